#!/usr/bin/env bash
# The GPU runs issues 43-48 wait for, three device calls of < 10 min each (PART=1, 2, 3), in this order:
#   PART=1: every GPU test (tests/gpu: fused MoE, NCCL TP=1, structured output, server gauges, ...), structured
#           output's cost (benchmarks/structured_output.py, issue 48), W7 at the device defaults with a step trace
#           (issue 44: where the time goes) if time is left
#   PART=2: W4 multi-turn, settings none, l2, l2_l3 (issue 43)
#   PART=3: the fused MoE kernel's tune, W6 bf16 and int4 experts on the tuned table (issue 45)
#   PART=4: W7 with the step trace (sums by step kind, decode batch sizes, time windows), then W7 with 100 steps
#           under the profiler (top kernels): where issue 44's time goes; then W7 at 1024 seqs / 16384 tokens;
#           then W7 over HTTP (dflash2 serve, dflash2 bench at 1000 in flight: issue 44 item 2)
#   PART=5: the fused MoE GPU tests, W7 traced with 100 profiled steps, W4 none and l2_l3 (one call)
#   PART=6: the fused MoE small path timed by the tune at T 1-16 (bits 16, 4), then W6 bf16 and int4 on that table
#   PART=7: issue 44's decode floor: decode steps profiled at 1, 32 and 300 rows (W7's 512-seq graph buckets, long
#           contexts), W7 offline traced, then W7 over HTTP beside it; everything in $OUT/part7.tar.gz
#   PART=8: issue 44 after the mixed-graph buckets and compile fixes: decode attention over spread vs compact
#           pages (kv_spread.py), W7 traced (compiles per step), W7 at 1024 seqs / 8192 tokens, W7 over HTTP;
#           everything in $OUT/part8.tar.gz
#   PART=9: issue 44's changes checked: W7 traced at the new defaults, the GPU tests of the paths changed, W2 and
#           W1 bf16 beside the tree before them (.bench/base: `git archive 0ed3f7b dflash2 benchmarks`), W7 over
#           HTTP if time is left; everything in $OUT/part9.tar.gz
#   PART=2 takes W4_SETTINGS (default none,l2,l2_l3) and W4_TIMEOUT (default 575)
# Carry [".bench", ".whl"]. Prepare them here first:
#   .whl: the wheels gpu_w3.sh lists, plus xxhash==3.6.0 gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
#         (same pip download flags; add --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64)
#   .bench: workloads.py (from ../shared/bench), w7.jsonl (`workloads.py sharegpt-like --out .bench/w7.jsonl`),
#           smol_tok/ (`.venv/bin/python benchmarks/structured_output.py --save-bundled-tokenizer .bench/smol_tok`)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || { echo "error: installing .whl/*.whl failed (is .whl in carry?)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${PART:-1}" in
1)
  timeout 270 python3 -m pytest -q -p no:cacheprovider --durations=15 tests/gpu > "$OUT/gpu_tests.log" 2>&1
  echo "== tests/gpu exit $?"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -25
  timeout 110 python3 benchmarks/structured_output.py --tokenizer .bench/smol_tok --output "$OUT/so.json" \
    > "$OUT/so.log" 2>&1
  echo "== structured output exit $?"; grep -E '"ratio|"tok_s|"syncs' "$OUT/so.log" | head -20
  [ $SECONDS -gt 420 ] && { echo "W7 skipped at ${SECONDS}s"; exit 0; }
  DFLASH2_STEP_TRACE=/tmp/w7steps.jsonl timeout $((560 - SECONDS)) python3 benchmarks/w7_throughput.py \
    --data .bench/w7.jsonl > "$OUT/w7.json" 2> "$OUT/w7.err"
  echo "== W7 exit $?"; grep -E 'tok_s|max_num|preempt' "$OUT/w7.json"
  python3 benchmarks/step_trace_report.py /tmp/w7steps.jsonl > "$OUT/w7_steps.json" 2>&1
  head -c 2500 "$OUT/w7_steps.json" ;;
