"""Quick kernel self-check on a GPU (seconds): every kernel and mode against the CPU backend and the float64
oracle on a few shapes, the add2 bitwise properties, determinism. The full suites live in tests/; this is the
first thing tools/gpu_check.sh runs, so a broken build fails fast and loud."""

import itertools
import sys

import torch

import attnres
from attnres import reference as R

bf = torch.bfloat16
fails = 0


def case(T, N, H, kernel, seed):
    global fails
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0, off=0.0: (torch.randn(*s, generator=g) * sc + off).to(bf)
    lr, add, add2 = r(T, H), r(T, H, sc=0.5), r(T, H, sc=0.5)
    bank_full = r(N + 1, T, H, sc=2.0)
    bank = bank_full[: N - 1]
    rw, mw, nw = r(H, sc=0.02), r(H, sc=0.1, off=1.0), r(H, sc=0.1, off=1.0)
    opt = attnres.Options(kernel=kernel)
    plan = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=N, hidden=H, device="cuda", add=True, add2=True,
                        options=opt)
    if not plan.accepted:
        return
    c = lambda t: t.cuda()
    ref = R.attn_res(lr, bank, rw, mw, 1e-5, layer_residual_add=add, layer_residual_add2=add2, norm_weight=nw,
                     norm_eps=1e-6)
    u, o, m = attnres.attn_res_add_rmsnorm(c(lr), c(add), c(bank), c(rw), c(mw), c(nw), 1e-5, 1e-6,
                                           layer_residual_add2=c(add2), return_mixture=True, options=opt)
    u1, o1, m1 = attnres.attn_res_add_rmsnorm(c(lr), c(add + add2), c(bank), c(rw), c(mw), c(nw), 1e-5, 1e-6,
                                              return_mixture=True, options=opt)
    o0, m0 = attnres.attn_res_rmsnorm(u, c(bank), c(rw), c(mw), c(nw), 1e-5, 1e-6, return_mixture=True, options=opt)
    mix, rs, pr, lg = attnres.attn_res(u, c(bank), c(rw), c(mw), 1e-5, options=opt)
    torch.cuda.synchronize()
    tag = f"T={T} N={N} H={H} {plan.kernel}/c{plan.cluster}"
    try:
        assert torch.equal(u.cpu(), lr + (add + add2)), "updated != torch prefix + (add + add2)"
        R.check_close(o, ref.output, "output")
        R.check_close(m, ref.mixture, "mixture")
        R.check_close(mix, ref.mixture, "attn_res mixture")
        R.check_close(rs, ref.rsigma, "rsigma")
        R.check_close(pr, ref.probs, "probs")
        R.check_close(lg, ref.logits, "logits")
        for a, b, what in ((u, u1, "updated"), (o, o1, "output add2 vs pre-summed"), (m, m1, "tap add2 vs pre-summed"),
                           (o, o0, "output add2 vs no-add on prefix"), (m, m0, "tap vs no-add"), (m, mix, "tap vs attn_res")):
            assert torch.equal(a, b), f"{what} not bitwise equal"
        u2, o2 = attnres.attn_res_add_rmsnorm(c(lr), c(add), c(bank), c(rw), c(mw), c(nw), 1e-5, 1e-6,
                                              layer_residual_add2=c(add2), options=opt)
        assert torch.equal(o2, o), "not deterministic"
    except AssertionError as e:
        fails += 1
        print(f"FAIL {tag}: {e}", flush=True)


def main():
    n = 0
    for (T, N, H), kernel in itertools.product(
            [(1, 1, 7168), (1, 2, 7168), (1, 4, 7168), (1, 5, 7168), (1, 9, 7168), (3, 9, 7168), (1, 16, 7168),
             (33, 12, 4096), (2, 9, 2304), (5, 7, 8192), (1, 3, 16384), (4, 16, 16384), (3, 6, 1160), (2, 3, 8),
             (32, 9, 7168)],
            ["single_cta", "split_k"]):
        case(T, N, H, kernel, seed=n)
        n += 1
    print(f"gpu_smoke: {n} cases, {fails} failures", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
