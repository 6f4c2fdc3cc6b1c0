#!/usr/bin/env bash
# Copies the two SGLang files tools/engines/bench_sglang.py runs (attn_residual.py and the plugin hook registry)
# from an unpacked SGLang wheel into build/engines/sglang_ref (ignored), to copy to the GPU machine with the tree.
# Usage: tools/engines/sglang_carry.sh UNPACKED_WHEEL_ROOT   (e.g. unzip sglang-0.5.23-*.whl -d sglang_wheel)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
src=${1:?usage: tools/engines/sglang_carry.sh UNPACKED_WHEEL_ROOT}
dst=build/engines/sglang_ref
for rel in sglang/srt/layers/attn_residual.py sglang/srt/plugins/hook_registry.py; do
  [ -f "$src/$rel" ] || { echo "sglang_carry: $src/$rel not found"; exit 1; }
  mkdir -p "$dst/$(dirname "$rel")"
  cp "$src/$rel" "$dst/$rel"
done
du -sh "$dst"
