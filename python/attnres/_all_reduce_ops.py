"""torch.ops.attnres.{all_reduce, all_reduce_attn_res_add_rmsnorm, moe_finalize_all_reduce} and their `.out`
overloads (PyTorch's out= convention: the outputs are keyword-only mutated arguments, nothing is returned).

The communicator travels as `comm`, the handle attnres.comm_registry gave it at creation, beside its `state`
tensor (mutated: the generation advances on CUDA). No address crosses the op boundary: the library looks the
handle up in its registry of this process's communicators and checks `state` against the record (real calls:
its address too), so a made-up or closed handle, or another tensor as state, is refused with ArgumentError
before any kernel sees an address. The fake implementations look the same record up (shape checks only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _C
from ._attn_ops import check_bank_storage, fake_check
from ._registry import define, note_writes
from ._tensors import ABSENT, _hint, c_dtype, fake_refs, ref, stream_of
from .options import DEFAULT as _DEFAULT_OPTIONS, Options

KERNELS = ("auto", "cpu", "single_cta")
SITES = ("add", "add2")
_SPLIT = _DEFAULT_OPTIONS.split_max_tokens
_FAKE_STATE_ADDRESS = 1 << 39  # below fake_refs' synthetic addresses ((i + 1) << 40): distinct from them


# --------------------------------------------------------------------------------------------- shared parts
def _comm(op: str, handle: int, state: Tensor) -> _C.CommRef:
    return _C.all_reduce_registered(op, int(handle), ref(state, op, "state"))


def _fake_comm(op: str, handle: int, state: Tensor) -> _C.CommRef:
    """The registered communicator of a fake call: the state's dtype, shape, strides and device are checked, its
    address is not (a fake tensor has none)."""
    dims = [_hint(d) for d in (*state.shape, *state.stride())]
    if None in dims or state.dim() != 1:
        dims = [0, 0]  # the library's state rule rejects it, naming the shape
    cuda = state.device.type == "cuda"
    s = _C.TensorRef(_FAKE_STATE_ADDRESS, c_dtype(state.dtype), _C.DeviceType.cuda if cuda else _C.DeviceType.cpu,
                     (state.device.index or 0) if cuda else 0, dims[:len(dims) // 2], dims[len(dims) // 2:])
    return _C.all_reduce_registered(op, int(handle), s, check_address=False)


def ar_options(pdl: bool, early_trigger: bool, kernel: str, op: str) -> _C.AllReduceOptions:
    if kernel not in KERNELS:
        raise _C.ArgumentError(f"{op}: kernel must be one of {KERNELS}, got {kernel!r}")
    o = _C.AllReduceOptions()
    o.pdl, o.early_trigger, o.kernel = bool(pdl), bool(early_trigger), getattr(_C.KernelKind, kernel)
    return o


def rows_like(t: Tensor, width: int) -> Tensor:
    T = t.shape[-2] if t.dim() >= 2 else 0
    return torch.empty((T, width), dtype=torch.bfloat16, device=t.device)


def check_site(op: str, site: str, layer_residual_add) -> None:
    if site not in SITES:
        raise _C.ArgumentError(f"{op}: site must be one of {SITES}, got {site!r}")
    if site == "add" and layer_residual_add is not None:
        raise _C.ArgumentError(f"{op}: layer_residual_add is the reduced partial at site add; pass None")
    if site == "add2" and layer_residual_add is None:
        raise _C.ArgumentError(f"{op}: site add2 requires layer_residual_add (the first addend, e.g. routed)")


def _validate_fake_all_reduce(op: str, comm: _C.CommRef, refs: dict | None, input_name: str,
                              output: Tensor | None, output_name: str) -> None:
    """The library's all-reduce rules on a fake call's refs (the reduction's input is refs[input_name])."""
    if refs is None:
        return
    args = _C.AllReduceArgs()
    args.comm, args.input = comm, refs[input_name]
    args.gathered = refs.get("gathered", ABSENT)
    args.output = refs.get(output_name, ABSENT) if output is not None else ABSENT
    _C.all_reduce_validate(args, require_output=False, read_data=False)


# ------------------------------------------------------------------------------------------- all_reduce
_AR_IN = ('Tensor input, Tensor? gathered, Tensor(a!) state, int comm, bool pdl=True, bool early_trigger=True, '
          'str force_kernel="auto"')


def _all_reduce(input, gathered, state, comm, pdl, early_trigger, force_kernel, reduced) -> None:
    op = "all_reduce"
    options = ar_options(pdl, early_trigger, force_kernel, op)
    args = _C.AllReduceArgs()
    args.comm = _comm(op, comm, state)
    args.input = ref(input, op, "input")
    args.gathered = ref(gathered, op, "gathered")
    args.output = ref(reduced, op, "reduced")
    args.stream = stream_of(input)
    _C.all_reduce(args, options)
    note_writes(state)


def _all_reduce_real(input, gathered, state, comm, pdl=True, early_trigger=True, force_kernel="auto"):
    reduced = rows_like(input, _comm("all_reduce", comm, state).width)
    _all_reduce(input, gathered, state, comm, pdl, early_trigger, force_kernel, reduced)
    return reduced


def _all_reduce_real_out(input, gathered, state, comm, pdl=True, early_trigger=True, force_kernel="auto", *,
                         reduced):
    _all_reduce(input, gathered, state, comm, pdl, early_trigger, force_kernel, reduced)
    note_writes(reduced)


def _all_reduce_fake_check(input, gathered, state, comm, pdl, early_trigger, force_kernel, reduced):
    op = "all_reduce"
    ar_options(pdl, early_trigger, force_kernel, op)
    c = _fake_comm(op, comm, state)
    refs = fake_refs(op, {"input": input, "gathered": gathered, "reduced": reduced, "state": state})
    _validate_fake_all_reduce(op, c, refs, "input", reduced, "reduced")
    return c


def _all_reduce_fake(input, gathered, state, comm, pdl=True, early_trigger=True, force_kernel="auto"):
    c = _all_reduce_fake_check(input, gathered, state, comm, pdl, early_trigger, force_kernel, None)
    return rows_like(input, c.width)


def _all_reduce_fake_out(input, gathered, state, comm, pdl=True, early_trigger=True, force_kernel="auto", *,
                         reduced):
    _all_reduce_fake_check(input, gathered, state, comm, pdl, early_trigger, force_kernel, reduced)


define("all_reduce", f"({_AR_IN}) -> Tensor", _all_reduce_real, _all_reduce_fake, mutates=False,
       public_name="all_reduce")
define("all_reduce.out", f"({_AR_IN}, *, Tensor(b!) reduced) -> ()", _all_reduce_real_out, _all_reduce_fake_out,
       mutates=True, public_name="all_reduce")


# ------------------------------------------------------------------------- all_reduce + attn_res_add_rmsnorm
_SITE_IN = ("Tensor partial, Tensor? gathered, Tensor(a!) state, int comm, str site, Tensor layer_residual, "
            "Tensor? layer_residual_add, Tensor(b!) bank, int num_snapshots, int snapshot_slot, Tensor res_weight, "
            "Tensor rms_weight, Tensor norm_weight, float rms_eps, float norm_eps, bool return_mixture=False, "
            f'str topology="auto", int split_max_tokens={_SPLIT}, bool pdl=True, str force_kernel="auto", '
            "int cluster=0, bool early_trigger=True")
_SITE_OUTPUTS = ("reduced", "updated", "output", "mixture")


def site_outputs(layer_residual: Tensor, width: int, return_mixture: bool) -> dict:
    """{reduced [T, width], updated, output [T, H], mixture [T, H] or None}, real or fake."""
    reduced = rows_like(layer_residual, width)
    updated = rows_like(layer_residual, layer_residual.shape[-1] if layer_residual.dim() == 2 else 0)
    return {"reduced": reduced, "updated": updated, "output": torch.empty_like(updated),
            "mixture": torch.empty_like(updated) if return_mixture else None}


def _site(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
          snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, topology,
          split_max_tokens, pdl, force_kernel, cluster, early_trigger, outs: dict) -> None:
    op = "all_reduce_attn_res_add_rmsnorm"
    check_site(op, site, layer_residual_add)
    options = ar_options(pdl, early_trigger, "cpu" if force_kernel == "cpu" else "auto", op)
    if return_mixture != (outs["mixture"] is not None):
        raise _C.ArgumentError(f"{op}: mixture is produced exactly when return_mixture is True")
    ar = _C.AllReduceArgs()
    ar.comm = _comm(op, comm, state)
    ar.input = ref(partial, op, "partial")
    ar.gathered = ref(gathered, op, "gathered")
    ar.output = ref(outs["reduced"], op, "reduced")
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
    attn.output = ref(outs["output"], op, "output")
    attn.updated = ref(outs["updated"], op, "updated")
    attn.mixture = ref(outs["mixture"], op, "mixture")
    attn.stream = stream_of(layer_residual)
    attn_options = Options.from_args(topology, split_max_tokens, pdl, force_kernel, cluster).to_c()
    _C.all_reduce_attn_res_add_rmsnorm(ar, getattr(_C.AllReduceSite, site), attn, options, attn_options)
    note_writes(state, bank)


def _site_real(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
               snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture=False,
               topology="auto", split_max_tokens=_SPLIT, pdl=True, force_kernel="auto", cluster=0,
               early_trigger=True):
    width = _comm("all_reduce_attn_res_add_rmsnorm", comm, state).width
    outs = site_outputs(layer_residual, width, return_mixture)
    _site(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
          snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, topology,
          split_max_tokens, pdl, force_kernel, cluster, early_trigger, outs)
    mixture = outs["mixture"] if return_mixture else outs["updated"].new_empty((0,))
    return outs["reduced"], outs["updated"], outs["output"], mixture


def _site_real_out(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
                   snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture=False,
                   topology="auto", split_max_tokens=_SPLIT, pdl=True, force_kernel="auto", cluster=0,
                   early_trigger=True, *, reduced, updated, output, mixture=None):
    outs = {"reduced": reduced, "updated": updated, "output": output, "mixture": mixture}
    _site(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
          snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, topology,
          split_max_tokens, pdl, force_kernel, cluster, early_trigger, outs)
    note_writes(reduced, updated, output, mixture)


def _site_fake_check(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
                     snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, pdl,
                     force_kernel, early_trigger, outs: dict | None) -> dict:
    op = "all_reduce_attn_res_add_rmsnorm"
    check_site(op, site, layer_residual_add)
    ar_options(pdl, early_trigger, "cpu" if force_kernel == "cpu" else "auto", op)
    c = _fake_comm(op, comm, state)
    given = outs is not None
    if outs is None:
        outs = site_outputs(layer_residual, c.width, return_mixture)
    elif return_mixture != (outs["mixture"] is not None):
        raise _C.ArgumentError(f"{op}: mixture is produced exactly when return_mixture is True")
    written = {k: v for k, v in outs.items() if given and v is not None}
    refs = fake_refs(op, {"partial": partial, "gathered": gathered, "state": state, "layer_residual": layer_residual,
                          "layer_residual_add": layer_residual_add, "bank": bank, "res_weight": res_weight,
                          "rms_weight": rms_weight, "norm_weight": norm_weight, **written})
    _validate_fake_all_reduce(op, c, refs, "partial", outs["reduced"] if given else None, "reduced")
    # The library's rules of the attention half, the reduced sum as the site's addend.
    addends = {"layer_residual_add": outs["reduced"]} if site == "add" else \
        {"layer_residual_add": layer_residual_add, "layer_residual_add2": outs["reduced"]}
    attn_outs = {k: outs[k] for k in ("updated", "output", "mixture")} if given else {}
    fake_check(op, _C.AttnResOp.attn_res_add_rmsnorm, num_snapshots if bank.dim() == 3 else _C.NOT_SNAPSHOT,
               snapshot_slot, rms_eps, norm_eps, layer_residual=layer_residual, block_residual=bank,
               res_weight=res_weight, rms_weight=rms_weight, norm_weight=norm_weight, **addends, **attn_outs)
    return outs


def _site_fake(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
               snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture=False,
               topology="auto", split_max_tokens=_SPLIT, pdl=True, force_kernel="auto", cluster=0,
               early_trigger=True):
    outs = _site_fake_check(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank,
                            num_snapshots, snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps,
                            return_mixture, pdl, force_kernel, early_trigger, None)
    mixture = outs["mixture"] if return_mixture else outs["updated"].new_empty((0,))
    return outs["reduced"], outs["updated"], outs["output"], mixture


def _site_fake_out(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
                   snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture=False,
                   topology="auto", split_max_tokens=_SPLIT, pdl=True, force_kernel="auto", cluster=0,
                   early_trigger=True, *, reduced, updated, output, mixture=None):
    _site_fake_check(partial, gathered, state, comm, site, layer_residual, layer_residual_add, bank, num_snapshots,
                     snapshot_slot, res_weight, rms_weight, norm_weight, rms_eps, norm_eps, return_mixture, pdl,
                     force_kernel, early_trigger,
                     {"reduced": reduced, "updated": updated, "output": output, "mixture": mixture})


define("all_reduce_attn_res_add_rmsnorm", f"({_SITE_IN}) -> (Tensor, Tensor, Tensor, Tensor)", _site_real,
       _site_fake, mutates=True, public_name="all_reduce_attn_res_add_rmsnorm")
define("all_reduce_attn_res_add_rmsnorm.out",
       f"({_SITE_IN}, *, Tensor(c!) reduced, Tensor(d!) updated, Tensor(e!) output, Tensor(f!)? mixture=None) -> ()",
       _site_real_out, _site_fake_out, mutates=True, public_name="all_reduce_attn_res_add_rmsnorm")


# ------------------------------------------------------------------------- moe_finalize + all_reduce + norm
_MOE_IN = ("Tensor rows, Tensor weights, Tensor index, Tensor norm_weight, Tensor? gathered, Tensor(a!) state, "
           'int comm, float eps, float scale, bool pdl=True, str force_kernel="auto"')


def moe_outputs(rows: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """(reduced, output), both [T, D] bf16, real or fake."""
    T = index.shape[0] if index.dim() == 2 else 0
    D = rows.shape[1] if rows.dim() == 2 else 0
    output = torch.empty((T, D), dtype=torch.bfloat16, device=rows.device)
    return torch.empty_like(output), output


def _moe_args(op, rows, weights, index, norm_weight, eps, scale, refs=None) -> _C.MoeFinalizeArgs:
    f = _C.MoeFinalizeArgs()
    for key, t in (("rows", rows), ("weights", weights), ("index", index), ("norm_weight", norm_weight)):
        setattr(f, key, refs[key] if refs is not None else ref(t, op, key))
    f.eps, f.scale = float(eps), float(scale)
    return f


def _moe(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl, force_kernel, reduced, output):
    op = "moe_finalize_all_reduce"
    options = ar_options(pdl, True, force_kernel, op)
    a = _C.MoeFinalizeAllReduceArgs()
    f = _moe_args(op, rows, weights, index, norm_weight, eps, scale)
    f.output = ref(output, op, "output")
    f.stream = stream_of(rows)
    a.finalize = f
    a.reduced = ref(reduced, op, "reduced")
    a.gathered = ref(gathered, op, "gathered")
    a.comm = _comm(op, comm, state)
    _C.moe_finalize_all_reduce(a, options)
    note_writes(state)


def _moe_real(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl=True, force_kernel="auto"):
    reduced, output = moe_outputs(rows, index)
    _moe(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl, force_kernel, reduced, output)
    return reduced, output


def _moe_real_out(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl=True,
                  force_kernel="auto", *, reduced, output):
    _moe(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl, force_kernel, reduced, output)
    note_writes(reduced, output)


def _moe_fake_check(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl, force_kernel,
                    reduced, output) -> None:
    op = "moe_finalize_all_reduce"
    ar_options(pdl, True, force_kernel, op)
    c = _fake_comm(op, comm, state)
    refs = fake_refs(op, {"rows": rows, "weights": weights, "index": index, "norm_weight": norm_weight,
                          "gathered": gathered, "reduced": reduced, "output": output, "state": state})
    if refs is None:
        return
    a = _C.MoeFinalizeAllReduceArgs()
    f = _moe_args(op, rows, weights, index, norm_weight, eps, scale, refs)
    f.output = refs.get("output", ABSENT)
    a.finalize, a.comm = f, c
    a.gathered = refs.get("gathered", ABSENT)
    a.reduced = refs.get("reduced", ABSENT)
    _C.moe_finalize_all_reduce_validate(a, require_output=False, read_data=False)


def _moe_fake(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl=True, force_kernel="auto"):
    _moe_fake_check(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl, force_kernel, None,
                    None)
    return moe_outputs(rows, index)


def _moe_fake_out(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl=True,
                  force_kernel="auto", *, reduced, output):
    _moe_fake_check(rows, weights, index, norm_weight, gathered, state, comm, eps, scale, pdl, force_kernel,
                    reduced, output)


define("moe_finalize_all_reduce", f"({_MOE_IN}) -> (Tensor, Tensor)", _moe_real, _moe_fake, mutates=False,
       public_name="moe_finalize_all_reduce")
define("moe_finalize_all_reduce.out", f"({_MOE_IN}, *, Tensor(b!) reduced, Tensor(c!) output) -> ()",
       _moe_real_out, _moe_fake_out, mutates=True, public_name="moe_finalize_all_reduce")
