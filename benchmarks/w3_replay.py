"""W3 through the scheduler alone: the unit tests' FakeEngine plays the runner, a step costs a fixed time plus a
time per token (a cost model, not a measurement), and per-class TTFT (arrival -> the step that samples the first
token ends) comes out deterministic, free of the machine's noise. For comparing scheduling policies (run it on
two checkouts for before/after), not for absolute figures.

    .venv/bin/python benchmarks/w3_replay.py --config gpu --seeds 1 2     # 400 requests, closed loop of 128
    .venv/bin/python benchmarks/w3_replay.py --config cpu --seeds 1 2 3   # the sample dataset, Poisson
    --cap N (the server's --max-outranked-prefill-tokens; -1: no cap; default: the config's default)

gpu: qwen3-0.6b on the H200 as gpu_w3.sh runs it (pool 384 MiB = 380 pages of 9 tokens, 32 running, chunk 512,
budget 2048), step = 3.5 ms + 0.065 ms a token (a 270-token prefill step ~21 ms, a decode step ~4-5 ms, as the
first GPU run's log shows); prompts 128-384 tokens, 64 new, 70/20/10; TTFT counted after the first 128.
cpu: the bundled model as priority.py runs it (12 pages of 22 tokens, 4 running, chunk 64, budget 128), step =
52 ms + 2.8 ms a token (RESULTS.md), the sample dataset's prompts (~1.4 tokens a word), Poisson at 2.2 req/s.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tests.unit.test_scheduler import FakeEngine, make_request  # noqa: E402

CONFIGS = {
    "gpu": dict(num_pages=380, tokens_per_page=9, max_num_seqs=32, max_num_batched_tokens=2048,
                prefill_chunk_size=512, fixed_ms=3.5, per_token_ms=0.065),
    "cpu": dict(num_pages=12, tokens_per_page=22, max_num_seqs=4, max_num_batched_tokens=128,
                prefill_chunk_size=64, fixed_ms=52.0, per_token_ms=2.8),
}


def workload(config: str, rng: random.Random) -> list[tuple[float, object]]:
    """(arrival time, request); arrival -1 means "when a closed-loop slot frees up"."""
    if config == "gpu":
        priorities = [0] * 280 + [100] * 80 + [1000] * 40
        rng.shuffle(priorities)
        return [(-1.0, make_request(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randint(128, 384))], 64, p))
                for i, p in enumerate(priorities)]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample.jsonl")
    items = [json.loads(line) for line in open(path)]
    t, out = 0.0, []
    for i, item in enumerate(items):
        t += rng.expovariate(2.2)
        num_tokens = max(3, int(len(item["prompt"].split()) * 1.4)) + 3
        out.append((t, make_request(f"r{i}", [rng.randrange(1, 50) for _ in range(num_tokens)], item["max_tokens"],
                                    item["priority"])))
    return out


def replay(config: str, cap: int | None, seed: int) -> dict:
    c = CONFIGS[config]
    rng = random.Random(seed)
    kwargs = {} if cap is None else {"max_outranked_prefill_tokens": None if cap < 0 else cap}
    engine = FakeEngine(c["num_pages"], c["tokens_per_page"], host_pages=4000, max_num_seqs=c["max_num_seqs"],
                        max_num_batched_tokens=c["max_num_batched_tokens"],
                        prefill_chunk_size=c["prefill_chunk_size"], **kwargs)
    pending = workload(config, rng)
    closed = pending[0][0] < 0
    now, arrived, first, in_flight, steps = 0.0, {}, {}, set(), 0
    while pending or engine.scheduler.has_unfinished():
        while pending and (len(in_flight) < 128 if closed else pending[0][0] <= now):
            arrival, request = pending.pop(0)
            arrived[request.request_id] = now if closed else arrival
            engine.add(request)
            in_flight.add(request.request_id)
        if not engine.scheduler.has_unfinished():
            now = pending[0][0]
            continue
        plan = engine.step()
        steps += 1
        now += (c["fixed_ms"] + c["per_token_ms"] * plan.num_tokens) / 1000.0
        for chunk in plan.chunks:
            if chunk.sample and chunk.request_id not in first:
                first[chunk.request_id] = now
        in_flight = {r for r in in_flight if not engine.requests[r].status.name.startswith("FINISHED")}
    counted = list(engine.requests.values())[128 if closed else 0:]
    ttft = {}
    for priority in (1000, 100, 0):
        values = [1000.0 * (first[r.request_id] - arrived[r.request_id]) for r in counted if r.priority == priority]
        ttft[str(priority)] = {"p50_ms": round(float(np.percentile(values, 50)), 1),
                               "p99_ms": round(float(np.percentile(values, 99)), 1)}
    return {"config": config, "cap": cap, "seed": seed, "ttft": ttft, "preemptions": engine.scheduler.num_preemptions,
            "steps": steps, "end_s": round(now, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="gpu")
    p.add_argument("--cap", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    args = p.parse_args()
    for seed in args.seeds:
        print(json.dumps(replay(args.config, args.cap, seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
