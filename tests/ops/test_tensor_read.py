"""How the call path reads a torch tensor (python/src/bind_call.cpp): through torch's DLPack exchange table where
torch publishes one, else through the tensor's Python attributes. Both reads must describe every view the same
way (pointer, dtype, device, shape, strides, the [T, 1, H] rows squeeze), and a tensor the exchange table cannot
describe (another layout, nested, quantized, meta: torch's table refuses them) must be refused with the library's
error, by the reader and by every public op."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnres
from attnres import _C
from conftest import HAS_CUDA

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def _fields(r) -> tuple:
    return (r.present, r.data, r.dtype, r.device_type, r.device_index, r.shape, r.strides)


def _both(t, rows: bool) -> tuple:
    return _fields(_C._read_tensor(t, rows, True)), _fields(_C._read_tensor(t, rows, False))


def test_torch_publishes_the_exchange_table_from_2_10():
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 10):
        assert _C._has_dlpack_exchange(), "torch >= 2.10 publishes __dlpack_c_exchange_api__"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32, torch.float16,
                                   torch.bool])
@pytest.mark.parametrize("rows", [False, True])
def test_views_read_the_same_both_ways(device, dtype, rows):
    base = torch.zeros(6, 4, 16, device=device).to(dtype)
    views = [base, base[1:], base[:, 1:2], base[:, :1, 3:], base[2:3], base.transpose(0, 2), base[::2, ::3],
             base[:, 0], base[0, 0], base[0, 0, 5], base[:0], base.expand(2, 6, 4, 16)[1],
             torch.zeros(16, device=device).to(dtype).expand(5, 1, 16), base.reshape(24, 16)[7:8]]
    for v in views:
        fast, attr = _both(v, rows)
        assert fast == attr, (tuple(v.shape), v.stride())
        if v.numel():
            assert fast[1] == v.data_ptr()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_random_slices_read_the_same_both_ways(shape, data):
    base = torch.zeros(*shape, 8, dtype=torch.bfloat16)
    index = tuple(slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.integers(1, 2))) for n in shape)
    v = base[index]
    if data.draw(st.booleans()) and v.dim() > 1:
        v = v.transpose(0, -1)
    for rows in (False, True):
        fast, attr = _both(v, rows)
        assert fast == attr


def _exotic():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # beta/prototype layouts warn on construction
        x = torch.randn(4, 64)
        out = {"sparse_coo": (x.to_sparse(), "must be a dense strided tensor, got layout torch.sparse_coo"),
               "sparse_csr": (x.to_sparse_csr(), "must be a dense strided tensor, got layout torch.sparse_csr"),
               "nested": (torch.nested.nested_tensor([torch.randn(2, 64), torch.randn(3, 64)]),
                          "must be a dense strided tensor, got a nested tensor"),
               "meta": (x.to("meta"), "is on meta: only cpu and cuda tensors are supported")}
        if torch.backends.mkldnn.is_available():
            out["mkldnn"] = (x.to_mkldnn(), "must be a dense strided tensor, got layout torch._mkldnn")
    return out


EXOTIC = _exotic()


@pytest.mark.parametrize("kind", sorted(EXOTIC))
@pytest.mark.parametrize("exchange", [True, False])
def test_exotic_tensors_are_refused_by_the_reader(kind, exchange):
    t, message = EXOTIC[kind]
    with pytest.raises(attnres.ArgumentError, match="^attnres._read_tensor: tensor " + message.replace(".", r"\.")):
        _C._read_tensor(t, False, exchange)


def test_a_quantized_tensor_is_read_through_its_attributes_and_refused_by_dtype():
    q = torch.quantize_per_tensor(torch.randn(2, 64), 0.1, 0, torch.qint8)
    r = _C._read_tensor(q, False, True)  # the table refuses it; the attribute read names its dtype
    assert r.dtype == _C.DType.other and r.shape == [2, 64]
    bank = torch.randn(1, 2, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(attnres.ArgumentError, match="^attn_res_rmsnorm: layer_residual"):
        attnres.attn_res_rmsnorm(q, bank, w, w, w, 1e-5, 1e-5)


@pytest.mark.parametrize("kind", sorted(k for k in EXOTIC if k != "meta"))
@pytest.mark.parametrize("where", ["layer_residual", "block_residual", "norm_weight", "out"])
def test_every_public_op_refuses_exotic_tensors_and_writes_nothing(kind, where):
    t, message = EXOTIC[kind]
    T, H = 4, 64
    g = torch.Generator().manual_seed(0)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    lr, add, bank, w = bf(T, H), bf(T, H), bf(2, T, H), [bf(H) for _ in range(3)]
    out = (torch.full((T, H), 7.0, dtype=torch.bfloat16), torch.full((T, H), 7.0, dtype=torch.bfloat16))
    kept = [x.clone() for x in (lr, add, bank, *out)]
    args = {"layer_residual": lr, "block_residual": bank, "norm_weight": w[2]}
    if where != "out":
        args[where] = t
    given_out = (out[0], t) if where == "out" else out
    name = "output" if where == "out" else where
    with pytest.raises(attnres.ArgumentError, match=f"^attn_res_add_rmsnorm: {name} " + message.replace(".", r"\.")):
        attnres.attn_res_add_rmsnorm(args["layer_residual"], add, args["block_residual"], w[0], w[1],
                                     args["norm_weight"], 1e-5, 1e-5, out=given_out)
    for before, after in zip(kept, (lr, add, bank, *out)):
        assert torch.equal(before.view(torch.int16), after.view(torch.int16))
