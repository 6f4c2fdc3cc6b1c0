"""NaN and Inf in the inputs: which outputs become non-finite, and that nothing else changes.

One bad value (NaN, +Inf or -Inf) goes into one place — a token's prefix, addend or bank row, a weight
element, a routed row, a route weight, the shared row, the norm weight, rows no route reads — and the call
is compared with the same call on the clean inputs:

* the affected token's outputs are non-finite exactly as the contract's fp32 formulas make them (the
  patterns are listed in docs/reliability.md and asserted below, element by element);
* every other token's outputs, and every unaffected output of the affected token, are bitwise equal to the
  clean call's;
* nothing is written outside the outputs: every output is a view into a larger buffer pre-filled with a
  sentinel bit pattern, and every input (a view into a NaN-bordered buffer, so a read outside its view would
  also show up as NaN in the clean call) is unchanged bit for bit, except the requested snapshot row, which
  must equal `updated`;
* no crash.

The calls go through attnres._C (the binding the public functions use) because the public functions
allocate their outputs; that is the only way to hand the library output views with sentinels around them.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnres
from attnres import _C
from attnres._tensors import ref, stream_of
from helpers import BF16, assert_same_bits, bits, kernel_options

F32 = torch.float32
NAN, INF = float("nan"), float("inf")
VALUES = {"nan": NAN, "+inf": INF, "-inf": -INF}
SENTINEL = {BF16: 0x5A5A, F32: 0x5A5A5A5A}  # finite bit patterns (bf16 ~1.5e16, fp32 ~1.5e16) no op produces
INT_VIEW = {BF16: torch.int16, F32: torch.int32}
BORDER_ROWS, BORDER_COLS = 1, 8  # 8 elements keep every view 16-byte aligned for the CUDA kernels

T, K, H = 4, 3, 64
N = K + 1
BAD_T, BAD_H, BAD_K = 2, 37, 1  # the poisoned token, element, and (for the bank) candidate


# ------------------------------------------------------------------------------------- buffers and views
def embedded(values: torch.Tensor, device, fill=NAN) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): `values` (1-D or 2-D) inside a buffer bordered by `fill` on every side."""
    if values.dim() == 1:
        buf = torch.full((values.shape[0] + 2 * BORDER_COLS,), fill, dtype=values.dtype)
        buf[BORDER_COLS:BORDER_COLS + values.shape[0]] = values
        buf = buf.to(device)
        return buf, buf[BORDER_COLS:BORDER_COLS + values.shape[0]]
    R, C = values.shape
    buf = torch.full((R + 2 * BORDER_ROWS, C + 2 * BORDER_COLS), fill, dtype=values.dtype)
    buf[BORDER_ROWS:BORDER_ROWS + R, BORDER_COLS:BORDER_COLS + C] = values
    buf = buf.to(device)
    return buf, buf[BORDER_ROWS:BORDER_ROWS + R, BORDER_COLS:BORDER_COLS + C]


class Boxed:
    """An output view inside a sentinel-filled buffer; `check()` asserts the sentinel outside the view."""

    def __init__(self, rows: int, cols: int, dtype, device):
        self.dtype = dtype
        self.buf = torch.empty((rows + 2 * BORDER_ROWS, cols + 2 * BORDER_COLS), dtype=dtype, device=device)
        self.buf.view(INT_VIEW[dtype]).fill_(SENTINEL[dtype])
        self.region = (slice(BORDER_ROWS, BORDER_ROWS + rows), slice(BORDER_COLS, BORDER_COLS + cols))
        self.view = self.buf[self.region]

    def check(self, what: str) -> None:
        b = bits(self.buf)
        outside = torch.ones(b.shape, dtype=torch.bool)
        outside[self.region] = False
        sentinel = torch.tensor(SENTINEL[self.dtype], dtype=b.dtype)
        changed = int((b[outside] != sentinel).sum())
        assert changed == 0, f"{what}: {changed} elements written outside the output view"


