"""The one-shot all-reduce of tensor-parallel decode and the ops fused with it (docs/ops/all_reduce.md).

* `all_reduce(comm, partial)` — reduced = bf16(fp32 sum of the W ranks' bf16 partials in rank order 0..W-1),
  every rank the same bits; a real -0.0 in a partial is read as +0.0.
* `all_reduce_attn_res_add_rmsnorm(comm, partial, prefix, bank, ...)` — the all-reduce into the addend of
  attn_res_add_rmsnorm (site "add": the attention partial; site "add2": the shared-expert partial with the
  routed part as the first addend, the MoE-tail fold), then that op: the one-shot all-reduce kernel, then the
  plain op, joined by PDL.
* `moe_finalize_all_reduce(comm, rows, weights, index, norm_weight, ...)` — the local-route finalize, the
  all-reduce of the latent and the two-rounding latent RMSNorm in one kernel.

`comm` is an attnres.tp.Communicator (allocated once, before any graph capture). On CUDA the kernels exchange
the partials through the communicator's buffers; on the CPU the communicator gathers every rank's partial
(torch.distributed over gloo, or the in-process world) and the CPU backend reduces them in rank order.

The torch.ops.attnres.* ops below carry the communicator as its state tensor (mutated: the generation
advances) and its buffer addresses; the buffers themselves are written through those addresses.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from . import _C
from ._attn_ops import check_bank_storage, fake_check
from .ops import check_bank_in_storage
from ._registry import custom_op, note_writes
from ._tensors import ABSENT, _hint, fake_refs, ref, stream_of
from .moe_gate import finalize_decline, gate_device, gate_dtypes, token_gate
from .options import DEFAULT as _DEFAULT_OPTIONS, Options

KERNELS = ("auto", "cpu", "single_cta")
SITES = ("add", "add2")
_SPLIT_MAX_TOKENS = _DEFAULT_OPTIONS.split_max_tokens


def _comm_ref(state: Tensor, buffers: List[int], world_size: int, rank: int, capacity: int, width: int,
              timeout_ns: int, state_address: int | None = None) -> _C.CommRef:
    """state_address: the state's address in a fake call (a synthetic one; a fake tensor has no data)."""
    c = _C.CommRef()
    c.world_size, c.rank, c.capacity, c.width, c.timeout_ns = world_size, rank, capacity, width, timeout_ns
    dev = state.device
    if dev.type == "cuda":
        c.device = [1, dev.index if dev.index is not None else torch.cuda.current_device()]
        c.state = state.data_ptr() if state_address is None else state_address
        c.buffers = list(buffers)
    else:
        c.device = [0, 0]  # DeviceType.cpu
    return c


def _ar_options(pdl: bool, early_trigger: bool, kernel: str, op: str) -> _C.AllReduceOptions:
    if kernel not in KERNELS:
        raise ValueError(f"{op}: kernel must be one of {KERNELS}, got {kernel!r}")
    o = _C.AllReduceOptions()
    o.pdl, o.early_trigger, o.kernel = bool(pdl), bool(early_trigger), getattr(_C.KernelKind, kernel)
    return o


def _rows_like(t: Tensor, width: int) -> Tensor:
    T = t.shape[-2] if t.dim() >= 2 else 0
    return torch.empty((T, width), dtype=torch.bfloat16, device=t.device)


def _fake_comm(op: str, state: Tensor, comm_args: tuple, **tensors) -> tuple[dict, _C.CommRef] | None:
    """A fake call's TensorRefs (fake_refs: a meta tensor among real ones, or two devices, raise) and its
    communicator, the state at its synthetic address. None when a size has no example value."""
    refs = fake_refs(op, {**tensors, "state": state})
    if refs is None:
        return None
    return refs, _comm_ref(state, *comm_args, state_address=refs.pop("state").data)


def _validate_fake_all_reduce(refs: dict, comm: _C.CommRef, input_name: str) -> None:
    """The library's all-reduce rules on a fake call's refs (the reduction's input is refs[input_name])."""
    args = _C.AllReduceArgs()
    args.comm, args.input = comm, refs[input_name]
    args.gathered = refs.get("gathered", ABSENT)
    _C.all_reduce_validate(args, require_output=False)


def _check_site(op: str, site: str, layer_residual_add) -> None:
    if site not in SITES:
        raise _C.ArgumentError(f"{op}: site must be one of {SITES}, got {site!r}")
    if site == "add" and layer_residual_add is not None:
        raise _C.ArgumentError(f"{op}: layer_residual_add is the reduced partial at site add; pass None")
    if site == "add2" and layer_residual_add is None:
        raise _C.ArgumentError(f"{op}: site add2 requires layer_residual_add (the first addend, e.g. routed)")


