#!/usr/bin/env bash
# One device call = several stages that belong together, each under its own time limit so a slow
# stage cannot starve the next, every log under $OUT (it comes back even if the call is cut).
#
#   bash benchmarks/device_run.sh STAGE[:SECONDS] ...
#
# STAGE may be A+B+...: those stages run side by side, each under the limit (the GPU test files
# are small and mostly wait on builds and float64 references on 16 CPU cores; timings do not
# belong in such a group).
#
# Stages: fa4-part1 (FlashAttention-4's first part to /var/tmp/fa4, below), tests-bwd (the
# backward kernels, tests/gpu/test_backward_gpu.py), tests-sm90 (the one-pass Hopper backward
# and its fuzz), tests-fp8 (its fp8 recipe's kernel; FP8_TESTS: extra pytest args),
# tests-kvblock (the fp8 recipe through the public API: emulation, audit, fuzz of
# FLAMIA_FUZZ_CASES), long-check (benchmarks/fp8_long_check.py LONG_ARGS: fp8's kernels vs
# float64 at 32k tokens), passes (benchmarks/bwd_fp8_passes_dev.py PASSES_ARGS: launch settings
# of the fp8 backward's pre and post passes), dev (benchmarks/bwd_sm90_dev.py DEV_ARGS), abp
# (the backward modules of the prepared patches ABP_PATCHES timed in one process next to this
# tree's, ABP_ARGS), fabp (stacks of prepared forward patches, FABP_PATCHES="a a+b", timed by
# fwd_ab.py next to this tree's forward modules, also loaded as a copy "main": the checks'
# reference, and main against current is the noise; FABP_ARGS), fwd-ab
# (fp8 forward kernels against copies, benchmarks/fwd_ab.py FWD_AB_ARGS), tests-fwd-kvblock
# (fp8's forward kernels), tests-fwd, cute-probe (benchmarks/cute_dsmem_probe.py: a CuTe DSL
# 2-CTA cluster's shared-memory exchange, built and checked; needs the FA4 parts for CuTe DSL),
# cute-bwd (benchmarks/cute_bwd_sm90.py CUTE_ARGS, default --check --time: the CuTe DSL bf16
# backward against float64 and timed next to the Gluon kernel and FA4; needs the FA4 parts),
# tests-base (the cuDNN training baseline), tests-compile
# (torch.compile and CUDA graphs), tests (all), bench (every kernel recipe, every baseline;
# BENCH_RECIPES), bench-fp8 (fp8 rows + fastest baselines only), graphs
# (benchmarks/graph_timing.py GRAPH_ARGS), fwd-sweep (Triton forward configs, fwd_dev.py
# --quick), fwd-cands (Triton forward FP8 configs FWD_CANDS vs the default), quant
# (benchmarks/quant_ab.py QUANT_ARGS: launch configs and copies of quantize.py), profile (PROFILE_ARGS),
# profile-fwd, train (flamia train-check, TRAIN_ARGS), gaps (GPU idle between kernels and host
# syncs of back-to-back calls, GAP_WORKLOADS), host (HOST_ARGS; cProfile of the host side,
# benchmarks/host_profile.py), ncu, ncu-src (per-instruction warp samples of the forward and
# one-pass backward kernels: benchmarks/ncu_source.py; NCU_WORKLOAD, default doc8k_x4), ncu-bwd
# (the bf16 backward, flamia sm90 and FA4, benchmarks/ncu_bwd_sm90.py; NCU_WORKLOADS;
# NCU_ARGS=--fp8: flamia's fp8 kernel instead), ptest-NAME / pab-NAME (a prepared patch,
# benchmarks/patches/NAME.patch, applied to a copy of the tree in /tmp/patched/NAME: the GPU
# tests of each kernel module it changes there (backward_sm90.py: both backward kernels';
# forward.py, forward_gluon.py, config.py: the forward's), PATCH_TESTS: more pytest args; the
# backward and the Gluon forward timed against this tree's module in one process
# (bwd_sm90_dev.py --fp8 --ab: the whole backward, both recipes; fwd_ab.py --gluon: the forward
# kernel at D=128; quantize.py: quant_ab.py against this tree's quantize_qkv, with the forward's
# and the fp8 API's GPU tests; a Triton forward or config patch gets no A/B), PAB_ARGS /
# PAB_FWD_ARGS / PAB_QUANT_ARGS: more args of the backward's / the forward's / quantize's A/B script; pprof-NAME: profile_call.py PROFILE_ARGS in the
# patched tree, to set against a `profile` stage of this tree in the same call; prun-NAME:
# the command line PRUN_CMD in the patched tree, e.g. an A/B script the patch brings; a ptest and a
# pab of one patch must not share a + group).
# Needs: the cudnn-frontend wheel in .whl/ (carry ".whl"), FLAMIA_GIT_COMMIT set by the caller
# as a literal sha: the device's .git is the session's first snapshot, so `git rev-parse` there
# (or $(git rev-parse ...) inside the command) names a stale commit.
#
# FlashAttention-4 (the fa4 baseline of bench, graphs specs, train-check run fa4): its
# CuTe DSL library is more than one call may carry, so it comes in two parts that
# `bash ../shared/tools/fa4_wheels.sh .fa4` builds here (.fa4/a, .fa4/b; .fa4 is git-ignored),
# over two calls on the same machine, the second within its 30 s warm window after the first:
#   call 1, carry [".fa4/a"]:          FLAMIA_GIT_COMMIT=<sha> bash benchmarks/device_run.sh fa4-part1
#   call 2, carry [".fa4/b", ".whl"]:  FLAMIA_GIT_COMMIT=<sha> bash benchmarks/device_run.sh bench:540
# Whenever .fa4/b/activate.sh is here, the script installs FA4 from both parts into /tmp/fa4site
# (once per machine) and puts it on PYTHONPATH before any stage; env.txt says whether it did. If
# the first part is missing (the machine went back between the calls), every stage still runs,
# the fa4 rows are skipped with the reason, and call 1 has to be made again.
set -u
# the caller vouches that the tree is that commit: the snapshot .git would call it dirty
[ -n "${FLAMIA_GIT_COMMIT:-}" ] && export FLAMIA_GIT_DIRTY=${FLAMIA_GIT_DIRTY:-0}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
      torch.cuda.get_device_name())' 2>&1 | tee "$OUT/env.txt"
