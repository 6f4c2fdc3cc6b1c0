"""Property-based tests (hypothesis) of every op against the float64 oracle and the contract's exact invariants.

Each example draws a shape (T 1..40, N 1..16, H a multiple of 8 in 8..2048, rarely one of the large fixed
sizes), a bank layout, padded prefix rows, an eps pair (0, tiny, fp32-subnormal, 1e-6..1e-1, unequal pairs)
and a *magnitude class* for some of the tokens (the others stay "normal"):

  normal     rows at the helpers' realistic magnitudes
  large      every candidate scaled by 1e10..1e14 (large but inside fp32's range for a sum of squares)
  huge       some candidates scaled by 1e28..1e31: their fp32 sum of squares overflows
  subnormal  every candidate and addend a bf16 subnormal
  cancel     candidates +B, -B, +B, ... (B orthogonal to q) plus a 1e-3..1e-1 perturbation
  equal      every bank row equal to the updated prefix P
  dominant   one candidate aligned with q, its logit about 30 above the rest
  zero       some (sometimes all) candidates all-zero rows

Where the contract's tolerance rule (reference.check_close) is meaningful it is applied per class of tokens;
where it is ill-posed the test checks what the contract does pin instead. The reasoning, case by case:

* Rounding flips. The library rounds an fp32 sum, the oracle a float64 one, so a value within the fp32
  error of a bf16 rounding midpoint may round the other way (measured on the CPU: ~1 row in 1000 at H = 8).
  Over a large tensor one flipped ulp is invisible to the rule; over a tiny one (a single flipped ulp costs
  >= 1e-3 of relative L2) it is not, so there `close` also accepts results within 1 ulp (mixture) or 2 ulps
  (output: the norm rounds twice) of the oracle elementwise — never a wider error.
* Cancellation. When the mixture is a near-cancelling sum (condition number kappa = |sum p |V|| / |sum p V|
  above KAPPA_MAX), fp32 rounding of the probabilities is amplified kappa times: the rule is only applied
  below KAPPA_MAX. Likewise a logit is a dot product over H terms: where the rule over a class's few logits
  fails, each logit must be within the fp32 error bound of its dot product instead (close_diag).
* bf16 subnormals carry 1..7 significant bits, so a legitimate last-bit difference in the fp32 sum is a
  >= 1% change of an element: the mixture is checked elementwise to 1 ulp (2^-133), the logits (fp32 products
  of subnormals) not at all, the output against the two-rounding norm of the library's own mixture.
* fp32 range. Every step of the contract is fp32. A candidate whose fp32 sum of squares overflows (huge)
  gets rsigma = 0 and logit 0, and a mixture whose sum of squares overflows normalizes to zeros; with eps = 0
  a row whose sum of squares is 0 in fp32 (zero, or subnormal: the squares underflow) gives 0 * inf = NaN
  exactly as the contract's formula (and PyTorch's fp32 RMSNorm) does. The float64 oracle does not model
  fp32 range, so these tokens are checked for the invariants only; the oracle is fed the eps values rounded
  to fp32, as the library uses them.

Exact invariants checked on every example: `updated` equals PyTorch's `prefix + (add + add2)` bit for bit;
the mixture lies elementwise between the smallest and the largest candidate; all-equal candidates give that
candidate; N = 1 gives P;
the probabilities sum to 1 within 1e-6; outputs are finite where the contract's fp32 formulas are; inputs
other than the snapshot row are never modified; moe_finalize's pre-norm value equals the fp32 emulation bit
for bit (docs/ops/moe_finalize.md), and all-equal routed rows with weights summing to 1 give that row.

Budget: FUZZ_EXAMPLES per (test, magnitude class) on the CPU, derandomized (CI sees the same examples every
run). ATTNRES_HYPOTHESIS_EXAMPLES=<n> sets that count for every property test (e.g. 2000 for a GPU run);
docs/reliability.md has the numbers and the commands.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (pip install hypothesis)")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import attnres  # noqa: E402
from attnres import moe, reference  # noqa: E402
from helpers import (BF16, LAYOUTS, Inputs, assert_same_bits, assert_storage_unchanged, bits,  # noqa: E402
                     kernel_options, make_inputs, oracle)

F32 = torch.float32
LARGE_H = (4096, 7168, 8192, 16384)
LARGE_D = (3584, 4096, 7168, 16384)
CLASSES = ("normal", "large", "huge", "subnormal", "cancel", "equal", "dominant", "zero")
KAPPA_MAX = 500.0  # above it the contract's tolerance is not meaningful for a cancelling sum (see above)
FLIP_BUDGET = 1e-3  # a single flipped ulp costing this much relative L2 makes the tensor "tiny"
PROB_SUM_TOL = 1e-6
TINY_EPS = (1e-30, 1e-40, 1e-45, 1e-60)  # 1e-40 and 1e-45 are fp32 subnormals, 1e-60 is 0 in fp32


# ------------------------------------------------------------------------------------------------- budget
def _examples(default: int) -> int:
    raw = os.environ.get("ATTNRES_HYPOTHESIS_EXAMPLES", "").strip()
    if not raw:
        return default
    try:
        n = int(raw, 10)
    except ValueError:
        raise ValueError(f"ATTNRES_HYPOTHESIS_EXAMPLES must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"ATTNRES_HYPOTHESIS_EXAMPLES must be a positive integer, got {raw!r}")
    return n


def fuzz(default: int):
    """Reproducible settings: derandomized (the examples depend only on the test function), no example
    database (nothing written into the tree), no deadline (CPU timing varies on CI)."""
    return settings(max_examples=_examples(default), deadline=None, derandomize=True, database=None,
                    print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# Examples per (test, magnitude class) on the CPU: every class gets its own budget, so coverage does not
# depend on how hypothesis happens to spread one draw. The file's CPU time is in docs/reliability.md.
FUZZ_EXAMPLES = {"attn_res": 40, "attn_res_rmsnorm": 40, "attn_res_add_rmsnorm": 60, "persistent": 20,
                 "moe_finalize": 60}


# ---------------------------------------------------------------------------------------------- strategies
def _log_range(lo: float, hi: float):
    a, b = math.log10(lo), math.log10(hi)
    return st.integers(0, 1000).map(lambda i: float(10 ** (a + (b - a) * i / 1000)))


EPS = st.one_of(st.just(0.0), st.just(1e-5), st.sampled_from(TINY_EPS), _log_range(1e-6, 1e-1))


def _f32(x: float) -> float:
    """The value the library computes with (eps and scale are fp32 inside every backend)."""
    return float(torch.tensor(x, dtype=F32))


@dataclass(frozen=True)
class AttnSpec:
    """One drawn attention-residual case (hypothesis prints it on failure; build() makes the tensors)."""

    T: int
    N: int
    H: int
    layout: str
    row_pad: int
    weight_2d: bool
    rms_eps: float
    norm_eps: float
    primary: str  # the magnitude class of the tokens in `special`
    special: tuple  # per token: True = primary class, False = normal
    addends: int
    tap: bool
    snapshot: bool
    seed: int

    def classes(self) -> list[str]:
        return [self.primary if s else "normal" for s in self.special]


@st.composite
def attn_specs(draw, device: str, primary: str, addends=(0,), tap=(False,), snapshot=(False,)):
    if draw(st.integers(0, 15)) == 0:  # rarely: a large fixed H, few tokens (CPU time)
        H = draw(st.sampled_from(LARGE_H))
        T = draw(st.integers(1, 4))
    else:
        H = 8 * draw(st.integers(1, 256))
        T = draw(st.integers(1, 40))
    N = draw(st.integers(1, 16))
    # CUDA kernels need 16-byte-aligned token strides; the CPU reads any stride.
    pads = (0, 8, 24) if device == "cuda" else (0, 3, 8, 24)
    special = tuple(draw(st.lists(st.booleans(), min_size=T, max_size=T)))
    return AttnSpec(T=T, N=N, H=H, layout=draw(st.sampled_from(LAYOUTS)), row_pad=draw(st.sampled_from(pads)),
                    weight_2d=draw(st.booleans()), rms_eps=draw(EPS), norm_eps=draw(EPS), primary=primary,
                    special=special, addends=draw(st.sampled_from(addends)), tap=draw(st.sampled_from(tap)),
                    snapshot=draw(st.sampled_from(snapshot)), seed=draw(st.integers(0, 2**31 - 1)))


# ------------------------------------------------------------------------------------------ building a case
@dataclass
class AttnCase:
    spec: AttnSpec
    inp: Inputs
    classes: list[str]
    rms_eps32: float
    norm_eps32: float


def _subnormal_row(g: torch.Generator, H: int) -> torch.Tensor:
    """bf16 subnormals m * 2^-133, 1 <= |m| <= 127 (exactly representable)."""
    m = torch.randint(-127, 128, (H,), generator=g).double()
    m = torch.where(m == 0, torch.ones_like(m), m)
    return m * 2.0 ** -133


def _event(what: str) -> None:
    if hypothesis.currently_in_test_context():
        event(what)


def _bucket(v: int, edges) -> str:
    lo = 0
    for e in edges:
        if v <= e:
            return f"{lo + 1}..{e}"
        lo = e
    return f">{lo}"


def build_attn(spec: AttnSpec, device: str) -> AttnCase:
    T, N, H = spec.T, spec.N, spec.H
    # Coverage, shown by pytest --hypothesis-show-statistics.
    _event(f"T {_bucket(T, (1, 4, 16, 40))}")
    _event(f"N {_bucket(N, (1, 4, 9, 16))}")
    _event(f"H {_bucket(H, (64, 512, 2048, 16384))}")
    K = N - 1
    inp = make_inputs(T, N, H, layout=spec.layout, addends=spec.addends, seed=spec.seed, device=device,
                      rms_eps=spec.rms_eps, norm_eps=spec.norm_eps, row_pad=spec.row_pad, weight_2d=spec.weight_2d,
                      spare_rows=2)
    classes = spec.classes()
    g = torch.Generator().manual_seed(spec.seed ^ 0x5EED)
    rnd = random.Random(spec.seed)

    if "dominant" in classes:
        # Scale the pseudo-query so that a candidate aligned with q has a logit of about 30 (H * rms(q)).
        q = inp.rms_weight.cpu().double() * inp.res_weight.cpu().double().reshape(H)
        factor = 30.0 / (H * float(q.pow(2).mean().sqrt()))
        inp.res_weight.copy_((inp.res_weight.cpu().double() * factor).to(BF16))
    q = inp.rms_weight.cpu().double() * inp.res_weight.cpu().double().reshape(H)
    q_dir = q / q.pow(2).mean().sqrt()

    bank = inp.block_residual  # [K, T, H] view (writable)
    addends = [a for a in (inp.add, inp.add2) if a is not None]

    def addend_sum(t: int) -> torch.Tensor | None:  # S as the prefix update sees it (bf16)
        if not addends:
            return None
        s = addends[0][t].cpu()
        return s if len(addends) == 1 else s + addends[1][t].cpu()

    def set_prefix(t: int, target: torch.Tensor) -> None:
        """Makes P[t] = bf16(target) up to one bf16 rounding: layer_residual = target - S."""
        s = addend_sum(t)
        row = target if s is None else target - s.double()
        inp.layer_residual[t].copy_(row.to(BF16))

    def scale_token_inputs(t: int, f: float, *, prefix: bool, rows) -> None:
        for k in rows:
            bank[k, t].copy_((bank[k, t].cpu().double() * f).to(BF16))
        if prefix:
            for x in (inp.layer_residual, *addends):
                x[t].copy_((x[t].cpu().double() * f).to(BF16))

    for t, cls in enumerate(classes):
        if cls == "normal":
            continue
        if cls == "large":
            scale_token_inputs(t, 10.0 ** rnd.uniform(10, 14), prefix=True, rows=range(K))
        elif cls == "huge":
            picks = [rnd.random() < 0.5 for _ in range(N)]
            if not any(picks):
                picks[rnd.randrange(N)] = True
            for n in range(N):
                if picks[n]:
                    scale_token_inputs(t, 10.0 ** rnd.uniform(28, 31), prefix=n == K, rows=[n] if n < K else [])
        elif cls == "subnormal":
            for k in range(K):
                bank[k, t].copy_(_subnormal_row(g, H).to(BF16))
            for x in (inp.layer_residual, *addends):
                x[t].copy_(_subnormal_row(g, H).to(BF16))
        elif cls == "cancel":
            b = torch.randn(H, generator=g, dtype=torch.float64)
            b = b - (b @ q) / (q @ q) * q  # orthogonal to q: the +B and -B logits are both ~0
            b = b / b.pow(2).mean().sqrt() * rnd.uniform(0.5, 4.0)
            rho = 10.0 ** rnd.uniform(-3, -1)
            for n in range(N):
                noise = rho * b.abs().mean() * torch.randn(H, generator=g, dtype=torch.float64)
                target = (b if n % 2 == 0 else -b) + noise
                if n < K:
                    bank[n, t].copy_(target.to(BF16))
                else:
                    set_prefix(t, target)
        elif cls == "dominant":
            star = rnd.randrange(N)
            s = rnd.uniform(0.5, 4.0)
            target = s * (q_dir + 0.1 * torch.randn(H, generator=g, dtype=torch.float64))
            if star < K:
                bank[star, t].copy_(target.to(BF16))
            else:
                set_prefix(t, target)
        elif cls == "zero":
            picks = [rnd.random() < 0.5 for _ in range(N)]
            if rnd.random() < 0.3 or not any(picks):
                picks = [True] * N
            for n in range(N):
                if not picks[n]:
                    continue
                if n < K:
                    bank[n, t].zero_()
                else:
                    s = addend_sum(t)
                    # bf16(-S + S) = +0 exactly; without addends the prefix itself is zero
                    inp.layer_residual[t].copy_(torch.zeros(H, dtype=BF16) if s is None else -s)
        elif cls == "equal":
            pass  # after every prefix is final (below)
        else:
            raise AssertionError(cls)

    if "equal" in classes:
        P = reference.prefix_update(inp.layer_residual.cpu(), *(a.cpu() for a in addends))
        for t, cls in enumerate(classes):
            if cls == "equal":
                for k in range(K):
                    bank[k, t].copy_(P[t])
    return AttnCase(spec=spec, inp=inp, classes=classes, rms_eps32=_f32(spec.rms_eps), norm_eps32=_f32(spec.norm_eps))


# ------------------------------------------------------------------------------------------------ checking
def _ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 bits as integers ordered like the values (+0 and -0 both 0): differences count ulps."""
    b = bits(t).to(torch.int32)
    return torch.where(b >= 0, b, -(b & 0x7FFF))


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return (_ordered(actual.to(BF16)) - _ordered(expected.to(BF16))).abs()