# ------------------------------------------------------------------------------------------- all_reduce
@custom_op("all_reduce", mutates_args=("state",))
def all_reduce_op(
    input: Tensor,
    gathered: Optional[Tensor],  # noqa: UP045
    state: Tensor,
    buffers: List[int],
    world_size: int,
    rank: int,
    capacity: int,
    width: int,
    timeout_ns: int,
    pdl: bool = True,
    early_trigger: bool = True,
    force_kernel: str = "auto",
) -> Tensor:
    op = "all_reduce"
    output = _rows_like(input, width)
    args = _C.AllReduceArgs()
    args.comm = _comm_ref(state, buffers, world_size, rank, capacity, width, timeout_ns)
    args.input = ref(input, op, "input")
    args.gathered = ref(gathered, op, "gathered")
    args.output = ref(output, op, "output")
    args.stream = stream_of(input)
    options = _ar_options(pdl, early_trigger, force_kernel, op)
    note_writes(state)
    _C.all_reduce(args, options)
    return output


@all_reduce_op.register_fake
def _(input, gathered, state, buffers, world_size, rank, capacity, width, timeout_ns, pdl=True, early_trigger=True,
      force_kernel="auto"):
    op = "all_reduce"
    _ar_options(pdl, early_trigger, force_kernel, op)
    checked = _fake_comm(op, state, (buffers, world_size, rank, capacity, width, timeout_ns), input=input,
                         gathered=gathered)
    if checked is not None:
        _validate_fake_all_reduce(*checked, "input")
    return _rows_like(input, width)


# ------------------------------------------------------------------------- all_reduce + attn_res_add_rmsnorm
@custom_op("all_reduce_attn_res_add_rmsnorm", mutates_args=("state", "bank"))
def all_reduce_attn_res_add_rmsnorm_op(
    partial: Tensor,
    gathered: Optional[Tensor],  # noqa: UP045
    state: Tensor,
    buffers: List[int],
    world_size: int,
    rank: int,
    capacity: int,
    width: int,
    timeout_ns: int,
    site: str,
    layer_residual: Tensor,
    layer_residual_add: Optional[Tensor],  # noqa: UP045  (site add2: the first addend, e.g. routed)
    bank: Tensor,
    num_snapshots: int,
    snapshot_slot: int,
    res_weight: Tensor,
    rms_weight: Tensor,
    norm_weight: Tensor,
    rms_eps: float,
    norm_eps: float,
    return_mixture: bool = False,
    topology: str = "auto",
    split_max_tokens: int = _SPLIT_MAX_TOKENS,
    pdl: bool = True,
    force_kernel: str = "auto",
    cluster: int = 0,
    early_trigger: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    op = "all_reduce_attn_res_add_rmsnorm"
    _check_site(op, site, layer_residual_add)
    ar_options = _ar_options(pdl, early_trigger, "cpu" if force_kernel == "cpu" else "auto", op)
    reduced, updated, output, mixture = _fused_outputs(layer_residual, width, return_mixture)
    ar = _C.AllReduceArgs()
    ar.comm = _comm_ref(state, buffers, world_size, rank, capacity, width, timeout_ns)
    ar.input = ref(partial, op, "partial")
    ar.gathered = ref(gathered, op, "gathered")
    ar.output = ref(reduced, op, "reduced")
    ar.stream = stream_of(partial)
    attn = _C.AttnResArgs()
    attn.layer_residual = ref(layer_residual, op, "layer_residual")
    if site == "add":
        attn.layer_residual_add = ar.output
    else:
        attn.layer_residual_add = ref(layer_residual_add, op, "layer_residual_add")
        attn.layer_residual_add2 = ar.output
    attn.block_residual = ref(bank, op, "block_residual")
    attn.snapshot_slot = snapshot_slot
    if bank.dim() == 3:
        check_bank_storage(op, bank, num_snapshots, snapshot_slot)
        _C.attn_res_bank_rows(op, attn, num_snapshots)
    attn.res_weight = ref(res_weight, op, "res_weight")
    attn.rms_weight = ref(rms_weight, op, "rms_weight")
    attn.norm_weight = ref(norm_weight, op, "norm_weight")
    attn.rms_eps, attn.norm_eps = float(rms_eps), float(norm_eps)
    attn.output = ref(output, op, "output")
    attn.updated = ref(updated, op, "updated")
    if return_mixture:
        attn.mixture = ref(mixture, op, "mixture")
    attn.snapshot_slot = snapshot_slot
    attn.stream = stream_of(layer_residual)
    attn_options = Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster).to_c()
    note_writes(state, bank)
    _C.all_reduce_attn_res_add_rmsnorm(ar, getattr(_C.AllReduceSite, site), attn, ar_options, attn_options)
    return reduced, updated, output, mixture


