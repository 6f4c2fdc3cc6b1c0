"""The FP8 (e4m3) output of the normed ops: bitwise equal to attnres.fp8.quantize of the op's own bf16 output on
every device and kernel, the scale layout (DeepGEMM's column-major, padded block128 scales), the scale boundary
cases, non-finite groups, rejections that write nothing, CUDA-graph replay and PDL chains.

attnres.fp8.quantize itself is checked against an independent brute-force e4m3 rounding (nearest of the 256
codes' values, ties to the even code)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import attnres
from attnres import _persistent_tuning, fp8
from conftest import DEVICES, requires_cuda
from helpers import BF16, assert_same_bits, bits, kernel_options, make_inputs, poison_

MODES = ("per_token", "block128")


# ------------------------------------------------------------------------------------ the reference itself
def _e4m3_values() -> torch.Tensor:
    """The values of the 256 codes (NaN for 0x7F / 0xFF), as float64."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()


def _brute_e4m3(v: float) -> int:
    """The code nearest to v (|v| <= 448, not NaN); ties go to the code with an even mantissa (bit 0 clear)."""
    table = _e4m3_values()
    best, best_d = None, None
    for code in range(256):
        x = float(table[code])
        if math.isnan(x) or (x == 0 and math.copysign(1, x) != math.copysign(1, v)):
            continue
        if x != 0 and (x < 0) != (v < 0 or (v == 0 and math.copysign(1, v) < 0)):
            continue
        d = abs(x - v)
        if best_d is None or d < best_d or (d == best_d and code % 2 == 0):
            best, best_d = code, d
    return best


def test_e4m3_rounding_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    table = _e4m3_values()
    finite = table[~torch.isnan(table)]
    mids = []
    for a, b in zip(finite.sort().values[:-1], finite.sort().values[1:]):
        m = (float(a) + float(b)) / 2
        mids += [m, math.nextafter(m, -math.inf), math.nextafter(m, math.inf)]  # ties and one ulp either side
    samples = torch.tensor(mids + [0.0, -0.0, 448.0, -448.0, 2.0 ** -10, -(2.0 ** -10), 2.0 ** -11, 1e-30],
                           dtype=torch.float64)
    samples = torch.cat([samples, (torch.rand(300, generator=g, dtype=torch.float64) * 2 - 1) * 448,
                         (torch.rand(200, generator=g, dtype=torch.float64) * 2 - 1) * 2.0 ** -6])
    samples = samples.float().double()  # fp32 values, the quantizer's input type
    # x / s with s = 1: quantize through a group whose amax is 448 (s = 448 / 448 = 1 exactly).
    x = torch.cat([samples, torch.tensor([448.0], dtype=torch.float64)]).float()
    x = x[(x.double() - x.to(BF16).double()).abs() == 0]  # the op's input is bf16: keep bf16 values
    assert x.numel() > 100
    q, s = fp8.quantize(x.to(BF16).reshape(1, -1), "per_token")
    assert float(s) == 1.0
    got = q.view(torch.uint8).reshape(-1).tolist()
    for v, c in zip(x.tolist(), got):
        assert c == _brute_e4m3(v), (v, c)


def test_reference_scale_rules():
    # per token: s = max(amax, 1e-10) / 448; pow2 rounds up to a power of two unless already one.
    x = torch.tensor([[448.0 * 4, 1.0], [0.0, 0.0], [3.0, -5.0]], dtype=BF16)
    _, s = fp8.quantize(x, "per_token")
    assert s[0, 0] == 4.0
    assert s[1, 0] == torch.tensor(1e-10, dtype=torch.float32) / torch.tensor(448.0)
    _, s2 = fp8.quantize(x, "per_token", pow2=True)
    assert s2[0, 0] == 4.0 and s2[2, 0] == 2.0 ** math.ceil(math.log2(5.0 / 448))
    assert s2[1, 0] == 2.0 ** math.ceil(math.log2(float(s[1, 0])))