def _flip_budget(expected: torch.Tensor) -> float:
    """Relative L2 that one flipped bf16 ulp of the largest element costs."""
    e = expected.detach().cpu().float()
    norm = float(e.double().norm())
    if norm == 0:
        return math.inf
    _, ex = torch.frexp(e.abs().clamp(min=2.0 ** -126))
    ulp = torch.ldexp(torch.ones_like(e), ex - 8)
    return float(ulp.max()) / norm


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, *, ulps: int) -> None:
    """The contract's rule; on a tensor too small for it (see the module docstring), elementwise <= ulps."""
    try:
        reference.check_close(actual.detach().cpu(), expected, what)
    except AssertionError as e:
        if _flip_budget(expected) < FLIP_BUDGET:
            raise
        d = ulp_distance(actual.detach().cpu(), expected)
        if not torch.isfinite(actual.detach().cpu().float()).all() or int(d.max()) > ulps:
            raise AssertionError(f"{e}; elementwise {int(d.max())} ulps (tiny tensor: <= {ulps} allowed)") from None


def close_diag(actual: torch.Tensor, expected: torch.Tensor, what: str, bound: torch.Tensor | None = None) -> None:
    """fp32 diagnostics: non-finite entries where the oracle's are (N = 1 with rms_eps = 0 and a zero row has
    rsigma = inf and logit = inf * 0 = NaN by the contract's formula), the contract's rule on the rest.

    The rule is over the tensor; the tokens of one class can be a handful of logits, and a single logit is a
    dot product over H terms that may cancel (condition number sum|V q| / |sum V q| of 100 or more at large H),
    where fp32 cannot give 1e-4 elementwise. There, with `bound`, each logit must instead be within the fp32
    error bound of its dot product (rsigma itself is checked by the rule)."""
    a, e = actual.double(), expected.double()
    fin = torch.isfinite(e)
    same_nan = torch.equal(torch.isnan(a), torch.isnan(e))
    same_inf = torch.equal(torch.isinf(a), torch.isinf(e)) and torch.equal(a[torch.isinf(e)], e[torch.isinf(e)])
    assert same_nan and same_inf, f"{what}: non-finite entries differ from the oracle's"
    try:
        reference.check_close(actual[fin], expected[fin], what)
    except AssertionError as err:
        if bound is None:
            raise
        excess = float(((a - e).abs() - bound)[fin].max())
        if excess > 0:
            raise AssertionError(f"{err}; and beyond the fp32 dot-product error bound by {excess:.2e}") from None


