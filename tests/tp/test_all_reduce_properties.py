"""Property-based tests (hypothesis) of the all-reduce ops and communicators on the CPU (issue 34): random
worlds (W = 1..8), T, D, mismatches between ranks, closed communicators, aliasing between the partial, the
prefix, the bank and the outputs. Every call either matches the contract on every rank, or raises an attnres
error and writes nothing: no output given through out=, no bank row, no partial, no communicator state.

In one process the world's ranks run one after another (InProcessWorld.run), so a fault that every rank
shares (an alias, T above the capacity, a dtype mismatch) is refused at rank 0, before any rank writes."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres.comm import CommunicatorError, InProcessWorld

from test_all_reduce import bits, contract

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (pip install hypothesis)")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BF16 = torch.bfloat16
POISON = -12345.0  # bf16-exact; no reduction of the drawn inputs produces it
EPS = (1e-5, 1e-6)
K = 2

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

OPS = ("all_reduce", "fused_add", "fused_add2", "moe")
ALIASES = {  # op -> the aliasings it can be called with (applied on every rank)
    "all_reduce": ("reduced=partial",),
    "fused_add": ("updated=partial", "reduced=layer_residual", "snapshot=partial", "output=bank", "reduced=bank"),
    "fused_add2": ("updated=partial", "reduced=routed", "snapshot=partial", "mixture=partial"),
    "moe": ("reduced=rows", "output=rows", "reduced=output"),
}


@st.composite
def cases(draw):
    op = draw(st.sampled_from(OPS))
    W = draw(st.integers(1, 8))
    capacity = draw(st.integers(1, 5))
    T = draw(st.integers(1, capacity + 1))  # capacity + 1: refused
    D = draw(st.sampled_from((8, 16, 64, 136)))
    fault = draw(st.sampled_from(("none", "none", "T", "dtype", "closed", "alias")) if W > 1 else
                 st.sampled_from(("none", "none", "closed", "alias")))
    if fault == "closed":
        T = min(T, capacity)  # one fault at a time: the closed rank is refused at its own turn
    alias = draw(st.sampled_from(ALIASES[op])) if fault == "alias" else None
    odd = draw(st.integers(0, W - 1))  # the rank that differs (fault T, dtype or closed)
    use_out = draw(st.booleans())
    snapshot = draw(st.booleans()) and op.startswith("fused")
    seed = draw(st.integers(0, 2**16))
    return dict(op=op, W=W, capacity=capacity, T=T, D=D, fault=fault, alias=alias, odd=odd, use_out=use_out,
                snapshot=snapshot or alias == "snapshot=partial", seed=seed)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g).to(BF16)


def _rank_inputs(c: dict, r: int) -> dict:
    """Rank r's tensors (partials differ per rank; the attention and MoE inputs are shared weights)."""
    g = torch.Generator().manual_seed(c["seed"] * 16 + r)
    T = c["T"] + (1 if c["fault"] == "T" and r == c["odd"] else 0)
    D = c["D"]
    x = {"partial": _rand(g, T, D)}
    if c["fault"] == "dtype" and r == c["odd"]:
        x["partial"] = x["partial"].to(torch.float16)
    g = torch.Generator().manual_seed(c["seed"])
    x["lr"], x["routed"] = _rand(g, c["T"], D), _rand(g, c["T"], D)
    x["bank"] = _rand(g, K + 1, c["T"], D)
    x["w"] = (1 + 0.1 * torch.randn(D, generator=g)).to(BF16)
    x["rows"] = _rand(g, 6, D)
    x["weights"] = torch.rand(c["T"], 2, generator=g)
    x["index"] = torch.randint(-1, 6, (c["T"], 2), generator=g, dtype=torch.int32)
    return x


def _outputs(c: dict, x: dict) -> tuple | None:
    """The out= tuple for rank inputs x: poisoned tensors, or the aliased ones."""
    T, D, a = c["T"], c["D"], c["alias"]
    n = {"all_reduce": 1, "moe": 2}.get(c["op"], 4)
    if not c["use_out"] and a in (None, "snapshot=partial"):
        return None
    outs = [torch.full((T, D), POISON, dtype=BF16) for _ in range(n)]
    names = {"all_reduce": ("reduced",), "moe": ("reduced", "output")}.get(c["op"],
                                                                          ("reduced", "updated", "output", "mixture"))
    if a not in (None, "snapshot=partial"):
        target, source = a.split("=")
        sources = {"partial": x["partial"], "layer_residual": x["lr"], "bank": x["bank"][0], "routed": x["routed"],
                   "rows": x["rows"][:T]}
        outs[names.index(target)] = outs[names.index(source)] if source in names else sources[source]
    return tuple(outs)


