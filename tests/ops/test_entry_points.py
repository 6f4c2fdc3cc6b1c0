"""Every public entry point is as safe as the wrappers: torch.ops.attnres.* validate their own arguments
(the snapshot op's bank rows), a meta tensor among real tensors raises instead of reaching the fake
implementation, fake implementations raise the real op's ArgumentError, DLPack producers with negative
strides are refused before torch.from_dlpack, and error messages name values and dtypes exactly."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnres
from attnres import knobs
from cli_checks import assert_first_call_cheap
from conftest import DEVICES, requires_cuda

BF16 = torch.bfloat16


def _attn(T=4, H=64, K=2, device="cpu"):
    g = torch.Generator().manual_seed(3)
    lr = torch.randn(T, H, generator=g).to(BF16).to(device)
    bank = torch.randn(K, T, H, generator=g).to(BF16).to(device)
    w = torch.ones(H, dtype=BF16, device=device)
    return lr, bank, w


# ------------------------------------------------------------------- 1. the snapshot op's bank rows
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K,slot,message", [
    (15, -1, "num_snapshots 15 exceeds the bank's 1 rows"),
    (1, 1, "snapshot_slot 1 lies outside the bank's 1 rows (the bank must hold at least 2 snapshot rows)"),
    (-1, -1, "num_snapshots must be >= 0, got -1"),
    (-3, 0, "num_snapshots must be >= 0, got -3"),
])
def test_snapshot_op_refuses_rows_outside_the_bank(K, slot, message, device):
    """The reproducer read K = 15 rows from a 1-row bank (SIGSEGV); each bad combination now raises and the
    bank is untouched."""
    T, H = 64, 1024
    lr, bank, w = _attn(T, H, 1, device)
    before = bank.clone()
    with pytest.raises(attnres.ArgumentError) as e:
        torch.ops.attnres.attn_res_add_rmsnorm_snapshot(lr, torch.zeros_like(lr), None, bank, K, slot, w, w, w,
                                                        1e-5, 1e-5)
    assert str(e.value) == f"attn_res_add_rmsnorm: {message}"
    assert torch.equal(bank.view(torch.int16), before.view(torch.int16))


def test_snapshot_op_still_writes_inside_the_bank():
    lr, bank, w = _attn(4, 64, 3)
    bank[2].fill_(float("nan"))
    updated, *_ = torch.ops.attnres.attn_res_add_rmsnorm_snapshot(lr, torch.zeros_like(lr), None, bank, 2, 2, w, w,
                                                                  w, 1e-5, 1e-5)
    assert torch.equal(bank[2].view(torch.int16), updated.view(torch.int16))


# ------------------------------------------------------------------- 2. meta tensors among real ones
def _calls(lr, bank, w):
    """One call of every op, as (name, thunk) with the tensors given."""
    index = torch.zeros((lr.shape[0], 2), dtype=torch.int32, device=lr.device if lr.device.type != "meta" else "cpu")
    weights = torch.ones((lr.shape[0], 2), dtype=torch.float32, device=index.device)
    ops = torch.ops.attnres
    return [
        ("attn_res", lambda: ops.attn_res(lr, bank, w, w, 1e-5)),
        ("attn_res_rmsnorm", lambda: ops.attn_res_rmsnorm(lr, bank, w, w, w, 1e-5, 1e-5)),
        ("attn_res_add_rmsnorm", lambda: ops.attn_res_add_rmsnorm(lr, lr, None, bank, w, w, w, 1e-5, 1e-5)),
        ("attn_res_add_rmsnorm_snapshot",
         lambda: ops.attn_res_add_rmsnorm_snapshot(lr, lr, None, bank, 1, 1, w, w, w, 1e-5, 1e-5)),
        ("attn_res_add_rmsnorm (persistent topology)",
         lambda: ops.attn_res_add_rmsnorm(lr, lr, None, bank, w, w, w, 1e-5, 1e-5, topology="persistent")),
        ("moe_finalize", lambda: ops.moe_finalize(lr, weights, index, None, None, 1e-5, 1.0)),
    ]


@pytest.mark.parametrize("which", range(6))
def test_one_meta_tensor_among_cpu_tensors_raises(which):
    """torch dispatches a call with any meta tensor to the Meta kernel (the fake implementation): it must
    refuse the mix instead of returning unwritten CPU tensors."""
    lr, bank, w = _attn()
    before = bank.clone()
    name, call = _calls(lr, bank.to("meta") if which != 5 else bank, w if which != 5 else w)[which]
    if which == 5:  # moe_finalize: a meta weights tensor among CPU rows and index
        index = torch.zeros((4, 2), dtype=torch.int32)
        call = lambda: torch.ops.attnres.moe_finalize(lr, torch.ones((4, 2), device="meta"), index, None, None,  # noqa: E731
                                                      1e-5, 1.0)
    with pytest.raises(attnres.ArgumentError, match=r"is on (meta|cpu) but \w+ is on (cpu|meta) \(all tensors "
                                                    r"must be on one device\)$"):
        call()
    assert torch.equal(bank.view(torch.int16), before.view(torch.int16))


def test_all_meta_calls_still_infer_shapes():
    lr, bank, w = (t.to("meta") for t in _attn())
    _, mixture, rsigma, _, _ = torch.ops.attnres.attn_res(lr, bank, w, w, 1e-5)
    assert mixture.device.type == "meta" and tuple(mixture.shape) == (4, 64) and tuple(rsigma.shape) == (3, 4)


# ------------------------------------------------------------------- fake implementations validate
def test_fake_implementations_raise_the_real_ops_argument_error():
    lr, bank, w = _attn()
    with pytest.raises(attnres.ArgumentError) as real:
        torch.ops.attnres.attn_res(lr[None], bank, w, w, 1e-5)
    with FakeTensorMode() as mode:
        f_lr, f_bank, f_w = (mode.from_tensor(t) for t in (lr, bank, w))
        with pytest.raises(attnres.ArgumentError) as fake:
            torch.ops.attnres.attn_res(f_lr[None], f_bank, f_w, f_w, 1e-5)
        with pytest.raises(attnres.ArgumentError, match=r"^attn_res_rmsnorm: norm_eps must be finite and >= 0, "
                                                        r"got -1e-07$"):
            torch.ops.attnres.attn_res_rmsnorm(f_lr, f_bank, f_w, f_w, f_w, 1e-5, -1e-7)
        rows = mode.from_tensor(torch.zeros((4, 64), dtype=BF16))
        with pytest.raises(attnres.ArgumentError, match=r"^moe_finalize: index must be a 2-D \[T, k\] tensor"):
            torch.ops.attnres.moe_finalize(rows, rows, mode.from_tensor(torch.zeros((2, 2, 2), dtype=torch.int32)),
                                           None, None, 1e-5, 1.0)
    assert str(fake.value) == str(real.value) == (
        "attn_res: layer_residual must be a 2-D [T, H] tensor, got 3 dimensions [1, 4, 64]")


def test_wrong_rank_under_torch_compile_is_the_argument_error():
    """Dynamo wraps what a fake implementation raises; the cause is the library's ArgumentError (it was a
    ValueError from unpacking the shape)."""
    lr, bank, w = _attn()
    torch._dynamo.reset()
    step = torch.compile(lambda a, b: torch.ops.attnres.attn_res(a, b, w, w, 1e-5), fullgraph=True)
    with pytest.raises(Exception) as e:
        step(lr[None], bank)
    chain, err = [], e.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(x, attnres.ArgumentError) and str(x).startswith("attn_res: layer_residual must be a 2-D")
               for x in chain) or "ArgumentError('attn_res: layer_residual must be a 2-D" in str(e.value)


# ------------------------------------------------------------------- 3. DLPack producers
class _Producer:
    """A DLPack producer that is not numpy (the generic path through the capsule)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("wrap", [lambda a: a, _Producer], ids=["numpy", "generic"])