def _logit_error_bound(case: AttnCase, V: torch.Tensor, ref: reference.Result) -> torch.Tensor:
    """[N, T]: a worst-case fp32 error of logit = rsigma * sum_h V q: the sum's rounding error is at most
    (depth) * 2^-24 * sum_h |V q| for a summation tree of that depth (CPU: 8 lanes of H / 8 terms and a
    3-level tree; CUDA: 8 terms per thread, a warp butterfly, warps and cluster ranks in order: < 64 levels),
    plus a few ulps of rsigma and of the product."""
    H = case.inp.H
    q = case.inp.rms_weight.cpu().double() * case.inp.res_weight.cpu().double().reshape(H)
    depth = H // 8 + 64
    return ref.rsigma * depth * 2.0 ** -24 * (V.abs() * q.abs()).sum(-1) + 8 * 2.0 ** -24 * ref.logits.abs()


def _kappa(probs: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Per token: |sum_n p |V_n|| / |sum_n p V_n| (float64; inf when the mixture is exactly zero)."""
    p = probs.unsqueeze(-1)
    num = (p * V.abs()).sum(0).norm(dim=-1)
    den = (p * V).sum(0).norm(dim=-1)
    return torch.where(den > 0, num / den, torch.full_like(num, math.inf))


class Verdict:
    """Per token, which checks the contract makes meaningful (module docstring)."""

    def __init__(self, case: AttnCase, ref: reference.Result, V: torch.Tensor, P: torch.Tensor):
        self.modes: list[str] = []
        kappa = _kappa(ref.probs.nan_to_num(0.0), V)
        mix_finite = torch.isfinite(ref.mixture.float()).all(-1)
        out_finite = torch.isfinite(ref.output.float()).all(-1)
        for t, cls in enumerate(case.classes):
            if cls in ("normal", "large", "equal", "dominant"):
                mode = "oracle"
            elif cls == "cancel":
                mode = "oracle" if float(kappa[t]) <= KAPPA_MAX else "finite"
            elif cls == "zero":
                mode = "oracle" if bool(mix_finite[t] and out_finite[t]) else "nan_as_oracle"
            elif cls == "subnormal":
                # with rms_eps = 0 the squares underflow: rsigma = inf and a NaN/inf logit (N = 1: still P)
                mode = "subnormal" if case.rms_eps32 > 0 or case.inp.N == 1 else "fp32_undefined"
            elif cls == "huge":
                mode = "finite"
            else:
                raise AssertionError(cls)
            self.modes.append(mode)
            _event(f"token check {mode}")

    def tokens(self, mode: str) -> list[int]:
        return [t for t, m in enumerate(self.modes) if m == mode]


def candidates(case: AttnCase, ref_prefix: torch.Tensor) -> torch.Tensor:
    """[N, T, H] float64: the bank rows, then P."""
    return torch.cat([case.inp.block_residual.cpu().double(), ref_prefix.double().unsqueeze(0)], 0)


def verify(case: AttnCase, ctx: str, *, mixture=None, output=None, updated=None, diag=None, norm: bool):
    """Every check of the module docstring for one call's results (None = the call has no such output)."""
    inp = case.inp
    n_add = case.spec.addends
    ref = oracle(inp, addends=n_add, norm=norm, rms_eps=case.rms_eps32, norm_eps=case.norm_eps32)
    P = reference.prefix_update(inp.layer_residual.cpu(), *(a.cpu() for a in (inp.add, inp.add2)[:n_add]))
    V = candidates(case, P)
    verdict = Verdict(case, ref, V, P)
    mixture = None if mixture is None else mixture.detach().cpu()
    output = None if output is None else output.detach().cpu()

    if updated is not None:
        assert_same_bits(updated, ref.updated, f"{ctx}: updated vs PyTorch's prefix + (add + add2)")

    # --- accuracy against the oracle, per mode
    idx = verdict.tokens("oracle")
    if idx:
        if mixture is not None:
            close(mixture[idx], ref.mixture[idx], f"{ctx}: mixture [oracle tokens {idx}]", ulps=1)
        if output is not None and norm:
            close(output[idx], ref.output[idx], f"{ctx}: output [oracle tokens {idx}]", ulps=2)
        if diag is not None:
            for name, got, want in zip(("rsigma", "probs", "logits"), diag, (ref.rsigma, ref.probs, ref.logits)):
                bound = _logit_error_bound(case, V, ref)[:, idx] if name == "logits" else None
                close_diag(got.cpu()[:, idx], want[:, idx], f"{ctx}: {name} [oracle tokens {idx}]", bound)
    idx = verdict.tokens("nan_as_oracle")
    for t in idx:  # contract-defined 0 * inf (eps = 0 and zero rows): NaN exactly where the oracle has NaN
        for name, got, want in (("mixture", mixture, ref.mixture), ("output", output, ref.output if norm else None)):
            if got is None or want is None:
                continue
            same = torch.equal(torch.isnan(got[t].float()), torch.isnan(want[t].float()))
            assert same, f"{ctx}: {name}[{t}] NaN pattern differs from the oracle's (eps = 0 with a zero row)"
            fin = torch.isfinite(want[t].float())
            close(got[t][fin], want[t][fin], f"{ctx}: {name}[{t}] finite part", ulps=2)
    idx = verdict.tokens("subnormal")
    if idx:
        if mixture is not None:
            d = ulp_distance(mixture[idx], ref.mixture[idx])
            assert int(d.max()) <= 1, f"{ctx}: subnormal mixture {int(d.max())} ulps from the oracle (tokens {idx})"
            if output is not None and norm and case.norm_eps32 > 0:
                own = reference.two_rounding_rmsnorm(mixture[idx], inp.norm_weight.cpu(), case.norm_eps32)
                close(output[idx], own, f"{ctx}: output of a subnormal mixture vs its two-rounding norm", ulps=2)
        if diag is not None:
            # rms_eps = 0 (N = 1 only): the fp32 rsigma is 1/sqrt(0) = inf, the float64 oracle's finite
            for name, got, want in zip(("rsigma", "probs"), diag[:2], (ref.rsigma, ref.probs)):
                if name == "probs" or case.rms_eps32 > 0:
                    reference.check_close(got.cpu()[:, idx], want[:, idx], f"{ctx}: {name} [subnormal tokens {idx}]")

    # --- exact invariants
    defined = [t for t, m in enumerate(verdict.modes) if m not in ("fp32_undefined", "nan_as_oracle")]
    if mixture is not None and defined:
        m = mixture[defined].double()
        assert torch.isfinite(m).all(), f"{ctx}: non-finite mixture for finite inputs (tokens {defined})"
        lo, hi = V[:, defined].min(0).values, V[:, defined].max(0).values
        assert bool(((m >= lo) & (m <= hi)).all()), f"{ctx}: mixture outside the candidates' elementwise range"
        for t in defined:
            if case.classes[t] == "equal":
                assert torch.equal(mixture[t], P[t]), f"{ctx}: token {t}: all-equal candidates, mixture != P"
        if inp.N == 1:
            assert torch.equal(mixture[defined], P[defined]), f"{ctx}: N = 1, mixture != P"
    if output is not None and norm:
        fin = [t for t in defined if not (verdict.modes[t] == "subnormal" and case.norm_eps32 == 0)]
        assert torch.isfinite(output[fin].float()).all(), f"{ctx}: non-finite output for finite inputs"
    if diag is not None and defined:
        p = diag[1].cpu().double()[:, defined]
        assert bool(((p >= 0) & (p <= 1)).all()), f"{ctx}: probabilities outside [0, 1]"
        worst = float((p.sum(0) - 1).abs().max())
        assert worst <= PROB_SUM_TOL, f"{ctx}: probabilities sum to 1 +- {worst:.2e} (need <= {PROB_SUM_TOL})"


# =========================================================================================== attn_res family
@pytest.mark.parametrize("primary", CLASSES)
@fuzz(FUZZ_EXAMPLES["attn_res"])
@given(data=st.data())
def test_attn_res_properties(device, primary, data):
    case = build_attn(data.draw(attn_specs(device, primary), label="spec"), device)
    inp = case.inp
    before = inp.storage_snapshot()
    for kernel, opts in kernel_options(device, "attn_res", inp.T, inp.N, inp.H, diagnostics=True):
        ctx = f"attn_res kernel={kernel}"
        mixture, rsigma, probs, logits = attnres.attn_res(inp.layer_residual, inp.block_residual, inp.res_weight,
                                                          inp.rms_weight, inp.rms_eps, options=opts)
        verify(case, ctx, mixture=mixture, diag=(rsigma, probs, logits), norm=False)
    assert_storage_unchanged(before, inp)


@pytest.mark.parametrize("primary", CLASSES)
@fuzz(FUZZ_EXAMPLES["attn_res_rmsnorm"])
@given(data=st.data())
def test_attn_res_rmsnorm_properties(device, primary, data):
    case = build_attn(data.draw(attn_specs(device, primary, tap=(False, True)), label="spec"), device)
    inp, tap = case.inp, case.spec.tap
    before = inp.storage_snapshot()
    for kernel, opts in kernel_options(device, "attn_res_rmsnorm", inp.T, inp.N, inp.H, tap=tap):
        r = attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight,
                                     inp.norm_weight, inp.rms_eps, inp.norm_eps, return_mixture=tap, options=opts)
        output, mixture = r if tap else (r, None)
        verify(case, f"attn_res_rmsnorm tap={tap} kernel={kernel}", mixture=mixture, output=output, norm=True)
    assert_storage_unchanged(before, inp)


