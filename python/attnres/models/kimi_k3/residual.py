"""The residual stream's sites: the snapshot bank, the eager and fused paths of an attention-residual site, the
pending MoE tail and its fold into the next consumer, the materialize-first decisions, and the path record.

Everything here calls only the public attnres API (attnres.plan, attn_res, attn_res_rmsnorm,
attn_res_add_rmsnorm). The decisions are pure functions of (settings, T, N, H, device, what the site needs)
and ask attnres.plan whenever the question is "would the library take this call" — they never restate the
library's rules.

Why the fold is bitwise invisible: the fused add2 path runs only where the fold-off chain would run the fused
no-add op on the same kernel; the op's contract makes `attn_res_add_rmsnorm(prefix, routed, add2=shared)`
equal, bit for bit, `attn_res_rmsnorm(prefix + (routed + shared))`. Everywhere else the tail is materialized
first by the same two bf16 adds the eager chain does, and the site then runs exactly the code the fold-off
chain runs.

FP8 outputs (ResidualSettings.fp8): the sites whose output feeds a projection GEMM (pre-attention and pre-MLP)
also return that output quantized to e4m3 with its scales. Where the site's op is a fused attnres op the plan
takes with fp8, the op emits them in the same launch; elsewhere (the plain RMSNorm, the eager path, the TP
all-reduce ops) attnres.fp8.quantize of the bf16 output does, into the same scales layout. Either way they are
the bits quantize(output) gives, and `output` itself is the bits it is without FP8 (the ops' contract), so the
bf16 chain and the fold guarantee are unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
from torch import Tensor

import attnres
from attnres import fp8 as _fp8
from attnres import knobs as _knobs
from attnres.options import TOPOLOGIES, Options

from .config import BANK_LAYOUTS, MAX_CANDIDATES, hidden_supported

log = logging.getLogger("attnres.models.kimi_k3")

BF16 = torch.bfloat16

# Paths a site (or a MoE tail) can take; SitePath.path holds one of these.
RMSNORM = "rmsnorm"  # no snapshot yet: a plain RMSNorm of the prefix (torch), no mixing
FUSED = "fused"  # attnres.attn_res_rmsnorm (mixing + norm in one op; tap from the op)
FUSED_ADD = "fused_add"  # attnres.attn_res_add_rmsnorm with one addend (pre-MLP sites)
FUSED_ADD2 = "fused_add2"  # the fold: attn_res_add_rmsnorm(prefix, routed, layer_residual_add2=shared)
EAGER = "eager"  # torch bf16 adds, attnres.attn_res for the mixture, torch two-rounding RMSNorm
MATERIALIZE = "materialize"  # a pending tail summed first, prefix + (routed + shared); the site's path follows
DEFER = "defer"  # a MoE layer left its tail pending
SUM = "sum"  # a MoE layer summed its tail itself (fold off)

# Why a site materializes first (or runs eager).
TAP = "tap"  # the kernel cannot emit the pre-norm mixture the capture needs
NO_SNAPSHOTS = "no_snapshots"  # the consumer has no snapshot yet (a plain RMSNorm, no attnres op)
TOPOLOGY = "topology"  # the persistent route declined the call (the tap)
MAX_CANDIDATES_REASON = "max_candidates"  # N above the fold's per-token limit
FINAL_CAPTURE = "final_capture"  # the last layer is captured: its tap is taken at the output site
WINDOW = "window"  # T above KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS
DEVICE = "device"  # the plan declines the fused path on this device / for these options
KERNEL = "kernel"  # the add2 op would run another kernel than the unfused site (not bitwise-safe)
FUSED_OFF = "fused_off"  # KIMI_K3_FUSED_ATTN_RES=0
DTYPE = "dtype"  # the tail is not bf16
HIDDEN = "hidden"  # H outside the ops' range

SITE_KINDS = ("pre_attn", "pre_mlp", "moe_tail", "output")
FP8_SITE_KINDS = ("pre_attn", "pre_mlp")  # their outputs feed the attention / MLP input projections

# Who produced a site's FP8 output (SitePath.fp8).
FP8_FUSED = "fused"  # the site's own fused op (fp8=), same launch
FP8_REFERENCE = "reference"  # attnres.fp8.quantize of the bf16 output: the site's path has no FP8 epilogue


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class ResidualSettings:
    """How the sites run. from_knobs() takes the knobs read once per process, at the first model built without
    settings (attnres.knobs.CURRENT; a bad value raises KnobError there); a model instance may carry its own
    (tests force each decision through these)."""

    fold: bool = False  # KIMI_K3_MOE_TAIL_ADD_FOLD
    fused: bool = True  # KIMI_K3_FUSED_ATTN_RES
    max_tokens: int = 32  # KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS
    topology: str = "auto"  # KIMI_K3_ATTN_RES_TOPOLOGY
    aux_stream: bool = True  # KIMI_K3_AUX_ATTN_RES_STREAM: taps hold the pre-norm mixture (else the raw prefix)
    kernel: str = "auto"  # Options.kernel of the fused sites (forcing one a device lacks makes the plan decline)
    pdl: bool = True
    kernel_emits_tap: bool = True  # attnres kernels emit the tap; False models a kernel that cannot
    fold_max_candidates: int = MAX_CANDIDATES  # the fold's per-token N limit
    fp8: str | None = None  # KIMI_K3_ATTN_RES_FP8: None, "per_token" or "block128" at the FP8_SITE_KINDS sites
    fp8_pow2: bool = False  # KIMI_K3_ATTN_RES_FP8 = *_pow2: power-of-two scales

    def __post_init__(self):
        if self.fp8 is not None and self.fp8 not in _fp8.MODES:
            raise ValueError(f"ResidualSettings.fp8 must be None or one of {_fp8.MODES}, got {self.fp8!r}")
        if self.fp8_pow2 and self.fp8 is None:
            raise ValueError("ResidualSettings.fp8_pow2 requires fp8 = per_token or block128")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"ResidualSettings.topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"ResidualSettings.max_tokens must be an int >= 0, got {self.max_tokens!r}")
        if not 1 <= self.fold_max_candidates <= MAX_CANDIDATES:
            raise ValueError(f"ResidualSettings.fold_max_candidates must be in [1, {MAX_CANDIDATES}], "
                             f"got {self.fold_max_candidates}")
        Options(kernel=self.kernel)  # validates the kernel name

    @classmethod
    def from_knobs(cls, knobs: _knobs.Knobs | None = None, **overrides) -> "ResidualSettings":
        k = knobs or _knobs.CURRENT
        mode = k.attn_res_fp8.removesuffix("_pow2")
        kw = dict(fold=k.moe_tail_add_fold, fused=k.fused_attn_res, max_tokens=k.fused_attn_res_max_tokens,
                  topology=k.attn_res_topology, aux_stream=k.aux_attn_res_stream,
                  fp8=None if mode == "none" else mode, fp8_pow2=k.attn_res_fp8.endswith("_pow2"))
        kw.update(overrides)
        return cls(**kw)

    @functools.cached_property
    def options(self) -> Options:
        """Options of the fused sites: the topology, and the per-token ceiling of the split topology."""
        return Options(topology=self.topology, split_max_tokens=self.max_tokens, pdl=self.pdl, kernel=self.kernel)

    @functools.cached_property
    def eager_options(self) -> Options:
        """Options of the eager path's mixing op: the library's own choice of kernel."""
        return Options(pdl=self.pdl)



# ------------------------------------------------------------------------------------------------ plan
@functools.lru_cache(maxsize=8192)
def _plan(op: str, tokens: int, candidates: int, hidden: int, device: str, add: bool, add2: bool, tap: bool,
          snapshot: bool, options: Options, fp8: str | None = None, fp8_pow2: bool = False) -> attnres.PlanInfo:
    return attnres.plan(op, tokens=tokens, candidates=candidates, hidden=hidden, device=device, add=add,
                        add2=add2, tap=tap, snapshot=snapshot, fp8=fp8, fp8_pow2_scales=fp8_pow2, options=options)


def _decline_reason(p: attnres.PlanInfo) -> str:
    """TOPOLOGY when the persistent route declined the call (its decline codes), DEVICE for any other decline."""
    return TOPOLOGY if p.decline_code.startswith("persistent_") else DEVICE


def _device_key(device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


class Route(NamedTuple):
    path: str
    kernel: str = ""  # the kernel the plan chose (eager: the mixing op's kernel)
    reason: str = ""  # one of the reason labels above
    detail: str = ""  # the plan's decline text, when there is one


def _eager_route(settings: ResidualSettings, tokens: int, candidates: int, hidden: int, device: str, reason: str,
                 detail: str = "") -> Route:
    p = _plan("attn_res", tokens, candidates, hidden, device, False, False, False, False, settings.eager_options)
    return Route(EAGER, p.kernel or "declined", reason, detail)


def site_route(settings: ResidualSettings, *, tokens: int, candidates: int, hidden: int, device, add: bool,
               tap: bool) -> Route:
    """The path of a site whose prefix is materialized — the path the fold-off chain takes there. `add`: the site
    adds one addend (pre-MLP); `tap`: the site must emit the pre-norm mixture."""
    dev = _device_key(device)
    if candidates == 1 and not add:
        return Route(RMSNORM, "torch", NO_SNAPSHOTS)
    if not settings.fused:
        return _eager_route(settings, tokens, candidates, hidden, dev, FUSED_OFF)
    if settings.topology == "per_token" and tokens > settings.max_tokens:
        return _eager_route(settings, tokens, candidates, hidden, dev, WINDOW)
    if tap and not settings.kernel_emits_tap:
        return _eager_route(settings, tokens, candidates, hidden, dev, TAP)
    op = "attn_res_add_rmsnorm" if add else "attn_res_rmsnorm"
    p = _plan(op, tokens, candidates, hidden, dev, add, False, tap, False, settings.options)
    if p.accepted:
        return Route(FUSED_ADD if add else FUSED, p.kernel)
    return _eager_route(settings, tokens, candidates, hidden, dev, _decline_reason(p), p.decline)


def fold_route(settings: ResidualSettings, *, tokens: int, candidates: int, hidden: int, device, tap: bool,
               snapshot: bool, final_capture: bool = False) -> Route:
    """FUSED_ADD2 when the consumer may take a pending tail in its kernel, else MATERIALIZE with the reason.
    The fold runs only where the unfused site would run the fused op on the same kernel."""
    if candidates == 1:
        return Route(MATERIALIZE, reason=NO_SNAPSHOTS)
    base = site_route(settings, tokens=tokens, candidates=candidates, hidden=hidden, device=device, add=False,
                      tap=tap)
    if base.path != FUSED:
        return Route(MATERIALIZE, reason=base.reason, detail=base.detail)
    if candidates > settings.fold_max_candidates:
        return Route(MATERIALIZE, reason=MAX_CANDIDATES_REASON,
                     detail=f"N = {candidates} > {settings.fold_max_candidates}")
    if final_capture:
        return Route(MATERIALIZE, reason=FINAL_CAPTURE)
    p = _plan("attn_res_add_rmsnorm", tokens, candidates, hidden, _device_key(device), True, True, tap, snapshot,
              settings.options)
    if not p.accepted:
        return Route(MATERIALIZE, reason=_decline_reason(p), detail=p.decline)
    if p.kernel != base.kernel:
        return Route(MATERIALIZE, reason=KERNEL, detail=f"add2 would run {p.kernel}, the unfused site {base.kernel}")
    return Route(FUSED_ADD2, p.kernel)


def tail_route(settings: ResidualSettings, *, tokens: int, hidden: int, dtype: torch.dtype) -> Route:
    """What a MoE layer does with its tail: DEFER (return a PendingTail), SUM (fold off), or MATERIALIZE (fold
    on, but the tail is outside the fused window: the layer sums it as the eager chain does)."""
    if not settings.fold:
        return Route(SUM)
    if not settings.fused:
        return Route(MATERIALIZE, reason=FUSED_OFF)
    if tokens > settings.max_tokens:
        return Route(MATERIALIZE, reason=WINDOW, detail=f"T = {tokens} > {settings.max_tokens}")
    if dtype != BF16:
        return Route(MATERIALIZE, reason=DTYPE)
    if not hidden_supported(hidden):
        return Route(MATERIALIZE, reason=HIDDEN)
    return Route(DEFER)


# ------------------------------------------------------------------------------------------------ record
@dataclass(frozen=True)
class SitePath:
    site: str  # "layer12.pre_attn", "layer5.pre_mlp", "layer5.moe_tail", "output"
    path: str
    tokens: int
    candidates: int
    kernel: str = ""
    reason: str = ""
    fp8: str = ""  # FP8_FUSED or FP8_REFERENCE where the site returned an FP8 output

    @property
    def kind(self) -> str:
        return self.site.rsplit(".", 1)[-1]


class PathRecord:
    """Every site's decision, in call order (tests read `entries`), and one debug log line per distinct
    (site, path, T, N)."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self.entries: list[SitePath] = []
        self._logged: set[tuple[str, str, int, int]] = set()

    def add(self, site: str, route: Route, tokens: int, candidates: int) -> None:
        entry = SitePath(site, route.path, tokens, candidates, route.kernel, route.reason)
        if self.keep:
            self.entries.append(entry)
        key = (site, route.path, tokens, candidates)
        if key not in self._logged:
            self._logged.add(key)
            log.debug("%s: %s (T=%d, N=%d%s%s%s)", site, route.path, tokens, candidates,
                      f", kernel {route.kernel}" if route.kernel else "", f", {route.reason}" if route.reason else "",
                      f": {route.detail}" if route.detail else "")

    def add_fp8(self, site: str, source: str) -> None:
        """Marks the site's last entry (the path it ran) with who produced its FP8 output."""
        if self.keep:
            for i in range(len(self.entries) - 1, -1, -1):
                if self.entries[i].site == site:
                    self.entries[i] = replace(self.entries[i], fp8=source)
                    break
        key = (site, "fp8:" + source, 0, 0)
        if key not in self._logged:
            self._logged.add(key)
            log.debug("%s: fp8 output from %s", site, source)

    def clear(self) -> None:
        self.entries.clear()

    def select(self, *, path: str | None = None, reason: str | None = None, kind: str | None = None,
               site: str | None = None, fp8: str | None = None) -> list[SitePath]:
        return [e for e in self.entries
                if (path is None or e.path == path) and (reason is None or e.reason == reason)
                and (kind is None or e.kind == kind) and (site is None or e.site == site)
                and (fp8 is None or e.fp8 == fp8)]

    def summary(self) -> Counter:
        """Count of (site kind, path, kernel, reason)."""
        return Counter((e.kind, e.path, e.kernel, e.reason) for e in self.entries)


