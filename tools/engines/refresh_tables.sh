#!/usr/bin/env bash
# Measures vLLM's and SGLang's AttnRes paths against the plugins' on this Hopper GPU, writes this GPU's tables into
# the checkout (python/attnres/integrations/tables/{vllm,sglang}/<GPU>.json), then runs the engines' own test files
# with the plugins serving. On the GPU host, with attnres installed and build/engines prepared (docs/integrations.md:
# bench_vllm.py prepare, sglang_prepare.sh, the engines' test files):
#
#   tools/engines/refresh_tables.sh            # results under $OUT (default build/engine_tables)
#
# About two minutes on an H100 (324 vLLM points, 210 SGLang points). Exits non-zero if a step fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-build/engine_tables}
mkdir -p "$out"
# ATTNRES_COMMIT first: a copied tree may carry a .git of another commit.
commit=${ATTNRES_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# The checkout's copy of this GPU's SGLang table (bench_vllm.py table finds its own).
sglang_table=python/attnres/integrations/$(cd / && python3 -c "
import torch
from attnres.integrations import _common
print(_common.table_file('sglang', torch.cuda.get_device_name()).relative_to(_common.TABLES_DIR.parent))")
PYTHONPATH=build/engines/vllm python3 tools/engines/bench_vllm.py run --out "$out/vllm_sites.json" | tail -3
python3 tools/engines/bench_vllm.py table "$out/vllm_sites.json"
mkdir -p "$(dirname "$sglang_table")"
ATTNRES_COMMIT=$commit python3 tools/engines/bench_sglang.py --sglang-src build/engines/sglang_ref \
  --out "$out/sglang.json" --write-table "$sglang_table" | tail -2
ATTNRES_VLLM_STANDIN=1 bash tools/engines/test_vllm.sh build/engines/vllm_tests/test_attn_res.py -rs | tee "$out/vllm_tests.txt" | tail -3
ATTNRES_SGLANG_STANDIN=1 bash tools/engines/test_sglang.sh build/engines/sglang_tests/*.py -- -rs | tee "$out/sglang_tests.txt" | tail -3
echo "refresh_tables: this GPU's tables written; results in $out"
