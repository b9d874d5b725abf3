#!/usr/bin/env bash
# Mixture of experts on the GPU (issue 45), one device call of < 10 min:
#   1. the fused MoE kernel's GPU tests (16/8/6/4 bits, CUDA-graph replay) and the MoE model tests
#   2. a tune of the qwen3-30b-a3b expert shape at 16 and 4 bits (table to $OUT/fused_moe_tuned.py)
#   3. W6 (benchmarks/moe.py): qwen3-30b-a3b dummy, bf16: batch-1 decode against its roofline, and 10 concurrent
#      requests of 2,048 + 1,024 tokens against vLLM's 740 tok/s; then the same with int4 experts
# JSON to $OUT: tune.json, w6_bf16.json, w6_int4.json; logs beside them.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 150 python3 -m pytest -q tests/gpu/test_gpu_fused_moe.py > "$OUT/gpu_tests.log" 2>&1
echo "== GPU tests exit $?"; tail -5 "$OUT/gpu_tests.log"
cp dflash2/kernels/triton/fused_moe_tuned.py "$OUT/fused_moe_tuned.py"
timeout 150 python3 benchmarks/moe_kernel_tune.py --models qwen3-30b-a3b --bits 16,4 --budget-s 120 \
  --table "$OUT/fused_moe_tuned.py" --output "$OUT/tune.json" > "$OUT/tune.log" 2>&1
echo "== tune exit $?"; tail -3 "$OUT/tune.log"
cp "$OUT/fused_moe_tuned.py" dflash2/kernels/triton/fused_moe_tuned.py  # W6 runs on the tuned table
timeout 150 python3 benchmarks/moe.py --output "$OUT/w6_bf16.json" > "$OUT/w6_bf16.log" 2>&1
echo "== W6 bf16 exit $?"; tail -c 1500 "$OUT/w6_bf16.log"
timeout 120 python3 benchmarks/moe.py --quantization int4 --output "$OUT/w6_int4.json" > "$OUT/w6_int4.log" 2>&1
echo "== W6 int4 experts exit $?"; tail -c 1500 "$OUT/w6_int4.log"
