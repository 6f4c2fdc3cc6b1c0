"""The communicator of the one-shot all-reduce (docs/ops/all_reduce.md, docs/tp.md).

Per rank: a buffer region of 3 rotating slots x W source ranks x (`capacity` tokens + 1 header row) x `width`
bf16 elements, initialised to the sentinel -0.0, and a small device state (uint32 words: generation, error,
arrival counter, tokens per slot, the error's details). The header row carries the source's T and width, so
a rank called with another T than its peers is detected on every rank (Communicator.check()). Both are allocated once with torch; every rank maps its peers' regions:

* `Communicator.create(capacity, width, group=...)` — one rank of a torch.distributed group (collective). On
  CUDA the regions are exchanged as CUDA IPC handles (`untyped_storage()._share_cuda_()`, gathered with
  all_gather_object, opened with `UntypedStorage._new_shared_cuda`); this works for W processes on W GPUs and
  for W processes on one GPU. On the CPU (gloo) nothing is mapped: each call first agrees with every rank on
  the call (op, T, D, dtype), then gathers the partials over the communicator's own gloo group, every wait bounded
  by timeout_s (exchange.py), and the CPU backend reduces them in rank order.
* `InProcessWorld(world_size, capacity, width, device)` — W ranks in one process: on CUDA the W regions on
  one device, each rank's kernel on its own stream (single-GPU timing and tests), the calls whose ranks cannot
  all be resident refused (residency.py); on the CPU each rank runs in its own thread and the world reduces what
  every rank passed. A world serves one call at a time.

Lifetime: allocate before any CUDA-graph capture, keep the communicator alive while any graph that uses it
exists, `close()` it explicitly; every use after close raises. One communicator serves every layer (outputs
are the caller's). NVLink multicast is never used.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from .. import _C, comm_registry
from . import arguments
from .exchange import (BrokenExchange, CommunicatorError, GlooExchange, InProcessExchange, PeerFailed,
                       check_same_tokens, exchange_group)
from .residency import check_resident

SLOTS = _C.limits["all_reduce_slots"]
SENTINEL_BITS = -32768  # int16 view of bf16 -0.0 (0x8000)
DEFAULT_TIMEOUT_S = 10.0  # generous: W processes on one GPU progress only at context switches
STATE_WORDS = _C.ALL_REDUCE_STATE_WORDS
HEADER_ROWS = _C.ALL_REDUCE_HEADER_ROWS
MAX_WORLD, MAX_WIDTH, WIDTH_MULTIPLE = arguments.MAX_WORLD, arguments.MAX_WIDTH, arguments.WIDTH_MULTIPLE
__all__ = ["Communicator", "CommunicatorError", "InProcessWorld", "check_same_tokens"]


def _region(world_size: int, capacity: int, width: int, device) -> Tensor:
    shape = (SLOTS, world_size, capacity + HEADER_ROWS, width)
    try:
        region = torch.empty(shape, dtype=torch.bfloat16, device=device)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise _C.ArgumentError(f"Communicator: capacity {capacity} x width {width} x {world_size} ranks needs a "
                               f"{list(shape)} bf16 region per rank, which {device} cannot allocate: "
                               f"{str(e).splitlines()[0]}") from None
    region.view(torch.int16).fill_(SENTINEL_BITS)
    return region


def _check_shape_args(world_size, capacity, width, timeout_s) -> None:
    """The shape and timeout rules alone (tests/ops/test_limits_python.py holds them to the library's limits)."""
    arguments.shape("Communicator", world_size, capacity, width)
    arguments.timeout_ns("Communicator", timeout_s)


def _checked(owner: str, world_size, capacity, width, timeout_s, device) -> tuple:
    """(world_size, capacity, width, timeout_s, device), each checked (arguments.py): raises before anything is
    allocated or exchanged."""
    world_size, capacity, width = arguments.shape(owner, world_size, capacity, width)
    arguments.timeout_ns(owner, timeout_s)
    return world_size, capacity, width, float(timeout_s), arguments.device(owner, device)


class Communicator:
    """One rank's view: its own region and state, every rank's region as this process addresses it.

    On the CPU, `exchange(op, partial)` hands every rank's partial to this rank (gloo: GlooExchange; in-process:
    the world's call); on CUDA the kernels exchange through the regions, and an in-process world's `world` refuses
    the calls its ranks cannot all hold resident."""

    def __init__(self, *, rank: int, world_size: int, capacity: int, width: int, device: torch.device,
                 regions: list[Tensor] | None, state: Tensor, timeout_s: float, exchange=None, keep=(),
                 world: "InProcessWorld | None" = None):
        world_size, capacity, width, timeout_s, device = _checked("Communicator", world_size, capacity, width,
                                                                  timeout_s, device)
        rank = arguments.count("Communicator", "rank", rank, 0, world_size - 1)
        self.rank, self.world_size, self.capacity, self.width = rank, world_size, capacity, width
        self.device = device
        self.timeout_s = timeout_s
        self._regions = regions
        self._state = state
        self._exchange = exchange
        self._world = world
        self._keep = list(keep)  # IPC-opened storages: mapped as long as this communicator is open
        self._closed = False
        self._broken: str | None = None  # why an exchange failed part-way (CPU): every later call raises it
        # The ops carry this handle, never an address: the library launches only on what it recorded here.
        self.handle = comm_registry.register(self, state=state, regions=regions)

    # ---------------------------------------------------------------- construction
    @classmethod
    def create(cls, capacity: int, width: int, *, group=None, device=None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> "Communicator":
        """Collective over `group` (default: the default group). CUDA: device defaults to the current one. CPU:
        collective over the default group (the exchange's own gloo group is created with new_group)."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        backend = dist.get_backend(group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        world, capacity, width, timeout_s, device = _checked("Communicator.create", world, capacity, width,
                                                             timeout_s, device)
        # Every rank must agree on the layout: a mismatch raises on every rank, before anything is mapped.
        shapes = [None] * world
        dist.all_gather_object(shapes, (capacity, width, device.type), group=group)
        if any(s != shapes[0] for s in shapes):
            raise _C.ArgumentError(f"Communicator.create: ranks disagree on (capacity, width, device type): "
                                   f"{shapes}")
        state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
        if device.type == "cpu":
            exchange = GlooExchange(exchange_group(group, timeout_s), rank, world, timeout_s)
            return cls(rank=rank, world_size=world, capacity=capacity, width=width, device=device, regions=None,
                       state=state, timeout_s=timeout_s, exchange=exchange)
        own = _region(world, capacity, width, device)
        torch.cuda.synchronize(device)  # the sentinel fill is done before any peer can write
        handles = [None] * world
        dist.all_gather_object(handles, own.untyped_storage()._share_cuda_(), group=group)
        regions, keep = [], []
        for r, h in enumerate(handles):
            if r == rank:
                regions.append(own)
                continue
            storage = torch.UntypedStorage._new_shared_cuda(*h)
            keep.append(storage)
            t = torch.empty(0, dtype=torch.bfloat16, device=device).set_(storage).view(own.shape)
            regions.append(t)
        dist.barrier(group=group)  # every rank mapped its peers before any exchange
        return cls(rank=rank, world_size=world, capacity=capacity, width=width, device=device, regions=regions,
                   state=state, timeout_s=timeout_s, keep=keep)

    # ---------------------------------------------------------------- the ops' view
    def check_open(self, op: str = "Communicator") -> None:
        if self._closed:
            raise CommunicatorError(f"{op}: the communicator is closed")
        if self._broken is not None:
            raise CommunicatorError(f"{op}: the communicator is unusable since an earlier exchange failed: "
                                    f"{self._broken}")

    @property
    def state(self) -> Tensor:
        self.check_open()
        return self._state

    @property
    def buffer_addresses(self) -> list[int]:
        self.check_open()
        return [t.data_ptr() for t in self._regions] if self._regions is not None else []

    def op_args(self) -> tuple[int, int, int, int, int]:
        self.check_open()
        return (self.world_size, self.rank, self.capacity, self.width, arguments.timeout_ns("Communicator",
                                                                                              self.timeout_s))

    def gather(self, partial: Tensor, op: str) -> Tensor | None:
        """CPU: every rank's partial, [W, T, D] in rank order (collective: every rank first agrees on the call,
        exchange.py), through the attnres_tp::cpu_exchange op (the communicator as its handle), so a compiled
        caller keeps the exchange as one opaque call; CUDA: None (the kernel exchanges), after an in-process
        world's residency check."""
        self.check_open(op)
        if self.device.type != "cpu":
            if isinstance(partial, Tensor) and partial.dim() == 2:
                self.check_resident(op, partial.shape[0])
            return None
        if self._exchange is None:
            raise CommunicatorError(f"{op}: an in-process CPU rank cannot reduce alone; call its InProcessWorld")
        if not (isinstance(partial, Tensor) and partial.device.type == "cpu"):
            # Not an op's argument (a non-tensor, a meta or CUDA tensor): exchanged as it is, so every rank agrees
            # on the refusal (exchange.check_agreement names what each rank passed).
            return self._exchange_now(op, partial)
        return torch.ops.attnres_tp.cpu_exchange(partial, self.handle, op)

    def check_resident(self, op: str, tokens: int) -> None:
        """An in-process CUDA world: UnsupportedError, before anything is launched, when its W ranks of `op` at
        T = tokens cannot all be resident on the one GPU (residency.py). Other communicators: nothing."""
        if self._world is not None and self.device.type == "cuda":
            check_resident(op, self.world_size, tokens, self.width, self.device)

    def _exchange_now(self, op: str, partial: Tensor) -> Tensor:
        """The exchange itself (the cpu_exchange op's kernel): a failure part-way makes the communicator unusable."""
        self.check_open(op)
        try:
            return self._exchange(op, partial)
        except BrokenExchange as e:
            self._broken = str(e)
            raise

    def region(self, rank: int | None = None) -> Tensor:
        """Rank `rank`'s region [3, W, capacity + 1, width] as this process addresses it (row `capacity` of each
        (slot, source) is the header; tests)."""
        self.check_open()
        return self._regions[self.rank if rank is None else rank]

    # ---------------------------------------------------------------- health and lifetime
    def generation(self) -> int:
        """The device-side generation counter (synchronizes)."""
        return int(self.state[0].item()) & 0xFFFFFFFF

    def check(self) -> None:
        """Raises CommunicatorError if an exchange on this rank timed out or failed (synchronizes)."""
        self.check_open()
        words = self._state.cpu().tolist()
        generation = words[0] & 0xFFFFFFFF
        if words[1] == _C.ALL_REDUCE_ERROR_TOKEN_MISMATCH:
            raise CommunicatorError(
                f"all_reduce: rank {self.rank} was called with T = {words[8]} but rank {words[6]} with T = "
                f"{words[7]} (generation {generation}); nothing was written; every rank must call every all-reduce "
                "with the same T; the communicator is unusable: close it and create a new one")
        if words[1] == _C.ALL_REDUCE_ERROR_WIDTH_MISMATCH:
            raise CommunicatorError(
                f"all_reduce: rank {self.rank}'s communicator has width {words[8]} but rank {words[6]}'s has width "
                f"{words[7]} (generation {generation}); nothing was written; the communicator is unusable")
        if words[1] != 0:
            raise CommunicatorError(
                f"all_reduce: rank {self.rank} timed out after {self.timeout_s:g} s waiting for rank {words[6]}'s "
                f"partial (generation {generation}); the communicator is unusable: close it and create "
                "a new one (every rank must call every all-reduce with the same T)")

    def close(self) -> None:
        """Releases the mapped regions and the state. Idempotent; every later use raises."""
        if self._closed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._closed = True
        if isinstance(self._exchange, GlooExchange):
            self._exchange.close()
        comm_registry.unregister(self.handle)
        self._regions, self._keep, self._state, self._exchange = None, [], None, None

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        status = "closed" if self._closed else "open"
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, capacity={self.capacity}, "
                f"width={self.width}, device={self.device}, {status})")


