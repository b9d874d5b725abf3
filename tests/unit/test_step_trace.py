"""DFLASH2_STEP_TRACE: one JSON line per step, whose shapes add up to the work the engine did."""
from __future__ import annotations

import json

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.engine.step_trace import ENV
from tests.engine_runs import run_with_urgent_arrivals
from tests.tiny_models import random_prompts as prompts

PAGE_BYTES = 2048  # tiny llama: 512 bytes a token in float32 -> 4 tokens a page


@pytest.mark.parametrize("overlap", [False, True])
def test_step_trace_records_every_step_of_a_preempting_run(tiny_llama, tmp_path, monkeypatch, overlap):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV, str(path))
    llm = LLM(tiny_llama, page_bytes=PAGE_BYTES, kv_cache_memory=16 * PAGE_BYTES, max_num_batched_tokens=64,
              max_model_len=60, max_num_seqs=4, swap_space=f"{64 * PAGE_BYTES}B", overlap=overlap,
              enable_prefix_caching=False)  # swaps only: no prefix-cache pages copied down to host memory
    engine = llm.engine
    low, high = prompts(4, seed=21), prompts(3, seed=22)
    params = SamplingParams(max_tokens=14, min_tokens=14, temperature=0)
    run_with_urgent_arrivals(engine, low, high, params, steps_before=4)
    records = [json.loads(line) for line in path.read_text().splitlines()]

    # every token the model computed is in exactly one step: each prompt once (swapped, not recomputed) and
    # every output token but the last fed back once
    assert engine.scheduler.num_swap_outs > 0
    assert sum(r["prefill_tokens"] + r["decodes"] for r in records) == sum(len(p) + 13 for p in low + high)
    assert sum(r["swap_out_pages"] for r in records) == sum(r["swap_in_pages"] for r in records) > 0
    assert sum(r["preempted"] for r in records) == engine.scheduler.num_swap_outs
    assert [r["top_priority"] for r in records[:4]] == [0] * 4  # before the urgent arrivals
    assert max(r["first_token_priority"] or 0 for r in records) == 1000
    assert all(r["device_ms"] is None for r in records)  # CPU: no device clock
    assert all(r["compiled"] == [] and "alloc_retries" not in r for r in records)  # the CPU path runs no Triton
    assert all(r[key] >= 0 for r in records for key in ("plan_ms", "launch_ms", "finish_ms"))
    assert [r["t_ms"] for r in records] == sorted(r["t_ms"] for r in records)
    # each prompt's last chunk samples once (nothing recomputed), named by its request id
    sampled = [request_id for r in records for request_id in r["sampling_prefills"]]
    assert len(sampled) == len(set(sampled)) == len(low) + len(high)
    assert all(r["mono_s"] <= r["done_mono_s"] for r in records)
    assert [r["mono_s"] for r in records] == sorted(r["mono_s"] for r in records)


def test_triton_compiles_reach_every_open_trace_and_the_hook_set_before(tmp_path, monkeypatch):
    from triton import knobs

    from dflash2.engine import step_trace

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kwargs: seen.append(kwargs["repr"]))
    monkeypatch.setattr(step_trace, "_COMPILE_SINKS", [])
    first = step_trace.StepTrace(str(tmp_path / "a.jsonl"), torch.device("cpu"))
    second = step_trace.StepTrace(str(tmp_path / "b.jsonl"), torch.device("cpu"))
    norm, argmax = "_rms_norm_kernel[num_warps=4](n_rows: i32)", "_argmax_kernel[num_warps=4](n: i32)"
    # as Triton 3.6 calls it: the constants and the specializations inside `compile`
    assert knobs.runtime.jit_cache_hook(repr=norm, compile={"constants": {(4,): 128},
                                                            "configs": [{(0,): [["tt.divisibility", 16]]}]}) is None
    first.close()
    knobs.runtime.jit_cache_hook(repr=argmax)
    assert seen == [norm, argmax]
    compiled_norm = f"{norm} constants={{(4,): 128}} attrs={{(0,): [['tt.divisibility', 16]]}}"
    assert first.compiled == [compiled_norm]
    assert second.compiled == [compiled_norm, f"{argmax} constants=None attrs=None"]
    second.close()


