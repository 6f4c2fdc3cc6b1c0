"""The one rule for integer arguments of the Python layer (plan(), the communicator's sizes): an int or an integer
type with __index__, inside a range; a bool is refused (True would count as 1)."""

from __future__ import annotations

import operator

from . import _C


def index_in(value, low: int, high: int, not_an_int: str, out_of_range: str) -> int:
    """`value` as an int in [low, high], else ArgumentError: `not_an_int` + repr(value) for a value that is not
    an integer, `out_of_range` + the value for one outside the range."""
    if isinstance(value, bool):  # numpy's bools have no __index__: refused below too
        raise _C.ArgumentError(f"{not_an_int}{value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise _C.ArgumentError(f"{not_an_int}{value!r}") from None
    if not low <= v <= high:
        raise _C.ArgumentError(f"{out_of_range}{v}")
    return v