@torch.library.custom_op("attnres_tp::cpu_exchange", mutates_args=())
def _cpu_exchange(partial: Tensor, comm: int, op: str) -> Tensor:
    """Every rank's partial [W, T, D] of the CPU communicator with handle `comm` (Communicator.gather): an op, so
    torch.compile(fullgraph=True) keeps the collective (threads or gloo) as one call it does not trace."""
    return comm_registry.communicator(op, comm)._exchange_now(op, partial)


@_cpu_exchange.register_fake
def _(partial, comm, op):
    return partial.new_empty((comm_registry.communicator(op, comm).world_size, *partial.shape))


# What InProcessWorld caches on each rank's stream at creation (see _reserve_cached_memory).
RESERVE_SMALL_BLOCKS = 32  # of 1 MiB: the caching allocator's small pool (requests <= 1 MiB, 2 MiB segments)
RESERVE_LARGE_BYTES = 256 << 20


def _reserve_cached_memory(stream, device) -> None:
    """Allocates and frees memory on `stream`, so PyTorch's caching allocator keeps it for that stream's later
    requests. Why: a cudaMalloc issued between one rank's launch and its peer's is an implicit synchronization —
    the peer's kernel then cannot start before the first rank's ends, while the first rank's exchange spins on
    the peer's partial until the bounded wait expires (the likely cause of the eager warm-up calls that stalled
    on the H200, kernels long loaded and few blocks resident). A warm cache makes an eager call allocate without
    cudaMalloc; timing runs capture one graph per rank instead (bench/allreduce.py), whose replays allocate
    nothing."""
    with torch.cuda.stream(stream):
        held = [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(RESERVE_SMALL_BLOCKS)]
        held.append(torch.empty(RESERVE_LARGE_BYTES, dtype=torch.uint8, device=device))
    del held


