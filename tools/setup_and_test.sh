#!/usr/bin/env bash
# Set up from nothing (tools/common.sh) and run every test: the GoogleTest suites and the consumer check
# through ctest, then pytest. Exits non-zero if any step or any test fails.
#   tools/setup_and_test.sh                     # CI and development machines
#   ATTNRES_NO_VENV=1 tools/setup_and_test.sh   # the GPU machine (offline, preinstalled deps)
# One build serves the package and the C++ tests, so the CUDA kernels compile once: the package is built in
# a fixed directory with the GoogleTest suites and the install rules on (the wheel installs only the
# extension's component), and ctest runs in that directory; its consumer check links the installed copy of
# the same library. ATTNRES_CTEST_CUDA different from ATTNRES_CUDA needs a build of its own (build/ctest).
PACKAGE_BUILD=build/package
PACKAGE_PIP_ARGS=()
if [ -z "${ATTNRES_CTEST_CUDA:-}" ] || [ "${ATTNRES_CTEST_CUDA}" = "${ATTNRES_CUDA:-AUTO}" ]; then
  PACKAGE_PIP_ARGS=(-C "build-dir=$PACKAGE_BUILD" -C cmake.define.ATTNRES_BUILD_TESTS=ON
                    -C cmake.define.ATTNRES_INSTALL=ON)
  # The GPU machine cannot apt-get GoogleTest: a prebuilt copy may be carried in .gpu_carry/gtest.
  [ -d "$(dirname "${BASH_SOURCE[0]}")/../.gpu_carry/gtest" ] &&
    PACKAGE_PIP_ARGS+=(-C "cmake.define.CMAKE_PREFIX_PATH=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.gpu_carry/gtest")
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# gtest for the C++ suites; ninja so CMake does not fall back to make.
setup libgtest-dev ninja-build

CTEST_BUILD=$PACKAGE_BUILD
if [ ${#PACKAGE_PIP_ARGS[@]} -eq 0 ]; then
  CTEST_BUILD=build/ctest
  build_cpp_tests() {
    local extra=()
    [ -d .gpu_carry/gtest ] && extra+=(-DCMAKE_PREFIX_PATH="$REPO_ROOT/.gpu_carry/gtest")
    cmake -S . -B "$CTEST_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTNRES_BUILD_TESTS=ON \
      -DATTNRES_CUDA="$ATTNRES_CTEST_CUDA" -DCMAKE_CUDA_ARCHITECTURES="$CMAKE_CUDA_ARCHITECTURES" \
      "${extra[@]}"
    cmake --build "$CTEST_BUILD" --parallel "$JOBS"
  }
  timed ctest-build build_cpp_tests
fi

# Run both suites even when the first fails, so one CI run reports everything.
status=0
timed ctest ctest --test-dir "$CTEST_BUILD" --output-on-failure -j "$JOBS" || status=1
# pytest-xdist spreads the tests over the cores; the GPU machine may not have it (nothing installable there).
xdist=()
"$PYTHON" -c 'import xdist' 2>/dev/null && xdist=(-n "$JOBS")
timed pytest "$PYTHON" -m pytest -q "${xdist[@]}" tests || status=1
[ $status -eq 0 ] && log "all tests passed" || log "FAILED (see above)"
exit $status