def _fused_outputs(layer_residual: Tensor, width: int, return_mixture: bool):
    """(reduced [T, width], updated, output [T, H], mixture [T, H] or (0,)), real or fake."""
    reduced = _rows_like(layer_residual, width)
    updated = _rows_like(layer_residual, layer_residual.shape[-1] if layer_residual.dim() == 2 else 0)
    output = torch.empty_like(updated)
    mixture = torch.empty_like(updated) if return_mixture else updated.new_empty((0,))
    return reduced, updated, output, mixture


@all_reduce_attn_res_add_rmsnorm_op.register_fake
def _(partial, gathered, state, buffers, world_size, rank, capacity, width, timeout_ns, site, layer_residual,
      layer_residual_add, bank, num_snapshots, snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps,
      return_mixture=False, topology="auto", split_max_tokens=_SPLIT_MAX_TOKENS, pdl=True, force_kernel="auto",
      cluster=0, early_trigger=True):
    op = "all_reduce_attn_res_add_rmsnorm"
    _check_site(op, site, layer_residual_add)
    _ar_options(pdl, early_trigger, "cpu" if force_kernel == "cpu" else "auto", op)
    checked = _fake_comm(op, state, (buffers, world_size, rank, capacity, width, timeout_ns), partial=partial,
                         gathered=gathered, layer_residual=layer_residual, layer_residual_add=layer_residual_add,
                         bank=bank, res_weight=res_weight, rms_weight=rms_weight, norm_weight=norm_weight)
    outputs = _fused_outputs(layer_residual, width, return_mixture)
    if checked is not None:
        _validate_fake_all_reduce(*checked, "partial")
    # The library's rules of the attention half, the reduced sum as the site's addend.
    addends = {"layer_residual_add": outputs[0]} if site == "add" else \
        {"layer_residual_add": layer_residual_add, "layer_residual_add2": outputs[0]}
    fake_check(op, _C.AttnResOp.attn_res_add_rmsnorm, num_snapshots if bank.dim() == 3 else _C.NOT_SNAPSHOT, snapshot_slot,
               rms_eps, norm_eps, layer_residual=layer_residual, block_residual=bank, res_weight=res_weight,
               rms_weight=rms_weight, norm_weight=norm_weight, **addends)
    return outputs