class InProcessWorld:
    """W ranks in one process. CUDA: W regions on one device, rank r's kernels on streams[r]; the kernels must
    all be resident at once (they are at decode sizes), which is the single-GPU timing set-up. CPU: the world
    reduces the ranks' partials together (`all_reduce`, the fused ops through `run`).

    CUDA caveats: the ranks' exchanges progress only while every rank's kernel can run. (1) Nothing between one
    rank's launch and the next rank's may synchronize the device implicitly (a cudaMalloc, a blocking copy, a
    synchronize): each stream gets a warm allocator cache at creation (_reserve_cached_memory), and a long run
    should capture one CUDA graph per rank and replay them on the ranks' streams (bench/allreduce.py
    capture_ranks / replay_ranks). (2) Every rank's exchanging blocks must be resident at once, beside the
    blocks each rank's next kernel holds while it waits under PDL: the calls that cannot be are refused up front
    (residency.py: UnsupportedError naming the largest T), and keep the persistent topology (one block on every
    SM) out of a world's calls. (3) A kernel's
    first launch in the process loads it (CUDA's lazy loading), which may synchronize the context: a kernel
    first launched after one rank's exchange (the plain op of the two-kernel site) is the most likely cause of
    an eager call that stalled on the H200, so run each op once outside the world's exchanges (or capture graphs, whose instantiation loads
    every kernel) before an eager exchange. Ranks on separate GPUs share none of these hazards."""

    def __init__(self, world_size: int, capacity: int, width: int, *, device="cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        world_size, capacity, width, timeout_s, device = _checked("InProcessWorld", world_size, capacity, width,
                                                                  timeout_s, device)
        self.device = device
        self.world_size = world_size
        self.timeout_s = timeout_s
        regions = [_region(world_size, capacity, width, device) for _ in range(world_size)] \
            if device.type == "cuda" else None
        self._lock = threading.Lock()  # one call at a time: two callers' ranks would pair with each other's
        self._call: InProcessExchange | None = None
        self._threads: dict[int, int] = {}  # thread id -> the rank it runs, during a CPU call
        self.comms = [
            Communicator(rank=r, world_size=world_size, capacity=capacity, width=width, device=device,
                         regions=regions, state=torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
                         timeout_s=timeout_s, world=self,
                         exchange=self._rank_exchange(r) if device.type == "cpu" else None)
            for r in range(world_size)]
        self.streams = [torch.cuda.Stream(device) for _ in range(world_size)] if device.type == "cuda" else []
        if device.type == "cuda":
            for stream in self.streams:
                _reserve_cached_memory(stream, device)
            torch.cuda.synchronize(device)

    def _rank_exchange(self, rank: int):
        def exchange(op: str, partial) -> Tensor:
            call = self._call
            if call is None or self._threads.get(threading.get_ident()) != rank:
                raise CommunicatorError(f"{op}: rank {rank} of an in-process CPU world must be called through "
                                        "InProcessWorld.run (its own rank's call there)")
            return call(op, rank, partial)

        return exchange

    def run(self, fn, inputs: list, gathered: list[Tensor] | None = None) -> list:
        """fn(comm, inputs[r]) for every rank r, returns the results in rank order. One call at a time: a call
        while another thread's is running raises CommunicatorError.

        CPU: each rank runs in its own thread, and what every rank's op passes is exchanged and reduced (bounded
        by timeout_s); `gathered`, if given, is what each rank is expected to pass (a rank passing anything else
        raises). A failing rank's error is raised (the lowest such rank's). CUDA: rank r runs on streams[r], each
        stream first waits for the current stream (inputs ready) and the current stream then waits for every
        rank's stream."""
        if not isinstance(inputs, (list, tuple)) or len(inputs) != self.world_size:
            raise _C.ArgumentError(f"InProcessWorld: {len(inputs) if isinstance(inputs, (list, tuple)) else inputs!r} "
                                   f"inputs for {self.world_size} ranks")
        if gathered is not None and (not isinstance(gathered, (list, tuple)) or len(gathered) != self.world_size):
            raise _C.ArgumentError(f"InProcessWorld: gathered must hold one partial per rank ({self.world_size})")
        if not self._lock.acquire(blocking=False):
            raise CommunicatorError("InProcessWorld: another call is running on this world (another thread, or a "
                                    "call made from inside run); a world serves one call at a time")
        try:
            return self._run_cpu(fn, inputs, gathered) if self.device.type == "cpu" else self._run_cuda(fn, inputs)
        finally:
            self._lock.release()

    def _run_cpu(self, fn, inputs: list, gathered) -> list:
        call = InProcessExchange(self.world_size, self.timeout_s, gathered)
        results: list = [None] * self.world_size
        errors: list = [None] * self.world_size

        def rank_main(r: int) -> None:
            self._threads[threading.get_ident()] = r
            try:
                results[r] = fn(self.comms[r], inputs[r])
            except BaseException as e:  # noqa: BLE001  (re-raised by run, in rank order)
                errors[r] = e
                call.abort()  # the other ranks stop waiting for this one
            finally:
                self._threads.pop(threading.get_ident(), None)

        self._call = call
        try:
            threads = [threading.Thread(target=rank_main, args=(r,), name=f"attnres-rank{r}", daemon=True)
                       for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            self._call = None
        # The root cause first: a rank that failed on its own, not one that stopped because a peer failed.
        failed = [e for e in errors if e is not None and not isinstance(e, PeerFailed)] or \
            [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        return results

    def _run_cuda(self, fn, inputs: list) -> list:
        current = torch.cuda.current_stream(self.device)
        results = []
        for c, p, s in zip(self.comms, inputs, self.streams):
            s.wait_stream(current)
            with torch.cuda.stream(s):
                results.append(fn(c, p))
        for s in self.streams:
            current.wait_stream(s)
        return results

    def all_reduce(self, partials: list[Tensor], **kwargs) -> list[Tensor]:
        from ..all_reduce import all_reduce

        return self.run(lambda c, p: all_reduce(c, p, **kwargs), partials)

    def check(self) -> None:
        for c in self.comms:
            c.check()

    def close(self) -> None:
        for c in self.comms:
            c.close()
