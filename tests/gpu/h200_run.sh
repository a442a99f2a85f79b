#!/usr/bin/env bash
# One device call on the lent H200: GPU tests and benchmarks, logs under $OUT.
# The GPU box has Python 3.12, its own packages and no index, so ninfer goes on the path through a
# namespace folder of links instead of a pip install. build/cubins (compiled on the CPU machine; NVRTC
# needs no GPU) and .carry/oracle (tests/gpu/make_oracle.py) travel with the call; the cubins may travel packed
# (about a quarter of the bytes: room for the whole oracle under the carry limit). `make gpu-carry` makes both.
#   STAGES="tests racecheck tune bench-ops ncu-ops bench-27b bench-27b-bf16 bench-35b bench-35b-bf16 bench-serve serve-load moe-ab split-ab chunk-ab w8a8-ab w8a8-kl moe-decode-ab spec spec-cb spec-wy spec-dv spec-dh" (default: tests bench-27b bench-35b)
#   MOE_FORMS="1 2 3" (moe-decode-ab: its forms by number, default all)
#   TESTS="tests/gpu/test_a_gpu.py ..." (default: every GPU test file), TEST_TIMEOUT (s per file, default 420), TEST_JOBS (files at a time, default 1), TEST_K (a pytest -k expression), BENCH_OPS="linear_q4 ..." (default: all), BENCH_ROUTES="prefill*" (default: all), BENCH_T="4 32" (default: all), SPEC_SHAPES (spec: default both shapes)
set -uo pipefail
FINAL=${OUT:-/tmp/out}; OUT=$FINAL/logs; mkdir -p "$OUT"   # only 8 files come back: logs are tarred at the end
ROOT=$(pwd)
NS=/tmp/ninfer-ns/ninfer; mkdir -p "$NS"
for layer in codegen runtime server cli; do ln -sfn "$ROOT/$layer" "$NS/$layer"; done
export PYTHONPATH=/tmp/ninfer-ns:$ROOT PYTHONUNBUFFERED=1 NINFER_ORACLE_DIR=$ROOT/.carry/oracle
PY=${PY:-python3}
STAGES=${STAGES:-tests bench-27b bench-35b}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; $PY -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda.bindings', cuda.bindings.__version__)"; } 2>&1 | tee "$OUT/env.log"
[ -f .carry/cubins.tgz ] && mkdir -p build/cubins && tar xzf .carry/cubins.tgz -C build/cubins
$PY -m ninfer.codegen 2>&1 | tee "$OUT/generate.log"
$PY -m ninfer.runtime.build --archs sm_90a 2>&1 | tail -2 | tee "$OUT/build.log"
test_file() {
  name=$(basename "$1" .py)
  timeout ${TEST_TIMEOUT:-420} $PY -m pytest -q -m gpu "$1" -p no:cacheprovider --maxfail=30 --timeout=300 --timeout-method=thread ${TEST_K:+-k "$TEST_K"} \
    > "$OUT/$name.log" 2>&1
  echo "$name: $(tail -1 "$OUT/$name.log")"
}
bench_filter() {  # ninfer-bench ops' filters from BENCH_OPS, BENCH_ROUTES and BENCH_T (token counts)
  for o in ${BENCH_OPS:-}; do echo --op $o; done; for r in ${BENCH_ROUTES:-}; do echo --route $r; done
  for t in ${BENCH_T:-}; do echo --tokens $t; done
}
run_tests() {  # each file in its own process (a faulting kernel must not hide the other results), TEST_JOBS at a time
  { for f in ${TESTS:-tests/gpu/test_*_gpu.py}; do
      test_file "$f" &
      while [ $(jobs -rp | wc -l) -ge ${TEST_JOBS:-1} ]; do wait -n; done
    done; wait; } | tee "$OUT/tests-summary.log"
}
for stage in $STAGES; do
  case $stage in
    tests) run_tests ;;
    tune)  # ninfer-tune (TUNE: one run's arguments, or several separated by ';', each under BENCH_TIMEOUT and writing what
      # it finished before the cut), then regenerate so the later stages run on the new tables; the file comes back in the logs
      IFS=';' read -ra runs <<< "${TUNE:---shape qwen3.6-27b --weights q4 --op linear_q4}"
      for run in "${runs[@]}"; do
        timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.tune $run --max-seconds $(( ${BENCH_TIMEOUT:-500} - 120 )) >> "$OUT/tune.log" 2>&1
        tail -2 "$OUT/tune.log"
      done
      cp specs/tuned/*.yaml "$OUT/"; $PY -m ninfer.codegen > /dev/null ;;
    bench-ops) timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench ops $(bench_filter) --json "$OUT/bench-ops.json" > "$OUT/bench-ops.log" 2>&1; tail -30 "$OUT/bench-ops.log" ;;
    ncu-ops)  # ninfer-bench ops (BENCH_OPS, BENCH_ROUTES, BENCH_T) under Nsight Compute: where a kernel's time goes (stall
      # reasons; per SASS instruction in ncu-sass.log). NCU_KERNEL: a kernel-name regex (the generated symbols name op and
      # route); NCU_SKIP matching launches skipped, then NCU_COUNT profiled (default 0 / 2). The clocks stay as they are
      # (--clock-control none: the device's METHOD.md). The reports come back as text.
      timeout ${BENCH_TIMEOUT:-500} ncu --clock-control none --kernel-name "regex:${NCU_KERNEL:-.}" --launch-skip ${NCU_SKIP:-0} \
        --launch-count ${NCU_COUNT:-2} --set full --import-source no -o /tmp/ncu-ops -f \
        $PY -m ninfer.cli.bench ops $(bench_filter) --reps 3 > "$OUT/ncu-run.log" 2>&1
      ncu --import /tmp/ncu-ops.ncu-rep --page details --print-details all > "$OUT/ncu-ops.log" 2>&1
      ncu --import /tmp/ncu-ops.ncu-rep --page source --print-source sass > "$OUT/ncu-sass.log" 2>&1
      grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Stall|Registers Per|Achieved Occupancy" "$OUT/ncu-ops.log" | head -60 ;;
    racecheck)  # compute-sanitizer's shared-memory race check over TESTS (TEST_K): one process, the first hazards reported
      for f in ${TESTS:-tests/gpu/test_gdn_verify_gpu.py}; do
        timeout ${TEST_TIMEOUT:-420} compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 20 \
          $PY -m pytest -q -m gpu "$f" -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} > "$OUT/racecheck-$(basename "$f" .py).log" 2>&1
        tail -4 "$OUT/racecheck-$(basename "$f" .py).log"
      done ;;
    bench-27b) timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model --shape qwen3.6-27b ${BENCH27:-} --json "$OUT/bench-27b.json" 2>&1 | tee "$OUT/bench-27b.log" ;;
    bench-27b-bf16) timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model --shape qwen3.6-27b --weights bf16 ${BENCH27_BF16:-} --json "$OUT/bench-27b-bf16.json" 2>&1 | tee "$OUT/bench-27b-bf16.log" ;;
    bench-serve) timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench serve --resources-from .carry/demo/demo.ninfer --workdir /tmp/ninfer-bench ${BENCH_SERVE:-} --json "$OUT/bench-serve.json" 2>"$OUT/bench-serve.err" | tee "$OUT/bench-serve.log"; tail -5 "$OUT/bench-serve.err" ;;
    serve-load) timeout 300 $PY tests/gpu/serve_load.py .carry/demo/demo.ninfer --clients 8 --max-tokens 256 2>&1 | tee "$OUT/serve-load.log" | tail -16 ;;
    bench-35b-bf16) timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model --shape qwen3.6-35b-a3b --weights bf16 ${BENCH35_BF16:-} --json "$OUT/bench-35b-bf16.json" 2>&1 | tee "$OUT/bench-35b-bf16.log" ;;
    bench-35b) timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model --shape qwen3.6-35b-a3b ${BENCH35:-} --json "$OUT/bench-35b.json" 2>&1 | tee "$OUT/bench-35b.log" ;;
    moe-ab)  # the 35B-A3B q4 model with the MoE expert forms off, split for decode, and split + grouped
      for form in "off off" "16 off" "16 17"; do set -- $form
        NINFER_MOE_SPLIT_MAX_T=$1 NINFER_MOE_GROUPED_MIN_T=$2 timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model \
          --shape qwen3.6-35b-a3b --weights q4 ${BENCH35:-} --json "$OUT/moe-ab-$1-$2.json" 2>&1 | tee "$OUT/moe-ab-$1-$2.log"
      done ;;
    split-ab)  # decode attention as flash decoding (split + merge; SPLIT_POLICIES of blocks/max-splits) against paged_attention alone
      for pol in ${SPLIT_POLICIES:-128/32 off}; do for shape in qwen3.6-27b qwen3.6-35b-a3b; do
        if [ $pol = off ]; then env=NINFER_ATTN_SPLIT_MAX_T=off; else env="NINFER_ATTN_SPLIT_BLOCKS=${pol%/*} NINFER_ATTN_SPLIT_MAX_KS=${pol#*/}"; fi
        echo "# split policy $pol"; env $env timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model --shape $shape --weights q4 \
          ${SPLIT_AB:---prompts 1024 --concurrency 1,2,4,8 --steps 64} --json "$OUT/split-ab-$shape-${pol/\//-}.json" 2>&1 | tee "$OUT/split-ab-$shape-${pol/\//-}.log"
      done; done ;;
    w8a8-ab)  # 27B fp8 prefill: dequant_fp8 + the bf16 GEMM (off) against the FP8 tensor cores from 256 tokens
      for min_t in off 256; do
        NINFER_FP8_W8A8_MIN_T=$min_t timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model --shape qwen3.6-27b --weights fp8 \
          --prompts 8192 --concurrency 1 --steps 8 --prefill-reps 3 --json "$OUT/w8a8-ab-$min_t.json" 2>&1 | tee "$OUT/w8a8-ab-$min_t.log"
      done ;;
    w8a8-kl)  # the tiny dense oracle's fp8 artifact against its bf16 one (ninfer-perplexity kl, cuda), W8A8 off / from 256 tokens
      $PY -c "import random; random.seed(0); print(' '.join(str(random.randrange(1024)) for _ in range(4096)))" > "$OUT/kl-ids.txt"
      for min_t in off 256; do
        NINFER_FP8_W8A8_MIN_T=$min_t timeout 120 $PY -m ninfer.cli.perplexity kl .carry/oracle/dense.fp8.ninfer .carry/oracle/dense.ninfer \
          --ids "$OUT/kl-ids.txt" --window 512 --backend cuda --json 2>&1 | tee "$OUT/w8a8-kl-$min_t.log" | tail -1
      done ;;
    moe-decode-ab)  # 35B-A3B q4 decode: the gate add outside the add-norm, then inside (the default); the router's weights
      # loaded before its PDL wait (gemv_row.g8 forced: at C = 8 too, where the table takes wgmma). MOE_FORMS: which, by number
      forms=("NINFER_MOE_GATE_ADD_NORM=0" "NINFER_MOE_GATE_ADD_NORM=1" "NINFER_ROUTES=moe_router=gemv_row.g8")
      for i in ${MOE_FORMS:-1 2 3}; do form=${forms[$((i - 1))]}; echo "# form $i: $form"
        env $form timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model --shape qwen3.6-35b-a3b --weights q4 \
          ${BENCH35:---prompts 1024 --concurrency 1,2,8 --steps 64 --prefill-reps 1} --json "$OUT/moe-decode-ab-$i.json" 2>&1 | tee "$OUT/moe-decode-ab-$i.log"
      done ;;
    spec)  # speculative decoding against plain decoding, 27B and 35B-A3B q4, MTP and n-gram drafts (rejected, then injected);
      # no --profile by default: a mode's profile runs after its timed calls, and the later modes' would then be timed
      # with CUPTI attached (BENCH_SPEC="--concurrency 8 --profile" for where a round's time goes)
      for shape in ${SPEC_SHAPES:-qwen3.6-27b qwen3.6-35b-a3b}; do for method in ${SPEC_METHODS:-mtp ngram}; do
        timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench spec --shape $shape --weights q4 --method $method \
          ${BENCH_SPEC:---concurrency 1,8} --json "$OUT/spec-$shape-$method.json" 2>&1 | tee "$OUT/spec-$shape-$method.log"
      done; done
      # through ninfer-serve too (n-gram drafts: whatever the random model's sampled answers repeat), 27B q4, C = 1 and 8;
      # SPEC_SERVE=0 skips it (it needs .carry/demo, which does not fit in one call beside .carry/oracle)
      [ "${SPEC_SERVE:-1}" = 1 ] && timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench serve --resources-from .carry/demo/demo.ninfer --workdir /tmp/ninfer-bench \
        --weights q4 --prompts 1024 --concurrency 1,8 --peer none \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' --json "$OUT/spec-serve-ngram.json" \
        2>&1 | tee "$OUT/spec-serve-ngram.log" ;;
    spec-dv)  # MTP rounds with drafts over a draft vocabulary (NInfer's --lm-head-draft shortlist size), 27B and 35B-A3B q4
      for shape in qwen3.6-27b qwen3.6-35b-a3b; do
        timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench spec --shape $shape --weights q4 --method mtp \
          --draft-vocab-size ${DRAFT_VOCAB:-131072} ${BENCH_SPEC:---concurrency 1,8} --json "$OUT/spec-dv-$shape.json" 2>&1 | tee "$OUT/spec-dv-$shape.log"
      done ;;
    spec-cb)  # MTP rounds with the GDN commit in line, then beside the draft steps (NINFER_SPEC_COMMIT_BESIDE), SPEC_SHAPES q4
      for shape in ${SPEC_SHAPES:-qwen3.6-27b qwen3.6-35b-a3b}; do for cb in 0 1; do
        NINFER_SPEC_COMMIT_BESIDE=$cb timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench spec --shape $shape --weights q4 \
          --method mtp ${BENCH_SPEC:---concurrency 1,8} --json "$OUT/spec-cb-$shape-$cb.json" 2>&1 | tee "$OUT/spec-cb-$shape-$cb.log"
      done; done ;;
    spec-wy)  # MTP rounds with gdn_verify on its table, then on the WY route (NINFER_ROUTES), 27B and 35B-A3B q4
      for pair in "qwen3.6-27b wy_cluster.g3" "qwen3.6-35b-a3b wy_cluster.g2"; do set -- $pair; for wy in "" "gdn_verify=$2"; do
        tag=$([ -n "$wy" ] && echo wy || echo table)
        NINFER_ROUTES=$wy timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench spec --shape $1 --weights q4 --method mtp \
          ${BENCH_SPEC:---concurrency 1,8} --json "$OUT/spec-wy-$1-$tag.json" 2>&1 | tee "$OUT/spec-wy-$1-$tag.log"
      done; done ;;
    spec-dh)  # the recipe's formats (q6 lm_head), MTP drafts over the whole head, then over a q4 draft head (--draft-head)
      for shape in qwen3.6-27b qwen3.6-35b-a3b; do for dh in "" "--draft-vocab-size ${DRAFT_VOCAB:-131072} --draft-head"; do
        tag=$([ -n "$dh" ] && echo dh || echo full)
        timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench spec --shape $shape --weights recipe --method mtp $dh \
          ${BENCH_SPEC:---concurrency 1,8} --json "$OUT/spec-dh-$shape-$tag.json" 2>&1 | tee "$OUT/spec-dh-$shape-$tag.log"
      done; done ;;
    chunk-ab)  # 27B q4 prefill with prefill chunks of 1024, 4096 and 8192 tokens
      for chunk in 1024 4096 8192; do
        timeout ${BENCH_TIMEOUT:-500} $PY -m ninfer.cli.bench model --shape qwen3.6-27b --weights q4 --prompts ${CHUNK_PROMPTS:-8192} \
          --concurrency 1 --steps 8 --prefill-chunk $chunk --json "$OUT/chunk-ab-$chunk.json" 2>&1 | tee "$OUT/chunk-ab-$chunk.log"
      done ;;
  esac
done
tar czf "$FINAL/logs.tar.gz" -C "$FINAL" logs && rm -rf "$OUT"