2)
  df -h /tmp | tail -1; rm -rf /tmp/l3; mkdir -p /tmp/l3
  timeout "${W4_TIMEOUT:-575}" python3 benchmarks/multi_turn.py --settings "${W4_SETTINGS:-none,l2,l2_l3}" \
    --l3-dir /tmp/l3 --l3-size 32GiB --workloads-py .bench/workloads.py \
    --log-dir /tmp/w4logs --output "$OUT/w4.json" > "$OUT/w4.log" 2>&1
  echo "== W4 exit $?"; tail -c 3000 "$OUT/w4.log" ;;
3)
  cp dflash2/kernels/triton/fused_moe_tuned.py "$OUT/fused_moe_tuned.py"
  timeout 150 python3 benchmarks/moe_kernel_tune.py --models qwen3-30b-a3b --bits 16,4 --budget-s 120 \
    --table "$OUT/fused_moe_tuned.py" --output "$OUT/tune.json" > "$OUT/tune.log" 2>&1
  echo "== tune exit $?"; tail -3 "$OUT/tune.log"
  cp "$OUT/fused_moe_tuned.py" dflash2/kernels/triton/fused_moe_tuned.py  # W6 runs on the tuned table
  timeout 160 python3 benchmarks/moe.py --output "$OUT/w6_bf16.json" > "$OUT/w6_bf16.log" 2>&1
  echo "== W6 bf16 exit $?"; tail -c 1200 "$OUT/w6_bf16.log"
  timeout 130 python3 benchmarks/moe.py --quantization int4 --output "$OUT/w6_int4.json" > "$OUT/w6_int4.log" 2>&1
  echo "== W6 int4 experts exit $?"; tail -c 1200 "$OUT/w6_int4.log" ;;
4)
  rm -f /tmp/w7steps.jsonl
  DFLASH2_STEP_TRACE=/tmp/w7steps.jsonl timeout 200 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl \
    > "$OUT/w7.json" 2> "$OUT/w7.err"
  echo "== W7 exit $?"; grep -E '"out_tok_s|"seconds|preempt' "$OUT/w7.json"
  python3 benchmarks/step_trace_report.py /tmp/w7steps.jsonl --window-from "$OUT/w7.json" > "$OUT/w7_steps.json" 2>&1
  cp /tmp/w7steps.jsonl "$OUT/w7steps.jsonl"
  timeout 200 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl --profile-steps 100 \
    --profile-after-steps 300 > "$OUT/w7_prof.json" 2> "$OUT/w7_prof.err"
  echo "== W7 profiled exit $?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['profile']; \
print(json.dumps({k: v for k, v in d.items() if k != 'top'})); [print(t) for t in d['top'][:25]]" "$OUT/w7_prof.json"
  rm -f /tmp/w7steps_1024.jsonl
  DFLASH2_STEP_TRACE=/tmp/w7steps_1024.jsonl timeout 200 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl \
    --max-num-seqs 1024 --max-num-batched-tokens 16384 > "$OUT/w7_1024.json" 2> "$OUT/w7_1024.err"
  echo "== W7 1024 seqs exit $?"; grep -E '"out_tok_s|"seconds|preempt' "$OUT/w7_1024.json"
  python3 benchmarks/step_trace_report.py /tmp/w7steps_1024.jsonl --window-from "$OUT/w7_1024.json" \
    > "$OUT/w7_1024_steps.json" 2>&1
  [ $SECONDS -gt 380 ] && { echo "W7 over HTTP skipped at ${SECONDS}s"; exit 0; }
  python3 -m dflash2.cli.main serve --model llama-3-8b --load-format dummy --port 8011 --disable-log-requests \
    > "$OUT/w7_serve.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2>/dev/null && break; sleep 1; done
  python3 -m dflash2.cli.main bench --url http://127.0.0.1:8011 --endpoint /generate --dataset .bench/w7.jsonl \
    --num-prompts 64 --max-tokens 8 --ignore-eos --concurrency 64 --no-progress > /dev/null 2>&1  # warm-up
  timeout 150 python3 -m dflash2.cli.main bench --url http://127.0.0.1:8011 --endpoint /generate \
    --dataset .bench/w7.jsonl --num-prompts 1000 --ignore-eos --concurrency 1000 --no-progress \
    --output "$OUT/w7_http.json" > "$OUT/w7_http.log" 2>&1
  echo "== W7 over HTTP exit $?"; tail -c 1500 "$OUT/w7_http.log"
  kill $server; wait $server ;;
