#!/usr/bin/env bash
# shellcheck disable=SC2317  # the functions below run through step()
# Validation on a GPU machine (H100/H200, no network) in one command, from the
# repository root or anywhere:
#
#   bash scripts/gpu_check.sh [STEP...]
#
# Prints the machine and versions, builds the extension with its CUDA kernels in
# place, then runs the steps:
#   selfcheck    python -m mixedprec.selfcheck (each op on CPU and CUDA against float64)
#   pytest       the whole suite, CUDA tests included (MIXEDPREC_EXPECT_CUDA=1), on
#                6 pytest-xdist workers when xdist is installed
#   ctest        the GoogleTest suite (skipped where GoogleTest is not installed)
#   memcheck     compute-sanitizer memcheck over the CUDA tests of the op files
#   racecheck    compute-sanitizer racecheck over the L2 norm's CUDA tests (the only
#                kernels with shared memory)
#   synccheck    compute-sanitizer synccheck over the engine's CUDA tests
#   bench-ops    bench/ops.py;  bench-train: bench/train.py;  bench: both
#   bench-lean   bench/lean.py on the GPU (issue #11's modes; not in the default run:
#                name it in a call of its own)
# With no STEP: selfcheck, then the other correctness steps at once (they share
# the GPU; none of them times anything), then the benchmarks alone. A STEP written
# A+B+... runs those steps at once, each into its own log, printed when all are
# done. Naming some steps splits a run over calls that each fit a time limit.
# Everything is also written to ${OUT:-/tmp}/gpu_check.log. Ends with a summary;
# exits 1 when any step failed.
#
# Uses python3 (torch 2.11 built for CUDA 13.0), nvcc, ninja, cmake, pytest and
# compute-sanitizer from the machine; downloads nothing. Variables:
#   PYTHON                 interpreter (default python3)
#   MAX_JOBS               parallel compile jobs (default 16)
#   TORCH_CUDA_ARCH_LIST   GPU architectures (default: setup.py's DEFAULT_ARCH_LIST)
#   MIXEDPREC_PREBUILT=1   use the mixedprec/_C*.so already in place (built on another
#                          machine against the same torch; the library is
#                          py_limited_api, so any Python 3 loads it) instead of
#                          building; it must load and hold the CUDA kernels
#   SANITIZER_TIMEOUT      seconds allowed for each compute-sanitizer run (default 300)
#   SANITIZER_WORKERS      pytest-xdist workers of each compute-sanitizer run (default:
#                          memcheck 6, racecheck 3, synccheck 2, sized to run at once)
#   PYTEST_WORKERS         pytest-xdist workers of the pytest step (default 6)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

PY=$(command -v "${PYTHON:-python3}")
export MAX_JOBS=${MAX_JOBS:-16}
export MIXEDPREC_CUDA=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CUDA_BIN=${CUDA_HOME:-/usr/local/cuda}/bin
SANITIZER=$(command -v compute-sanitizer || echo "$CUDA_BIN/compute-sanitizer")
LOG=${OUT:-/tmp}/gpu_check.log

SUMMARY=()
PASSED=0
FAILED=0
SKIPPED=0

# step NAME CMD...: runs CMD, records PASS (status 0), SKIP (77) or FAIL, and
# the last test-count line it printed (pytest, ctest, compute-sanitizer).
step() {
  local name=$1 out start rc status counts errors
  shift
  out=$(mktemp)
  start=$SECONDS
  printf '\n==== %s\n$ %s\n' "$name" "$*"
  "$@" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=PASS PASSED=$((PASSED + 1)) ;;
    77) status=SKIP SKIPPED=$((SKIPPED + 1)) ;;
    *) status=FAIL FAILED=$((FAILED + 1)) ;;
  esac
  counts=$(grep -E '[0-9]+ (passed|failed|error)|(tests|checks) passed|no tests ran' "$out" |
    tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  errors=$(grep -oE 'ERROR SUMMARY: .*' "$out" | tail -n 1)
  [ "$rc" = 124 ] && counts="timed out; $counts"
  SUMMARY+=("$(printf '%-4s %-32s %5ss  %s' "$status" "$name" $((SECONDS - start)) \
    "$counts${errors:+; $errors}")")
  rm -f "$out"
  return "$rc"
}