# ====================================================================================== attention residual
OPS = {
    # op: (inputs it takes, outputs, bank layout)
    "attn_res": (("layer_residual", "block_residual", "res_weight", "rms_weight"),
                 ("output", "rsigma", "probs", "logits"), "snapshot_major"),
    "attn_res_rmsnorm": (("layer_residual", "block_residual", "res_weight", "rms_weight", "norm_weight"),
                         ("output", "mixture"), "token_major"),
    "attn_res_add_rmsnorm": (("layer_residual", "layer_residual_add", "layer_residual_add2", "block_residual",
                              "res_weight", "rms_weight", "norm_weight"), ("updated", "output", "mixture"),
                             "token_major"),
    "attn_res_add_rmsnorm_persistent": (("layer_residual", "layer_residual_add", "block_residual", "res_weight",
                                         "rms_weight", "norm_weight"), ("updated", "output"), "snapshot_major"),
}
PREFIX_SOURCES = ("layer_residual", "layer_residual_add", "layer_residual_add2")
WEIGHTS = ("res_weight", "rms_weight", "norm_weight")
ATTN_CASES = [(op, loc) for op, (ins, _, _) in OPS.items() for loc in ins]


class AttnCall:
    """Clean inputs for one op, each a view into a NaN-bordered buffer; the bank has a spare row K (the
    snapshot slot of attn_res_add_rmsnorm) and NaN rows around its candidates."""

    def __init__(self, op: str, device):
        self.op, self.device = op, device
        inputs, self.outputs, layout = OPS[op]
        g = torch.Generator().manual_seed(20240)
        rows = lambda scale: (torch.randn(T, H, generator=g) * scale).to(BF16)  # noqa: E731
        self.buffers, self.views = {}, {}
        for name, values in (("layer_residual", rows(1.0)), ("layer_residual_add", rows(0.5)),
                             ("layer_residual_add2", rows(0.5)),
                             ("res_weight", (torch.randn(H, generator=g) * 0.05).to(BF16)),
                             ("rms_weight", (1 + 0.1 * torch.randn(H, generator=g)).to(BF16)),
                             ("norm_weight", (1 + 0.1 * torch.randn(H, generator=g)).to(BF16))):
            if name in inputs:
                self.buffers[name], self.views[name] = embedded(values, device)
        cand = (torch.randn(K, T, H, generator=g) * 2).to(BF16)
        if layout == "snapshot_major":
            bank = torch.full((K + 3, T + 2, H + 2 * BORDER_COLS), NAN, dtype=BF16)
            bank[1:K + 1, 1:T + 1, BORDER_COLS:BORDER_COLS + H] = cand
            bank = bank.to(device)
            view = bank[1:K + 1, 1:T + 1, BORDER_COLS:BORDER_COLS + H]
            self.slot_row = lambda b: b[K + 1, 1:T + 1, BORDER_COLS:BORDER_COLS + H]  # noqa: E731
        else:
            bank = torch.full((T + 2, K + 3, H + 2 * BORDER_COLS), NAN, dtype=BF16)
            bank[1:T + 1, 1:K + 1, BORDER_COLS:BORDER_COLS + H] = cand.transpose(0, 1)
            bank = bank.to(device)
            view = bank[1:T + 1, 1:K + 1, BORDER_COLS:BORDER_COLS + H].transpose(0, 1)
            self.slot_row = lambda b: b[1:T + 1, K + 1, BORDER_COLS:BORDER_COLS + H]  # noqa: E731
        self.buffers["block_residual"], self.views["block_residual"] = bank, view
        self.snapshot = op == "attn_res_add_rmsnorm"

    def poison(self, location: str, value: float) -> None:
        v = self.views[location]
        if location == "block_residual":
            v[BAD_K, BAD_T, BAD_H] = value
        elif location in WEIGHTS:
            v[BAD_H] = value
        else:
            v[BAD_T, BAD_H] = value

    def run(self, options: attnres.Options, *, declined: bool = False) -> dict[str, torch.Tensor] | None:
        """One call with sentinel-boxed outputs; returns the outputs (CPU copies). With declined=True the
        call must raise UnsupportedError without writing a byte (the output views keep their sentinel too)."""
        boxes = {name: Boxed(N, T, F32, self.device) if name in ("rsigma", "probs", "logits")
                 else Boxed(T, H, BF16, self.device) for name in self.outputs}
        before = {name: buf.clone() for name, buf in self.buffers.items()}
        args = _C.AttnResArgs()
        for name, view in self.views.items():
            setattr(args, name, ref(view, self.op, name))
        for name, box in boxes.items():
            setattr(args, name, ref(box.view, self.op, name))
        args.rms_eps, args.norm_eps = 1e-5, 1e-5
        args.snapshot_slot = K if self.snapshot else -1
        args.stream = stream_of(self.views["layer_residual"])
        if declined:
            with pytest.raises(attnres.UnsupportedError):
                _C.run(getattr(_C.AttnResOp, self.op), args, options.to_c())
            for name, box in boxes.items():
                assert torch.equal(bits(box.buf), torch.full_like(bits(box.buf), SENTINEL[box.dtype])), \
                    f"{self.op}: a declined call wrote into {name}"
            for name, old in before.items():
                assert_same_bits(self.buffers[name], old, f"{self.op}: input buffer {name!r} after a declined call")
            return None
        _C.run(getattr(_C.AttnResOp, self.op), args, options.to_c())
        if self.device == "cuda":
            torch.cuda.synchronize()
        got = {name: box.view.cpu() for name, box in boxes.items()}
        for name, box in boxes.items():
            box.check(f"{self.op}: {name}")
        for name, old in before.items():
            now = self.buffers[name]
            if name == "block_residual" and self.snapshot:
                expect = old.clone()
                self.slot_row(expect).copy_(got["updated"].to(expect.device))
                assert_same_bits(now, expect, f"{self.op}: bank buffer (snapshot row {K} = updated, rest unchanged)")
            else:
                assert_same_bits(now, old, f"{self.op}: input buffer {name!r}")
        return got


