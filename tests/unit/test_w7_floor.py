"""benchmarks/w7_floor.py: the roofline replay of a schedule counts each request's steps and bytes exactly."""
from __future__ import annotations

import pytest

from benchmarks.w7_floor import KV_BYTES_PER_TOKEN, WEIGHT_BYTES, replay


def test_one_request_is_a_prefill_step_then_a_decode_step_per_further_token():
    seconds, steps = replay([(4, 3)], max_num_seqs=8, budget=8192, kv_tokens=100, tflops=800, tb_s=2.0)
    assert steps == 3  # the prompt's step samples the first token; two decodes over 4, then 5 cached tokens
    assert seconds == pytest.approx((3 * WEIGHT_BYTES + (4 + 5) * KV_BYTES_PER_TOKEN) / 2e12)


def test_the_budget_and_the_sequence_cap_spread_admissions_over_steps():
    two = [(5, 1), (5, 1)]
    assert replay(two, max_num_seqs=2, budget=10, kv_tokens=100, tflops=800, tb_s=2.0)[1] == 1  # both in one step
    assert replay(two, max_num_seqs=1, budget=10, kv_tokens=100, tflops=800, tb_s=2.0)[1] == 2  # one at a time
    assert replay(two, max_num_seqs=2, budget=6, kv_tokens=100, tflops=800, tb_s=2.0)[1] == 2  # 5 + 1, then 4
    assert replay(two, max_num_seqs=2, budget=10, kv_tokens=9, tflops=800, tb_s=2.0)[1] == 2  # the pool holds one


def test_the_device_floor_takes_the_devices_figures_and_knows_only_those_it_names():
    from benchmarks.w7_floor import device_floor

    floor = device_floor("NVIDIA H200", [(4, 3)], max_num_seqs=8, budget=8192, kv_tokens=100)
    seconds = (3 * WEIGHT_BYTES + (4 + 5) * KV_BYTES_PER_TOKEN) / 4.8e12
    assert (floor["steps"], floor["tflops"], floor["tb_s"]) == (3, 800.0, 4.8)
    assert floor["out_tok_s"] == round(3 / seconds, 1)
    assert device_floor("cpu", [(4, 3)], max_num_seqs=8, budget=8192, kv_tokens=100) is None
