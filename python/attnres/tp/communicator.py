"""The communicator of the one-shot all-reduce (docs/ops/all_reduce.md, docs/tp.md).

Per rank: a buffer region of 3 rotating slots x W source ranks x (`capacity` tokens + 1 header row) x `width`
bf16 elements, initialised to the sentinel -0.0, and a small device state (uint32 words: generation, error,
arrival counter, tokens per slot, the error's details). The header row carries the source's T and width, so
a rank called with another T than its peers is detected on every rank (Communicator.check()). Both are allocated once with torch; every rank maps its peers' regions:

* `Communicator.create(capacity, width, group=...)` — one rank of a torch.distributed group (collective). On
  CUDA the regions are exchanged as CUDA IPC handles (`untyped_storage()._share_cuda_()`, gathered with
  all_gather_object, opened with `UntypedStorage._new_shared_cuda`); this works for W processes on W GPUs and
  for W processes on one GPU. On the CPU (gloo) nothing is mapped: each call gathers the partials with
  torch.distributed and the CPU backend reduces them in rank order.
* `InProcessWorld(world_size, capacity, width, device)` — W ranks in one process: on CUDA the W regions on
  one device, each rank's kernel on its own stream (single-GPU timing and tests); on the CPU the world
  reduces the ranks' partials together.

Lifetime: allocate before any CUDA-graph capture, keep the communicator alive while any graph that uses it
exists, `close()` it explicitly; every use after close raises. One communicator serves every layer (outputs
are the caller's). NVLink multicast is never used.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _C, comm_registry
from ..errors import AttnResError

SLOTS = _C.limits["all_reduce_slots"]
SENTINEL_BITS = -32768  # int16 view of bf16 -0.0 (0x8000)
DEFAULT_TIMEOUT_S = 10.0  # generous: W processes on one GPU progress only at context switches
STATE_WORDS = _C.ALL_REDUCE_STATE_WORDS
MAX_WORLD = _C.limits["all_reduce_max_world"]
MAX_WIDTH = _C.limits["all_reduce_max_width"]
WIDTH_MULTIPLE = _C.limits["all_reduce_width_multiple"]
HEADER_ROWS = _C.ALL_REDUCE_HEADER_ROWS


class CommunicatorError(AttnResError):
    """The exchange failed on the device (a rank did not arrive within the bound), or the communicator is
    unusable. Raised by Communicator.check() and by calls on a broken or closed communicator."""


def _region(world_size: int, capacity: int, width: int, device) -> Tensor:
    region = torch.empty((SLOTS, world_size, capacity + HEADER_ROWS, width), dtype=torch.bfloat16, device=device)
    region.view(torch.int16).fill_(SENTINEL_BITS)
    return region


def check_same_tokens(op: str, tokens: list[int]) -> None:
    """Every rank's T of one call (rank order): ArgumentError naming the first rank that differs from rank 0."""
    for r, t in enumerate(tokens):
        if t != tokens[0]:
            raise _C.ArgumentError(
                f"{op}: rank {r} was called with T = {t} but rank 0 with T = {tokens[0]}: every rank must call "
                "every all-reduce with the same T")


