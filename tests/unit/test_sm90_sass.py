"""Kernels compiled for sm_90 on the CPU (Triton's bundled ptxas and cuobjdump; no GPU needed), in a subprocess,
checking where their L2 prefetches sit against the PDL wait (griddepcontrol.wait: ACQBULK): the other kernel tests
import the kernels under TRITON_INTERPRET=1, which compiles nothing. This module does not import triton itself:
imported here first, without TRITON_INTERPRET, it would stay compiled for the interpreted tests collected after it."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PRELUDE = r"""
import json, re, sys
sys.path.insert(0, ".")
from benchmarks.sass_count import compile_sm90, cuobjdump


def positions(kernel, types, constants, num_warps, prefetch_op):
    sass = cuobjdump(compile_sm90(kernel, types, constants, num_warps, 1), "-sass")
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)]
    return {"prefetches": [i for i, op in enumerate(ops) if op.startswith(prefetch_op)],
            "waits": [i for i, op in enumerate(ops) if op.startswith("ACQBULK")],
            "fences": [i for i, op in enumerate(ops) if op.startswith("MEMBAR")],
            "atomics": [(i, op) for i, op in enumerate(ops) if op.startswith("ATOMG")]}
"""

_INT4_GEMV = r"""
from dflash2.kernels.triton import int4_gemv
types = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
         "nw_ptr": "*bf16", "eps": "fp32"}
result = {}
for prefetch in (False, True):  # down's case (K over several steps), 16 rows, the residual add folded in; or one step
    constants = {"GS": 128, "BLOCK_M": 1, "BLOCK_N": 16, "CHUNKS": 128, "SPLIT_K": 1, "SILU_MUL": False,
                 "EVEN_M": True, "EVEN_N": True, "EVEN_K": False, "PREFETCH": prefetch, "ASM": True, "PAIRED": False,
                 "SILU_OUT": False, "HALF2": True, "ADD_OUT": True, "ADD_EARLY": True}
    result[str(prefetch)] = positions(int4_gemv._int4_gemv_kernel, types, constants, 4, "UBLKPF")
print(json.dumps(result))
"""

_DECODE_ATTENTION = r"""
from dflash2.kernels.triton import attention
types = {"q_ptr": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "k_scales": "*fp16", "v_scales": "*fp16",
         "page_table": "*i32", "slots": "*i32", "lengths": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32",
         "final_ptr": "*bf16", "cnt_ptr": "*i32", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "cos_ptr": "*bf16",
         "sin_ptr": "*bf16", "scale": "fp32"}
result = {}
for lines in (0, 2):  # the short graph's launch on llama-3-8b's bf16 cache: 4 splits of 128 tokens, 4 warps
    constants = {"GROUP": 4, "GROUP_PAD": 16, "GROUP_P2": 4, "HEAD_DIM": 128, "BLOCK_N": 128, "NUM_SPLITS": 4,
                 "SPLITS_PAD": 4, "PRECISION": "tf32", "KIND": 0, "INT8_LOOP": "", "INT8_SUB": 1, "ROTARY": True,
                 "KV_PREFETCH_LINES": lines}
    result[str(lines)] = positions(attention._decode_split_kernel, types, constants, 4, "CCTL.E.PF2")
print(json.dumps(result))
"""

_ARGMAX = r"""
from dflash2.kernels.triton import step_edges
types = {"x_ptr": "*bf16", "best_v_ptr": "*fp32", "best_i_ptr": "*i32", "cnt_ptr": "*i32", "out_ptr": "*i64",
         "future_ptr": "*i64", "base_ptr": "*i64"}