@pytest.mark.parametrize("primary", CLASSES)
@fuzz(FUZZ_EXAMPLES["attn_res_add_rmsnorm"])
@given(data=st.data())
def test_attn_res_add_rmsnorm_properties(device, primary, data):
    spec = data.draw(attn_specs(device, primary, addends=(1, 2), tap=(False, True), snapshot=(False, True)),
                     label="spec")
    case = build_attn(spec, device)
    inp = case.inp
    # A contiguous bank has no row past K; the others write their first or second spare row.
    slot = None
    if spec.snapshot and inp.spare_slot is not None:
        slot = inp.spare_slot + (spec.seed & 1)
    for kernel, opts in kernel_options(device, "attn_res_add_rmsnorm", inp.T, inp.N, inp.H, add=True,
                                       add2=spec.addends == 2, tap=spec.tap, snapshot=slot is not None):
        before = inp.storage_snapshot()
        r = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, inp.res_weight,
                                         inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                         layer_residual_add2=inp.add2, return_mixture=spec.tap, snapshot_slot=slot,
                                         options=opts)
        updated, output, mixture = r if spec.tap else (*r, None)
        ctx = f"attn_res_add_rmsnorm tap={spec.tap} slot={slot} kernel={kernel}"
        verify(case, ctx, mixture=mixture, output=output, updated=updated, norm=True)
        # The snapshot row holds P (= updated) bit for bit; every other byte of every input is unchanged.
        assert_storage_unchanged(before, inp, except_bank_row=slot,
                                 expected_row=updated.cpu() if slot is not None else None)


