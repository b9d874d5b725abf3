#!/usr/bin/env bash
# The GPU runs the open issues wait for, one device call of < 10 min each:
#   PART=1: every GPU test (tests/gpu), structured output's cost (benchmarks/structured_output.py)
#   PART=2: W4 multi-turn, settings W4_SETTINGS (default none,l2,l2_l3), bound W4_TIMEOUT (default 575 s)
#   PART=3: the fused MoE kernel's tune (TUNE_TOKENS: the token counts, e.g. 1,2,4,8,16; default the tune's),
#           then W6 bf16 and int4 experts on the table it wrote (issue 45)
#   PART=4: where W7's time goes (issue 44): W7 traced, W7 with 100 steps profiled, decode steps profiled at 1, 32
#           and 300 rows, decode attention over spread vs compact pages (kv_spread.py); $OUT/part4.tar.gz
#   PART=5: a W7 change checked: the GPU tests (TESTS, default tests/gpu; bound TESTS_S), W7 traced, W2 and W1 bf16 beside the tree
#           before it (.bench/base: `git archive <commit> dflash2 benchmarks | tar x -C .bench/base`; W2_BY, W1_BY:
#           skipped past that many seconds), W7 over HTTP with the server processes' CPU per token (HTTP_BY);
#           $OUT/part5.tar.gz, written after W7 and again at the end
#   PART=6: where W6's time goes (issue 45): qwen3-30b-a3b decode steps profiled at 1 row (128-token prompt) and
#           10 rows (2,048-token prompts), bf16; $OUT/part6.tar.gz
#   PART=7: a W6 change checked (issue 45): W6 bf16 beside the tree before it (.bench/prev: `git archive <commit>
#           dflash2 benchmarks | tar x -C .bench/prev`), the router's time a call (moe_router_bench.py), the dense
#           GEMVs' configs on qwen3-30b-a3b's shapes (gemv_bench.py --shapes) and the skinny GEMM's at 8 and 16 rows
#           (small_m_tune.py --shapes), W6 decode steps profiled at 1 and 10
#           rows (W6_TREES: the trees W6 runs on, default ". .bench/prev"; empty: none); $OUT/part7.tar.gz
#   PART=8: the one-row fold checked (issues 45, 44): its GPU tests, then W6 bf16 (--repeats W6_REPEATS, default 1),
#           W2 bf16 and W1 bf16 (P8_RUNS: which and in what order, default "w6 w2 w1"), each on the tree and beside .bench/cur (the tree before the fold: `git archive
#           8537db1 | tar x -C .bench/cur`), each part only while END (s, default 480) leaves it time; then
#           gemv_bench.py --sweep-fold on qwen3-30b-a3b's shapes; $OUT/part8.tar.gz
#   PART=9: issue 44 on an H200: W7 offline, W3 (Poisson, --synthetic 1600) on the tree and beside .bench/base
#           (`git archive 0ed3f7b dflash2 benchmarks | tar x -C .bench/base`), then the fold's GPU tests while END
#           (default 560) leaves time; $OUT/part9.tar.gz
#   PART=auto: 9 on an H200, 8 on any other card
# Carry [".bench", ".whl"]. Prepare them here first:
#   .whl: the wheels gpu_w3.sh lists, plus xxhash==3.6.0 gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
#         (same pip download flags; add --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64)
#   .bench: workloads.py and w1_throughput.jsonl (from ../shared/bench), w7.jsonl (`workloads.py sharegpt-like
#           --out .bench/w7.jsonl`), smol_tok/ (`.venv/bin/python benchmarks/structured_output.py
#           --save-bundled-tokenizer .bench/smol_tok`)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || { echo "error: installing .whl/*.whl failed (is .whl in carry?)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

w7_traced() {  # DIR NAME [w7_throughput args]: W7 with the step trace, its report, the slow or compiling steps
  local dir=$1 name=$2; shift 2
  DFLASH2_STEP_TRACE=$dir/${name}_steps.jsonl timeout ${W7_S:-150} python3 benchmarks/w7_throughput.py \
    --data .bench/w7.jsonl "$@" > $dir/$name.json 2> $dir/$name.err
  echo "== $name exit $?"; grep -E '"out_tok_s|"seconds|preempt|load_seconds|kv_pages|max_num_seqs' $dir/$name.json
  python3 benchmarks/step_trace_report.py $dir/${name}_steps.jsonl --window-from $dir/$name.json \
    > $dir/${name}_report.json 2>&1
  python3 -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; \
[print(round(r['device_ms']), r['decodes'], r['prefill_tokens'], r['graph'], \
       [c.split('[')[0] for c in r.get('compiled', [])]) for r in rows if r.get('compiled') or r['device_ms'] > 300]" \
    $dir/${name}_steps.jsonl | head -20
}

