"""One attnres call (H = 7168) at large T for Nsight Compute on the GPU machine:

  ncu --clock-control none --cache-control all -k regex:attn_res -s 1 -c 1 --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
      python3 tools/profile_large_t.py T N TOPOLOGY KERNEL [OP]      e.g. 16384 9 persistent auto, 4096 2 per_token split_k

OP: `add` (attn_res_add_rmsnorm with one addend, the default), `add2` (two addends), `norm`
(attn_res_rmsnorm, no addend) or `mix` (attn_res, no diagnostics).
The call runs twice (-s 1 profiles the second: lazy loading and first-call work stay out of it).
"""
import sys, torch, attnres
bf = torch.bfloat16
T, N, topo, kernel = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
op = sys.argv[5] if len(sys.argv) > 5 else "add"
H = 7168
g = torch.Generator(device="cuda").manual_seed(N)
r = lambda *s, sc=1.0, off=0.0: (torch.randn(*s, generator=g, device="cuda") * sc + off).to(bf)
lr, add, add2, bank = r(T, H), r(T, H), r(T, H), r(N - 1, T, H)
w = (r(H, sc=0.02), r(H, sc=0.1, off=1.0), r(H, sc=0.1, off=1.0))
opt = attnres.Options(topology=topo, kernel=kernel)
calls = {
    "add": lambda: attnres.attn_res_add_rmsnorm(lr, add, bank, *w, 1e-5, 1e-5, options=opt),
    "add2": lambda: attnres.attn_res_add_rmsnorm(lr, add, bank, *w, 1e-5, 1e-5, layer_residual_add2=add2, options=opt),
    "norm": lambda: attnres.attn_res_rmsnorm(lr, bank, *w, 1e-5, 1e-5, options=opt),
    "mix": lambda: attnres.attn_res(lr, bank, *w[:2], 1e-5, diagnostics=False, options=opt),
}
for _ in range(2):
    calls[op]()
torch.cuda.synchronize()