# ------------------------------------------------------------------------------------------- op plumbing
def _call(op: str, inp, mode, pow2, *, layout_kwargs=None, options=None, tap=False, snapshot_slot=None,
          fp8_only=False):
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    kw = dict(fp8=mode, fp8_pow2_scales=pow2, options=options, fp8_only=fp8_only)
    if op == "attn_res_rmsnorm":
        return attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, return_mixture=tap,
                                        snapshot_slot=snapshot_slot, **kw)
    if op == "attn_res_add_rmsnorm":
        return attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w,
                                            layer_residual_add2=inp.add2, return_mixture=tap,
                                            snapshot_slot=snapshot_slot, **kw)
    return attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual, inp.block_residual, *w,
                                                   layer_residual_add=inp.add, **kw)


def _bf16_call(op: str, inp, options=None):
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    if op == "attn_res_rmsnorm":
        return attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, options=options)
    if op == "attn_res_add_rmsnorm":
        return attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w,
                                            layer_residual_add2=inp.add2, options=options)[1]
    return attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual, inp.block_residual, *w,
                                                   layer_residual_add=inp.add, options=options)[1]


def _check_against_reference(result, mode, pow2, what, bf16_output=None):
    output, q, s = result[-3], result[-2], result[-1]
    T, H = output.shape
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, H)
    assert s.dtype == torch.float32 and s.device == output.device
    if mode == "per_token":
        assert s.shape == (T, 1)
    else:
        assert s.shape == (T, H // 128) and s.stride() == (1, (T + 3) // 4 * 4), s.stride()
    rq, rs = fp8.quantize(output, mode, pow2)
    assert_same_bits(q, rq, f"{what}: codes")
    assert_same_bits(s.contiguous(), rs, f"{what}: scales")
    if bf16_output is not None:
        assert_same_bits(output, bf16_output, f"{what}: the bf16 output changed with fp8")


def _check_fp8_only(op: str, inp, mode, pow2, options, full, what):
    """The FP8-only call (no bf16 output) returns the full call's results (no tap) without the output, bit for
    bit."""
    only = _call(op, inp, mode, pow2, options=options, fp8_only=True)
    expected = full[:-3] + full[-2:] if op != "attn_res_rmsnorm" else full[-2:]
    assert len(only) == len(expected), what
    for i, (got, want) in enumerate(zip(only, expected)):
        if want is None:
            assert got is None, what
        else:
            assert_same_bits(got.contiguous(), want.contiguous(), f"{what}: fp8_only result {i}")


OPS = ("attn_res_rmsnorm", "attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent")
# (T, N, H): H = 1152 splits 128-column groups across split_k's blocks (chunk 72 vectors), 7168 does not; at
# N <= 4 single_cta lays H = 1152 out as split_k's two chunks in one block (a thread's index is not its vector's).
SHAPES = [(1, 2, 128), (3, 5, 384), (2, 4, 1152), (8, 9, 1152), (2, 12, 7168)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode,pow2", list(itertools.product(MODES, (False, True))))
def test_matches_quantized_bf16_output(device, op, mode, pow2):
    shapes = SHAPES if device == "cuda" else SHAPES[:3]
    for (T, N, H), layout in itertools.product(shapes, ("snapshot_major", "token_major")):
        addends = {"attn_res_rmsnorm": 0, "attn_res_add_rmsnorm": 2, "attn_res_add_rmsnorm_persistent": 1}[op]
        inp = make_inputs(T, N, H, layout=layout, addends=addends, seed=T * 31 + N + H, device=device)
        for kernel, opts in kernel_options(device, op, T, N, H, add=addends > 0, add2=addends > 1, fp8=mode):
            what = f"{op} {mode} pow2={pow2} T={T} N={N} H={H} {layout} {kernel}"
            expected_bf16 = _bf16_call(op, inp, opts)
            full = _call(op, inp, mode, pow2, options=opts)
            _check_against_reference(full, mode, pow2, what, expected_bf16)
            _check_fp8_only(op, inp, mode, pow2, opts, full, what)


@requires_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("H,cluster", [(1024, 3), (1024, 8), (1280, 5), (2048, 6), (16384, 8)])
def test_split_k_groups_across_blocks(mode, H, cluster):
    """Forced clusters whose chunks do (1024 / 8, 1280 / 5) and do not (1024 / 3, 2048 / 6) align with the
    128-column groups."""
    for T, N in ((1, 2), (5, 9), (4, 16)):
        inp = make_inputs(T, N, H, addends=1, seed=H + cluster + T, device="cuda")
        opts = attnres.Options(kernel="split_k", cluster=cluster)
        for pow2 in (False, True):
            what = f"split_k H={H} cluster={cluster} T={T} N={N}"
            full = _call("attn_res_add_rmsnorm", inp, mode, pow2, options=opts)
            _check_against_reference(full, mode, pow2, what, _bf16_call("attn_res_add_rmsnorm", inp, opts))
            _check_fp8_only("attn_res_add_rmsnorm", inp, mode, pow2, opts, full, what)


@requires_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("blocks_per_sm", (0, 1, 2))
def test_persistent_every_vector_bucket(mode, blocks_per_sm):
    """Every vector bucket of the persistent kernel's FP8 instances on either geometry (0: the plan's, two blocks
    per SM where that instance exists: H <= 7168 but 1544-2048), one pass and two (N = 9, 16 at H = 7168 on two
    blocks), with the addend and without (attn_res_rmsnorm on the persistent topology). H = 1152 (chunks of 72
    vectors, 3 consumer warps each) and 2560 (chunks of 107, 4 vectors per thread): 128-column groups straddle
    two chunks, hence two consumer warps (the shared-memory group reduction)."""
    variant = _persistent_tuning.Variant(f"{blocks_per_sm} blocks per SM", blocks_per_sm=blocks_per_sm)
    options = variant.options()
    for T, N, H in ((1, 2, 1024), (40, 5, 2048), (7, 9, 7168), (3, 16, 16384), (130, 3, 4096), (5, 4, 1152),
                    (9, 9, 2560), (300, 6, 7168), (6, 16, 7168)):
        for op in ("attn_res_add_rmsnorm_persistent", "attn_res_rmsnorm"):
            add = op != "attn_res_rmsnorm"
            planned = attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cuda", add=add, fp8=mode,
                                   options=options)
            if not planned.accepted:
                assert blocks_per_sm == 2 and planned.decline_code == "persistent_two_blocks_threads", (T, N, H)
                continue
            assert planned.kernel == "persistent" and (blocks_per_sm == 0 or planned.blocks_per_sm == blocks_per_sm)
            inp = make_inputs(T, N, H, addends=int(add), seed=T + H, device="cuda")
            for pow2 in (False, True):
                what = f"{op} T={T} N={N} H={H} blocks_per_sm={planned.blocks_per_sm} passes={planned.passes}"
                full = _call(op, inp, mode, pow2, options=options)
                _check_against_reference(full, mode, pow2, what, _bf16_call(op, inp, options))
                _check_fp8_only(op, inp, mode, pow2, options, full, what)


@pytest.mark.parametrize("device", DEVICES)
def test_tap_and_snapshot_with_fp8(device):
    inp = make_inputs(3, 4, 256, addends=2, device=device, seed=5)
    bank_before = inp.bank_row(inp.spare_slot).clone()
    r = _call("attn_res_add_rmsnorm", inp, "block128", True, tap=True, snapshot_slot=inp.spare_slot)
    assert len(r) == 5
    updated, output, mixture, q, s = r
    assert_same_bits(inp.bank_row(inp.spare_slot), updated, "snapshot row")
    assert not torch.equal(bits(bank_before), bits(updated))
    _check_against_reference((output, q, s), "block128", True, "tap+snapshot")
    r = _call("attn_res_rmsnorm", inp, "per_token", False, tap=True)
    assert len(r) == 4
    _check_against_reference((r[0], r[2], r[3]), "per_token", False, "rmsnorm tap")
    # FP8-only: the same results but the bf16 output, the snapshot row written all the same.
    inp.bank_row(inp.spare_slot).copy_(bank_before)
    only = _call("attn_res_add_rmsnorm", inp, "block128", True, tap=True, snapshot_slot=inp.spare_slot,
                 fp8_only=True)
    assert len(only) == 4
    for got, want in zip(only, (updated, mixture, q, s)):
        assert_same_bits(got.contiguous(), want.contiguous(), "fp8_only tap+snapshot")
    assert_same_bits(inp.bank_row(inp.spare_slot), updated, "fp8_only snapshot row")
    only = _call("attn_res_rmsnorm", inp, "per_token", False, tap=True, fp8_only=True)
    assert len(only) == 3
    for got, want in zip(only, r[1:]):
        assert_same_bits(got, want, "fp8_only rmsnorm tap")


# ---------------------------------------------------------------------------------------- boundary cases
def _boundary_inputs(device, columns: torch.Tensor):
    """A call whose bf16 output is exactly `columns` ([T, H] bf16): N = 1 (the mixture is the prefix), a
    prefix of ones and norm_eps = 0 (r = 1, normed = 1), so output = norm_weight... per token: the rows of
    `columns` become the norm weights of separate calls."""
    T, H = columns.shape
    inp = make_inputs(1, 1, H, device=device, norm_eps=0.0)
    inp.layer_residual.fill_(1.0)
    return inp


def _boundary_groups() -> list[torch.Tensor]:
    """128-element bf16 groups: all zero, subnormal amax, amax at 448 * 2^k and one bf16 ulp either side, a
    group whose maximum scales to exactly +-448, mixed magnitudes down to e4m3 subnormals, signed zeros, and
    groups whose other elements scale to fp32 subnormals."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(128, generator=g)
    groups = [torch.zeros(128), torch.full((128,), -0.0)]
    sub = torch.tensor(2.0 ** -130)
    groups.append(base.sign() * sub)
    for k in (-30, -7, -1, 0, 1, 9, 60):
        amax = torch.tensor(448.0 * 2.0 ** k, dtype=BF16)
        for a in (amax, torch.nextafter(amax, torch.tensor(0.0, dtype=BF16)),
                  torch.nextafter(amax, torch.tensor(math.inf, dtype=BF16))):
            x = (base / base.abs().max() * a.float() * 0.999)
            x[3] = a.float()
            x[9] = -a.float()
            groups.append(x)
    x = base * torch.logspace(-12, 0, 128, base=2.0)
    groups.append(x)
    # fp32-subnormal quotients (x / s with s = 2^9, 2^60): the kernels' division without range checks
    # (cpp/src/cuda/fp8_epilogue.cuh) must give the IEEE division's codes there too, with exact and pow2 scales.
    for k, e in ((9, -120), (60, -80)):
        x = base * 2.0 ** e
        x[7] = 448.0 * 2.0 ** k
        groups.append(x)
    return [gr.to(BF16) for gr in groups]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_scale_boundaries(device, mode):
    groups = _boundary_groups()
    for pow2 in (False, True):
        for i in range(0, len(groups), 4):
            row = torch.cat(groups[i:i + 4])  # up to 4 groups of 128 columns in one token
            H = row.numel()
            inp = make_inputs(1, 1, H, device=device, norm_eps=0.0)
            inp.layer_residual.fill_(1.0)
            inp.norm_weight.copy_(row)
            r = _call("attn_res_rmsnorm", inp, mode, pow2)
            assert_same_bits(r[0], row.reshape(1, H).to(device), "the output is the constructed row")
            _check_against_reference(r, mode, pow2, f"boundary groups {i}..{i + 3} pow2={pow2}")
            q = r[1].view(torch.uint8).cpu()
            if mode == "block128":
                s = r[2].cpu()
                for j, gr in enumerate(groups[i:i + 4]):
                    amax = gr.float().abs().max()
                    if amax > 1e-10 and not pow2:
                        # the group's maximum scales to 448 (or within one rounding of it): code 0x7E
                        assert (q[0, j * 128:(j + 1) * 128] & 0x7F).max() == 0x7E, (i, j)
                    if amax == 0 and not pow2:
                        assert s[0, j] == torch.tensor(1e-10) / torch.tensor(448.0)
                    if amax == 0 and pow2:
                        assert s[0, j] == 2.0 ** -42  # 1e-10 / 448 = 1.95 * 2^-43, rounded up


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_groups(device, mode):
    """A NaN in a group: scale NaN (0x7FC00000), every code 0x7F. An inf: scale inf, finite codes +-0,
    the inf itself 0x7F (inf / inf). Other groups are unaffected (block128)."""
    H = 256
    row = torch.linspace(-3, 3, H)
    row[5] = float("nan")
    row[200] = float("inf")
    for pow2 in (False, True):
        inp = make_inputs(1, 1, H, device=device, norm_eps=0.0)
        inp.layer_residual.fill_(1.0)
        inp.norm_weight.copy_(row.to(BF16))
        r = _call("attn_res_rmsnorm", inp, mode, pow2)
        _check_against_reference(r, mode, pow2, f"non-finite pow2={pow2}")
        q, s = r[1].view(torch.uint8).cpu(), r[2].cpu().contiguous()
        assert s[0, 0].view(torch.int32) == 0x7FC00000
        assert (q[0, :128] == 0x7F).all()
        if mode == "block128":
            assert math.isinf(float(s[0, 1]))
            assert q[0, 200] == 0x7F
            others = torch.cat([q[0, 128:200], q[0, 201:]])
            assert ((others == 0x00) | (others == 0x80)).all()


# ---------------------------------------------------------------------------------------------- rejections
@pytest.mark.parametrize("device", DEVICES)
def test_rejections_write_nothing(device):
    inp = make_inputs(2, 3, 200, addends=1, device=device)  # H = 200: not a multiple of 128
    codes = torch.full((2, 200), 0x55, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    scales = torch.full((2, 1), -7.0, device=device)
    before = inp.storage_snapshot()
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    cases = [
        (lambda: attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, fp8="block128"),
         "attn_res_rmsnorm: fp8 = block128 needs the hidden size H to be a multiple of 128, got H = "),
        (lambda: attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, fp8="fp8"), "fp8 must be"),
        (lambda: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w,
                                              fp8_pow2_scales=True), "fp8_pow2_scales requires"),
        (lambda: attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual, inp.block_residual, *w,
                                                         fp8="block128"), "multiple of 128"),
        (lambda: torch.ops.attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, False,
                                                    "block128"), "multiple of 128"),
        (lambda: torch.ops.attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, None, inp.block_residual,
                                                        *w, False, "per_tensor"), "fp8 must be"),
        (lambda: torch.ops.attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, None, inp.block_residual,
                                                        *w, False, "block128", topology="persistent"),
         "multiple of 128"),
        # fp8_only: an FP8 mode is required, and no output tensor is taken.
        (lambda: attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, fp8_only=True),
         "^attn_res_rmsnorm: fp8_only requires fp8 = 'per_token' or 'block128'"),
        (lambda: attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual, inp.block_residual, *w,
                                                         layer_residual_add=inp.add, fp8_only=True),
         "^attn_res_add_rmsnorm: fp8_only requires fp8"),
        (lambda: torch.ops.attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, None, inp.block_residual,
                                                        *w, fp8_only=True), "fp8_only requires fp8"),
        (lambda: torch.ops.attnres.attn_res_rmsnorm.out(
            inp.layer_residual, inp.block_residual, *w, fp8="per_token", fp8_only=True,
            output=torch.empty_like(inp.layer_residual), output_fp8=codes, fp8_scales=scales),
         "^attn_res_rmsnorm: fp8_only takes no output tensor"),
        (lambda: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w, fp8="per_token",
                                              fp8_only=True, out=(None, torch.empty_like(inp.layer_residual),
                                                                  codes, scales)),
         r"out must be a tuple of 3 tensors or None \(updated, output_fp8, fp8_scales\)"),
        # Without an FP8 mode the library requires the output (a .out call that leaves it None).
        (lambda: torch.ops.attnres.attn_res_rmsnorm.out(inp.layer_residual, inp.block_residual, *w,
                                                        output=None),
         r"^attn_res_rmsnorm: output is required \(only an FP8 call may leave it out"),
    ]
    for call, message in cases:
        with pytest.raises(attnres.ArgumentError, match=message):
            call()
    for name, buf in inp.storage_snapshot().items():
        assert torch.equal(bits(buf), bits(before[name])), name
    assert (codes.view(torch.uint8) == 0x55).all() and (scales == -7.0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_out_call_without_output_is_the_fp8_only_call(device):
    """torch.ops' .out overload with output=None and an FP8 mode (fp8_only or not) writes the codes and scales of
    the call that also writes the output."""
    inp = make_inputs(3, 4, 256, addends=1, device=device, seed=9)
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    updated, output, q, s = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w,
                                                         fp8="block128")
    for fp8_only in (False, True):
        u = torch.empty_like(updated)
        q2 = torch.full_like(q.view(torch.uint8), 0x55).view(torch.float8_e4m3fn)
        s2 = fp8.empty_scales("block128", 3, 256, device).fill_(-7.0)
        torch.ops.attnres.attn_res_add_rmsnorm.out(inp.layer_residual, inp.add, None, inp.block_residual, *w,
                                                   fp8="block128", fp8_only=fp8_only, updated=u, output=None,
                                                   output_fp8=q2, fp8_scales=s2)
        for got, want in ((u, updated), (q2, q), (s2, s)):
            assert_same_bits(got, want, f".out without output, fp8_only={fp8_only}")
        functional = torch.ops.attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, None, inp.block_residual,
                                                            *w, fp8="block128", fp8_only=True)
        assert functional[1].shape == (0,)
        assert_same_bits(functional[3], q, "functional fp8_only codes")


@pytest.mark.parametrize("device", DEVICES)
def test_eager_fp8_call_goes_straight_to_the_library(device, monkeypatch):
    """A plain eager FP8 call (no out=, tap, snapshot or options) skips the generic op path (ops._run) and gives
    the generic path's results bit for bit (options=DEFAULT takes the generic path); malformed calls still get
    the generic path's errors."""
    from attnres import ops

    inp = make_inputs(3, 5, 256, addends=2, device=device, seed=21)
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    calls = {
        "add": lambda only, **kw: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w,
                                                               layer_residual_add2=inp.add2, fp8="block128",
                                                               fp8_pow2_scales=True, fp8_only=only, **kw),
        "norm": lambda only, **kw: attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w,
                                                            fp8="per_token", fp8_only=only, **kw),
    }
    generic = {(name, only): f(only, options=attnres.Options()) for name, f in calls.items() for only in (0, 1)}

    def no_generic_path(*args, **kwargs):
        raise AssertionError("the eager FP8 call took the generic path")

    monkeypatch.setattr(ops, "_run", no_generic_path)
    for (name, only), want in generic.items():
        got = calls[name](bool(only))
        assert len(got) == len(want), (name, only)
        for g, e in zip(got, want):
            assert (g.shape, g.stride(), g.dtype) == (e.shape, e.stride(), e.dtype), (name, only)
            assert_same_bits(g.contiguous(), e.contiguous(), f"{name} fp8_only={only}")
    monkeypatch.undo()
    for bad, message in ((["per_token"], "fp8 must be None, 'per_token' or 'block128'"),
                         ("per_tensor", "fp8 must be None, 'per_token' or 'block128'")):
        with pytest.raises(attnres.ArgumentError, match=message):
            attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, fp8=bad)
    with pytest.raises(attnres.ArgumentError, match="^attn_res_add_rmsnorm: layer_residual must be a 2-D"):
        attnres.attn_res_add_rmsnorm(inp.layer_residual[0], inp.add[0], inp.block_residual, *w, fp8="per_token")


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_only_out_returns_the_given_tensors(device):
    """out= of an FP8-only call is (updated, output_fp8, fp8_scales): the given tensors come back, written with the
    allocating call's bits; updated may be the prefix itself (in place)."""
    inp = make_inputs(3, 4, 256, addends=1, device=device, seed=13)
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    want = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w, fp8="block128",
                                        fp8_only=True)
    q = torch.full((3, 256), 0x55, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    s = fp8.empty_scales("block128", 3, 256, device).fill_(-7.0)
    prefix = inp.layer_residual.clone()
    got = attnres.attn_res_add_rmsnorm(prefix, inp.add, inp.block_residual, *w, fp8="block128", fp8_only=True,
                                       out=(prefix, q, s))
    assert got[0] is prefix and got[1] is q and got[2] is s
    for g, e in zip(got, want):
        assert_same_bits(g, e, "fp8_only out=")


def test_cpp_rejections_of_fp8_tensors():
    """The C++ validation, reached through attnres._C with hand-built arguments: attn_res cannot emit FP8,
    wrong dtype, shape and block128 strides are named."""
    from attnres import _C
    from attnres._tensors import ref

    T, H = 3, 256
    inp = make_inputs(T, 2, H)
    out = torch.empty(T, H, dtype=BF16)
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn)

    def args(mode, scales, codes=q):
        a = _C.AttnResArgs()
        for key, t in (("layer_residual", inp.layer_residual), ("block_residual", inp.block_residual),
                       ("res_weight", inp.res_weight), ("rms_weight", inp.rms_weight),
                       ("norm_weight", inp.norm_weight), ("output", out)):
            setattr(a, key, ref(t, "t", key))
        a.fp8 = getattr(_C.Fp8Scales, mode)
        a.output_fp8 = ref(codes, "t", "output_fp8")
        a.fp8_scales = ref(scales, "t", "fp8_scales")
        return a

    good = fp8.empty_scales("block128", T, H, "cpu")
    _C.validate(_C.AttnResOp.attn_res_rmsnorm, args("block128", good))
    bad = [
        (args("block128", torch.empty(T, 2)), "^attn_res_rmsnorm: fp8_scales must be column-major over tokens with the token stride padded"),
        (args("block128", torch.empty_strided((T, 2), (1, T))), "^attn_res_rmsnorm: fp8_scales must be column-major over tokens"),
        (args("block128", torch.empty(T, 3)), "shape"),
        (args("per_token", torch.empty(T, 2)), r"\[T, 1\]"),
        (args("per_token", torch.empty(T, 1, dtype=torch.float64)), "float32"),
        (args("per_token", torch.empty(T, 1), torch.empty(T, H, dtype=torch.uint8)), "float8_e4m3fn"),
        (args("per_token", torch.empty(T, 1), torch.empty(T, H + 8, dtype=torch.float8_e4m3fn)), "output_fp8"),
    ]
    for a, message in bad:
        with pytest.raises(attnres.ArgumentError, match=message):
            _C.validate(_C.AttnResOp.attn_res_rmsnorm, a)
    a = args("per_token", torch.empty(T, 1))
    a.norm_weight = _C.TensorRef()
    with pytest.raises(attnres.ArgumentError, match="attn_res has no normed output"):
        _C.validate(_C.AttnResOp.attn_res, a)
    a = args("per_token", torch.empty(T, 1))
    a.fp8 = _C.Fp8Scales.none
    with pytest.raises(attnres.ArgumentError, match="^attn_res_rmsnorm: output_fp8 requires fp8 = per_token or block128"):
        _C.validate(_C.AttnResOp.attn_res_rmsnorm, a)
    a = args("per_token", good[:, :1].contiguous())
    a.output_fp8 = _C.TensorRef()
    with pytest.raises(attnres.ArgumentError, match="^attn_res_rmsnorm: output_fp8 is required with fp8 = "):
        _C.validate(_C.AttnResOp.attn_res_rmsnorm, a)


