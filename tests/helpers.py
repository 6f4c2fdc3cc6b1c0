"""Input generators and small utilities shared by the op tests.

`make_inputs` draws fresh random inputs for one call (never zeros): a bank in one of three layouts with rows
at several magnitudes, weights at the scales a trained checkpoint has, prefix and addends of realistic size.
Everything is drawn on the CPU from a seeded generator and then moved, so a CPU call and a CUDA call of the
same case see the same bits. Storage the call must not read (bank rows past K, padding after a row) holds
NaN: a kernel that reads it produces NaN, which every accuracy check rejects.

`oracle` runs the float64 reference (attnres.reference) for a case. `ROOT` is the repository root (the harness
packages bench, stress and tp_check live there); `checkout_env` puts it, and this attnres, on a subprocess's
PYTHONPATH.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

import attnres
from attnres import reference

ROOT = Path(__file__).resolve().parent.parent
BF16 = torch.bfloat16
LAYOUTS = ("contiguous", "snapshot_major", "token_major")
BF16_TINY = torch.finfo(BF16).smallest_normal  # below this (and nonzero) a bf16 value is subnormal


@dataclass
class Inputs:
    """One call's inputs. `block_residual` is a [K, T, H] view of `bank_buffer`; `spare_slot` is a bank row
    >= K inside the buffer that a snapshot write may target (None when the layout has no spare row)."""

    T: int
    N: int
    H: int
    layout: str
    layer_residual: Tensor
    add: Tensor | None
    add2: Tensor | None
    block_residual: Tensor
    bank_buffer: Tensor
    res_weight: Tensor
    rms_weight: Tensor
    norm_weight: Tensor
    rms_eps: float
    norm_eps: float
    spare_slot: int | None
    buffers: dict = field(default_factory=dict)  # every allocation the views above live in

    @property
    def K(self) -> int:
        return self.N - 1

    @property
    def device(self) -> torch.device:
        return self.layer_residual.device

    def describe(self) -> str:
        return (f"T={self.T} N={self.N} H={self.H} layout={self.layout} eps=({self.rms_eps:g}, {self.norm_eps:g}) "
                f"add={self.add is not None} add2={self.add2 is not None}")

    def storage_snapshot(self) -> dict[str, Tensor]:
        """Clones of every buffer the inputs live in (padding and spare bank rows included)."""
        return {name: buf.clone() for name, buf in self.buffers.items()}

    def bank_row(self, slot: int) -> Tensor:
        """Bank row `slot` of every token, [T, H], as a view of the bank buffer."""
        if self.layout == "token_major":
            return self.bank_buffer[:, slot, :]
        return self.bank_buffer[slot]


def _log_uniform(g: torch.Generator, shape, lo: float, hi: float) -> Tensor:
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    return torch.exp(torch.log(torch.tensor(lo, dtype=torch.float64)) * (1 - u) +
                     torch.log(torch.tensor(hi, dtype=torch.float64)) * u)


def _nonzero_normal(g: torch.Generator, shape) -> Tensor:
    """Standard normal draws as float64 (drawn in float32: the values end up in bf16 anyway)."""
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    # exact zeros would make subnormal/cancellation checks vacuous; they are measure-zero anyway
    return torch.where(x == 0, torch.full_like(x, 0.5), x).double()


def make_inputs(T: int, N: int, H: int, *, layout: str = "snapshot_major", addends: int = 0, seed: int = 0,
                device="cpu", bank_scale: tuple[float, float] = (0.1, 8.0),
                prefix_scale: tuple[float, float] = (0.5, 2.0), add_scale: float = 0.5,
                res_weight_scale: float = 0.02, rms_eps: float = 1e-5, norm_eps: float = 1e-5,
                spare_rows: int = 2, row_pad: int = 0, weight_2d: bool = False,
                elementwise_range: tuple[float, float] | None = None) -> Inputs:
    """Fresh inputs for a call with T tokens, N = K + 1 candidates, hidden size H.

    layout: 'contiguous' ([K, T, H] buffer), 'snapshot_major' ([K + spare_rows, T, H] buffer sliced [:K]) or
    'token_major' ([T, K + spare_rows, H] buffer viewed as [K, T, H]). Bank rows (one per snapshot and token)
    get magnitudes log-uniform in bank_scale, prefix rows in prefix_scale; elementwise_range additionally
    scales every element log-uniformly (large dynamic range inside a row). row_pad > 0 gives the prefix and
    addends a token stride of H + row_pad (NaN in the padding). weight_2d: res_weight as [1, H].
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if addends not in (0, 1, 2):
        raise ValueError("addends must be 0, 1 or 2")
    g = torch.Generator().manual_seed(seed)
    K = N - 1

    def rows(n_rows: int, scale: tuple[float, float]) -> Tensor:  # [n_rows, H] float64
        x = _nonzero_normal(g, (n_rows, H)) * _log_uniform(g, (n_rows, 1), *scale)
        if elementwise_range is not None:
            x = x * _log_uniform(g, (n_rows, H), *elementwise_range)
        return x

    # The bank: values for the K candidate rows of every token, NaN in spare rows.
    values = rows(max(K, 0) * T, bank_scale).reshape(K, T, H).to(BF16)
    nan = float("nan")
    if layout == "contiguous":
        bank_buffer = values.clone()
        spare = None
    elif layout == "snapshot_major":
        kmax = K + max(spare_rows, 1)
        bank_buffer = torch.full((kmax, T, H), nan, dtype=BF16)
        bank_buffer[:K] = values
        spare = K
    else:
        kmax = K + max(spare_rows, 1)
        bank_buffer = torch.full((T, kmax, H), nan, dtype=BF16)
        bank_buffer[:, :K] = values.transpose(0, 1)
        spare = K

    def padded(x: Tensor) -> Tensor:  # [T, H] bf16 storage, possibly with NaN padding after each row
        if row_pad == 0:
            return x.contiguous()
        buf = torch.full((T, H + row_pad), nan, dtype=BF16)
        buf[:, :H] = x
        return buf

    prefix_buf = padded(rows(T, prefix_scale).to(BF16))
    add_buf = padded((_nonzero_normal(g, (T, H)) * add_scale).to(BF16)) if addends >= 1 else None
    add2_buf = padded((_nonzero_normal(g, (T, H)) * add_scale).to(BF16)) if addends >= 2 else None

    res_w = (_nonzero_normal(g, (H,)) * res_weight_scale).to(BF16)
    rms_w = (1 + 0.1 * _nonzero_normal(g, (H,))).to(BF16)
    norm_w = (1 + 0.1 * _nonzero_normal(g, (H,))).to(BF16)
    if weight_2d:
        res_w = res_w.reshape(1, H)

    buffers = {"bank": bank_buffer, "prefix": prefix_buf, "res_weight": res_w, "rms_weight": rms_w,
               "norm_weight": norm_w}
    if add_buf is not None:
        buffers["add"] = add_buf
    if add2_buf is not None:
        buffers["add2"] = add2_buf
    buffers = {k: v.to(device) for k, v in buffers.items()}

    def view_rows(buf: Tensor | None) -> Tensor | None:
        return None if buf is None else buf[:, :H]

    bank = buffers["bank"]
    if layout == "contiguous":
        block = bank
    elif layout == "snapshot_major":
        block = bank[:K]
    else:
        block = bank.transpose(0, 1)[:K]
    return Inputs(T=T, N=N, H=H, layout=layout, layer_residual=view_rows(buffers["prefix"]),
                  add=view_rows(buffers.get("add")), add2=view_rows(buffers.get("add2")), block_residual=block,
                  bank_buffer=bank, res_weight=buffers["res_weight"], rms_weight=buffers["rms_weight"],
                  norm_weight=buffers["norm_weight"], rms_eps=rms_eps, norm_eps=norm_eps, spare_slot=spare,
                  buffers=buffers)