def _attn_options(op, device):
    flags = {"attn_res": {"diagnostics": True}, "attn_res_rmsnorm": {"tap": True},
             "attn_res_add_rmsnorm": {"add": True, "add2": True, "tap": True, "snapshot": True},
             "attn_res_add_rmsnorm_persistent": {"add": True}}[op]
    if op == "attn_res_add_rmsnorm_persistent":
        opts = attnres.Options(topology="persistent")
        return [(attnres.plan(op, tokens=T, candidates=N, hidden=H, device=device, options=opts, **flags), opts)]
    return [(attnres.plan(op, tokens=T, candidates=N, hidden=H, device=device, options=o, **flags), o)
            for _, o in kernel_options(device, op, T, N, H, **flags)]


def _same_except(actual, expected, what, *, tokens=None, columns=None):
    """Bitwise equality of [T, H] outputs outside the given tokens (rows) or columns."""
    keep = torch.ones(actual.shape, dtype=torch.bool)
    if tokens is not None:
        keep[tokens] = False
    if columns is not None:
        keep[:, columns] = False
    a, e = bits(actual), bits(expected)
    diff = int((a[keep] != e[keep]).sum())
    assert diff == 0, f"{what}: {diff} unaffected elements differ from the clean call"


def _is(value: float, x: torch.Tensor) -> bool:
    """x holds exactly this NaN or signed infinity (every element)."""
    x = x.float()
    return bool(torch.isnan(x).all()) if math.isnan(value) else bool((x == value).all())