def test_plan_declines_what_the_ops_reject():
    assert not attnres.plan("attn_res", tokens=1, candidates=2, hidden=256, fp8="per_token").accepted
    assert not attnres.plan("attn_res_rmsnorm", tokens=1, candidates=2, hidden=200, fp8="block128").accepted
    assert not attnres.plan("attn_res_rmsnorm", tokens=1, candidates=2, hidden=256, fp8_pow2_scales=True).accepted
    assert attnres.plan("attn_res_rmsnorm", tokens=1, candidates=2, hidden=256, fp8="block128").accepted
    with pytest.raises(ValueError, match="^attnres.plan: fp8 must be one of "):
        attnres.plan("attn_res_rmsnorm", tokens=1, candidates=2, hidden=256, fp8="x")


# ------------------------------------------------------------------------------------- torch.ops, compile
@pytest.mark.parametrize("mode", MODES)
def test_fake_shapes_and_strides(mode):
    from torch._subclasses.fake_tensor import FakeTensorMode

    T, H = 5, 384
    inp = make_inputs(T, 3, H, addends=1)
    real = torch.ops.attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, None, inp.block_residual,
                                                  inp.res_weight, inp.rms_weight, inp.norm_weight, 1e-5, 1e-5,
                                                  False, mode)
    with FakeTensorMode() as m:
        args = [m.from_tensor(t) for t in (inp.layer_residual, inp.add, inp.block_residual, inp.res_weight,
                                            inp.rms_weight, inp.norm_weight)]
        fake = torch.ops.attnres.attn_res_add_rmsnorm(args[0], args[1], None, *args[2:], 1e-5, 1e-5, False, mode)
        fake_rms = torch.ops.attnres.attn_res_rmsnorm(args[0], args[2], *args[3:], 1e-5, 1e-5, False, mode)
        fake_only = torch.ops.attnres.attn_res_rmsnorm(args[0], args[2], *args[3:], 1e-5, 1e-5, False, mode,
                                                       fp8_only=True)
        with pytest.raises(attnres.ArgumentError, match="fp8_only requires fp8"):
            torch.ops.attnres.attn_res_rmsnorm(args[0], args[2], *args[3:], 1e-5, 1e-5, fp8_only=True)
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    assert fake_rms[3].stride() == real[4].stride() and fake_rms[2].dtype == torch.float8_e4m3fn
    assert fake_only[0].shape == (0,) and (fake_only[2].shape, fake_only[3].stride()) == (fake_rms[2].shape,
                                                                                          fake_rms[3].stride())