@pytest.mark.parametrize("primary", CLASSES)
@fuzz(FUZZ_EXAMPLES["persistent"])
@given(data=st.data())
def test_attn_res_add_rmsnorm_persistent_properties(device, primary, data):
    spec = data.draw(attn_specs(device, primary, addends=(0, 1)), label="spec")
    case = build_attn(spec, device)
    inp = case.inp
    with_add = spec.addends == 1
    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=inp.T, candidates=inp.N, hidden=inp.H, device=device,
                     add=with_add, options=attnres.Options(topology="persistent"))
    before = inp.storage_snapshot()
    call = lambda: attnres.attn_res_add_rmsnorm_persistent(  # noqa: E731
        inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps,
        inp.norm_eps, layer_residual_add=inp.add if with_add else None)
    if not p.accepted:
        # Only CUDA may decline (the CPU backend takes every call): the op raises the plan's reason.
        assert device == "cuda", p.decline
        with pytest.raises(attnres.UnsupportedError):
            call()
    else:
        updated, output = call()
        assert (updated is None) == (not with_add)
        verify(case, f"attn_res_add_rmsnorm_persistent kernel={p.kernel}", output=output, updated=updated, norm=True)
    assert_storage_unchanged(before, inp)


# ============================================================================================= moe_finalize
@dataclass(frozen=True)
class MoeSpec:
    T: int
    k: int
    D: int
    remote: float
    duplicates: bool  # routes of a token may share a row
    weights_dtype: str
    shared: bool
    norm: bool
    scale: float
    eps: float
    row_pad: int
    spare_rows: int
    primary: str
    special: tuple
    seed: int

    def classes(self) -> list[str]:
        return [self.primary if s else "normal" for s in self.special]


MOE_CLASSES = ("normal", "huge", "subnormal", "cancel", "equal", "dominant", "zero")


@st.composite
def moe_specs(draw, primary: str):
    if draw(st.integers(0, 15)) == 0:
        D = draw(st.sampled_from(LARGE_D))
        T = draw(st.integers(1, 4))
    else:
        D = 8 * draw(st.integers(1, 256))
        T = draw(st.integers(1, 40))
    scale = draw(st.one_of(st.sampled_from([1.0, -1.5, 0.5, 2.827]), st.floats(-4.0, 4.0, allow_nan=False)))
    return MoeSpec(T=T, k=draw(st.integers(1, 32)), D=D, remote=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
                   duplicates=draw(st.booleans()), weights_dtype=draw(st.sampled_from(["f32", "bf16"])),
                   shared=draw(st.booleans()), norm=draw(st.booleans()), scale=scale, eps=draw(EPS),
                   row_pad=draw(st.sampled_from([0, 8, 24])), spare_rows=draw(st.sampled_from([0, 1, 8])),
                   primary=primary,
                   special=tuple(draw(st.lists(st.booleans(), min_size=T, max_size=T))),
                   seed=draw(st.integers(0, 2**31 - 1)))