@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("op,location", ATTN_CASES, ids=[f"{o}-{loc}" for o, loc in ATTN_CASES])
def test_attention_nonfinite_input(op, location, value, device):
    v = VALUES[value]
    for plan, opts in _attn_options(op, device):
        ctx = f"{op} {location}={value} kernel={plan.kernel or 'declined'}"
        clean_call = AttnCall(op, device)
        if not plan.accepted:
            # This build or device declines the call: it raises and writes nothing.
            assert device == "cuda", plan.decline
            clean_call.poison(location, v)
            clean_call.run(opts, declined=True)
            continue
        clean = clean_call.run(opts)
        for name, t in clean.items():
            assert torch.isfinite(t.float()).all(), f"{ctx}: the clean call's {name} is not finite"
        bad_call = AttnCall(op, device)
        bad_call.poison(location, v)
        bad = bad_call.run(opts)
        mixture_name = "output" if op == "attn_res" else "mixture"
        normed = ("output",) if op != "attn_res" else ()

        if location in PREFIX_SOURCES or location == "block_residual":
            # The token's candidate is non-finite: its sum of squares and its dot with q are NaN or +-inf, its
            # logit NaN (Inf gives rsigma = 0 and 0 * inf), so every probability of the token is NaN and so
            # are its mixture and output. `updated` carries the bad value in that one element.
            for name in (mixture_name, *normed):
                if name in bad:
                    assert torch.isnan(bad[name][BAD_T].float()).all(), f"{ctx}: {name}[{BAD_T}] not all NaN"
                    _same_except(bad[name], clean[name], f"{ctx}: {name}", tokens=[BAD_T])
            if "updated" in bad:
                if location == "block_residual":
                    assert_same_bits(bad["updated"], clean["updated"], f"{ctx}: updated")
                else:
                    assert _is(v, bad["updated"][BAD_T, BAD_H]), f"{ctx}: updated[{BAD_T}, {BAD_H}] is not {value}"
                    keep = bad["updated"].clone()
                    keep[BAD_T, BAD_H] = clean["updated"][BAD_T, BAD_H]
                    assert_same_bits(keep, clean["updated"], f"{ctx}: updated outside the bad element")
            if op == "attn_res":
                n = BAD_K if location == "block_residual" else K
                assert torch.isnan(bad["probs"][:, BAD_T]).all(), f"{ctx}: probs[:, {BAD_T}] not all NaN"
                assert torch.isnan(bad["logits"][n, BAD_T]), f"{ctx}: logits[{n}, {BAD_T}] not NaN"
                want_rsigma = NAN if math.isnan(v) else 0.0  # 1 / sqrt(inf) = 0
                assert _is(want_rsigma, bad["rsigma"][n, BAD_T]), f"{ctx}: rsigma[{n}, {BAD_T}]"
                # The other candidates' rsigma and logits, and every other token's diagnostics, are unchanged.
                for name in ("rsigma", "logits", "probs"):
                    keep = torch.ones(N, T, dtype=torch.bool)
                    if name == "probs":
                        keep[:, BAD_T] = False
                    else:
                        keep[n, BAD_T] = False
                    assert torch.equal(bits(bad[name])[keep], bits(clean[name])[keep]), f"{ctx}: {name} elsewhere"
        elif location in ("res_weight", "rms_weight"):
            # q[h] is NaN or +-inf: every token's dot with q is NaN or +-inf, so every token's logits are
            # non-finite and every probability, mixture and output is NaN. rsigma and updated do not use q.
            for name in (mixture_name, *normed):
                if name in bad:
                    assert torch.isnan(bad[name].float()).all(), f"{ctx}: {name} not all NaN"
            if "updated" in bad:
                assert_same_bits(bad["updated"], clean["updated"], f"{ctx}: updated")
            if op == "attn_res":
                assert torch.isnan(bad["probs"]).all(), f"{ctx}: probs not all NaN"
                assert not torch.isfinite(bad["logits"]).any(), f"{ctx}: a finite logit"
                assert_same_bits(bad["rsigma"], clean["rsigma"], f"{ctx}: rsigma")
        else:  # norm_weight[h]: column h of every token's output is normed * value; nothing else changes
            assert location == "norm_weight"
            col = bad["output"][:, BAD_H].float()
            if math.isnan(v):
                assert torch.isnan(col).all(), f"{ctx}: output[:, {BAD_H}] not all NaN"
            else:
                # sign(normed) from the clean call: output = normed * w with w = the clean norm weight.
                w = clean_call.views["norm_weight"][BAD_H].float().cpu()
                sign = torch.sign(clean["output"][:, BAD_H].float()) * torch.sign(w) * math.copysign(1.0, v)
                assert bool((sign != 0).all()), "the clean column has no zero (test precondition)"
                assert torch.equal(col, sign * INF), f"{ctx}: output[:, {BAD_H}] = {col.tolist()}, not +-inf"
            _same_except(bad["output"], clean["output"], f"{ctx}: output", columns=[BAD_H])
            for name in ("updated", "mixture"):
                if name in bad:
                    assert_same_bits(bad[name], clean[name], f"{ctx}: {name}")


