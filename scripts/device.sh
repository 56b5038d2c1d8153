#!/usr/bin/env bash
# Everything the GPU machine checks, in one call (device time is scarce):
#   build all example cubins in parallel with NVRTC, run the GPU tests (runtime ones
#   included: torch.compile, CUDA graphs, streams, cold/warm start), the host-overhead
#   comparison with SDPA FLASH, compute-sanitizer (racecheck, synccheck, memcheck) at a small
#   shape, then the benchmarks if asked.
# Usage (repo root, on the device):
#   bash scripts/device.sh [fa4stage] [numerics] [backward] [bwdwindow] [bwdab] [bwdcells] [fwdcells] [bwdtrace] [bwdvarlen] [varlen] [kvcache] [modifiers] [fp8] [distributed] [tests] [sanitize] [trace] [probe] [streamprobe] [bench ARGS...]
#   modifiers: tests/test_gpu_modifiers.py, tests/test_gpu_modifiers_backward.py and
#   tests/test_gpu_modifiers_learnable.py (score and keep modifiers, forward and backward,
#   learnable inputs' gradients), then compute-sanitizer on
#   scripts/sanitize_modifiers.py (examples/modifiers/ at ragged shapes, every tile class)
#   fp8: tests/test_gpu_fp8.py (the FP8 forward against the dequantized reference, issue 42),
#   then compute-sanitizer on scripts/sanitize_fp8.py (each FP8 kernel at ragged shapes)
#   varlen: tests/test_gpu_varlen.py, then compute-sanitizer on scripts/sanitize_varlen.py,
#   then VARLEN_BENCH's specs timed (VARLEN_BACKWARD=1: their backward, beside FA4's;
#   SPEC=PADDED: on equal lengths beside the padded spec, the same tokens)
#   bwdvarlen (and backward): tests/test_gpu_backward_varlen.py, then compute-sanitizer on
#   scripts/sanitize_backward_varlen.py
#   kvcache: tests/test_gpu_kvcache.py and test_gpu_serving_api.py (fadsl.attention_varlen and
#   attention_with_kvcache), compute-sanitizer on scripts/sanitize_kvcache.py, KV_BENCH
#   distributed (kind nvidia-h200-x2): tests/test_gpu_distributed.py, the context-parallel training
#   example, scripts/bench_context_parallel.py at CP_SEQLENS beside torch's context_parallel
#   tune: fadsl tune on TUNE_SPEC (from TUNE_FROM's specs too) within TUNE_BUDGET minutes, the winner then timed beside TUNE_AGAINST
#   tunebackward: fadsl tune --backward on each of TUNE_BWD_SPECS (the training examples)
#   calls: fadsl bench --calls (the public calls' host time per call beside SDPA and FA4, and
#   paged decode eager and from a CUDA graph beside cuDNN and FA4; FA4 when a call with
#   fa4stage came first and this one carries .fa4b)
#   backward: tests/test_gpu_backward.py and test_gpu_backward_variants.py (windows, softcap), then the backward timed (fadsl bench --backward)
#   for each example named in BWD_SPECS (NAME: with `backward {}` added; NAME+KEY...: those keys
#   on, e.g. fa3_causal+overlap; see tests/training_specs.py) at BWD_SEQLENS;
#   NAME=VAR1,VAR2 times the variants VAR1, VAR2 on the same tensors (--against); every spec
#   is built first, in parallel (scripts/prebuild.py --backward)
#   bwdwindow: scripts/window_backward_bench.py: fadsl.attention's backward with a causal window of
#   each of BWD_WINDOWS (default 1024) beside the causal one and FA4's, at BWD_WINDOW_SEQLENS
#   (default 8192,16384), head_dims BWD_WINDOW_DIMS (default 128)
#   fp8bench: scripts/fp8_bench.py (issue 42: fadsl's FP8 forward beside cuDNN's, errors and TF/s) with FP8_BENCH_ARGS; cuDNN's from a carried .whl-cudnn (see the script's header)
#   bwdprobe: the backward's budget and experiments: research/probes/probe_backward.py on each spec
#   of BWD_PROBE_SPECS (default the four training examples) with each define set of
#   BWD_PROBE_DEFINES (";"-separated, e.g. "FADSL_X=1;FADSL_Y=1 FADSL_Z=2"; none: skipped)
#   at BWD_PROBE_SEQLENS (default 1024,4096,16384), then scripts/backward_budget.py (each
#   kernel's share of a backward call) and Nsight Compute's SpeedOfLight, compute, warp-state
#   and memory sections for the main kernel of each of BWD_NCU_SPECS (default fa3_hopper and
#   fa3_hdim64; "": none) at 1 x 16384
#   bwdab: research/probes/backward_ab.py: development builds of each of BWD_AB_SPECS (default
#   fa3_hopper, fa3_causal), one per define set of BWD_AB_SETS (";"-separated, after the control
#   FADSL_NOTHING=1), timed sustained side by side at BWD_AB_SEQLENS (default 1024,4096,16384)
#   with BWD_AB_AGAINST (spec files or training variants' names, e.g. fa3_causal+prefetch_kv: other
#   backward blocks, as built) on the same tensors
#   bwdcells: issue 44's twelve cells, each example of BWD_CELL_SPECS (default the four training
#   examples) at each of BWD_CELL_SEQLENS (default "1024 4096 16384"): research/probes/bwd_vs_fa4.py
#   per cell (BWD_CELL_SECONDS, default 0.4, two rounds), then the markdown table
#   (scripts/backward_cells.py) in $OUT/bwd_cells.md
#   fwdcells: issue 46's table, each of FWD_CELLS (NAME:SEQLENS, default the shipped forward
#   examples at 1k-16k) by fadsl bench beside cuDNN, SDPA FLASH and FA4, into $OUT/fwd_cells.log
#   bwdtrace: scripts/backward_trace.py (the backward's m-block timeline) on each of
#   BWD_TRACE_SPECS (spec files, or training variants' names as BWD_SPECS takes them, e.g.
#   fa3_hopper+deterministic-dqred+s2; default the four training examples) at each of BWD_TRACE_SEQLENS
#   (default "1024 16384"), hidden 2048
#   fa4stage: copy the carried .fa4a (FlashAttention-4's first half) to /tmp/fa4; a later call
#   on the same warm machine that carries .fa4b installs it (bench times it then)
#   numerics: the numerics suite (tests/test_gpu_numerics.py: every kernel, every rescale mode,
#   adversarial scores against the float32 model and float64), before every change to
#   generated code
#   trace: scripts/tile_trace.py (where a tile's time goes) on TRACE_SPECS (default the head_dim
#   64 and 128 examples) at TRACE_SEQLENS (default "2048 8192"), hidden 2048
#   streamprobe: research/probes/stream_probe.py (decode's load path: TMA, cp.async, plain loads) and
#   Nsight Compute's L2 requests for each of STREAM_NCU (default "tma_128_3 cpasync_128_3 ldg")
#   probe: research/probes/energy_probe.py (what L2 -> SMEM traffic costs at the power cap) on
#   PROBE_SPECS (default fa3_hopper) at PROBE_SEQLENS (default "4096,16384")
#   GPU_TESTS: the pytest arguments instead of every GPU test file (e.g. "tests/test_gpu_sm90.py")
#   SANITIZE_ONLY: a regex of the kernel names scripts/sanitize.py runs (default: all)
#   BENCH_DTYPE (bf16/fp16; default the spec's first), BENCH_SEQLENS ("2048,4096"),
#   BENCH_HIDDEN (heads = hidden / head_dim, the FA papers' 2048; default 16 heads), BENCH_TAG
#   (a suffix for the result files, e.g. "_run2" when a spec is timed more than once),
#   BENCH_AGAINST ("a.fa b.fa": variants timed with each spec on the same tensors, as
#   fadsl:<kernel>), BENCH_ROUNDS (every contender timed that many times, in balanced orders; default one whole design)
set -uo pipefail
export PYTHONUNBUFFERED=1 FADSL_CACHE_DIR=$PWD/build/fadsl-cache  # build/ survives between calls on a warm machine
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# lark travels as a wheel; fadsl is installed non-editable so its grammar/ and emit/ resolve.
python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -c "
from fadsl.build.nvrtc import compiler_id, cuda_include_dirs
import cuda.bindings; print('cuda-bindings', cuda.bindings.__version__, '|', compiler_id(), '| headers', cuda_include_dirs())"