def test_negative_stride_dlpack_producer_is_refused_not_aborted(wrap):
    """torch.from_dlpack aborts the interpreter on a negative stride: the producer is inspected first."""
    lr, bank, w = _attn(4, 16)
    flipped = np.zeros((4, 16), np.float32)[::-1]
    with pytest.raises(attnres.ArgumentError, match=r"^attn_res: layer_residual has a negative stride \[-16, 1\]$"):
        attnres.attn_res(wrap(flipped), bank, w, w, 1e-5)
    good = np.ascontiguousarray(lr.float().numpy())
    with pytest.raises(attnres.ArgumentError, match="layer_residual must be bfloat16, got float32"):
        attnres.attn_res(wrap(good), bank, w, w, 1e-5)  # imported, then judged by the library


# ------------------------------------------------------------------- 4. messages
@pytest.mark.parametrize("eps,shown", [(-1e-7, "-1e-07"), (-0.5, "-0.5"), (1e39, "1e+39 (infinite as float32")])
def test_eps_is_printed_exactly_and_float32_overflow_refused(eps, shown):
    lr, bank, w = _attn()
    with pytest.raises(attnres.ArgumentError, match=r"^attn_res: rms_eps must be finite and >= 0, got "
                                                    + shown.replace("(", r"\(").replace("+", r"\+")):
        attnres.attn_res(lr, bank, w, w, eps)