def oracle(inp: Inputs, *, addends: int | None = None, norm: bool = True,
           rms_eps: float | None = None, norm_eps: float | None = None) -> reference.Result:
    """The float64 reference for the case. addends: how many of the case's addends the call uses (default:
    all it has); norm: whether the op has the trailing norm; eps overrides exist for the swapped-eps checks."""
    n_add = (0 if inp.add is None else 1 + (inp.add2 is not None)) if addends is None else addends
    return reference.attn_res(
        inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight,
        inp.rms_eps if rms_eps is None else rms_eps,
        layer_residual_add=inp.add if n_add >= 1 else None,
        layer_residual_add2=inp.add2 if n_add >= 2 else None,
        norm_weight=inp.norm_weight if norm else None,
        norm_eps=inp.norm_eps if norm_eps is None else norm_eps)


# ------------------------------------------------------------------------------------------- calling the ops
def run_attn_res(inp: Inputs, options: attnres.Options | None = None):
    return attnres.attn_res(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.rms_eps,
                            options=options)


def run_rmsnorm(inp: Inputs, *, tap: bool = False, options: attnres.Options | None = None):
    """(output, mixture or None)."""
    r = attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight,
                                 inp.norm_weight, inp.rms_eps, inp.norm_eps, return_mixture=tap, options=options)
    return r if tap else (r, None)


