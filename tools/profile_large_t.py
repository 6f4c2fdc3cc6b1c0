"""One attn_res_add_rmsnorm call (one addend, H = 7168) at large T for Nsight Compute on the GPU machine:

  ncu --clock-control none --cache-control all -k regex:attn_res -s 1 -c 1 --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
      python3 tools/profile_large_t.py T N TOPOLOGY KERNEL      e.g. 16384 9 persistent auto, 4096 2 per_token split_k

The call runs twice (-s 1 profiles the second: lazy loading and first-call work stay out of it).
"""
import sys, torch, attnres
bf = torch.bfloat16
T, N, topo, kernel = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
H = 7168
g = torch.Generator(device="cuda").manual_seed(N)
r = lambda *s, sc=1.0, off=0.0: (torch.randn(*s, generator=g, device="cuda") * sc + off).to(bf)
lr, add, bank = r(T, H), r(T, H), r(N - 1, T, H)
w = (r(H, sc=0.02), r(H, sc=0.1, off=1.0), r(H, sc=0.1, off=1.0))
opt = attnres.Options(topology=topo, kernel=kernel)
for _ in range(2):
    attnres.attn_res_add_rmsnorm(lr, add, bank, *w, 1e-5, 1e-5, options=opt)
torch.cuda.synchronize()
