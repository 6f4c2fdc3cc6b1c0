"""The communicators' contract in one process (issue 34, defects 4, 7, 8, 10): the in-process world reduces what
each rank passed and refuses concurrent use, every rank of a disagreeing call raises the same error, waits are
bounded, construction arguments are checked with attnres errors, the MoE gates agree, and the in-process CUDA
world refuses the calls whose ranks cannot all be resident."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import attnres
from attnres import _C
from attnres.all_reduce import supports_moe_finalize_all_reduce
from attnres.moe_gate import supports_fused_moe_finalize
from attnres.comm import Communicator, CommunicatorError, InProcessWorld
from attnres.comm import arguments
from attnres.comm.residency import check_resident, max_tokens

from conftest import HAS_CUDA, requires_cuda

BF16 = torch.bfloat16


def rows(T: int, D: int, value: float) -> torch.Tensor:
    return torch.full((T, D), value, dtype=BF16)


# ------------------------------------------------------------------------------------------ what is reduced
def test_world_reduces_what_each_rank_passed():
    """The op's partial is not the run's input (here: doubled, and rank 1 adds 1): the sum is of the partials."""
    world = InProcessWorld(2, 4, 16)
    out = world.run(lambda c, p: attnres.all_reduce(c, p * 2 + c.rank), [rows(2, 16, 1.0), rows(2, 16, 3.0)])
    for o in out:
        assert torch.equal(o, rows(2, 16, 2.0 + 7.0))


def test_world_checks_gathered_against_what_ranks_pass():
    world = InProcessWorld(2, 4, 16)
    parts = [rows(1, 16, 1.0), rows(1, 16, 2.0)]
    assert torch.equal(world.run(lambda c, p: attnres.all_reduce(c, p), parts, gathered=parts)[0], rows(1, 16, 3.0))
    with pytest.raises(attnres.ArgumentError, match=r"rank 1's partial differs from gathered\[1\]"):
        world.run(lambda c, p: attnres.all_reduce(c, p), parts, gathered=[parts[0], rows(1, 16, 7.0)])
    with pytest.raises(attnres.ArgumentError, match="one partial per rank"):
        world.run(lambda c, p: attnres.all_reduce(c, p), parts, gathered=parts[:1])


@pytest.mark.parametrize("second, text", [
    (rows(3, 8, 1.0), "rank 1's partial is a bfloat16 tensor of shape [3, 8] on cpu but rank 0's"),
    (torch.ones(3, 16, dtype=torch.float16), "rank 1's partial is a float16 tensor"),
    (rows(2, 16, 1.0), "rank 1 was called with T = 2 but rank 0 with T = 3"),
    ("x", "rank 1's partial is a str, not a tensor on cpu"),
])
def test_world_ranks_that_disagree_all_raise_the_same_error(second, text):
    world = InProcessWorld(2, 4, 16)
    errors = []

    def call(c, p):
        try:
            return attnres.all_reduce(c, p)
        except attnres.ArgumentError as e:
            errors.append(str(e))
            raise

    with pytest.raises(attnres.ArgumentError) as info:
        world.run(call, [rows(3, 16, 1.0), second])
    assert text in str(info.value)
    assert len(errors) == 2 and errors[0] == errors[1]
    assert all(int(c.state[0]) == 0 for c in world.comms)


def test_world_rank_that_never_calls_times_out():
    world = InProcessWorld(2, 4, 16, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(CommunicatorError, match=r"rank 0 timed out after 0.3 s waiting for rank\(s\) \[1\]"):
        world.run(lambda c, p: attnres.all_reduce(c, p) if c.rank == 0 else None, [rows(1, 16, 1.0)] * 2)
    assert time.monotonic() - t0 < 3.0
    # The world is usable again: the failed call's exchange is gone with it.
    assert torch.equal(world.all_reduce([rows(1, 16, 1.0)] * 2)[1], rows(1, 16, 2.0))


def test_world_rank_that_fails_first_is_the_error_raised():
    world = InProcessWorld(3, 4, 16, timeout_s=30.0)

    def call(c, p):
        if c.rank == 1:
            raise KeyError("rank 1's own failure")
        return attnres.all_reduce(c, p)

    t0 = time.monotonic()
    with pytest.raises(KeyError, match="rank 1's own failure"):
        world.run(call, [rows(1, 16, 1.0)] * 3)
    assert time.monotonic() - t0 < 5.0  # the others stopped waiting at once, not after 30 s


def test_world_refuses_concurrent_and_nested_calls():
    world = InProcessWorld(2, 4, 16)
    inside, release = threading.Event(), threading.Event()
    results = {}

    def slow(c, p):
        inside.set()
        release.wait(10)
        return attnres.all_reduce(c, p)

    def first():
        results["first"] = world.run(slow, [rows(1, 16, 1.0)] * 2)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    try:
        with pytest.raises(CommunicatorError, match="another call is running on this world"):
            world.all_reduce([rows(1, 16, 5.0)] * 2)
    finally:
        release.set()
        t.join(10)
    assert torch.equal(results["first"][0], rows(1, 16, 2.0))  # the first call was not disturbed
    with pytest.raises(CommunicatorError, match="another call is running"):
        world.run(lambda c, p: world.all_reduce([p, p]), [rows(1, 16, 1.0)] * 2)


def test_world_rank_called_from_another_ranks_thread_is_refused():
    world = InProcessWorld(2, 4, 16, timeout_s=0.5)
    with pytest.raises(CommunicatorError, match="rank 1 of an in-process CPU world must be called through"):
        world.run(lambda c, p: attnres.all_reduce(world.comms[1], p), [rows(1, 16, 1.0)] * 2)


# ------------------------------------------------------------------------------------------ arguments
BAD = [
    ({"timeout_s": 1e-12}, attnres.ArgumentError, "timeout_s = 1e-12 is 0 ns"),
    ({"timeout_s": 1e10}, attnres.ArgumentError, r"it must be in \[1 ns, 9223372036854775807 ns\]"),
    ({"timeout_s": float("nan")}, attnres.ArgumentError, "finite and > 0"),
    ({"timeout_s": True}, attnres.ArgumentError, "timeout_s must be a number"),
    ({"timeout_s": "1"}, attnres.ArgumentError, "timeout_s must be a number"),
    ({"device": "meta"}, attnres.ArgumentError, "device meta is not supported"),
    ({"device": "foo"}, attnres.ArgumentError, "device 'foo' is not a device torch knows"),
    ({"device": 1.5}, attnres.ArgumentError, "device must be"),
    ({"width": -16}, attnres.ArgumentError, "width must be a multiple of 8"),
    ({"width": True}, attnres.ArgumentError, "width must be a multiple of 8"),
    ({"width": 2 ** 64}, attnres.ArgumentError, "width must be a multiple of 8"),
    ({"capacity": True}, attnres.ArgumentError, "capacity"),
    ({"capacity": 0}, attnres.ArgumentError, "capacity"),
    ({"capacity": 2 ** 32}, attnres.ArgumentError, r"capacity \(tokens per call\) must be an int in \[1, 4294967295\]"),
    ({"capacity": 2.0}, attnres.ArgumentError, "capacity"),
    ({"world_size": True}, attnres.ArgumentError, "world_size"),
    ({"world_size": 2 ** 32 + 2}, attnres.ArgumentError, "world_size"),
]
if not HAS_CUDA:
    BAD.append(({"device": "cuda"}, attnres.UnsupportedError, "device cuda"))
    BAD.append(({"device": "cuda:5"}, attnres.UnsupportedError, "device cuda:5"))


@pytest.mark.parametrize("bad, error, text", BAD, ids=[repr(b) for b, _, _ in BAD])
def test_construction_arguments_rejected(bad, error, text):
    args = {"world_size": 2, "capacity": 4, "width": 16, "timeout_s": 1.0, "device": "cpu"} | bad
    with pytest.raises(error, match=text):
        InProcessWorld(args["world_size"], args["capacity"], args["width"], timeout_s=args["timeout_s"],
                       device=args["device"])
    with pytest.raises(error, match=text):
        Communicator(rank=0, world_size=args["world_size"], capacity=args["capacity"], width=args["width"],
                     device=args["device"], regions=None, state=torch.zeros(12, dtype=torch.int32),
                     timeout_s=args["timeout_s"])


def test_timeout_bound_is_the_librarys_int64():
    c = _C.CommRef()
    c.timeout_ns = arguments.TIMEOUT_NS_MAX
    with pytest.raises(TypeError):
        c.timeout_ns = arguments.TIMEOUT_NS_MAX + 1
    # The longest accepted timeout passes every later layer: the op takes its ns.
    world = InProcessWorld(2, 4, 16, timeout_s=9.2e9)
    assert world.comms[0].op_args()[4] == int(9.2e9 * 1e9)
    assert torch.equal(world.all_reduce([rows(1, 16, 1.0)] * 2)[0], rows(1, 16, 2.0))
    assert InProcessWorld(2, 4, 16, timeout_s=1e-9).comms[0].op_args()[4] == 1


def test_communicator_rank_is_checked():
    for rank in (-1, 2, True):
        with pytest.raises(attnres.ArgumentError, match="rank"):
            Communicator(rank=rank, world_size=2, capacity=4, width=16, device="cpu", regions=None,
                         state=torch.zeros(12, dtype=torch.int32), timeout_s=1.0)


# ------------------------------------------------------------------------------------------ the gates
H200 = {"cc_major": 9, "cc_minor": 0, "sm_count": 132, "shared_memory_per_block_optin": 232448}
GATES = [lambda **kw: supports_moe_finalize_all_reduce(1, 16, 3584, 2, **kw),
         lambda **kw: supports_fused_moe_finalize(1, 16, 3584, **kw)]


@pytest.mark.parametrize("gate", GATES, ids=["finalize_all_reduce", "fused_finalize"])
def test_gates_agree_on_devices(gate):
    assert gate(device="h200", max_tokens=16) == (True, "")
    assert gate(device=H200, max_tokens=16) == (True, "")
    ok, why = gate(device=H200 | {"sm_count": 0}, max_tokens=16)
    assert not ok and "sm_count = 0" in why
    ok, why = gate(device=H200 | {"sm_count": 2 ** 31}, max_tokens=16)
    assert not ok and "sm_count must be in" in why
    ok, why = gate(device=H200 | {"cc_major": 8}, max_tokens=16)
    assert not ok and "compute capability 8.0" in why
    ok, why = gate(device="meta", max_tokens=16)
    assert not ok and "device meta is not supported" in why
    if not HAS_CUDA:
        assert not gate(device="cuda:5", max_tokens=16)[0]


@pytest.mark.parametrize("gate", GATES, ids=["finalize_all_reduce", "fused_finalize"])
@pytest.mark.parametrize("kwargs, text", [
    ({"max_tokens": float("nan")}, "max_tokens must be None or an int >= 0"),
    ({"max_tokens": float("inf")}, "max_tokens must be None or an int >= 0"),
    ({"max_tokens": -1}, "max_tokens must be None or an int >= 0"),
    ({"max_tokens": True}, "max_tokens must be None or an int >= 0"),
    ({"dtypes": (torch.bfloat16,)}, "dtypes must be a pair of torch dtypes"),
    ({"dtypes": "bf16"}, "dtypes must be a pair of torch dtypes"),
])
def test_gates_refuse_malformed_queries(gate, kwargs, text):
    with pytest.raises(attnres.ArgumentError, match=text):
        gate(**kwargs)


def test_finalize_all_reduce_gate_takes_the_finalize_plans_limits():
    ok, why = supports_moe_finalize_all_reduce(2 ** 40, 16, 3584, 2, max_tokens=2 ** 41)
    assert not ok and "outside [1, 16384]" in why
    assert supports_moe_finalize_all_reduce(1, 16, 3584, 2 ** 32 + 2, max_tokens=16)[1].startswith(
        "world size 4294967298 has no fused kernel")
    ok, why = supports_fused_moe_finalize(1, 16, 3584, device=H200 | {"sm_count": 2 ** 31}, world_size=1,
                                          max_tokens=16)
    assert not ok


# ------------------------------------------------------------------------------------------ residency on one GPU
def test_in_process_residency_limit():
    fused, moe = "all_reduce_attn_res_add_rmsnorm", "moe_finalize_all_reduce"
    assert max_tokens(fused, 2, 7168, "h200") == 33 and max_tokens(fused, 4, 7168, "h200") == 16
    assert max_tokens("all_reduce", 4, 7168, "h200") == 33
    # moe_finalize_all_reduce: one block of its plan's 448 threads per token and its PDL successor's; its registers
    # (up to 128 per thread) leave room for one such block per SM.
    assert [max_tokens(moe, w, 7168, "h200") for w in (2, 4, 8)] == [33, 16, 8]
    assert max_tokens(moe, 8, 512, "h200") == 132 * 8 // (8 * 2)  # 64-thread blocks: 8 per SM by registers
    check_resident(fused, 2, 32, 7168, "h200")  # measured to progress on the H200 (869 threads per SM)
    check_resident("all_reduce", 4, 32, 7168, "h200")
    check_resident(moe, 2, 32, 3584, "h200")  # bench/allreduce.py's largest MoE point, measured to progress
    with pytest.raises(attnres.UnsupportedError, match=r"4 ranks on one GPU \(132 SMs\) takes at most T = 16 at "
                                                       r"width 7168.*got T = 18"):
        check_resident(fused, 4, 18, 7168, "h200")  # stalled once on an H100 shared with other test processes
    with pytest.raises(attnres.UnsupportedError, match=r"moe_finalize_all_reduce: an InProcessWorld of 2 ranks .* "
                                                       r"takes at most T = 33 .*2 block\(s\) of 448 threads per "
                                                       r"token, at most 1 per SM"):
        check_resident(moe, 2, 64, 3584, "h200")  # stalled on the H200 (bench/allreduce.py MAX_TOKENS_ONE_GPU)
    with pytest.raises(attnres.UnsupportedError, match=r"8 ranks .* takes at most T = 8 "):
        check_resident(moe, 8, 33, 7168, "h200")  # stalled on the H100
    check_resident("moe_finalize", 8, 10 ** 6, 7168, "h200")  # no exchange: not limited


@requires_cuda
@pytest.mark.gpu
def test_in_process_cuda_world_refuses_what_cannot_be_resident():
    """W = 4, T = 32 fused site on one H200: it timed out after 10 s; now refused at once, nothing launched, and
    the largest T the message names runs."""
    from helpers import make_inputs

    W, T, H, N = 4, 32, 7168, 9
    fused = "all_reduce_attn_res_add_rmsnorm"
    limit = max_tokens(fused, W, H, "cuda")
    assert 1 <= limit < T
    world = InProcessWorld(W, T, H, device="cuda", timeout_s=10.0)
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(T, H, generator=g).to(BF16).cuda() for _ in range(W)]

    def call(x):
        return lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(
            c, p[: x.layer_residual.shape[0]], x.layer_residual, x.block_residual, x.res_weight, x.rms_weight,
            x.norm_weight, x.rms_eps, x.norm_eps)

    t0 = time.monotonic()
    with pytest.raises(attnres.UnsupportedError, match=f"takes at most T = {limit} at width {H}"):
        world.run(call(make_inputs(T, N, H, addends=1, seed=1, device="cuda")), parts)
    assert time.monotonic() - t0 < 5.0
    assert all(c.generation() == 0 for c in world.comms)  # nothing launched
    out = world.run(call(make_inputs(limit, N, H, addends=1, seed=2, device="cuda")), parts)
    torch.cuda.synchronize()
    world.check()
    assert all(torch.equal(o[0], out[0][0]) for o in out)
    world.close()


@requires_cuda
@pytest.mark.gpu
def test_in_process_cuda_world_refuses_moe_finalize_that_cannot_be_resident():
    """moe_finalize_all_reduce (one block per token) at W = 8: one token past the limit is refused at once, nothing
    launched; the limit itself completes within the bounded wait, every rank holding the same reduced bits."""
    W, k, D = 8, 8, 7168
    limit = max_tokens("moe_finalize_all_reduce", W, D, "cuda")
    assert limit >= 1
    g = torch.Generator().manual_seed(4)

    def pieces(T):  # rank r owns route r of every token
        weights = torch.softmax(torch.randn(T, k, generator=g), -1).cuda()
        out = []
        for r in range(W):
            index = torch.full((T, k), -1, dtype=torch.int32)
            index[:, r] = torch.arange(T, dtype=torch.int32)
            out.append((torch.randn(T, D, generator=g).to(BF16).cuda(), weights, index.cuda()))
        return out

    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).to(BF16).cuda()
    world = InProcessWorld(W, limit + 1, D, device="cuda", timeout_s=10.0)

    def call(c, piece):
        return attnres.moe_finalize_all_reduce(c, *piece, norm_w, eps=1e-5)

    t0 = time.monotonic()
    with pytest.raises(attnres.UnsupportedError, match=f"takes at most T = {limit} at width {D}"):
        world.run(call, pieces(limit + 1))
    assert time.monotonic() - t0 < 5.0
    assert all(c.generation() == 0 for c in world.comms)  # nothing launched
    t0 = time.monotonic()
    out = world.run(call, pieces(limit))
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 8.0, "the ranks at the limit ran into the bounded wait"
    world.check()
    assert all(torch.equal(o[0], out[0][0]) and torch.equal(o[1], out[0][1]) for o in out)
    world.close()


@requires_cuda
@pytest.mark.gpu
def test_region_that_cannot_be_allocated_is_an_argument_error():
    with pytest.raises(attnres.ArgumentError, match="cannot allocate"):
        InProcessWorld(8, arguments.MAX_CAPACITY, arguments.MAX_WIDTH, device="cuda")
