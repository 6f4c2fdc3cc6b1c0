"""The automatic topology (the default Options): the kernel changes with T, the bits of a token do not.

With `Options()` a call with one addend or none runs on the persistent kernel where its plan takes two blocks per
SM (H = 7168 does) from the T its GPU's grid measured it faster for the call's N (tuning::automatic_persistent_min_tokens:
on the H200 at H = 7168 T >= 512 for N = 9 with or without the addend; never on the H100, where split_k's exact-N
instances beat it; the other N per op and GPU in docs/ops/common.md), smaller calls on split_k (docs/ops/common.md,
routing); every CUDA kernel reduces in split_k's order, so a token's `updated` and `output` must be the same bits
whatever T the call has. Checked at T = 1 ... 16384 for N = 9 (across the H200's crossover: T - 1, T, T + 1)
against the 16384-token call, with and without the addend, on tokens taken from the start, the middle and the end
of the batch; the persistent calls (forced on the H100) are also checked against split_k forced on the same
tokens, and so are the default's calls at two more N (one where the persistent kernel never runs).
"""

from __future__ import annotations

import pytest
import torch

import attnres
from conftest import requires_cuda
from helpers import assert_same_bits

pytestmark = [requires_cuda, pytest.mark.gpu]

# The GPU's grid (tuning::topology_grid): the H100's default never takes the persistent kernel.
H100 = torch.cuda.is_available() and torch.cuda.get_device_name().startswith("NVIDIA H100")
H, N, T_MAX = 7168, 9, 16384
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator(device="cuda").manual_seed(16384)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(BF16)

    return {"prefix": draw(T_MAX, H), "add": draw(T_MAX, H, scale=0.5), "bank": draw(N - 1, T_MAX, H, scale=2.0),
            "res_w": draw(H, scale=0.02), "rms_w": 1 + draw(H, scale=0.1), "norm_w": 1 + draw(H, scale=0.1)}


def _call(b, lo: int, hi: int, add: bool):
    w = (b["res_w"], b["rms_w"], b["norm_w"], 1e-5, 1e-5)
    if add:
        return list(attnres.attn_res_add_rmsnorm(b["prefix"][lo:hi], b["add"][lo:hi], b["bank"][:, lo:hi], *w))
    return [attnres.attn_res_rmsnorm(b["prefix"][lo:hi], b["bank"][:, lo:hi], *w)]


AROUND = 512  # the H200's crossover at N = 9, H = 7168; the same T on the H100
CROSSOVER = None if H100 else AROUND
T_GRID = tuple(sorted({1, 2, 31, 128, AROUND - 1, AROUND, AROUND + 1, 1000, 4096, 8192, T_MAX - 1}))
# The persistent calls: the default's on the H200, forced on the H100.
PERSISTENT = attnres.Options(kernel="persistent") if H100 else attnres.Options()


def _kernel_at(op: str, T: int, add: bool) -> str:
    return attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cuda", add=add).kernel


@pytest.mark.parametrize("add", [True, False], ids=["add", "noadd"])
def test_default_options_give_a_token_the_same_bits_at_every_T(batch, add):
    op = "attn_res_add_rmsnorm" if add else "attn_res_rmsnorm"
    big = attnres.plan(op, tokens=T_MAX, candidates=N, hidden=H, device="cuda", add=add)
    assert big.kernel == ("split_k" if H100 else "persistent"), big
    full = _call(batch, 0, T_MAX, add)
    for T in T_GRID:
        kernel = _kernel_at(op, T, add)
        assert kernel == ("persistent" if CROSSOVER and T >= CROSSOVER else "split_k"), (T, kernel)
        for lo in (0, (T_MAX - T) // 2, T_MAX - T):
            got = _call(batch, lo, lo + T, add)
            for i, (g, f) in enumerate(zip(got, full)):
                assert_same_bits(g, f[lo:lo + T], f"{op} output #{i}: tokens [{lo}, {lo + T}) in a call of {T} "
                                                  f"({kernel}) vs of {T_MAX} ({big.kernel})")


@pytest.mark.parametrize("add", [True, False], ids=["add", "noadd"])
def test_persistent_default_matches_forced_split_k_across_the_crossover(batch, add):
    """The default's persistent calls (two blocks per SM; forced on the H100) give split_k's bits on the same
    tokens."""
    op = "attn_res_add_rmsnorm" if add else "attn_res_rmsnorm"
    w = (batch["res_w"], batch["rms_w"], batch["norm_w"], 1e-5, 1e-5)
    split_k = attnres.Options(kernel="split_k")
    fn = getattr(attnres, op)
    for T in (AROUND, AROUND + 1, 4096, T_MAX):
        p = attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cuda", add=add, options=PERSISTENT)
        assert p.kernel == "persistent" and p.blocks_per_sm == 2, (T, p)
        args = (batch["prefix"][:T], *([batch["add"][:T]] if add else []), batch["bank"][:, :T], *w)
        got, want = fn(*args, options=PERSISTENT), fn(*args, options=split_k)
        got, want = (got, want) if add else ((got,), (want,))
        for i, (g, f) in enumerate(zip(got, want)):
            assert_same_bits(g, f, f"{op} output #{i} at T = {T}: persistent vs split_k")


@pytest.mark.parametrize("n, crossover", [(6, None), (12, None)] if H100 else [(6, 256), (12, None)],
                         ids=["n6", "n12"])
def test_default_matches_forced_split_k_at_other_n(batch, n, crossover):
    """At N = 6 the H200's default takes the persistent kernel from its crossover, the H100's never; at N = 12
    neither. Either way the bits are split_k's."""
    g = torch.Generator(device="cuda").manual_seed(n)
    bank = (2.0 * torch.randn(n - 1, 1024, H, generator=g, device="cuda")).to(BF16)
    w = (batch["res_w"], batch["rms_w"], batch["norm_w"], 1e-5, 1e-5)
    split_k = attnres.Options(kernel="split_k")
    for T in ((crossover - 1, crossover) if crossover else (255, 256)) + (1024,):
        kernel = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=n, hidden=H, device="cuda", add=True).kernel
        assert kernel == ("persistent" if crossover is not None and T >= crossover else "split_k"), (n, T, kernel)
        args = (batch["prefix"][:T], batch["add"][:T], bank[:, :T], *w)
        got = attnres.attn_res_add_rmsnorm(*args)
        want = attnres.attn_res_add_rmsnorm(*args, options=split_k)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_bits(a, b, f"output #{i} at N = {n}, T = {T}: default ({kernel}) vs split_k")
