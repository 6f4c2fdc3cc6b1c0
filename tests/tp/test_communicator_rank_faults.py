"""Gloo processes on the CPU (CI), two and three ranks: ranks that disagree on a call, a rank that never calls, a
rank that dies mid-call. Every launch is bounded (launch(timeout_s=...)), every rank's default group
has a 60 s timeout, and each communicator's own waits are bounded by its timeout_s: nothing here can hang."""

from __future__ import annotations

import os
import time

import torch

import attnres
from attnres.comm import Communicator, CommunicatorError
from tp_check.launch import launch

BF16 = torch.bfloat16
LAUNCH_S = 120  # the whole two-process run, start-up included (2 cores shared with other jobs)
TIMEOUT_S = 1.5  # the communicators' bound in the fault cases


def _outcome(fn) -> tuple:
    try:
        out = fn()
        return ("returned", out.float().tolist() if isinstance(out, torch.Tensor) else None)
    except Exception as e:  # noqa: BLE001  (compared across ranks in the test)
        return (type(e).__name__, str(e))


def _mismatch_cases(rank: int) -> dict:
    """Rank 1's side of each case differs from rank 0's in one thing."""
    ones = torch.ones(3, 16, dtype=BF16)
    other = {
        "narrower": torch.ones(3, 8, dtype=BF16),
        "wider": torch.ones(3, 24, dtype=BF16),
        "float16": torch.ones(3, 16, dtype=torch.float16),
        "fewer tokens": torch.ones(2, 16, dtype=BF16),
        "not a tensor": [1.0] * 16,
        "meta": torch.ones(3, 16, dtype=BF16, device="meta"),
        "3-D": torch.ones(1, 3, 16, dtype=BF16),
    }
    return {name: ones if rank == 0 else x for name, x in other.items()}


def _disagreeing_rank(timeout_s: float):
    from tp_check.launch import init, shutdown

    ctx = init("cpu", timeout_s=60)
    comm = Communicator.create(4, 16, timeout_s=timeout_s)
    out = {name: _outcome(lambda x=x: attnres.all_reduce(comm, x)) for name, x in _mismatch_cases(ctx.rank).items()}
    # Different ops: rank 1 reduces its MoE finalize partial where rank 0 reduces a plain partial.
    if ctx.rank == 0:
        out["other op"] = _outcome(lambda: attnres.all_reduce(comm, torch.ones(2, 16, dtype=BF16)))
    else:
        rows = torch.ones(4, 16, dtype=BF16)
        index = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        out["other op"] = _outcome(lambda: attnres.moe_finalize_all_reduce(
            comm, rows, torch.full((2, 2), 0.5), index, torch.ones(16, dtype=BF16), eps=1e-5))
    # Every mismatch left the communicator usable (every rank raised at the same point): a good call sums.
    out["good"] = _outcome(lambda: attnres.all_reduce(comm, torch.full((2, 16), float(ctx.rank + 1), dtype=BF16)))
    # A second thread's call while one is in flight is refused (its collectives would pair with the first's).
    import threading

    if ctx.rank == 0:
        first = {}
        t = threading.Thread(target=lambda: first.update(r=_outcome(
            lambda: attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16)))))
        t.start()
        time.sleep(0.3)  # the thread is waiting for rank 1, which sleeps
        out["second thread"] = _outcome(lambda: attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16)))
        t.join(30)
        out["first thread"] = first["r"]
    else:
        time.sleep(1.0)
        out["first thread"] = _outcome(lambda: attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16)))
    # On the CPU the communicator's own group is made by new_group, which every process calls: a group of some
    # ranks only is refused, on each of its ranks.
    import torch.distributed as dist

    part = dist.new_group([0])
    if ctx.rank == 0:
        out["part group"] = _outcome(lambda: Communicator.create(4, 16, group=part))
    # Rank 1 never calls: rank 0 raises CommunicatorError after timeout_s, and the communicator is unusable.
    if ctx.rank == 0:
        t0 = time.monotonic()
        out["never called"] = _outcome(lambda: attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16)))
        out["never called s"] = time.monotonic() - t0
        t0 = time.monotonic()
        out["after"] = _outcome(lambda: attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16)))
        out["after s"] = time.monotonic() - t0
        out["check"] = _outcome(comm.check)
    # Rank 1 stays alive, not calling, until rank 0 is done (closing would end the wait at once: a reset
    # connection); the default group is untouched by the communicator's failure, so its barrier passes.
    dist.barrier()
    comm.close()
    shutdown()
    return out