5)  # one call with little device time left: the MoE small path's GPU tests, W4 (LIMIT: its bound), W7 if time is left
  timeout "${MOE_TESTS_S:-60}" python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_fused_moe.py \
    > "$OUT/moe_tests.log" 2>&1
  echo "== fused MoE GPU tests exit $?"; tail -5 "$OUT/moe_tests.log"
  df -h /tmp | tail -1; rm -rf /tmp/l3; mkdir -p /tmp/l3
  timeout $((${LIMIT:-575} - SECONDS)) python3 benchmarks/multi_turn.py --settings "${W4_SETTINGS:-none,l2_l3}" \
    --l3-dir /tmp/l3 --l3-size 32GiB \
    --workloads-py .bench/workloads.py --log-dir /tmp/w4logs --output "$OUT/w4.json" > "$OUT/w4.log" 2>&1
  echo "== W4 exit $?"; tail -c 2500 "$OUT/w4.log"
  left=$((${LIMIT:-575} - SECONDS)); [ $left -lt 80 ] && { echo "W7 skipped: ${left}s left"; exit 0; }
  rm -f /tmp/w7steps.jsonl
  DFLASH2_STEP_TRACE=/tmp/w7steps.jsonl timeout $left python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl \
    --profile-steps 100 --profile-after-steps 300 > "$OUT/w7_prof.json" 2> "$OUT/w7_prof.err"
  echo "== W7 traced + profiled exit $?"; grep -E '"out_tok_s|"seconds|preempt' "$OUT/w7_prof.json"
  python3 benchmarks/step_trace_report.py /tmp/w7steps.jsonl --window-from "$OUT/w7_prof.json" > "$OUT/w7_steps.json" 2>&1
  cp /tmp/w7steps.jsonl "$OUT/w7steps.jsonl"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['profile']; \
print(json.dumps({k: v for k, v in d.items() if k != 'top'})); [print(t) for t in d['top'][:25]]" "$OUT/w7_prof.json" ;;
6)  # issue 45's small path timed: the tune at decode sizes (both paths compete), then W6 on the new table
  cp dflash2/kernels/triton/fused_moe_tuned.py "$OUT/fused_moe_tuned.py"
  timeout 240 python3 benchmarks/moe_kernel_tune.py --models qwen3-30b-a3b --bits 16,4 --tokens 1,2,4,8,16 \
    --budget-s 210 --table "$OUT/fused_moe_tuned.py" --output "$OUT/tune.json" > "$OUT/tune.log" 2>&1
  echo "== tune exit $?"; tail -1 "$OUT/tune.log" | cut -c1-3000
  cp "$OUT/fused_moe_tuned.py" dflash2/kernels/triton/fused_moe_tuned.py
  timeout 160 python3 benchmarks/moe.py --output "$OUT/w6_bf16.json" > "$OUT/w6_bf16.log" 2>&1
  echo "== W6 bf16 exit $?"; tail -c 1200 "$OUT/w6_bf16.log"
  timeout 130 python3 benchmarks/moe.py --quantization int4 --output "$OUT/w6_int4.json" > "$OUT/w6_int4.log" 2>&1
  echo "== W6 int4 exit $?"; tail -c 1200 "$OUT/w6_int4.log" ;;