def test_compiled_matches_eager():
    inp = make_inputs(4, 3, 256, addends=1, seed=3)

    def f(lr, add, bank, a, b, c):
        return attnres.attn_res_add_rmsnorm(lr, add, bank, a, b, c, 1e-5, 1e-5, fp8="block128", fp8_pow2_scales=True)

    args = (inp.layer_residual, inp.add, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight)
    eager = f(*args)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    for e, c in zip(eager, compiled):
        assert_same_bits(c.contiguous(), e.contiguous(), "compiled")
    assert compiled[3].stride() == eager[3].stride()

    def g(lr, add, bank, a, b, c):
        return attnres.attn_res_add_rmsnorm(lr, add, bank, a, b, c, 1e-5, 1e-5, fp8="per_token", fp8_only=True)

    compiled = torch.compile(g, backend="aot_eager", fullgraph=True)(*args)
    full = attnres.attn_res_add_rmsnorm(*args, 1e-5, 1e-5, fp8="per_token")
    assert len(compiled) == 3
    for c, e in zip(compiled, (full[0], full[2], full[3])):
        assert_same_bits(c, e, "compiled fp8_only")


# ------------------------------------------------------------------------------------- graphs and PDL (GPU)
@requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_graph_replay_and_pdl_chain(mode):
    """A chain of FP8 ops (each reading the previous op's updated prefix) captured in one CUDA graph, with
    PDL, replayed on fresh inputs: every op's codes and scales equal the quantized bf16 output of an eager
    run of the same chain; the same chain of FP8-only calls, too."""
    T, N, H = 4, 9, 7168
    inp = make_inputs(T, N, H, addends=1, seed=11, device="cuda")
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    prefix = inp.layer_residual.clone()

    def chain():
        p, outs = prefix, []
        for step in range(3):
            updated, output, q, s = attnres.attn_res_add_rmsnorm(p, inp.add, inp.block_residual, *w, fp8=mode,
                                                                 fp8_pow2_scales=step % 2 == 1)
            outs.append((output, q, s))
            p = updated
        return outs

    chain()  # warm-up (instances, attributes)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = chain()
    for trial in range(2):
        prefix.copy_(make_inputs(T, N, H, addends=1, seed=100 + trial, device="cuda").layer_residual)
        for o, q, s in captured:
            poison_(o)
            q.view(torch.uint8).fill_(0x55)
            s.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        eager = chain()
        for step, ((o, q, s), (eo, eq, es)) in enumerate(zip(captured, eager)):
            assert_same_bits(o, eo, f"replay {trial} step {step}: output")
            assert_same_bits(q, eq, f"replay {trial} step {step}: codes")
            rq, rs = fp8.quantize(o, mode, step % 2 == 1)
            assert_same_bits(q, rq, f"replay {trial} step {step}: codes vs reference")
            assert_same_bits(s.contiguous(), rs, f"replay {trial} step {step}: scales vs reference")

    def chain_fp8_only():
        p, outs = prefix, []
        for step in range(3):
            updated, q, s = attnres.attn_res_add_rmsnorm(p, inp.add, inp.block_residual, *w, fp8=mode,
                                                         fp8_pow2_scales=step % 2 == 1, fp8_only=True)
            outs.append((q, s))
            p = updated
        return outs

    chain_fp8_only()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = chain_fp8_only()
    prefix.copy_(make_inputs(T, N, H, addends=1, seed=200, device="cuda").layer_residual)
    for q, s in captured:
        q.view(torch.uint8).fill_(0x55)
        s.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for step, ((q, s), (_, eq, es)) in enumerate(zip(captured, chain())):
        assert_same_bits(q, eq, f"fp8_only replay step {step}: codes")
        assert_same_bits(s.contiguous(), es.contiguous(), f"fp8_only replay step {step}: scales")
