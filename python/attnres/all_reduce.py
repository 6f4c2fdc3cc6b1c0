"""The one-shot all-reduce of tensor-parallel decode and the ops fused with it (docs/ops/all_reduce.md).

* `all_reduce(comm, partial)` — reduced = bf16(fp32 sum of the W ranks' bf16 partials in rank order 0..W-1),
  every rank the same bits; a real -0.0 in a partial is read as +0.0.
* `all_reduce_attn_res_add_rmsnorm(comm, partial, prefix, bank, ...)` — the all-reduce into the addend of
  attn_res_add_rmsnorm (site "add": the attention partial; site "add2": the shared-expert partial with the
  routed part as the first addend, the MoE-tail fold), then that op: the one-shot all-reduce kernel, then the
  plain op, joined by PDL.
* `moe_finalize_all_reduce(comm, rows, weights, index, norm_weight, ...)` — the local-route finalize, the
  all-reduce of the latent and the two-rounding latent RMSNorm in one kernel.

`comm` is an attnres.comm.Communicator (allocated once, before any graph capture). On CUDA the kernels exchange
the partials through the communicator's buffers; on the CPU the communicator gathers every rank's partial
(torch.distributed over gloo, or the in-process world) and the CPU backend reduces them in rank order.

The torch.ops.attnres.* ops (attnres/_all_reduce_ops.py) carry the communicator as its registry handle and its
state tensor; no address crosses the op boundary. Every function takes `out=`: a tuple in the order it returns
its results (a None entry is allocated), validated like the inputs.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _C
from ._all_reduce_ops import KERNELS, SITES, moe_outputs, rows_like, site_outputs  # noqa: F401 (registers the ops)
from .errors import ArgumentError
from .ops import check_bank_in_storage, given_outputs
from ._tensors import as_tensor
from .moe_gate import finalize_decline, gate_device, gate_dtypes, token_gate
from .options import DEFAULT as _DEFAULT_OPTIONS, Options


class RefusedArguments:
    """What a rank whose moe_finalize_all_reduce arguments were refused exchanges: not a tensor, so every rank's
    agreement fails ("rank r's partial is a RefusedArguments")."""


def _exchange_then_raise(comm, partial, op: str) -> None:
    """A rank whose call is refused before its exchange (a screened argument, out=) still makes the exchange on
    the CPU, so its peers are not left waiting out timeout_s: a partial every rank passes completes it (each
    rank then raises or reduces on its own), a refused partial fails the ranks' agreement on every rank with the
    same error (tp/exchange.py), which is raised instead (its context: this rank's own error). The caller re-raises
    its own error."""
    if getattr(getattr(comm, "device", None), "type", None) != "cpu" or getattr(comm, "closed", True) \
            or getattr(comm, "world_size", 1) == 1:
        return  # CUDA, a closed communicator, or no peer to wait: the rank's own error alone
    try:
        partial = as_tensor(partial, op, "partial")
    except (TypeError, ArgumentError):
        pass  # exchanged as it is: the agreement names it
    comm.gather(partial, op)


# -------------------------------------------------------------------------------------- Python wrappers
def all_reduce(comm, partial: Tensor, *, pdl: bool = True, early_trigger: bool = True, kernel: str = "auto",
               out=None) -> Tensor:
    """This rank's share of the all-reduce of `partial` [T, D] bf16 over comm's world: the reduced [T, D]
    (written into out=(reduced,) when given)."""
    op = "all_reduce"
    raw = partial
    try:
        partial = as_tensor(partial, op, "partial")
        given = given_outputs(op, out, ("reduced",))
    except (TypeError, ArgumentError):
        _exchange_then_raise(comm, raw, op)
        raise
    gathered = comm.gather(partial, op)
    args = (partial, gathered, comm.state, comm.handle, bool(pdl), bool(early_trigger), kernel)
    if not given:
        return torch.ops.attnres.all_reduce(*args)
    torch.ops.attnres.all_reduce.out(*args, reduced=given["reduced"])
    return given["reduced"]


def all_reduce_attn_res_add_rmsnorm(comm, partial: Tensor, layer_residual: Tensor, block_residual: Tensor,
                                    res_weight: Tensor, rms_weight: Tensor, norm_weight: Tensor, rms_eps: float,
                                    norm_eps: float, *, site: str = "add", layer_residual_add: Tensor | None = None,
                                    return_mixture: bool = False, snapshot_slot: int | None = None,
                                    options: Options | None = None, early_trigger: bool = True, out=None):
    """(reduced, updated, output[, mixture]). Site "add": reduced = all_reduce(partial) is the addend,
    updated = prefix + reduced. Site "add2": updated = prefix + (layer_residual_add + reduced), the fold.
    Then output = RMSNorm(AttnRes(bank, updated)) exactly as attn_res_add_rmsnorm on the same addends.
    out=: a tuple in that order (None entries allocated); out=(None, layer_residual, None) updates the prefix in
    place."""
    op = "all_reduce_attn_res_add_rmsnorm"
    opts = options or _DEFAULT_OPTIONS
    raw = partial
    try:
        tensors = [as_tensor(t, op, name) for t, name in (
            (partial, "partial"), (layer_residual, "layer_residual"), (block_residual, "block_residual"),
            (res_weight, "res_weight"), (rms_weight, "rms_weight"), (norm_weight, "norm_weight"),
            (layer_residual_add, "layer_residual_add"))]
        partial, layer_residual, block, res_weight, rms_weight, norm_weight, layer_residual_add = tensors
        produced = ("reduced", "updated", "output") + (("mixture",) if return_mixture else ())
        given = given_outputs(op, out, produced)
        K = block.shape[0] if block.dim() == 3 else 0
        slot = -1
        bank = block
        if snapshot_slot is not None:
            slot = operator.index(snapshot_slot)
            if slot < 0:
                raise ArgumentError(f"{op}: snapshot_slot must be None or a row index >= K, got {slot}")
            if block.dim() == 3 and min(block.stride()) >= 0:
                if not torch.compiler.is_compiling():  # a fake bank has no storage to measure; the op's kernel checks
                    check_bank_in_storage(block, max(K, slot + 1), op)
                bank = block.as_strided((max(K, slot + 1), *block.shape[1:]), block.stride())
    except (TypeError, ArgumentError):
        _exchange_then_raise(comm, raw, op)
        raise
    gathered = comm.gather(partial, op)
    args = (partial, gathered, comm.state, comm.handle, site, layer_residual, layer_residual_add, bank, K, slot,
            res_weight, rms_weight, norm_weight, float(rms_eps), float(norm_eps), bool(return_mixture),
            *opts.as_args(), bool(early_trigger))
    if not given:
        reduced, updated, output, mixture = torch.ops.attnres.all_reduce_attn_res_add_rmsnorm(*args)
        result = (reduced, updated, output)
        return result + (mixture,) if return_mixture else result
    outs = site_outputs(layer_residual, comm.width, return_mixture)
    outs.update(given)
    torch.ops.attnres.all_reduce_attn_res_add_rmsnorm.out(*args, **outs)
    return tuple(outs[k] for k in produced)


def moe_finalize_all_reduce(comm, rows: Tensor, weights: Tensor, index: Tensor, norm_weight: Tensor, *, eps: float,
                            scale: float = 1.0, pdl: bool = True, kernel: str = "auto", out=None
                            ) -> tuple[Tensor, Tensor]:
    """(reduced latent, normed latent) [T, D]: this rank's local-route finalize (moe_finalize without shared and
    norm), all-reduced over comm's world, then moe_finalize's two-rounding RMSNorm. out=: (reduced, normed), None
    entries allocated."""
    op = "moe_finalize_all_reduce"
    raw = rows
    try:
        rows, weights, index, norm_weight = (as_tensor(t, op, name) for t, name in (
            (rows, "rows"), (weights, "weights"), (index, "index"), (norm_weight, "norm_weight")))
        given = given_outputs(op, out, ("reduced", "output"))
    except (TypeError, ArgumentError):
        # No partial can be computed: the exchange must fail on every rank, never complete with rows as a partial.
        _exchange_then_raise(comm, raw if not isinstance(raw, Tensor) or raw.device.type != "cpu"
                             else RefusedArguments(), op)
        raise
    gathered = None
    if comm.device.type != "cpu":
        comm.check_open(op)
        if weights.dim() == 2:  # else the library names the rank rule
            comm.check_resident(op, weights.shape[0])
    else:
        # The CPU backend reduces gathered partials: each rank's is moe_finalize without the norm.
        from .moe import moe_finalize

        comm.check_open(op)
        partial = moe_finalize(rows, weights, index, eps=0.0, scale=scale, kernel="cpu")
        gathered = comm.gather(partial, op)
    args = (rows, weights, index, norm_weight, gathered, comm.state, comm.handle, float(eps), float(scale), bool(pdl),
            kernel)
    if not given:
        return torch.ops.attnres.moe_finalize_all_reduce(*args)
    reduced, output = moe_outputs(rows, index)
    outs = {"reduced": reduced, "output": output, **given}
    torch.ops.attnres.moe_finalize_all_reduce.out(*args, **outs)
    return outs["reduced"], outs["output"]


# ------------------------------------------------------------------------------------------- the gates
MOE_WORLD_SIZES = tuple(_C.limits["all_reduce_world_sizes"])
_MAX_ROUTES = _C.limits["moe_finalize_max_routes"]
_MAX_WIDTH = _C.limits["all_reduce_max_width"]
_WIDTH_MULTIPLE = _C.limits["all_reduce_width_multiple"]
_WORLDS_TEXT = ", ".join(map(str, MOE_WORLD_SIZES[:-1])) + f" or {MOE_WORLD_SIZES[-1]}"


@dataclass(frozen=True)
class AllReduceDecision:
    """What a TP site ran: path "fused" (the one-shot ops) or "fallback" (torch.distributed + the plain op),
    and why it fell back ("" when fused)."""

    site: str  # "attention" | "shared" | "moe_finalize"
    path: str
    reason: str
    tokens: int
    world_size: int
    device: str


_decisions: list[list[AllReduceDecision]] = []


def note_decision(decision: AllReduceDecision) -> None:
    for sink in _decisions:
        sink.append(decision)


@contextlib.contextmanager
def record_all_reduce_decisions():
    """Collects every AllReduceDecision made inside the block (the TP chain's sites)."""
    sink: list[AllReduceDecision] = []
    _decisions.append(sink)
    try:
        yield sink
    finally:
        _decisions.remove(sink)


def supports_moe_finalize_all_reduce(tokens: int, k: int, hidden: int, world_size: int,
                                     dtypes: tuple[torch.dtype, torch.dtype] = (torch.bfloat16, torch.float32),
                                     device="cpu", *, max_tokens: int | None = None) -> tuple[bool, str]:
    """(True, "") when moe_finalize_all_reduce takes T = tokens, k routes, D = hidden over world_size ranks with
    dtypes (rows, weights) on `device` (a torch device or a described GPU, as supports_fused_moe_finalize takes);
    else (False, why). The token gate is ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS (attnres.knobs); `max_tokens`
    overrides it for one query. Arguments no path can compute raise ArgumentError (moe_gate.token_gate)."""
    op = "supports_moe_finalize_all_reduce"
    gate = token_gate(op, "ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS", max_tokens, tokens=tokens, k=k,
                      hidden=hidden, world_size=world_size)
    rows_dtype, weights_dtype = gate_dtypes(op, dtypes)
    if gate == 0:
        return False, "the fused finalize + all-reduce is disabled (ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS=0)"
    if tokens > gate:
        return False, f"T = {tokens} is above the token gate {gate} (ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS)"
    if world_size not in MOE_WORLD_SIZES:
        return False, f"world size {world_size} has no fused kernel ({_WORLDS_TEXT})"
    if rows_dtype != torch.bfloat16:
        return False, f"rows are {rows_dtype} (the kernel reads bfloat16)"
    if weights_dtype not in (torch.float32, torch.bfloat16):
        return False, f"weights are {weights_dtype} (the kernel reads float32 or bfloat16)"
    if not 1 <= k <= _MAX_ROUTES:
        return False, f"k = {k} is outside [1, {_MAX_ROUTES}]"
    if hidden % _WIDTH_MULTIPLE != 0 or hidden > _MAX_WIDTH:
        return False, f"D = {hidden} is not a multiple of {_WIDTH_MULTIPLE} in [{_WIDTH_MULTIPLE}, {_MAX_WIDTH}]"
    # The device as the finalize's gate reads it (a described GPU, a missing cuda:N), then the finalize's own plan
    # on it (T, D and the device's declines): the fused kernel is that finalize with the exchange inside.
    info, why = gate_device(device)
    if info is None:
        return False, why
    decline = finalize_decline(tokens, k, hidden, (rows_dtype, weights_dtype), info)
    return (False, decline) if decline else (True, "")
