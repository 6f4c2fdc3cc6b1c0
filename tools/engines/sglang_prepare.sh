#!/usr/bin/env bash
# Copies what the SGLang tools run into ignored folders under build/engines, to copy to the GPU machine with the tree.
#
#   tools/engines/sglang_prepare.sh WHEEL_OR_UNPACKED_ROOT   (sglang-0.5.23-*.whl, or the folder it was unzipped to)
#       SGLang's files that tools/engines/bench_sglang.py and test_sglang.sh import (attn_residual.py, the plugin
#       hook registry, the CI-registration markers SGLang's tests call) -> build/engines/sglang_ref
#   tools/engines/sglang_prepare.sh --tests FILE...
#       SGLang's own test files (they are in SGLang's repository, not in its wheel) -> build/engines/sglang_tests
#   tools/engines/sglang_prepare.sh --tests-git GIT_DIR REV PATH...
#       the same, read from a git clone or mirror of sgl-project/sglang at REV
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
usage="usage: tools/engines/sglang_prepare.sh WHEEL_OR_UNPACKED_ROOT | --tests FILE... | --tests-git GIT_DIR REV PATH..."
case "${1:?$usage}" in
  --tests | --tests-git)
    mode=$1; shift
    dst=build/engines/sglang_tests
    mkdir -p "$dst"
    if [ "$mode" = --tests-git ]; then
      git_dir=${1:?--tests-git GIT_DIR REV PATH...}; rev=${2:?--tests-git GIT_DIR REV PATH...}; shift 2
    fi
    [ $# -gt 0 ] || { echo "sglang_prepare: no test files given"; exit 1; }
    for f in "$@"; do
      # One flat folder: pytest's default import mode needs distinct basenames anyway.
      out="$dst/$(basename "$f")"
      if [ "$mode" = --tests ]; then
        cp "$f" "$out"
      else
        git --git-dir="$git_dir" show "$rev:$f" > "$out" || {
          rm -f "$out"; echo "sglang_prepare: $rev:$f not found"; exit 1; }
      fi
      echo "$out"
    done
    ;;
  *)
    src=$1
    dst=build/engines/sglang_ref
    for rel in sglang/srt/layers/attn_residual.py sglang/srt/plugins/hook_registry.py sglang/test/ci/ci_register.py; do
      mkdir -p "$dst/$(dirname "$rel")"
      if [ -f "$src" ]; then
        unzip -p "$src" "$rel" > "$dst/$rel" || { echo "sglang_prepare: $src lacks $rel"; exit 1; }
      else
        [ -f "$src/$rel" ] || { echo "sglang_prepare: $src/$rel not found"; exit 1; }
        cp "$src/$rel" "$dst/$rel"
      fi
    done
    du -sh "$dst"
    ;;
esac