@dataclass
class MoeCase:
    spec: MoeSpec
    rows: torch.Tensor  # [R, D] view of storage (a NaN row before it, NaN column padding)
    weights: torch.Tensor
    index: torch.Tensor
    shared: torch.Tensor | None
    norm_weight: torch.Tensor | None
    storage: dict
    classes: list[str]
    exact_one: list[bool]  # per token: all local rows equal and the weights sum to exactly 1


def build_moe(spec: MoeSpec, device: str) -> MoeCase:
    """Every row no route names (padding rows, the row before rows[0], column padding) holds NaN."""
    T, k, D = spec.T, spec.k, spec.D
    _event(f"T {_bucket(T, (1, 4, 16, 40))}")
    _event(f"k {_bucket(k, (1, 4, 16, 32))}")
    _event(f"D {_bucket(D, (64, 512, 2048, 16384))}")
    g = torch.Generator().manual_seed(spec.seed)
    rnd = random.Random(spec.seed)
    R = T * k + spec.spare_rows
    storage = torch.full((R + 2, D + spec.row_pad), float("nan"), dtype=BF16)
    rows = storage[1:R + 1, :D]
    index = torch.randperm(R, generator=g)[:T * k].reshape(T, k)
    if spec.duplicates:  # routes of one token may share a row (each token keeps its own rows: classes stay apart)
        index = torch.gather(index, 1, torch.randint(0, k, (T, k), generator=g))
    index = torch.where(torch.rand((T, k), generator=g) < spec.remote, -1, index).to(torch.int32)
    weights = torch.softmax(torch.randn(T, k, generator=g, dtype=torch.float64) * 2, dim=-1)
    wdt = F32 if spec.weights_dtype == "f32" else BF16
    classes = spec.classes()
    exact_one = [False] * T

    def row_values(t: int, cls: str, j: int, base: torch.Tensor) -> torch.Tensor:
        if cls in ("normal", "dominant"):
            return torch.randn(D, generator=g, dtype=torch.float64) * 10 ** rnd.uniform(-1.3, 1.3)
        if cls == "huge":
            return torch.randn(D, generator=g, dtype=torch.float64) * 10 ** rnd.uniform(28, 31)
        if cls == "subnormal":
            return _subnormal_row(g, D)
        if cls == "cancel":
            rho = 10 ** rnd.uniform(-3, -1)
            return (base if j % 2 == 0 else -base) + rho * torch.randn(D, generator=g, dtype=torch.float64)
        if cls == "equal":
            return base
        if cls == "zero":
            return torch.zeros(D, dtype=torch.float64) if rnd.random() < 0.7 else base
        raise AssertionError(cls)

    for t, cls in enumerate(classes):
        base = torch.randn(D, generator=g, dtype=torch.float64) * rnd.uniform(0.5, 4.0)
        local = [j for j in range(k) if int(index[t, j]) >= 0]
        for j in local:
            rows[int(index[t, j])] = row_values(t, cls, j, base).to(BF16)  # duplicates: the last write wins
        if cls == "cancel":
            weights[t] = 1.0 / k
        elif cls == "dominant" and local:
            weights[t] = 1e-4 * torch.rand(k, generator=g, dtype=torch.float64)
            weights[t, rnd.choice(local)] = 1.0
        elif cls == "equal" and local:
            # weights c / 256 with integer c >= 1 summing to 256 over the local routes: exact in bf16 and fp32,
            # so sum_j w_j * B is B exactly in fp32 (<= 21 significant bits) and rounds to B.
            if len(local) <= 256:
                cuts = sorted(rnd.sample(range(1, 256), len(local) - 1))
                parts = [b - a for a, b in zip([0, *cuts], [*cuts, 256])]
                weights[t] = 0.0
                for j, c in zip(local, parts):
                    weights[t, j] = c / 256
                exact_one[t] = True
    shared = None
    if spec.shared:
        shared = (torch.randn(T, D, generator=g) * 0.5).to(BF16)
        for t, cls in enumerate(classes):
            if cls == "subnormal":
                shared[t] = _subnormal_row(g, D).to(BF16)
            elif cls == "zero":
                shared[t] = 0.0
    norm_weight = (1 + 0.1 * torch.randn(D, generator=g)).to(BF16) if spec.norm else None
    bufs = {"rows": storage, "weights": weights.to(wdt), "index": index}
    if shared is not None:
        bufs["shared"] = shared
    if norm_weight is not None:
        bufs["norm_weight"] = norm_weight
    bufs = {name: b.to(device) for name, b in bufs.items()}
    return MoeCase(spec=spec, rows=bufs["rows"][1:R + 1, :D], weights=bufs["weights"], index=bufs["index"],
                   shared=bufs.get("shared"), norm_weight=bufs.get("norm_weight"), storage=bufs, classes=classes,
                   exact_one=exact_one)


def moe_emulate(c: MoeCase) -> torch.Tensor:
    """The contract's pre-norm value in fp32, bit for bit (docs/ops/moe_finalize.md): per route a product
    then a sum, j ascending, skipping -1; one rounding of scale * acc; the shared add (PyTorch bf16 add)."""
    rows, w, idx = c.rows.cpu(), c.weights.cpu().float(), c.index.cpu().long()
    T, k = idx.shape
    acc = torch.zeros(T, rows.shape[1], dtype=F32)
    for j in range(k):
        local = (idx[:, j] >= 0).unsqueeze(-1)
        term = rows[idx[:, j].clamp(min=0)].float() * w[:, j:j + 1]
        acc = torch.where(local, acc + term, acc)
    x = (acc * torch.tensor(c.spec.scale, dtype=F32)).to(BF16)
    return x if c.shared is None else x + c.shared.cpu()


