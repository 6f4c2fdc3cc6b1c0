"""The persistent kernel's geometry variants (attnres._persistent_tuning: blocks per SM, ring slots, passes) give
split_k's bits (all CUDA-only, skipped elsewhere).

Which thread owns an element and every reduction order depend on H alone, so no knob may change a bit of
`updated` or `output`. Checked over a grid of T (1 token to several per block, several blocks per SM), N in
1..16, H from one vector to 16384, with and without the addend, snapshot- and token-major banks, for every
variant the plan accepts at that shape: the benchmark's (default: two blocks per SM where that geometry
exists; spare1, two_pass, half_ring on one block per SM; two_blocks) and the extremes (the smallest ring of
2 slots, one pass with exactly one spare slot, two blocks per SM with 2 slots and two passes). Results are
cloned and the call's own outputs poisoned with NaN before the next call, so a variant that leaves an output
unwritten cannot inherit the previous call's bits."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _persistent_tuning as tuning
from conftest import requires_cuda

pytestmark = [requires_cuda, pytest.mark.gpu]

V = tuning.Variant
HIDDEN = [8, 200, 1160, 2056, 4096, 7168, 8192, 16384]
TOKENS = [1, 3, 133, 300, 1000]
CANDIDATES = [1, 2, 3, 5, 9, 12, 16]


def _variants(N: int, add: bool) -> list[V]:
    rows = N + (1 if add else 0)
    return [V("default"), V("spare1", blocks_per_sm=1, slots=rows + 1), V("two_pass", blocks_per_sm=1, passes=2),
            V("half_ring", blocks_per_sm=1, slots=7), V("two_blocks", blocks_per_sm=2),
            V("ring2", blocks_per_sm=1, slots=2), V("one_pass_tight", blocks_per_sm=1, slots=rows + 1, passes=1),
            V("two_blocks_ring2", blocks_per_sm=2, slots=2, passes=2), V("explicit_one", blocks_per_sm=1)]


def _kept(tensors):
    kept = tuple(None if t is None else t.clone() for t in tensors)
    for t in tensors:
        if t is not None:
            t.fill_(float("nan"))
    return kept


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _compare(want, got, what: str) -> list[str]:
    bad = []
    for name, a, b in zip(("updated", "output"), got, want):
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            n = "missing" if a is None or b is None else f"{int((_bits(a) != _bits(b)).sum())} of {b.numel()} differ"
            bad.append(f"{what}: {name}: {n}")
    return bad


def _reference(inp, add: bool):
    opts = attnres.Options(kernel="split_k")
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    if add:
        return _kept(attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w, options=opts))
    return _kept((None, attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, options=opts)))


def _check(T: int, N: int, H: int, add: bool, layout: str) -> tuple[list[str], set[str]]:
    from test_persistent import gpu_inputs

    inp = gpu_inputs(T, N, H, layout=layout, add=add, seed=(T * 37 + N) * 11 + H + add)
    want = _reference(inp, add)
    bad, ran = [], set()
    for v in _variants(N, add):
        if not tuning.plan(v, tokens=T, candidates=N, hidden=H, add=add).accepted:
            continue
        got = _kept(tuning.call(v, inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight,
                                inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                layer_residual_add=inp.add if add else None))
        bad += _compare(want, got, f"{v.name} T={T} N={N} H={H} add={add} {layout}")
        ran.add(v.name)
    return bad, ran


@pytest.mark.parametrize("H", HIDDEN)
def test_every_variant_gives_split_k_bits(H):
    bad, ran = [], set()
    for add in (True, False):
        for N in CANDIDATES:
            for T in TOKENS:
                for layout in ("snapshot_major", "token_major"):
                    if layout == "token_major" and T not in (3, 300):
                        continue
                    b, r = _check(T, N, H, add, layout)
                    bad += b
                    ran |= r
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad[:20])
    # What the grid must reach: every variant where the plan accepts it (two blocks per SM needs <= 256
    # threads and 2 slots in half the shared memory; the 8-slot ring fits up to H = 7168 or so).
    assert {"default", "two_pass", "ring2", "spare1", "explicit_one"} <= ran, ran
    two_blocks = tuning.plan(V("b", blocks_per_sm=2), tokens=1, candidates=2, hidden=H, add=True).accepted
    assert ("two_blocks" in ran) == two_blocks, (H, ran)
    if H == 7168:
        assert {"two_blocks", "half_ring", "two_blocks_ring2", "one_pass_tight"} <= ran, ran


def test_two_blocks_per_sm_are_resident_at_kimi_k3():
    """The two-blocks instance fits two blocks per SM at H = 7168 (the launcher refuses it otherwise, rather than
    running one block per SM): the call succeeds, and the plan is the one the benchmark measures."""
    p = tuning.plan(V("two_blocks", blocks_per_sm=2), tokens=4096, candidates=9, hidden=7168, add=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (p.blocks_per_sm, p.slots, p.passes, p.blocks) == (2, 8, 2, min(4096, 2 * sms))
    from test_persistent import gpu_inputs

    inp = gpu_inputs(4096, 9, 7168, add=True, seed=3)
    want = _reference(inp, True)
    got = _kept(tuning.call(V("two_blocks", blocks_per_sm=2), inp.layer_residual, inp.block_residual, inp.res_weight,
                            inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps, layer_residual_add=inp.add))
    assert not _compare(want, got, "two_blocks T=4096 N=9")


@pytest.mark.parametrize("variant", [V("two_blocks", blocks_per_sm=2), V("spare1", slots=4), V("two_pass", passes=2)],
                         ids=lambda v: v.name)
def test_graph_replay_gives_the_eager_bits(variant):
    """Captured in a CUDA graph (the residency check of two blocks per SM runs during the capture), replayed
    after the inputs change: the eager bits of the new inputs."""
    from test_persistent import gpu_inputs

    T, N, H = 700, 2, 7168
    inp = gpu_inputs(T, N, H, add=True, seed=11)
    args = (inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps,
            inp.norm_eps)
    tuning.call(variant, *args, layer_residual_add=inp.add)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        updated, output = tuning.call(variant, *args, layer_residual_add=inp.add)
    fresh = gpu_inputs(T, N, H, add=True, seed=12)
    inp.layer_residual.copy_(fresh.layer_residual)
    inp.add.copy_(fresh.add)
    inp.block_residual.copy_(fresh.block_residual)
    g.replay()
    torch.cuda.synchronize()
    want = _reference(inp, True)
    assert not _compare(want, (updated.clone(), output.clone()), f"{variant.name} graph replay")