def run_add_rmsnorm(inp: Inputs, *, tap: bool = False, snapshot_slot: int | None = None,
                    options: attnres.Options | None = None, add: Tensor | None = None,
                    add2: Tensor | None = None, use_case_addends: bool = True):
    """(updated, output, mixture or None). The case's own addends unless add/add2 are given."""
    if use_case_addends and add is None:
        add, add2 = inp.add, inp.add2
    r = attnres.attn_res_add_rmsnorm(inp.layer_residual, add, inp.block_residual, inp.res_weight, inp.rms_weight,
                                     inp.norm_weight, inp.rms_eps, inp.norm_eps, layer_residual_add2=add2,
                                     return_mixture=tap, snapshot_slot=snapshot_slot, options=options)
    return r if tap else (*r, None)


def run_persistent(inp: Inputs, *, with_add: bool = True, options: attnres.Options | None = None):
    """(updated or None, output)."""
    return attnres.attn_res_add_rmsnorm_persistent(
        inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps,
        inp.norm_eps, layer_residual_add=inp.add if with_add else None, options=options)


# ----------------------------------------------------------------------------------------- kernels per device
def kernel_options(device, op: str, T: int, N: int, H: int, **flags) -> list[tuple[str, attnres.Options]]:
    """The options under which a device runs the call, each named by the kernel that runs: on the CPU the
    cpu backend; on CUDA the automatic choice plus every per-token kernel the plan accepts when forced."""
    dev = torch.device(device)
    auto = attnres.plan(op, tokens=T, candidates=N, hidden=H, device=dev, **flags)
    out = [(auto.kernel or "declined", attnres.Options())]
    if dev.type == "cuda" and op != "attn_res_add_rmsnorm_persistent":
        for kernel in ("single_cta", "split_k"):
            opts = attnres.Options(kernel=kernel)
            p = attnres.plan(op, tokens=T, candidates=N, hidden=H, device=dev, options=opts, **flags)
            if p.accepted and p.kernel != auto.kernel:
                out.append((kernel, opts))
    return out


# ---------------------------------------------------------------------------------------------- bit checks
def bits(t: Tensor) -> Tensor:
    """The raw bits of a tensor on the CPU (NaN-safe bitwise comparison)."""
    t = t.detach()
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    t = t.cpu().contiguous()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(view)


def assert_same_bits(actual: Tensor, expected: Tensor, what: str) -> None:
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != {expected.dtype}")
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        diff = (a != e)
        idx = diff.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ in bits; first at "
                             f"{idx}: {actual.detach().cpu()[tuple(idx)].item()!r} vs "
                             f"{expected.detach().cpu()[tuple(idx)].item()!r}")


def assert_storage_unchanged(before: dict[str, Tensor], inp: Inputs, *, except_bank_row: int | None = None,
                             expected_row: Tensor | None = None) -> None:
    """Every input buffer equals its clone bit for bit; with except_bank_row, that bank row must instead
    equal expected_row and every other byte of the bank buffer is unchanged."""
    for name, old in before.items():
        now = inp.buffers[name]
        if name == "bank" and except_bank_row is not None:
            want = old.clone()
            if inp.layout == "token_major":
                want[:, except_bank_row, :] = expected_row.to(want.device)
            else:
                want[except_bank_row] = expected_row.to(want.device)
            assert_same_bits(now, want, f"bank buffer after writing snapshot row {except_bank_row}")
        else:
            assert_same_bits(now, old, f"input buffer {name!r}")


def count_subnormal(t: Tensor) -> int:
    x = t.detach().cpu().float()
    return int(((x != 0) & (x.abs() < BF16_TINY)).sum())


def poison_(t: Tensor) -> Tensor:
    """Fill with NaN (floating tensors) so a value that was never written cannot pass a check."""
    return t.fill_(float("nan"))



# ------------------------------------------------------------------------------------------- plan limits
def max_cluster_python() -> int:
    """The largest split_k cluster attnres.Options accepts (probed, so the tests follow plan_tuning.hpp)."""
    best = 0
    for c in range(1, 65):
        try:
            attnres.Options(cluster=c)
        except ValueError:
            break
        best = c
    return best


def max_cluster_library() -> int:
    """The largest cluster the C++ plan accepts, read from its own option check."""
    import re

    from attnres import _C
    q = _C.PlanQuery()
    q.op, q.tokens, q.candidates, q.hidden = _C.AttnResOp.attn_res, 1, 2, 64
    opts = _C.Options()
    opts.cluster = 1000
    try:
        _C.plan_query(q, _C.query_device(_C.DeviceType.cpu, 0), opts)
    except attnres.ArgumentError as e:
        m = re.search(r"options\.cluster must be in \[0, (\d+)\]", str(e))
        if m:
            return int(m.group(1))
        raise
    raise AssertionError("the plan accepted a cluster of 1000")


def checkout_env() -> dict[str, str]:
    """os.environ with the repository root and the attnres these tests import first on PYTHONPATH: a subprocess
    started outside the root runs the checkout's harness packages (python -m tp_check ...) against the same
    library."""
    first = [str(ROOT), str(Path(attnres.__file__).resolve().parent.parent)]
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(first + ([rest] if rest else []))}