def _moe_kappa(c: MoeCase) -> torch.Tensor:
    rows, w, idx = c.rows.cpu().double(), c.weights.cpu().double(), c.index.cpu().long()
    local = (idx >= 0).unsqueeze(-1)
    terms = torch.where(local, rows[idx.clamp(min=0)] * w.unsqueeze(-1), 0.0) * _f32(c.spec.scale)
    num, x = terms.abs().sum(1), terms.sum(1)
    if c.shared is not None:
        s = c.shared.cpu().double()
        num, x = num + s.abs(), x + s
    num, den = num.norm(dim=-1), x.norm(dim=-1)
    return torch.where(den > 0, num / den, torch.where(num > 0, torch.full_like(num, math.inf), torch.ones_like(num)))


@pytest.mark.parametrize("primary", MOE_CLASSES)
@fuzz(FUZZ_EXAMPLES["moe_finalize"])
@given(data=st.data())
def test_moe_finalize_properties(device, primary, data):
    spec = data.draw(moe_specs(primary), label="spec")
    c = build_moe(spec, device)
    ctx = f"moe_finalize {spec}"
    before = {name: b.clone() for name, b in c.storage.items()}
    eps32 = _f32(spec.eps)
    out = attnres.moe_finalize(c.rows, c.weights, c.index, shared=c.shared, norm_weight=c.norm_weight, eps=spec.eps,
                               scale=spec.scale)
    for name, old in before.items():
        assert_same_bits(c.storage[name], old, f"{ctx}: input storage {name!r}")
    assert out.dtype == BF16 and out.device.type == torch.device(device).type
    out = out.cpu()

    # 1. The pre-norm value is pinned bit for bit on every backend.
    x = moe_emulate(c)
    assert torch.isfinite(x.float()).all(), f"{ctx}: the emulated combine is not finite (generator bug)"
    if c.norm_weight is None:
        assert_same_bits(out, x, f"{ctx}: output vs the fp32 emulation")
    for t in range(spec.T):
        if c.exact_one[t] and spec.scale == 1.0:
            base = c.rows.cpu()[int(c.index[t][c.index[t] >= 0][0])]
            want = base if c.shared is None else base + c.shared.cpu()[t]
            assert_same_bits(x[t], want, f"{ctx}: token {t}: equal rows with weights summing to 1")

    # 2. Against the oracle where its tolerance is meaningful, decided from the exact pre-norm value x:
    #    * a token whose largest |x| is below 2^-118 holds bf16 subnormals (a few significant bits; its fp32
    #      sum of squares is 0): the oracle's own rounding of x may differ by a >= 1% step. x is pinned by (1);
    #      the norm is checked from x in (3);
    #    * with the norm, eps = 0 and that sum of squares 0, the contract's r = 1/sqrt(0) = inf: (3);
    #    * with the norm and an eps below 2^-90, a token whose largest |x| is below 2^-63 (x^2 below fp32's
    #      normal range): its fp32 sum of squares holds a few bits (or is 0), so r is that rounding's, not the
    #      oracle's: its direction is checked in (3), and inf / NaN where that sum rounded to 0;
    #    * huge rows with the norm: the fp32 sum of squares overflows, r = 0 (checked finite in (3));
    #    * a cancelling sum (kappa > KAPPA_MAX) amplifies fp32 rounding beyond the rule.
    norm = c.norm_weight is not None
    expected = moe.reference_moe_finalize(c.rows, c.weights, c.index, shared=c.shared, norm_weight=c.norm_weight,
                                          eps=eps32, scale=_f32(spec.scale))
    kappa = _moe_kappa(c)
    x32 = x.float()
    x_zero = (x32 == 0).all(-1)
    few_bits = (x32.abs().amax(-1) < 2.0 ** -118) & ~x_zero
    r_inf = norm and eps32 == 0
    subnormal_squares = (x32.abs().amax(-1) < 2.0 ** -63) & ~x_zero & ~few_bits
    free_scale = norm and eps32 < 2.0 ** -90
    tokens, from_x, inf_r, direction = [], [], [], []
    for t, cls in enumerate(c.classes):
        if r_inf and bool(x_zero[t] | few_bits[t]):
            inf_r.append(t)
        elif bool(few_bits[t]):
            from_x.append(t)
        elif free_scale and bool(subnormal_squares[t]):
            direction.append(t)
        elif not (norm and cls == "huge") and float(kappa[t]) <= KAPPA_MAX:
            tokens.append(t)
    _event(f"token checks: oracle {bool(tokens)}, from x {bool(from_x)}, r = inf {bool(inf_r)}")
    if tokens:
        close(out[tokens], expected[tokens], f"{ctx}: output [tokens {tokens}]", ulps=2)

    # 3. The norm stage from the exact pre-norm value, and finiteness.
    if norm and from_x:
        own = reference.two_rounding_rmsnorm(x[from_x], c.norm_weight.cpu(), eps32)
        close(out[from_x], own, f"{ctx}: norm of a subnormal pre-norm value [tokens {from_x}]", ulps=2)
    for t in inf_r:  # r = inf: normed = x * inf, so NaN where x == 0 (0 * inf) and +-inf elsewhere
        o = out[t].float()
        zero = x32[t] == 0
        assert bool(torch.isnan(o[zero]).all() and torch.isinf(o[~zero]).all()), \
            f"{ctx}: token {t}: eps = 0 and an fp32 sum of squares of 0 must give NaN where x == 0, +-inf elsewhere"
    for t in direction:  # r from a subnormal fp32 sum of squares: out is bf16(x * r) * w for some r > 0, or inf
        o, own = out[t].double(), reference.two_rounding_rmsnorm(x[t:t + 1], c.norm_weight.cpu(), eps32)[0].double()
        if torch.isfinite(o).all() and float(own.norm()) == 0:
            assert float(o.norm()) == 0, f"{ctx}: token {t}: a zero direction must stay zero"
        elif torch.isfinite(o).all():
            cos = float((o @ own) / (o.norm() * own.norm()))
            assert cos > 0.999, f"{ctx}: token {t}: a subnormal sum of squares changes r, not the direction (cos {cos})"
        else:
            zero = x32[t] == 0
            assert bool(torch.isnan(o[zero]).all() and torch.isinf(o[~zero]).all()), \
                f"{ctx}: token {t}: a sum of squares rounded to 0 must give NaN where x == 0, +-inf elsewhere"
    fin = [t for t in range(spec.T) if t not in inf_r and t not in direction]
    assert torch.isfinite(out[fin].float()).all(), f"{ctx}: non-finite output for finite inputs [tokens {fin}]"


