"""How CPU ranks hand each other their partials (the CPU backend reduces what every rank passed, in rank order).

Every exchange is two steps, the same on gloo and in the in-process world:

1. each rank's description of its call — the op and what it passed (a tensor's device, dtype and shape) — goes
   to every rank, and `check_agreement` runs on the same list everywhere: a rank called with another op, T, D
   or dtype, or with something that is not a CPU tensor, makes every rank raise the same ArgumentError before
   any buffer is exchanged (gathering buffers of different sizes aborts gloo; of different dtypes, returns
   another rank's bits reinterpreted);
2. only then the partials themselves, which all have one shape and dtype.

Every wait is bounded by the communicator's timeout_s and ends in CommunicatorError (docs/tp.md).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _C
from ..errors import AttnResError

# gloo takes its timeout in whole milliseconds: a shorter bound would round to 0 ms, so it is rounded up to this.
GLOO_MIN_TIMEOUT_S = 1e-3


class CommunicatorError(AttnResError):
    """The exchange failed (a rank did not arrive within the bound, a peer died), or the communicator is
    unusable. Raised by Communicator.check() and by calls on a broken or closed communicator."""


class BrokenExchange(CommunicatorError):
    """The exchange failed part-way: the communicator that raised it is unusable from then on."""


class PeerFailed(CommunicatorError):
    """In-process world: this rank's exchange was abandoned because another rank failed first."""


def describe(op: str, partial) -> tuple:
    """What every rank sends before any buffer: plain values, the same on every rank for agreeing calls."""
    if not isinstance(partial, Tensor):
        return (op, type(partial).__name__, None, None)
    return (op, partial.device.type, str(partial.dtype).replace("torch.", ""), tuple(partial.shape))


def _text(d: tuple) -> str:
    _, kind, dtype, shape = d
    return f"a {kind}" if dtype is None else f"a {dtype} tensor of shape {list(shape)} on {kind}"


def check_same_tokens(op: str, tokens: list[int]) -> None:
    """Every rank's T of one call (rank order): ArgumentError naming the first rank that differs from rank 0."""
    for r, t in enumerate(tokens):
        if t != tokens[0]:
            raise _C.ArgumentError(
                f"{op}: rank {r} was called with T = {t} but rank 0 with T = {tokens[0]}: every rank must call "
                "every all-reduce with the same T")


def check_agreement(descriptions: list[tuple]) -> None:
    """Raises ArgumentError (the same text on every rank: it depends only on the gathered list) unless every rank
    made the same op's call with a CPU tensor of one shape and dtype. The op then validates that shape."""
    op = descriptions[0][0]
    for r, d in enumerate(descriptions):
        if d[0] != op:
            raise _C.ArgumentError(f"{op}: rank {r} called {d[0]} but rank 0 called {op}: every rank must make the "
                                   "same call; nothing was exchanged")
    for r, d in enumerate(descriptions):
        if d[2] is None or d[1] != "cpu":
            raise _C.ArgumentError(f"{op}: rank {r}'s partial is {_text(d)}, not a tensor on cpu (the "
                                   "communicator is on cpu); nothing was exchanged")
    check_same_tokens(op, [d[3][-2] if len(d[3]) >= 2 else 0 for d in descriptions])
    for r, d in enumerate(descriptions):
        if d[2:] != descriptions[0][2:]:
            raise _C.ArgumentError(
                f"{op}: rank {r}'s partial is {_text(d)} but rank 0's is {_text(descriptions[0])}: every rank must "
                "pass the same T, D and dtype; nothing was exchanged")


# ------------------------------------------------------------------------------------------ gloo
def exchange_group(group, timeout_s: float):
    """The communicator's own gloo group over `group`'s ranks, its collectives bounded by timeout_s.

    Why a group of its own: a timed-out collective leaves a group's ranks out of step for good, so the
    communicator's failure must not break the caller's group. Why `_set_pg_timeout` after creation: a group
    created with a short timeout fails its own rendezvous (a peer reaching new_group a few ms later). Why not
    `use_local_synchronization`: its hashed names are reused once a group is destroyed, and a later group of the
    same name read a stale address and hung (torch 2.13); the plain form's names are never reused, at the cost
    that every process of the default group creates it (the caller's `group` must hold every rank)."""
    world = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(world)
    if len(ranks) != dist.get_world_size():
        raise _C.ArgumentError(
            f"Communicator.create: on the CPU the group must hold every rank of the default group ({len(ranks)} "
            f"of {dist.get_world_size()}): its exchange group is created by torch.distributed.new_group, which "
            "every process calls")
    sub = dist.new_group(ranks, backend="gloo")
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=max(timeout_s, GLOO_MIN_TIMEOUT_S)), sub)
    return sub