# ============================================================================================ moe_finalize
MT, MK, MD = 4, 6, 64
SPARE = 5  # rows no route names
MR = MT * MK + SPARE
REMOTE = (1, 2)  # the route made remote in the remote-route case
MOE_LOCATIONS = ("route_row", "route_weight", "shared", "norm_weight", "padding_rows", "remote_route")


class MoeCall:
    """rows: a [R, D] view into a NaN-bordered buffer (the row before rows[0] — what a -1 route would
    address — is NaN); every row holds finite values, including the SPARE rows no route names. weights and
    index: dense views inside larger buffers (NaN and out-of-range borders)."""

    def __init__(self, device, weights_dtype, norm: bool, remote: bool):
        self.device = device
        g = torch.Generator().manual_seed(777)
        perm = torch.randperm(MR, generator=g)
        index = perm[:MT * MK].reshape(MT, MK).to(torch.int32)
        self.padding = perm[MT * MK:].tolist()
        self.remote_row = int(index[REMOTE])
        if remote:
            index[REMOTE] = -1
        rows = (torch.randn(MR, MD, generator=g) * 2).to(BF16)
        weights = torch.softmax(torch.randn(MT, MK, generator=g), -1).to(weights_dtype)
        shared = (torch.randn(MT, MD, generator=g) * 0.5).to(BF16)
        norm_weight = (1 + 0.1 * torch.randn(MD, generator=g)).to(BF16)
        self.buffers, self.views = {}, {}
        self.buffers["rows"], self.views["rows"] = embedded(rows, device)
        self.buffers["shared"], self.views["shared"] = embedded(shared, device)
        if norm:
            self.buffers["norm_weight"], self.views["norm_weight"] = embedded(norm_weight, device)
        wbuf, w = embedded(weights.reshape(-1), device)
        self.buffers["weights"], self.views["weights"] = wbuf, w.view(MT, MK)
        ibuf, i = embedded(index.reshape(-1), device, fill=2**31 - 1)
        self.buffers["index"], self.views["index"] = ibuf, i.view(MT, MK)
        self.index = index

    def poison(self, location: str, value: float) -> None:
        v = self.views
        if location == "route_row":
            v["rows"][int(self.index[BAD_T, 0]), BAD_H] = value
        elif location == "route_weight":
            v["weights"][BAD_T, 0] = value
        elif location == "shared":
            v["shared"][BAD_T, BAD_H] = value
        elif location == "norm_weight":
            v["norm_weight"][BAD_H] = value
        elif location == "padding_rows":
            v["rows"][self.padding] = value
        elif location == "remote_route":
            v["rows"][self.remote_row] = value  # the row the route named before it became -1
            v["weights"][REMOTE] = value
        else:
            raise AssertionError(location)

    def run(self) -> torch.Tensor:
        box = Boxed(MT, MD, BF16, self.device)
        before = {name: buf.clone() for name, buf in self.buffers.items()}
        a = _C.MoeFinalizeArgs()
        for name, view in self.views.items():
            setattr(a, name, ref(view, "moe_finalize", name))
        a.output = ref(box.view, "moe_finalize", "output")
        a.eps, a.scale = 1e-5, 0.75
        a.stream = stream_of(self.views["rows"])
        _C.moe_finalize(a, _C.MoeFinalizeOptions())
        if self.device == "cuda":
            torch.cuda.synchronize()
        box.check("moe_finalize: output")
        for name, old in before.items():
            assert_same_bits(self.buffers[name], old, f"moe_finalize: input buffer {name!r}")
        return box.view.cpu()


