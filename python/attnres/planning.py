"""attnres.plan(): which kernel a call would take, or why it is declined, without running it.

The plan is the library's own pure function of (device, op, T, N, H, outputs, options); the model layer
uses it to decide between the fused path and materializing first (e.g. the persistent kernel declines
layer_residual_add2)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from . import _C
from .options import DEFAULT, Options

OPS = ("attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent")
FP8_MODES = (None, "per_token", "block128")


@dataclass(frozen=True)
class PlanInfo:
    kernel: str | None  # "cpu", "single_cta", "split_k", "persistent"; None when declined
    decline: str | None  # the reason, when declined
    cluster: int = 1
    threads: int = 0
    max_candidates: int = 0
    pdl: bool = False
    # persistent kernel: grid, blocks per SM, 16-byte vectors per consumer thread, ring slots, passes over each
    # row, and the dynamic shared memory of a block; single_cta: smem_bytes > 0 when it streams (its blocks,
    # as many as are resident, loop over the tokens with the next slots - 1 tokens' rows prefetched into that
    # memory, `slots` token buffers, and each thread owns `vectors` 16-byte slices of a row); the token-block
    # single_cta: one block per token, `blocks_per_sm` resident per SM, `vectors` slices per thread
    blocks: int = 0
    blocks_per_sm: int = 0
    vectors: int = 0
    slots: int = 0
    passes: int = 0
    smem_bytes: int = 0
    # The kernel family: "per_token" (split_k, or single_cta one token per block), "stream" (the streaming
    # single_cta), "token_blocks" (the token-block single_cta), "persistent", "cpu"; "none" when declined.
    # decline_code: why, as a name of _C.DeclineCode ("none" when accepted); callers branch on these, never on the
    # sentence.
    route: str = "none"
    decline_code: str = "none"

    @property
    def accepted(self) -> bool:
        return self.decline is None


def plan_info(p: _C.Plan) -> PlanInfo:
    """The PlanInfo of a C++ plan (attnres.plan, the tuning modules and the launch record report through it)."""
    route, code = _C.route_name(p.route), _C.decline_code_name(p.decline_code)
    if not p.accepted:
        return PlanInfo(kernel=None, decline=p.decline, route=route, decline_code=code)
    persistent = p.kernel == _C.KernelKind.persistent
    return PlanInfo(kernel=_C.kernel_name(p.kernel), decline=None, cluster=p.cluster, threads=p.threads,
                    max_candidates=p.max_candidates, pdl=p.pdl, route=route, decline_code=code,
                    **({"blocks": p.blocks, "blocks_per_sm": p.blocks_per_sm, "vectors": p.vectors,
                        "slots": p.slots, "passes": p.passes, "smem_bytes": p.smem_bytes} if persistent else
                       {"smem_bytes": p.smem_bytes, "slots": p.slots, "blocks_per_sm": p.blocks_per_sm,
                        "vectors": p.vectors if p.smem_bytes > 0 or p.route == _C.Route.token_blocks else 0}))


_DESCRIBED = ("h100", "h200")
_PROPERTIES = ("cc_major", "cc_minor", "sm_count", "shared_memory_per_block_optin")
_DEVICE_FORMS = ("'cpu', 'cuda', 'cuda:N', a torch.device (or a CUDA index), a described GPU 'h100' or 'h200' "
                 "(any case), or a dict of DeviceInfo properties (cc_major, cc_minor, sm_count, "
                 "shared_memory_per_block_optin)")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _int(name: str, value, low: int = _INT64[0], high: int = _INT64[1]) -> int:
    """`value` as an int in [low, high] (an int or an integer type with __index__; a bool is not a count), else
    ArgumentError naming the argument."""
    if isinstance(value, bool):  # numpy's bools have no __index__: refused below
        raise _C.ArgumentError(f"attnres.plan: {name} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise _C.ArgumentError(f"attnres.plan: {name} must be an int, got {value!r}") from None
    if not low <= v <= high:
        raise _C.ArgumentError(f"attnres.plan: {name} must be in [{low}, {high}], got {v}")
    return v


def _described(props) -> _C.DeviceInfo:
    """A DeviceInfo from explicit properties: a dict or an object with cc_major, cc_minor, sm_count and
    shared_memory_per_block_optin (name optional), taken as cuda:0 of a build with the CUDA backend."""
    get = props.get if isinstance(props, dict) else (lambda key, default=None: getattr(props, key, default))
    d = _C.DeviceInfo()
    d.device_type, d.device_index, d.cuda_backend = _C.DeviceType.cuda, 0, True
    for key in _PROPERTIES:
        value = get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _C.ArgumentError(f"attnres.plan: the described device's {key} must be an int, got {value!r}")
        setattr(d, key, _int(f"the described device's {key}", value, -(1 << 31), (1 << 31) - 1))
    d.name = str(get("name", "described device"))
    return d


def device_info(device) -> _C.DeviceInfo:
    """The library's DeviceInfo for a torch device (raises ArgumentError for a CUDA index that does not
    exist), or for a described GPU without it: "h100", "h200" (any case), or explicit properties (see
    _described). Anything else raises ArgumentError naming the accepted forms."""
    if isinstance(device, str) and device.strip().lower() in _DESCRIBED:
        return _C.described_device(device.strip().lower())
    if isinstance(device, (dict, _C.DeviceInfo)) or hasattr(device, "sm_count"):
        return _described(device)
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise _C.ArgumentError(f"attnres.plan: device {device!r} is not supported (cpu, cuda, h100, h200 or a "
                               f"property dict): the accepted forms are {_DEVICE_FORMS}")
    try:
        parsed = torch.device(device.strip().lower() if isinstance(device, str) else device)
    except (RuntimeError, ValueError, TypeError):
        raise _C.ArgumentError(f"attnres.plan: device {device!r} is not supported (cpu, cuda, h100, h200 or a "
                               f"property dict): the accepted forms are {_DEVICE_FORMS}") from None
    if parsed.type == "cpu":
        return _C.query_device(_C.DeviceType.cpu, 0)
    if parsed.type == "cuda":
        index = parsed.index
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return _C.query_device(_C.DeviceType.cuda, index)
    raise _C.ArgumentError(f"attnres.plan: device {parsed} is not supported (cpu, cuda, h100, h200 or a property "
                           f"dict): the accepted forms are {_DEVICE_FORMS}")


def _flag(name: str, value) -> bool:
    """A bool (Python's or numpy's), else ArgumentError: bool("no") would silently be True."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if not isinstance(value, bool) and not numpy_bool:
        raise _C.ArgumentError(f"attnres.plan: {name} must be a bool, got {value!r}")
    return bool(value)