class GlooExchange:
    """One rank's side of a process group's exchange. Not for concurrent use: two threads' collectives on one
    group would pair with each other's, so a second thread is refused."""

    def __init__(self, group, rank: int, world_size: int, timeout_s: float):
        self.group, self.rank, self.world_size, self.timeout_s = group, rank, world_size, timeout_s
        self._lock = threading.Lock()

    def __call__(self, op: str, partial) -> Tensor:
        if not self._lock.acquire(blocking=False):
            raise CommunicatorError(f"{op}: another thread is in a call on this communicator; a communicator "
                                    "serves one call at a time")
        try:
            everyone = [None] * self.world_size
            self._collective(op, lambda: dist.all_gather_object(everyone, describe(op, partial), group=self.group))
            check_agreement(everyone)
            parts = [torch.empty_like(partial) for _ in range(self.world_size)]
            self._collective(op, lambda: dist.all_gather(parts, partial.contiguous(), group=self.group))
            return torch.stack(parts)
        finally:
            self._lock.release()

    def _collective(self, op: str, fn) -> None:
        try:
            fn()
        except RuntimeError as e:  # gloo's timeout and a closed connection (a peer that died) both land here
            raise BrokenExchange(
                f"{op}: rank {self.rank}: the exchange with the other ranks failed (bound: timeout_s = "
                f"{self.timeout_s:g} s): {str(e).splitlines()[0] if str(e) else type(e).__name__}; a rank did not "
                "call, or died; the communicator is unusable: close it and create a new one") from None

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except (ValueError, RuntimeError):  # already gone with the default group
                pass


# ------------------------------------------------------------------------------------------ in process
class InProcessExchange:
    """One call of an InProcessWorld on the CPU: rank r's thread deposits what it passed, waits (bounded) for
    every rank, and every rank reduces the same list — what each rank passed, nothing staged."""

    def __init__(self, world_size: int, timeout_s: float, expected: list | None):
        self.world_size, self.timeout_s, self.expected = world_size, timeout_s, expected
        self.slots: list = [None] * world_size  # rank r writes only slot r, and only once every rank read it
        self.arrived = [0] * world_size  # exchanges each rank entered
        self.read = [0] * world_size  # exchanges each rank finished reading
        self.cond = threading.Condition()
        self.failed = False

    def abort(self) -> None:
        """A rank failed outside the exchange: the others stop waiting for it."""
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def _wait(self, op: str, rank: int, counts: list[int]) -> None:
        """Until every rank's count reached this rank's. Success wins over a failure noted later: a rank that
        fails after an exchange completed must not turn its peers' completed exchange into an error."""
        with self.cond:
            self.cond.notify_all()
            n = counts[rank]
            self.cond.wait_for(lambda: self.failed or min(counts) >= n, self.timeout_s)
            if min(counts) >= n:
                return
            if self.failed:
                raise PeerFailed(f"{op}: rank {rank}: another rank failed before the exchange")
            missing = [r for r, c in enumerate(counts) if c < n]
            raise CommunicatorError(f"{op}: rank {rank} timed out after {self.timeout_s:g} s waiting for rank(s) "
                                    f"{missing}: every rank must make every call")

    def __call__(self, op: str, rank: int, partial) -> Tensor:
        with self.cond:
            self.slots[rank] = (describe(op, partial), partial)
            self.arrived[rank] += 1
        self._wait(op, rank, self.arrived)
        try:
            check_agreement([s[0] for s in self.slots])  # every thread raises the same error
            if self.expected is not None:
                for r, (_, p) in enumerate(self.slots):
                    e = self.expected[r]
                    if not (isinstance(e, Tensor) and e.shape == p.shape and e.dtype == p.dtype and torch.equal(e, p)):
                        raise _C.ArgumentError(f"{op}: rank {r}'s partial differs from gathered[{r}] "
                                               "(InProcessWorld.run's `gathered` names what each rank passes); "
                                               "nothing was reduced")
            return torch.stack([p.contiguous() for _, p in self.slots])
        finally:
            with self.cond:
                self.read[rank] += 1
            # Every rank has read the slots before any rank's next exchange refills its own.
            self._wait(op, rank, self.read)
