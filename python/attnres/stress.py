"""Stress runs (docs/reliability.md, section 5): many randomly shaped calls checked against the CPU backend,
and a long Kimi K3 decode chain with the MoE-tail fold checked against the eager chain.

    python -m attnres.stress calls --count 100000 --streams 4 --device cuda
    python -m attnres.stress chain --steps 10000 --device cuda

`calls` draws each call from a generator seeded by (seed, call index): an op (attn_res, attn_res_rmsnorm with
or without the tap, attn_res_add_rmsnorm with one or two addends, tap and snapshot write, the persistent op
where the plan takes it, moe_finalize), T (1..64 mostly, sometimes up to --max-tokens), N 1..16, H from the fast
paths {7168, 2304, 4096, 8192} or a random multiple of 8, a bank layout (contiguous, snapshot-major, token-major,
row-padded), padded prefix rows, eps, and on CUDA a forced kernel and PDL on or off. Storage the call must not
read (spare bank rows, padding, moe rows no route names) holds NaN. The calls are issued round-robin on
--streams CUDA streams; every --graph-every calls one call is also captured in a CUDA graph and replayed twice
(once over poisoned outputs, once after fresh values were copied into its input buffers), and each replay must
equal the eager call bit for bit. Every result is compared with the same call on the CPU backend (dense CPU
copies of the inputs): `updated`, the snapshot row and moe_finalize without its norm bit for bit (the
contract's exact outputs, docs/ops/*.md "Determinism"), every other output within the contract's tolerance
(attnres.reference.check_close) or within 2 bf16 ulps of it elementwise; fp32 logits within the rule or within
the worst-case fp32 error bound of their dot product. Every input buffer must keep its bits (the requested
snapshot row must hold `updated`). With --device cpu the "device" call is the CPU backend on the random
layout and, every --oracle-every calls, the float64 oracle checks it too.

`chain` runs the decode chain (`attnres.models.kimi_k3`, stand-in sub-layers) twice, fold on and fold off,
for --steps dependent steps: step s + 1's input is bf16(step s's output + embedding[s mod 97]), so a
difference in any bit at any step changes everything after it. On CUDA each chain's step is one CUDA graph
(--eager: no graphs). Every step writes an order-weighted integer digest of its output, taps and bank into a
per-step table (inside the graph), so the two chains are compared at every step; every --check-every steps
and at the last step the whole state — every site's prefix, output and tap, the bank after every layer, the
model output and the next input — is compared bit for bit, and the first graph replay is compared with the
eager step it was captured from.

Both print a JSON summary as the last line and exit 1 on any mismatch (2 on a usage or setup error).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import random
import sys
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

import attnres
from attnres import reference
from attnres.moe import moe_finalize, reference_moe_finalize

BF16 = torch.bfloat16
FAST_H = (7168, 2304, 4096, 8192)
MOE_FAST_D = (3584, 7168, 4096)
LAYOUTS = ("contiguous", "snapshot_major", "token_major", "strided")
NAN = float("nan")
BF16_ULPS = 2  # elementwise allowance next to the tolerance rule: two roundings (normed, output) may flip
MAX_FAILURES_LISTED = 20

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ================================================================================================ checks
def bits(t: Tensor) -> Tensor:
    """The raw bits (NaN-safe, -0.0 != 0.0), same device."""
    t = t.contiguous()
    return t.view(_INT_OF_WIDTH[t.element_size()]) if t.is_floating_point() else t


def same_bits(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    return torch.equal(bits(a), bits(b.to(a.device)))


def _ordered_bf16(t: Tensor) -> Tensor:
    """bf16 bits as integers ordered like the values (adjacent representable values differ by 1)."""
    b = bits(t.cpu()).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def within_ulps(a: Tensor, e: Tensor, ulps: int) -> bool:
    """Every element of a is within `ulps` bf16 steps of e (both finite), or bitwise equal."""
    a, e = a.cpu(), e.cpu()
    af, ef = a.float(), e.float()
    if not (torch.isfinite(af).all() and torch.isfinite(ef).all()):
        # The contract's own NaN/Inf (e.g. eps = 0 and an all-zero row): the same elements non-finite, the same
        # infinities (NaN payloads may differ), the finite rest within the allowance.
        if not (torch.equal(torch.isnan(af), torch.isnan(ef)) and torch.equal(torch.isinf(af), torch.isinf(ef))
                and torch.equal(af[torch.isinf(af)], ef[torch.isinf(ef)])):
            return False
        finite = torch.isfinite(af)
        a, e = a[finite], e[finite]
    return bool(((_ordered_bf16(a) - _ordered_bf16(e)).abs() <= ulps).all())


def close_bf16(a: Tensor, e: Tensor, what: str) -> str | None:
    """None when a meets the contract's tolerance against e (or is within BF16_ULPS of it elementwise)."""
    if tuple(a.shape) != tuple(e.shape) or a.dtype != e.dtype:
        return f"{what}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(e.shape)} {e.dtype}"
    try:
        reference.check_close(a.cpu(), e.cpu(), what)
        return None
    except AssertionError as err:
        if within_ulps(a, e, BF16_ULPS):
            return None
        return str(err)


def _logit_bound(inputs: dict, H: int) -> Tensor:
    """Worst-case |error| of an fp32 logit on either backend, doubled (two results, each off the exact value):
    the dot product of H rounded products summed in any order, gamma(H + 2) * rsigma * sum_h |v_h q_h|, plus
    a few roundings of rsigma and the final product relative to the logit itself."""
    P = inputs["updated_ref"] if inputs.get("updated_ref") is not None else inputs["prefix"]
    V = torch.cat([inputs["block"].double(), P.double().unsqueeze(0)], 0)  # [N, T, H]
    q = inputs["res_weight"].double().reshape(H) * inputs["rms_weight"].double().reshape(H)
    rs = torch.rsqrt((V * V).mean(-1) + inputs["rms_eps"])
    u = 2.0 ** -24
    gamma = (H + 2) * u / (1 - (H + 2) * u)
    return 2 * (gamma * rs * (V.abs() @ q.abs()) + 8 * u * (rs * (V @ q)).abs())