constants = {"CHUNKS": 32, "CHUNKS_PAD": 32, "BLOCK": 4096, "FUTURE": True}
print(json.dumps(positions(step_edges._argmax_kernel, types, constants, 4, "CCTL.E.PF2")))
"""


# The kernels that fold a decoder layer's norms and residual adds (models/llama.py fuses_norms) and Qwen3's q/k
# norms (decode attention's QK_NORM), as a one-row step of qwen3-30b-a3b in bf16 launches them
_FOLDED = r"""
from dflash2.kernels.triton import attention, fused_moe_small, int4_gemv, moe_router, quant_matmul
bf, f32 = "*bf16", "*fp32"
result = {}
gemv_types = {"x_ptr": bf, "w_ptr": bf, "hi_ptr": bf, "s_ptr": bf, "z_ptr": bf, "out_ptr": bf, "ws_ptr": f32,
              "cnt_ptr": "*i32", "nw_ptr": bf, "eps": "fp32"}
gemv = {"BITS": 16, "GS": 512, "T": 1, "BLOCK_M": 1, "BLOCK_N": 4, "SPLIT_K": 1, "WORDS": False}
result["gemv_norm"] = positions(quant_matmul._gemv_kernel, gemv_types, {**gemv, "SILU_MUL": False, "NORM": True},
                                4, "UBLKPF")
result["gemv_add"] = positions(quant_matmul._gemv_kernel, gemv_types, {**gemv, "SILU_MUL": True, "ADD_OUT": True},
                               4, "UBLKPF")
router_types = {"x_ptr": bf, "w_ptr": bf, "ws_ptr": f32, "cnt_ptr": "*i32", "weights_ptr": bf, "ids_ptr": "*i64",
                "nw_ptr": bf, "eps": "fp32", "h_ptr": bf}
result["router_norm"] = positions(moe_router._route_small_kernel, router_types,
                                  {"TOP_K": 8, "K_PAD": 8, "NORM": True, "E_PAD": 128, "BLOCK_E": 2, "BLOCK_H": 2048,
                                   "ONE_PASS": True, "RMS_NORM": True}, 4, "UBLKPF")
down_types = {"hidden_ptr": bf, "w_ptr": bf, "s_ptr": bf, "z_ptr": bf, "out_ptr": bf, "ws_ptr": f32,
              "cnt_ptr": "*i32", "ids_ptr": "*i64", "router_ptr": bf}
result["experts_down_add"] = positions(fused_moe_small._small_down_kernel, down_types,
                                       {"TOP_K": 8, "BITS": 16, "GROUP": 1, "GS": 128, "T": 1, "BLOCK_N": 32,
                                        "SPLIT_K": 2, "ADD_OUT": True}, 4, "UBLKPF")
attention_types = {"q_ptr": bf, "k_cache": bf, "v_cache": bf, "k_scales": "*fp16", "v_scales": "*fp16",
                   "page_table": "*i32", "slots": "*i32", "lengths": "*i32", "out_ptr": f32, "lse_ptr": f32,
                   "final_ptr": bf, "cnt_ptr": "*i32", "k_new_ptr": bf, "v_new_ptr": bf, "cos_ptr": bf,
                   "sin_ptr": bf, "q_norm_w": bf, "k_norm_w": bf, "norm_eps": "fp32", "scale": "fp32"}
result["attention_qk_norm"] = positions(attention._decode_split_kernel, attention_types,
                                        {"GROUP": 8, "GROUP_PAD": 16, "GROUP_P2": 8, "HEAD_DIM": 128, "BLOCK_N": 128,
                                         "NUM_SPLITS": 4, "SPLITS_PAD": 4, "PRECISION": "tf32", "KIND": 0,
                                         "INT8_LOOP": "", "INT8_SUB": 1, "ROTARY": True, "QK_NORM": True,
                                         "KV_PREFETCH_LINES": 2}, 4, "CCTL.E.PF2")
int4_types = {"x_ptr": bf, "w_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": bf, "ws_ptr": f32, "cnt_ptr": "*i32",
              "nw_ptr": bf, "eps": "fp32"}
