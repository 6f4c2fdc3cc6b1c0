#!/usr/bin/env bash
# A/B of two builds on the same GPU, minutes apart: the installed attnres (this tree, after tools/gpu_check.sh)
# against the source tree in $1 (e.g. `git archive 4aed4f9 | tar x -C old_src`), built into a private target
# folder. Prints tools/ab_points.py's JSON for each. For when the regression guard flags a point whose baseline
# was measured on another machine: same-run references do not see every machine difference (cluster kernels
# depend on the GPU's GPC layout, elementwise kernels do not).
set -euo pipefail
old=$(realpath "${1:?usage: tools/ab_commits.sh OLD_SOURCE_TREE [repeats]}")  # a path, not a requirement name
target=${AB_TARGET:-/tmp/attnres_ab_old}
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DATTNRES_CUDA=ON" python3 -m pip install --no-build-isolation --no-deps \
  -q --target "$target" "$old" >"${OUT:-.}/ab_old_build.log" 2>&1
script=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ab_points.py
echo "new: $(cd /tmp && python3 "$script" "${2:-25}")"
echo "old: $(cd /tmp && PYTHONPATH="$target" python3 "$script" "${2:-25}")"