MOE_CASES = [(loc, norm) for loc in MOE_LOCATIONS for norm in (False, True) if not (loc == "norm_weight" and not norm)]
MOE_IDS = [f"{loc}-{'norm' if n else 'no_norm'}" for loc, n in MOE_CASES]


@pytest.mark.parametrize("weights_dtype", [F32, BF16], ids=["w_f32", "w_bf16"])
@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("location,norm", MOE_CASES, ids=MOE_IDS)
def test_moe_finalize_nonfinite_input(location, norm, value, weights_dtype, device):
    v = VALUES[value]
    remote = location == "remote_route"
    clean_call = MoeCall(device, weights_dtype, norm, remote)
    clean = clean_call.run()
    assert torch.isfinite(clean.float()).all(), "the clean call is not finite"
    bad_call = MoeCall(device, weights_dtype, norm, remote)
    bad_call.poison(location, v)
    bad = bad_call.run()
    ctx = f"moe_finalize {location}={value} norm={norm} weights={weights_dtype}"

    if location in ("padding_rows", "remote_route"):
        # Rows no route names, and remote (-1) routes' rows and weights, are never read.
        assert_same_bits(bad, clean, f"{ctx}: output")
        return
    if location == "norm_weight":
        col = bad[:, BAD_H].float()
        if math.isnan(v):
            assert torch.isnan(col).all(), f"{ctx}: output[:, {BAD_H}] not all NaN"
        else:
            w = clean_call.views["norm_weight"][BAD_H].float().cpu()
            sign = torch.sign(clean[:, BAD_H].float()) * torch.sign(w) * math.copysign(1.0, v)
            assert bool((sign != 0).all()), "the clean column has no zero (test precondition)"
            assert torch.equal(col, sign * INF), f"{ctx}: output[:, {BAD_H}] = {col.tolist()}"
        _same_except(bad, clean, f"{ctx}: output", columns=[BAD_H])
        return

    _same_except(bad, clean, f"{ctx}: output", tokens=[BAD_T])  # every other token: bit for bit
    row = bad[BAD_T].float()
    if location == "route_weight":
        # Every element of the token's combine is w * row = NaN (or +-inf, and then r = 0 gives inf * 0).
        if math.isnan(v) or norm:
            assert torch.isnan(row).all(), f"{ctx}: output[{BAD_T}] not all NaN"
        else:
            r = clean_call.views["rows"][int(clean_call.index[BAD_T, 0])].float().cpu()
            want = torch.sign(r) * math.copysign(INF, v)
            assert torch.equal(row, want), f"{ctx}: output[{BAD_T}] is not sign(row) * {value}"
        return
    # route_row or shared: one element of the token's pre-norm value x is NaN or +-inf (weights and the
    # scale are positive, so the sign survives). Without the norm only that element changes; with it the
    # sum of squares is NaN (all NaN) or inf (r = 0: the element is inf * 0 = NaN, the others +-0).
    assert location in ("route_row", "shared")
    if not norm:
        assert _is(v, row[BAD_H]), f"{ctx}: output[{BAD_T}, {BAD_H}] = {row[BAD_H].item()}, want {value}"
        keep = bad.clone()
        keep[BAD_T, BAD_H] = clean[BAD_T, BAD_H]
        assert_same_bits(keep, clean, f"{ctx}: output outside the bad element")
    elif math.isnan(v):
        assert torch.isnan(row).all(), f"{ctx}: output[{BAD_T}] not all NaN"
    else:
        assert torch.isnan(row[BAD_H]), f"{ctx}: output[{BAD_T}, {BAD_H}] not NaN"
        others = torch.cat([row[:BAD_H], row[BAD_H + 1:]])
        assert bool((others == 0).all()), f"{ctx}: output[{BAD_T}] outside element {BAD_H} is not all zero (r = 0)"