skip() {  # skip NAME REASON
  SUMMARY+=("$(printf '%-4s %-32s %6s  %s' SKIP "$1" "" "$2")")
  SKIPPED=$((SKIPPED + 1))
}

environment() {
  local nvcc
  nvcc=$(command -v nvcc || echo "$CUDA_BIN/nvcc")
  date -u
  nvidia-smi || return 1
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.sm,clocks.max.sm \
    --format=csv
  "$PY" - <<'EOF' || return 1
import os, sys, torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "built for CUDA", torch.version.cuda,
      "cuDNN", torch.backends.cudnn.version())
print("GPU", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("CPU threads", torch.get_num_threads(), "of", os.cpu_count())
EOF
  "$nvcc" --version | tail -n 2
  cmake --version | head -n 1
  "$SANITIZER" --version | tail -n 1
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-(setup.py default)} MAX_JOBS=$MAX_JOBS" \
    "MIXEDPREC_PREBUILT=${MIXEDPREC_PREBUILT:-0}"
}

# Whether the extension loads here with its CUDA kernels registered.
cuda_kernels_loaded() {
  "$PY" - <<'EOF'
import torch
from mixedprec import ops

names = ops.__all__[1:]
missing = [n for n in names
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"mixedprec::{n}", "CUDA")]
print(f"mixedprec._C: CUDA kernels of {len(names) - len(missing)} of {len(names)} ops",
      f"(missing: {missing})" if missing else "")
raise SystemExit(1 if missing else 0)
EOF
}

build() {
  local with_cuda
  if [ "${MIXEDPREC_PREBUILT:-0}" = 1 ]; then
    ls -l mixedprec/_C*.so || return 1
    cuda_kernels_loaded
    return
  fi
  with_cuda=$("$PY" scripts/build_checks.py) || return 1
  if [ "$with_cuda" != 1 ]; then
    echo "error: setup.py would not build the CUDA kernels here"
    return 1
  fi
  "$PY" setup.py build_ext --inplace && cuda_kernels_loaded
}

cpp_tests() {
  local configure
  if ! configure=$(cmake -S tests/cpp -B build/cpp -G Ninja -DPython3_EXECUTABLE="$PY" 2>&1); then
    echo "$configure"
    if grep -q GTest <<<"$configure"; then
      echo "GoogleTest is not installed on this machine: skipped"
      return 77
    fi
    return 1
  fi
  cmake --build build/cpp -j "$MAX_JOBS" && ctest --test-dir build/cpp --output-on-failure -j 8
}

ALL_STEPS=(selfcheck pytest ctest memcheck racecheck synccheck bench-ops bench-train bench
  bench-lean)
DEFAULT_STEPS=(selfcheck pytest+ctest+memcheck+racecheck+synccheck bench)
# The op tests: what memcheck checks (the rest of the suite drives the same kernels
# through the Python layer, at many times the run time under the tool; test_errors.py
# checks arguments that are rejected before any kernel runs).
OP_TESTS=(tests/python/ops/test_multi_tensor.py tests/python/ops/test_engine_edges.py
  tests/python/optim/test_fused_optimizers.py tests/python/ops/test_sum_fp32.py
  tests/python/scaler/test_loss_scale.py)
# The engine's tests: what synccheck (barriers) checks; the 2^31-element test is
# memcheck's. racecheck looks for shared-memory hazards, and only the L2 norm's block
# reductions use shared memory: it runs the L2 norm tests of these files and amp_C's.
ENGINE_TESTS=(tests/python/ops/test_multi_tensor.py tests/python/ops/test_engine_edges.py)
L2NORM_TESTS=("${ENGINE_TESTS[@]}" tests/python/compat/test_amp_C.py)

HAVE_XDIST=0
"$PY" -c "import xdist" 2>/dev/null && HAVE_XDIST=1

# workers N: pytest-xdist's arguments for N workers (none without xdist).
workers() {
  [ "$HAVE_XDIST" = 1 ] && echo "-n $1"
}

