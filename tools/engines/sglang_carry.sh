#!/usr/bin/env bash
# Copies the two SGLang files tools/engines/bench_sglang.py runs (attn_residual.py and the plugin hook registry)
# from an unpacked SGLang wheel into build/engines/sglang_ref (ignored), to name in the device tool's carry.
# Usage: tools/engines/sglang_carry.sh [UNPACKED_WHEEL_ROOT]   (default /work/engine_wheels/sglang)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
src=${1:-/work/engine_wheels/sglang}
dst=build/engines/sglang_ref
for rel in sglang/srt/layers/attn_residual.py sglang/srt/plugins/hook_registry.py; do
  [ -f "$src/$rel" ] || { echo "sglang_carry: $src/$rel not found"; exit 1; }
  mkdir -p "$dst/$(dirname "$rel")"
  cp "$src/$rel" "$dst/$rel"
done
du -sh "$dst"