if [ -f .fa4/b/activate.sh ]; then  # FlashAttention-4 (header): install once, then on PYTHONPATH
  if source .fa4/b/activate.sh >>"$OUT/env.txt" 2>&1; then
    python -c 'from importlib.metadata import version as v; print("fa4: flash-attn-4",
      v("flash-attn-4"), "nvidia-cutlass-dsl", v("nvidia-cutlass-dsl"))' 2>&1 | tee -a "$OUT/env.txt"
  else
    echo "fa4: not installed (activate.sh rc=$?, see env.txt): its rows are skipped" \
      | tee -a "$OUT/env.txt"
  fi
fi

# Nsight Compute (stages ncu, ncu-src): on PATH or in its default install directory
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)

summary="$OUT/summary.txt"
patched_tree() {  # NAME: /tmp/patched/NAME, the tree with benchmarks/patches/NAME.patch applied
  # (kept for the later stages of a call and of later calls on a warm machine while the tree and
  # the patch are the same: .applied holds their content hash, so an edited patch is re-applied)
  local d=/tmp/patched/$1 p=$PWD/benchmarks/patches/$1.patch files key
  files="flamia tests benchmarks pyproject.toml README.md"
  key=$({ tar cf - --sort=name --mtime=@0 --owner=0 --group=0 --exclude=benchmarks/results \
            $files; cat "$p"; } | sha1sum | cut -c1-40)
  if [ "$(cat "$d/.applied" 2>/dev/null)" != "$key" ]; then
    rm -rf "$d" && mkdir -p "$d" || return 1
    tar cf - --exclude=benchmarks/results $files | tar xf - -C "$d"
    (cd "$d" && { git apply "$p" 2>/dev/null || patch -s -p1 <"$p"; }) || return 1
    echo "$key" >"$d/.applied"
  fi
  echo "$d"
}
: >"$summary"
run_stage() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${secs}s) ==="
  timeout --signal=TERM --kill-after=15 "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$summary"
}

