#!/usr/bin/env bash
# The GPU check, run on the H200 (the device tool) from the repository root:
#   tools/gpu_check.sh [smoke|test|chain|persistent|variants|fp8|tp|allreduce|bench|full|profile|sanitize|stress][,more]   results and logs under $OUT (default ./gpu_out)
# smoke: build + kernel self-check + quick benchmarks; test: build + the SASS schedule check (tools/sass_check.py) +
# ctest + pytest (GPU cases run; CTEST=0 skips ctest); chain: the
# decode-chain benchmark and the regression guard; sanitize: tools/sanitize.sh (compute-sanitizer, four tools);
# stress: the random-call and decode-chain stress runs (python -m stress); persistent: its benchmark
# (PERSISTENT_QUICK=1 for the reduced grid); peers: the side-by-side points and the automatic topology's grid
# and the prefill grid (PEERS_QUICK=1: their reduced grids), with vLLM's kernel side by side where
# build/engines/vllm is prepared (and FlagGems-vllm's where build/engines/flaggems is); variants: the persistent
# kernel's geometry variants (their GPU bit tests, then python -m bench persistent --variants); fp8: the FP8
# epilogue benchmark (FP8_QUICK=1: T = 1, 32 at N = 9; FP8_PREFILL=1 adds `bench fp8 --prefill`, its 3 points
# with FP8_QUICK); allreduce: the fused all-reduce epilogues in the in-process W = 2 world on one GPU (a lower
# bound of two GPUs; ALLREDUCE_QUICK=1: T = 1, 8); tp: the two-GPU
# checks and benchmark (nvidia-h200-x2; TP_SYMM=1 adds the symmetric-memory one-shot floor in a process of its own);
# teeth: tools/pdl_teeth.sh (the PDL-release test against a mutant that releases at kernel entry: must fail);
# grids: the runs the per-GPU defaults are read from: two addends on every kernel (`bench prefill --ops add2
# --forced`, T = 256, 1024, 4096: its per-N persistent threshold is the two-addend table's row) and the streaming
# token buffers (`bench stream`, T = 1024, 4096); engines: tools/engines/refresh_tables.sh (build/engines carried:
# docs/integrations.md), which writes this GPU's engine tables into the tree and runs the engines' own tests;
# bench: build + the benchmark suites; full: all of it; profile: ncu durations and stall sampling; build (or any
# other word): the build alone. The machine has no network: it builds with the
# preinstalled nanobind/scikit-build-core (--no-build-isolation) and, for ctest, a GoogleTest carried in
# .gpu_carry/gtest (tools/gpu_carry.sh prepares it).
set -uo pipefail
mode=${1:-full}
# Modes combine with commas (e.g. `test,chain`): one build serves them all.
has() { local m; for m in "$@"; do [[ ,$mode, == *,$m,* ]] && return 0; done; return 1; }
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ATTNRES_COMMIT=${ATTNRES_COMMIT:-unknown} CMAKE_BUILD_PARALLEL_LEVEL=16
status=0
step() { echo "== $* ($(date +%T))"; }

step "environment"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch,sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"

# SKIP_BUILD=1: use the attnres already installed (a second gpu_check.sh on the other GPU of the x2 machine,
# started after a first one built it: two pip installs of one tree at once would race).
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  step "build + install (CUDA sm_90)"
  export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DATTNRES_CUDA=ON"
  if ! python3 -m pip install --no-build-isolation --no-deps -q . >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
fi
python3 -c "import attnres; print(attnres.backend_info())"

if has test smoke full; then
  step "SASS schedule of the per-token kernels (tools/sass_check.py: post-wait loads together, exps branch-free)"
  so=$(python3 -c "import attnres._C as c; print(c.__file__)")
  cuobjdump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  if "$cuobjdump" -sass "$so" >/tmp/attnres_sass.txt 2>&1; then
    python3 tools/sass_check.py /tmp/attnres_sass.txt >"$OUT/sass_check.txt" || status=1
    grep FAIL "$OUT/sass_check.txt" | head -5; tail -1 "$OUT/sass_check.txt"
  else
    echo "cuobjdump failed: no SASS check"; status=1
  fi
fi
if has smoke full bench; then
  step "SASS of the kernels (for reading load batching and barriers)"
  so=$(python3 -c "import attnres._C as c; print(c.__file__)")
  cuobjdump -sass "$so" >"$OUT/sass.txt" 2>&1 || true
  step "kernel self-check"
  python3 tools/gpu_smoke.py 2>&1 | tee "$OUT/smoke.log" || status=1
fi

