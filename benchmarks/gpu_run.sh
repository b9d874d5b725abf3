#!/usr/bin/env bash
# One device call: (TESTS=1) the GPU tests, then our W1 (bf16 and int8 KV) and W2 (bf16 and int4 weights), then
# (PEERS=1) the transformers peer on the same machine; benchmarks/attach_peer.py then adds the peer's JSON to ours.
# W1_KV / W2_WEIGHTS pick the variants (default "bf16 int8" / "bf16 int4"); W1_ARGS / W2_ARGS go to every W1 / W2
# run (e.g. W1_ARGS=--profile for the GPU-busy fraction). Needs ../shared/bench copied to .bench/ (git-ignored)
# and named in carry. The figures and their commands: benchmarks/RESULTS.md.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MARK=$(mktemp)  # only this call's result files go back
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 150 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
fi
for kv in ${W1_KV:-bf16 int8}; do
  timeout 150 python3 benchmarks/throughput.py --data .bench/w1_throughput.jsonl --kv-cache-dtype "$kv" --save \
    ${W1_ARGS:-} > "$OUT/w1_$kv.log" 2>&1
  echo "w1 $kv: $(grep -o '"out_tok_s": [0-9.]*' "$OUT/w1_$kv.log" | tr '\n' ' ')"
done
for weights in ${W2_WEIGHTS:-bf16 int4}; do
  timeout 120 python3 benchmarks/latency.py --weights "$weights" --save ${W2_ARGS:-} > "$OUT/w2_$weights.log" 2>&1
  echo "w2 $weights: $(grep -o '"tok_s": [0-9.]*\|"ttft_ms": [0-9.]*' "$OUT/w2_$weights.log" | tr '\n' ' ')"
done
find benchmarks/results -name "*.json" -newer "$MARK" -exec cp {} "$OUT/" \;
if [ "${PEERS:-0}" = 1 ]; then
  timeout 150 python3 .bench/hf_peer.py w2 --compile 2>&1 | tail -3 | tee "$OUT/peer_w2.json"
  timeout 260 python3 .bench/hf_peer.py w1 --data .bench/w1_throughput.jsonl 2>&1 | tail -3 | tee "$OUT/peer_w1.json"
fi
