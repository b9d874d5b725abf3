#!/usr/bin/env bash
# One device call for issue 6's W2 (about 6-8 minutes on an H200): the int4 GPU tests, the int4 GEMV tune
# (which writes the fastest config per shape to $OUT/int4.json), then W2 int4 with the built-in config tables,
# with the tune's configs (DFLASH2_INT4_CONFIGS), and with those plus DFLASH2_FUSE_NORM=1, then W2 bf16 (the
# ratio's denominator). STEPS picks a subset: any of tests tune tables tuned fused bf16 (default: all).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-"tests tune tables tuned fused bf16"}
mkdir -p "$OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }
w2() {  # name, then environment assignments for the run
  local name=$1; shift
  env "$@" timeout 150 python3 benchmarks/latency.py --weights "${WEIGHTS:-int4}" > "$OUT/w2_$name.log" 2>&1
  echo "w2 $name: $(grep -o '"tok_s": [0-9.]*\|"decode_tok_s": [0-9.]*' "$OUT/w2_$name.log" | tr '\n' ' ')"
}
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if has tests; then
  timeout 280 python3 -m pytest tests/gpu/test_gpu_quant_matmul.py -q -x -p no:cacheprovider -k "int4" 2>&1 \
    | tail -15 | tee "$OUT/gpu_tests.log"
fi
if has tune; then
  timeout 280 python3 benchmarks/decode_gemv_tune.py --int4-only --output "$OUT/tune.json" \
    --configs-out "$OUT/int4.json" > "$OUT/tune.log" 2>&1
  grep "^best" "$OUT/tune.log" | cut -c1-1500
fi
has tables && w2 tables
has tuned && [ -f "$OUT/int4.json" ] && w2 tuned DFLASH2_INT4_CONFIGS="$OUT/int4.json"
if has fused; then
  if [ -f "$OUT/int4.json" ]; then w2 fused DFLASH2_INT4_CONFIGS="$OUT/int4.json" DFLASH2_FUSE_NORM=1
  else w2 fused DFLASH2_FUSE_NORM=1; fi
fi
has bf16 && WEIGHTS=bf16 w2 bf16