stage() {  # name seconds: one stage
  local name=$1 secs=$2
  case $name in
    fa4-part1) run_stage "$name" "$secs" bash -c 'mkdir -p /var/tmp/fa4 &&
             cp .fa4/a/part.aa /var/tmp/fa4/ && ls -l /var/tmp/fa4' ;;
    tests-bwd) run_stage "$name" "$secs" python -m pytest -q -x tests/gpu/test_backward_gpu.py ;;
    tests-sm90) run_stage "$name" "$secs" python -m pytest -q -s tests/gpu/test_backward_sm90_gpu.py ;;
    tests-fp8) run_stage "$name" "$secs" python -m pytest -q -s -x tests/gpu/test_backward_sm90_fp8_gpu.py ${FP8_TESTS:-} ;;
    tests-kvblock) run_stage "$name" "$secs" python -m pytest -q -s -x \
             tests/gpu/test_kvblock_kernels_gpu.py ;;
    passes) run_stage "$name" "$secs" python benchmarks/bwd_fp8_passes_dev.py ${PASSES_ARGS:-} ;;
    long-check) run_stage "$name" "$secs" python benchmarks/fp8_long_check.py ${LONG_ARGS:-} ;;
    dev) run_stage "$name" "$secs" python benchmarks/bwd_sm90_dev.py ${DEV_ARGS:-} ;;
    fwd-ab) run_stage "$name" "$secs" python benchmarks/fwd_ab.py ${FWD_AB_ARGS:-} ;;
    tests-fwd-kvblock) run_stage "$name" "$secs" python -m pytest -q -x \
             tests/gpu/test_forward_kvblock_gpu.py ;;
    tests-fwd) run_stage "$name" "$secs" python -m pytest -q tests/gpu/test_forward_gpu.py ;;
    cute-probe) run_stage "$name" "$secs" python benchmarks/cute_dsmem_probe.py ;;
    cute-bwd) run_stage "$name" "$secs" python benchmarks/cute_bwd_sm90.py ${CUTE_ARGS:---check --time} ;;
    tests) run_stage "$name" "$secs" python -m pytest -q tests/gpu ;;
    tests-base) run_stage "$name" "$secs" python -m pytest -q tests/gpu/test_baselines_gpu.py ;;
    tests-compile) run_stage "$name" "$secs" python -m pytest -q tests/gpu/test_compile_gpu.py \
             tests/gpu/test_cuda_graphs_gpu.py ;;
    graphs) run_stage "$name" "$secs" python benchmarks/graph_timing.py ${GRAPH_ARGS:-} ;;
    bench) run_stage "$name" "$secs" python -m flamia bench --quick \
             --max-minutes "$(python -c "print(round(($secs - 25) / 60, 2))")" \
             --recipes "${BENCH_RECIPES:-fp8,bf16}" \
             --baselines "${BENCH_BASELINES:-all}" --out "$OUT" ;;
    bench-fp8) run_stage "$name" "$secs" python -m flamia bench --quick \
             --max-minutes $(( (secs - 60) / 60 )) --recipes fp8 --baselines sdpa_cudnn,cudnn,fa4 \
             --no-accuracy --out "$OUT" ;;
    fwd-sweep) run_stage "$name" "$secs" python benchmarks/fwd_dev.py --quick ;;
    fwd-cands) run_stage "$name" "$secs" python benchmarks/fwd_dev.py --no-usage \
             --budget-s $((secs - 30)) --fp8-configs "$FWD_CANDS" --rounds "${FWD_ROUNDS:-3}" \
             --sweep "${FWD_WORKLOADS:-doc8k_x4,longtail,doc512_x64,d64_doc8k_x4,d64_longtail}" ;;
    quant) run_stage "$name" "$secs" python benchmarks/quant_ab.py ${QUANT_ARGS:-} ;;
    profile) run_stage "$name" "$secs" python benchmarks/profile_call.py ${PROFILE_ARGS:-} ;;
    train) run_stage "$name" "$secs" python -m flamia.train --out "$OUT/train_check" \
             --time-limit $((secs - 40)) ${TRAIN_ARGS:-} ;;
    profile-fwd) run_stage "$name" "$secs" python benchmarks/profile_call.py --forward-only ;;
    gaps) run_stage "$name" "$secs" python benchmarks/profile_call.py --gaps \
             --only "${GAP_WORKLOADS:-doc32k,doc8k_x4,doc512_x64,d64_doc8k_x4}" ;;
    host) run_stage "$name" "$secs" python benchmarks/host_profile.py ${HOST_ARGS:-} ;;
    ncu) # hardware counters of one fp8 fwd+bwd call (NCU_CALL_ARGS, default doc8k_x4)
      run_stage "$name" "$secs" "$NCU" --clock-control none --profile-from-start off \
        --set detailed --import-source no -f -o "$OUT/ncu" python benchmarks/ncu_call.py \
        ${NCU_CALL_ARGS:-}
      "$NCU" --import "$OUT/ncu.ncu-rep" --page details >"$OUT/ncu-details.txt" 2>&1
      "$NCU" --import "$OUT/ncu.ncu-rep" --page raw --csv >"$OUT/ncu-raw.csv" 2>&1
      rm -f "$OUT/ncu.ncu-rep"   # (too large to come back; the CSV holds every metric)
      python benchmarks/ncu_summary.py "$OUT/ncu-raw.csv" --memory-columns "$OUT/ncu-memory.txt" \
        | tee "$OUT/ncu-summary.txt" ;;
    ncu-src) # per-SASS-instruction warp-state samples of the forward and backward kernels, doc8k_x4 fp8
      run_stage "$name" "$secs" "$NCU" --clock-control none --profile-from-start off \
        --section SourceCounters --section SpeedOfLight --section WarpStateStats \
        -k 'regex:attn_fwd|attn_bwd_sm90' --import-source no -f -o "$OUT/ncusrc" \
        python benchmarks/ncu_call.py --only "${NCU_WORKLOAD:-doc8k_x4}" ${NCU_CALL_ARGS:-}
      "$NCU" --import "$OUT/ncusrc.ncu-rep" --page source --csv --print-source sass \
        >"$OUT/ncu-source.csv" 2>&1
      head -c 1500 "$OUT/ncu-source.csv"; echo
      "$NCU" --import "$OUT/ncusrc.ncu-rep" --page details >"$OUT/ncu-src-details.txt" 2>&1
      grep -E "^  [_a-z]|SM Frequency|Duration|Warp Cycles Per Issued|Issued Warp" \
        "$OUT/ncu-src-details.txt" | head -40
      rm -f "$OUT/ncusrc.ncu-rep"
      python benchmarks/ncu_source.py "$OUT/ncu-source.csv" --top 40 | tee "$OUT/ncu-source.txt"
      gzip -f "$OUT/ncu-source.csv" ;;
    ncu-bwd) # the bf16 backward, flamia sm90 next to FA4: counters and per-SASS warp samples
      for wl in $(echo "${NCU_WORKLOADS:-d64_doc8k_x4,doc8k_x4}" | tr , ' '); do
        run_stage "$name-$wl" "$secs" "$NCU" --clock-control none --profile-from-start off \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section SourceCounters --section InstructionStats --section LaunchStats \
          --section Occupancy --section MemoryWorkloadAnalysis --import-source no -f \
          -o "$OUT/ncubwd-$wl" python benchmarks/ncu_bwd_sm90.py --only "$wl" ${NCU_ARGS:-}
        "$NCU" --import "$OUT/ncubwd-$wl.ncu-rep" --page details >"$OUT/ncu-bwd-$wl-details.txt" 2>&1
        "$NCU" --import "$OUT/ncubwd-$wl.ncu-rep" --page source --csv --print-source sass \
          >"$OUT/ncu-bwd-$wl-source.csv" 2>&1
        rm -f "$OUT/ncubwd-$wl.ncu-rep"
        grep -E "^  [_a-zA-Z]|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|Registers Per|Achieved Occ|Shared|Pipe|Stall|Tensor" \
          "$OUT/ncu-bwd-$wl-details.txt" | head -60
        python benchmarks/ncu_source.py "$OUT/ncu-bwd-$wl-source.csv" --top 30 \
          >"$OUT/ncu-bwd-$wl-source.txt" 2>&1
        head -c 6000 "$OUT/ncu-bwd-$wl-source.txt"
        gzip -f "$OUT/ncu-bwd-$wl-source.csv"
      done ;;
    abp) # the backward modules of several prepared patches (ABP_PATCHES="a b ...") timed in one
      # process next to this tree's (bwd_sm90_dev.py --time --fp8; ABP_ARGS: --workloads ...),
      # each checked bitwise against it in deterministic mode first
      local files="" n
      for n in ${ABP_PATCHES:-}; do
        local d=/tmp/abp/$n
        rm -rf "$d" && mkdir -p "$d/flamia/ops" && cp flamia/ops/backward_sm90.py "$d/flamia/ops/"
        if (cd "$d" && git apply --include=flamia/ops/backward_sm90.py \
              "$OLDPWD/benchmarks/patches/$n.patch"); then
          cp "$d/flamia/ops/backward_sm90.py" "/tmp/abp/${n//-/_}.py"
          files="$files,/tmp/abp/${n//-/_}.py"
        else
          echo "abp: benchmarks/patches/$n.patch does not apply" | tee -a "$summary"
        fi
      done
      run_stage "$name" "$secs" python benchmarks/bwd_sm90_dev.py --time --fp8 \
        --pair-copies --ab "${files#,}" ${ABP_ARGS:-} ;;
    fabp) # stacks of prepared forward patches (FABP_PATCHES="a a+b ...": each item's patches
      # applied in that order to copies of forward.py and forward_gluon.py) timed in one process
      # by fwd_ab.py next to this tree's modules, listed first as "main" (the reference of the
      # output checks); a copy identical to this tree's or to an earlier item's is left out;
      # FABP_ARGS: --workloads ...
      local tri="main=flamia/ops/forward.py" glu="main=flamia/ops/forward_gluon.py" item p ok
      rm -rf /tmp/fabp    # (a warm machine's earlier copies would hide this call's)
      for item in ${FABP_PATCHES:-}; do
        local v=${item//[-+]/_} d=/tmp/fabp/${item//[-+]/_}
        rm -rf "$d" && mkdir -p "$d/flamia/ops"
        cp flamia/ops/forward.py flamia/ops/forward_gluon.py "$d/flamia/ops/"
        ok=1
        for p in ${item//+/ }; do
          (cd "$d" && git apply --include=flamia/ops/forward.py \
             --include=flamia/ops/forward_gluon.py "$OLDPWD/benchmarks/patches/$p.patch") || ok=0
        done
        if [ "$ok" = 0 ]; then
          echo "fabp: $item does not apply" | tee -a "$summary"
          continue
        fi
        local k f new
        for k in t g; do   # t: forward.py (Triton), g: forward_gluon.py
          [ $k = t ] && f=forward.py || f=forward_gluon.py
          new=1
          for p in flamia/ops/$f /tmp/fabp/*_$k.py; do
            [ -f "$p" ] && cmp -s "$d/flamia/ops/$f" "$p" && new=0
          done
          [ $new = 0 ] && continue
          cp "$d/flamia/ops/$f" "/tmp/fabp/${v}_$k.py"
          if [ $k = t ]; then tri="$tri,$v=/tmp/fabp/${v}_t.py"; else glu="$glu,$v=/tmp/fabp/${v}_g.py"; fi
        done
      done
      echo "fabp: --triton $tri --gluon $glu" | tee -a "$summary"
      run_stage "$name" "$secs" python benchmarks/fwd_ab.py --triton "$tri" --gluon "$glu" \
        ${FABP_ARGS:-} ;;
    ptest-*|pab-*|pprof-*|prun-*) # a prepared patch (benchmarks/patches/NAME.patch) in its own copy of the tree
      local pname=${name#p*-} d
      if ! d=$(patched_tree "$pname"); then
        echo "$name: benchmarks/patches/$pname.patch does not apply" | tee -a "$summary"
        return
      fi
      # the A/B bases: this tree's modules. The tests and A/Bs of each kernel module the patch
      # changes: backward_sm90.py (both backward kernels), forward_gluon.py (the forward)
      cp flamia/ops/backward_sm90.py /tmp/patched/main_bwd.py
      cp flamia/ops/forward_gluon.py /tmp/patched/main_fwd.py
      cp flamia/ops/quantize.py /tmp/patched/main_quant.py
      local tests="" abs=() p="benchmarks/patches/$pname.patch"
      if grep -q '^diff --git a/flamia/ops/backward_sm90.py' "$p"; then
        tests="tests/gpu/test_backward_sm90_fp8_gpu.py tests/gpu/test_backward_sm90_gpu.py"
        abs+=("benchmarks/bwd_sm90_dev.py --time --fp8 --ab /tmp/patched/main_bwd.py ${PAB_ARGS:-}")
      fi
      if grep -q '^diff --git a/flamia/ops/\(forward\|forward_gluon\|config\)\.py' "$p"; then
        tests="$tests tests/gpu/test_forward_kvblock_gpu.py tests/gpu/test_forward_gpu.py"
      fi
      if grep -q '^diff --git a/flamia/ops/forward_gluon.py' "$p"; then
        abs+=("benchmarks/fwd_ab.py --gluon main=/tmp/patched/main_fwd.py --rounds 5 ${PAB_FWD_ARGS:-}")
      fi
      if grep -q '^diff --git a/flamia/ops/quantize.py' "$p"; then
        tests="$tests tests/gpu/test_forward_gpu.py tests/gpu/test_forward_kvblock_gpu.py tests/gpu/test_kvblock_kernels_gpu.py"
        abs+=("benchmarks/quant_ab.py --ab main=/tmp/patched/main_quant.py --rounds 5 ${PAB_QUANT_ARGS:-}")
      fi
      [ -n "$tests" ] || tests="tests/gpu/test_backward_sm90_fp8_gpu.py"
      if [ "${name%%-*}" = prun ]; then    # PRUN_CMD (a command line) in the patched tree
        run_stage "$name" "$secs" env PYTHONPATH="${PYTHONPATH//$PWD/$d}" bash -c "cd $d &&
          ${PRUN_CMD:-true}"
      elif [ "${name%%-*}" = pprof ]; then   # profile_call.py (PROFILE_ARGS) in the patched tree
        run_stage "$name" "$secs" env PYTHONPATH="${PYTHONPATH//$PWD/$d}" bash -c "cd $d &&
          python benchmarks/profile_call.py ${PROFILE_ARGS:-}"
      elif [ "${name%%-*}" = ptest ]; then
        run_stage "$name" "$secs" env PYTHONPATH="${PYTHONPATH//$PWD/$d}" bash -c "cd $d &&
          python -m pytest -q -s -x $tests ${PATCH_TESTS:-}"
      else
        local cmds="true" ab
        for ab in "${abs[@]}"; do cmds="$cmds && python $ab"; done
        run_stage "$name" "$secs" env PYTHONPATH="${PYTHONPATH//$PWD/$d}" bash -c "cd $d &&
          $cmds"
      fi ;;
    *) echo "unknown stage $name" | tee -a "$summary" ;;
  esac
}

for spec in "$@"; do
  name=${spec%%:*}
  secs=${spec#*:}
  [ "$secs" = "$spec" ] && secs=300
  if [ "$name" = "${name#*+}" ]; then
    stage "$name" "$secs"
  else   # a+b+...: the stages side by side (tests that share the GPU lightly), each its own limit
    for one in $(echo "$name" | tr + ' '); do
      stage "$one" "$secs" >"$OUT/.console-$one" 2>&1 &
    done
    wait
    for one in $(echo "$name" | tr + ' '); do
      cat "$OUT/.console-$one"
      rm -f "$OUT/.console-$one"
    done
  fi
done
echo "=== summary ==="
cat "$summary"
# at most 8 files come back from a call: more than that, and the logs travel as one archive
if [ "$(ls -A "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.log *.txt | grep -v '^summary.txt$'))
fi
