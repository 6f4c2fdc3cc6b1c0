"""The FP8, snapshot-writing and persistent-topology calls of the family ops and the all-reduce ops keep the
base ops' entry-point guarantees
(tests/ops/test_entry_points.py): the first call in a fresh interpreter does not import torch._dynamo, a meta
tensor among CPU tensors raises ArgumentError instead of reaching the fake implementation, a fake call with
a wrong rank raises the real op's ArgumentError, and torch.library.opcheck passes. CPU calls of the
all-reduce ops use a one-rank world (gathered = the rank's own partial)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnres
from attnres.comm import InProcessWorld
from cli_checks import assert_first_call_cheap

BF16 = torch.bfloat16
T, H, K = 4, 128, 2
_WORLDS = {}  # device -> a W = 1 world (capacity 8, width H), kept open: the raw ops take its registry handle


def _comm(device):
    if device not in _WORLDS:
        _WORLDS[device] = InProcessWorld(1, 8, H, device=device)
    return _WORLDS[device].comms[0]


def _tensors(device="cpu"):
    g = torch.Generator().manual_seed(11)
    lr = torch.randn(T, H, generator=g).to(BF16).to(device)
    add = torch.randn(T, H, generator=g).to(BF16).to(device)
    bank = torch.randn(K + 1, T, H, generator=g).to(BF16).to(device)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(BF16).to(device)
    rows = torch.randn(6, H, generator=g).to(BF16).to(device)
    weights = torch.rand(T, 2, generator=g).to(device)
    index = torch.randint(0, 6, (T, 2), generator=g, dtype=torch.int32).to(device)
    return dict(lr=lr, add=add, bank=bank, w=w, rows=rows, weights=weights, index=index,
                state=_comm(torch.device(device).type).state)


def _calls(t, bank=None):
    """case -> (op, args) for the variants of the family ops (the FP8 outputs, the snapshot ops, the persistent
    topology: arguments of torch.ops.attnres.<family>[_snapshot]) and every op of all_reduce.py; `bank` replaces
    the bank (and block residual) where given."""
    lr, add, w, st = t["lr"], t["add"], t["w"], t["state"]
    W1 = _comm("cpu" if lr.device.type == "meta" else lr.device.type).handle
    full = t["bank"] if bank is None else bank
    block = t["bank"][:K] if bank is None else bank
    eps = (1e-5, 1e-6)
    # A rank's own entry of `gathered` is its partial (the CPU op checks it bit for bit).
    gathered = add[None] if add.device.type != "meta" else torch.empty((1, T, H), dtype=BF16, device="meta")
    moe_gathered = torch.zeros((1, T, H), dtype=BF16, device=gathered.device)
    if gathered.device.type != "meta" and t["rows"].dim() == 2:
        moe_gathered = attnres.moe_finalize(t["rows"], t["weights"], t["index"], eps=0.0)[None]
    ops = torch.ops.attnres
    return {
        "attn_res_snapshot": (ops.attn_res_snapshot, (lr, full, K, K, w, w, eps[0])),
        "attn_res_rmsnorm-block128": (ops.attn_res_rmsnorm, (lr, block, w, w, w, *eps, True, "block128")),
        "attn_res_rmsnorm_snapshot": (ops.attn_res_rmsnorm_snapshot,
                                      (lr, full, K, K, w, w, w, *eps, False, "per_token")),
        "attn_res_add_rmsnorm-per_token": (ops.attn_res_add_rmsnorm,
                                           (lr, add, None, block, w, w, w, *eps, False, "per_token", True)),
        "attn_res_add_rmsnorm_snapshot-block128": (ops.attn_res_add_rmsnorm_snapshot,
                                                   (lr, add, add, full, K, K, w, w, w, *eps, True, "block128")),
        # the former attn_res_add_rmsnorm_persistent_fp8: fp8 and the persistent topology as arguments
        "attn_res_add_rmsnorm-persistent-per_token": (ops.attn_res_add_rmsnorm,
                                                      (lr, add, None, block, w, w, w, *eps, False, "per_token",
                                                       False, "persistent")),
        "all_reduce": (ops.all_reduce, (add, gathered, st, W1)),
        "all_reduce_attn_res_add_rmsnorm": (ops.all_reduce_attn_res_add_rmsnorm,
                                            (add, gathered, st, W1, "add", lr, None, full, K, K, w, w, w,
                                             *eps, True)),
        "moe_finalize_all_reduce": (ops.moe_finalize_all_reduce,
                                    (t["rows"], t["weights"], t["index"], w, moe_gathered, st, W1, 1e-5, 1.0)),
    }


NAMES = tuple(_calls(_tensors()))


def test_every_new_op_is_registered_through_the_library_registry():
    """torch.library.custom_op ops carry dynamo's disable wrapper; the Library registration does not: the
    op's CPU kernel is the Python function itself."""
    from attnres import _registry

    registered = {d.split("(")[0] for d in _registry._LIB._op_defs}
    used = {op._qualified_op_name for op, _ in _calls(_tensors()).values()}
    assert used <= registered
    # the family ops also register their .out overload through the same registry
    assert {f"{op}.out" for op in used if op.startswith("attnres::attn_res")} <= registered


