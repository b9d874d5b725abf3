#!/usr/bin/env bash
# KV tiers on the GPU (issue 43), two device calls of < 10 min each, server wheels in .whl/ (see gpu_w3.sh) and
# ../shared/bench/workloads.py copied to .bench/ (carry [".bench", ".whl"]):
#   PART=1: W3 (Poisson overload, gpu_w3.sh) with this tree and, when BASE names a tree (e.g. a `git archive` of
#           the commit before the tiers in .bench/base), with that one, each with a step trace (swap steps' cost);
#           then W4 (benchmarks/multi_turn.py) setting l2_l3.
#   PART=2: W4 settings none and l2.
# JSON to $OUT: w3_{new,base}.json, steps_{new,base}.json, w4_SETTING.json.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "error: installing .whl/*.whl failed (is .whl in carry?)"; exit 1; }
work=/tmp/kv_tiers; mkdir -p $work
nvidia-smi --query-gpu=name,memory.total --format=csv
w3() {  # side directory
  [ -d "$2/.whl" ] || ln -sfn "$PWD/.whl" "$2/.whl"
  (cd "$2" && DFLASH2_STEP_TRACE=$work/steps_$1.jsonl OUT=$work/w3_$1 W3_RUNS=poisson W3_TIMEOUT=230 \
    bash benchmarks/gpu_w3.sh > $work/w3_$1.txt 2>&1)
  cp $work/w3_$1/w3_gpu_poisson.json $OUT/w3_$1.json
  PYTHONPATH=$PWD python3 benchmarks/step_trace_report.py $work/steps_$1.jsonl > $OUT/steps_$1.json
  echo "== W3 $1"; tail -4 $work/w3_$1.txt
}
w4() {  # setting timeout
  rm -rf /tmp/l3 && mkdir -p /tmp/l3
  PYTHONPATH=/tmp/site:$PWD timeout $2 python3 benchmarks/multi_turn.py --settings $1 --l3-dir /tmp/l3 \
    --l3-size 32GiB --workloads-py .bench/workloads.py --output $OUT/w4_$1.json > $work/w4_$1.log 2>&1
  echo "== W4 $1 exit $?"; tail -c 1500 $work/w4_$1.log
}
if [ "${PART:-1}" = 1 ]; then
  w3 new "$PWD"
  [ -n "${BASE:-}" ] && w3 base "$BASE"
  w4 l2_l3 200
else
  w4 none 280
  w4 l2 280
fi
