"""One call of FlagGems-vllm's fixed-configuration kernel (vLLM's `attn_res_add_rmsnorm` site: an addend, no
snapshot write; H = 7168) at large T, for Nsight Compute beside tools/profile_large_t.py's attnres call:

  PYTHONPATH=build/engines/flaggems ncu --clock-control none --cache-control all -k regex:_attn_res_fixed -s 1 -c 1 \
      --set full python3 tools/engines/profile_flaggems.py T N          e.g. 4096 2

build/engines/flaggems is prepared by `tools/engines/bench_vllm.py prepare-flaggems` (docs/integrations.md). The
bank is FlagGems' `[T, 8, H]`, N - 1 of its rows attended (N <= 9). The call runs twice (-s 1 profiles the second:
Triton's compile and first-call work stay out of it).
"""
import sys

T, N = int(sys.argv[1]), int(sys.argv[2])
if not 1 <= N <= 9:
    sys.exit(f"profile_flaggems: N must be in 1..9 (FlagGems' bank holds 8 rows), got {N}")

import torch  # noqa: E402
from flaggems_vllm import attn_res  # noqa: E402
H = 7168
g = torch.Generator(device="cuda").manual_seed(N)
r = lambda *s, sc=1.0, off=0.0: (torch.randn(*s, generator=g, device="cuda") * sc + off).to(torch.bfloat16)  # noqa: E731
prefix, delta, blocks = r(T, H), r(T, H), r(T, 8, H)
norm_weight, qk_weight, output_norm_weight = r(H, sc=0.1, off=1.0), r(H, sc=0.02), r(H, sc=0.1, off=1.0)
for _ in range(2):
    attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks=N - 1, block_write_idx=-1,
             eps=1e-5, output_norm_eps=1e-5)
torch.cuda.synchronize()
