"""The FP8 argument rules the Python layer owns (docs/preconditions.md): a bad mode is refused by the ops with
attnres.ArgumentError naming the op, and by the reference quantizer; nothing is written."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import fp8

BF16 = torch.bfloat16


def test_op_refuses_an_unknown_fp8_mode_and_writes_nothing():
    T, K, H = 2, 3, 128
    g = torch.Generator().manual_seed(0)
    prefix, bank = torch.randn(T, H, generator=g).to(BF16), torch.randn(K, T, H, generator=g).to(BF16)
    w = torch.ones(H, dtype=BF16)
    before = (prefix.clone(), bank.clone())
    with pytest.raises(attnres.ArgumentError,
                       match="^attn_res_rmsnorm: fp8 must be None, 'per_token' or 'block128', got 'bogus'$"):
        attnres.attn_res_rmsnorm(prefix, bank, w, w, w, 1e-5, 1e-5, fp8="bogus")
    assert torch.equal(prefix, before[0]) and torch.equal(bank, before[1])


def test_reference_quantizer_rejects_a_bad_mode_or_width():
    x = torch.ones(2, 96, dtype=BF16)
    with pytest.raises(ValueError, match=r"^fp8.quantize: mode must be one of \('per_token', 'block128'\), got 'x'$"):
        fp8.quantize(x, "x")
    with pytest.raises(ValueError, match="^fp8.quantize: block128 needs H a multiple of 128, got 96$"):
        fp8.quantize(x, "block128")