start=$SECONDS
if [[ ${PREBUILD:-1} == 1 ]]; then  # PREBUILD=0: build on first use instead
  python3 scripts/prebuild.py 2>&1 | tee "$OUT/prebuild.log" | tail -20
  echo "prebuild: $((SECONDS - start)) s"
fi

steps=" $* "
status=0
# checked NAME TEST_FILE SANITIZE_SCRIPT [PYTEST_ARGS...]: a GPU test file, then compute-
# sanitizer's racecheck, synccheck and memcheck on a script that runs the kernels once
checked() {
  local name=$1 tests=$2 script=$3
  shift 3
  python3 -P -m pytest -q -m gpu "$tests" -p no:cacheprovider --durations=5 --timeout=300 -rs "$@" 2>&1 | tee "$OUT/pytest_$name.log" | tail -25
  status=$((status | ${PIPESTATUS[0]}))
  for tool in racecheck synccheck memcheck; do
    echo "== compute-sanitizer --tool $tool ($name)"
    compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 python3 -P "$script" 2>&1 \
      | tee "$OUT/sanitize_${name}_$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|error" | tail -5
    status=$((status | ${PIPESTATUS[0]}))
  done
}
if [[ $steps == *" fa4stage "* ]]; then
  mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ && echo "fa4: first half staged in /tmp/fa4"