def close_logits(a: Tensor, e: Tensor, inputs: dict, H: int) -> str | None:
    try:
        reference.check_close(a.cpu(), e.cpu(), "logits")
        return None
    except AssertionError as err:
        # A cancelling dot product (a logit near 0) has a large relative error on any backend: judge each
        # logit by the fp32 error bound of its sum instead.
        bound = _logit_bound(inputs, H)
        diff = (a.cpu().double() - e.cpu().double()).abs()
        if torch.isfinite(diff).all() and bool((diff <= bound).all()):
            return None
        return f"{err}; beyond the fp32 dot-product bound at {int((diff > bound).sum())} logits"


# ================================================================================================ calls
@dataclass
class Spec:
    """One call, drawn from its seed; everything needed to rebuild it."""

    index: int
    seed: int
    op: str
    T: int
    N: int = 0  # attention ops: candidates (K = N - 1)
    H: int = 0  # attention ops: hidden; moe: D
    layout: str = "snapshot_major"
    spare: int = 0  # bank rows past K
    bank_pad: int = 0  # "strided": elements after each bank row
    row_pad: int = 0  # elements after each prefix/addend row
    weight_2d: bool = False
    addends: int = 0
    tap: bool = False
    snapshot: int = -1  # the slot written, -1 none
    diagnostics: bool = False
    rms_eps: float = 1e-5
    norm_eps: float = 1e-5
    kernel: str = "auto"
    pdl: bool = True
    # moe_finalize
    k: int = 0
    R: int = 0
    remote: float = 0.0
    weights_dtype: str = "float32"
    shared: bool = False
    norm: bool = False
    scale: float = 1.0

    def shape_key(self) -> tuple:
        if self.op == "moe_finalize":
            return (self.op, self.T, self.k, self.H)
        return (self.op, self.T, self.N, self.H)

    def describe(self) -> str:
        d = {k: v for k, v in asdict(self).items() if v not in (0, False, -1, "") or k in ("index", "seed", "T")}
        return json.dumps(d, sort_keys=True)


def _draw_tokens(r: random.Random, max_tokens: int) -> int:
    u = r.random()
    if u < 0.55:
        return r.randint(1, 8)
    if u < 0.85:
        return r.randint(9, 32)
    if u < 0.98 or max_tokens <= 64:
        return r.randint(33, min(64, max_tokens))
    return r.randint(65, max_tokens)


def _draw_hidden(r: random.Random, fast: tuple[int, ...]) -> int:
    if r.random() < 0.5:
        return r.choice(fast)
    return 8 * max(1, min(2048, round(math.exp(r.uniform(0.0, math.log(2048.0))))))


def _draw_eps(r: random.Random) -> float:
    u = r.random()
    if u < 0.05:
        return 0.0
    if u < 0.35:
        return 1e-5
    return math.exp(r.uniform(math.log(1e-6), math.log(1e-2)))


@functools.lru_cache(maxsize=65536)
def _plan_accepts(op: str, T: int, N: int, H: int, device: str, add: bool, add2: bool, tap: bool, snapshot: bool,
                  diagnostics: bool, kernel: str) -> bool:
    options = attnres.Options(kernel=kernel) if op != "attn_res_add_rmsnorm_persistent" else \
        attnres.Options(topology="persistent")
    return attnres.plan(op, tokens=T, candidates=N, hidden=H, device=device, add=add, add2=add2, tap=tap,
                        snapshot=snapshot, diagnostics=diagnostics, options=options).accepted


def draw_spec(seed: int, index: int, device: str, max_tokens: int) -> Spec:
    call_seed = zlib.crc32(f"{seed}:{index}".encode())
    r = random.Random(call_seed)
    u = r.random()
    op = ("attn_res" if u < 0.15 else "attn_res_rmsnorm" if u < 0.32 else "attn_res_add_rmsnorm" if u < 0.72
          else "attn_res_add_rmsnorm_persistent" if u < 0.77 else "moe_finalize")
    T = _draw_tokens(r, max_tokens)
    s = Spec(index=index, seed=call_seed, op=op, T=T)
    cuda = device == "cuda"
    if op == "moe_finalize":
        s.H = r.choice(MOE_FAST_D) if r.random() < 0.4 else _draw_hidden(r, MOE_FAST_D)
        s.k = r.choice((8, 16)) if r.random() < 0.5 else r.randint(1, 32)
        s.R = T * s.k + r.randint(0, 8)
        s.remote = r.choice((0.0, 0.0, 0.1, 0.5, 1.0))
        s.weights_dtype = r.choice(("float32", "bfloat16"))
        s.shared, s.norm = r.random() < 0.6, r.random() < 0.5
        s.norm_eps = _draw_eps(r)
        s.scale = r.choice((1.0, 2.827, -1.5, round(r.uniform(-4, 4), 3)))
        s.row_pad = 8 * r.randint(1, 3) if r.random() < 0.3 else 0
        s.pdl = r.random() < 0.7
        return s
    s.N, s.H = r.randint(1, 16), _draw_hidden(r, FAST_H)
    s.layout = r.choice(LAYOUTS)
    s.spare = 0 if s.layout == "contiguous" else r.randint(1, 3)
    s.bank_pad = 8 * r.randint(1, 4) if s.layout == "strided" else 0
    s.row_pad = 8 * r.randint(1, 3) if r.random() < 0.3 else 0
    s.weight_2d = r.random() < 0.2
    s.rms_eps, s.norm_eps = _draw_eps(r), _draw_eps(r)
    if op == "attn_res":
        s.diagnostics = True
    elif op == "attn_res_rmsnorm":
        s.tap = r.random() < 0.5
    elif op == "attn_res_add_rmsnorm":
        s.addends = r.choice((1, 2, 2))
        s.tap = r.random() < 0.4
        if s.spare and r.random() < 0.4:
            s.snapshot = s.N - 1 + r.randrange(s.spare)
    else:
        s.addends = r.choice((0, 1))
    dev = "cuda" if cuda else "cpu"
    flags = (s.addends >= 1, s.addends == 2, s.tap, s.snapshot >= 0, s.diagnostics)
    if op == "attn_res_add_rmsnorm_persistent":
        if not _plan_accepts(op, T, s.N, s.H, dev, *flags, "auto"):
            # The plan declines the persistent kernel here (docs/ops): the same call on the fused op instead.
            s.op, s.addends = "attn_res_add_rmsnorm", max(s.addends, 1)
        return s
    if cuda:
        s.pdl = r.random() < 0.7
        kernel = r.choice(("auto", "auto", "single_cta", "split_k"))
        flags = (s.addends >= 1, s.addends == 2, s.tap, s.snapshot >= 0, s.diagnostics)
        s.kernel = kernel if kernel == "auto" or _plan_accepts(s.op, T, s.N, s.H, dev, *flags, kernel) else "auto"
    return s