@pytest.mark.parametrize("name", ["attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm", "attn_res_rmsnorm_snapshot",
                                  "attn_res_add_rmsnorm_snapshot", "attn_res_snapshot",
                                  "all_reduce_attn_res_add_rmsnorm"])
def test_attention_options_default_to_auto(name):
    packet = getattr(torch.ops.attnres, name)
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        topology = next(a for a in schema.arguments if a.name == "topology")
        assert topology.default_value == attnres.Options().topology == "auto", (name, overload)


def test_persistent_alias_with_fp8_runs_on_the_persistent_topology():
    """attnres.attn_res_add_rmsnorm_persistent (the former persistent FP8 op's entry point) is
    attn_res_add_rmsnorm with topology="persistent": through torch's dispatcher the op sees that topology and
    the FP8 mode, and the results are the family op's bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "attnres":
                names = [a.name for a in func._schema.arguments]
                seen.append((func.name(), {**dict(zip(names, args)), **kwargs}))
            return func(*args, **kwargs)

    t = _tensors()
    lr, add, w, block = t["lr"], t["add"], t["w"], t["bank"][:K]
    with Record():
        got = attnres.attn_res_add_rmsnorm_persistent(lr, block, w, w, w, 1e-5, 1e-6, layer_residual_add=add,
                                                      fp8="per_token")
    assert [name for name, _ in seen] == ["attnres::attn_res_add_rmsnorm"], seen
    assert seen[0][1]["topology"] == "persistent" and seen[0][1]["fp8"] == "per_token", seen
    want = torch.ops.attnres.attn_res_add_rmsnorm(lr, add, None, block, w, w, w, 1e-5, 1e-6, fp8="per_token",
                                                  topology="persistent")
    want = (want[0], want[1], want[3], want[4])
    assert len(got) == 4
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), i


@pytest.mark.parametrize("name", NAMES)
def test_one_meta_tensor_among_cpu_tensors_raises(name):
    t = _tensors()
    before = {k: v.clone() for k, v in t.items()}
    bank_meta = t["bank"].to("meta") if "snapshot" in name or "attn_res" in name else None
    if name in ("all_reduce", "moe_finalize_all_reduce"):
        t = dict(t, state=t["state"].to("meta"))
    op, args = _calls(t, bank_meta)[name]
    with pytest.raises(attnres.ArgumentError, match=r"is on (meta|cpu) but \w+ is on (cpu|meta) \(all tensors "
                                                    r"must be on one device\)$"):
        op(*args)
    for k, v in before.items():
        assert torch.equal(v, t[k] if t[k].device.type != "meta" else v), k


@pytest.mark.parametrize("name", NAMES)
def test_fake_call_with_a_wrong_rank_raises_the_real_ops_argument_error(name):
    t = _tensors()
    t3 = dict(t, lr=t["lr"][None], add=t["add"][None], rows=t["rows"][None])
    op, args = _calls(t3)[name]
    with pytest.raises(attnres.ArgumentError) as real:
        op(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(attnres.ArgumentError) as fake:
            op(*fake_args)
    assert str(fake.value) == str(real.value)
    assert "must be a 2-D" in str(real.value), str(real.value)


def test_fake_block128_with_h_not_a_multiple_of_128_raises():
    t = _tensors()
    op, args = _calls(t)["attn_res_rmsnorm-block128"]
    narrow = [a[..., :64].contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    with FakeTensorMode() as mode:
        with pytest.raises(attnres.ArgumentError, match=r"^attn_res_rmsnorm: fp8 = block128 needs the hidden size "
                                                        r"H to be a multiple of 128, got H = 64$"):
            op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in narrow])


@pytest.mark.parametrize("name", NAMES)
def test_fake_results_match_the_real_ones(name):
    op, args = _calls(_tensors())[name]
    real = op(*args)
    real = real if isinstance(real, tuple) else (real,)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(fake) == len(real)
    for i, (f, r) in enumerate(zip(fake, real)):
        assert (tuple(f.shape), f.stride(), f.dtype) == (tuple(r.shape), r.stride(), r.dtype), (name, i)


def test_all_meta_calls_infer_shapes():
    t = {k: v.to("meta") for k, v in _tensors().items()}
    q, s = torch.ops.attnres.attn_res_rmsnorm(t["lr"], t["bank"][:K], t["w"], t["w"], t["w"], 1e-5, 1e-6,
                                              False, "block128")[2:]
    assert q.device.type == "meta" and tuple(q.shape) == (T, H) and s.stride() == (1, 4)
    reduced = torch.ops.attnres.all_reduce(t["add"], t["lr"][None], t["state"], _comm("cpu").handle)
    assert reduced.device.type == "meta" and tuple(reduced.shape) == (T, H)


def test_fused_op_refuses_num_snapshots_past_the_bank():
    """A direct call with K above the bank's rows used to build a view past the bank."""
    t = _tensors()
    op, args = _calls(t)["all_reduce_attn_res_add_rmsnorm"]
    args = list(args)
    args[8], args[9] = 9, -1  # num_snapshots, snapshot_slot
    # the bank-rows rule is the family ops' (one C++ check, one wording)
    with pytest.raises(attnres.ArgumentError, match=r"^all_reduce_attn_res_add_rmsnorm: num_snapshots 9 exceeds the "
                                                    r"bank's 3 rows$"):
        op(*args)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name):
    op, args = _calls(_tensors())[name]
    torch.library.opcheck(op.default, args)


