#!/usr/bin/env bash
# One device call for issue 6's W2 (about 5-7 minutes on an H200): the int4 GPU tests, the int4 GEMV tune
# (the fastest config per shape to $OUT/int4.json) and the int4 prefill GEMM tune ($OUT/gemm.json), then W2
# int4 at the built-in defaults and with the tunes' configs (DFLASH2_INT4_CONFIGS, DFLASH2_INT4_GEMM_CONFIGS), then W2
# bf16 (the ratio's denominator). STEPS picks a subset: any of tests tune prefill default tuned bf16 (default: all).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-"tests tune prefill default tuned bf16"}
mkdir -p "$OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }
w2() {  # name, then environment assignments for the run
  local name=$1; shift
  env "$@" timeout 150 python3 benchmarks/latency.py --weights "${WEIGHTS:-int4}" > "$OUT/w2_$name.log" 2>&1
  echo "w2 $name: $(grep -o '"tok_s": [0-9.]*\|"decode_tok_s": [0-9.]*' "$OUT/w2_$name.log" | tr '\n' ' ')"
}
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if has tests; then
  timeout 280 python3 -m pytest tests/gpu/test_gpu_quant_matmul.py tests/gpu/test_gpu.py -q -x -p no:cacheprovider \
    -k "int4 or argmax or resolve or greedy or rotary" 2>&1 \
    | tail -15 | tee "$OUT/gpu_tests.log"
fi
if has tune; then
  timeout 280 python3 benchmarks/decode_gemv_tune.py --int4-only --output "$OUT/tune.json" \
    --configs-out "$OUT/int4.json" > "$OUT/tune.log" 2>&1
  grep "^best" "$OUT/tune.log" | cut -c1-1500
fi
if has prefill; then
  timeout 200 python3 benchmarks/prefill_gemm_tune.py --output "$OUT/prefill_tune.json" \
    --configs-out "$OUT/gemm.json" > "$OUT/prefill_tune.log" 2>&1
  grep "^summary" "$OUT/prefill_tune.log" | cut -c1-1500
fi
tuned=()  # the tunes' tables, where they were written
[ -f "$OUT/int4.json" ] && tuned+=(DFLASH2_INT4_CONFIGS="$OUT/int4.json")
[ -f "$OUT/gemm.json" ] && tuned+=(DFLASH2_INT4_GEMM_CONFIGS="$OUT/gemm.json")
has default && w2 default
has tuned && [ ${#tuned[@]} -gt 0 ] && w2 tuned "${tuned[@]}"
has bf16 && WEIGHTS=bf16 w2 bf16
