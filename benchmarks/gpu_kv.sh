#!/usr/bin/env bash
# KV cache dtypes on the GPU, in two device calls (each < 10 min). Needs ../shared/bench copied to .bench/.
#   PART=1: the GPU tests (quantized-KV kernels vs torch, graphs == eager) and the decode-kernel tuning per KV
#           dtype and page layout;  PART=2: W1 with bf16 KV (head- and token-major) and int8 KV.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
if [ "${PART:-1}" = 1 ]; then
  timeout 200 python3 -m pytest tests/gpu/test_gpu_kv_quant.py tests/gpu/test_gpu.py -q -p no:cacheprovider 2>&1 \
    | tail -25 | tee "$OUT/gpu_kv_tests.log"
  timeout 330 python3 benchmarks/tune_decode.py --output "$OUT/tune_decode_kv.json" 2>&1 | tail -14 | tee "$OUT/tune_decode_kv.log"
else
  for run in "bf16 head_major" "bf16 token_major" "int8 head_major"; do
    set -- $run
    timeout 170 python3 benchmarks/throughput.py --data .bench/w1_throughput.jsonl --kv-cache-dtype "$1" \
      --kv-layout "$2" > "$OUT/w1_kv_$1_$2.log" 2>&1
    grep -E '"(out_tok_s|roofline_tok_s|fraction_of_roofline|kv_cache_dtype|kv_layout|tokens_per_page|kv_pages)"' \
      "$OUT/w1_kv_$1_$2.log" | tr -d '\n'; echo
  done
fi