class Call:
    """One call's tensors on a device: `buffers` (every allocation its inputs live in, NaN where the call
    must not read), the input views, and after run() its outputs."""

    def __init__(self, spec: Spec, device: torch.device, seed: int | None = None):
        self.spec = spec
        self.device = device
        g = torch.Generator(device=device)
        g.manual_seed(spec.seed if seed is None else seed)
        self.g = g
        self.buffers: dict[str, Tensor] = {}
        self.views: dict[str, Tensor | None] = {}
        self.outputs: dict[str, Tensor] = {}
        if spec.op == "moe_finalize":
            self._build_moe()
        else:
            self._build_attn()

    # ------------------------------------------------------------------------------------------ inputs
    def _randn(self, *shape) -> Tensor:
        return torch.randn(*shape, generator=self.g, device=self.device)

    def _rand(self, *shape) -> Tensor:
        return torch.rand(*shape, generator=self.g, device=self.device)

    def _log_uniform(self, shape, lo: float, hi: float) -> Tensor:
        return torch.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * self._rand(*shape))

    def _rows(self, name: str, T: int, H: int, values: Tensor, pad: int) -> Tensor:
        buf = torch.full((T, H + pad), NAN, dtype=BF16, device=self.device)
        buf[:, :H] = values
        self.buffers[name] = buf
        return buf[:, :H]

    def _build_attn(self) -> None:
        s = self.spec
        T, H, K = s.T, s.H, s.N - 1
        vals = (self._randn(K, T, H) * self._log_uniform((K, T, 1), 0.1, 8.0)).to(BF16)
        kmax = K + s.spare
        if s.layout == "token_major":
            bank = torch.full((T, kmax, H), NAN, dtype=BF16, device=self.device)
            bank[:, :K] = vals.transpose(0, 1)
            block = bank.transpose(0, 1)[:K]
        else:
            bank = torch.full((kmax, T, H + s.bank_pad), NAN, dtype=BF16, device=self.device)
            bank[:K, :, :H] = vals
            block = bank[:K, :, :H]
        self.buffers["bank"] = bank
        self.views["block"] = block
        self.views["prefix"] = self._rows("prefix", T, H, (self._randn(T, H) * self._log_uniform((T, 1), 0.5, 2.0))
                                          .to(BF16), s.row_pad)
        self.views["add"] = self._rows("add", T, H, (0.5 * self._randn(T, H)).to(BF16), s.row_pad) \
            if s.addends >= 1 else None
        self.views["add2"] = self._rows("add2", T, H, (0.5 * self._randn(T, H)).to(BF16), s.row_pad) \
            if s.addends >= 2 else None
        for name, scale, base in (("res_weight", 0.02, 0.0), ("rms_weight", 0.1, 1.0), ("norm_weight", 0.1, 1.0)):
            w = (base + scale * self._randn(H)).to(BF16)
            self.buffers[name] = w
            self.views[name] = w.reshape(1, H) if (name == "res_weight" and s.weight_2d) else w

    def _build_moe(self) -> None:
        s = self.spec
        T, k, D, R = s.T, s.k, s.H, s.R
        rows = torch.full((R, D + s.row_pad), NAN, dtype=BF16, device=self.device)
        perm = torch.randperm(R, generator=self.g, device=self.device)[:T * k].to(torch.int32).reshape(T, k)
        remote = self._rand(T, k) < s.remote
        index = torch.where(remote, torch.full_like(perm, -1), perm)
        named = index[index >= 0].long()
        rows[named, :D] = (self._randn(named.numel(), D) * self._log_uniform((named.numel(), 1), 0.1, 4.0)).to(BF16)
        wdtype = torch.float32 if s.weights_dtype == "float32" else BF16
        weights = self._rand(T, k).to(wdtype)
        self.buffers.update(rows=rows, index=index, weights=weights)
        self.views.update(rows=rows[:, :D], index=index, weights=weights)
        self.views["shared"] = self._rows("shared", T, D, self._randn(T, D).to(BF16), s.row_pad) if s.shared else None
        if s.norm:
            self.buffers["norm_weight"] = self.views["norm_weight"] = (1 + 0.1 * self._randn(D)).to(BF16)
        else:
            self.views["norm_weight"] = None

    def refill(self, seed: int) -> None:
        """Fresh values into every input buffer (same layout, same NaN padding), in place."""
        fresh = Call(self.spec, self.device, seed=seed)
        for name, buf in self.buffers.items():
            buf.copy_(fresh.buffers[name])

    def bank_row(self, buf: Tensor, slot: int) -> Tensor:
        s = self.spec
        return buf[:, slot] if s.layout == "token_major" else buf[slot, :, :s.H]


