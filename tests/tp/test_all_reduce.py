"""The one-shot all-reduce and its fused ops (docs/ops/all_reduce.md) against the CPU reference of the contract:
per element the fp32 sum of the W bf16 partials in rank order, each -0.0 read as +0.0, rounded once to bf16.

CPU cases (CI): the in-process world and two gloo ranks. CUDA cases (the `gpu` marker): the in-process world
on one GPU (each rank on its own stream), W processes on one GPU exchanging CUDA IPC handles over gloo, CUDA
graph replay over thousands of generations, PDL chains, and a rank that never arrives."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attnres
from attnres import _C
from attnres.all_reduce import record_all_reduce_decisions, supports_moe_finalize_all_reduce  # noqa: F401
from attnres.comm import Communicator, CommunicatorError, InProcessWorld

from conftest import DEVICES, HAS_CUDA, requires_cuda
from helpers import make_inputs

BF16 = torch.bfloat16
gpu = [requires_cuda, pytest.mark.gpu]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int16)


def contract(partials: list[torch.Tensor]) -> torch.Tensor:
    """The reference: fp32 adds in rank order, -0.0 as +0.0, one rounding."""
    acc = None
    for p in partials:
        f = p.detach().cpu().float()
        f = torch.where(f == 0, torch.zeros_like(f), f)
        acc = f if acc is None else acc + f
    return acc.to(BF16)


def partials_for(W: int, T: int, D: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(W):
        p = (torch.randn(T, D, generator=g) * torch.exp(torch.randn(T, 1, generator=g))).to(BF16)
        p.view(-1)[:: 17] = -0.0  # real -0.0 inputs
        p.view(-1)[5:: 101] = 3e-39  # subnormal (bf16 keeps it)
        out.append(p)
    return out


def world_sizes(device: str):
    return (2, 4, 8) if device == "cuda" else (2, 3, 4, 8)


# ------------------------------------------------------------------------------------------ the contract
@pytest.mark.parametrize("device", DEVICES)
def test_contract_bitwise_every_rank_identical(device):
    for W in world_sizes(device):
        for T in (1, 5):
            world = InProcessWorld(W, 8, 256, device=device)
            parts = [p.to(device) for p in partials_for(W, T, 256, seed=W * 10 + T)]
            outs = world.all_reduce(parts)
            want = bits(contract(parts))
            for r, o in enumerate(outs):
                assert torch.equal(bits(o), want), f"W={W} T={T} rank {r}"
            world.check()
            world.close()


@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_equal_torch_bf16_add(device):
    world = InProcessWorld(2, 4, 7168, device=device)
    p0, p1 = (p.to(device) for p in partials_for(2, 3, 7168, seed=7))
    p0.view(-1)[::17] = 0.0  # torch: -0.0 + -0.0 = -0.0; the contract reads -0.0 as +0.0 (docs/ops/all_reduce.md)
    outs = world.all_reduce([p0, p1])
    want = bits(p0 + p1)
    for o in outs:
        assert torch.equal(bits(o), want)
    world.close()


@pytest.mark.parametrize("device", DEVICES)
def test_generations_rotate_with_varying_tokens(device):
    """Slots are reused every third call, with T changing between calls (the clear covers the previous T)."""
    world = InProcessWorld(2, 8, 64, device=device)
    for i, T in enumerate((8, 1, 3, 8, 2, 1, 7, 8, 1)):
        parts = [p.to(device) for p in partials_for(2, T, 64, seed=100 + i)]
        outs = world.all_reduce(parts)
        for o in outs:
            assert torch.equal(bits(o), bits(contract(parts))), f"call {i} T={T}"
    if device == "cuda":
        assert [c.generation() for c in world.comms] == [9, 9]
    world.close()


# ------------------------------------------------------------------------------------------- rejections
def _state_snapshot(world):
    return [c.state.clone() for c in world.comms]


@pytest.mark.parametrize("device", DEVICES)
def test_rejections_write_nothing(device):
    world = InProcessWorld(2, 4, 64, device=device)
    before = _state_snapshot(world)
    good = [p.to(device) for p in partials_for(2, 2, 64, seed=1)]
    cases = {
        "above the communicator's capacity": [torch.zeros(5, 64, dtype=BF16, device=device)] * 2,
        "the communicator's width is 64": [torch.zeros(2, 32, dtype=BF16, device=device)] * 2,
        "must be bfloat16": [p.float() for p in good],
        "must be a 2-D": [p.view(1, 2, 64) for p in good],
    }
    for msg, parts in cases.items():
        with pytest.raises(ValueError, match=msg):
            world.all_reduce(parts)
    c = world.comms[0]
    gathered = torch.stack(good).cpu() if device == "cpu" else None
    # The raw op takes the communicator's registry handle, never its world, rank or addresses
    # (tests/tp/test_all_reduce_registry.py: made-up and closed handles, foreign state tensors).
    with pytest.raises(ValueError, match="names no open communicator"):
        torch.ops.attnres.all_reduce(good[0], gathered, c.state, 10**9)
    if device == "cpu":
        with pytest.raises(ValueError, match="holds 3 partials but the world has 2"):
            torch.ops.attnres.all_reduce(good[0], torch.stack(good * 2)[:3], c.state, c.handle)
    for b, a in zip(before, _state_snapshot(world)):
        assert torch.equal(b, a)  # no generation advanced: nothing ran
    if device == "cuda":
        assert all(bool((c.region().view(torch.int16) == -32768).all()) for c in world.comms)
    world.close()
    with pytest.raises(CommunicatorError, match="closed"):
        world.all_reduce(good)
    with pytest.raises(CommunicatorError, match="closed"):
        world.comms[0].check()


def test_cpu_ranks_with_different_tokens_rejected():
    """The in-process CPU world: rank 1 called with another T raises, naming both ranks and both T; nothing ran."""
    world = InProcessWorld(2, 4, 64)
    before = _state_snapshot(world)
    parts = partials_for(2, 3, 64, seed=2)
    with pytest.raises(ValueError, match=r"rank 1 was called with T = 2 but rank 0 with T = 3"):
        world.all_reduce([parts[0], parts[1][:2]])
    pieces, norm_w = _moe_pieces(2, 2, 4, 64, "cpu", seed=3)
    rows, weights, index = pieces[1]
    pieces[1] = (rows, weights[:1], index[:1])  # rank 1 really calls with T = 1: the world reduces what it passes
    with pytest.raises(ValueError, match=r"rank 1 was called with T = 1 but rank 0 with T = 2"):
        world.run(lambda c, piece: attnres.moe_finalize_all_reduce(c, *piece, norm_w, eps=1e-5), pieces)
    for b, a in zip(before, _state_snapshot(world)):
        assert torch.equal(b, a)
    world.close()


def test_communicator_arguments_rejected():
    for kwargs, msg in (({"world_size": 9}, "world_size"), ({"capacity": 0}, "capacity"), ({"width": 12}, "width"),
                        ({"timeout_s": 0.0}, "timeout_s")):
        args = {"world_size": 2, "capacity": 4, "width": 64, "timeout_s": 1.0} | kwargs
        with pytest.raises(ValueError, match=msg):
            InProcessWorld(args["world_size"], args["capacity"], args["width"], timeout_s=args["timeout_s"])


def test_cpu_rank_alone_cannot_reduce():
    world = InProcessWorld(2, 4, 64)
    with pytest.raises(CommunicatorError, match="InProcessWorld.run"):
        attnres.all_reduce(world.comms[0], torch.zeros(1, 64, dtype=BF16))


@requires_cuda
@pytest.mark.gpu
def test_world_without_kernel_is_declined_on_cuda():
    world = InProcessWorld(3, 4, 64, device="cuda")
    with pytest.raises(attnres.UnsupportedError, match="world size 3 has no CUDA kernel instance"):
        world.all_reduce([torch.zeros(1, 64, dtype=BF16, device="cuda")] * 3)
    assert all(c.generation() == 0 for c in world.comms)
    world.close()


# ---------------------------------------------------------------------------- fused attn_res_add_rmsnorm
def _site_inputs(T, H, N, device, seed):
    x = make_inputs(T, N, H, addends=1, seed=seed, device=device)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("site", ["add", "add2"])
@pytest.mark.parametrize("extras", ["plain", "tap_snapshot"])
def test_fused_site_equals_all_reduce_then_plain_op(device, site, extras):
    W, T, H, N = 2, 2, 256, 5
    x = _site_inputs(T, H, N, device, seed=3)
    parts = [p.to(device) for p in partials_for(W, T, H, seed=11)]
    reduced_ref = contract(parts).to(device)
    tap = extras == "tap_snapshot"
    slot = x.spare_slot if tap else None
    routed = x.add if site == "add2" else None
    kwargs = dict(return_mixture=tap)
    plain_bank = x.block_residual.clone() if slot is None else None
    if slot is not None:
        bank_buf = x.bank_buffer.clone()
        plain_block = bank_buf[: x.K] if x.layout != "token_major" else bank_buf.transpose(0, 1)[: x.K]
    else:
        plain_block = plain_bank
    plain = attnres.attn_res_add_rmsnorm(
        x.layer_residual, routed if site == "add2" else reduced_ref, plain_block, x.res_weight, x.rms_weight,
        x.norm_weight, x.rms_eps, x.norm_eps, layer_residual_add2=reduced_ref if site == "add2" else None,
        snapshot_slot=slot, **kwargs)
    world = InProcessWorld(W, 4, H, device=device)
    banks = [x.bank_buffer.clone() for _ in range(W)]

    def block_of(buf):
        return buf[: x.K] if x.layout != "token_major" else buf.transpose(0, 1)[: x.K]

    def call(c, p):
        return attnres.all_reduce_attn_res_add_rmsnorm(
            c, p, x.layer_residual, block_of(banks[c.rank]), x.res_weight, x.rms_weight, x.norm_weight,
            x.rms_eps, x.norm_eps, site=site, layer_residual_add=routed, snapshot_slot=slot, **kwargs)

    results = world.run(call, parts)
    for r, res in enumerate(results):
        assert torch.equal(bits(res[0]), bits(reduced_ref)), f"rank {r} reduced"
        for a, b in zip(res[1:], plain):
            assert torch.equal(bits(a), bits(b)), f"rank {r}"
        if slot is not None:
            assert torch.equal(bits(banks[r]), bits(bank_buf)), f"rank {r} snapshot write"
    world.close()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_site_rejects_before_writing(device):
    x = _site_inputs(1, 256, 3, device, seed=4)
    world = InProcessWorld(2, 4, 256, device=device)
    parts = [p.to(device) for p in partials_for(2, 1, 256, seed=5)]
    bad_weight = x.rms_weight[:128]
    with pytest.raises(ValueError, match="rms_weight"):
        world.run(lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(
            c, p, x.layer_residual, x.block_residual, x.res_weight, bad_weight, x.norm_weight, x.rms_eps,
            x.norm_eps), parts)
    with pytest.raises(ValueError, match="site add2 requires layer_residual_add"):
        world.run(lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(
            c, p, x.layer_residual, x.block_residual, x.res_weight, x.rms_weight, x.norm_weight, x.rms_eps,
            x.norm_eps, site="add2"), parts)
    assert all(int(c.state[0]) == 0 for c in world.comms)
    world.close()


# ------------------------------------------------------------------------ moe finalize + all-reduce + norm
def _moe_pieces(W, T, k, D, device, seed):
    """Per rank (rows, weights, index): each route local on exactly one rank (-1 elsewhere), NaN padding."""
    g = torch.Generator().manual_seed(seed)
    E = 4 * W
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    out = []
    for r in range(W):
        owned = range(r * 4, r * 4 + 4)
        index = torch.full((T, k), -1, dtype=torch.int32)
        local = [(t, j) for t in range(T) for j in range(k) if int(ids[t, j]) in owned]
        rows = torch.full((len(local) + 8, D), float("nan"), dtype=BF16)
        for n, (t, j) in enumerate(local):
            index[t, j] = n
            rows[n] = torch.randn(D, generator=g).to(BF16)
        out.append((rows.to(device), weights.to(device), index.to(device)))
    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).to(BF16).to(device)
    return out, norm_w


@pytest.mark.parametrize("device", DEVICES)
def test_moe_finalize_all_reduce_contract(device):
    for W in (2, 4):
        T, k, D = 3, 8, 512
        pieces, norm_w = _moe_pieces(W, T, k, D, device, seed=W)
        partials = [attnres.moe_finalize(r, w, i, eps=0.0, scale=2.827) for r, w, i in pieces]
        reduced_ref = contract(partials).to(device)
        T_ = reduced_ref.shape[0]
        normed_ref = attnres.moe_finalize(reduced_ref, torch.ones(T_, 1, device=device),
                                          torch.arange(T_, dtype=torch.int32, device=device).view(T_, 1),
                                          norm_weight=norm_w, eps=1e-5)
        world = InProcessWorld(W, 4, D, device=device)
        results = world.run(lambda c, piece: attnres.moe_finalize_all_reduce(c, *piece, norm_w, eps=1e-5,
                                                                             scale=2.827),
                            pieces, gathered=partials)
        for r, (reduced, normed) in enumerate(results):
            assert torch.equal(bits(reduced), bits(reduced_ref)), f"W={W} rank {r} reduced"
            assert torch.equal(bits(normed), bits(normed_ref)), f"W={W} rank {r} normed"
        world.close()


@pytest.mark.parametrize("device", DEVICES)
def test_moe_finalize_all_reduce_rejections(device):
    W, T, k, D = 2, 2, 4, 64
    pieces, norm_w = _moe_pieces(W, T, k, D, device, seed=9)
    rows, weights, index = pieces[0]
    world = InProcessWorld(W, 4, D, device=device)

    def call(r, w, i, nw=norm_w):  # every rank makes the same bad call (the world reduces what ranks pass)
        world.run(lambda cc, _: attnres.moe_finalize_all_reduce(cc, r, w, i, nw, eps=1e-5), [None] * W)

    padded = torch.zeros(T, k + 3, device=device)[:, :k]
    padded.copy_(weights)
    cases = [
        ((rows, weights, index.view(-1)), "flat map"),
        ((rows, weights[:, :2], index), "must have the shape of index"),
        ((rows, padded, index), "must be dense"),
        ((torch.zeros(8, D + 4, dtype=BF16, device=device)[:, :D], weights, index), "row stride"),
        ((rows, weights, index, norm_w[:32]), "norm_weight"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call(*args)
    with pytest.raises(ValueError, match="communicator's width"):
        wide = InProcessWorld(W, 4, 2 * D, device=device)
        wide.run(lambda cc, _: attnres.moe_finalize_all_reduce(cc, rows, weights, index, norm_w, eps=1e-5),
                 [None] * W)
    assert all(int(cc.state[0]) == 0 for cc in world.comms)
    world.close()


@requires_cuda
@pytest.mark.gpu
def test_moe_finalize_all_reduce_cuda_only_rejections():
    pieces, norm_w = _moe_pieces(2, 2, 4, 64, "cuda", seed=9)
    rows, weights, index = pieces[0]
    world = InProcessWorld(2, 4, 64, device="cuda")
    with pytest.raises(ValueError, match="is on cpu"):
        attnres.moe_finalize_all_reduce(world.comms[0], rows, weights.cpu(), index, norm_w, eps=1e-5)
    with pytest.raises(ValueError, match="16-byte aligned"):
        buf = torch.zeros(rows.numel() + 8, dtype=BF16, device="cuda")[1:1 + rows.numel()].view(rows.shape)
        attnres.moe_finalize_all_reduce(world.comms[0], buf, weights, index, norm_w, eps=1e-5)
    three = InProcessWorld(3, 4, 64, device="cuda")
    with pytest.raises(attnres.UnsupportedError, match="world size 3"):
        attnres.moe_finalize_all_reduce(three.comms[0], rows, weights, index, norm_w, eps=1e-5)
    assert int(world.comms[0].state[0]) == 0 and int(three.comms[0].state[0]) == 0
    world.close()
    three.close()


def test_moe_support_predicate():
    assert supports_moe_finalize_all_reduce(1, 16, 3584, 2) == (True, "")
    ok, why = supports_moe_finalize_all_reduce(1, 16, 3584, 3)
    assert not ok and "world size 3" in why
    ok, why = supports_moe_finalize_all_reduce(17, 16, 3584, 2)
    assert not ok and "token gate" in why
    ok, why = supports_moe_finalize_all_reduce(1, 16, 3584, 2, max_tokens=0)
    assert not ok and "disabled" in why
    ok, why = supports_moe_finalize_all_reduce(1, 16, 3584, 2, (torch.float16, torch.float32))
    assert not ok and "rows are" in why
    with pytest.raises(ValueError, match="world_size"):
        supports_moe_finalize_all_reduce(1, 16, 3584, 0)


# ------------------------------------------------------------------------------- two gloo ranks on the CPU
def _gloo_rank():
    from tp_check.launch import init, shutdown

    ctx = init("cpu")
    comm = Communicator.create(4, 128)
    parts = partials_for(2, 3, 128, seed=21)
    reduced = attnres.all_reduce(comm, parts[ctx.rank])
    pieces, norm_w = _moe_pieces(2, 2, 4, 128, "cpu", seed=22)
    latent, normed = attnres.moe_finalize_all_reduce(comm, *pieces[ctx.rank], norm_w, eps=1e-5, scale=2.0)
    # Rank 1 called with another T: every rank raises (the T are gathered before the partials).
    try:
        attnres.all_reduce(comm, parts[ctx.rank][: 3 - ctx.rank])
        mismatch = "NOT RAISED"
    except ValueError as e:
        mismatch = str(e)
    comm.close()
    shutdown()
    return bits(reduced), bits(latent), bits(normed), mismatch


def test_two_gloo_ranks():
    from tp_check.launch import launch

    results = launch(_gloo_rank, 2)
    parts = partials_for(2, 3, 128, seed=21)
    assert torch.equal(results[0][0], bits(contract(parts)))
    pieces, norm_w = _moe_pieces(2, 2, 4, 128, "cpu", seed=22)
    partials = [attnres.moe_finalize(r, w, i, eps=0.0, scale=2.0) for r, w, i in pieces]
    assert torch.equal(results[0][1], bits(contract(partials)))
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[:3], results[0][:3]))
    for r in results:
        assert "rank 1 was called with T = 2 but rank 0 with T = 3" in r[3], r[3]


# ------------------------------------------------------------------------------------------ CUDA only
@requires_cuda
@pytest.mark.gpu
def test_graph_replay_thousands_of_generations():
    W, T, D = 2, 2, 7168
    world = InProcessWorld(W, 4, D, device="cuda")
    parts = [torch.empty(T, D, dtype=BF16, device="cuda") for _ in range(W)]
    for p, q in zip(parts, partials_for(W, T, D, seed=0)):
        p.copy_(q)
    world.all_reduce(parts)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = world.all_reduce(parts)
    for step in range(3000):
        if step % 500 == 0 or step < 4:
            for p, q in zip(parts, partials_for(W, T, D, seed=step + 1)):
                p.copy_(q)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        if step % 250 == 0 or step < 4:
            torch.cuda.synchronize()
            want = bits(contract(parts))
            for o in outs:
                assert torch.equal(bits(o), want), f"replay {step}"
    torch.cuda.synchronize()
    world.check()
    assert [c.generation() for c in world.comms] == [3001, 3001]
    world.close()


@requires_cuda
@pytest.mark.gpu
def test_pdl_chain_with_plain_ops():
    """plain op -> fused site (PDL) -> plain op on every rank's stream: the fused op neither reads its addend
    early nor lets the next op read its outputs early."""
    W, T, H, N = 2, 2, 7168, 9
    x = make_inputs(T, N, H, addends=1, seed=8, device="cuda")
    world = InProcessWorld(W, 4, H, device="cuda")
    parts = [p.cuda() for p in partials_for(W, T, H, seed=12)]

    def chain(c, p):
        # The partial comes out of a plain op (a producer kernel just before the all-reduce).
        upd, out = attnres.attn_res_add_rmsnorm(x.layer_residual, p, x.block_residual, x.res_weight, x.rms_weight,
                                                x.norm_weight, x.rms_eps, x.norm_eps)
        red, upd2, out2 = attnres.all_reduce_attn_res_add_rmsnorm(
            c, out, upd, x.block_residual, x.res_weight, x.rms_weight, x.norm_weight, x.rms_eps, x.norm_eps)
        return red, attnres.attn_res_add_rmsnorm(upd2, out2, x.block_residual, x.res_weight, x.rms_weight,
                                                 x.norm_weight, x.rms_eps, x.norm_eps)

    got = world.run(chain, parts)
    torch.cuda.synchronize()
    outs1 = [attnres.attn_res_add_rmsnorm(x.layer_residual, p, x.block_residual, x.res_weight, x.rms_weight,
                                          x.norm_weight, x.rms_eps, x.norm_eps) for p in parts]
    red = contract([o[1] for o in outs1]).cuda()
    # The reduced sum is the same on every rank; each rank's prefix (its first op's `updated`) is its own.
    for r, (red_r, fin_r) in enumerate(got):
        assert torch.equal(bits(red_r), bits(red)), f"rank {r}: reduced sum"
        upd2, out2 = attnres.attn_res_add_rmsnorm(outs1[r][0], red, x.block_residual, x.res_weight, x.rms_weight,
                                                  x.norm_weight, x.rms_eps, x.norm_eps)
        final = attnres.attn_res_add_rmsnorm(upd2, out2, x.block_residual, x.res_weight, x.rms_weight,
                                             x.norm_weight, x.rms_eps, x.norm_eps)
        for i, (a, b) in enumerate(zip(fin_r, final)):
            assert torch.equal(bits(a), bits(b)), f"rank {r}: final op output #{i}"
    world.close()


_FAULT_SCRIPT = textwrap.dedent("""
    import torch, attnres
    from attnres.comm import InProcessWorld, CommunicatorError
    world = InProcessWorld(2, 4, 256, device="cuda", timeout_s=0.2)
    out = torch.full((1, 256), 7.0, dtype=torch.bfloat16, device="cuda")
    got = attnres.all_reduce(world.comms[0], torch.ones(1, 256, dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    try:
        world.comms[0].check()
        print("NO ERROR")
    except CommunicatorError as e:
        print("RAISED", e)
    # A broken communicator exits at once: no second hang, nothing written.
    sentinel = torch.full((1, 256), 5.0, dtype=torch.bfloat16, device="cuda")
    again = attnres.all_reduce(world.comms[0], sentinel)
    torch.cuda.synchronize()
    print("GEN", world.comms[0].generation())
""")


@requires_cuda
@pytest.mark.gpu
def test_rank_that_never_arrives_raises_not_hangs():
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", _FAULT_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "RAISED" in proc.stdout and "timed out" in proc.stdout and "waiting for rank 1" in proc.stdout, proc.stdout


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [(2, 1), (1, 2), (3, 1)])
@pytest.mark.parametrize("op", ["all_reduce", "moe_finalize_all_reduce"])
def test_ranks_called_with_different_tokens_raise_and_write_nothing(tokens, op):
    """Rank 1 called with another T than rank 0 (fewer rows, more rows): the header of the exchange catches it on
    both ranks at once, every rank's check() names both ranks and both T (a rank that had waited out its bounded
    wait would report the timeout instead), the call takes well under the 30 s bound (generous: under
    compute-sanitizer the first launches of each kernel take seconds), and no output is written (the outputs
    reuse poisoned blocks of the allocator)."""
    import time

    W, D, k, bound = 2, 512, 4, 30.0
    world = InProcessWorld(W, 4, D, device="cuda", timeout_s=bound)
    world.all_reduce([p.cuda() for p in partials_for(W, 2, D, seed=30)])  # one good call first: slots rotate
    torch.cuda.synchronize()
    reused = []

    def call(c, piece):
        T = tokens[c.rank]
        poison = torch.full((T, D), float("nan"), dtype=BF16, device="cuda")  # on this rank's stream
        ptr = poison.data_ptr()
        del poison
        if op == "all_reduce":
            out = attnres.all_reduce(c, piece[:T])
            reused.append((out.data_ptr() == ptr, out))
        else:
            rows, weights, index = piece
            out = attnres.moe_finalize_all_reduce(c, rows, weights[:T], index[:T], norm_w, eps=1e-5)
            reused.append((out[1].data_ptr() == ptr, out[1]))  # the normed output is allocated first
        return out

    if op == "all_reduce":
        inputs = [p.cuda() for p in partials_for(W, max(tokens), D, seed=31)]
    else:
        inputs, norm_w = _moe_pieces(W, max(tokens), k, D, "cuda", seed=32)
    t0 = time.perf_counter()
    world.run(call, inputs)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    for r, c in enumerate(world.comms):
        other = 1 - r
        with pytest.raises(CommunicatorError, match=rf"rank {r} was called with T = {tokens[r]} but rank {other} "
                                                    rf"with T = {tokens[other]}.*nothing was written"):
            c.check()
    assert elapsed < bound / 2, f"the mismatch took {elapsed:.1f} s: it ran into the bounded wait"
    for same_block, out in reused:
        assert same_block, "the output did not reuse the poisoned block: the check below would mean nothing"
        assert bool(out.isnan().all()), "a mismatched call wrote output"
    # The communicator is broken for good: a later call returns at once, writing nothing.
    gen = [c.generation() for c in world.comms]
    world.all_reduce([p.cuda() for p in partials_for(W, 1, D, seed=33)])
    torch.cuda.synchronize()
    assert [c.generation() for c in world.comms] == gen
    world.close()


def _ipc_rank(W, T, D):
    import torch.distributed as dist

    from tp_check.launch import shutdown

    os.environ.setdefault("LOCAL_WORLD_SIZE", str(W))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.cuda.set_device(0)  # every process on one GPU: IPC-mapped peers, time-sliced contexts
    comm = Communicator.create(4, D, device="cuda:0", timeout_s=60.0)
    results = []
    for step in range(3):
        parts = partials_for(W, T, D, seed=50 + step)
        results.append(bits(attnres.all_reduce(comm, parts[rank].cuda())))
        torch.cuda.synchronize()
    comm.check()
    comm.close()
    shutdown()
    return results


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 4])
def test_processes_on_one_gpu_exchange_ipc_handles(W):
    from tp_check.launch import launch

    T, D = 2, 7168
    results = launch(_ipc_rank, W, W, T, D)
    for step in range(3):
        want = bits(contract(partials_for(W, T, D, seed=50 + step)))
        for r in range(W):
            assert torch.equal(results[r][step], want), f"rank {r} step {step}"