def test_no_trace_without_the_variable(tiny_llama, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert LLM(tiny_llama, page_bytes=PAGE_BYTES, max_model_len=60).engine.trace is None


def test_the_report_groups_steps_by_kind():
    from benchmarks.step_trace_report import summarize

    def step(t, tokens, decodes, swaps=0, first=None, device=None):
        return {"t_ms": t, "plan_ms": 0.5, "launch_ms": 1.0, "finish_ms": 0.25, "device_ms": device,
                "decodes": decodes, "prefill_chunks": int(tokens > 0), "prefill_tokens": tokens,
                "swap_out_pages": swaps, "swap_in_pages": 0, "preempted": 0, "top_priority": 0,
                "first_token_priority": first}

    report = summarize([step(0.0, 0, 4, device=2.0), step(3.0, 300, 4, swaps=2, first=1000, device=4.0),
                        step(10.0, 2048, 0, first=0, device=8.0)])
    assert {name: entry["steps"] for name, entry in report.items()} == {
        "all": 3, "decode_only": 1, "prefill_le_1024": 1, "with_swaps": 1, "urgent_first_token": 1,
        "prefill_over_1024": 1}
    assert report["all"]["device_ms"] == {"p50": 4.0, "p99": 7.92, "max": 8.0}
    assert report["all"]["gap_ms"] == {"p50": 3.5, "p99": 5.46, "max": 5.5}  # 3 - 0 - 1.5, 10 - 3 - 1.5; last: none
    assert report["urgent_first_token"]["launch_ms"] == {"p50": 1.0, "p99": 1.0, "max": 1.0}


def test_urgent_waits_splits_a_first_token_wait_at_its_step():
    from benchmarks.w3_urgent_waits import urgent_waits

    def step(planned, done, ids=(), prefill=0, device=None):
        return {"mono_s": planned, "done_mono_s": done, "plan_ms": 0.2, "launch_ms": 0.3, "finish_ms": 0.1,
                "device_ms": device, "decodes": 4, "prefill_tokens": prefill, "swap_out_pages": 0, "swap_in_pages": 0,
                "sampling_prefills": list(ids)}

    steps = [step(9.990, 9.995), step(9.998, 10.003, prefill=512), step(10.0032, 10.0055, ids=["u"], prefill=256)]
    requests = [{"request_id": "u", "priority": 1000, "ttft_ms": 6.0, "received_monotonic": 9.9995, "http_in_ms": 0.5},
                {"request_id": "b", "priority": 0, "ttft_ms": 9.0, "received_monotonic": 9.9995, "http_in_ms": 0.5}]
    report = urgent_waits(requests, steps, priority=1000)
    assert report["requests"] == 1
    slowest = report["slowest"][0]
    assert {k: slowest[k] for k in ("to_plan_ms", "launch_ms", "to_done_ms", "deliver_ms", "steps_ahead")} == {
        "to_plan_ms": 3.2, "launch_ms": 0.5, "to_done_ms": 1.7, "deliver_ms": 0.6, "steps_ahead": 1}
    assert [s["prefill_tokens"] for s in slowest["steps"]] == [512, 256] and slowest["steps"][1]["own"]
    assert report["steps_ahead_by_kind"] == {"with_prefill": 1}
    assert "own_device_ms" not in report  # a CPU trace has no device times
    steps[-1] = step(10.0032, 10.0055, ids=["u"], prefill=256, device=2.25)
    assert urgent_waits(requests, steps, priority=1000)["own_device_ms"] == {"p50": 2.25, "p90": 2.25, "p99": 2.25,
                                                                           "max": 2.25}


def test_host_gaps_count_the_host_idle_before_each_plan():
    from benchmarks.w3_urgent_waits import host_gaps

    def step(planned, done):  # plan 0.2 + launch 0.3 ms
        return {"mono_s": planned, "done_mono_s": done, "plan_ms": 0.2, "launch_ms": 0.3}

    # second plan: 0.5 ms after the first's results (which came after its launch); third: 4 ms after the
    # second's launch (a stall: nothing came in between); the last is outside the window
    steps = [step(1.000, 1.002), step(1.0025, 1.009), step(1.0070, 1.010), step(2.0, 2.001)]
    report = host_gaps(steps, 1.0, 1.5)
    assert report["steps"] == 2 and report["max_ms"] == 4.0 and report["over_3.5_ms"] == 1
    assert report["over_2_ms"] == 1 and report["p50_ms"] == 2.25