def _options(s: Spec) -> attnres.Options:
    if s.op == "attn_res_add_rmsnorm_persistent":
        return attnres.Options(topology="persistent", pdl=s.pdl)
    return attnres.Options(kernel=s.kernel, pdl=s.pdl)


def run_op(s: Spec, v: dict, options: attnres.Options | None) -> dict[str, Tensor]:
    """The op of the spec on the views v (any device). options None: the library's defaults (the reference)."""
    if s.op == "moe_finalize":
        out = moe_finalize(v["rows"], v["weights"], v["index"], shared=v["shared"], norm_weight=v["norm_weight"],
                           eps=s.norm_eps, scale=s.scale, pdl=s.pdl if options is not None else True)
        return {"output": out}
    w = (v["res_weight"], v["rms_weight"])
    if s.op == "attn_res":
        m, rsigma, probs, logits = attnres.attn_res(v["prefix"], v["block"], *w, s.rms_eps, options=options)
        return {"mixture": m, "rsigma": rsigma, "probs": probs, "logits": logits}
    if s.op == "attn_res_rmsnorm":
        r = attnres.attn_res_rmsnorm(v["prefix"], v["block"], *w, v["norm_weight"], s.rms_eps, s.norm_eps,
                                     return_mixture=s.tap, options=options)
        return {"output": r[0], "mixture": r[1]} if s.tap else {"output": r}
    if s.op == "attn_res_add_rmsnorm":
        r = attnres.attn_res_add_rmsnorm(v["prefix"], v["add"], v["block"], *w, v["norm_weight"], s.rms_eps,
                                         s.norm_eps, layer_residual_add2=v["add2"], return_mixture=s.tap,
                                         snapshot_slot=s.snapshot if (s.snapshot >= 0 and options is not None)
                                         else None, options=options)
        out = {"updated": r[0], "output": r[1]}
        if s.tap:
            out["mixture"] = r[2]
        return out
    updated, output = attnres.attn_res_add_rmsnorm_persistent(
        v["prefix"], v["block"], *w, v["norm_weight"], s.rms_eps, s.norm_eps, layer_residual_add=v["add"],
        options=options if options is not None else attnres.Options(topology="persistent"))
    return {"output": output} if updated is None else {"updated": updated, "output": output}


# The device-side call. A hook of its own so that tests can corrupt it and prove the checker catches it.
def device_call(s: Spec, call: Call) -> dict[str, Tensor]:
    return run_op(s, call.views, _options(s))


def reference_call(s: Spec, cpu_views: dict) -> dict[str, Tensor]:
    return run_op(s, cpu_views, None)


EXACT = {"updated"}  # bitwise between backends for every op (docs/ops: updated == PyTorch's adds)


def compare(s: Spec, got: dict[str, Tensor], ref: dict[str, Tensor], cpu_views: dict) -> list[str]:
    """Every disagreement of the device outputs `got` (already on the CPU) with the reference."""
    problems = []
    if sorted(got) != sorted(ref):
        return [f"outputs {sorted(got)} vs reference {sorted(ref)}"]
    for name, e in ref.items():
        a = got[name]
        exact = name in EXACT or (s.op == "moe_finalize" and not s.norm)
        if exact:
            if not same_bits(a, e):
                n = int((bits(a) != bits(e)).sum()) if a.shape == e.shape else -1
                problems.append(f"{name}: {n} elements differ in bits from the CPU backend")
        elif name == "logits":
            why = close_logits(a, e, {**cpu_views, "updated_ref": ref.get("updated"), "rms_eps": s.rms_eps}, s.H)
            if why:
                problems.append(why)
        elif a.dtype == torch.float32:
            try:
                reference.check_close(a, e, name)
            except AssertionError as err:
                problems.append(str(err))
        else:
            why = close_bf16(a, e, name)
            if why:
                problems.append(why)
    return problems


def oracle_check(s: Spec, got: dict[str, Tensor], v: dict) -> list[str]:
    """The device outputs against the float64 oracle (the CPU runs' independent check)."""
    problems = []
    if s.op == "moe_finalize":
        e = reference_moe_finalize(v["rows"], v["weights"], v["index"], shared=v["shared"],
                                   norm_weight=v["norm_weight"], eps=s.norm_eps, scale=s.scale)
        why = close_bf16(got["output"], e, "moe output vs oracle")
        return [why] if why else []
    norm = s.op != "attn_res"
    r = reference.attn_res(v["prefix"], v["block"], v["res_weight"], v["rms_weight"], s.rms_eps,
                           layer_residual_add=v["add"] if s.addends >= 1 else None,
                           layer_residual_add2=v["add2"] if s.addends >= 2 else None,
                           norm_weight=v["norm_weight"] if norm else None, norm_eps=s.norm_eps)
    for name, a in got.items():
        if name == "updated":
            if not same_bits(a, r.updated):
                problems.append("updated differs in bits from PyTorch's prefix + (add + add2)")
            continue
        e = {"output": r.output, "mixture": r.mixture, "rsigma": r.rsigma, "probs": r.probs, "logits": r.logits}[name]
        if name == "logits":
            why = close_logits(a, e.float(), {**v, "updated_ref": r.updated, "rms_eps": s.rms_eps}, s.H)
        elif name in ("rsigma", "probs"):
            try:
                reference.check_close(a, e, name)
                why = None
            except AssertionError as err:
                why = str(err)
        else:
            why = close_bf16(a, e.to(BF16), f"{name} vs oracle")
        if why:
            problems.append(why)
    return problems