def test_mutating_ops_bump_the_version_counter():
    t = _tensors()
    for name in ("attn_res_snapshot", "all_reduce", "moe_finalize_all_reduce"):
        op, args = _calls(t)[name]
        watched = t["bank"] if name == "attn_res_snapshot" else t["state"]
        v = watched._version
        op(*args)
        assert watched._version > v, name


@pytest.mark.parametrize("call", [
    "attnres.attn_res_rmsnorm(lr, bank, w, w, w, 1e-5, 1e-5, fp8='per_token')",
    "torch.ops.attnres.all_reduce(lr, lr[None], c.state, c.handle)",
], ids=["fp8", "all_reduce"])
def test_first_call_after_import_does_not_import_dynamo(call):
    """As tests/ops/test_entry_points.py's first-call test: a fresh interpreter, the best of three processes."""
    code = textwrap.dedent(f"""
        import sys, time
        import torch, attnres
        lr = torch.randn(4, 64).bfloat16(); bank = torch.randn(2, 4, 64).bfloat16()
        w = torch.ones(64, dtype=torch.bfloat16)
        from attnres.comm import InProcessWorld; c = InProcessWorld(1, 8, 64).comms[0]
        t = time.perf_counter(); {call}; first = time.perf_counter() - t
        print(first, "torch._dynamo" in sys.modules)
    """)
    assert_first_call_cheap(code)
