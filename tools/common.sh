# Shared setup of tools/setup_and_test.sh and tools/setup_and_demo.sh (sourced, not run).
#
# From a fresh clone on a fresh machine (Debian, Python >= 3.10, gcc, CMake >= 3.24, network to PyPI and
# Debian; nvcc optional, no GPU needed): the missing Debian packages (none, and so no apt and no sudo, when they
# are present), a virtual environment in .venv (reused when present), the pinned Python dependencies, then the
# package itself (CUDA backend when nvcc is found) in build/package, shared by both scripts.
#
# ATTNRES_NO_VENV=1 is for the GPU machine, which has no network and everything preinstalled (torch,
# nanobind, scikit-build-core, pytest): the system python3, no apt, no dependency downloads.
# ATTNRES_CUDA=AUTO|ON|OFF picks the CUDA backend of the package build (default AUTO: on when nvcc exists).

set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"

ATTNRES_NO_VENV=${ATTNRES_NO_VENV:-0}
export ATTNRES_CUDA=${ATTNRES_CUDA:-AUTO}
# sm_90 (H100/H200) always: "native" would fail on machines without a GPU. CMAKE_ARGS reaches the
# scikit-build-core build; the C++ test build gets the same flag.
export CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-90}
export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES}"
JOBS=$(nproc 2>/dev/null || echo 2)

# Exact pins where the build depends on them (nanobind's ABI, scikit-build-core's options); torch pinned
# because an unpinned one resolves to a multi-GB CUDA wheel (2.13.0 is the CPU build on the CI mirror).
PYTHON_DEPS=(torch==2.13.0 nanobind==3.1.0 scikit-build-core==1.1.2 numpy pytest hypothesis pytest-xdist ninja matplotlib)

log() { printf '[attnres] %s\n' "$*" >&2; }

# Phase timings, printed at exit (also when a phase fails) so slow steps are visible in CI logs.
# Each phase runs in a subshell with errexit of its own: bash ignores errexit inside a function whose status
# is being tested, so a failing command in the middle of a multi-command phase would otherwise go unnoticed.
PHASES=()
timed() {
  local name=$1 start rc
  shift
  start=$(date +%s)
  log "== $name"
  set +e
  (set -e; "$@")
  rc=$?
  set -e
  PHASES+=("$(printf '%-14s %5ss%s' "$name" "$(($(date +%s) - start))" "$([ $rc -eq 0 ] || echo "  (failed: $rc)")")")
  return $rc
}
print_phases() {
  [ ${#PHASES[@]} -eq 0 ] && return
  log "phase timings:"
  local p
  for p in "${PHASES[@]}"; do log "  $p"; done
}
trap print_phases EXIT

# Debian packages, installed only when missing: on a machine that already has them (or the Python dependencies
# that replace them: ninja comes from the venv) this needs no apt and no sudo, and says so. Arguments: the
# packages this script needs, each as PACKAGE or PACKAGE:CHECK, where CHECK is a shell test that is true when
# the package's content is already available some other way. Needs root or sudo only when one is missing.
install_system_packages() {
  if [ "$ATTNRES_NO_VENV" = 1 ]; then
    log "ATTNRES_NO_VENV=1: skipping apt (no apt, no sudo)"
    return
  fi
  local missing=() spec pkg check
  for spec in "$@"; do
    pkg=${spec%%:*}
    check=; [ "$pkg" != "$spec" ] && check=${spec#*:}
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' && continue
    [ -n "$check" ] && eval "$check" && continue
    missing+=("$pkg")
  done
  # python3 -m venv needs ensurepip, which Debian's own python3 ships separately (only to create .venv).
  if [ ! -x "$PYTHON" ] && ! python3 -c 'import ensurepip' 2>/dev/null; then
    missing+=("python3-venv")
  fi
  if [ ${#missing[@]} -eq 0 ]; then
    if [ $# -eq 0 ]; then
      log "no system package needed: no apt, no sudo"
    else
      log "system packages present (${*%%:*}): no apt, no sudo needed"
    fi
    return
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { log "missing system packages: ${missing[*]} (install them: needs root)"; return 1; }
    sudo=(sudo)
  fi
  log "installing missing system packages with ${sudo[*]:-root} apt-get: ${missing[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The interpreter everything uses.
if [ "$ATTNRES_NO_VENV" = 1 ]; then
  PYTHON=$(command -v python3)
else
  PYTHON=$REPO_ROOT/.venv/bin/python
fi

# The venv's tools (ninja from pip) come first on PATH: no ninja-build package needed.
[ "$ATTNRES_NO_VENV" = 1 ] || export PATH="$REPO_ROOT/.venv/bin:$PATH"

setup_python() {
  if [ "$ATTNRES_NO_VENV" = 1 ]; then
    log "ATTNRES_NO_VENV=1: using $PYTHON ($("$PYTHON" --version 2>&1)) and its preinstalled packages"
    return
  fi
  [ -x "$PYTHON" ] || python3 -m venv .venv  # reused when present: a re-run only checks the pins
  "$PYTHON" -m pip install -q "${PYTHON_DEPS[@]}"
  # Where nvcc exists, NVIDIA's nvdisasm (a wheel) lets tests/kernels/test_sass_check.py compile the per-token kernels
  # for sm_90 and check their SASS schedule without a GPU. Optional: without it that one test skips.
  if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
    "$PYTHON" -m pip install -q nvidia-cuda-nvdisasm==13.5.37 ||
      log "nvidia-cuda-nvdisasm not installable: the compiled-SASS test skips"
  fi
}

# The package, built against the torch/nanobind already installed (no build isolation: an isolated build
# would download its own, unpinned, copies). Both README commands build it in one directory, build/package,
# with the same options, so the CUDA kernels compile once whichever runs first; setup_and_test.sh adds the
# GoogleTest suites to that build (ATTNRES_PACKAGE_TESTS=ON: test targets only, the library is not recompiled)
# and the install rules are always on (the wheel installs only the extension's component).
PACKAGE_BUILD=build/package
ATTNRES_PACKAGE_TESTS=${ATTNRES_PACKAGE_TESTS:-OFF}
PACKAGE_PIP_ARGS=(-C "build-dir=$PACKAGE_BUILD" -C cmake.define.ATTNRES_INSTALL=ON
                  -C "cmake.define.ATTNRES_BUILD_TESTS=$ATTNRES_PACKAGE_TESTS")
# The GPU machine cannot apt-get GoogleTest: a prebuilt copy may be carried in .gpu_carry/gtest.
[ -d "$REPO_ROOT/.gpu_carry/gtest" ] &&
  PACKAGE_PIP_ARGS+=(-C "cmake.define.CMAKE_PREFIX_PATH=$REPO_ROOT/.gpu_carry/gtest")
install_package() {
  local no_deps=()
  [ "$ATTNRES_NO_VENV" = 1 ] && no_deps=(--no-deps)
  log "building the package in $PACKAGE_BUILD (ATTNRES_CUDA=$ATTNRES_CUDA, C++ tests $ATTNRES_PACKAGE_TESTS)"
  "$PYTHON" -m pip install -q --no-build-isolation "${no_deps[@]}" "${PACKAGE_PIP_ARGS[@]}" .
  "$PYTHON" -c 'import attnres; print("[attnres] installed", attnres.__version__, attnres.backend_info())' >&2
}

setup() {
  timed apt install_system_packages "$@"
  timed python setup_python
  timed package install_package
}