def _check_job(s: Spec, cpu_views: dict, got: dict[str, Tensor], oracle: bool) -> tuple[list[str], list[str]]:
    """Runs in a worker thread (the library releases the GIL): the CPU reference call and the comparisons."""
    dense = {k: (None if t is None else t.contiguous()) for k, t in cpu_views.items()}
    try:
        ref = reference_call(s, dense)
    except Exception as err:  # noqa: BLE001  (any refusal of a valid call is a finding)
        return [f"the CPU backend raised {type(err).__name__}: {err}"], []
    problems = compare(s, got, ref, dense)
    oracle_problems = oracle_check(s, got, dense) if oracle else []
    return problems, oracle_problems


# ------------------------------------------------------------------------------------------ the runner
@dataclass
class CallStats:
    calls: int = 0
    checked: int = 0
    mismatches: int = 0
    input_mutations: int = 0
    graph_captures: int = 0
    graph_replays: int = 0
    graph_mismatches: int = 0
    oracle_checks: int = 0
    oracle_mismatches: int = 0
    errors: int = 0
    shapes: set = field(default_factory=set)
    ops: dict = field(default_factory=dict)
    variants: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)

    def fail(self, kind: str, s: Spec, detail: str) -> None:
        if len(self.failures) < MAX_FAILURES_LISTED:
            self.failures.append({"kind": kind, "call": s.index, "detail": detail[:500], "spec": json.loads(s.describe())})

    def count(self, s: Spec) -> None:
        self.calls += 1
        self.shapes.add(s.shape_key())
        self.ops[s.op] = self.ops.get(s.op, 0) + 1
        tags = [f"layout={s.layout}"] if s.op != "moe_finalize" else [f"weights={s.weights_dtype}"]
        tags += [f"kernel={s.kernel}", f"pdl={s.pdl}"]
        for flag, on in (("add2", s.addends == 2), ("add", s.addends == 1), ("tap", s.tap),
                         ("snapshot", s.snapshot >= 0), ("row_pad", s.row_pad > 0), ("shared", s.shared),
                         ("norm", s.norm), ("remote", s.remote > 0), ("T>64", s.T > 64)):
            if on:
                tags.append(flag)
        for t in tags:
            self.variants[t] = self.variants.get(t, 0) + 1


def _inputs_unchanged(call: Call, before: dict[str, Tensor], outputs: dict[str, Tensor]) -> str | None:
    s = call.spec
    for name, old in before.items():
        now = call.buffers[name]
        if name == "bank" and s.snapshot >= 0 and "updated" in outputs:
            want = old.clone()
            call.bank_row(want, s.snapshot).copy_(outputs["updated"])
            if not same_bits(now, want):
                return f"bank buffer: not (unchanged except snapshot row {s.snapshot} == updated)"
        elif not same_bits(now, old):
            return f"input buffer {name!r} changed"
    return None


class _Progress:
    """tqdm where installed, else a line on stderr every few seconds."""

    def __init__(self, total: int, desc: str, quiet: bool):
        self.total, self.desc, self.quiet = total, desc, quiet
        self.n, self.t0, self.last = 0, time.perf_counter(), 0.0
        self.bar = None
        if not quiet:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="call" if desc == "calls" else "step", file=sys.stderr)
            except ImportError:
                self.bar = None

    def update(self, n: int, note: str = "") -> None:
        self.n += n
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(n)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= 5 or self.n == self.total:
            self.last = now
            rate = self.n / max(now - self.t0, 1e-9)
            print(f"[{self.desc}] {self.n}/{self.total} ({rate:.0f}/s) {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _capture(fn):
    """Warm-up on a side stream, then capture fn once (as tests/test_cuda_graphs_pdl.py does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def _graph_round(call: Call, stats: CallStats) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Captures the call, replays it over poisoned outputs (and a poisoned snapshot row) on the captured
    inputs, then again after fresh values were copied into its buffers; each replay must equal the eager
    call that follows it bit for bit. Returns the last eager outputs and the clones of the buffers taken
    right after the refill (what the caller's input check compares with)."""
    s = call.spec
    graph, captured = _capture(lambda: device_call(s, call))
    stats.graph_captures += 1
    eager, before = {}, {}
    for round_ in range(2):
        if round_ == 1:
            call.refill(s.seed ^ 0x5EED)  # spare bank rows NaN again, like every fresh buffer
            before = {k: b.clone() for k, b in call.buffers.items()}
        for t in captured.values():
            t.fill_(NAN)
        if s.snapshot >= 0:
            call.bank_row(call.buffers["bank"], s.snapshot).fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: t.clone() for k, t in captured.items()}
        row = call.bank_row(call.buffers["bank"], s.snapshot).clone() if s.snapshot >= 0 else None
        eager = device_call(s, call)
        torch.cuda.synchronize()
        stats.graph_replays += 1
        bad = [k for k in eager if not same_bits(replayed[k], eager[k])]
        if row is not None and not same_bits(row, eager["updated"]):
            bad.append("snapshot row")
        if bad:
            stats.graph_mismatches += 1
            stats.fail("graph", s, f"replay {round_} differs from the eager call in {bad}")
    del graph
    return eager, before


