"""The int4 decode GEMV compiled for sm_90 on the CPU (Triton's bundled ptxas and cuobjdump; no GPU needed), in a
subprocess: the other kernel tests import the kernels under TRITON_INTERPRET=1, which compiles nothing. This
module does not import triton itself: imported here first, without TRITON_INTERPRET, it would stay compiled for
the interpreted tests collected after it."""
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

_COMPILE = r"""
import json, re, sys
sys.path.insert(0, ".")
from benchmarks.sass_count import compile_sm90, cuobjdump
from dflash2.kernels.triton import int4_gemv
types = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
         "nw_ptr": "*bf16", "eps": "fp32"}
result = {}
for l2_rows in (False, True):  # down's case: 16 rows, K over several steps, the residual add folded in
    constants = {"GS": 128, "BLOCK_M": 1, "BLOCK_N": 16, "CHUNKS": 128, "SPLIT_K": 1, "SILU_MUL": False,
                 "EVEN_M": True, "EVEN_N": True, "EVEN_K": False, "PREFETCH": True, "ASM": True, "PAIRED": False,
                 "SILU_OUT": False, "HALF2": True, "EARLY": True, "ADD_OUT": True, "ADD_EARLY": True,
                 "L2_ROWS": l2_rows}
    sass = cuobjdump(compile_sm90(int4_gemv._int4_gemv_kernel, types, constants, 4, 1), "-sass")
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)]
    result[str(l2_rows)] = {"prefetches": [i for i, op in enumerate(ops) if op.startswith("UBLKPF")],
                            "waits": [i for i, op in enumerate(ops) if op.startswith("ACQBULK")]}
print(json.dumps(result))
"""


def test_int4_gemv_asks_l2_for_its_rows_after_the_wait():
    """L2_ROWS (int4_gemv.L2_ROWS): a program whose K takes several steps issues two bulk L2 prefetches (its rows'
    words, their scales), after its PDL wait (griddepcontrol.wait: ACQBULK), so that they do not compete with
    the previous kernel's last loads; without it, none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["False"]["prefetches"] == []
    prefetches, waits = result["True"]["prefetches"], result["True"]["waits"]
    assert len(prefetches) == 2 and len(waits) == 1
    assert waits[0] < prefetches[0]
