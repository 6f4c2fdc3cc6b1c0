"""The communicators' construction arguments, checked once with attnres's errors (docs/tp.md).

Why at construction: every later call passes these values to the ops (`op_args`) and to torch; a value accepted
here and refused there (a timeout that rounds to 0 ns or overflows the library's int64, a "meta" device, a bool
taken for a count) would make every call of a communicator that looked healthy fail with another layer's error.
"""

from __future__ import annotations

import math
import operator

import torch

from .. import _C

MAX_WORLD = _C.limits["all_reduce_max_world"]
MAX_WIDTH = _C.limits["all_reduce_max_width"]
WIDTH_MULTIPLE = _C.limits["all_reduce_width_multiple"]
# CommRef::timeout_ns is an int64_t (cpp/include/attnres/all_reduce.hpp; tests/tp/test_communicators.py holds the
# binding to it) and the ops' schema int is int64 too.
TIMEOUT_NS_MAX = (1 << 63) - 1
# The exchange's header packs T into 32 bits (T | width << 32) and the state keeps tokens per slot as uint32.
MAX_CAPACITY = (1 << 32) - 1


def count(owner: str, name: str, value, low: int, high: int) -> int:
    """`value` as an int in [low, high]; a bool is not a count (True would be 1)."""
    if isinstance(value, bool):
        raise _C.ArgumentError(f"{owner}: {name} must be an int in [{low}, {high}], got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise _C.ArgumentError(f"{owner}: {name} must be an int in [{low}, {high}], got {value!r}") from None
    if not low <= v <= high:
        raise _C.ArgumentError(f"{owner}: {name} must be an int in [{low}, {high}], got {v}")
    return v


def timeout_ns(owner: str, timeout_s) -> int:
    """The bounded wait in ns as the ops take it: >= 1 and within int64."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise _C.ArgumentError(f"{owner}: timeout_s must be a number of seconds, got {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise _C.ArgumentError(f"{owner}: timeout_s must be finite and > 0, got {timeout_s!r}")
    ns = int(timeout_s * 1e9)
    if not 1 <= ns <= TIMEOUT_NS_MAX:
        raise _C.ArgumentError(f"{owner}: timeout_s = {timeout_s!r} is {ns} ns; it must be in [1 ns, "
                               f"{TIMEOUT_NS_MAX} ns] (the library's int64 bound on the wait)")
    return ns


def shape(owner: str, world_size, capacity, width) -> tuple[int, int, int]:
    world_size = count(owner, "world_size", world_size, 1, MAX_WORLD)
    capacity = count(owner, "capacity (tokens per call)", capacity, 1, MAX_CAPACITY)
    bad = isinstance(width, bool) or not isinstance(width, int)
    if bad or not (WIDTH_MULTIPLE <= width <= MAX_WIDTH and width % WIDTH_MULTIPLE == 0):
        raise _C.ArgumentError(f"{owner}: width must be a multiple of {WIDTH_MULTIPLE} in [{WIDTH_MULTIPLE}, "
                               f"{MAX_WIDTH}], got {width!r}")
    return world_size, capacity, width


def device(owner: str, value) -> torch.device:
    """A cpu or cuda torch.device (a cuda device without its index gets the current one): anything else, a
    device torch cannot parse, or a CUDA device this process cannot use raises before anything is allocated."""
    if isinstance(value, bool) or not isinstance(value, (str, torch.device, int)):
        raise _C.ArgumentError(f"{owner}: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {value!r}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise _C.ArgumentError(f"{owner}: device {value!r} is not a device torch knows ('cpu', 'cuda', "
                               "'cuda:N')") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise _C.ArgumentError(f"{owner}: device {dev} is not supported: the communicator's buffers live on 'cpu' "
                               "or a 'cuda' device")
    if not _C.cuda_backend_built():
        raise _C.UnsupportedError(f"{owner}: device {dev}: attnres was built without the CUDA backend")
    if not torch.cuda.is_available():
        raise _C.UnsupportedError(f"{owner}: device {dev}: no CUDA device is visible to this process")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise _C.ArgumentError(f"{owner}: device {dev} does not exist ({torch.cuda.device_count()} CUDA devices "
                               "visible)")
    return torch.device("cuda", index)