fi
if [[ -d .fa4b && -f /tmp/fa4/lib.part00 ]]; then
  source .fa4b/install.sh || status=1
fi
# for commands after this script in the same call (`source /tmp/fadsl-env.sh`): the installed
# packages, FA4's CuTe DSL folders when it was installed, fadsl's cubin cache
printf 'export PYTHONPATH=%q:%q FADSL_CACHE_DIR=%q\n' "$PYTHONPATH" "$PWD" "$FADSL_CACHE_DIR" > /tmp/fadsl-env.sh
if [[ $steps == *" numerics "* ]]; then
  python3 -P -m pytest -q -m gpu tests/test_gpu_numerics.py -p no:cacheprovider --durations=5 --timeout=300 -rs 2>&1 | tee "$OUT/pytest_numerics.log" | tail -25
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $steps == *" bwdvarlen "* || $steps == *" backward "* && ${BWD_TESTS:-1} == 1 ]]; then
  # the varlen backward's GPU tests (packed sequences, fadsl.attention_varlen's gradients),
  # then compute-sanitizer on scripts/sanitize_backward_varlen.py
  checked backward_varlen tests/test_gpu_backward_varlen.py scripts/sanitize_backward_varlen.py
fi
if [[ $steps == *" backward "* ]]; then
  # the backward's GPU tests, then its timing (BWD_SPECS: specs with a backward block,
  # written by the tests' training_spec into /tmp; BWD_SEQLENS)
  # BWD_TESTS=0: timing only
  names=$(echo ${BWD_SPECS:-} | tr ' =,' '\n\n\n')
  # (BWD_TESTS=0: the timed specs alone)
  python3 -P scripts/prebuild.py $([[ ${BWD_TESTS:-1} == 1 ]] && echo --backward || echo --backward-only) $names 2>&1 | tee "$OUT/prebuild_backward.log" | tail -3
  echo "prebuild (backward): $((SECONDS - start)) s"
  [[ ${BWD_TESTS:-1} == 1 ]] && checked backward tests/test_gpu_backward.py scripts/sanitize_backward.py -x tests/test_gpu_backward_variants.py
  for name in $names; do
    python3 -P -c "import sys; sys.path.insert(0, 'tests'); from training_specs import training_spec; open('/tmp/$name.fa', 'w').write(training_spec('$name'))"
  done
  for group in ${BWD_SPECS:-}; do
    name=${group%%=*}
    against=""
    [[ $group == *=* ]] && for variant in $(echo ${group#*=} | tr ',' ' '); do against="$against --against /tmp/$variant.fa"; done
    causal=$(grep -qE '^\s*mask\s+causal' /tmp/$name.fa && echo --causal)
    python3 -P -m fadsl.cli bench --backward /tmp/$name.fa $causal $against --hidden 2048 --seqlens ${BWD_SEQLENS:-1024,4096,16384} --json "$OUT/bwd_$name.json" 2>&1 | tee -a "$OUT/bench_backward.log" | tail -8
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" bwdprobe "* ]]; then
  bwd_examples="examples/fa3_hopper.fa examples/fa3_causal.fa examples/fa3_hdim64.fa examples/fa3_hdim64_causal.fa"
  IFS=';' read -ra define_sets <<< "${BWD_PROBE_DEFINES:-}"
  for defines in "${define_sets[@]}"; do
    for spec in ${BWD_PROBE_SPECS:-$bwd_examples}; do
      PROBE_CHECK=1 PROBE_DEFINES="$defines" python3 -P research/probes/probe_backward.py "$spec" --seqlens ${BWD_PROBE_SEQLENS:-1024,4096,16384} 2>&1 \
        | grep -v "^\[" | tee -a "$OUT/probe_backward.log" | tail -5
      status=$((status | ${PIPESTATUS[0]}))
    done
  done
  python3 -P scripts/backward_budget.py $bwd_examples 2>&1 | tee "$OUT/backward_budget.log" | tail -8
  status=$((status | ${PIPESTATUS[0]}))
  for spec in ${BWD_NCU_SPECS-examples/fa3_hopper.fa examples/fa3_hdim64.fa}; do
    timeout 240 ncu --clock-control none -k regex:'_bwd_bf16$' --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 -P scripts/ncu_one.py --backward "$spec" > "$OUT/ncu_$(basename "$spec" .fa).txt" 2>&1
    grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|Shared Memory|L1/TEX Hit|Max Bandwidth" "$OUT/ncu_$(basename "$spec" .fa).txt" | head -20
  done
