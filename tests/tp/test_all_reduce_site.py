"""The fused all-reduce site (all_reduce_attn_res_add_rmsnorm, docs/ops/all_reduce.md): the one-shot all-reduce
then the plain op, joined by PDL. What test_all_reduce.py does not cover: T above the communicator's capacity
refused before anything runs (no generation advances), and torch.library.opcheck of the torch op."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres.comm import InProcessWorld

from conftest import DEVICES
from helpers import make_inputs
from test_all_reduce import partials_for

BF16 = torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_above_capacity_rejected(device):
    x = make_inputs(3, 3, 64, addends=1, seed=3, device=device)
    world = InProcessWorld(2, 2, 64, device=device)
    parts = [p.to(device) for p in partials_for(2, 3, 64, seed=4)]
    with pytest.raises(attnres.ArgumentError, match="above the communicator's capacity of 2"):
        world.run(lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(
            c, p, x.layer_residual, x.block_residual, x.res_weight, x.rms_weight, x.norm_weight, x.rms_eps,
            x.norm_eps), parts)
    assert all(int(c.state[0]) == 0 for c in world.comms)
    world.close()


def test_opcheck():
    g = torch.Generator().manual_seed(11)
    T, H, K = 4, 128, 2
    lr, add = (torch.randn(T, H, generator=g).to(BF16) for _ in range(2))
    bank = torch.randn(K + 1, T, H, generator=g).to(BF16)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(BF16)
    comm = InProcessWorld(1, 8, H).comms[0]
    args = (add, add[None], comm.state, comm.handle, "add", lr, None, bank, K, K, w, w, w, 1e-5, 1e-6, True)
    torch.library.opcheck(torch.ops.attnres.all_reduce_attn_res_add_rmsnorm.default, args)