# ------------------------------------------------------------------------- moe_finalize + all_reduce + norm
def _moe_outputs(rows: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """(reduced, output), both [T, D] bf16, real or fake."""
    T = index.shape[0] if index.dim() == 2 else 0
    D = rows.shape[1] if rows.dim() == 2 else 0
    output = torch.empty((T, D), dtype=torch.bfloat16, device=rows.device)
    return torch.empty_like(output), output


@custom_op("moe_finalize_all_reduce", mutates_args=("state",))
def moe_finalize_all_reduce_op(
    rows: Tensor,
    weights: Tensor,
    index: Tensor,
    norm_weight: Tensor,
    gathered: Optional[Tensor],  # noqa: UP045
    state: Tensor,
    buffers: List[int],
    world_size: int,
    rank: int,
    capacity: int,
    width: int,
    timeout_ns: int,
    eps: float,
    scale: float,
    pdl: bool = True,
    force_kernel: str = "auto",
) -> tuple[Tensor, Tensor]:
    op = "moe_finalize_all_reduce"
    reduced, output = _moe_outputs(rows, index)
    a = _C.MoeFinalizeAllReduceArgs()
    f = _C.MoeFinalizeArgs()
    f.rows, f.weights, f.index = ref(rows, op, "rows"), ref(weights, op, "weights"), ref(index, op, "index")
    f.norm_weight = ref(norm_weight, op, "norm_weight")
    f.eps, f.scale = float(eps), float(scale)
    f.output = ref(output, op, "output")
    f.stream = stream_of(rows)
    a.finalize = f
    a.reduced = ref(reduced, op, "reduced")
    a.gathered = ref(gathered, op, "gathered")
    a.comm = _comm_ref(state, buffers, world_size, rank, capacity, width, timeout_ns)
    options = _ar_options(pdl, True, force_kernel, op)
    note_writes(state)
    _C.moe_finalize_all_reduce(a, options)
    return reduced, output


@moe_finalize_all_reduce_op.register_fake
def _(rows, weights, index, norm_weight, gathered, state, buffers, world_size, rank, capacity, width, timeout_ns,
      eps, scale, pdl=True, force_kernel="auto"):
    op = "moe_finalize_all_reduce"
    _ar_options(pdl, True, force_kernel, op)
    checked = _fake_comm(op, state, (buffers, world_size, rank, capacity, width, timeout_ns), rows=rows,
                         weights=weights, index=index, norm_weight=norm_weight, gathered=gathered)
    if checked is not None:
        refs, comm = checked
        f = _C.MoeFinalizeArgs()
        f.rows, f.weights, f.index, f.norm_weight = refs["rows"], refs["weights"], refs["index"], refs["norm_weight"]
        f.eps, f.scale = float(eps), float(scale)
        a = _C.MoeFinalizeAllReduceArgs()
        a.finalize, a.comm = f, comm
        a.gathered = refs.get("gathered", ABSENT)
        _C.moe_finalize_all_reduce_validate(a, require_output=False, read_data=False)
    return _moe_outputs(rows, index)


# -------------------------------------------------------------------------------------- Python wrappers
def all_reduce(comm, partial: Tensor, *, pdl: bool = True, early_trigger: bool = True, kernel: str = "auto") -> Tensor:
    """This rank's share of the all-reduce of `partial` [T, D] bf16 over comm's world: the reduced [T, D]."""
    gathered = comm.gather(partial, "all_reduce")
    return torch.ops.attnres.all_reduce(partial, gathered, comm.state, comm.buffer_addresses, *comm.op_args(),
                                        bool(pdl), bool(early_trigger), kernel)


def all_reduce_attn_res_add_rmsnorm(comm, partial: Tensor, layer_residual: Tensor, block_residual: Tensor,
                                    res_weight: Tensor, rms_weight: Tensor, norm_weight: Tensor, rms_eps: float,
                                    norm_eps: float, *, site: str = "add", layer_residual_add: Tensor | None = None,
                                    return_mixture: bool = False, snapshot_slot: int | None = None,
                                    options: Options | None = None, early_trigger: bool = True):
    """(reduced, updated, output[, mixture]). Site "add": reduced = all_reduce(partial) is the addend,
    updated = prefix + reduced. Site "add2": updated = prefix + (layer_residual_add + reduced), the fold.
    Then output = RMSNorm(AttnRes(bank, updated)) exactly as attn_res_add_rmsnorm on the same addends."""
    op = "all_reduce_attn_res_add_rmsnorm"
    opts = options or _DEFAULT_OPTIONS
    gathered = comm.gather(partial, op)
    block = block_residual
    K = block.shape[0] if block.dim() == 3 else 0
    slot = -1
    bank = block
    if snapshot_slot is not None:
        slot = operator.index(snapshot_slot)
        if slot < 0:
            raise _C.ArgumentError(f"{op}: snapshot_slot must be None or a row index >= K, got {slot}")
        if block.dim() == 3 and min(block.stride()) >= 0:
            check_bank_in_storage(block, max(K, slot + 1), op)
            bank = block.as_strided((max(K, slot + 1), *block.shape[1:]), block.stride())
    reduced, updated, output, mixture = torch.ops.attnres.all_reduce_attn_res_add_rmsnorm(
        partial, gathered, comm.state, comm.buffer_addresses, *comm.op_args(), site, layer_residual,
        layer_residual_add, bank, K, slot, res_weight, rms_weight, norm_weight, float(rms_eps), float(norm_eps),
        bool(return_mixture), *opts.as_args(), bool(early_trigger))
    result = (reduced, updated, output)
    return result + (mixture,) if return_mixture else result


def moe_finalize_all_reduce(comm, rows: Tensor, weights: Tensor, index: Tensor, norm_weight: Tensor, *, eps: float,
                            scale: float = 1.0, pdl: bool = True, kernel: str = "auto") -> tuple[Tensor, Tensor]:
    """(reduced latent, normed latent) [T, D]: this rank's local-route finalize (moe_finalize without shared and
    norm), all-reduced over comm's world, then moe_finalize's two-rounding RMSNorm."""
    op = "moe_finalize_all_reduce"
    gathered = None
    if comm.device.type == "cpu":
        # The CPU backend reduces gathered partials: each rank's is moe_finalize without the norm.
        from .moe import moe_finalize

        comm.check_open(op)
        partial = moe_finalize(rows, weights, index, eps=0.0, scale=scale, kernel="cpu")
        gathered = comm.gather(partial, op)
    return torch.ops.attnres.moe_finalize_all_reduce(rows, weights, index, norm_weight, gathered, comm.state,
                                                     comm.buffer_addresses, *comm.op_args(), float(eps), float(scale),
                                                     bool(pdl), kernel)


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
