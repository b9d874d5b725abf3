"""Does programmatic dependent launch take effect between two kernels, and where in a CUDA graph? (GPU only.)

W2's step graph starts with the embedding lookup, and the first layer's qkv GEMV (launched with PDL, like every
kernel of the step) starts only after the lookup has ended, while every later GEMV starts before its predecessor
ends (twenty-fifth session's timelines). This probe times two kernels with the GPU's own clock (%globaltimer):
the primary lets dependents launch right away, then spins SPIN_NS; the secondary stamps its entry before its wait.
A secondary that enters before the primary's end was launched early. Cases: eager; a graph whose primary is its
root; the same behind a host-to-device copy inside the graph; the same behind another PDL kernel; the primary
launched without PDL; a primary of 1 us at the root; and a step's boundary as the engine queues it (the previous
step's graph, the input copy outside any graph, then the graph of the pair with a 1 us primary). Prints JSON: per
case, the secondary's entry and its wait's return, in us after the primary's end (negative: early), medians of
REPEATS replays.

Twenty-sixth session, call 1 (the first five cases): eager +12.16 us; in a graph -4.64 us at the root, behind a
copy and behind another PDL kernel alike; +0.51 with the primary launched without PDL. Twenty-seventh session, call
1: a 1 us primary at the root -0.64 (wait return +0.35), and the same behind another graph and a copy outside both,
as the step's lookup is, -0.64 (+0.35). So the early launch works at the step's boundary here too, and why the W2
step's first qkv starts 1.1-1.6 us after the lookup ends (its timelines) is not the graph's structure.

    python3 benchmarks/pdl_edge_probe.py
"""
from __future__ import annotations

import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

SPIN_NS = 5000
REPEATS = 50


@triton.jit
def _now(order):
    """The GPU's nanosecond clock; `order` (any int32 scalar) only gives the asm an operand."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [order], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _primary(stamps, spin_ns, USE_PDL: tl.constexpr):
    """stamps[0]: entry, stamps[1]: end (program 0)."""
    start = _now(tl.program_id(0))
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    now = _now(tl.program_id(0))
    while now - start < spin_ns:
        now = _now(tl.program_id(0))
    if tl.program_id(0) == 0:
        tl.store(stamps, start)
        tl.store(stamps + 1, now)


@triton.jit
def _secondary(stamps, USE_PDL: tl.constexpr):
    """stamps[2]: entry (before the wait), stamps[3]: the wait's return (program 0)."""
    entry = _now(tl.program_id(0))
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    waited = _now(tl.program_id(0))
    if tl.program_id(0) == 0:
        tl.store(stamps + 2, entry)
        tl.store(stamps + 3, waited)


class _Probe:
    """The probe's buffers: the four stamps, a spare stamp block for the kernel placed before the pair, and a
    host-to-device copy's source and target."""

    def __init__(self) -> None:
        self.stamps = torch.zeros(4, dtype=torch.int64, device="cuda")
        self.spare = torch.zeros(4, dtype=torch.int64, device="cuda")
        self.host = torch.zeros(1 << 16, dtype=torch.int32).pin_memory()
        self.scratch = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")

    def pair(self, primary_pdl: bool = True, before: str = "", spin_ns: int = SPIN_NS) -> None:
        """The primary and the secondary, behind a copy or another PDL kernel where `before` says."""
        if before == "copy":
            self.scratch.copy_(self.host, non_blocking=True)
        elif before == "kernel":
            _secondary[(1,)](self.spare, USE_PDL=True, launch_pdl=True)
        _primary[(4,)](self.stamps, spin_ns, USE_PDL=primary_pdl, launch_pdl=primary_pdl)
        _secondary[(132,)](self.stamps, USE_PDL=True, launch_pdl=True)

    def previous_step(self) -> None:
        """A stand-in for the step before (a graph of its own): one kernel spinning SPIN_NS, stamping `spare`."""
        _primary[(4,)](self.spare, SPIN_NS, USE_PDL=False, launch_pdl=False)

    def measure(self, run) -> dict[str, float]:
        """Medians over REPEATS runs of the secondary's entry and wait return, us after the primary's end."""
        entries, waits = [], []
        for _ in range(REPEATS):
            run()
            torch.cuda.synchronize()
            _, primary_end, entry, waited = self.stamps.tolist()
            entries.append((entry - primary_end) / 1000.0)
            waits.append((waited - primary_end) / 1000.0)
        return {"secondary_entry_us_after_primary_end": round(statistics.median(entries), 2),
                "secondary_wait_return_us_after_primary_end": round(statistics.median(waits), 2)}


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("pdl_edge_probe.py needs a CUDA GPU of compute capability 9.0 or newer")
    probe = _Probe()
    cases = {"eager": {}, "graph, primary at the root": {}, "graph, behind a host-to-device copy": {"before": "copy"},
             "graph, behind another PDL kernel": {"before": "kernel"},
             "graph, primary launched without PDL": {"primary_pdl": False},
             "graph, a 1 us primary at the root": {"spin_ns": 1000},
             # a decode step's boundary (twenty-sixth session's timelines): the previous step's graph, the input
             # copy queued outside any graph, then this step's graph, whose root is a short kernel (the lookup)
             "graph behind another graph and a copy outside both, a 1 us primary": {"spin_ns": 1000}}
    previous = torch.cuda.CUDAGraph()
    probe.previous_step()
    torch.cuda.synchronize()
    with torch.cuda.graph(previous):
        probe.previous_step()
    report = {}
    for name, kwargs in cases.items():
        probe.pair(**kwargs)  # compile and warm up
        torch.cuda.synchronize()
        if name == "eager":
            report[name] = probe.measure(lambda: probe.pair(**kwargs))
            continue
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            probe.pair(**kwargs)
        if name.startswith("graph behind another graph"):
            def boundary(graph=graph) -> None:
                previous.replay()
                probe.scratch.copy_(probe.host, non_blocking=True)
                graph.replay()
            report[name] = probe.measure(boundary)
        else:
            report[name] = probe.measure(graph.replay)
    print(json.dumps({"spin_ns": SPIN_NS, "repeats": REPEATS, "cases": report}, indent=1))


if __name__ == "__main__":
    main()