def plan(op: str, *, tokens: int, candidates: int, hidden: int, device="cpu", add: bool = False,
         add2: bool = False, tap: bool = False, snapshot: bool = False, diagnostics: bool = False,
         fp8: str | None = None, fp8_pow2_scales: bool = False, options: Options | None = None) -> PlanInfo:
    """The kernel `op` would run for T = tokens, N = candidates, H = hidden on `device` (fp8: None, "per_token"
    or "block128", the FP8 epilogue): a torch device, or a described GPU
    ("h100", "h200", or a dict of cc_major, cc_minor, sm_count, shared_memory_per_block_optin), for which it is
    the plan a CUDA build takes on that GPU, answered without one. On a visible GPU it is the plan a call of that
    shape launches (the occupancy calculator included). Bad arguments raise attnres.ArgumentError."""
    if op not in OPS:
        raise _C.ArgumentError(f"attnres.plan: op must be one of {OPS}, got {op!r}")
    if fp8 not in FP8_MODES:
        raise _C.ArgumentError(f"attnres.plan: fp8 must be one of {FP8_MODES}, got {fp8!r}")
    if options is not None and not callable(getattr(options, "to_c", None)):
        raise _C.ArgumentError(f"attnres.plan: options must be an attnres.Options (anything with to_c()) or None, "
                               f"got {options!r}")
    q = _C.PlanQuery()
    q.op = getattr(_C.AttnResOp, op)
    q.tokens, q.candidates, q.hidden = _int("tokens", tokens), _int("candidates", candidates), _int("hidden", hidden)
    q.add, q.add2, q.tap = _flag("add", add), _flag("add2", add2), _flag("tap", tap)
    q.snapshot, q.diagnostics = _flag("snapshot", snapshot), _flag("diagnostics", diagnostics)
    q.fp8 = getattr(_C.Fp8Scales, fp8 or "none")
    q.fp8_pow2_scales = _flag("fp8_pow2_scales", fp8_pow2_scales)
    return plan_info(_C.plan_query(q, device_info(device), (options or DEFAULT).to_c()))


def backend_info() -> dict:
    """What this build and machine offer: the CUDA backend, the devices it sees, their capability."""
    info = {"version": _C.__version__, "cuda_backend": _C.cuda_backend_built(), "cuda_devices": []}
    for i in range(_C.cuda_device_count()):
        d = _C.query_device(_C.DeviceType.cuda, i)
        info["cuda_devices"].append({"index": i, "name": d.name, "cc": f"{d.cc_major}.{d.cc_minor}", "sms": d.sm_count})
    return info
