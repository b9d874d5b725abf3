"""Device kernel times from a torch.profiler run (decode_profile.py, latency.py --profile, throughput.py
--profile): each kernel's total and its exposed time.

Exposed time: kernels in start order, each one is charged for how far it moves the latest end seen so far
(max(0, end - latest end)). The charges sum to the time the device was busy (the union of the kernels'
intervals); a kernel that runs entirely under another one, as programmatic dependent launch lets a kernel's
early part do, is charged nothing.
"""
from __future__ import annotations

import json
from collections import defaultdict


def kernel_events(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device kernel of a profile, in start order."""
    import torch

    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)


def _per_step(totals: dict[str, float], key: str, steps: int, **extra: dict[str, float]) -> list[dict]:
    rows = [{"kernel": name[:90], **{k: round(v[name] / steps, 2) for k, v in extra.items()},
             key: round(us / steps, 1)} for name, us in totals.items()]
    return sorted(rows, key=lambda r: -r[key])


def kernel_table(events: list[tuple[float, float, str]], steps: int) -> list[dict]:
    """Each kernel's calls and microseconds per step, largest first."""
    total_us: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    for start, end, name in events:
        total_us[name] += end - start
        calls[name] += 1
    return _per_step(total_us, "us_per_step", steps, calls_per_step=calls)


def exposed_table(events: list[tuple[float, float, str]], steps: int) -> tuple[list[dict], float]:
    """Each kernel's exposed microseconds per step (module docstring), largest first, and their sum: the busy
    microseconds per step."""
    exposed: dict[str, float] = defaultdict(float)
    latest = None
    for start, end, name in events:
        if latest is None:
            latest = start
        exposed[name] += max(0.0, end - max(latest, start))
        latest = max(latest, end)
    return _per_step(exposed, "exposed_us_per_step", steps), round(sum(exposed.values()) / steps, 1)


def write_timeline(events: list[tuple[float, float, str]], steps: int, path: str, last_steps: int = 1) -> None:
    """The last `last_steps` steps' kernels and copies as JSON lines, start and end in us from the first one written
    (the events split into `steps` equal runs: every step launches the same ones)."""
    last = events[-(len(events) // steps) * last_steps:]
    origin = last[0][0]
    with open(path, "w") as f:
        for start, end, name in last:
            f.write(json.dumps({"kernel": name[:60], "start_us": round(start - origin, 2),
                                "end_us": round(end - origin, 2)}) + "\n")
