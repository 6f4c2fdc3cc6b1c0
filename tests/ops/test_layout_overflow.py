"""Defect 3 of issue 34: layouts whose sizes overflow int64. A DLPack producer with such strides aborted the
interpreter inside torch.from_dlpack (c10::Error through a C++ boundary, exit 134) in every op family; the
library's own layout arithmetic wrapped (a token stride of 2^62 passed the overlap check and put every token's
fp8 scale on one address). Both are refused now with ArgumentError; the C++ side is in
cpp/tests/test_layout_overflow.cpp."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _C
from attnres.comm import InProcessWorld

np = pytest.importorskip("numpy")

BF16 = torch.bfloat16
T, H, K = 4, 64, 2
HUGE = 1 << 62  # bytes: numpy strides are in bytes, DLPack's in elements
OVERFLOW = "has a layout whose storage size overflows int64"


def _huge(shape=(T, H), dtype=np.float32):
    """A view with a 2^62-byte stride on its first dimension of size >= 3: (size - 1) x 2^62 overflows."""
    base = np.zeros(16, dtype=dtype)
    strides = [base.itemsize] * len(shape)
    strides[next(i for i, n in enumerate(shape) if n >= 3)] = HUGE
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


def _inputs():
    g = torch.Generator().manual_seed(0)
    lr = torch.randn(T, H, generator=g).to(BF16)
    bank = torch.randn(K, T, H, generator=g).to(BF16)
    w = torch.ones(H, dtype=BF16)
    return lr, bank, w


def _world_call(fn):
    world = InProcessWorld(1, T, H)
    try:
        return world.run(fn, [torch.zeros(T, H, dtype=BF16)])
    finally:
        world.close()


def _cases():
    lr, bank, w = _inputs()
    rows, weights, index = torch.zeros(6, H, dtype=BF16), torch.ones(T, 1), torch.zeros(T, 1, dtype=torch.int32)
    return {
        "attn_res": lambda: attnres.attn_res(_huge(), bank, w, w, 1e-5),
        "attn_res_rmsnorm fp8_scales out": lambda: attnres.attn_res_rmsnorm(
            lr, bank, w, w, w, 1e-5, 1e-5, fp8="per_token", out=(None, None, _huge((T, 1)))),
        "attn_res_add_rmsnorm": lambda: attnres.attn_res_add_rmsnorm(lr, _huge(), bank, w, w, w, 1e-5, 1e-5),
        "moe_finalize": lambda: attnres.moe_finalize(_huge((6, H)), weights, index, eps=0.0),
        "all_reduce": lambda: _world_call(lambda c, p: attnres.all_reduce(c, _huge())),
        "all_reduce out": lambda: _world_call(lambda c, p: attnres.all_reduce(c, p, out=(_huge(),))),
        "all_reduce_attn_res_add_rmsnorm": lambda: _world_call(
            lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(c, p, lr, _huge((K, T, H)), w, w, w, 1e-5, 1e-5)),
        "all_reduce_attn_res_add_rmsnorm out": lambda: _world_call(
            lambda c, p: attnres.all_reduce_attn_res_add_rmsnorm(c, p, lr, bank, w, w, w, 1e-5, 1e-5,
                                                                 out=(None, None, _huge()))),
        "moe_finalize_all_reduce": lambda: _world_call(
            lambda c, p: attnres.moe_finalize_all_reduce(c, rows, _huge((T, 1)), index, w, eps=1e-5)),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_dlpack_producer_with_overflowing_strides_is_refused(case):
    with pytest.raises(attnres.ArgumentError, match=OVERFLOW):
        _cases()[case]()


def test_screen_keeps_what_torch_accepts():
    """The screen refuses only what torch.from_dlpack would: a large stride whose storage size fits passes."""
    base = np.zeros(16, dtype=np.float32)
    ok = np.lib.stride_tricks.as_strided(base, shape=(2, 4), strides=(1 << 40, 4))
    assert attnres._tensors.as_tensor(ok, "t", "x").stride() == ((1 << 40) // 4, 1)


def _ref(shape, strides, dtype=_C.DType.bf16, data=1 << 20):
    return _C.TensorRef(data, dtype, _C.DeviceType.cpu, 0, list(shape), list(strides))


def test_library_refuses_wrapped_extents():
    """TensorRefs no torch tensor can express: the library's own checks, not the screen, refuse them."""
    a = _C.AttnResArgs()
    a.layer_residual = _ref((T, H), (H, 1), data=1 << 24)
    a.block_residual = _ref((K, T, H), (T * H, H, 1), data=2 << 24)
    a.res_weight, a.rms_weight, a.norm_weight = (_ref((H,), (1,), data=(3 + i) << 24) for i in range(3))
    a.output = _ref((T, H), (H, 1), data=6 << 24)
    a.output_fp8 = _ref((T, H), (H, 1), _C.DType.e4m3, data=7 << 24)
    a.fp8_scales = _ref((T, 1), (1 << 62, 1), _C.DType.f32, data=8 << 24)  # 4 * 2^62 bytes wraps to 0
    with pytest.raises(attnres.ArgumentError, match=r"^attn_res_rmsnorm: fp8_scales has an overlapping layout"):
        _C.attn_res_check(_C.AttnResOp.attn_res_rmsnorm, a, K, "per_token")
    args = _C.AllReduceArgs()
    args.comm = _C.CommRef()
    args.comm.world_size, args.comm.rank, args.comm.capacity, args.comm.width = 1, 0, T, H
    args.gathered = _ref((1, T, H), (T * H, 1 << 62, 1))
    with pytest.raises(attnres.ArgumentError, match="^all_reduce: gathered has a layout whose extent overflows 64-bit "
                                                    "address arithmetic"):
        _C.all_reduce_validate(args, require_output=False, read_data=False)
