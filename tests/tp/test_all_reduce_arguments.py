"""The all-reduce ops' argument rules the Python layer owns (docs/preconditions.md, family "all-reduce ops"):
the kernel name, the fused site and its addend, the snapshot slot. Each is refused before anything runs: no
rank's communicator advances and no input changes."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres.comm import InProcessWorld

from helpers import make_inputs

BF16 = torch.bfloat16
OP = "all_reduce_attn_res_add_rmsnorm"


def _world_and_parts(T=1, H=256):
    world = InProcessWorld(2, 4, H)
    g = torch.Generator().manual_seed(1)
    return world, [torch.randn(T, H, generator=g).to(BF16) for _ in range(2)]


def test_all_reduce_refuses_an_unknown_kernel():
    world, parts = _world_and_parts()
    with pytest.raises(ValueError, match=r"^all_reduce: kernel must be one of \(.*\), got 'fastest'$"):
        world.all_reduce(parts, kernel="fastest")
    assert all(int(c.state[0]) == 0 for c in world.comms)
    world.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"site": "add3"}, rf"^{OP}: site must be one of \(.*\), got 'add3'$"),
    ({"site": "add", "layer_residual_add": "addend"},
     rf"^{OP}: layer_residual_add is the reduced partial at site add; pass None$"),
    ({"snapshot_slot": -1}, rf"^{OP}: snapshot_slot must be None or a row index >= K, got -1$"),
])
def test_fused_site_refuses_bad_arguments_and_writes_nothing(kwargs, message):
    x = make_inputs(1, 3, 256, addends=1, seed=2)
    if kwargs.get("layer_residual_add") == "addend":
        kwargs = kwargs | {"layer_residual_add": x.add}
    world, parts = _world_and_parts()
    before = (x.layer_residual.clone(), x.block_residual.clone())
    with pytest.raises(attnres.ArgumentError, match=message):
        world.run(lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(
            c, p, x.layer_residual, x.block_residual, x.res_weight, x.rms_weight, x.norm_weight, x.rms_eps,
            x.norm_eps, **kwargs), parts)
    assert torch.equal(x.layer_residual, before[0]) and torch.equal(x.block_residual, before[1])
    assert all(int(c.state[0]) == 0 for c in world.comms)
    world.close()
