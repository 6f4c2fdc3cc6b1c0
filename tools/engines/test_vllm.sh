#!/usr/bin/env bash
# Runs vLLM's own AttnRes tests (tests/models/kimi_k3/test_attn_res.py of vLLM 0.33.0: not in the wheel, pass its
# path) with the attnres vLLM plugin active, on a Hopper GPU. Every call attnres supports is served by attnres
# (the measured table is bypassed; ATTNRES_VLLM_TEST_TABLE=shipped keeps it); the run fails if none was.
#
#   tools/engines/test_vllm.sh PATH/TO/test_attn_res.py [pytest args...]
#
# vLLM: the installed one if `import vllm` works (ATTNRES_VLLM_STANDIN=1 forces the stand-in), else the
# stand-in tree of `tools/engines/bench_vllm.py prepare` in build/engines/vllm (copy build/engines to the GPU host).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
test_file="${1:?usage: $0 PATH/TO/test_attn_res.py [pytest args...]}"
shift
py="${PYTHON:-python3}"
[ -x "$root/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && py="$root/.venv/bin/python"
# The installed attnres (a wheel: python/ has no extension module and would shadow it); python/ only without one.
path="$root/tools/engines"
(cd / && "$py" -c "import attnres._C") 2>/dev/null || path="$root/python:$path"
if [ "${ATTNRES_VLLM_STANDIN:-0}" = 1 ] || ! "$py" -c "import vllm" 2>/dev/null; then
  [ -f "$root/build/engines/vllm/vllm/models/kimi_k3/nvidia/ops/attn_res.py" ] || {
    echo "test_vllm.sh: no vLLM: run tools/engines/bench_vllm.py prepare <vllm wheel> first" >&2; exit 2; }
  path="$path:$root/build/engines/vllm"
fi
export ATTNRES_VLLM=1
PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m pytest -p vllm_pytest_plugin -p no:cacheprovider \
  --rootdir "$(dirname "$test_file")" "$test_file" "$@"
