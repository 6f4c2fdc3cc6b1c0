"""The library's registry of the communicators this process created (cpp/include/attnres/all_reduce.hpp).

The all-reduce ops never take an address: a Communicator registers its regions, world, rank, capacity, width
and state tensor once, at creation, and the ops carry the handle it got back. The library looks the handle up
for every call, checks the state tensor against the record, and launches kernels only on recorded memory: a
made-up handle, a closed communicator's handle or another tensor as state is refused with ArgumentError.
"""

from __future__ import annotations

import weakref

import torch

from . import _C
from ._tensors import ref

_open: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # handle -> Communicator


def register(comm, *, state: torch.Tensor, regions: list[torch.Tensor] | None) -> int:
    """Records `comm` (an attnres.comm.Communicator being built) and returns its handle. The record is dropped at
    comm.close() (unregister) or when comm is collected, whichever comes first: the memory it names is freed
    then, and a handle never outlives its memory."""
    op = "Communicator"
    c = _C.CommRef()
    c.world_size, c.rank, c.capacity, c.width = comm.world_size, comm.rank, comm.capacity, comm.width
    c.timeout_ns = timeout_ns(comm.timeout_s)
    state_ref = ref(state, op, "state")
    c.device = [int(state_ref.device_type == _C.DeviceType.cuda), state_ref.device_index]
    c.state = state_ref.data
    region_bytes = 0
    if regions is not None:
        c.buffers = [t.data_ptr() for t in regions]
        region_bytes = regions[0].numel() * regions[0].element_size() if regions else 0
    handle = _C.all_reduce_register(c, state_ref, region_bytes)
    weakref.finalize(comm, _C.all_reduce_unregister, handle)
    _open[handle] = comm
    return handle


def communicator(op: str, handle: int):
    """The open communicator of this process with `handle` (the CPU exchange op looks its communicator up here,
    as the all-reduce ops look theirs up in the library's registry)."""
    comm = _open.get(int(handle))
    if comm is None:
        raise _C.ArgumentError(f"{op}: comm handle {int(handle)} names no open communicator of this process "
                               "(never created, or closed)")
    return comm


def unregister(handle: int) -> None:
    """Drops the record (idempotent): every later call with the handle is refused."""
    _open.pop(handle, None)
    _C.all_reduce_unregister(handle)


def timeout_ns(timeout_s: float) -> int:
    """The bound in ns, as the library's int64 holds it: comm/arguments.py's rule (>= 1 ns, within int64), the one
    Communicator's constructor already applied, so a bound outside it is refused at creation."""
    from .comm import arguments

    return arguments.timeout_ns("Communicator", timeout_s)