w7_http() {  # DIR: W7 over HTTP (dflash2 serve, dflash2 bench at 1000 in flight) and the server's CPU per token
  timeout 200 python3 benchmarks/server_host_cost.py --serve "--model llama-3-8b --load-format dummy" \
    --dataset .bench/w7.jsonl --num-prompts 1000 --concurrency 1000 --ignore-eos --endpoints /generate \
    --output $1/w7_http.json > $1/w7_http.log 2>&1
  echo "== W7 over HTTP exit $?"; tail -c 700 $1/w7_http.log
}

fold_tests() {  # DIR BOUND: the one-row fold's GPU tests (issues 45, 44)
  timeout $2 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_fused_moe.py tests/gpu/test_gpu_quant_matmul.py \
    tests/gpu/test_gpu.py -k "fold or rotary or qwen3" > $1/tests.log 2>&1
  echo "== fold tests exit $? at ${SECONDS}s"; grep -E "passed|failed|FAILED|ERROR" $1/tests.log | tail -12
}

PART=${PART:-1}
[ "$PART" = auto ] && { case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*) PART=9;; *) PART=8;; esac; }
echo "PART=$PART"
case "$PART" in
1)
  timeout 270 python3 -m pytest -q -p no:cacheprovider --durations=15 tests/gpu > "$OUT/gpu_tests.log" 2>&1
  echo "== tests/gpu exit $?"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -25
  timeout 110 python3 benchmarks/structured_output.py --tokenizer .bench/smol_tok --output "$OUT/so.json" \
    > "$OUT/so.log" 2>&1
  echo "== structured output exit $?"; grep -E '"ratio|"tok_s|"syncs' "$OUT/so.log" | head -20 ;;
2)
  df -h /tmp | tail -1; rm -rf /tmp/l3; mkdir -p /tmp/l3
  timeout "${W4_TIMEOUT:-575}" python3 benchmarks/multi_turn.py --settings "${W4_SETTINGS:-none,l2,l2_l3}" \
    --l3-dir /tmp/l3 --l3-size 32GiB --workloads-py .bench/workloads.py \
    --log-dir /tmp/w4logs --output "$OUT/w4.json" > "$OUT/w4.log" 2>&1
  echo "== W4 exit $?"; tail -c 3000 "$OUT/w4.log" ;;
3)
  cp dflash2/kernels/triton/fused_moe_tuned.py "$OUT/fused_moe_tuned.py"
  timeout 240 python3 benchmarks/moe_kernel_tune.py --models qwen3-30b-a3b --bits 16,4 ${TUNE_TOKENS:+--tokens $TUNE_TOKENS} \
    --budget-s 210 --table "$OUT/fused_moe_tuned.py" --output "$OUT/tune.json" > "$OUT/tune.log" 2>&1
  echo "== tune exit $?"; tail -1 "$OUT/tune.log" | cut -c1-3000
  cp "$OUT/fused_moe_tuned.py" dflash2/kernels/triton/fused_moe_tuned.py  # W6 runs on the tuned table
  timeout 160 python3 benchmarks/moe.py --output "$OUT/w6_bf16.json" > "$OUT/w6_bf16.log" 2>&1
  echo "== W6 bf16 exit $?"; tail -c 1200 "$OUT/w6_bf16.log"
  timeout 130 python3 benchmarks/moe.py --quantization int4 --output "$OUT/w6_int4.json" > "$OUT/w6_int4.log" 2>&1
  echo "== W6 int4 exit $?"; tail -c 1200 "$OUT/w6_int4.log" ;;
