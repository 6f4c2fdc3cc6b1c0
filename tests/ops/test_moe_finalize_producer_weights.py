"""The weights a MoE producer hands to its consumer are the buffer its routing used (docs/ops/moe_finalize.md): the
deferred path (producer pieces -> attnres.moe_finalize) equals the producer's own finalized output bit for bit,
since both sum fp32 products in j order and round once — with routing computed inside the producer and with
routing pre-computed by the caller, whose weights buffer the producer reads without writing a local one.

The checks have teeth: a producer that hands over its local buffer instead (never written, zeroed or random: no
crash, garbage routing weights) must make the same comparison fail.
"""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import moe
from attnres.models.moe_producer import MoePieces, ToyRoutedMoE
from attnres.reference import check_close

BF16 = torch.bfloat16

# (hidden, experts, top_k, tokens, local experts (None: all), routed scale, weights dtype)
SHAPES = [
    (64, 8, 2, 1, None, 1.0, torch.float32),
    (256, 16, 8, 2, None, 2.5, torch.float32),
    (128, 32, 16, 3, range(0, 32, 2), 2.827, torch.bfloat16),  # expert parallel: half the routes remote
    (200, 12, 4, 16, range(6), 1.0, torch.bfloat16),
]


def _shape_id(s) -> str:
    hidden, experts, k, T, local, scale, wd = s
    return f"D{hidden}-E{experts}-k{k}-T{T}-{'ep' if local is not None else 'all'}-s{scale:g}-{str(wd)[6:]}"


def _moe(shape, device) -> tuple[ToyRoutedMoE, torch.Tensor]:
    hidden, experts, k, T, local, scale, wd = shape
    layer = ToyRoutedMoE(hidden, experts, k, seed=hidden * 31 + experts, device=device, routed_scale=scale,
                         local_experts=local, weights_dtype=wd)
    x = (torch.randn(T, hidden, generator=torch.Generator().manual_seed(T + hidden)) * 2).to(BF16).to(device)
    return layer, x


def _caller_routing(layer: ToyRoutedMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing computed by the caller with its own scoring, as Kimi/DeepSeek-style gates do: sigmoid scores,
    experts picked by score + a load-balancing bias, weights = the picked scores normalized. Its weights (and
    often its experts) differ from what the runner's own softmax router would produce."""
    scores = torch.sigmoid(x.float() @ layer.router.float().t())
    bias = torch.linspace(-0.05, 0.05, layer.num_experts, device=x.device)
    ids = (scores + bias).topk(layer.top_k, dim=-1).indices
    picked = scores.gather(1, ids)
    weights = (picked / picked.sum(-1, keepdim=True)).to(layer.weights_dtype)
    return weights, ids.to(torch.int32)


def _consume(pieces: MoePieces) -> torch.Tensor:
    return attnres.moe_finalize(pieces.rows, pieces.weights, pieces.index, eps=1e-5, scale=pieces.scale)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.detach().cpu().view(torch.int16), b.detach().cpu().view(torch.int16))


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_deferred_equals_finalized_with_internal_routing(shape, device):
    layer, x = _moe(shape, device)
    pieces = layer(x, do_finalize=False)
    assert _same_bits(_consume(pieces), layer(x))


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_deferred_equals_finalized_with_caller_routing(shape, device):
    layer, x = _moe(shape, device)
    topk_weights, topk_ids = _caller_routing(layer, x)
    assert not torch.equal(topk_weights, layer.route(x)[0]), "the caller's routing must differ from the runner's"
    pieces = layer(x, topk_weights=topk_weights, topk_ids=topk_ids, do_finalize=False)
    assert pieces.weights is topk_weights, "the consumer must get the caller's buffer, the one routing used"
    finalized = layer(x, topk_weights=topk_weights, topk_ids=topk_ids)
    assert _same_bits(_consume(pieces), finalized)
    if shape[4] is not None:
        assert bool((pieces.index == -1).any()), "expert parallelism must leave remote routes"