if has test full && [[ ${CTEST:-1} == 1 ]]; then
  step "ctest (GPU suites run)"
  gt=$PWD/.gpu_carry/gtest/lib/x86_64-linux-gnu/cmake/GTest
  if cmake -S . -B build/ctest -G Ninja -DATTNRES_BUILD_TESTS=ON -DATTNRES_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
       -DGTest_DIR="$gt" >"$OUT/ctest.log" 2>&1 && cmake --build build/ctest >>"$OUT/ctest.log" 2>&1; then
    (cd build/ctest && ctest --output-on-failure -j 8 2>&1) | tee -a "$OUT/ctest.log" | tail -15 || status=1
    grep -q "100% tests passed" "$OUT/ctest.log" || status=1
  else
    tail -30 "$OUT/ctest.log"; echo "CTEST BUILD FAILED"; status=1
  fi
fi
if has test full; then
  step "pytest (GPU cases run)"
  # The two-rank NCCL test runs in the tp mode on its own: under 24 loaded xdist workers its spawned ranks
  # (the real 93-layer config) ran past the per-test timeout on the x2 machine (d528250), while the same checks
  # took 12 s alone.
  # Only the GPU cases by default (PYTEST_MARK=gpu; CI runs the CPU ones): PYTEST_MARK="" runs everything.
  # -v so the log names every test as it finishes (a crashed or killed worker is then attributable);
  # pytest-timeout's thread method kills a stuck worker and prints every thread's stack (the signal method
  # cannot interrupt a test blocked inside a CUDA call); the whole step is bounded so later steps still run.
  timeout "${PYTEST_WALL:-420}" python3 -m pytest -v -rfE --maxfail=40 -p no:cacheprovider -n "${PYTEST_WORKERS:-8}" \
    --timeout "${PYTEST_TIMEOUT:-180}" --timeout-method thread --junitxml="$OUT/pytest.xml" -m "${PYTEST_MARK:-gpu}" \
    --deselect "tests/tp/test_tp_chain.py::test_two_ranks[nccl-cuda]" tests ${PYTEST_ARGS:-} \
    >"$OUT/pytest.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)|crashed|Timeout|passed|failed" "$OUT/pytest.log" | tail -45
  if [[ ${QUICK_BENCH:-1} == 1 ]]; then
    step "quick decode benchmark"
    python3 -m attnres.bench decode --quick --out "$OUT/decode_quick.json" 2>&1 | tail -6
  fi
fi

if has profile; then
  step "ncu: kernel durations (cold L2 per launch) and source-level stall sampling"
  ncu --clock-control none --cache-control all -k regex:attn_res_per_token --metrics gpu__time_duration.sum \
    --csv python3 tools/profile_kernel.py sweep >"$OUT/ncu_durations.csv" 2>&1 || status=1
  python3 - "$OUT/ncu_durations.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1]).read().splitlines()) if len(r) > 14 and r[12] == "gpu__time_duration.sum"]
for r in rows:
    print(f"{r[4].split('(')[0][-45:]:45s} block {r[7]:12s} grid {r[8]:12s} {r[14]} ns")
PY
  [[ ${PROFILE_SOURCE:-1} == 1 ]] || exit $status
  for n in 2 9; do
    ncu --clock-control none --cache-control all -k regex:attn_res_per_token -c 1 --set full \
      --import-source no --page source --print-source sass --csv python3 tools/profile_kernel.py one $n \
      >"$OUT/ncu_source_n$n.csv" 2>&1 || status=1
    ncu --clock-control none --cache-control all -k regex:attn_res_per_token -c 1 --set full \
      python3 tools/profile_kernel.py one $n >"$OUT/ncu_details_n$n.txt" 2>&1 || status=1
  done
  grep -E "Duration|Stall|Warp Cycles|Issued|Eligible" "$OUT/ncu_details_n9.txt" | head -20
fi

if has smoke; then
  step "quick benchmarks"
  python3 -m bench guard --baseline "${GUARD_BASELINE:-bench_results/h200x2_d67b737_guard.json}" --out "$OUT/guard.json" 2>&1 | tail -12
  python3 -m bench tune --quick --out "$OUT/tune_quick.json" 2>&1 | tail -8
  python3 -m attnres.bench decode --quick --out "$OUT/decode_quick.json" 2>&1 | tail -8
fi
# The guard's baseline (GUARD_BASELINE): the landed kernels' guard run (f2a5a55's kernels, the two-GPU host's GPU 1,
# the current benchmark harness); bench_results/h200_4aed4f9.json is the older, faster build's (docs/performance.md).
if has chain; then
  step "decode-chain benchmark and the regression guard"
  timeout -s INT -k 20 "${CHAIN_WALL:-240}" python3 -m attnres.bench chain ${CHAIN_TOKENS:+--tokens $CHAIN_TOKENS} --out "$OUT/chain.json" 2>&1 | tail -12 || status=1
  if [[ ${GUARD:-1} == 1 ]]; then
    timeout 120 python3 -m bench guard --baseline "${GUARD_BASELINE:-bench_results/h200x2_d67b737_guard.json}" --out "$OUT/guard.json" \
      2>&1 | tail -14
  fi
