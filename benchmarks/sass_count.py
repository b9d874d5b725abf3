"""Compile the hot Triton kernels for sm_90 on this machine (no GPU needed) and count the instructions of their
main loop per element it processes: a proxy for whether a kernel can keep up with HBM on an H200.

    .venv/bin/python benchmarks/sass_count.py [--gemv-only]   (JSON lines; CPU only, needs triton's ptxas;
                                                              --gemv-only: skip the decode-attention loops)

The int4 GEMVs of a llama-3-8b decode step are also compiled as the engine launches them (engine_int4_reports:
their configs, the launcher's constants, M = 1 and the shapes' integers specialized as at launch), with their
registers and spill instructions: what decides how many programs fit an SM.

At full bandwidth (~4 TB/s) an H200 issues about 33e12 thread-instructions a second, so a kernel streaming
B bytes an element stays memory-bound only below ~8 B instructions an element (bf16 KV: ~16; int8 KV: ~8;
int4 weights at 0.5 B: ~4). Compiling also catches what TRITON_INTERPRET=1 does not (types the compiler
rejects, code after a return inside a constexpr branch). Pointers and strides are declared divisible by 16, as
Triton specializes them at launch.
"""
from __future__ import annotations

import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dflash2.kernels.triton import attention as attn  # noqa: E402
from dflash2.kernels.triton import int4_configs, int4_gemv, quant_matmul  # noqa: E402
from dflash2.kernels.triton.int8_decode import int8_sub_tiles  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_sm90(kernel, types: dict[str, str], constants: dict, num_warps: int, num_stages: int,
                 values: dict[str, int] | None = None, maxnreg: int | None = None):
    """values: integer arguments as a launch passes them, specialized as Triton's launcher does (a 1 becomes a
    constant, a multiple of 16 is declared divisible by 16). The register count depends on it: the persistent
    int4 GEMV on gate_up compiles to 96 registers with M left open but to 127 with M = 1 (nineteenth session).
    Without values, pointers and strides are declared divisible and every other integer is left open."""
    parameters = inspect.signature(kernel.fn).parameters
    names = list(parameters)
    defaults = {n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty}
    constants = {**defaults, **constants}  # constexpr parameters with defaults (HALF2, NORM) as the launcher's
    if "USE_PDL" in names:  # programmatic dependent launch as on the H200 (kernels/triton/pdl.py)
        constants = {"USE_PDL": True, **constants}
    values = values or {}
    constants = {**constants, **{n: 1 for n, v in values.items() if v == 1}}
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}

    def divisible(name: str) -> bool:
        if signature[name].startswith("*"):
            return True
        return values[name] % 16 == 0 if name in values else name.startswith("stride")

    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constants and divisible(n)}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(source, target=TARGET, options=options)


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instructions of the longest backward-branch loop in a kernel's SASS (cuobjdump -sass), and their opcodes."""
    instructions = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*);", line)
        if m:
            instructions.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best: list = []
    for address, op, rest in instructions:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            body = [i for i in instructions if int(target.group(1), 16) <= i[0] <= address]
            best = body if len(body) > len(best) else best
    return len(best), collections.Counter(op.split(".")[0] for _, op, _ in best)


