#!/usr/bin/env bash
# Shows that tests/kernels/test_pdl_release.py catches a PDL release placed too early (run on the H200):
# builds a mutant of the library whose kernels release their dependents at kernel entry (besides the real
# release after the wait; the first release of a block is the one that counts), and runs the test file against
# it with ATTNRES_PDL_TEETH=1: the chains that an entry release breaks must then read the poisoned row (and
# the others must still be exact). Exit 0: they did (the tests have teeth); 1: they did not.
#   tools/pdl_teeth.sh            (results under $OUT, default ./gpu_out)
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/gpu_out}
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$REPO" && tar cf - --exclude=./build --exclude=./.git --exclude=./.venv --exclude=./gpu_out .) | (mkdir -p "$work/src" && cd "$work/src" && tar xf -)

# The mutation: a release as the first statement of every kernel.
src=$work/src/cpp/src/cuda
sed -i 's/^\(    attn_res_per_token_kernel(const __grid_constant__ PerTokenParams p) {\)$/\1\n  launch_dependents();/' "$src/attn_res_per_token.cuh"
sed -i 's/^\(    attn_res_persistent_kernel(const __grid_constant__ PersistentParams p) {\)$/\1\n  launch_dependents();/' "$src/attn_res_persistent.cuh"
sed -i 's/^\(    attn_res_stream_kernel(const __grid_constant__ PerTokenParams p) {\)$/\1\n  launch_dependents();/' "$src/attn_res_stream.cuh"
sed -i 's/^\(    attn_res_blocks_kernel(const __grid_constant__ PerTokenParams p) {\)$/\1\n  launch_dependents();/' "$src/attn_res_blocks.cuh"
sed -i 's/^\(.*moe_finalize_single_cta(const MoeParams p) {\)$/\1\n  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");/' "$src/moe_finalize_kernel.cu"
applied=$(cat "$src/attn_res_per_token.cuh" "$src/attn_res_persistent.cuh" "$src/attn_res_stream.cuh" \
  "$src/attn_res_blocks.cuh" "$src/moe_finalize_kernel.cu" |
  grep -A1 -E "attn_res_(per_token|persistent|stream|blocks)_kernel\(const|moe_finalize_single_cta\(const" |
  grep -c "launch_dependents")
if [[ $applied != 5 ]]; then echo "pdl_teeth: the mutation applied to $applied of 5 kernels"; exit 2; fi

echo "== building the entry-release mutant"
if ! CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DATTNRES_CUDA=ON" python3 -m pip install --no-build-isolation \
     --no-deps -q --target "$work/site" "$work/src" >"$OUT/pdl_teeth_build.log" 2>&1; then
  tail -30 "$OUT/pdl_teeth_build.log"; echo "pdl_teeth: build failed"; exit 2
fi
loaded=$(cd "$REPO" && PYTHONPATH="$work/site" python3 -c "import attnres; print(attnres.__file__)")
[[ $loaded == "$work/site/"* ]] || { echo "pdl_teeth: the mutant is not the attnres imported ($loaded)"; exit 2; }
echo "== tests/kernels/test_pdl_release.py against the mutant ($loaded), ATTNRES_PDL_TEETH=1"
(cd "$REPO" && ATTNRES_PDL_TEETH=1 PYTHONPATH="$work/site" timeout "${TEETH_WALL:-300}" python3 -m pytest -q -p no:cacheprovider \
  -rf tests/kernels/test_pdl_release.py 2>&1) | tee "$OUT/pdl_teeth.log" | grep -E "^FAILED|passed|failed" | tail -25
rc=${PIPESTATUS[0]}
[[ $rc == 0 ]] && echo "pdl_teeth: the entry-release mutant read the poisoned row where it must" ||
  echo "pdl_teeth: the tests did not catch the entry release (see $OUT/pdl_teeth.log)"
exit $rc