# ------------------------------------------------------------------------------------------------ tensors
@dataclass(frozen=True)
class PendingPartial:
    """A row-parallel sub-layer's output on this rank before its all-reduce (tensor parallelism,
    attnres.models.kimi_k3.tp). A site whose route is the fused op hands `partial` and `comm` (an
    attnres.comm.Communicator that supports this call) to attnres.all_reduce_attn_res_add_rmsnorm and calls
    `fused()` to record it; any other consumer calls `reduce()` (the chain's own all-reduce, recorded there)."""

    partial: Tensor
    comm: object
    reduce: Callable[[], Tensor]
    fused: Callable[[], None]


def reduced(t: Tensor | PendingPartial) -> Tensor:
    return t.reduce() if isinstance(t, PendingPartial) else t


class PendingTail(NamedTuple):
    """A MoE layer's tail, not yet added: the carried prefix is prefix + (routed + shared). Under TP `shared`
    may still be this rank's partial (a PendingPartial) for the fold site to all-reduce in its fused op."""

    prefix: Tensor
    routed: Tensor
    shared: Tensor | PendingPartial

    def materialize(self) -> Tensor:
        """The eager chain's two bf16 adds, in its order: moe = routed + shared, then prefix + moe."""
        return self.prefix + (self.routed + reduced(self.shared))