7)  # issue 44: why a W7 decode step of 33 rows took 11.9 ms where one row takes 5.4; offline and HTTP side by side
  mkdir -p /tmp/p7
  for bp in 1:1200 32:1200 300:500; do
    timeout 120 python3 benchmarks/decode_profile.py --batch ${bp%%:*} --prompt-len ${bp##*:} --max-num-seqs 512 \
      --steps 20 --timeline /tmp/p7/timeline_${bp%%:*}.jsonl > /tmp/p7/decode_${bp%%:*}.json 2> /tmp/p7/decode_${bp%%:*}.err
    echo "== decode profile ${bp} exit $?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(d['wall_ms_per_step'], d['busy_us_per_step']); [print(k) for k in d['exposed'][:12]]" /tmp/p7/decode_${bp%%:*}.json
  done
  DFLASH2_STEP_TRACE=/tmp/p7/w7steps.jsonl timeout 150 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl \
    > /tmp/p7/w7.json 2> /tmp/p7/w7.err
  echo "== W7 exit $?"; grep -E '"out_tok_s|"seconds|preempt' /tmp/p7/w7.json
  python3 benchmarks/step_trace_report.py /tmp/p7/w7steps.jsonl --window-from /tmp/p7/w7.json > /tmp/p7/w7_steps.json 2>&1
  python3 -m dflash2.cli.main serve --model llama-3-8b --load-format dummy --port 8011 --disable-log-requests \
    > /tmp/p7/w7_serve.log 2>&1 &
  server=$!
  for _ in $(seq 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2>/dev/null && break; sleep 1; done
  python3 -m dflash2.cli.main bench --url http://127.0.0.1:8011 --endpoint /generate --dataset .bench/w7.jsonl \
    --num-prompts 64 --max-tokens 8 --ignore-eos --concurrency 64 --no-progress > /dev/null 2>&1  # warm-up
  timeout 150 python3 -m dflash2.cli.main bench --url http://127.0.0.1:8011 --endpoint /generate \
    --dataset .bench/w7.jsonl --num-prompts 1000 --ignore-eos --concurrency 1000 --no-progress \
    --output /tmp/p7/w7_http.json > /tmp/p7/w7_http.log 2>&1
  echo "== W7 over HTTP exit $?"; tail -c 1500 /tmp/p7/w7_http.log
  kill $server; wait $server
  tar czf "$OUT/part7.tar.gz" -C /tmp p7 ;;
8)
  mkdir -p /tmp/p8
  for bl in 300:500 32:1200; do
    timeout 90 python3 benchmarks/kv_spread.py --batch ${bl%%:*} --length ${bl##*:} --pool-gib 48 \
      --grid "64,4,2 32,2,3 64,2,3 128,4,2 16,1,3" > /tmp/p8/spread_${bl%%:*}.json 2> /tmp/p8/spread_${bl%%:*}.err
    echo "== kv_spread ${bl} exit $?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
[print(k, v['us'], v['TB_s']) for k, v in d.items() if isinstance(v, dict) and 'us' in v]" /tmp/p8/spread_${bl%%:*}.json
  done
  DFLASH2_STEP_TRACE=/tmp/p8/w7steps.jsonl timeout 150 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl \
    > /tmp/p8/w7.json 2> /tmp/p8/w7.err
  echo "== W7 exit $?"; grep -E '"out_tok_s|"seconds|preempt|load_seconds' /tmp/p8/w7.json
  python3 benchmarks/step_trace_report.py /tmp/p8/w7steps.jsonl --window-from /tmp/p8/w7.json > /tmp/p8/w7_steps.json 2>&1
  python3 -c "import json; rows=[json.loads(l) for l in open('/tmp/p8/w7steps.jsonl')]; \
[print(round(r['device_ms']), r['decodes'], r['prefill_tokens'], r['graph'], r.get('alloc_retries'), [c[:150] for c in r['compiled']]) \
for r in rows if r['compiled'] or r['device_ms'] > 300]" | head -40
  DFLASH2_STEP_TRACE=/tmp/p8/w7steps_1024.jsonl timeout 150 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl \
    --max-num-seqs 1024 --max-num-batched-tokens 8192 > /tmp/p8/w7_1024.json 2> /tmp/p8/w7_1024.err
  echo "== W7 1024 seqs / 8192 tokens exit $?"; grep -E '"out_tok_s|"seconds|preempt|kv_pages' /tmp/p8/w7_1024.json
  if [ $SECONDS -lt 420 ]; then
    python3 -m dflash2.cli.main serve --model llama-3-8b --load-format dummy --port 8011 --disable-log-requests \
      > /tmp/p8/w7_serve.log 2>&1 &
    server=$!
    for _ in $(seq 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2>/dev/null && break; sleep 1; done
    python3 -m dflash2.cli.main bench --url http://127.0.0.1:8011 --endpoint /generate --dataset .bench/w7.jsonl \
      --num-prompts 64 --max-tokens 8 --ignore-eos --concurrency 64 --no-progress > /dev/null 2>&1  # warm-up
    timeout 100 python3 -m dflash2.cli.main bench --url http://127.0.0.1:8011 --endpoint /generate \
      --dataset .bench/w7.jsonl --num-prompts 1000 --ignore-eos --concurrency 1000 --no-progress \
      --output /tmp/p8/w7_http.json > /tmp/p8/w7_http.log 2>&1
    echo "== W7 over HTTP exit $?"; tail -c 600 /tmp/p8/w7_http.log
    kill $server; wait $server
  fi
  tar czf "$OUT/part8.tar.gz" -C /tmp p8 ;;
9)
  mkdir -p /tmp/p9
  timeout ${TESTS_S:-150} python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu.py tests/gpu/test_gpu_lifecycle.py \
    > /tmp/p9/gpu_tests.log 2>&1
  echo "== GPU tests exit $?"; tail -3 /tmp/p9/gpu_tests.log
  DFLASH2_STEP_TRACE=/tmp/p9/w7steps.jsonl timeout 120 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl \
    > /tmp/p9/w7.json 2> /tmp/p9/w7.err
  echo "== W7 exit $?"; grep -E '"out_tok_s|"seconds|preempt|load_seconds|kv_pages|max_num_seqs' /tmp/p9/w7.json
  python3 benchmarks/step_trace_report.py /tmp/p9/w7steps.jsonl --window-from /tmp/p9/w7.json > /tmp/p9/w7_steps.json 2>&1
  python3 -c "import json; rows=[json.loads(l) for l in open('/tmp/p9/w7steps.jsonl')]; \
[print(round(r['device_ms']), r['decodes'], r['prefill_tokens'], r['graph'], [c.split('[')[0] for c in r['compiled']]) \
for r in rows if r['compiled'] or r['device_ms'] > 300]" | head -20
  tar czf "$OUT/part9.tar.gz" -C /tmp p9  # again at the end: what came so far, if the call's limit ends it
  for tree in . .bench/base; do
    [ $SECONDS -gt ${W2_BY:-400} ] && { echo "W2 $tree skipped at ${SECONDS}s"; continue; }
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 benchmarks/latency.py --weights bf16 > /tmp/p9/w2_${tree//\//_}.log 2>&1)
    echo "== W2 bf16 $tree exit $?"; grep -E '"tok_s|"ttft' /tmp/p9/w2_${tree//\//_}.log | head -3
  done
  for tree in . .bench/base; do
    [ $SECONDS -gt ${W1_BY:-400} ] && { echo "W1 $tree skipped at ${SECONDS}s"; continue; }
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 75 python3 benchmarks/throughput.py \
      --data $OLDPWD/.bench/w1_throughput.jsonl > /tmp/p9/w1_${tree//\//_}.log 2>&1)
    echo "== W1 bf16 $tree exit $?"; grep -E '"out_tok_s|"output_tok_s|tok_s' /tmp/p9/w1_${tree//\//_}.log | head -3
  done
  if [ $SECONDS -lt ${HTTP_BY:-300} ]; then  # W7 over HTTP, and the host CPU seconds of each server process
    python3 -m dflash2.cli.main serve --model llama-3-8b --load-format dummy --port 8011 --disable-log-requests \
      > /tmp/p9/w7_serve.log 2>&1 &
    server=$!
    for _ in $(seq 120); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" 2>/dev/null && break; sleep 1; done
    python3 -m dflash2.cli.main bench --url http://127.0.0.1:8011 --endpoint /generate --dataset .bench/w7.jsonl \
      --num-prompts 64 --max-tokens 8 --ignore-eos --concurrency 64 --no-progress > /dev/null 2>&1  # warm-up
    python3 benchmarks/proc_cpu.py $server > /tmp/p9/cpu_before.json
    timeout 90 python3 -m dflash2.cli.main bench --url http://127.0.0.1:8011 --endpoint /generate \
      --dataset .bench/w7.jsonl --num-prompts 1000 --ignore-eos --concurrency 1000 --no-progress \
      --output /tmp/p9/w7_http.json > /tmp/p9/w7_http.log 2>&1
    echo "== W7 over HTTP exit $?"; tail -c 400 /tmp/p9/w7_http.log
    python3 benchmarks/proc_cpu.py $server > /tmp/p9/cpu_after.json; cat /tmp/p9/cpu_before.json /tmp/p9/cpu_after.json
    kill $server; wait $server
  fi
  tar czf "$OUT/part9.tar.gz" -C /tmp p9 ;;
esac