# sanitize TOOL WORKERS FILTER FILE...: compute-sanitizer TOOL over the CUDA tests of
# the files that match FILTER (pytest -k), on WORKERS pytest-xdist workers (the tool
# follows child processes). Without the caching allocator every tensor is its own
# allocation, so an out-of-bounds access is caught instead of landing in a
# neighbour's memory.
sanitize() {
  local tool=$1 n=${SANITIZER_WORKERS:-$2} filter="cuda and not test_cuda_graphs${3:+ and $3}"
  shift 3
  [ "$tool" = memcheck ] || filter="$filter and not 2_31"
  # shellcheck disable=SC2046  # workers' words are separate arguments
  env MIXEDPREC_EXPECT_CUDA=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    timeout "${SANITIZER_TIMEOUT:-300}" "$SANITIZER" --tool "$tool" --error-exitcode 1 \
    --target-processes all "$PY" -m pytest "$@" -k "$filter" -x -q -p no:cacheprovider \
    $(workers "$n")
}

run_step() {
  # shellcheck disable=SC2046  # workers' words are separate arguments
  case $1 in
    selfcheck) step "selfcheck" "$PY" -m mixedprec.selfcheck ;;
    pytest) step "pytest" env MIXEDPREC_EXPECT_CUDA=1 "$PY" -m pytest tests/python -ra \
      $(workers "${PYTEST_WORKERS:-6}") -p no:cacheprovider --durations=10 ;;
    ctest) step "ctest" cpp_tests ;;
    memcheck) step "memcheck (op tests, cuda)" sanitize memcheck 6 "" "${OP_TESTS[@]}" ;;
    racecheck) step "racecheck (L2 norm tests, cuda)" sanitize racecheck 3 l2norm \
      "${L2NORM_TESTS[@]}" ;;
    synccheck) step "synccheck (engine tests, cuda)" sanitize synccheck 2 "" \
      "${ENGINE_TESTS[@]}" ;;
    bench-ops) step "bench ops.py" "$PY" bench/ops.py ;;
    bench-train) step "bench train.py" "$PY" bench/train.py ;;
    bench-lean) step "bench lean.py" "$PY" bench/lean.py --device cuda ;;
    bench)
      run_step bench-ops
      run_step bench-train
      ;;
  esac
}

# run_group A+B+...: runs the steps at once, each into its own log; then prints the
# logs in order and adds their summary lines and counts to this shell's.
run_group() {
  local -a names lines
  local dir s p f k
  IFS=+ read -ra names <<<"$1"
  if [ ${#names[@]} -eq 1 ]; then
    run_step "$1"
    return
  fi
  dir=$(mktemp -d)
  printf '\n==== at once: %s\n' "${names[*]}"
  for s in "${names[@]}"; do
    (
      SUMMARY=() PASSED=0 FAILED=0 SKIPPED=0
      run_step "$s" >"$dir/$s.log" 2>&1
      printf '%s\n' "${SUMMARY[@]}" >"$dir/$s.summary"
      echo "$PASSED $FAILED $SKIPPED" >"$dir/$s.counts"
    ) &
  done
  wait
  for s in "${names[@]}"; do
    cat "$dir/$s.log"
    mapfile -t lines <"$dir/$s.summary"
    SUMMARY+=("${lines[@]}")
    read -r p f k <"$dir/$s.counts"
    PASSED=$((PASSED + p)) FAILED=$((FAILED + f)) SKIPPED=$((SKIPPED + k))
  done
  rm -rf "$dir"
}

main() {
  echo "mixedprec GPU check, log: $LOG, steps: ${STEPS[*]}"
  step "environment" environment
  if ! step "build (CUDA)" build; then
    skip "tests" "the build failed"
    return
  fi
  for group in "${STEPS[@]}"; do
    run_group "$group"
  done
}

summary() {
  printf '\n==== summary (%s)\n' "$(date -u)"
  printf '%s\n' "${SUMMARY[@]}"
  echo "steps: $PASSED passed, $FAILED failed, $SKIPPED skipped"
  [ "$FAILED" -eq 0 ]
}

STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=("${DEFAULT_STEPS[@]}")
for group in "${STEPS[@]}"; do
  IFS=+ read -ra names <<<"$group"
  for s in "${names[@]}"; do
    if [[ ! " ${ALL_STEPS[*]} " =~ \ $s\  ]]; then
      echo "gpu_check.sh: unknown step '$s'; expected some of: ${ALL_STEPS[*]}" >&2
      exit 2
    fi
  done
done

mkdir -p "$(dirname "$LOG")"
{
  main
  summary
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
