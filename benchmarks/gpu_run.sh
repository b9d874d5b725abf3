#!/usr/bin/env bash
# One device call: GPU tests, then our W1 and W2 (and, with PEERS=1, the transformers peer in the same run).
# Needs ../shared/bench copied to .bench/ (git-ignored) and carried.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
fi
if [ "${PEERS:-0}" = 1 ]; then
  timeout 280 python3 .bench/hf_peer.py w1 --data .bench/w1_throughput.jsonl | tee "$OUT/peer_w1.json"
  timeout 200 python3 .bench/hf_peer.py w2 --compile | tee "$OUT/peer_w2.json"
fi
timeout 200 python3 benchmarks/throughput.py --data .bench/w1_throughput.jsonl --peer-json "$OUT/peer_w1.json" \
  --save --profile ${W1_ARGS:-} 2>&1 | tail -90 | tee "$OUT/w1.log"
timeout 150 python3 benchmarks/latency.py --peer-json "$OUT/peer_w2.json" --save ${W2_ARGS:-} 2>&1 | tail -40 | tee "$OUT/w2.log"
cp benchmarks/results/*.json "$OUT/" 2>/dev/null || true
