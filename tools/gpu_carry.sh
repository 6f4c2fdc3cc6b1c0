#!/usr/bin/env bash
# Prepares .gpu_carry/gtest on the development machine: a GoogleTest prefix (headers, static libraries, CMake
# package) copied from Debian's libgtest-dev, for the GPU machine, which has no network to install it. Name
# `.gpu_carry` in the device tool's carry; tools/gpu_check.sh's ctest build finds it there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dpkg-query -W libgtest-dev >/dev/null 2>&1 || { echo "gpu_carry: install libgtest-dev first"; exit 1; }
dst=.gpu_carry/gtest
rm -rf "$dst"
mkdir -p "$dst/include" "$dst/lib/x86_64-linux-gnu/cmake"
cp -r /usr/include/gtest "$dst/include/"
[ -d /usr/include/gmock ] && cp -r /usr/include/gmock "$dst/include/"
cp /usr/lib/x86_64-linux-gnu/libgtest*.a "$dst/lib/x86_64-linux-gnu/"
cp /usr/lib/x86_64-linux-gnu/libgmock*.a "$dst/lib/x86_64-linux-gnu/" 2>/dev/null || true
cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$dst/lib/x86_64-linux-gnu/cmake/"
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || echo '/.gpu_carry/' >> .git/info/exclude
du -sh "$dst"
