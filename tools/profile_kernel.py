"""Launches the per-token kernel for profiling under Nsight Compute (ncu) on the GPU machine.

  python3 tools/profile_kernel.py sweep          one add2 call per (N, kernel) at T = 1, H = 7168
  python3 tools/profile_kernel.py one N [KERNEL]  a single add2 call (for source-level stall sampling)
"""

import sys

import torch

import attnres

bf = torch.bfloat16


def call(T, N, H, kernel, cluster=0):
    g = torch.Generator(device="cuda").manual_seed(N)
    r = lambda *s, sc=1.0, off=0.0: (torch.randn(*s, generator=g, device="cuda") * sc + off).to(bf)
    lr, add, add2, bank = r(T, H), r(T, H), r(T, H), r(N - 1, T, H)
    w = (r(H, sc=0.02), r(H, sc=0.1, off=1.0), r(H, sc=0.1, off=1.0))
    opt = attnres.Options(kernel=kernel, cluster=cluster)
    attnres.attn_res_add_rmsnorm(lr, add, bank, *w, 1e-5, 1e-5, layer_residual_add2=add2, options=opt)


def main():
    if sys.argv[1] == "sweep":
        for N in (1, 2, 3, 4, 5, 9, 12, 16):
            for kernel in ("single_cta", "split_k"):
                if kernel == "single_cta" and N > 4:
                    continue
                call(1, N, 7168, kernel)
        for c in (4, 7, 8):
            call(1, 9, 7168, "split_k", c)
    else:
        call(1, int(sys.argv[2]), 7168, sys.argv[3] if len(sys.argv) > 3 else "split_k")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