@pytest.mark.parametrize("bug", ["never_written", "zeros", "random"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_the_check_catches_the_seed_bug(shape, bug, device, monkeypatch):
    """The comparison above has teeth: hand over the runner's local buffer (as the seed did), a zeroed one or
    a random one, and the deferred output no longer equals the finalized one."""
    layer, x = _moe(shape, device)
    topk_weights, topk_ids = _caller_routing(layer, x)

    def buggy(self, used, local):
        if bug == "never_written":
            return local
        if bug == "zeros":
            return torch.zeros_like(local)
        g = torch.Generator().manual_seed(99)
        return torch.softmax(torch.randn(local.shape, generator=g), -1).to(local.dtype).to(local.device)

    monkeypatch.setattr(ToyRoutedMoE, "_weights_handed_to_consumer", buggy)
    pieces = layer(x, topk_weights=topk_weights, topk_ids=topk_ids, do_finalize=False)
    assert pieces.weights is not topk_weights
    assert not torch.equal(pieces.weights.cpu(), topk_weights.cpu()), "the simulated bug must hand over other weights"
    finalized = layer(x, topk_weights=topk_weights, topk_ids=topk_ids)
    # a never-written buffer may hold NaN or garbage: moe_finalize must still run (the weights are data)
    deferred = _consume(pieces)
    assert not _same_bits(deferred, finalized)
    with pytest.raises(AssertionError):
        check_close(deferred, finalized, "deferred with the seed's bug")


def test_deferred_tail_through_the_dispatching_helper(device):
    """The deferred tail as a model runs it: pieces + the shared expert's output + the latent norm, through
    finalize_moe_output on both paths, against the runner's own finalize followed by the PyTorch tail."""
    layer, x = _moe(SHAPES[2], device)
    topk_weights, topk_ids = _caller_routing(layer, x)
    pieces = layer(x, topk_weights=topk_weights, topk_ids=topk_ids, do_finalize=False)
    g = torch.Generator().manual_seed(7)
    shared = (torch.randn(x.shape, generator=g) * 0.5).to(BF16).to(device)
    norm_weight = (1 + 0.1 * torch.randn(x.shape[1], generator=g)).to(BF16).to(device)
    eager = moe.rmsnorm_two_rounding(layer(x, topk_weights=topk_weights, topk_ids=topk_ids) + shared, norm_weight, 1e-5)
    for gate in (16, 0):
        with moe.record_finalize_decisions() as record:
            out = moe.finalize_moe_output(pieces.rows, pieces.weights, pieces.index, shared=shared,
                                          norm_weight=norm_weight, eps=1e-5, scale=pieces.scale, max_tokens=gate)
        assert record[0].path == ("fused" if gate else "unfused")
        check_close(out, eager, f"deferred tail, gate {gate}")


def test_producer_rejects_half_given_routing():
    layer = ToyRoutedMoE(64, 8, 2)
    x = torch.randn(2, 64).to(BF16)
    w, ids = layer.route(x)
    with pytest.raises(ValueError, match="pass both topk_weights and topk_ids"):
        layer(x, topk_weights=w)
    with pytest.raises(ValueError, match=r"pre-computed routing must be \[T, k\] = \[2, 2\]"):
        layer(x, topk_weights=w[:1], topk_ids=ids[:1])


def test_producer_is_deterministic_and_pads_with_nan():
    a, x = _moe(SHAPES[1], "cpu")
    b, _ = _moe(SHAPES[1], "cpu")
    pa, pb = a(x, do_finalize=False), b(x, do_finalize=False)
    assert torch.equal(pa.index, pb.index) and torch.equal(pa.weights, pb.weights)
    assert _same_bits(pa.rows.nan_to_num(0), pb.rows.nan_to_num(0))
    named = torch.zeros(pa.rows.shape[0], dtype=torch.bool)
    named[pa.index[pa.index >= 0].long()] = True
    assert torch.isnan(pa.rows[~named].float()).all() and not torch.isnan(pa.rows[named].float()).any()
    assert pa.rows.shape[0] >= x.shape[0] * a.top_k
