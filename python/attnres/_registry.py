"""Registers the torch.ops.attnres.* ops through torch.library.Library (define + impl + register_fake).

torch.library.custom_op would do the same, but its CPU/CUDA kernels are wrapped in torch._dynamo's
`disable`, which imports torch._dynamo (seconds) on the first call of any op in the process, and it has no
overloads (the `.out` convention). A plain Library registration dispatches straight to the Python function.

Every op also gets an Autograd kernel: the ops are inference ops, so a functional op's outputs carry a
backward that raises (naming the op), and an op that writes into caller tensors (`.out`, the bank of the
`*_snapshot` ops) refuses inputs that require grad, as PyTorch's own out= ops do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import ArgumentError, UnsupportedError

_LIB = torch.library.Library("attnres", "DEF")  # noqa: TOR901 (kept for the process's lifetime)


class _NoBackward(torch.autograd.Function):
    """Passes the op's outputs through; its backward raises (the op has no derivative)."""

    @staticmethod
    def forward(ctx, name: str, count: int, *tensors):
        ctx.name = name
        outs = tuple(t.view_as(t) for t in tensors[:count])
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        raise UnsupportedError(f"{ctx.name}: attnres ops are inference ops and have no backward (run the forward "
                               "under torch.no_grad() or torch.inference_mode(), or detach the inputs)")


def _requires_grad(args, kwargs) -> list[torch.Tensor]:
    found = []
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                found.append(t)
    return found


def _autograd_kernel(qualname: str, name: str, mutates: bool) -> Callable:
    op = None

    def kernel(*args, **kwargs):
        nonlocal op
        if op is None:
            ns, _, rest = qualname.partition("::")
            base, _, overload = rest.partition(".")
            op = getattr(getattr(torch.ops.attnres, base), overload or "default")
        grad = _requires_grad(args, kwargs) if torch.is_grad_enabled() else []
        if grad and mutates:
            raise ArgumentError(f"{name}: writes into caller tensors and does not support automatic "
                                "differentiation, but an input requires grad (call it under torch.no_grad() or "
                                "torch.inference_mode(), or detach the inputs)")
        with torch._C._AutoDispatchBelowAutograd():
            result = op(*args, **kwargs)
        if not grad:
            return result
        single = isinstance(result, torch.Tensor)
        outs = (result,) if single else tuple(result)
        wrapped = _NoBackward.apply(name, len(outs), *outs, *grad)
        return wrapped[0] if single else wrapped

    return kernel


def define(name: str, schema: str, impl: Callable, fake: Callable, *, mutates: bool, public_name: str) -> None:
    """Defines attnres::<name> (name may carry an overload, "attn_res.out") with `schema` ("(args) -> rets"),
    its CPU and CUDA kernel `impl`, its fake kernel and its Autograd kernel. `public_name` names the op in
    errors."""
    _LIB.define(name + schema)
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, impl, key)
    _LIB.impl(name, _autograd_kernel(f"attnres::{name}", public_name, mutates), "Autograd")
    torch.library.register_fake(f"attnres::{name}", fake, lib=_LIB)


def _bump_takes_tuples() -> bool:
    """Whether this torch's _increment_version takes a tuple of tensors and passes over inference tensors (which
    have no version counter) itself: one C call for all of a call's written tensors."""
    try:
        with torch.inference_mode():
            inference = torch.empty(0)
        torch._C._increment_version((torch.empty(0), inference))
        return True
    except (TypeError, RuntimeError):
        return False


if _bump_takes_tuples():
    _bump = torch._C._increment_version

    def bump_versions(tensors: tuple) -> None:
        """note_writes for a tuple of tensors (no None)."""
        _bump(tensors)
else:
    def bump_versions(tensors: tuple) -> None:
        """note_writes for a tuple of tensors (no None)."""
        for t in tensors:
            if not t.is_inference():
                torch.autograd.graph.increment_version(t)


def note_writes(*tensors) -> None:
    """What an ADInplaceOrView kernel does for a mutated argument (a Library registration has none): bump its
    version counter, so autograd sees the write (inference tensors have no counter)."""
    bump_versions(tuple(t for t in tensors if t is not None))


class Op:
    """An op whose schema is inferred from its implementation's annotations (torch.library.infer_schema, as
    custom_op infers it); defined when its fake implementation is registered."""

    def __init__(self, name: str, fn: Callable, mutates_args: tuple[str, ...]):
        self.name = name
        self._fn = fn
        self._mutates_args = mutates_args
        self._schema = torch.library.infer_schema(fn, mutates_args=mutates_args)

    def register_fake(self, fake: Callable) -> Callable:
        # The communicator's state is the op's own bookkeeping, not a caller tensor: only a mutated bank makes
        # the op refuse inputs that require grad.
        define(self.name, self._schema, self._fn, fake, mutates="bank" in self._mutates_args, public_name=self.name)
        return fake

    def __call__(self, *args, **kwargs):
        return getattr(torch.ops.attnres, self.name)(*args, **kwargs)


def custom_op(name: str, *, mutates_args: tuple[str, ...]) -> Callable[[Callable], Op]:
    """Decorator: `@custom_op("moe_finalize", mutates_args=())` registers attnres::moe_finalize."""
    return lambda fn: Op(name, fn, tuple(mutates_args))
