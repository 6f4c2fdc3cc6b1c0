#!/usr/bin/env bash
# Token-block experiment on the device: build, bits, A/B 1, forced GPU tests, A/B 2/3, ncu. Each step capped, saved.
set -uo pipefail
OUT=${OUT:-$PWD/xout}; R=$OUT/r; mkdir -p "$R"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
t0=$(date +%s); left() { echo $(( ${END:-560} - ($(date +%s) - t0) )); }
step() { echo "== $* ($(date +%T), $(left) s left)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt"; cat "$R/gpu.txt"
git log --oneline -1 > "$R/commit.txt" 2>/dev/null
step build
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DATTNRES_CUDA=ON" python3 -m pip install --no-build-isolation --no-deps -q . \
  > "$R/build.log" 2>&1 || { tail -40 "$R/build.log"; echo BUILD FAILED; exit 1; }
step bits
timeout 90 python3 xblocks/blocks_ab.py bits x > "$R/bits.txt" 2>&1; echo "rc $?" >> "$R/bits.txt"; tail -12 "$R/bits.txt"
step "A/B 1"
AB_OPS=${AB1OPS:-norm,add} AB_TS=${AB1TS:-4096} timeout $(( $(left) - 300 > 60 ? 150 : 60 )) \
  python3 xblocks/blocks_ab.py time "$R/ab1.json" 2>&1 | tee "$R/ab1.txt"
step "forced GPU tests (7:4 replaces single_cta)"
ATTNRES_X_BLOCKS=${FORCE:-7:4} timeout 110 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --timeout 100 \
  tests/kernels/test_kernel_bits.py tests/kernels/test_cuda_graphs_pdl.py tests/kernels/test_pdl_release.py \
  tests/ops/test_bitwise.py tests/ops/test_nonfinite.py tests/ops/test_snapshot_every_op.py tests/ops/test_ops_oracle.py \
  tests/ops/test_attn_res_addend.py > "$R/pytest_forced.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$R/pytest_forced.log" | tail -25
step "A/B 2 (add2, mix)"
AB_OPS=add2,mix AB_TS=4096 timeout $(( $(left) > 200 ? 110 : 40 )) python3 xblocks/blocks_ab.py time "$R/ab2.json" 2>&1 | tee "$R/ab2.txt"
step "A/B 3 (T 1024, 16384)"
AB_OPS=norm,add AB_TS=1024,16384 AB_NS=1,2 timeout $(( $(left) > 120 ? 100 : 30 )) python3 xblocks/blocks_ab.py time "$R/ab3.json" 2>&1 | tee "$R/ab3.txt"
if [[ ${PROF:-1} == 1 && $(left) -gt 60 ]]; then
  step "ncu: default vs 7:4 at T=4096 N=2 add"
  cat > /tmp/one.py <<'PY'
import os, sys, torch, attnres
sys.path.insert(0, os.getcwd())
from attnres.bench.workloads import EPS, make_sets
s = make_sets(4096, 2, 7168, 1, seed=5)[0]
w = (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)
for v in (None, "7:4:all", "4:2:all"):
    if v: os.environ["ATTNRES_X_BLOCKS"] = v
    attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w)
    os.environ.pop("ATTNRES_X_BLOCKS", None)
torch.cuda.synchronize()
PY
  timeout $(( $(left) - 5 )) ncu --clock-control none --cache-control all -k regex:"attn_res_(stream|blocks)" --set full \
    python3 /tmp/one.py > "$R/ncu_details.txt" 2>&1
  grep -E "attn_res_|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit" "$R/ncu_details.txt" | head -40
fi
step done
