#!/usr/bin/env bash
# One device call: (TESTS=1) the GPU tests, then our W1 and W2, then (PEERS=1) the transformers peer on the
# same machine; benchmarks/attach_peer.py then adds the peer's JSON to ours. Needs ../shared/bench copied
# to .bench/ (git-ignored) and named in carry.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
MARK=$(mktemp)  # only this call's result files go back (the device returns at most 8 files)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 150 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
fi
timeout 150 python3 benchmarks/throughput.py --data .bench/w1_throughput.jsonl --save --profile ${W1_ARGS:-} \
  > "$OUT/w1.log" 2>&1; tail -45 "$OUT/w1.log"
timeout 120 python3 benchmarks/latency.py --save ${W2_ARGS:-} > "$OUT/w2.log" 2>&1; tail -25 "$OUT/w2.log"
find benchmarks/results -name "*.json" -newer "$MARK" -exec cp {} "$OUT/" \;
if [ "${PEERS:-0}" = 1 ]; then
  timeout 150 python3 .bench/hf_peer.py w2 --compile 2>&1 | tail -3 | tee "$OUT/peer_w2.json"
  timeout 260 python3 .bench/hf_peer.py w1 --data .bench/w1_throughput.jsonl 2>&1 | tail -3 | tee "$OUT/peer_w1.json"
fi