fi
if has persistent; then
  step "persistent-kernel benchmark (per-token/persistent crossover)"
  timeout -s INT -k 20 "${PERSISTENT_WALL:-300}" python3 -m bench persistent ${PERSISTENT_QUICK:+--quick} \
    --out "$OUT/persistent.json" 2>&1 | tail -30 || status=1
fi
if has peers; then
  step "the side-by-side points (against the peers' figures), the automatic topology's grid and the prefill grid"
  timeout -s INT -k 20 "${PEERS_WALL:-200}" python3 -m bench peers ${PEERS_QUICK:+--quick} \
    --out "$OUT/peers.json" 2>&1 | grep -v "━" | tail -24 || status=1
  timeout -s INT -k 20 "${TOPOLOGY_WALL:-200}" python3 -m bench topology ${PEERS_QUICK:+--quick} \
    --out "$OUT/topology.json" 2>&1 | grep -v "━" | tail -90 || status=1
  timeout -s INT -k 20 "${PREFILL_WALL:-400}" python3 -m bench prefill ${PEERS_QUICK:+--quick} \
    --out "$OUT/prefill.json" 2>&1 | grep -v "━" | tail -80 || status=1
  # vLLM 0.33.0's own kernel side by side with attnres at the side-by-side table's points (vLLM's call: the prefix
  # updated in place, the token-major bank), where build/engines/vllm is prepared (docs/integrations.md); with
  # FlagGems-vllm's kernel in the same run where build/engines/flaggems is prepared too.
  if [[ -d build/engines/vllm/vllm ]]; then
    fg=; [[ -d build/engines/flaggems/flaggems_vllm ]] && fg=--flaggems
    PYTHONPATH=build/engines/vllm:build/engines/flaggems timeout -s INT -k 20 "${PEERS_VLLM_WALL:-240}" \
      python3 tools/engines/bench_vllm.py run \
      --sites add_rmsnorm --tokens 4096 1024 1 8 32 128 --candidates 1 2 5 9 12 --bank-rows 12 $fg \
      --out "$OUT/peers_vllm.json" 2>&1 | tail -32 || status=1
  fi
fi
if has variants; then
  step "persistent-kernel geometry variants: bits against split_k, then the interleaved benchmark vs the copy floor"
  timeout 900 python3 -m pytest -q -m gpu tests/kernels/test_persistent_variants.py 2>&1 | tail -15 || status=1
  timeout -s INT -k 20 "${VARIANTS_WALL:-240}" python3 -m bench persistent --variants \
    --out "$OUT/persistent_variants.json" 2>&1 | tail -40 || status=1
fi
if has fp8; then
  step "FP8 epilogue benchmark (fused e4m3 output vs bf16 op + separate quantization)"
  timeout -s INT -k 20 "${FP8_WALL:-300}" python3 -m bench fp8 ${FP8_QUICK:+--quick} \
    --out "$OUT/fp8.json" 2>&1 | tail -40 || status=1
  if [[ -n ${FP8_PREFILL:-} ]]; then
    step "FP8 at prefill sizes: bf16 against the FP8 call with and without the bf16 output (FP8_QUICK: 3 points)"
    timeout -s INT -k 20 "${FP8_PREFILL_WALL:-420}" python3 -m bench fp8 --prefill ${FP8_QUICK:+--quick} \
      --out "$OUT/fp8_prefill.json" 2>&1 | tail -60 || status=1
  fi
fi
if has allreduce; then
  step "fused all-reduce epilogues, in-process W = 2 world on one GPU (a lower bound: local memory, not NVLink)"
  timeout "${ALLREDUCE_WALL:-300}" python3 -m bench allreduce ${ALLREDUCE_QUICK:+--quick} \
    --out "$OUT/allreduce.json" 2>&1 | tail -16 || status=1