def run_calls(count: int, *, device: str = "cuda", streams: int = 4, seed: int = 0, start: int = 0,
              graph_every: int = 100, batch: int = 64, workers: int | None = None, max_tokens: int = 256,
              oracle_every: int | None = None, max_seconds: float | None = None, quiet: bool = False) -> dict:
    """`count` calls from index `start` (fewer when max_seconds runs out first: "stopped_early")."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"calls: device must be cpu or cuda, got {device!r}")
    cuda = device == "cuda"
    if cuda and not (torch.cuda.is_available() and attnres.backend_info()["cuda_devices"]):
        raise RuntimeError("calls: --device cuda needs the CUDA backend and a visible Hopper GPU")
    if oracle_every is None:
        oracle_every = 0 if cuda else 1
    dev = torch.device(device)
    workers = workers or max(1, (os.cpu_count() or 2) - (1 if cuda else 0))
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: intra-op threads only spin; the pool runs the checks in parallel
    cuda_streams = [torch.cuda.Stream() for _ in range(max(1, streams))] if cuda else []
    stats = CallStats()
    progress = _Progress(count, "calls", quiet)
    pool = ThreadPoolExecutor(max_workers=workers)
    futures: list[tuple[Spec, Future]] = []
    pending: list[tuple[Call, dict, dict]] = []
    t0 = time.perf_counter()
    stopped_early = False

    def collect(block: bool) -> None:
        keep = []
        for s, fut in futures:
            if not block and not fut.done():
                keep.append((s, fut))
                continue
            try:
                problems, oracle_problems = fut.result()
            except Exception as err:  # noqa: BLE001
                stats.errors += 1
                stats.fail("error", s, f"check raised {type(err).__name__}: {err}")
                continue
            stats.checked += 1
            if problems:
                stats.mismatches += 1
                stats.fail("mismatch", s, "; ".join(problems))
            if oracle_problems:
                stats.oracle_mismatches += 1
                stats.fail("oracle", s, "; ".join(oracle_problems))
        futures[:] = keep

    def flush() -> None:
        if cuda:
            torch.cuda.synchronize()
        for call, before, outputs in pending:
            s = call.spec
            why = _inputs_unchanged(call, before, outputs)
            if why:
                stats.input_mutations += 1
                stats.fail("input_mutation", s, why)
            cpu_views = {k: (None if t is None else t.cpu()) for k, t in call.views.items()}
            got = {k: t.cpu() for k, t in outputs.items()}
            oracle = oracle_every > 0 and s.index % oracle_every == 0
            stats.oracle_checks += oracle
            futures.append((s, pool.submit(_check_job, s, cpu_views, got, oracle)))
        pending.clear()
        collect(block=len(futures) > 8 * workers)

    try:
        for i in range(start, start + count):
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                stopped_early = True
                break
            s = draw_spec(seed, i, device, max_tokens)
            stats.count(s)
            graph = cuda and graph_every > 0 and (i - start) % graph_every == graph_every - 1
            try:
                if graph:
                    if pending:
                        flush()
                    call = Call(s, dev)
                    outputs, before = _graph_round(call, stats)
                else:
                    stream = cuda_streams[i % len(cuda_streams)] if cuda else None
                    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                        call = Call(s, dev)
                        before = {k: b.clone() for k, b in call.buffers.items()}
                        outputs = device_call(s, call)
            except Exception as err:  # noqa: BLE001  (a valid call that raises is a finding)
                stats.errors += 1
                stats.fail("error", s, f"{type(err).__name__}: {err}")
                progress.update(1)
                continue
            pending.append((call, before, outputs))
            if len(pending) >= batch:
                flush()
            progress.update(1, f"mismatches {stats.mismatches + stats.input_mutations + stats.graph_mismatches}")
        flush()
        collect(block=True)
    finally:
        pool.shutdown(wait=True)
        progress.close()
        torch.set_num_threads(torch_threads)
    wall = time.perf_counter() - t0
    return {
        "mode": "calls", "device": device, "seed": seed, "start": start, "calls": stats.calls,
        "checked": stats.checked, "distinct_shapes": len(stats.shapes), "ops": dict(sorted(stats.ops.items())),
        "variants": dict(sorted(stats.variants.items())), "streams": len(cuda_streams) if cuda else 0,
        "graph_captures": stats.graph_captures, "graph_replays": stats.graph_replays,
        "graph_mismatches": stats.graph_mismatches, "mismatches": stats.mismatches,
        "input_mutation_failures": stats.input_mutations, "errors": stats.errors,
        "oracle_checks": stats.oracle_checks, "oracle_mismatches": stats.oracle_mismatches,
        "wall_s": round(wall, 2), "calls_per_s": round(stats.calls / max(wall, 1e-9), 1), "workers": workers,
        "stopped_early": stopped_early,
        "failures": stats.failures,
        "ok": stats.mismatches + stats.input_mutations + stats.graph_mismatches + stats.errors
        + stats.oracle_mismatches == 0 and stats.checked == stats.calls - stats.errors,
    }


# ================================================================================================ chain
def _digest_weights(n: int, device) -> Tensor:
    g = torch.Generator().manual_seed(0xD16E57)
    return torch.randint(1, 1 << 20, (n,), generator=g, dtype=torch.int64).to(device)


class _ChainRun:
    """One chain (fold on or off): a shallow copy of the model with its settings, its bank, its input buffer,
    the step counter and the digest table, all on the device, so one step is capturable as a graph."""

    def __init__(self, model, fold: bool, x0: Tensor, embeddings: Tensor, steps: int, weights: Tensor):
        from attnres.models.kimi_k3 import ResidualSettings
        from attnres.models.kimi_k3.residual import PathRecord
        self.fold = fold
        self.model = copy.copy(model)
        self.model.settings = ResidualSettings(fold=fold)
        self.model.paths = PathRecord(keep=False)
        self.x = x0.clone()
        self.emb = embeddings
        self.bank = self.model.allocate_bank(x0.shape[0], fill=-3.0)
        self.step_index = torch.zeros((), dtype=torch.int64, device=x0.device)
        self.digests = torch.zeros(steps + 1, dtype=torch.int64, device=x0.device)
        self.w = weights
        self.last = None  # (KimiK3Output, ChainTrace) of the latest step (graph: the pool's tensors)

    def _digest(self, tensors: list[Tensor]) -> Tensor:
        total = torch.zeros((), dtype=torch.int64, device=self.x.device)
        for i, t in enumerate(tensors):
            b = bits(t).reshape(-1).to(torch.int64)
            total = total * 1000003 + (b * self.w[:b.numel()]).sum() + i
        return total

    def step(self) -> None:
        from attnres.models.kimi_k3 import ChainTrace
        trace = ChainTrace()
        out = self.model(self.x, bank=self.bank, trace=trace)
        self.last = (out, trace)
        state = [out.output, self.bank.storage] + [out.taps[k] for k in sorted(out.taps)]
        self.digests.index_copy_(0, self.step_index.reshape(1), self._digest(state).reshape(1))
        e = self.emb.index_select(0, self.step_index.remainder(self.emb.shape[0]).reshape(1))[0]
        self.x.copy_((out.output.float() + e.float()).to(BF16))
        self.step_index.add_(1)

    def reset(self, x0: Tensor) -> None:
        self.x.copy_(x0)
        self.step_index.zero_()
        self.digests.zero_()
        self.bank.storage.fill_(-3.0)


def _compare_state(a: _ChainRun, b: _ChainRun) -> list[str]:
    from attnres.models.kimi_k3 import compare_outputs, compare_traces
    (out_a, tr_a), (out_b, tr_b) = a.last, b.last
    diffs = compare_traces(tr_a, tr_b) + compare_outputs(out_a, out_b)
    if not same_bits(a.x, b.x):
        diffs.append("next input differs")
    return diffs


def _snapshot_state(run: _ChainRun):
    """Clones of everything a later comparison reads (graph tensors are rewritten by the next replay)."""
    from attnres.models.kimi_k3 import ChainTrace, KimiK3Output, SnapshotBank
    out, trace = run.last
    tr = ChainTrace(sites=[type(s)(s.site, s.prefix.clone(), s.output.clone(), None if s.tap is None else s.tap.clone())
                           for s in trace.sites], banks=[(layer, b.clone()) for layer, b in trace.banks])
    o = KimiK3Output(out.output.clone(), {k: v.clone() for k, v in out.taps.items()},
                     SnapshotBank(out.bank.storage.clone(), out.bank.layout), out.num_snapshots)
    return o, tr


def chain_config(device: str, layers: int | None, hidden: int | None, block: int | None):
    from attnres.models.kimi_k3 import KimiK3Config, kimi_k3_full_attention_layers
    if device == "cuda" or hidden == 7168:
        cfg = KimiK3Config.real()
        if layers is not None and layers != cfg.num_layers:
            caps = tuple(c for c in cfg.capture_layers if c < layers)
            cfg = cfg.with_(num_layers=layers, full_attention_layers=kimi_k3_full_attention_layers(layers),
                            capture_layers=caps)
        if block is not None:
            cfg = cfg.with_(snapshot_block=block)
        if hidden is not None and hidden != cfg.hidden_size:
            cfg = cfg.with_(hidden_size=hidden)
        return cfg
    return KimiK3Config.small(hidden_size=hidden or 256, num_layers=layers or 26, snapshot_block=block or 4)


def run_chain(steps: int, *, device: str = "cuda", tokens: int = 1, layers: int | None = None,
              hidden: int | None = None, block: int | None = None, check_every: int = 100, eager: bool = False,
              seed: int = 0, max_seconds: float | None = None, quiet: bool = False) -> dict:
    """`steps` dependent steps of both chains (fewer when max_seconds runs out first: "stopped_early")."""
    from attnres.models.kimi_k3 import KimiK3Model, ResidualSettings
    from attnres.models.kimi_k3.residual import FUSED_ADD2, PathRecord
    if device not in ("cpu", "cuda"):
        raise ValueError(f"chain: device must be cpu or cuda, got {device!r}")
    if steps < 1 or check_every < 1 or tokens < 1:
        raise ValueError("chain: steps, check_every and tokens must be >= 1")
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("chain: --device cuda needs a CUDA GPU")
    graphs = cuda and not eager
    cfg = chain_config(device, layers, hidden, block).with_(seed=seed)
    torch_threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = KimiK3Model(cfg, settings=ResidualSettings(fold=False), device=device, keep_paths=False)
    g = torch.Generator().manual_seed(seed * 7919 + 13)
    embeddings = torch.randn(97, tokens, cfg.hidden_size, generator=g).to(BF16).to(device)
    x0 = model.embed(tokens, step=seed)
    state_numel = max(x0.numel() * (2 + len(cfg.capture_layers)), cfg.num_snapshots * x0.numel())
    weights = _digest_weights(state_numel, device)
    runs = {fold: _ChainRun(model, fold, x0, embeddings, steps, weights) for fold in (True, False)}

    # How many sites take the fold per step (the path record of one eager step).
    probe = copy.copy(model)
    probe.settings, probe.paths = ResidualSettings(fold=True), PathRecord()
    probe(x0, bank=probe.allocate_bank(tokens, fill=-3.0))
    folded = len(probe.paths.select(path=FUSED_ADD2))

    diffs_total: list[str] = []
    checked_steps: list[int] = []
    first_bad: int | None = None

    def check(step: int, extra: list[str] | None = None) -> None:
        nonlocal first_bad
        diffs = _compare_state(runs[True], runs[False]) + (extra or [])
        checked_steps.append(step)
        if diffs and first_bad is None:
            first_bad = step
        diffs_total.extend(f"step {step}: {d}" for d in diffs[:10])

    graph_vs_eager: list[str] = []
    if graphs:
        # The eager step the graph must reproduce, run on a side stream: it is also the capture's warm-up
        # (plan cache, cuBLAS workspaces and lazy initialisation stay out of the graph).
        eager_state = {}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fold, r in runs.items():
                r.step()
                eager_state[fold] = _snapshot_state(r)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        compiled = {}
        for fold, r in runs.items():
            r.reset(x0)
            r.last = None
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                r.step()
            compiled[fold] = graph
        torch.cuda.synchronize()
        for r in runs.values():
            r.reset(x0)  # the capture did not run the step, but reset anyway: replays start from step 0
        torch.cuda.synchronize()
    progress = _Progress(steps, "chain", quiet)
    t_steps = time.perf_counter()
    stopped_early = False
    last_step = 0
    try:
        for step in range(1, steps + 1):
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                stopped_early = True
                break
            last_step = step
            for fold, r in runs.items():
                if graphs:
                    compiled[fold].replay()
                else:
                    r.step()
            if graphs and step == 1:
                torch.cuda.synchronize()
                from attnres.models.kimi_k3 import compare_outputs, compare_traces
                for fold, r in runs.items():
                    o, tr = eager_state[fold]
                    d = compare_traces(r.last[1], tr) + compare_outputs(r.last[0], o)
                    graph_vs_eager += [f"fold={fold}: {x}" for x in d[:10]]
            if step % check_every == 0 or step == steps:
                if cuda:
                    torch.cuda.synchronize()
                check(step)
            progress.update(1, f"diffs {len(diffs_total)}")
        if cuda:
            torch.cuda.synchronize()
        if stopped_early and last_step and last_step not in checked_steps:
            check(last_step)
    finally:
        progress.close()
        torch.set_num_threads(torch_threads)
    step_wall = time.perf_counter() - t_steps
    d_on, d_off = runs[True].digests[:last_step].cpu(), runs[False].digests[:last_step].cpu()
    digest_diff = (d_on != d_off).nonzero().flatten().tolist()
    first_digest = digest_diff[0] + 1 if digest_diff else None
    steps_done = int(runs[True].step_index.item())
    ok = not diffs_total and not digest_diff and not graph_vs_eager and steps_done == last_step
    return {
        "mode": "chain", "device": device, "graph": graphs, "seed": seed, "tokens": tokens,
        "layers": cfg.num_layers, "hidden": cfg.hidden_size, "snapshot_block": cfg.snapshot_block,
        "sites_per_step": 2 * cfg.num_layers + 1, "folded_sites_per_step": folded, "steps": steps_done,
        "checked_steps": len(checked_steps), "check_every": check_every,
        "mismatched_checks": len({d.split(":")[0] for d in diffs_total}), "first_mismatch_step": first_bad,
        "digest_mismatch_steps": len(digest_diff), "first_digest_mismatch_step": first_digest,
        "graph_vs_eager_diffs": graph_vs_eager[:10], "diffs": diffs_total[:20],
        "mismatches": len({d.split(":")[0] for d in diffs_total}) + len(digest_diff) + (1 if graph_vs_eager else 0),
        "wall_s": round(time.perf_counter() - t0, 2), "stopped_early": stopped_early,
        "steps_per_s": round(2 * last_step / max(step_wall, 1e-9), 1),  # both chains' steps
        "ok": ok,
    }


# ================================================================================================ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnres.stress", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("calls", help="randomly shaped calls checked against the CPU backend")
    c.add_argument("--count", type=int, default=1000)
    c.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    c.add_argument("--streams", type=int, default=4, help="CUDA streams, used round-robin")
    c.add_argument("--graph-every", type=int, default=100, help="capture + replay every n-th call (0: never)")
    c.add_argument("--batch", type=int, default=64, help="calls in flight between synchronisations")
    c.add_argument("--workers", type=int, default=0, help="CPU check threads (0: cores, minus one on CUDA)")
    c.add_argument("--max-tokens", type=int, default=256, help="largest T of the rare large calls")
    c.add_argument("--oracle-every", type=int, default=-1,
                   help="also check every n-th call against the float64 oracle (-1: every call on cpu, none on cuda)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--start", type=int, default=0, help="first call index (to rerun one failing call: --count 1)")
    c.add_argument("--max-seconds", type=float, default=None, help="stop issuing calls after this long")
    c.add_argument("--quiet", action="store_true")
    h = sub.add_parser("chain", help="the Kimi K3 decode chain, fold on vs off, bit for bit")
    h.add_argument("--steps", type=int, default=100)
    h.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    h.add_argument("--tokens", type=int, default=1)
    h.add_argument("--layers", type=int, default=None, help="default: 93 on cuda, 26 (small config) on cpu")
    h.add_argument("--hidden", type=int, default=None, help="default: 7168 on cuda, 256 on cpu")
    h.add_argument("--block", type=int, default=None, help="snapshot block (default 12 on cuda, 4 on cpu)")
    h.add_argument("--check-every", type=int, default=100)
    h.add_argument("--eager", action="store_true", help="no CUDA graphs")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--max-seconds", type=float, default=None, help="stop stepping after this long")
    h.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.mode == "calls":
            if args.count < 1 or args.streams < 1 or args.batch < 1 or args.max_tokens < 1:
                raise ValueError("calls: --count, --streams, --batch and --max-tokens must be >= 1")
            summary = run_calls(args.count, device=args.device, streams=args.streams, seed=args.seed,
                                start=args.start, graph_every=args.graph_every, batch=args.batch,
                                workers=args.workers or None, max_tokens=args.max_tokens,
                                oracle_every=None if args.oracle_every < 0 else args.oracle_every,
                                max_seconds=args.max_seconds, quiet=args.quiet)
        else:
            summary = run_chain(args.steps, device=args.device, tokens=args.tokens, layers=args.layers,
                                hidden=args.hidden, block=args.block, check_every=args.check_every,
                                eager=args.eager, seed=args.seed, max_seconds=args.max_seconds, quiet=args.quiet)
    except (ValueError, RuntimeError) as err:
        print(f"attnres.stress: {err}", file=sys.stderr)
        return 2
    for f in summary.get("failures", [])[:5]:
        print(f"FAILED {f['kind']} call {f['call']}: {f['detail']}\n  spec {json.dumps(f['spec'])}", file=sys.stderr)
    print(json.dumps(summary, sort_keys=True))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