def test_moe_scale_infinite_as_float32_is_refused():
    rows = torch.ones((4, 64), dtype=BF16)
    index = torch.zeros((4, 2), dtype=torch.int32)
    weights = torch.ones((4, 2))
    with pytest.raises(attnres.ArgumentError, match=r"^moe_finalize: scale must be finite, got 1e\+39 \(infinite "
                                                    r"as float32"):
        attnres.moe_finalize(rows, weights, index, eps=1e-5, scale=1e39)


def test_a_5000_digit_knob_value_is_a_knob_error():
    with pytest.raises(knobs.KnobError, match=r"^KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS: expected a base-10 integer "
                                              r"in \[0, 16384\], got a 5000-digit value$"):
        knobs.load({"KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS": "9" * 5000})


# ------------------------------------------------------------------- first call after import
def test_first_op_call_after_import_is_cheap():
    """The first call used to import torch._dynamo (seconds: torch.library.custom_op's kernels are wrapped in
    dynamo's disable). Measured in a fresh interpreter; the best of three processes, so one slow start on a
    loaded 2-core machine does not fail the test (a regression costs seconds, far above the limit)."""
    code = textwrap.dedent("""
        import sys, time
        import torch, attnres
        lr = torch.randn(4, 64).bfloat16(); bank = torch.randn(2, 4, 64).bfloat16()
        w = torch.ones(64, dtype=torch.bfloat16)
        t = time.perf_counter(); attnres.attn_res(lr, bank, w, w, 1e-5); first = time.perf_counter() - t
        print(first, "torch._dynamo" in sys.modules)
    """)
    assert_first_call_cheap(code)


# ------------------------------------------------------------------- described devices
@pytest.mark.parametrize("op,flags", [("attn_res", {}), ("attn_res_add_rmsnorm", {"add": True, "add2": True}),
                                      ("attn_res_add_rmsnorm_persistent", {"add": True})])
def test_described_gpu_plans_without_a_gpu(op, flags):
    props = {"cc_major": 9, "cc_minor": 0, "sm_count": 132, "shared_memory_per_block_optin": 232448}
    for T in (1, 8, 300):
        for N in (2, 9, 16):
            h200 = attnres.plan(op, tokens=T, candidates=N, hidden=7168, device="h200", **flags)
            assert h200 == attnres.plan(op, tokens=T, candidates=N, hidden=7168, device=props, **flags)
            assert h200 == attnres.plan(op, tokens=T, candidates=N, hidden=7168, device="h100", **flags)
            assert h200.accepted and h200.kernel in ("split_k", "single_cta", "persistent")
    with pytest.raises(attnres.ArgumentError, match=r"^attnres\.plan: the described device's cc_minor must be an int, got None$"):
        attnres.plan(op, tokens=1, candidates=2, hidden=64, device={"cc_major": 9}, **flags)


@requires_cuda
def test_described_h200_is_the_real_devices_plan():
    """On an H200 the described device plans exactly as the device itself, over a grid of shapes."""
    if "H200" not in torch.cuda.get_device_name():
        pytest.skip("needs an H200")
    for op, flags in (("attn_res", {}), ("attn_res_rmsnorm", {"tap": True}), ("attn_res_add_rmsnorm", {"add": True}),
                      ("attn_res_add_rmsnorm", {"add": True, "add2": True, "snapshot": True}),
                      ("attn_res_add_rmsnorm_persistent", {"add": True})):
        for topology in ("per_token", "split", "persistent"):
            options = attnres.Options(topology=topology)
            for T in (1, 4, 32, 64, 65, 300, 4096):
                for N in (1, 2, 5, 9, 16):
                    for H in (8, 2304, 7168, 16384):
                        args = dict(tokens=T, candidates=N, hidden=H, options=options, **flags)
                        assert attnres.plan(op, device="h200", **args) == attnres.plan(op, device="cuda", **args), args