def _check_shape_args(world_size: int, capacity: int, width: int, timeout_s: float) -> None:
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD:
        raise _C.ArgumentError(f"Communicator: world_size must be an int in [1, {MAX_WORLD}], got {world_size!r}")
    if not isinstance(capacity, int) or capacity < 1:
        raise _C.ArgumentError(f"Communicator: capacity must be an int >= 1 (tokens per call), got {capacity!r}")
    if not isinstance(width, int) or not (WIDTH_MULTIPLE <= width <= MAX_WIDTH and width % WIDTH_MULTIPLE == 0):
        raise _C.ArgumentError(f"Communicator: width must be a multiple of {WIDTH_MULTIPLE} in [{WIDTH_MULTIPLE}, "
                               f"{MAX_WIDTH}], got {width!r}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise _C.ArgumentError(f"Communicator: timeout_s must be finite and > 0, got {timeout_s!r}")


class Communicator:
    """One rank's view: its own region and state, every rank's region as this process addresses it."""

    def __init__(self, *, rank: int, world_size: int, capacity: int, width: int, device: torch.device,
                 regions: list[Tensor] | None, state: Tensor, timeout_s: float, gather_fn=None, keep=()):
        _check_shape_args(world_size, capacity, width, timeout_s)
        if not 0 <= rank < world_size:
            raise _C.ArgumentError(f"Communicator: rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size, self.capacity, self.width = rank, world_size, capacity, width
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self._regions = regions
        self._state = state
        self._gather_fn = gather_fn
        self._keep = list(keep)  # IPC-opened storages: mapped as long as this communicator is open
        self._closed = False
        # The ops carry this handle, never an address: the library launches only on what it recorded here.
        self.handle = comm_registry.register(self, state=state, regions=regions)

    # ---------------------------------------------------------------- construction
    @classmethod
    def create(cls, capacity: int, width: int, *, group=None, device=None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> "Communicator":
        """Collective over `group` (default: the default group). CUDA: device defaults to the current one."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        _check_shape_args(world, capacity, width, timeout_s)
        backend = dist.get_backend(group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        device = torch.device(device)
        # Every rank must agree on the layout: a mismatch raises on every rank, before anything is mapped.
        shapes = [None] * world
        dist.all_gather_object(shapes, (capacity, width, device.type), group=group)
        if any(s != shapes[0] for s in shapes):
            raise _C.ArgumentError(f"Communicator.create: ranks disagree on (capacity, width, device type): {shapes}")
        state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
        if device.type == "cpu":
            def gather(partial: Tensor) -> Tensor:
                # Every rank's T first (one small collective): a mismatch raises on every rank, nothing written.
                shape = torch.tensor(list(partial.shape[-2:]) if partial.dim() >= 2 else [0, 0], dtype=torch.int64)
                shapes = [torch.empty_like(shape) for _ in range(world)]
                dist.all_gather(shapes, shape, group=group)
                check_same_tokens("all_reduce", [int(s[0]) for s in shapes])
                parts = [torch.empty_like(partial) for _ in range(world)]
                dist.all_gather(parts, partial.contiguous(), group=group)
                return torch.stack(parts)

            return cls(rank=rank, world_size=world, capacity=capacity, width=width, device=device, regions=None,
                       state=state, timeout_s=timeout_s, gather_fn=gather)
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
        return (self.world_size, self.rank, self.capacity, self.width, int(self.timeout_s * 1e9))

    def gather(self, partial: Tensor, op: str) -> Tensor | None:
        """CPU: every rank's partial, [W, T, D] in rank order (collective); CUDA: None (the kernel exchanges)."""
        self.check_open(op)
        if self.device.type != "cpu":
            return None
        if self._gather_fn is None:
            raise CommunicatorError(f"{op}: an in-process CPU rank cannot reduce alone; call its InProcessWorld")
        if partial.device.type != "cpu":
            raise _C.ArgumentError(f"{op}: partial is on {partial.device} but the communicator is on cpu")
        return self._gather_fn(partial)

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
        """Raises CommunicatorError if an exchange on this rank timed out (synchronizes)."""
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
        comm_registry.unregister(self.handle)
        self._regions, self._keep, self._state, self._gather_fn = None, [], None, None

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        status = "closed" if self._closed else "open"
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, capacity={self.capacity}, "
                f"width={self.width}, device={self.device}, {status})")


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
    blocks each rank's next kernel holds while it waits under PDL: keep T small (the benchmark stays at
    T <= 32) and keep the persistent topology (one block on every SM) out of a world's calls. (3) A kernel's
    first launch in the process loads it (CUDA's lazy loading), which may synchronize the context: a kernel
    first launched after one rank's exchange (the plain op of the two-kernel site) is the most likely cause of
    an eager call that stalled on the H200, so run each op once outside the world's exchanges (or capture graphs, whose instantiation loads
    every kernel) before an eager exchange. Ranks on separate GPUs share none of these hazards."""

    def __init__(self, world_size: int, capacity: int, width: int, *, device="cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        _check_shape_args(world_size, capacity, width, timeout_s)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.world_size = world_size
        regions = [_region(world_size, capacity, width, device) for _ in range(world_size)] \
            if device.type == "cuda" else None
        self._pending: dict[int, Tensor] = {}
        self.comms = [
            Communicator(rank=r, world_size=world_size, capacity=capacity, width=width, device=device,
                         regions=regions, state=torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
                         timeout_s=timeout_s, gather_fn=self._gather_fn(r) if device.type == "cpu" else None)
            for r in range(world_size)]
        self.streams = [torch.cuda.Stream(device) for _ in range(world_size)] if device.type == "cuda" else []
        if device.type == "cuda":
            for stream in self.streams:
                _reserve_cached_memory(stream, device)
            torch.cuda.synchronize(device)

    def _gather_fn(self, rank: int):
        def gather(partial: Tensor) -> Tensor:
            if self._staged is None:
                raise CommunicatorError("InProcessWorld: a CPU rank's call must go through InProcessWorld.run")
            return self._staged

        return gather

    _staged: Tensor | None = None

    def run(self, fn, inputs: list, gathered: list[Tensor] | None = None) -> list:
        """fn(comm, inputs[r]) for every rank r, returns the results in rank order. CPU: `gathered` (default:
        the inputs themselves) is staged as every rank's gathered partials; CUDA: rank r runs on streams[r],
        each stream first waits for the current stream (inputs ready) and the current stream then waits for
        every rank's stream."""
        partials = inputs
        if len(inputs) != self.world_size:
            raise _C.ArgumentError(f"InProcessWorld: {len(inputs)} inputs for {self.world_size} ranks")
        if self.device.type == "cpu":
            staged = inputs if gathered is None else gathered
            check_same_tokens("all_reduce", [p.shape[-2] if p.dim() >= 2 else 0 for p in staged])
            self._staged = torch.stack([p.contiguous() for p in staged])
            try:
                return [fn(c, p) for c, p in zip(self.comms, partials)]
            finally:
                self._staged = None
        current = torch.cuda.current_stream(self.device)
        results = []
        for c, p, s in zip(self.comms, partials, self.streams):
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
