#!/usr/bin/env bash
# W3 on the GPU, one device call: priority under overload through the real server, dummy Qwen3-0.6B, a page
# pool small enough to force preemption, host swap space; a closed loop of 128 and Poisson arrivals at 1.5x the
# measured capacity; JSON to $OUT/w3_gpu_{closed,poisson}.json, the server's logs (one JSON line per request)
# in $OUT/w3_server_{closed,poisson}/.
#
# The device has torch, transformers, httpx, prometheus-client, but not the server's FastAPI stack: the
# wheels in .whl/ (git-ignored; name ".whl" in the run's carry) are installed into /tmp/site first:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl fastapi==0.165.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 starlette==1.10.0 \
#     annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 click==8.5.1 typing-extensions==4.16.0 \
#     opentelemetry-api==1.45.2 uvloop==0.23.0 httptools==0.9.0 nvidia-ml-py==13.615.71   (fastapi 0.165 imports
#     opentelemetry; nvidia-ml-py: the GPU gauges)
# Overrides: PYTHON (default python3), W3_RUNS (default "closed poisson"; a kind named twice runs twice, its second
# run's files named poisson_2 and so on), W3_INSTALL=0 (skip the install), W3_TIMEOUT (seconds per run), W3_ARGS
# (appended last to both runs, so they win, e.g. W3_ARGS="--kv-cache-memory 256MiB --overload 2").
# DFLASH2_STEP_TRACE=$OUT/steps.jsonl reaches the server through the environment: one line per engine step
# (benchmarks/step_trace_report.py summarizes it). W3_SERVER_PREFIX runs the server under a profiler
# (w3_server.py), e.g. W3_SERVER_PREFIX="py-spy record -r 250 -f raw -t -g --nonblocking -o $OUT/spy.txt --"
# with the py-spy wheel in .whl/ (it lands in /tmp/site/bin: put that on PATH).
set -uo pipefail
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ "${W3_INSTALL:-1}" = 1 ]; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || { echo "error: installing .whl/*.whl failed (is .whl in carry?)"; exit 1; }
fi
$PYTHON -c "import fastapi, uvicorn, pydantic, starlette, prometheus_client, httpx, numpy; print('server deps: ok')" \
  || { echo "error: the server's dependencies do not import"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
# qwen3-0.6b in bf16 puts 9 tokens in a 1 MiB page: 384 MiB holds ~3,400 tokens, about 10 of the 32 requests
# that may run at once (prompts 128-384 tokens + 64 new), so pages run out and requests are swapped.
# Two runs, each bounded by W3_TIMEOUT (default 240 s). At 4,800 requests the overload phase took 59-61 s and
# the waiting line peaked at 1,641-1,761 requests (eighth session); W3_ARGS="--synthetic 1600" gives the earlier
# size (20 s, 478 waiting at most):
#   closed: 128 requests in flight (closed loop), as the first GPU run (2026-11-29: 6.47x; benchmarks/RESULTS.md);
#   poisson: Poisson arrivals at 1.5x the measured capacity, 4,800 requests (~60 s, 480 urgent: a p99 that is
#   not the worst one or two; with 80 urgent, six runs of the same code gave ratios from 1.74 to 5.01, and with
#   160 the client's urgent p99 still moved 12-25 ms between runs of the same code, seventh session).
# 1,000 idle requests (~10 s) for the same reason: the p99 of 100 or 200 is their worst one or two, which a
# single hiccup of the server or the client sets (priority.py also refuses to judge an idle phase whose p99 is
# over twice its median).
# --max-outranked-prefill-tokens is the server's default (64), spelled out so the JSON names it.
common=(--model qwen3-0.6b --load-format dummy --device cuda --synthetic 400 --prompt-len 256 --output-len 64
  --max-model-len 512 --kv-cache-memory 384MiB --swap-space 4 --max-num-seqs 32 --prefill-chunk-size 512
  --max-num-batched-tokens 2048 --max-outranked-prefill-tokens 64 --idle-requests 1000)
status=0
declare -A seen=()  # a kind named again (W3_RUNS="poisson poisson") gets its own files: poisson_2, ...
for kind in ${W3_RUNS:-closed poisson}; do
  seen[$kind]=$(( ${seen[$kind]:-0} + 1 ))
  run=$kind; [ ${seen[$kind]} -gt 1 ] && run=${kind}_${seen[$kind]}
  if [ $kind = closed ]; then extra=(--concurrency 128); else extra=(--synthetic 4800); fi
  timeout ${W3_TIMEOUT:-240} $PYTHON benchmarks/priority.py "${common[@]}" "${extra[@]}" \
    --server-log-dir "$OUT/w3_server_$run" --output "$OUT/w3_gpu_$run.json" ${W3_ARGS:-} > "$OUT/w3_gpu_$run.log" 2>&1
  run_status=$?
  [ $run_status -gt $status ] && status=$run_status
  echo "== $run: priority.py exit status $run_status"
  grep -A12 '"1000": {' "$OUT/w3_gpu_$run.log" | head -40
  grep -A7 '"target"' "$OUT/w3_gpu_$run.log"
  tail -3 "$OUT/w3_server_$run/stderr.log" 2>/dev/null
done
echo "worst exit status $status (0: target met, 2: missed, other: failed)"
exit $status