def test_disagreeing_ranks_raise_the_same_error_and_a_missing_rank_times_out():
    r0, r1 = launch(_disagreeing_rank, 2, TIMEOUT_S, timeout_s=LAUNCH_S)
    expected = {
        "narrower": "rank 1's partial is a bfloat16 tensor of shape [3, 8] on cpu but rank 0's is a bfloat16 "
                    "tensor of shape [3, 16] on cpu",
        "wider": "shape [3, 24]",
        "float16": "rank 1's partial is a float16 tensor",
        "fewer tokens": "rank 1 was called with T = 2 but rank 0 with T = 3",
        "not a tensor": "rank 1's partial is a list, not a tensor on cpu",
        "meta": "rank 1's partial is a bfloat16 tensor of shape [3, 16] on meta, not a tensor on cpu",
        "3-D": "rank 1's partial is a bfloat16 tensor of shape [1, 3, 16]",
        "other op": "rank 1 called moe_finalize_all_reduce but rank 0 called all_reduce",
    }
    for name, text in expected.items():
        assert r0[name] == r1[name], f"{name}: the ranks raised differently: {r0[name]} / {r1[name]}"
        kind, message = r0[name]
        assert kind == "ArgumentError" and text in message, (name, r0[name])
    assert r0["good"] == r1["good"] == ("returned", [[3.0] * 16] * 2)
    assert r0["second thread"][0] == "CommunicatorError" and "another thread" in r0["second thread"][1]
    assert r0["first thread"] == r1["first thread"] == ("returned", [[2.0] * 16])
    assert r0["part group"][0] == "ArgumentError" and "must hold every rank" in r0["part group"][1]
    kind, message = r0["never called"]
    assert kind == "BrokenExchange" and "timeout_s = 1.5 s" in message, r0["never called"]
    assert 0.9 * TIMEOUT_S <= r0["never called s"] < TIMEOUT_S + 3.0, r0["never called s"]
    assert r0["after"][0] == "CommunicatorError" and "unusable" in r0["after"][1] and r0["after s"] < 0.5
    assert r0["check"][0] == "CommunicatorError"


def _dying_rank(timeout_s: float):
    import torch.distributed as dist

    from tp_check.launch import init

    ctx = init("cpu", timeout_s=60)
    comm = Communicator.create(4, 16, timeout_s=timeout_s)
    attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16))  # one good call first
    if ctx.rank == 1:
        # Dies inside the call: after the ranks agreed on it, as its partial is to be exchanged.
        dist.all_gather = lambda *a, **k: os._exit(0)
    t0 = time.monotonic()
    out = {"died": _outcome(lambda: attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16)))}
    out["died s"] = time.monotonic() - t0
    out["is CommunicatorError"] = isinstance(_raised(comm), CommunicatorError)
    comm.close()
    dist.destroy_process_group()  # no barrier: the peer is gone
    return out


def _raised(comm):
    try:
        comm.check()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_a_rank_that_dies_mid_call_makes_the_others_raise_within_the_bound():
    r0, r1 = launch(_dying_rank, 2, 20.0, timeout_s=LAUNCH_S, exited_ok=True)
    assert r1 is None  # rank 1 exited inside the call
    kind, message = r0["died"]
    assert kind == "BrokenExchange" and "a rank did not call, or died" in message, r0["died"]
    assert r0["died s"] < 20.0 and r0["is CommunicatorError"]


def _three_ranks(timeout_s: float):
    """W = 3: a good call, the last rank called with fewer tokens, then the middle rank dies inside a call."""
    import torch.distributed as dist

    from tp_check.launch import init

    ctx = init("cpu", timeout_s=60)
    comm = Communicator.create(4, 16, timeout_s=timeout_s)
    out = {"good": _outcome(lambda: attnres.all_reduce(comm, torch.full((2, 16), float(ctx.rank + 1), dtype=BF16)))}
    T = 2 if ctx.rank == 2 else 3
    out["fewer tokens"] = _outcome(lambda: attnres.all_reduce(comm, torch.ones(T, 16, dtype=BF16)))
    out["after mismatch"] = _outcome(lambda: attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16)))
    if ctx.rank == 1:
        dist.all_gather = lambda *a, **k: os._exit(0)
    t0 = time.monotonic()
    out["died"] = _outcome(lambda: attnres.all_reduce(comm, torch.ones(1, 16, dtype=BF16)))
    out["died s"] = time.monotonic() - t0
    comm.close()
    dist.destroy_process_group()  # no barrier: rank 1 is gone
    return out


def test_three_ranks_agree_on_a_mismatch_and_survivors_raise_when_one_dies():
    r0, r1, r2 = launch(_three_ranks, 3, 20.0, timeout_s=LAUNCH_S, exited_ok=True)
    assert r1 is None  # rank 1 exited inside the last call
    assert r0["good"] == r2["good"] == ("returned", [[6.0] * 16] * 2)
    kind, message = r0["fewer tokens"]
    assert kind == "ArgumentError" and "rank 2 was called with T = 2" in message, r0["fewer tokens"]
    assert r2["fewer tokens"] == r0["fewer tokens"]
    assert r0["after mismatch"] == r2["after mismatch"] == ("returned", [[3.0] * 16])
    for r in (r0, r2):
        kind, message = r["died"]
        assert kind == "BrokenExchange" and "a rank did not call, or died" in message, r["died"]
        assert r["died s"] < 20.0
