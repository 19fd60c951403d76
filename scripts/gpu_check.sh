#!/usr/bin/env bash
# shellcheck disable=SC2317  # the functions below run through step()
# Validation on a GPU machine (H100/H200, no network) in one command, from the
# repository root or anywhere:
#
#   bash scripts/gpu_check.sh [STEP...]
#
# Prints the machine and versions, builds the extension with its CUDA kernels in
# place, then runs the steps: selfcheck, pytest (the full suite, CUDA tests
# included, MIXEDPREC_EXPECT_CUDA=1), ctest (the GoogleTest suite), bench
# (bench/ops.py and bench/train.py) and memcheck (compute-sanitizer over the CUDA
# tests of the ops). With no STEP, all of them in that order; naming some (e.g.
# `bash scripts/gpu_check.sh pytest memcheck`) splits a run over several calls
# that each fit a time limit. Everything is also written to
# ${OUT:-/tmp}/gpu_check.log. Ends with a summary; exits 1 when any step failed.
#
# Uses python3 (torch 2.11 built for CUDA 13.0), nvcc, ninja, cmake, pytest and
# compute-sanitizer from the machine; downloads nothing. Variables:
#   PYTHON                 interpreter (default python3)
#   MAX_JOBS               parallel compile jobs (default 16)
#   TORCH_CUDA_ARCH_LIST   GPU architectures (default: setup.py's DEFAULT_ARCH_LIST)
#   SANITIZER_TIMEOUT      seconds allowed for the memcheck run (default 300)
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
  SUMMARY+=("$(printf '%-4s %-30s %5ss  %s' "$status" "$name" $((SECONDS - start)) \
    "$counts${errors:+; $errors}")")
  rm -f "$out"
  return "$rc"
}

skip() {  # skip NAME REASON
  SUMMARY+=("$(printf '%-4s %-30s %6s  %s' SKIP "$1" "" "$2")")
  SKIPPED=$((SKIPPED + 1))
}

environment() {
  local nvcc
  nvcc=$(command -v nvcc || echo "$CUDA_BIN/nvcc")
  date -u
  nvidia-smi || return 1
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
  "$PY" - <<'EOF' || return 1
import sys, torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "built for CUDA", torch.version.cuda)
print("GPU", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF
  "$nvcc" --version | tail -n 2
  cmake --version | head -n 1
  "$SANITIZER" --version | tail -n 1
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-(setup.py default)} MAX_JOBS=$MAX_JOBS"
}

build() {
  local with_cuda
  with_cuda=$("$PY" scripts/check_cuda.py) || return 1
  if [ "$with_cuda" != 1 ]; then
    echo "error: setup.py would not build the CUDA kernels here"
    return 1
  fi
  "$PY" setup.py build_ext --inplace
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

ALL_STEPS=(selfcheck pytest ctest bench memcheck)
# The op tests: what compute-sanitizer checks (the rest of the suite drives the same
# kernels through the Python layer, at many times the run time under the tool).
OP_TESTS=(tests/python/test_multi_tensor.py tests/python/test_engine_edges.py
  tests/python/test_fused_optimizers.py tests/python/test_sum_fp32.py
  tests/python/test_loss_scale.py tests/python/test_errors.py)

run_step() {
  case $1 in
    selfcheck) step "selfcheck" "$PY" examples/selfcheck.py ;;
    pytest) step "pytest" env MIXEDPREC_EXPECT_CUDA=1 "$PY" -m pytest tests/python -ra ;;
    ctest) step "ctest" cpp_tests ;;
    bench)
      step "bench ops.py" "$PY" bench/ops.py
      step "bench train.py" "$PY" bench/train.py
      ;;
    # Without the caching allocator every tensor is its own allocation, so an
    # out-of-bounds access is caught instead of landing in a neighbour's memory.
    memcheck)
      step "memcheck (op tests, cuda)" env MIXEDPREC_EXPECT_CUDA=1 \
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_TIMEOUT:-300}" \
        "$SANITIZER" --tool memcheck --error-exitcode 1 \
        "$PY" -m pytest "${OP_TESTS[@]}" -k cuda -x -q
      ;;
  esac
}

main() {
  echo "mixedprec GPU check, log: $LOG, steps: ${STEPS[*]}"
  step "environment" environment
  if ! step "build (CUDA)" build; then
    skip "tests" "the build failed"
    return
  fi
  for s in "${STEPS[@]}"; do
    run_step "$s"
  done
}

summary() {
  printf '\n==== summary (%s)\n' "$(date -u)"
  printf '%s\n' "${SUMMARY[@]}"
  echo "steps: $PASSED passed, $FAILED failed, $SKIPPED skipped"
  [ "$FAILED" -eq 0 ]
}

STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=("${ALL_STEPS[@]}")
for s in "${STEPS[@]}"; do
  if [[ ! " ${ALL_STEPS[*]} " =~ \ $s\  ]]; then
    echo "gpu_check.sh: unknown step '$s'; expected some of: ${ALL_STEPS[*]}" >&2
    exit 2
  fi
done

mkdir -p "$(dirname "$LOG")"
{
  main
  summary
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