# ========================================================================= the bug the invariants found
N1_KINDS = {  # token 1's prefix, and its logit under rms_eps = 0 (rsigma = inf)
    "zero": "NaN",  # inf * 0
    "subnormal_negative_dot": "-inf",
    "subnormal_positive_dot": "+inf",
}


def _n1_prefix_case(device, kind: str):
    """T = 3, N = 1 (no bank rows); token 1's prefix is all-zero or subnormal (its fp32 squares underflow),
    with the sign of its dot with q chosen, so its logit under rms_eps = 0 is NaN, -inf or +inf."""
    g = torch.Generator().manual_seed(7)
    H = 64
    lr = (torch.randn(3, H, generator=g) * 0.7).to(BF16)
    res_w = (torch.randn(H, generator=g) * 0.02).to(BF16)
    rms_w = (1 + 0.1 * torch.randn(H, generator=g)).to(BF16)
    if kind == "zero":
        lr[1] = 0.0
    else:
        row = _subnormal_row(g, H)
        dot = float((row * rms_w.double() * res_w.double()).sum())
        assert dot != 0
        lr[1] = (row if (dot > 0) == (kind == "subnormal_positive_dot") else -row).to(BF16)
    bank = torch.empty(0, 3, H, dtype=BF16)
    return lr.to(device), bank.to(device), res_w.to(device), rms_w.to(device)


@pytest.mark.parametrize("kind", list(N1_KINDS))
def test_n1_mixture_is_the_prefix_when_its_logit_is_not_finite(kind, device):
    """ops.md step 6: with N = 1 the mixture is P itself — also with rms_eps = 0 and a prefix whose fp32 sum
    of squares is 0 (all-zero, or subnormal: the squares underflow), where rsigma = inf and the logit is
    inf * 0 = NaN or +-inf. The probability is 1 (the logit and rsigma report the formula's NaN/inf)."""
    lr, bank, res_w, rms_w = _n1_prefix_case(device, kind)
    nw = (1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(3))).to(BF16).to(device)
    for kernel, opts in kernel_options(device, "attn_res", 3, 1, 64, diagnostics=True):
        mixture, rsigma, probs, logits = attnres.attn_res(lr, bank, res_w, rms_w, 0.0, options=opts)
        assert torch.equal(mixture.cpu(), lr.cpu()), f"kernel={kernel}: N = 1 mixture != P ({kind} prefix, eps = 0)"
        assert torch.equal(probs.cpu(), torch.ones(1, 3)), f"kernel={kernel}: N = 1 probabilities != 1"
        assert bool(torch.isinf(rsigma[0, 1])), f"kernel={kernel}: rsigma of the {kind} row is 1/sqrt(0) = inf"
    for kernel, opts in kernel_options(device, "attn_res_rmsnorm", 3, 1, 64, tap=True):
        output, tap = attnres.attn_res_rmsnorm(lr, bank, res_w, rms_w, nw, 0.0, 1e-5, return_mixture=True,
                                               options=opts)
        assert torch.equal(tap.cpu(), lr.cpu()), f"kernel={kernel}: attn_res_rmsnorm tap != P"
        want = reference.two_rounding_rmsnorm(lr.cpu(), nw.cpu(), _f32(1e-5))
        close(output.cpu(), want, f"kernel={kernel}: attn_res_rmsnorm output", ulps=2)


def test_n1_mixture_is_the_prefix_with_a_positive_eps(device):
    """The same inputs with rms_eps > 0 (even an fp32 subnormal one) take the contract's path: P itself."""
    for kind in N1_KINDS:
        lr, bank, res_w, rms_w = _n1_prefix_case(device, kind)
        for eps in (1e-45, 1e-5):
            for kernel, opts in kernel_options(device, "attn_res", 3, 1, 64, diagnostics=True):
                mixture, _, probs, _ = attnres.attn_res(lr, bank, res_w, rms_w, eps, options=opts)
                assert torch.equal(mixture.cpu(), lr.cpu()), f"{kind} eps={eps} kernel={kernel}: mixture != P"
                assert torch.equal(probs.cpu(), torch.ones(1, 3)), f"{kind} eps={eps} kernel={kernel}"


def test_generators_reach_the_degenerate_regimes():
    """The classes do what the docstring says (else the property tests above would check less than they claim):
    huge rows overflow the fp32 sum of squares, subnormal rows underflow it, cancel cases cancel, dominant
    ones saturate the softmax."""
    spec = AttnSpec(T=8, N=4, H=256, layout="snapshot_major", row_pad=0, weight_2d=False, rms_eps=1e-5,
                    norm_eps=1e-5, primary="huge", special=(True,) * 8, addends=1, tap=True, snapshot=False, seed=3)
    for cls in ("huge", "subnormal", "cancel", "dominant", "zero", "equal"):
        case = build_attn(AttnSpec(**{**spec.__dict__, "primary": cls}), "cpu")
        inp = case.inp
        P = reference.prefix_update(inp.layer_residual, inp.add)
        V = candidates(case, P)
        sumsq = (V.float() ** 2).sum(-1)  # [N, T] in fp32, as the library computes it
        ref = oracle(inp, addends=1)
        if cls == "huge":
            assert bool(torch.isinf(sumsq).any(0).all()), "every huge token has an overflowing candidate"
        elif cls == "subnormal":
            assert bool((sumsq == 0).all()) and bool((V.abs() < 2.0 ** -125).all())  # P: a sum of two subnormals
        elif cls == "cancel":
            assert float(_kappa(ref.probs, V).min()) > 3.0, "cancel tokens cancel"
        elif cls == "dominant":
            assert float(ref.probs.max(0).values.min()) > 0.99, "a dominant candidate takes the softmax"
        elif cls == "zero":
            assert bool((V.abs().amax(-1) == 0).any(0).all()), "every zero token has a zero candidate"
        elif cls == "equal":
            assert bool((V == V[-1:]).all())
