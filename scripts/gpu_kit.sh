#!/usr/bin/env bash
# Every check and benchmark that needs a GPU, as one prepared run: a session is lent a GPU
# machine for minutes at a time (start-up included) and that machine cannot build Rust, so
# the binaries are built here and carried there.
#
#   scripts/gpu_kit.sh pack                  here: the `cuda` build (its own target dir,
#                                            target/gpu-kit, so the default build stays) of
#                                            libfo.so, fo and the cuda-feature test binaries,
#                                            stripped into gpu-kit/ (ignored), with pytest
#   scripts/gpu_kit.sh run [checks|rust|py|bench|profile|overlap|all] [SECONDS]
#                                            there: each step under its own timeout, the steps
#                                            within SECONDS (default 540; the GPU and torch lines
#                                            before them at most 90 s more); logs and a summary
#                                            (SUMMARY.txt) under ${OUT:-gpu-kit/out}
#
# With the device tool: `run` with carry ["gpu-kit"] and the command
# `bash scripts/gpu_kit.sh run checks`, then `... run bench` on the same warm machine
# (checks = rust + py: the Rust test binaries and pytest, which may run side by side).
# `run profile` splits a training step's time (scripts/profile_gpu_step.py, with its CUDA
# kernels) and, where Nsight Compute (ncu) is installed, reads the counters of one launch of
# fo.torch's default path (fo_step_kernel_p7, fast) and its exact twin (p4); it is not part of `all`. `run overlap` times
# FSDP2 + CPUOffloadPolicy's overlapped iteration (scripts/bench_fsdp2_overlap.py, on the GPU)
# with fo's pool on every host core, on all but one (the core the thread driving backward
# needs: its launches wait while the pool holds every core) and on half of them, then `fo bench
# overlap --backward launch` (the driving thread busy, no GPU) with the pool on every core and on
# all but one; not in `all`.
# Without a GPU (torch sees none) `run` says so and exits 2, having run nothing, unless
# FO_GPU_KIT_ANYWAY=1 (a dry run here: the steps run and skip or refuse as they do without one).
# FO_GPU_KIT_TAR=1 packs the logs into $OUT/logs-<what>.tgz (SUMMARY.txt stays beside it).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
KIT=${FO_GPU_KIT:-$ROOT/gpu-kit} # FO_GPU_KIT: another kit folder (the tests use one)