4)
  mkdir -p /tmp/p4
  w7_traced /tmp/p4 w7
  timeout 200 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl --profile-steps 100 \
    --profile-after-steps 300 > /tmp/p4/w7_prof.json 2> /tmp/p4/w7_prof.err
  echo "== W7 profiled exit $?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['profile']; \
print(json.dumps({k: v for k, v in d.items() if k != 'top'})); [print(t) for t in d['top'][:25]]" /tmp/p4/w7_prof.json
  for bp in 1:1200 32:1200 300:500; do
    timeout 120 python3 benchmarks/decode_profile.py --batch ${bp%%:*} --prompt-len ${bp##*:} --max-num-seqs 512 \
      --steps 20 > /tmp/p4/decode_${bp%%:*}.json 2> /tmp/p4/decode_${bp%%:*}.err
    echo "== decode profile ${bp} exit $?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(d['wall_ms_per_step'], d['busy_us_per_step']); [print(k) for k in d['exposed'][:12]]" /tmp/p4/decode_${bp%%:*}.json
  done
  for bl in 300:500 32:1200; do
    timeout 90 python3 benchmarks/kv_spread.py --batch ${bl%%:*} --length ${bl##*:} --pool-gib 48 \
      --grid "64,4,2 32,2,3 64,2,3 128,4,2" > /tmp/p4/spread_${bl%%:*}.json 2> /tmp/p4/spread_${bl%%:*}.err
    echo "== kv_spread ${bl} exit $?"
  done
  tar czf "$OUT/part4.tar.gz" -C /tmp p4 ;;
5)
  mkdir -p /tmp/p5
  timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider --durations=10 ${TESTS:-tests/gpu} \
    > /tmp/p5/gpu_tests.log 2>&1
  echo "== GPU tests exit $?"; grep -E "passed|failed|FAILED|ERROR" /tmp/p5/gpu_tests.log | tail -12
  W7_S=120 w7_traced /tmp/p5 w7
  tar czf "$OUT/part5.tar.gz" -C /tmp p5  # again at the end: what came so far, if the call's limit ends it
  for tree in . .bench/base; do
    [ $SECONDS -gt ${W2_BY:-400} ] && { echo "W2 $tree skipped at ${SECONDS}s"; continue; }
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 benchmarks/latency.py --weights bf16 \
      > /tmp/p5/w2_${tree//\//_}.log 2>&1)
    echo "== W2 bf16 $tree exit $?"; grep -E '"tok_s|"ttft' /tmp/p5/w2_${tree//\//_}.log | head -3
  done
  for tree in . .bench/base; do
    [ $SECONDS -gt ${W1_BY:-400} ] && { echo "W1 $tree skipped at ${SECONDS}s"; continue; }
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 75 python3 benchmarks/throughput.py \
      --data $OLDPWD/.bench/w1_throughput.jsonl > /tmp/p5/w1_${tree//\//_}.log 2>&1)
    echo "== W1 bf16 $tree exit $?"; grep -E 'tok_s' /tmp/p5/w1_${tree//\//_}.log | head -3
  done
  [ $SECONDS -lt ${HTTP_BY:-300} ] && w7_http /tmp/p5
  tar czf "$OUT/part5.tar.gz" -C /tmp p5 ;;
6)
  mkdir -p /tmp/p6
  for weights in bf16; do
    for bp in 1:128 10:2048; do
      name=${weights}_${bp%%:*}
      timeout 150 python3 benchmarks/decode_profile.py --model qwen3-30b-a3b --weights $weights \
        --batch ${bp%%:*} --prompt-len ${bp##*:} --steps 20 --timeline /tmp/p6/${name}_timeline.jsonl > /tmp/p6/$name.json 2> /tmp/p6/$name.err
      echo "== W6 decode profile $name exit $?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(d['wall_ms_per_step'], d['busy_us_per_step']); [print(k) for k in d['exposed'][:14]]" /tmp/p6/$name.json
    done
  done
  tar czf "$OUT/part6.tar.gz" -C /tmp p6 ;;
7)
  mkdir -p /tmp/p7
  for tree in ${W6_TREES-. .bench/prev}; do
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/moe.py --repeats 2 \
      --output /tmp/p7/w6_${tree//\//_}.json > /tmp/p7/w6_${tree//\//_}.log 2>&1)
    echo "== W6 bf16 $tree exit $? at ${SECONDS}s"
    grep -E '"tok_s|output_tok_s|fraction_of_roofline|ms_per' /tmp/p7/w6_${tree//\//_}.json | head -6
  done
  timeout 60 python3 benchmarks/moe_router_bench.py --output /tmp/p7/router.json > /tmp/p7/router.log 2>&1
  echo "== router exit $?"; cat /tmp/p7/router.json
  tar czf "$OUT/part7.tar.gz" -C /tmp p7
  timeout 100 python3 benchmarks/gemv_bench.py --shapes qwen3-30b-a3b --sweep-bits 16 --sweep-budget-s 60 \
    --output /tmp/p7/gemv.json > /tmp/p7/gemv.log 2>&1
  echo "== gemv_bench exit $?"; grep '"best"' /tmp/p7/gemv.log | cut -c1-300
  timeout 150 python3 benchmarks/small_m_tune.py --shapes qwen3-30b-a3b --rows 8,16 --output /tmp/p7/skinny.json \
    --configs-out /tmp/p7/skinny_configs.json > /tmp/p7/skinny.log 2>&1
  echo "== small_m_tune exit $?"; grep -E '^summary|^configs' /tmp/p7/skinny.log | cut -c1-600
  for bp in 1:128 10:2048; do
    name=bf16_${bp%%:*}
    timeout 100 python3 benchmarks/decode_profile.py --model qwen3-30b-a3b --weights bf16 --batch ${bp%%:*} \
      --prompt-len ${bp##*:} --steps 20 --timeline /tmp/p7/${name}_timeline.jsonl > /tmp/p7/$name.json 2> /tmp/p7/$name.err
    echo "== W6 decode profile $name exit $?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(d['wall_ms_per_step'], d['busy_us_per_step']); [print(k) for k in d['exposed'][:12]]" /tmp/p7/$name.json
  done
  tar czf "$OUT/part7.tar.gz" -C /tmp p7 ;;
8)
  mkdir -p /tmp/p8
  END=${END:-480}
  fold_tests /tmp/p8 ${TESTS_S:-90}
  run_on() {  # NAME BOUND TREE COMMAND...: the command in TREE if END leaves BOUND seconds
    local name=$1 bound=$2 tree=$3; shift 3
    [ $((END - SECONDS)) -lt $bound ] && { echo "$name $tree skipped at ${SECONDS}s"; return; }
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout $bound "$@" > /tmp/p8/${name}_${tree//\//_}.log 2>&1)
    echo "== $name $tree exit $? at ${SECONDS}s"
    grep -E '"tok_s|output_tok_s|fraction_of_roofline|"ttft|out_tok_s' /tmp/p8/${name}_${tree//\//_}.log | head -6
  }
  for run in ${P8_RUNS:-w6 w2 w1}; do
    for tree in . .bench/cur; do
      case $run in
      w6) run_on w6 110 $tree python3 benchmarks/moe.py --repeats ${W6_REPEATS:-1} --output /tmp/p8/w6_${tree//\//_}.json ;;
      w2) run_on w2 50 $tree python3 benchmarks/latency.py --weights bf16 ;;
      w1) run_on w1 70 $tree python3 benchmarks/throughput.py --data $PWD/.bench/w1_throughput.jsonl ;;
      esac
    done
  done
  tar czf "$OUT/part8.tar.gz" -C /tmp p8
  left=$((END - SECONDS))
  [ $left -gt 70 ] && timeout $left python3 benchmarks/gemv_bench.py --shapes qwen3-30b-a3b --sweep-bits 16 \
    --sweep-fold --sweep-budget-s $((left - 40)) --output /tmp/p8/gemv_fold.json > /tmp/p8/gemv_fold.log 2>&1
  grep '"best"' /tmp/p8/gemv_fold.log | cut -c1-300
  tar czf "$OUT/part8.tar.gz" -C /tmp p8 ;;
9)
  mkdir -p /tmp/p9
  END=${END:-560}
  timeout 170 python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl > /tmp/p9/w7.json 2> /tmp/p9/w7.err
  echo "== W7 exit $? at ${SECONDS}s"; grep -E '"out_tok_s|"total_tok_s|roofline|preempt|max_num' /tmp/p9/w7.json | head
  tar czf "$OUT/part9.tar.gz" -C /tmp p9
  ln -sfn "$PWD/.whl" .bench/base/.whl
  for tree in . .bench/base; do
    left=$((END - SECONDS))
    [ $left -lt 110 ] && { echo "W3 $tree skipped at ${SECONDS}s"; continue; }
    o=/tmp/p9/w3_${tree//\//_}; mkdir -p $o
    (cd $tree && OUT=$o W3_RUNS=poisson W3_TIMEOUT=$((left < 200 ? left - 10 : 190)) W3_ARGS="--synthetic 1600" \
      bash benchmarks/gpu_w3.sh > $o/run.log 2>&1)
    echo "== W3 $tree exit $? at ${SECONDS}s"; grep -E '"ratio|"p99' $o/run.log | head -12
  done
  tar czf "$OUT/part9.tar.gz" -C /tmp p9
  left=$((END - SECONDS))
  [ $left -gt 60 ] && fold_tests /tmp/p9 $((left - 20 < 90 ? left - 20 : 90))
  tar czf "$OUT/part9.tar.gz" -C /tmp p9 ;;
esac
