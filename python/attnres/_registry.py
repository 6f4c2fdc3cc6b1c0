"""Registers the torch.ops.attnres.* ops through torch.library.Library (define + impl + register_fake).

torch.library.custom_op would do the same, but its CPU/CUDA kernels are wrapped in torch._dynamo's
`disable`, which imports torch._dynamo (seconds) on the first call of any op in the process. A plain
Library registration dispatches straight to the Python function. The schema is inferred from the
function's annotations, exactly as custom_op infers it (torch.library.infer_schema).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

_LIB = torch.library.Library("attnres", "DEF")  # noqa: TOR901 (kept for the process's lifetime)


class Op:
    """One registered op: calling it dispatches through torch.ops.attnres.<name>."""

    def __init__(self, name: str, fn: Callable, mutates_args: Iterable[str]):
        self.name = name
        self._fn = fn
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, key)

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(f"attnres::{self.name}", fake, lib=_LIB)
        return fake

    def __call__(self, *args, **kwargs):
        return getattr(torch.ops.attnres, self.name)(*args, **kwargs)


def custom_op(name: str, *, mutates_args: Iterable[str]) -> Callable[[Callable], Op]:
    """Decorator: `@custom_op("attn_res", mutates_args=())` registers attnres::attn_res."""
    return lambda fn: Op(name, fn, mutates_args)


def note_writes(*tensors) -> None:
    """What custom_op's ADInplaceOrView kernel does for a mutated argument (a Library registration has none):
    bump its version counter, so autograd sees the write (inference tensors have no counter)."""
    for t in tensors:
        if t is not None and not t.is_inference():
            torch.autograd.graph.increment_version(t)