pack() {
  set -e
  local target=$ROOT/target/gpu-kit
  echo "==> cargo build --release --features cuda (lib, fo) into $target"
  cargo build --release --features cuda --lib --bin fo --target-dir "$target"
  echo "==> the cuda-feature test binaries (lib unit tests, gpu_abi, optim_api, comm_nccl)"
  rm -rf "$KIT"
  mkdir -p "$KIT/tests" "$KIT/py"
  cp "$target/release/libfo.so" "$target/release/fo" "$KIT/"
  local json=$target/gpu-kit-tests.json
  cargo test --release --features cuda --no-run --lib --test gpu_abi --test optim_api \
    --test comm_nccl --target-dir "$target" --message-format=json >"$json"
  # One executable per test target; the lib's unit tests are named fo (kind lib).
  python3 -c '
import json, shutil, sys
for line in open(sys.argv[1]):
    try:
        j = json.loads(line)
    except ValueError:
        continue
    if j.get("reason") == "compiler-artifact" and j.get("executable") and j["profile"]["test"]:
        name = "lib" if j["target"]["name"] == "fo" else j["target"]["name"]
        shutil.copy(j["executable"], sys.argv[2] + "/" + name)
        print("    " + name + " <- " + j["executable"])
' "$json" "$KIT/tests"
  strip "$KIT/libfo.so" "$KIT/fo" "$KIT"/tests/*
  # The device image has torch but not pytest: a pure-Python copy travels with the kit.
  local py=python3
  [ -x .venv/bin/python ] && py=.venv/bin/python
  "$py" -m pip install -q --target "$KIT/py" pytest
  # pygments only colours tracebacks (pytest imports it when present) and is most of the size.
  rm -rf "$KIT"/py/pygments "$KIT"/py/pygments-*.dist-info "$KIT"/py/bin
  git describe --always --dirty --abbrev=12 >"$KIT/COMMIT"
  echo "$ROOT" >"$KIT/BUILT_IN" # the checkout the test binaries name (CARGO_MANIFEST_DIR)
  du -sh "$KIT"
  echo "packed $(cat "$KIT/COMMIT") into gpu-kit/ (carry it: the device tool takes 64 MiB)"
}

# step NAME SECONDS CMD...: runs CMD under the smaller of its timeout and what is left of
# the run's budget, logging to $OUT/NAME.log and a line of SUMMARY.txt.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 10 ]; then
    printf '%-22s %-8s %5s  %s\n' "$name" "skipped" "-" "the run's time budget is spent" | tee -a "$OUT/SUMMARY.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$? verdict=ok
  [ $rc -ne 0 ] && verdict="rc=$rc"
  [ $rc -eq 124 ] && verdict="timeout"
  local last
  last=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1)
  last=${last:0:110} # characters, not bytes (cut -c splits a UTF-8 quote from timeout)
  printf '%-22s %-8s %4ss  %s\n' "$name" "$verdict" $((SECONDS - t0)) "$last" | tee -a "$OUT/SUMMARY.txt"
}

run() {
  local what=${1:-checks} budget=${2:-540}
  if [ "${FO_GPU_KIT_ANYWAY:-0}" != 1 ] &&
    ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no GPU: python3 has no torch that sees one (torch.cuda.is_available()); nothing ran" >&2
    exit 2
  fi
  if [ ! -x "$KIT/fo" ] || [ ! -f "$KIT/libfo.so" ]; then
    echo "no kit: $KIT/fo or $KIT/libfo.so is missing (run scripts/gpu_kit.sh pack where Rust builds, carry gpu-kit)" >&2
    exit 2
  fi
  OUT=${OUT:-$KIT/out}
  mkdir -p "$OUT"
  local cores
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) # nproc heeds OMP_NUM_THREADS
  # Test binaries find the kernel sources and fixtures through the checkout they were built
  # in (env!("CARGO_MANIFEST_DIR")); on the GPU machine that path is this copy.
  local built
  built=$(cat "$KIT/BUILT_IN" 2>/dev/null)
  if [ -n "$built" ] && [ ! -e "$built" ]; then
    mkdir -p "$(dirname "$built")" && ln -s "$ROOT" "$built" || echo "could not link $built to $ROOT" >&2
  fi
  export FO_LIBRARY=$KIT/libfo.so PYTHONPATH=$ROOT/python:$KIT/py
  local nccl
  nccl=$(python3 -c 'import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); print(next(iter(glob.glob(d + "/nvidia/nccl/lib/libnccl.so.2")), ""))' 2>/dev/null)
  {
    echo "commit $(cat "$KIT/COMMIT" 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    timeout 60 python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
    echo "host cores: $cores"
  } | tee "$OUT/SUMMARY.txt"
  # The budget is the steps': the lines above are bounded by their own timeouts.
  DEADLINE=$((SECONDS + budget))
  case $what in checks | all | rust) ;; *) false ;; esac && {
    step selftest 150 "$KIT/fo" selftest
    step gpu_abi 60 "$KIT/tests/gpu_abi" --test-threads 1
    step optim_api 90 "$KIT/tests/optim_api"
    step comm_nccl 60 env FO_TEST_NCCL_LIBRARY="$nccl" "$KIT/tests/comm_nccl" --test-threads 1
    step unit_device 240 "$KIT/tests/lib" device:: kernels:: clip:: comm:: broadcast:: optim::placement optim::overlap
  }
  case $what in checks | all | py) ;; *) false ;; esac && {
    # -rP: what passing tests print (fo's and torch's fp32 gaps to fused AdamW, the FSDP2
    # overlap's result) comes back in the log. The FSDP2 runs on GPUs need two (skipped on one).
    step pytest_cuda 300 python3 -m pytest -q -rsP -p no:cacheprovider python/tests/test_torch_fsdp2_cuda.py \
      $(ls python/tests/test_torch_cuda*.py 2>/dev/null) python/tests/test_torch_strided.py \
      python/tests/test_torch_examples.py \
      python/tests/test_torch_fsdp2.py::test_on_gpus_uneven_shards_follow_torch_and_resume_on_host_ranks \
      python/tests/test_torch_fsdp2.py::test_overlap_on_gpus_over_nccl_alone_has_the_bits_of_the_plain_step
  }
  if [ "$what" = bench ] || [ "$what" = all ]; then
    step bench_fsdp2_overlap 150 python3 scripts/bench_fsdp2_overlap.py --rounds 3
    step bench_torch_gpu_train 180 python3 scripts/bench_torch_gpu_train.py --rounds 3
    step bench_gpu_step 220 python3 scripts/bench_gpu_step.py --rounds 3
    step bench_offload 150 python3 scripts/bench_offload.py --rounds 3
  fi
  if [ "$what" = overlap ]; then
    local t done_t=" "
    for t in "$cores" $((cores - 1)) $((cores / 2)); do
      case $done_t in *" $t "*) continue ;; esac
      done_t="$done_t$t "
      [ "$t" -ge 1 ] && step "fsdp2_overlap_t$t" 170 python3 scripts/bench_fsdp2_overlap.py --device cuda --rounds 3 \
        --fo-threads "$t"
    done
    # The same question without the GPU: a backward whose driving thread is busy (launch-bound)
    # beside fo's pool on every core and on all but one, the same 20 ms backward for both.
    for t in "$cores" $((cores - 1)); do
      [ "$t" -ge 1 ] && step "bench_overlap_launch_t$t" 60 "$KIT/fo" bench overlap --backward launch --pool "$t" --rounds 5 \
        --backward-ms 20
    done
  fi
  if [ "$what" = profile ]; then
    step profile_gpu_step 150 python3 scripts/profile_gpu_step.py --kernels
    if command -v ncu >/dev/null 2>&1; then
      step ncu_step_p4 150 ncu --clock-control none -k regex:fo_step_kernel_p4 --launch-skip 2 -c 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section InstructionStats --section LaunchStats \
        python3 scripts/profile_gpu_step.py --only "fo quant8 exact" --rounds 1 --steps 3
      # The same model under the fast arithmetic (fo_fast.cuh, the default): its entry for bf16 + quant8.
      step ncu_step_p7 150 ncu --clock-control none -k regex:fo_step_kernel_p7 --launch-skip 2 -c 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section InstructionStats --section LaunchStats \
        python3 scripts/profile_gpu_step.py --only "fo quant8" --rounds 1 --steps 3
    else
      printf '%-22s %-8s %5s  %s\n' ncu_step_p4 skipped - "no ncu (Nsight Compute) on the PATH" | tee -a "$OUT/SUMMARY.txt"
    fi
  fi
  # FO_GPU_KIT_TAR=1: the logs as one archive (the device tool returns a few files from $OUT
  # and drops the rest: on 2026-11-27 five of thirteen logs did not come back).
  if [ "${FO_GPU_KIT_TAR:-0}" = 1 ] && ls "$OUT"/*.log >/dev/null 2>&1; then
    (cd "$OUT" && tar czf "logs-$what.tgz" ./*.log && rm -f ./*.log)
  fi
  echo "logs: $OUT ($(ls "$OUT" | wc -l) files)"
}

case "${1:-}" in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) sed -n '2,/^[^#]/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 2 ;;
esac