def _call(c: dict, comm, x: dict):
    op, out = c["op"], _outputs(c, x)
    if op == "all_reduce":
        return (attnres.all_reduce(comm, x["partial"], out=out),)
    if op == "moe":
        return attnres.moe_finalize_all_reduce(comm, x["rows"], x["weights"], x["index"], x["w"], eps=EPS[0], out=out)
    bank = x["bank"] if c["snapshot"] else x["bank"][:K]
    partial = x["bank"][K] if c["alias"] == "snapshot=partial" else x["partial"]
    kwargs = dict(site="add2", layer_residual_add=x["routed"]) if op == "fused_add2" else {}
    return attnres.all_reduce_attn_res_add_rmsnorm(comm, partial, x["lr"], bank[:K], x["w"], x["w"], x["w"], *EPS,
                                                   return_mixture=True, snapshot_slot=K if c["snapshot"] else None,
                                                   out=out, **kwargs)


def _expected(c: dict, xs: list[dict]) -> tuple:
    x = xs[0]
    if c["op"] == "moe":
        partial = attnres.moe_finalize(x["rows"], x["weights"], x["index"], eps=0.0)
        reduced = contract([partial] * c["W"])
        T = reduced.shape[0]
        normed = attnres.moe_finalize(reduced, torch.ones(T, 1), torch.arange(T, dtype=torch.int32).view(T, 1),
                                      norm_weight=x["w"], eps=EPS[0])
        return reduced, normed
    reduced = contract([y["partial"] for y in xs])
    if c["op"] == "all_reduce":
        return (reduced,)
    bank = x["bank"].clone()
    addends = (reduced, None) if c["op"] == "fused_add" else (x["routed"], reduced)
    rest = attnres.attn_res_add_rmsnorm(x["lr"], addends[0], bank[:K], x["w"], x["w"],
                                        x["w"], *EPS, layer_residual_add2=addends[1], return_mixture=True,
                                        snapshot_slot=K if c["snapshot"] else None)
    return (reduced, *rest) + ((bank[K],) if c["snapshot"] else ())


def _fingerprint(world, xs) -> list:
    return [bits(t).clone() for x in xs for t in x.values() if t.dtype in (BF16, torch.float16)] + \
        [cm.state.clone() for cm in world.comms if not cm.closed]


@FUZZ
@given(cases())
def test_every_call_matches_the_contract_or_raises_and_writes_nothing(c):
    event(f'{c["op"]} {c["fault"]}{" above capacity" if c["T"] > c["capacity"] else ""}')
    world = InProcessWorld(c["W"], c["capacity"], c["D"])
    try:
        xs = [_rank_inputs(c, r) for r in range(c["W"])]
        if c["fault"] == "closed":
            world.comms[c["odd"]].close()
        before = _fingerprint(world, xs)
        # the CPU world stages what each rank passes (the snapshot alias passes the bank's row K)
        staged = [x["bank"][K] if c["alias"] == "snapshot=partial" else x["partial"] for x in xs]
        if c["op"] == "moe":
            # the CPU world stages every rank's partial: the MoE tail's is the finalize without its norm
            staged = [attnres.moe_finalize(x["rows"], x["weights"], x["index"], eps=0.0) for x in xs]
            if c["fault"] == "T":
                staged[c["odd"]] = torch.zeros(c["T"] + 1, c["D"], dtype=BF16)
        # the MoE tail computes its partial itself: the odd rank's fp16 partial is not an argument
        ignored = c["op"] == "moe" and c["fault"] == "dtype"
        faulty = (c["fault"] != "none" and not ignored) or c["T"] > c["capacity"]
        if faulty:
            expected_error = CommunicatorError if c["fault"] == "closed" else attnres.AttnResError
            with pytest.raises(expected_error):
                world.run(lambda cm, x: _call(c, cm, x), xs, gathered=staged)
            if c["fault"] != "closed":  # a closed rank is refused at its own turn; the ranks before it ran
                assert all(torch.equal(a, b) for a, b in zip(before, _fingerprint(world, xs))), c
            else:
                # what the closed rank owns is untouched
                odd = _fingerprint(world, xs[c["odd"]:c["odd"] + 1])
                ref = [bits(t) for t in xs[c["odd"]].values() if t.dtype in (BF16, torch.float16)]
                assert all(torch.equal(a, b) for a, b in zip(ref, odd))
            return
        results = world.run(lambda cm, x: _call(c, cm, x), xs, gathered=staged)
        expected = _expected(c, xs)
        for r, got in enumerate(results):
            if c["snapshot"]:
                got = (*got, xs[r]["bank"][K])  # the snapshot row each rank wrote
            assert len(got) == len(expected)
            for i, (a, b) in enumerate(zip(got, expected)):
                assert torch.equal(bits(a), bits(b)), (c, r, i)
    finally:
        world.close()