@dataclass
class SiteWeights:
    """One attention-residual site: the pseudo-query (the Linear(H, 1) weight), the scoring RMSNorm's gain, and
    the RMSNorm after the mixture."""

    res_weight: Tensor
    rms_weight: Tensor
    norm_weight: Tensor
    rms_eps: float
    norm_eps: float

    def args(self) -> tuple:
        return (self.res_weight, self.rms_weight, self.norm_weight, self.rms_eps, self.norm_eps)


class SnapshotBank:
    """The preallocated snapshot bank: [Kmax, T, H] (snapshot-major) or [T, Kmax, H] (token-major). Candidate
    views are strided slices of it; rows are written in place."""

    def __init__(self, storage: Tensor, layout: str = "snapshot_major"):
        if layout not in BANK_LAYOUTS:
            raise ValueError(f"SnapshotBank: layout must be one of {BANK_LAYOUTS}, got {layout!r}")
        if storage.dim() != 3 or storage.dtype != BF16 or storage.stride(-1) != 1:
            raise ValueError("SnapshotBank: storage must be a bf16 3-D tensor with a contiguous last dimension")
        self.storage = storage
        self.layout = layout

    @classmethod
    def allocate(cls, rows: int, tokens: int, hidden: int, *, layout: str = "snapshot_major", device="cpu",
                 fill: float | None = None) -> "SnapshotBank":
        shape = (rows, tokens, hidden) if layout == "snapshot_major" else (tokens, rows, hidden)
        storage = torch.empty(shape, dtype=BF16, device=device)
        if fill is not None:
            storage.fill_(fill)
        return cls(storage, layout)

    @property
    def rows(self) -> int:
        return self.storage.shape[0 if self.layout == "snapshot_major" else 1]

    @property
    def tokens(self) -> int:
        return self.storage.shape[1 if self.layout == "snapshot_major" else 0]

    def candidates(self, k: int) -> Tensor:
        """The first k snapshots as a [k, T, H] view (token-major: a strided view, no copy)."""
        if self.layout == "snapshot_major":
            return self.storage[:k]
        return self.storage[:, :k].transpose(0, 1)

    def row(self, s: int) -> Tensor:
        return self.storage[s] if self.layout == "snapshot_major" else self.storage[:, s]


