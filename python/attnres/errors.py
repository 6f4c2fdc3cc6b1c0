"""The errors attnres raises: one base class, importable from the package (`attnres.ArgumentError`, ...).

The C++ library's exceptions are translated into these classes (attnres._C registers them at import), so a
traceback names `attnres.ArgumentError` whichever layer raised it.
"""

from __future__ import annotations


class AttnResError(Exception):
    """Base of every error attnres raises."""


class ArgumentError(AttnResError, ValueError):
    """A violated precondition (shape, dtype, device, layout, range, aliasing): raised before anything is written."""


class UnsupportedError(AttnResError, RuntimeError):
    """A valid call this build or device cannot run (the plan's decline reason): nothing is written."""


class CudaError(AttnResError, RuntimeError):
    """The CUDA runtime reported an error during a launch."""


for _cls in (AttnResError, ArgumentError, UnsupportedError, CudaError):
    _cls.__module__ = "attnres"
del _cls
