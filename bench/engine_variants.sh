#!/usr/bin/env bash
# Measures the CUDA engine's tuning constants (csrc/cuda/multi_tensor_block.cuh:
# MIXEDPREC_UNROLL, MIXEDPREC_BLOCKS_PER_CHUNK) with bench/ops.py, one build each.
#
#   bash bench/engine_variants.sh build [NAME=UNROLL,BLOCKS ...]   # where nvcc is
#   bash bench/engine_variants.sh run                              # on the GPU
#
# `build` compiles each variant for sm_90 into build/variants/NAME/lib (default:
# u1b1=1,1 u2b1=2,1 u1b4=1,4 u2b4=2,4); the library is py_limited_api, so a build
# from any machine with the same torch loads on the GPU machine (carry build/variants).
# `run` puts each built variant in place of mixedprec/_C*.so in turn, runs
# bench/ops.py --ops unscale,adam,sgd on every list, restores the original library,
# and prints one table: the median ms of each mixedprec op-level row per variant
# (also written to ${OUT:-/tmp}/variants.txt). Each run's files: /tmp/variants/NAME/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}

case ${1:-} in
  build)
    shift
    specs=("$@")
    [ ${#specs[@]} -gt 0 ] || specs=(u1b1=1,1 u2b1=2,1 u1b4=1,4 u2b4=2,4)
    for spec in "${specs[@]}"; do
      name=${spec%%=*} values=${spec#*=}
      dir=build/variants/$name
      mkdir -p "$dir"
      flags="-DMIXEDPREC_UNROLL=${values%,*} -DMIXEDPREC_BLOCKS_PER_CHUNK=${values#*,}"
      TORCH_CUDA_ARCH_LIST=9.0 NVCC_APPEND_FLAGS="$flags -Xptxas -v" \
        "$PY" setup.py build_ext --build-temp "$dir/tmp" --build-lib "$dir/lib" \
        >"$dir/build.log" 2>&1
      strip -g "$dir"/lib/mixedprec/_C*.so  # debug info off: smaller to carry
      echo "built $name (unroll ${values%,*}, blocks per chunk ${values#*,}): $dir/lib"
    done
    ;;
  run)
    lib=$(ls mixedprec/_C*.so)
    cp "$lib" /tmp/mixedprec_C_original.so
    trap 'cp /tmp/mixedprec_C_original.so "$lib"' EXIT
    names=()
    for dir in build/variants/*/lib; do
      name=$(basename "$(dirname "$dir")")
      names+=("$name")
      cp "$dir"/mixedprec/_C*.so "$lib"
      echo "== variant $name"
      "$PY" bench/ops.py --ops unscale,adam,sgd --out "/tmp/variants/$name" \
        | grep -E "^  .*mixedprec (multi|check)|copy reference" || true
    done
    "$PY" - /tmp/variants "${names[@]}" <<'EOF' | tee "${OUT:-/tmp}/variants.txt"
import json, pathlib, sys
root, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
rows = {}
for name in names:
    data = json.loads(next((root / name).glob("ops-*.json")).read_text())
    for r in data["results"]:
        if r["side"] == "mixedprec" and not r["impl"].startswith("mixedprec Fused"):
            rows.setdefault((r["op"], r["list"]), {})[name] = (r["median_ms"], r["pct_copy"])
print("median ms (% of copy) by variant")
print(f"{'op':<14}{'list':<13}" + "".join(f"{n:>18}" for n in names))
for (op, lst), by in rows.items():
    cells = "".join(f"{by[n][0]:>10.4f} ({by[n][1]:4.1f})" if n in by else " " * 18
                    for n in names)
    print(f"{op:<14}{lst:<13}{cells}")
EOF
    ;;
  *)
    echo "usage: bash bench/engine_variants.sh build [NAME=UNROLL,BLOCKS ...] | run" >&2
    exit 2
    ;;
esac
