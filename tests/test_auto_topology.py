"""The automatic topology (the default Options): the kernel changes with T, the bits of a token do not.

With `Options()` a one-addend call of T >= tuning::kAutomaticPersistentMinTokens tokens runs on the persistent
kernel and smaller calls on split_k (docs/ops/common.md, routing); every CUDA kernel reduces in split_k's
order, so a token's `updated`, `output` (and, where the op has it, the tap) must be the same bits whatever T
the call has. Checked at T = 1 ... 16384 against the 16384-token call, with and without the addend, on tokens
taken from the start, the middle and the end of the batch.
"""

from __future__ import annotations

import pytest
import torch

import attnres
from conftest import requires_cuda
from helpers import assert_same_bits

pytestmark = [requires_cuda, pytest.mark.gpu]

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


@pytest.mark.parametrize("add", [True, False], ids=["add", "noadd"])
def test_default_options_give_a_token_the_same_bits_at_every_T(batch, add):
    op = "attn_res_add_rmsnorm" if add else "attn_res_rmsnorm"
    big = attnres.plan(op, tokens=T_MAX, candidates=N, hidden=H, device="cuda", add=add)
    assert big.kernel == ("persistent" if add else "split_k"), big
    full = _call(batch, 0, T_MAX, add)
    for T in (1, 2, 31, 128, 1000, 4096, T_MAX - 1):
        small = attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cuda", add=add)
        assert small.kernel == "split_k", (T, small)
        for lo in (0, (T_MAX - T) // 2, T_MAX - T):
            got = _call(batch, lo, lo + T, add)
            for i, (g, f) in enumerate(zip(got, full)):
                assert_same_bits(g, f[lo:lo + T], f"{op} output #{i}: tokens [{lo}, {lo + T}) in a call of {T} "
                                                  f"({small.kernel}) vs of {T_MAX} ({big.kernel})")