fi
if has tp; then
  step "tensor parallelism on two GPUs (NCCL, NVLink multicast off): checks and benchmark"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi topo -m 2>&1 | head -5 | tee "$OUT/topo.txt"
  timeout "${TP_WALL:-240}" python3 -m pytest -v -rfE -p no:cacheprovider "tests/tp/test_tp_chain.py::test_two_ranks[nccl-cuda]" \
    2>&1 | tee "$OUT/tp_check.log" | tail -8 || status=1
  if [[ ${TP_BENCH:-1} == 1 ]]; then
    timeout "${TP_BENCH_WALL:-240}" python3 -m bench tp --out "$OUT/tp.json" 2>&1 | tail -20 || status=1
  fi
  if [[ ${TP_SYMM:-0} == 1 ]]; then
    # torch's symmetric-memory one-shot all-reduce (the floor of a fused one-shot epilogue, docs/tp.md), in a
    # process of its own and with its whole output kept: at 3a47675 it died with an illegal memory access.
    CUDA_LAUNCH_BLOCKING=1 timeout "${TP_SYMM_WALL:-180}" python3 -m bench tp --symm-mem --latencies-only \
      --out "$OUT/tp_symm.json" >"$OUT/tp_symm.log" 2>&1 || status=1
    grep -m5 -B2 -A12 "Error\|Traceback" "$OUT/tp_symm.log" | head -60; tail -12 "$OUT/tp_symm.log"
  fi
fi
if has teeth; then
  step "PDL release: tests/kernels/test_pdl_release.py against an entry-release mutant (tools/pdl_teeth.sh) must fail"
  OUT="$OUT" tools/pdl_teeth.sh || status=1
fi
if has grids; then
  step "the per-GPU defaults' grids: two addends on every kernel, then the streaming token buffers"
  timeout -s INT -k 20 "${GRIDS_WALL:-240}" python3 -m bench prefill --ops add2 --forced --tokens 256,1024,4096 \
    --out "$OUT/add2_grid.json" 2>&1 | grep -v "━" | tail -22 || status=1
  timeout -s INT -k 20 "${GRIDS_WALL:-240}" python3 -m bench stream --tokens 1024,4096 \
    --out "$OUT/stream_buffers.json" 2>&1 | grep -v "━" | tail -40 || status=1
fi
if has engines; then
  step "the engines' tables and their own tests (tools/engines/refresh_tables.sh)"
  OUT="$OUT/engine_tables" timeout "${ENGINES_WALL:-300}" tools/engines/refresh_tables.sh 2>&1 | tail -8 || status=1
  # The tables it wrote into this tree, and its results, as one archive (the device tool returns few files).
  cp -r python/attnres/integrations/tables "$OUT/engine_tables/tables"
  tar czf "$OUT/engine_tables.tgz" -C "$OUT" engine_tables && rm -rf "$OUT/engine_tables"
fi
if has bench full; then
  step "benchmarks"
  python3 -m bench all --out "$OUT/bench.json" 2>&1 | tail -12 || status=1
fi
if has sanitize; then
  if [[ ! -x build/ctest/cpp/tests/test_cuda_backend || ! -x build/ctest/cpp/tests/test_moe_finalize ]]; then
    step "ctest build (the sanitizer runs the GPU gtest suites)"
    gt=$PWD/.gpu_carry/gtest/lib/x86_64-linux-gnu/cmake/GTest
    { cmake -S . -B build/ctest -G Ninja -DATTNRES_BUILD_TESTS=ON -DATTNRES_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DGTest_DIR="$gt" && cmake --build build/ctest --target test_cuda_backend test_moe_finalize; } \
      >"$OUT/ctest_build.log" 2>&1 || { tail -20 "$OUT/ctest_build.log"; status=1; }
  fi
  step "compute-sanitizer: memcheck, racecheck, synccheck, initcheck (tools/sanitize.sh)"
  OUT="$OUT" SANITIZE_BUDGET_S=${SANITIZE_BUDGET_S:-450} tools/sanitize.sh >"$OUT/sanitize.log" 2>&1 || status=1
  tail -45 "$OUT/sanitize_summary.txt"
  # One archive: the device tool returns only a few files from $OUT.
  tar czf "$OUT/sanitize_logs.tgz" -C "$OUT" sanitize && rm -rf "$OUT/sanitize"
fi

if has stress; then
  step "stress: random calls on 4 streams with graph replays, checked against the CPU backend"
  python3 -m stress calls --count ${STRESS_CALLS:-100000} --streams 4 --device cuda \
    --max-seconds ${STRESS_CALLS_S:-420} --quiet >"$OUT/stress_calls.json" 2>"$OUT/stress_calls.log" || status=1
  tail -5 "$OUT/stress_calls.log"; tail -c 1200 "$OUT/stress_calls.json"; echo
  step "stress: Kimi K3 decode chain (93 layers, H = 7168), fold on vs off, one graph per step"
  python3 -m stress chain --steps ${STRESS_STEPS:-10000} --device cuda --max-seconds ${STRESS_CHAIN_S:-240} \
    --quiet >"$OUT/stress_chain.json" 2>"$OUT/stress_chain.log" || status=1
  tail -5 "$OUT/stress_chain.log"; tail -c 1200 "$OUT/stress_chain.json"; echo
fi

step "done: status $status"
exit $status
