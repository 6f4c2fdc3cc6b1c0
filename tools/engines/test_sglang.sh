#!/usr/bin/env bash
# Runs SGLang's own AttnRes tests (files of SGLang's repository, not of its wheel: pass their paths;
# `tools/engines/sglang_prepare.sh --tests` copies them into build/engines/sglang_tests) with the attnres SGLang
# plugin active, on a Hopper GPU. Every call attnres supports is served by attnres (the measured table is
# bypassed; ATTNRES_SGLANG_TEST_TABLE=shipped keeps it); the run fails if none was.
#
#   tools/engines/test_sglang.sh TEST_FILE... [-- pytest args...]
#
# SGLang: the installed one if `import sglang.srt.layers.attn_residual` works (ATTNRES_SGLANG_STANDIN=1 forces the
# stand-ins), else SGLang's files copied from its wheel by `tools/engines/sglang_prepare.sh` in
# build/engines/sglang_ref (copy build/engines to the GPU host), with the stand-ins of tools/engines/sglang_pytest_plugin.py.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
tests=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do tests+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#tests[@]} -gt 0 ] || { echo "usage: $0 TEST_FILE... [-- pytest args...]" >&2; exit 2; }
py="${PYTHON:-python3}"
[ -x "$root/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && py="$root/.venv/bin/python"
# The installed attnres (a wheel: python/ has no extension module and would shadow it); python/ only without one.
path="$root/tools/engines"
(cd / && "$py" -c "import attnres._C") 2>/dev/null || path="$root/python:$path"
unset ATTNRES_SGLANG_SRC
if [ "${ATTNRES_SGLANG_STANDIN:-0}" = 1 ] || ! "$py" -c "import sglang.srt.layers.attn_residual" 2>/dev/null; then
  src="$root/build/engines/sglang_ref"
  [ -f "$src/sglang/srt/layers/attn_residual.py" ] && [ -f "$src/sglang/test/ci/ci_register.py" ] || {
    echo "test_sglang.sh: no SGLang: run tools/engines/sglang_prepare.sh <unpacked sglang wheel> first" >&2; exit 2; }
  export ATTNRES_SGLANG_SRC="$src"
fi
export ATTNRES_SGLANG=1
# All files in one session: the check that attnres served a call is over the whole run. --rootdir is the first
# file's folder, so SGLang's repository layout (conftest, ini files) is not needed.
PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m pytest -p sglang_pytest_plugin -p no:cacheprovider \
  --rootdir "$(dirname "${tests[0]}")" "${tests[@]}" "$@"
