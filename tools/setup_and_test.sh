#!/usr/bin/env bash
# Set up from nothing (tools/common.sh) and run every test: the GoogleTest suites, the consumer checks and the
# ATTNRES_CUDA option check through ctest, then pytest. Exits non-zero if any step or any test fails.
#   tools/setup_and_test.sh                     # CI and development machines
#   ATTNRES_NO_VENV=1 tools/setup_and_test.sh   # the GPU machine (offline, preinstalled deps)
# One build serves the package, the demo and the C++ tests, so the CUDA kernels compile once: the package is
# built in build/package (the directory and options tools/setup_and_demo.sh uses) with the GoogleTest suites
# added, and ctest runs in that directory; its consumer check links the installed copy of the same library.
# ATTNRES_CTEST_CUDA different from ATTNRES_CUDA needs a build of its own (build/ctest).
ATTNRES_PACKAGE_TESTS=ON
if [ -n "${ATTNRES_CTEST_CUDA:-}" ] && [ "${ATTNRES_CTEST_CUDA}" != "${ATTNRES_CUDA:-AUTO}" ]; then
  ATTNRES_PACKAGE_TESTS=OFF
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# GoogleTest for the C++ suites (Debian libgtest-dev, unless a CMake package of it is already there). ninja
# comes from the venv.
setup "libgtest-dev:[ -d .gpu_carry/gtest ] || ls /usr/lib/*/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake /usr/local/lib/cmake/GTest/GTestConfig.cmake >/dev/null 2>&1"

CTEST_BUILD=$PACKAGE_BUILD
if [ "$ATTNRES_PACKAGE_TESTS" = OFF ]; then
  CTEST_BUILD=build/ctest
  build_cpp_tests() {
    local extra=()
    [ -d .gpu_carry/gtest ] && extra+=(-DCMAKE_PREFIX_PATH="$REPO_ROOT/.gpu_carry/gtest")
    cmake -S . -B "$CTEST_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTNRES_BUILD_TESTS=ON \
      -DATTNRES_CUDA="$ATTNRES_CTEST_CUDA" -DCMAKE_CUDA_ARCHITECTURES="$CMAKE_CUDA_ARCHITECTURES" \
      ${extra[@]+"${extra[@]}"}
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
timed pytest "$PYTHON" -m pytest -q ${xdist[@]+"${xdist[@]}"} tests || status=1
[ $status -eq 0 ] && log "all tests passed" || log "FAILED (see above)"
exit $status
