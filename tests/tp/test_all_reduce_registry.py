"""The all-reduce ops' raw entry points (issue 34): the communicator travels as a registry handle, never an
address; a rank's own gathered partial is its input; the fused site refuses outputs aliasing the partial; out=;
torch.compile(fullgraph=True). CPU in CI; the CUDA cases are marked gpu (the H200 session)."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _C
from attnres.comm import InProcessWorld

from conftest import DEVICES, requires_cuda
from test_all_reduce import bits, contract, partials_for

BF16 = torch.bfloat16
T, D, K = 3, 64, 2
OPS = torch.ops.attnres


def _site_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(T, D, generator=g).to(BF16).to(device)
    bank = torch.randn(K + 1, T, D, generator=g).to(BF16).to(device)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(BF16).to(device)
    return lr, bank, w


def _raw_site_args(p, gathered, state, handle, lr, bank, w, slot=-1):
    return (p, gathered, state, handle, "add", lr, None, bank, K, slot, w, w, w, 1e-5, 1e-6)


def _moe_pieces(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(6, D, generator=g).to(BF16).to(device)
    weights = torch.rand(T, 2, generator=g).to(device)
    index = torch.randint(0, 6, (T, 2), generator=g, dtype=torch.int32).to(device)
    return rows, weights, index


def _raw_calls(c, device, state=None, handle=None):
    """name -> a zero-argument raw call of each op on comm c (W = 1), with `state` / `handle` substituted."""
    state = c.state if state is None else state
    handle = c.handle if handle is None else handle
    p = partials_for(1, T, D, seed=3)[0].to(device)
    gathered = p[None] if device == "cpu" else None
    lr, bank, w = _site_inputs(device)
    rows, weights, index = _moe_pieces(device)
    moe_gathered = attnres.moe_finalize(rows, weights, index, eps=0.0)[None] if device == "cpu" else None
    return {
        "all_reduce": lambda: OPS.all_reduce(p, gathered, state, handle),
        "all_reduce_attn_res_add_rmsnorm": lambda: OPS.all_reduce_attn_res_add_rmsnorm(
            *_raw_site_args(p, gathered, state, handle, lr, bank, w)),
        "moe_finalize_all_reduce": lambda: OPS.moe_finalize_all_reduce(rows, weights, index, w, moe_gathered, state,
                                                                       handle, 1e-5, 1.0),
    }


NAMES = ("all_reduce", "all_reduce_attn_res_add_rmsnorm", "moe_finalize_all_reduce")


# ------------------------------------------------------------------------------- no forged address
def _devices_w1():
    # CUDA kernels exist for W = 2, 4, 8 only, but every case here is refused before the plan.
    return DEVICES


@pytest.mark.parametrize("device", _devices_w1())
@pytest.mark.parametrize("name", NAMES)
def test_made_up_and_closed_handles_are_refused(device, name):
    world = InProcessWorld(1, 4, D, device=device)
    c = world.comms[0]
    state = c.state
    with pytest.raises(attnres.ArgumentError, match=rf"^{name}: comm handle 123456789 names no open communicator "
                                                    r"of this process \(never created, or closed\)$"):
        _raw_calls(c, device, handle=123456789)[name]()
    calls = _raw_calls(c, device)
    handle = c.handle
    world.close()
    with pytest.raises(attnres.ArgumentError, match=rf"comm handle {handle} names no open communicator"):
        calls[name]()
    assert int(state[0]) == 0  # nothing ran


@pytest.mark.parametrize("device", _devices_w1())
@pytest.mark.parametrize("name", NAMES)
def test_wrong_state_tensors_are_refused(device, name):
    world = InProcessWorld(1, 4, D, device=device)
    c = world.comms[0]
    cases = {
        # the one-element state that let the kernel write 12 words out of bounds
        "one element": (torch.zeros(1, dtype=torch.int32, device=device), "state must be the communicator's int32 "
                                                                          r"\[12\] state tensor"),
        "int64": (torch.zeros(12, dtype=torch.int64, device=device), "state must be int32, got int64"),
        "strided": (torch.zeros(24, dtype=torch.int32, device=device)[::2], "stride 1"),
        "2-D": (torch.zeros(3, 4, dtype=torch.int32, device=device), "got shape \\[3, 4\\]"),
    }
    if device == "cuda":
        cases["another tensor"] = (c.state.clone(), "state is not the state tensor of the communicator")
        cases["cpu"] = (torch.zeros(12, dtype=torch.int32), "state is on cpu but the communicator is on cuda")
    for label, (state, msg) in cases.items():
        with pytest.raises(attnres.ArgumentError, match=msg):
            _raw_calls(c, device, state=state)[name]()
        assert not state.any(), label
    assert int(c.state[0]) == 0
    world.close()


def test_state_of_a_cpu_communicator_on_another_device_is_refused():
    world = InProcessWorld(1, 4, D)
    meta = torch.zeros(12, dtype=torch.int32, device="meta")
    with pytest.raises(attnres.ArgumentError, match="all tensors must be on one device"):
        _raw_calls(world.comms[0], "cpu", state=meta)["all_reduce"]()
    world.close()


def test_a_collected_communicator_is_unregistered():
    world = InProcessWorld(1, 4, D)
    handle, state = world.comms[0].handle, world.comms[0].state
    del world
    import gc

    gc.collect()
    with pytest.raises(attnres.ArgumentError, match="names no open communicator"):
        _C.all_reduce_registered("all_reduce", handle, attnres._tensors.ref(state, "all_reduce", "state"))


def test_registration_refuses_a_bad_record():
    world = InProcessWorld(1, 4, D)
    comm = world.comms[0]
    state_ref = attnres._tensors.ref(comm.state, "t", "state")
    c = _C.CommRef()
    c.world_size, c.rank, c.capacity, c.width, c.timeout_ns = 1, 0, 4, D, 10**9
    c.state = state_ref.data
    with pytest.raises(attnres.ArgumentError, match="region_bytes must be 0 on the CPU"):
        _C.all_reduce_register(c, state_ref, 64)
    c.buffers = [0x1000]
    with pytest.raises(attnres.ArgumentError, match="comm.buffers must be empty on the CPU"):
        _C.all_reduce_register(c, state_ref, 0)
    c.buffers = []
    c.state = state_ref.data + 16
    with pytest.raises(attnres.ArgumentError, match="state is not at comm.state"):
        _C.all_reduce_register(c, state_ref, 0)
    world.close()


@requires_cuda
@pytest.mark.gpu
def test_unregistered_cuda_commref_never_reaches_a_kernel():
    """A CommRef built by hand (forged buffers) is refused by the library itself, whatever the entry point."""
    world = InProcessWorld(2, 4, D, device="cuda")
    c = world.comms[0]
    forged = _C.all_reduce_registered("t", c.handle, attnres._tensors.ref(c.state, "t", "state"))
    forged.buffers = [c.region(0).data_ptr(), 0x7F0000000000]
    args = _C.AllReduceArgs()
    args.comm = forged
    p = torch.zeros(T, D, dtype=BF16, device="cuda")
    out = torch.zeros_like(p)
    args.input, args.output = (attnres._tensors.ref(t, "t", "x") for t in (p, out))
    with pytest.raises(attnres.ArgumentError, match="comm is not a registered communicator"):
        _C.all_reduce(args, _C.AllReduceOptions())
    world.close()


# ------------------------------------------------------------------------- defect 4: the partial is the input
def test_all_reduce_refuses_a_gathered_that_ignores_the_input():
    """torch.ops.attnres.all_reduce(input=7.0, gathered=[1, 1]) returned 2.0."""
    world = InProcessWorld(2, 4, D)
    c = world.comms[0]
    seven = torch.full((T, D), 7.0, dtype=BF16)
    ones = torch.ones(2, T, D, dtype=BF16)
    with pytest.raises(attnres.ArgumentError, match=r"^all_reduce: gathered \[rank = 0\] differs from input at "
                                                    r"\[0, 0\]: a rank's own entry of the gathered partials must be "
                                                    r"the input it passes$"):
        OPS.all_reduce(seven, ones, c.state, c.handle)
    ones[0] = 7.0
    assert torch.equal(OPS.all_reduce(seven, ones, c.state, c.handle), torch.full((T, D), 8.0, dtype=BF16))
    # rank 1's own entry is row 1
    with pytest.raises(attnres.ArgumentError, match=r"gathered \[rank = 1\] differs from input"):
        OPS.all_reduce(seven, ones, world.comms[1].state, world.comms[1].handle)
    # the fused op and the MoE tail follow the same rule
    lr, bank, w = _site_inputs("cpu")
    reduced = torch.full((T, D), -1.0, dtype=BF16)
    # (the fused op's all-reduce half reports in all_reduce's words: its partial is the all-reduce's input)
    with pytest.raises(attnres.ArgumentError, match=r"^all_reduce: gathered \[rank = 1\] differs from input"):
        OPS.all_reduce_attn_res_add_rmsnorm.out(
            *_raw_site_args(seven, ones, world.comms[1].state, world.comms[1].handle, lr, bank, w), reduced=reduced,
            updated=torch.empty_like(lr), output=torch.empty_like(lr))
    assert bool((reduced == -1).all())
    rows, weights, index = _moe_pieces("cpu")
    with pytest.raises(attnres.ArgumentError, match=r"gathered \[rank = 0\] differs from this rank's local-route "
                                                    r"partial"):
        OPS.moe_finalize_all_reduce(rows, weights, index, w, ones, c.state, c.handle, 1e-5, 1.0)
    world.close()


# -------------------------------------------------------------- defect 6: the snapshot row and the partial
@pytest.mark.parametrize("device", DEVICES)
def test_fused_site_refuses_a_snapshot_row_on_its_partial(device):
    W = 2 if device == "cuda" else 1
    world = InProcessWorld(W, 4, D, device=device)
    lr, bank, w = _site_inputs(device)
    partial = bank[K].clone()
    bank_before = bank.clone()

    def call(c, _):
        # the partial is the bank's row K, where the snapshot is written
        p = bank[K]
        gathered = p[None] if device == "cpu" else None
        return OPS.all_reduce_attn_res_add_rmsnorm(*_raw_site_args(p, gathered, c.state, c.handle, lr, bank, w,
                                                                   slot=K))

    with pytest.raises(attnres.ArgumentError, match="^all_reduce_attn_res_add_rmsnorm: snapshot row overlaps "
                                                    r"partial \(the all-reduce reads it; outputs must not alias "
                                                    r"inputs\)$"):
        call(world.comms[0], None)
    assert torch.equal(bits(bank), bits(bank_before)) and torch.equal(bits(bank[K]), bits(partial))
    # the public function through out=: updated on the partial is refused the same way
    with pytest.raises(attnres.ArgumentError, match="updated overlaps partial"):
        world.run(lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(c, p, lr, bank[:K], w, w, w, 1e-5, 1e-6,
                                                                       out=(None, p, None)),
                  [bank[K].clone() for _ in range(W)] if device == "cpu" else [bank[K]] * W)
    assert all(int(c.state[0]) == 0 for c in world.comms)
    world.close()


# ------------------------------------------------------------------------------------------------- out=
def test_out_matches_the_allocating_call():
    W = 2
    world = InProcessWorld(W, 4, D)
    parts = partials_for(W, T, D, seed=5)
    lr, bank, w = _site_inputs("cpu")
    ref = world.run(lambda c, p: attnres.all_reduce(c, p), parts)
    outs = [torch.full((T, D), 3.0, dtype=BF16) for _ in range(W)]
    got = world.run(lambda c, p: attnres.all_reduce(c, p, out=(outs[c.rank],)), parts)
    assert all(g is o and torch.equal(bits(g), bits(r)) for g, o, r in zip(got, outs, ref))
    assert torch.equal(bits(ref[0]), bits(contract(parts)))

    def site(out):
        return world.run(lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(
            c, p, lr, bank[:K], w, w, w, 1e-5, 1e-6, return_mixture=True, out=out(c.rank)), parts)

    ref = site(lambda r: None)
    given = [torch.empty(T, D, dtype=BF16) for _ in range(W)]
    got = site(lambda r: (None, None, given[r], None))
    for r in range(W):
        assert got[r][2] is given[r]
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got[r], ref[r]))
    with pytest.raises(attnres.ArgumentError, match=r"out must be a tuple of 4 tensors or None \(reduced, updated, "
                                                    r"output, mixture\), got tuple of 3"):
        site(lambda r: (None, None, None))
    with pytest.raises(attnres.ArgumentError, match=r"^all_reduce: out must be a tuple of 1 tensors or None "
                                                    r"\(reduced\), got int$"):
        world.run(lambda c, p: attnres.all_reduce(c, p, out=5), parts)
    with pytest.raises(attnres.ArgumentError, match="all_reduce: output must be bfloat16, got float32"):
        site(lambda r: (torch.empty(T, D), None, None, None))
    with pytest.raises(attnres.ArgumentError, match="reduced overlaps layer_residual"):
        site(lambda r: (lr, None, None, None))

    rows, weights, index = _moe_pieces("cpu")
    pieces = [(rows, weights, index)] * W
    staged = [attnres.moe_finalize(rows, weights, index, eps=0.0)] * W  # every rank's local-route partial
    ref = world.run(lambda c, x: attnres.moe_finalize_all_reduce(c, *x, w, eps=1e-5), pieces, gathered=staged)
    normed = [torch.empty(T, D, dtype=BF16) for _ in range(W)]
    got = world.run(lambda c, x: attnres.moe_finalize_all_reduce(c, *x, w, eps=1e-5, out=(None, normed[c.rank])),
                    pieces, gathered=staged)
    assert all(g[1] is n and torch.equal(bits(g[1]), bits(r_[1])) for g, n, r_ in zip(got, normed, ref))
    with pytest.raises(attnres.ArgumentError, match="output overlaps gathered|reduced overlaps"):
        world.run(lambda c, x: attnres.moe_finalize_all_reduce(c, *x, w, eps=1e-5, out=(rows[:T], None)), pieces,
                  gathered=staged)
    world.close()


def test_out_overloads_have_the_out_convention():
    for name in NAMES:
        schema = getattr(OPS, name).out._schema
        assert schema.returns == [], name
        assert all(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
                   for a in schema.arguments if a.name in ("reduced", "updated", "output", "mixture")), name
    w = InProcessWorld(1, 4, D)
    c = w.comms[0]
    p = partials_for(1, T, D, seed=2)[0]
    torch.library.opcheck(OPS.all_reduce.out, (p, p[None], c.state, c.handle), {"reduced": torch.empty(T, D,
                                                                                                       dtype=BF16)})
    w.close()


# ------------------------------------------------------------------------ defect 9: fullgraph compile
def test_fused_wrapper_compiles_with_fullgraph():
    world = InProcessWorld(1, 4, D)
    lr, bank, w = _site_inputs("cpu")
    p = partials_for(1, T, D, seed=7)[0]

    def fused(c, partial):
        return attnres.all_reduce_attn_res_add_rmsnorm(c, partial, lr, bank[:K], w, w, w, 1e-5, 1e-6,
                                                       snapshot_slot=K)

    def plain(c, partial):
        return attnres.all_reduce(c, partial)

    for fn in (fused, plain):
        eager = world.run(fn, [p])[0]
        compiled = world.run(torch.compile(fn, fullgraph=True, backend="eager"), [p])[0]
        eager, compiled = (x if isinstance(x, tuple) else (x,) for x in (eager, compiled))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(eager, compiled)), fn.__name__
    world.close()


def test_timeouts_outside_the_registry_range_are_refused_at_creation():
    """The record holds the bound in int64 ns (>= 1): a bound outside it is refused when the communicator is
    made, not by every later call."""
    # (either the registration's words or an earlier check of Communicator's own arguments)
    with pytest.raises(attnres.ArgumentError, match=r"timeout_s .*must be"):
        InProcessWorld(1, 4, D, timeout_s=1e-12)
    with pytest.raises(attnres.ArgumentError, match=r"timeout_s .*must be"):
        InProcessWorld(1, 4, D, timeout_s=1e10)


@pytest.mark.parametrize("return_mixture", [False, True])
def test_fused_out_mixture_must_match_return_mixture(return_mixture):
    """The .out overload's mixture is given exactly when return_mixture asks for it; otherwise the call is refused
    before anything is exchanged or written."""
    world = InProcessWorld(1, 4, D, device="cpu")
    c = world.comms[0]
    lr, bank, w = _site_inputs("cpu")
    p = torch.ones(T, D, dtype=BF16)
    outs = {"reduced": torch.full((T, D), -1.0, dtype=BF16), "updated": torch.full_like(lr, -1.0),
            "output": torch.full_like(lr, -1.0)}
    if not return_mixture:
        outs["mixture"] = torch.full_like(lr, -1.0)  # given without return_mixture
    message = "all_reduce_attn_res_add_rmsnorm: mixture is produced exactly when return_mixture is True"
    with pytest.raises(attnres.ArgumentError, match=f"^{message}$"):
        OPS.all_reduce_attn_res_add_rmsnorm.out(*_raw_site_args(p, p[None], c.state, c.handle, lr, bank, w),
                                                return_mixture, **outs)
    assert all(bool((t == -1).all()) for t in outs.values())
    assert int(c.state[0]) == 0
    world.close()