result["int4_gemv_norm"] = positions(int4_gemv._int4_gemv_kernel, int4_types,
                                     {"GS": 128, "BLOCK_M": 1, "BLOCK_N": 16, "CHUNKS": 64, "SPLIT_K": 1,
                                      "SILU_MUL": False, "EVEN_M": True, "EVEN_N": True, "EVEN_K": True,
                                      "PREFETCH": False, "ASM": True, "PAIRED": True, "SILU_OUT": True, "HALF2": True,
                                      "NORM": True, "ONE_STEP": True}, 4, "UBLKPF")
print(json.dumps(result))
"""

def _compiled(script: str) -> dict:
    """What `script` (after _PRELUDE) prints last, as JSON, run without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PRELUDE + script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_int4_gemv_asks_l2_for_its_rows_after_the_wait():
    """A program whose K takes several steps (PREFETCH, SPLIT_K 1) issues two bulk L2 prefetches (its rows' words,
    their scales), after its PDL wait (griddepcontrol.wait: ACQBULK), so that they do not compete with the
    previous kernel's last loads; with one step, none."""
    result = _compiled(_INT4_GEMV)
    assert result["False"]["prefetches"] == []
    prefetches, waits = result["True"]["prefetches"], result["True"]["waits"]
    assert len(prefetches) == 2 and len(waits) == 1
    assert waits[0] < prefetches[0]


def test_decode_attention_asks_l2_for_its_first_kv_tile_before_the_wait():
    """KV_PREFETCH_LINES (the short graph's SHORT_CONFIG KV_PREFETCH): the first tile's K and V lines are asked of
    L2 (prefetch.global.L2: CCTL.E.PF2) before the PDL wait, while the qkv GEMV before still runs: 128 tokens x
    2 lines x K and V over 128 threads, 4 instructions a thread; without it, none."""
    result = _compiled(_DECODE_ATTENTION)
    assert result["0"]["prefetches"] == []
    prefetches, waits = result["2"]["prefetches"], result["2"]["waits"]
    assert len(prefetches) == 4 and len(waits) == 1
    assert prefetches[-1] < waits[0]


@pytest.mark.parametrize("kernel", ["decode attention", "argmax"])
def test_ticket_counters_reset_without_a_fence(kernel):
    """The last program of a ticket (decode attention's merge, the greedy argmax's last chunk) resets its counter with
    a relaxed atomic: the one fence (MEMBAR) in the kernel is the ticket's own release, right before its ATOMG.ADD; the
    reset's ATOMG.EXCH has none before it, so the program does not wait for its output stores' acknowledgements."""
    result = _compiled(_DECODE_ATTENTION)["2"] if kernel == "decode attention" else _compiled(_ARGMAX)
    ops = [op for _, op in result["atomics"]]
    assert len(ops) == 2 and ops[0].startswith("ATOMG.E.ADD") and ops[1].startswith("ATOMG.E.EXCH")
    (ticket, _), _ = result["atomics"]
    assert len(result["fences"]) == 1 and 0 < ticket - result["fences"][0] <= 4


def test_the_folded_kernels_compile_for_sm90():
    """The 16-bit GEMV with the RMSNorm (qkv) and with the residual add on a [gate | up] input (down), the router
    with the norm, the experts' down kernel adding into the stream, decode attention with the q/k norms and the
    int4 GEMV with the norm compile for sm_90 (the interpreter compiles nothing), each with its one PDL wait; those
    with tickets keep the release right before the ticket and reset without a fence."""
    result = _compiled(_FOLDED)
    assert sorted(result) == ["attention_qk_norm", "experts_down_add", "gemv_add", "gemv_norm", "int4_gemv_norm",
                              "router_norm"]
    for name, kernel in result.items():
        assert len(kernel["waits"]) == 1, name
        if kernel["atomics"]:
            (ticket, add), (_, reset) = kernel["atomics"]
            assert add.startswith("ATOMG.E.ADD") and reset.startswith("ATOMG.E.EXCH"), name
            assert len(kernel["fences"]) == 1 and 0 < ticket - kernel["fences"][0] <= 4, name