# ------------------------------------------------------------------------------------------------ the paths
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Kimi's RMSNorm in its two-rounding order: normed = bf16(x * rsqrt(mean(x^2) + eps)), then
    bf16(normed * weight), all arithmetic in fp32."""
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = (x32 * r).to(BF16)
    return (normed.float() * weight.float()).to(BF16)


def eager_attn_res_rmsnorm(prefix: Tensor, candidates: Tensor, w: SiteWeights,
                           options: Options | None = None) -> tuple[Tensor, Tensor]:
    """The unfused site: the mixture from attnres.attn_res, then the RMSNorm as its own step.
    Returns (output, mixture)."""
    mixture = attnres.attn_res(prefix, candidates, w.res_weight, w.rms_weight, w.rms_eps, options=options)[0]
    return rmsnorm(mixture, w.norm_weight, w.norm_eps), mixture


class Fp8Output(NamedTuple):
    """A site's output for an FP8 GEMM: codes [T, H] float8_e4m3fn and fp32 scales in the ops' layout
    (attnres.fp8.empty_scales: per_token [T, 1]; block128 [T, H / 128] column-major, token stride padded to 4)."""

    codes: Tensor
    scales: Tensor
    source: str  # FP8_FUSED or FP8_REFERENCE


class SiteResult(NamedTuple):
    prefix: Tensor  # the materialized prefix the site mixed (what is carried on / written to the bank)
    output: Tensor  # the normed output fed to the sub-layer (or the model output)
    mixture: Tensor | None  # the pre-norm mixture, when asked for
    route: Route
    fp8: Fp8Output | None = None  # with fp8: output quantized (settings.fp8), at the sites that asked for it


def check_fp8_hidden(settings: ResidualSettings, hidden: int) -> None:
    """block128 groups 128 columns: H must be a multiple of 128 (the FP8 GEMM's K-blocking needs it too)."""
    if settings.fp8 == "block128" and hidden % _fp8.GROUP:
        raise ValueError(f"ResidualSettings.fp8 = block128 needs H a multiple of {_fp8.GROUP}, got H = {hidden}")


def reference_fp8(output: Tensor, settings: ResidualSettings) -> Fp8Output:
    """attnres.fp8.quantize of a bf16 output, its scales copied into the layout the fused ops write."""
    T, H = output.shape
    check_fp8_hidden(settings, H)
    codes, scales = _fp8.quantize(output, settings.fp8, settings.fp8_pow2)
    laid_out = _fp8.empty_scales(settings.fp8, T, H, output.device)
    laid_out.copy_(scales)
    return Fp8Output(codes, laid_out, FP8_REFERENCE)


def _fp8_kw(settings: ResidualSettings, in_op: bool) -> dict:
    return dict(fp8=settings.fp8, fp8_pow2_scales=settings.fp8_pow2) if in_op else {}


def _fp8_in_op(settings: ResidualSettings, route: Route, op: str, tokens: int, candidates: int, hidden: int,
               device, *, add: bool = False, add2: bool = False, tap: bool = False, snapshot: bool = False) -> bool:
    """Whether the site's fused op emits the FP8 output itself: the plan takes the same call with fp8 on the
    kernel the site runs (so `output` stays the bits of the route the fp8-off chain takes)."""
    if settings.fp8 is None:
        return False
    check_fp8_hidden(settings, hidden)
    p = _plan(op, tokens, candidates, hidden, _device_key(device), add, add2, tap, snapshot, settings.options,
              settings.fp8, settings.fp8_pow2)
    return p.accepted and p.kernel == route.kernel


def _with_fp8(result: SiteResult, fused: tuple | None, settings: ResidualSettings, want: bool, site: str,
              record: PathRecord | None) -> SiteResult:
    """Attaches the site's FP8 output: the op's own (codes, scales) when it emitted them, else the reference."""
    if not want or settings.fp8 is None:
        return result
    fp8 = Fp8Output(fused[0], fused[1], FP8_FUSED) if fused is not None else reference_fp8(result.output, settings)
    if record is not None:
        record.add_fp8(site, fp8.source)
    return result._replace(fp8=fp8)


def _snapshot_in_op(settings: ResidualSettings, route: Route, tokens: int, candidates: int, hidden: int,
                    device) -> bool:
    """Whether the site's own op can write the snapshot row (snapshot_slot): the plan accepts the write on the
    kernel the site runs."""
    if route.path == FUSED:
        op, options = "attn_res_rmsnorm", settings.options
    elif route.path == EAGER:
        op, options = "attn_res", settings.eager_options
    else:
        return False
    p = _plan(op, tokens, candidates, hidden, _device_key(device), False, False, False, True, options)
    return p.accepted and p.kernel == route.kernel


def _run_unchanged(prefix: Tensor, bank: SnapshotBank, k: int, w: SiteWeights, settings: ResidualSettings,
                   route: Route, mixture: bool, snapshot_slot: int | None = None, fp8_in_op: bool = False
                   ) -> tuple[Tensor, Tensor | None, tuple | None]:
    """(output, mixture, (output_fp8, scales) or None) of a materialized prefix through `route` (RMSNORM, FUSED
    or EAGER); with snapshot_slot (FUSED and EAGER only) the op also writes the prefix into that bank row; with
    fp8_in_op (FUSED only) the op also emits the FP8 output."""
    if route.path == RMSNORM:
        return rmsnorm(prefix, w.norm_weight, w.norm_eps), (prefix if mixture else None), None  # N = 1: mixture = P
    cand = bank.candidates(k)
    if route.path == FUSED:
        out = attnres.attn_res_rmsnorm(prefix, cand, *w.args(), return_mixture=mixture, snapshot_slot=snapshot_slot,
                                       **_fp8_kw(settings, fp8_in_op), options=settings.options)
        out = out if isinstance(out, tuple) else (out,)
        return out[0], (out[1] if mixture else None), (out[-2:] if fp8_in_op else None)
    mix = attnres.attn_res(prefix, cand, w.res_weight, w.rms_weight, w.rms_eps, snapshot_slot=snapshot_slot,
                           options=settings.eager_options)[0]
    return rmsnorm(mix, w.norm_weight, w.norm_eps), (mix if mixture else None), None


def try_fold(tail: PendingTail, bank: SnapshotBank, k: int, w: SiteWeights, settings: ResidualSettings, *,
             mixture: bool = False, snapshot: bool = False, final_capture: bool = False, fp8: bool = False
             ) -> tuple[Route, SiteResult | None]:
    """The add2 consumer: runs attn_res_add_rmsnorm(prefix, routed, bank[:k], layer_residual_add2=shared) when
    fold_route allows it (with snapshot, the updated prefix also lands in bank row k through the op's
    snapshot_slot; with fp8, the op also emits the FP8 output where the plan takes it: the result's `fp8` then
    holds (codes, scales) with source FP8_FUSED, and the caller attaches the reference otherwise). Otherwise
    declines — (route, None) — and the caller materializes first."""
    T, H = tail.prefix.shape
    route = fold_route(settings, tokens=T, candidates=k + 1, hidden=H, device=tail.prefix.device, tap=mixture,
                       snapshot=snapshot, final_capture=final_capture)
    if route.path != FUSED_ADD2:
        return route, None
    if isinstance(tail.shared, PendingPartial):
        # The shared partial's all-reduce lands in the op's second addend: prefix + (routed + reduced shared).
        out = attnres.all_reduce_attn_res_add_rmsnorm(
            tail.shared.comm, tail.shared.partial, tail.prefix, bank.candidates(k), *w.args(), site="add2",
            layer_residual_add=tail.routed, return_mixture=mixture, snapshot_slot=k if snapshot else None,
            options=settings.options)
        tail.shared.fused()
        return route, SiteResult(out[1], out[2], out[3] if mixture else None, route)
    in_op = fp8 and _fp8_in_op(settings, route, "attn_res_add_rmsnorm", T, k + 1, H, tail.prefix.device, add=True,
                               add2=True, tap=mixture, snapshot=snapshot)
    out = attnres.attn_res_add_rmsnorm(tail.prefix, tail.routed, bank.candidates(k), *w.args(),
                                       layer_residual_add2=tail.shared, return_mixture=mixture,
                                       snapshot_slot=k if snapshot else None, **_fp8_kw(settings, in_op),
                                       options=settings.options)
    fused = Fp8Output(out[-2], out[-1], FP8_FUSED) if in_op else None
    return route, SiteResult(out[0], out[1], out[2] if mixture else None, route, fused)


def attn_res_site(carried: Tensor | PendingTail, bank: SnapshotBank, k: int, w: SiteWeights,
                  settings: ResidualSettings, *, site: str = "site", mixture: bool = False, snapshot: bool = False,
                  final_capture: bool = False, fp8: bool = False, record: PathRecord | None = None) -> SiteResult:
    """A site without an addend of its own (pre-attention, snapshot-layer pre-MLP, model output) over the first
    k snapshots. `carried` is the prefix or a pending tail; `mixture`: return the pre-norm mixture (a capture
    tap); `snapshot`: the prefix also goes into bank row k (the caller then counts k + 1 snapshots); `fp8`: the
    output feeds an FP8 GEMM, so with settings.fp8 the result also carries it quantized (SiteResult.fp8)."""
    if isinstance(carried, PendingTail):
        T, H = carried.prefix.shape
        route, result = try_fold(carried, bank, k, w, settings, mixture=mixture, snapshot=snapshot,
                                 final_capture=final_capture, fp8=fp8)
        if record is not None:
            record.add(site, route, T, k + 1)
        if result is not None:
            return _with_fp8(result, result.fp8, settings, fp8, site, record)
        prefix = carried.materialize()
    else:
        prefix = carried
    T, H = prefix.shape
    route = site_route(settings, tokens=T, candidates=k + 1, hidden=H, device=prefix.device, add=False, tap=mixture)
    if record is not None:
        record.add(site, route, T, k + 1)
    # The snapshot row is written by the site's op where its kernel can (snapshot_slot), else copied.
    in_op = snapshot and _snapshot_in_op(settings, route, T, k + 1, H, prefix.device)
    fp8_in_op = fp8 and route.path == FUSED and _fp8_in_op(settings, route, "attn_res_rmsnorm", T, k + 1, H,
                                                           prefix.device, tap=mixture, snapshot=in_op)
    output, mix, fused = _run_unchanged(prefix, bank, k, w, settings, route, mixture, k if in_op else None, fp8_in_op)
    if snapshot and not in_op:
        bank.row(k).copy_(prefix)
    return _with_fp8(SiteResult(prefix, output, mix, route), fused, settings, fp8, site, record)


def attn_res_add_site(prefix: Tensor, add: Tensor | PendingPartial, bank: SnapshotBank, k: int, w: SiteWeights,
                      settings: ResidualSettings, *, site: str = "site", fp8: bool = False,
                      record: PathRecord | None = None) -> SiteResult:
    """A site that adds one addend (the pre-MLP site of a non-snapshot layer): P = prefix + add, then the mixture
    over bank[:k] and P, then the norm. Under TP `add` may be this rank's attention partial (a PendingPartial):
    the fused route all-reduces it inside the site's op, every other route reduces it first. `fp8`: as
    attn_res_site (the TP all-reduce op has no FP8 epilogue: the reference quantizes there)."""
    T, H = prefix.shape
    route = site_route(settings, tokens=T, candidates=k + 1, hidden=H, device=prefix.device, add=True, tap=False)
    if record is not None:
        record.add(site, route, T, k + 1)
    if isinstance(add, PendingPartial):
        if route.path == FUSED_ADD:
            _, updated, output = attnres.all_reduce_attn_res_add_rmsnorm(
                add.comm, add.partial, prefix, bank.candidates(k), *w.args(), site="add", options=settings.options)
            add.fused()
            return _with_fp8(SiteResult(updated, output, None, route), None, settings, fp8, site, record)
        add = add.reduce()
    if route.path == FUSED_ADD:
        in_op = fp8 and _fp8_in_op(settings, route, "attn_res_add_rmsnorm", T, k + 1, H, prefix.device, add=True)
        out = attnres.attn_res_add_rmsnorm(prefix, add, bank.candidates(k), *w.args(), **_fp8_kw(settings, in_op),
                                           options=settings.options)
        return _with_fp8(SiteResult(out[0], out[1], None, route), out[2:] if in_op else None, settings, fp8, site,
                         record)
    updated = prefix + add
    output, _ = eager_attn_res_rmsnorm(updated, bank.candidates(k), w, settings.eager_options)
    return _with_fp8(SiteResult(updated, output, None, route), None, settings, fp8, site, record)