def cuobjdump(compiled, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([CUOBJDUMP, flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def report(name: str, kernel, types: dict, constants: dict, elements_per_iteration: int, num_warps: int = 4,
           num_stages: int = 2, values: dict[str, int] | None = None, maxnreg: int | None = None) -> None:
    compiled = compile_sm90(kernel, types, constants, num_warps, num_stages, values, maxnreg)
    sass = cuobjdump(compiled, "-sass")
    count, mix = loop_mix(sass)
    registers = re.search(r"REG:(\d+)", cuobjdump(compiled, "-res-usage"))
    print(json.dumps({"kernel": name, "loop_instructions": count,
                      "per_element": round(count * 32 * num_warps / elements_per_iteration, 2),
                      "registers": int(registers.group(1)) if registers else None,
                      "spill_instructions": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
                      "shared_memory_in_loop": any(mix[op] for op in ("STS", "LDS", "BAR", "LDSM")),
                      "top": dict(mix.most_common(8))}), flush=True)


def decode_reports() -> None:
    """The decode loop per KV kind at BLOCK_N 32 / 4 warps (comparable across kinds and with earlier counts), then
    at the configs decode_attention takes (DECODE_CONFIG; DECODE_CONFIGS["int8-<loop>"], else DECODE_CONFIG); int8 in each of its loops
    (INT8_LOOP: "imma_t", per-warp transposed integer q.K; "legacy", the
    fp16-dequantizing one), then the int8 loops over the BLOCK_N / warps grid benchmarks/tune_decode.py tries."""
    def int8(loop: str) -> dict:
        return attn.DECODE_CONFIGS.get(f"int8-{loop}", attn.DECODE_CONFIG)

    cases = [(0, "*bf16", None, None), (1, "*i8", "imma_t", None), (1, "*i8", "legacy", None),
             (3, "*fp8e4nv", None, None),
             (0, "*bf16", None, attn.DECODE_CONFIG), (1, "*i8", "imma_t", int8("imma_t")),
             (1, "*i8", "legacy", int8("legacy"))]
    cases += [(1, "*i8", loop, {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": 2})
              for block_n in (32, 64, 128) for num_warps in (2, 4) for loop in ("imma_t",)
              if (block_n, num_warps) != (int8(loop)["BLOCK_N"], int8(loop)["num_warps"])]
    for kind, cache, loop, config in cases:
        config = config or {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
        types = {"q_ptr": "*bf16", "k_cache": cache, "v_cache": cache, "k_scales": "*fp16", "v_scales": "*fp16",
                 "page_table": "*i32", "slots": "*i32", "lengths": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32",
                 "final_ptr": "*bf16", "cnt_ptr": "*i32", "scale": "fp32"}
        block_n, num_warps = config["BLOCK_N"], config["num_warps"]
        constants = {"GROUP": 2, "GROUP_PAD": 2 if loop == "imma_t" else 16, "HEAD_DIM": 128, "BLOCK_N": block_n,
                     "NUM_SPLITS": 4, "SPLITS_PAD": 4, "GROUP_P2": 2, "PRECISION": "tf32", "KIND": kind,
                     "INT8_LOOP": loop or "", "INT8_SUB": int8_sub_tiles(block_n, num_warps)}
        report(f"decode attention, KV kind {kind}{f', {loop} loop' if loop else ''}, BLOCK_N {block_n}, "
               f"{num_warps} warps (per K+V element)", attn._decode_split_kernel, types, constants,
               elements_per_iteration=block_n * 128 * 2, num_warps=num_warps, num_stages=config["num_stages"])


# llama-3-8b's decode GEMVs as the int4 engine launches them at one row: (name, N, K, what is folded in)
LLAMA3_8B_INT4_LAYERS = [("qkv", 6144, 4096, "norm"), ("o_proj", 4096, 4096, "add"),
                         ("gate_up", 28672, 4096, "norm+silu_out"), ("down", 4096, 14336, "add"),
                         ("lm_head", 128256, 4096, "")]


def engine_int4_reports() -> None:
    """The int4 GEMVs of a llama-3-8b decode step at their engine configs (int4_configs, half2 products, M = 1),
    with the constants int4_gemv's launcher sets and the integers specialized as a launch specializes them."""
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32",
             "cnt_ptr": "*i32", "nw_ptr": "*bf16", "eps": "fp32"}
    for name, n, k, fused in LLAMA3_8B_INT4_LAYERS:
        config = int4_configs.int4_config(n, k, 1, half2=True)
        weight = {"n": n, "k": k, "group_size": 128, "half2": True, "paired": "silu_out" in fused}
        constants = int4_gemv.launch_constants(weight, 1, config, silu_out="silu_out" in fused, norm="norm" in fused,
                                               add_out=fused == "add", out_settled=fused == "add")
        options = {key: constants.pop(key) for key in ("num_warps", "num_stages", "maxnreg") if key in constants}
        kernel = int4_gemv._int4_gemv_persistent_kernel if config.get("PERSISTENT") else int4_gemv._int4_gemv_kernel
        values = {"M": 1, "N": n, "K": k, "stride_xm": k, "stride_wn": k // 8, "stride_sn": k // 128,
                  "stride_om": n // 2 if "silu_out" in fused else n}
        report(f"int4 GEMV as the engine runs llama-3-8b's {name} (N {n}, K {k}{', ' + fused if fused else ''}), "
               f"M=1, {config} (per weight)", kernel, types, constants,
               elements_per_iteration=config["BLOCK_N"] * config["CHUNKS"] * 32, values=values, **options)


def int4_gemm_reports() -> None:
    """The int4 prefill GEMM at its default tile (64 weight rows x 128 activation rows x 128 columns, 3 stages)."""
    from dflash2.kernels.triton import int4_gemm

    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "out_ptr": "*bf16",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    constants = {"GS": 128, "T": 1, "BLOCK_N": 64, "BLOCK_M": 128, "SPLIT_K": 1, "EVEN_K": True, "IEEE": False,
                 "ASM": True}
    report("int4 GEMM 64 x 128 x 128 (per weight of a 128-row block)", int4_gemm._int4_gemm_kernel, types, constants,
           elements_per_iteration=64 * 128, num_warps=4, num_stages=3)


def main() -> None:
    if "--gemv-only" not in sys.argv:
        decode_reports()
    engine_int4_reports()
    int4_gemm_reports()
    gemv_types = {"x_ptr": "*bf16", "hi_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16", "out_ptr": "*bf16",
                  "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    for bits, weight, block_n, gs, t, words in ((16, "*bf16", 8, 512, 1, False), (8, "*i32", 8, 512, 1, True)):
        constants = {"BITS": bits, "GS": gs, "T": t, "BLOCK_M": 1, "BLOCK_N": block_n, "SPLIT_K": 1,
                     "SILU_MUL": False, "WORDS": words}
        report(f"GEMV {bits}-bit, M=1 (per weight)", quant_matmul._gemv_kernel, {**gemv_types, "w_ptr": weight},
               constants, elements_per_iteration=block_n * gs * t)
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32",
             "cnt_ptr": "*i32", "nw_ptr": "*bf16", "eps": "fp32"}
    # half2: packed fp16 products (16-bit models); else float32 ones (float32 models)
    for half2 in (False, True):
        for block_m, config in sorted(int4_configs.INT4_GEMV_CONFIGS.items()):
            for block_n in sorted({config["BLOCK_N"], 2 * config["BLOCK_N"]} if block_m == 1 else {config["BLOCK_N"]}):
                constants = {"GS": 128, "BLOCK_M": block_m, "BLOCK_N": block_n, "CHUNKS": config["CHUNKS"],
                             "SPLIT_K": 1, "SILU_MUL": False, "EVEN_M": True, "EVEN_N": True, "EVEN_K": True,
                             "PREFETCH": False, "ASM": True, "PAIRED": False, "SILU_OUT": False, "HALF2": half2}
                products = ", half2" if half2 else ""
                report(f"int4 GEMV, repacked{products}, M={block_m}, BLOCK_N={block_n} (per weight)",
                       int4_gemv._int4_gemv_kernel, types, constants,
                       elements_per_iteration=block_n * config["CHUNKS"] * 32, num_warps=config["num_warps"],
                       num_stages=config["num_stages"])

    persistent_types = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": "*bf16", "nw_ptr": "*bf16",
                        "eps": "fp32"}
    # config "PERSISTENT", one step a tile (K = 4096 on 4 warps): the loop is over tiles; with the RMSNorm
    # prologue (NORM, normed once a program) and the residual add (ADD_OUT)
    for block_n, fused in ((8, {}), (16, {}), (8, {"NORM": True}), (8, {"ADD_OUT": True})):
        constants = {"GS": 128, "BLOCK_M": 1, "BLOCK_N": block_n, "CHUNKS": 128, "STEPS": 1, "SILU_MUL": False,
                     "EVEN_M": True, "EVEN_K": True, "ASM": True, "PAIRED": False, "SILU_OUT": False, "HALF2": True,
                     **fused}
        report(f"int4 GEMV, persistent, half2, M=1, BLOCK_N={block_n}{''.join(', ' + f for f in fused)} "
               "(per weight)", int4_gemv._int4_gemv_persistent_kernel, persistent_types, constants,
               elements_per_iteration=block_n * 128 * 32, num_warps=4, num_stages=1)


if __name__ == "__main__":
    main()