fi
if [[ $steps == *" bwdab "* ]]; then
  for spec in ${BWD_AB_SPECS:-examples/fa3_hopper.fa examples/fa3_causal.fa}; do
    python3 -P research/probes/backward_ab.py "$spec" --sets "FADSL_NOTHING=1;${BWD_AB_SETS:?BWD_AB_SETS: the define sets to time}" \
      --seqlens ${BWD_AB_SEQLENS:-1024,4096,16384} --seconds ${BWD_AB_SECONDS:-0.8} \
      ${BWD_AB_AGAINST:+--against $BWD_AB_AGAINST} 2>&1 | grep -v "^\[" | tee -a "$OUT/backward_ab.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" bwdcells "* ]]; then
  # issue 44's table: each cell's backward beside cuDNN's and FA4's (FA4 where this call carries
  # .fa4b after a fa4stage call), sustained, then the table by scripts/backward_cells.py
  cells=()  # the cells that wrote their figures
  for name in ${BWD_CELL_SPECS:-fa3_causal fa3_hopper fa3_hdim64_causal fa3_hdim64}; do
    for seqlen in ${BWD_CELL_SEQLENS:-1024 4096 16384}; do
      echo "== $name $seqlen"
      json=$OUT/bwd_cell_${name}_$seqlen.json
      timeout 240 python3 -P research/probes/bwd_vs_fa4.py "examples/$name.fa" --seqlen "$seqlen" \
        --seconds ${BWD_CELL_SECONDS:-0.4} --rounds 2 --json "$json" 2>&1 \
        | tee -a "$OUT/bwd_cells.log" | grep -E "^(fadsl|cudnn|fa4) "
      status=$((status | ${PIPESTATUS[0]}))
      [[ -f $json ]] && cells+=("$json")
    done
  done
  (( ${#cells[@]} )) && python3 scripts/backward_cells.py "${cells[@]}" | tee "$OUT/bwd_cells.md"
fi
if [[ $steps == *" fwdcells "* ]]; then
  # issue 46's table: each shipped forward example beside cuDNN, SDPA FLASH and FA4 (FA4 where
  # this call carries .fa4b after a fa4stage call); NAME:SEQLENS picks the seqlens of a spec
  # that serves only some (fa3_hdim64_causal_short below 4k); `causal` in the name: --causal
  for cell in ${FWD_CELLS:-fa3_hdim64:1024,2048,4096,16384 fa3_hdim64_causal_short:1024,2048 \
      fa3_hdim64_causal:4096,16384 fa3_hopper:1024,2048,4096,16384 fa3_causal:1024,2048,4096,16384 \
      fa3_hdim256:1024,2048,4096,16384 fa3_hdim256_causal:1024,2048,4096,16384}; do
    name=${cell%%:*}
    echo "== $name ${cell#*:}"
    timeout 240 python3 -P -m fadsl.cli bench "examples/$name.fa" $([[ $name == *causal* ]] && echo --causal) \
      --hidden 2048 --seqlens "${cell#*:}" 2>&1 | tee -a "$OUT/fwd_cells.log" | tail -8
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" bwdtrace "* ]]; then
  for spec in ${BWD_TRACE_SPECS:-examples/fa3_hopper.fa examples/fa3_causal.fa examples/fa3_hdim64.fa examples/fa3_hdim64_causal.fa}; do
    if [[ ! -f $spec ]]; then  # a training variant's name, as BWD_SPECS takes (NAME+KEY...)
      python3 -P -c "import sys; sys.path.insert(0, 'tests'); from training_specs import training_spec; open('/tmp/$spec.fa', 'w').write(training_spec('$spec'))"
      spec=/tmp/$spec.fa
    fi
    for seqlen in ${BWD_TRACE_SEQLENS:-1024 16384}; do
      python3 -P scripts/backward_trace.py "$spec" --seqlen "$seqlen" --hidden 2048 2>&1 | tee -a "$OUT/backward_trace.log" | tail -18
      status=$((status | ${PIPESTATUS[0]}))
    done
  done
fi
if [[ $steps == *" bwdwindow "* ]]; then
  python3 -P scripts/window_backward_bench.py --windows ${BWD_WINDOWS:-1024} --seqlens ${BWD_WINDOW_SEQLENS:-8192,16384} \
    --head-dims ${BWD_WINDOW_DIMS:-128} --json "$OUT/bwd_window.json" 2>&1 | tee -a "$OUT/bench_backward.log" | tail -12
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $steps == *" fp8bench "* ]]; then
  # nvidia-cudnn-frontend (the cudnn module) where carried; without it cuDNN's row says why
  if compgen -G ".whl-cudnn/*.whl" >/dev/null; then
    python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl-cudnn/*.whl || status=1
  fi
  python3 -P scripts/fp8_bench.py ${FP8_BENCH_ARGS:-} --json "$OUT/fp8_bench.json" 2>&1 | tee "$OUT/fp8_bench.log" | tail -80
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $steps == *" varlen "* ]]; then
  # varlen (issue 31): its GPU tests, then compute-sanitizer on a ragged packed batch
  # (VARLEN_TESTS=0: neither); then `fadsl bench` on each spec of VARLEN_BENCH (mixed
  # lengths up to each of VARLEN_SEQLENS, VARLEN_TOKENS tokens, hidden 2048; FA4's varlen too)
  [[ ${VARLEN_TESTS:-1} == 1 ]] && checked varlen tests/test_gpu_varlen.py scripts/sanitize_varlen.py
  # SPEC=PADDED: equal lengths, the padded spec on the same tokens (packing's cost)
  for group in ${VARLEN_BENCH:-}; do
    spec=${group%%=*}
    against=""
    [[ $group == *=* ]] && against="--against ${group#*=}"
    causal=$(grep -qE '^\s*mask\s+causal' "$spec" && echo --causal)
    python3 -P -m fadsl.cli bench "$spec" $causal $against ${VARLEN_BACKWARD:+--backward} --hidden 2048 --seqlens ${VARLEN_SEQLENS:-1024,4096,16384} --tokens ${VARLEN_TOKENS:-32768} \
      --json "$OUT/varlen_$(basename "$spec" .fa).json" 2>&1 | tee -a "$OUT/bench_varlen.log" | tail -6
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" modifiers "* ]]; then
  checked modifiers tests/test_gpu_modifiers.py scripts/sanitize_modifiers.py tests/test_gpu_modifiers_backward.py tests/test_gpu_modifiers_learnable.py
fi
if [[ $steps == *" fp8 "* ]]; then
  [[ ${PREBUILD:-1} == 1 ]] || python3 -P scripts/prebuild.py --fp8 2>&1 | tail -12  # (PREBUILD=0: the FP8 kernels alone)
  checked fp8 tests/test_gpu_fp8.py scripts/sanitize_fp8.py
fi
if [[ $steps == *" kvcache "* ]]; then
  # kv-cache calls (issue 31): the GPU tests, compute-sanitizer on ragged caches with split
  # pieces (KV_TESTS=0: neither), then `fadsl bench` on each spec of KV_BENCH (decode's bytes
  # of K and V a second against cuDNN and FA4)
  [[ ${KV_TESTS:-1} == 1 ]] && checked kvcache tests/test_gpu_kvcache.py scripts/sanitize_kvcache.py tests/test_gpu_serving_api.py
  for spec in ${KV_BENCH:-}; do
    python3 -P -m fadsl.cli bench "$spec" --json "$OUT/kvcache_$(basename "$spec" .fa).json" 2>&1 | grep -v "^\[" | tee -a "$OUT/bench_kvcache.log" | tail -30
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" tunebackward "* ]]; then
  # fadsl tune --backward on each of TUNE_BWD_SPECS (default the four training examples) at
  # TUNE_BWD_SEQLENS, hidden 2048; each winner written to $OUT/tuned_bwd_NAME.fa
  for spec in ${TUNE_BWD_SPECS:-examples/fa3_hopper.fa examples/fa3_causal.fa examples/fa3_hdim64.fa examples/fa3_hdim64_causal.fa}; do
    python3 -P -m fadsl.cli tune --backward "$spec" --hidden 2048 --seqlens ${TUNE_BWD_SEQLENS:-1024,4096,16384} \
      -o "$OUT/tuned_bwd_$(basename "$spec" .fa).fa" 2>&1 | grep -v "^\[" | tee -a "$OUT/tune_backward.log" | tail -30
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" calls "* ]]; then
  python3 -P -m fadsl.cli bench --calls --json "$OUT/bench_calls.json" 2>&1 | tee "$OUT/bench_calls.log" | tail -25
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $steps == *" distributed "* ]]; then
  # (kind nvidia-h200-x2) tests/test_gpu_distributed.py, the training example checked against
  # one GPU, then scripts/bench_context_parallel.py at CP_SEQLENS beside torch's context_parallel
  export NCCL_NVLS_ENABLE=0
  python3 -P -m pytest -q -m gpu tests/test_gpu_distributed.py -p no:cacheprovider --durations=5 -rs 2>&1 | tee "$OUT/pytest_distributed.log" | tail -8
  status=$((status | ${PIPESTATUS[0]}))
  torchrun --nproc-per-node 2 examples/context_parallel_train.py --seqlen 16384 --steps 5 --check 2>&1 | grep -E "^(step|check)|Error" | tee "$OUT/cp_train.log"
  torchrun --nproc-per-node 2 scripts/bench_context_parallel.py --seqlens ${CP_SEQLENS:-16384,65536,131072} 2>&1 | grep -vE "^W|^\*|Warning" | tee "$OUT/bench_cp.log" | tail -20
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $steps == *" tune "* ]]; then
  # fadsl tune on TUNE_SPEC (default: issue 32's 2-consumer causal head_dim 64 spec) within
  # TUNE_BUDGET minutes, then the winner timed beside TUNE_AGAINST (the best hand-written spec)
  spec=${TUNE_SPEC:-tests/specs/sm90/tune_causal_hdim64.fa}
  causal=$(grep -qE '^\s*mask\s+causal' "$spec" && echo --causal)
  start=$SECONDS
  starts=""
  for start in ${TUNE_FROM:-}; do starts="$starts --from $start"; done
  python3 -P -m fadsl.cli tune "$spec" $causal $starts --hidden 2048 --budget ${TUNE_BUDGET:-5} -o "$OUT/tuned.fa" 2>&1 | tee "$OUT/tune.log" | grep -v "^\[" | tail -25
  status=$((status | ${PIPESTATUS[0]}))
  echo "tune: $((SECONDS - start)) s"
  if [[ -f "$OUT/tuned.fa" && -n "${TUNE_AGAINST:-examples/fa3_hdim64_causal.fa}" ]]; then
    python3 -P -m fadsl.cli bench "$OUT/tuned.fa" $causal --hidden 2048 --seqlens 2048,4096,8192,16384 --against ${TUNE_AGAINST:-examples/fa3_hdim64_causal.fa} 2>&1 | tee "$OUT/tune_vs_hand.log" | tail -8
    status=$((status | ${PIPESTATUS[0]}))
  fi
fi
if [[ $steps == *" tests "* || $# -eq 0 ]]; then
  # -P: import the installed fadsl (the one pip built), not the source folder
  python3 -P -m pytest -q -m gpu ${GPU_TESTS:-tests/test_gpu_runtime.py tests/test_gpu.py tests/test_gpu_general.py tests/test_gpu_sm90.py tests/test_gpu_split.py tests/test_gpu_cluster.py tests/test_gpu_softcap.py tests/test_gpu_window.py tests/test_gpu_varlen.py tests/test_gpu_kvcache.py tests/test_gpu_public_compile.py tests/test_gpu_append_kv.py tests/test_gpu_attention_variants.py} -p no:cacheprovider --durations=8 --timeout=120 -rs 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
  status=$((status | ${PIPESTATUS[0]}))
  bench_specs=examples/fa2_pipelined.fa
  if python3 -c "import torch, sys; sys.exit(torch.cuda.get_device_capability() != (9, 0))" && [[ -f examples/fa3_hopper.fa ]]; then
    bench_specs="$bench_specs examples/fa3_hopper.fa"
  fi
  for spec in $bench_specs; do
    python3 -P scripts/runtime_bench.py "$spec" 2>&1 | tee -a "$OUT/runtime_bench.log" | tail -3
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" sanitize "* || $# -eq 0 ]]; then
  for tool in racecheck synccheck memcheck; do
    echo "== compute-sanitizer --tool $tool"
    # --report-api-errors no: cuda-bindings probes the driver for every entry point it knows
    # (cuGetProcAddress answers "invalid value" for those newer than the driver); fadsl raises
    # on any failed driver call itself, so only the kernels' own errors are wanted here.
    compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 python3 scripts/sanitize.py "${SANITIZE_ONLY:-}" 2>&1 \
      | tee "$OUT/sanitize_$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|error" | tail -5
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" trace "* ]]; then
  for spec in ${TRACE_SPECS:-examples/fa3_hdim64.fa examples/fa3_hopper.fa}; do
    for seqlen in ${TRACE_SEQLENS:-2048 8192}; do
      python3 -P scripts/tile_trace.py "$spec" --seqlen "$seqlen" --hidden 2048 2>&1 | tee -a "$OUT/tile_trace.log" | tail -9
      status=$((status | ${PIPESTATUS[0]}))
    done
  done
fi
if [[ $steps == *" probe "* ]]; then
  for spec in ${PROBE_SPECS:-examples/fa3_hopper.fa}; do
    python3 -P research/probes/energy_probe.py "$spec" --seqlens "${PROBE_SEQLENS:-4096,16384}" 2>&1 \
      | grep -v "^fadsl bench" | tee -a "$OUT/energy_probe.log" | tail -8
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $steps == *" streamprobe "* ]]; then
  # decode's load path (issue 31): the paged cache streamed by TMA boxes, cp.async and plain
  # loads (research/probes/stream_probe.py), then Nsight Compute's L2 read requests and DRAM activity
  # for one launch of each at 128 x 8192 (the decode kernel asks 1.25x the requests cuDNN does)
  timeout 300 python3 -P research/probes/stream_probe.py 2>&1 | tee "$OUT/stream_probe.log" | tail -16
  status=$((status | ${PIPESTATUS[0]}))
  for variant in ${STREAM_NCU-tma_128_3 cpasync_128_3 ldg}; do  # STREAM_NCU="": no Nsight
    timeout 120 ncu --clock-control none --kernel-name $variant --launch-skip 5 --launch-count 1 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_lookup_hit.sum \
      python3 -P research/probes/stream_probe.py --shape 128x8192 --variant $variant 2>&1 | grep -v "^==PROF==" \
      | tee -a "$OUT/stream_probe_ncu.log" | grep -E "^  [a-z]|sum|pct" | tail -8
  done
fi
if [[ $steps == *" bench "* ]]; then
  shift $(( $(printf '%s\n' "$@" | grep -n '^bench$' | cut -d: -f1) ))
  # Build the cubins bench will time (its dtype) in parallel first (bench builds one at a time).
  python3 -P -c "
import os, sys, torch, fadsl
from fadsl.runtime.attention import arch_of
from concurrent.futures import ProcessPoolExecutor
ARCH = arch_of(0)
WANTED = os.environ.get('BENCH_DTYPE')  # bench times this dtype only (default: the first)
def build(s):
    kern = fadsl.load(s, verbose=False)
    dtypes = kern.config.dtypes
    for dtype in [d for d in dtypes if d.value == WANTED] if WANTED else dtypes[:1]:
        for built in kern.variants:
            built.cubin(dtype, ARCH)
    return s
with ProcessPoolExecutor(16) as pool:
    list(pool.map(build, sys.argv[1:]))
" "$@" ${BENCH_AGAINST:-} 2>&1 | tail -3
  against=""
  for variant in ${BENCH_AGAINST:-}; do against="$against --against $variant"; done
  mkdir -p "$OUT/bench"
  for spec in "$@"; do
    causal=$(grep -qE '^\s*mask\s+causal' "$spec" && echo --causal)
    name=$(basename "$spec" .fa)${BENCH_DTYPE:+_$BENCH_DTYPE}${BENCH_TAG:-}
    python3 -P -m fadsl.cli bench "$spec" $causal ${BENCH_DTYPE:+--dtype $BENCH_DTYPE} ${BENCH_SEQLENS:+--seqlens "$BENCH_SEQLENS"} ${BENCH_HIDDEN:+--hidden $BENCH_HIDDEN} \
      $against ${BENCH_ROUNDS:+--rounds $BENCH_ROUNDS} --json "$OUT/bench/$name.json" --plot "$OUT/bench/$name.png" 2>&1 | tee -a "$OUT/bench/bench.log" | tail -9
  done
  # At most 8 files come back from the device: one archive of the results (a second call
  # in one device run gets its own, not the first one's name).
  archive="$OUT/bench${BENCH_DTYPE:+_$BENCH_DTYPE}${BENCH_TAG:-}"
  n=2; base=$archive
  while [[ -e "$archive.tar" ]]; do archive="${base}_$n"; n=$((n + 1)); done
  tar -C "$OUT" -cf "$archive.tar" bench && rm -r "$OUT/bench"
fi
echo "device.sh status $status"
exit $status
