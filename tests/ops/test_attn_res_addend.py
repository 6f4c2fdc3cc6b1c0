"""attn_res with an addend (no trailing norm) and the in-place prefix update, through attnres._C directly.

* attn_res with layer_residual_add (+ layer_residual_add2) returns bitwise the `mixture` tap of
  attn_res_add_rmsnorm on the same inputs, and writes the same `updated` and snapshot row;
* `updated` = layer_residual itself (the in-place update) gives bitwise the out-of-place results, on the CPU
  backend and on every forced CUDA kernel (single_cta, its streaming form, split_k, the persistent kernel).
"""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _C
from attnres._tensors import ref, ref_leading_rows, stream_of

from conftest import CUDA_SKIP_REASON

BF16 = torch.bfloat16
OPS = {"attn_res": _C.AttnResOp.attn_res, "attn_res_add_rmsnorm": _C.AttnResOp.attn_res_add_rmsnorm,
       "attn_res_add_rmsnorm_persistent": _C.AttnResOp.attn_res_add_rmsnorm_persistent}


def inputs(T, N, H, device, seed, slot=None):
    g = torch.Generator().manual_seed(seed)
    rows = lambda *s: torch.randn(*s, generator=g).to(BF16).to(device)  # noqa: E731
    bank = rows(max(N, slot + 1 if slot is not None else 0), T, H)
    return dict(layer_residual=rows(T, H), layer_residual_add=rows(T, H), layer_residual_add2=rows(T, H),
                bank=bank, res_weight=(0.02 * torch.randn(H, generator=g)).to(BF16).to(device),
                rms_weight=(1 + 0.1 * torch.randn(H, generator=g)).to(BF16).to(device),
                norm_weight=(1 + 0.1 * torch.randn(H, generator=g)).to(BF16).to(device))


def run(op, inp, N, *, add2=False, tap=False, diagnostics=False, in_place=False, slot=-1, options=None):
    """Runs `op` on copies of `inp`; returns every tensor the call could have written."""
    t = {k: v.clone() for k, v in inp.items()}
    T, H = t["layer_residual"].shape
    dev = t["layer_residual"].device
    nan = lambda *s, dtype=BF16: torch.full(s, float("nan"), dtype=dtype, device=dev)  # noqa: E731
    out = dict(output=nan(T, H), updated=t["layer_residual"] if in_place else nan(T, H), mixture=nan(T, H),
               rsigma=nan(N, T, dtype=torch.float32), probs=nan(N, T, dtype=torch.float32),
               logits=nan(N, T, dtype=torch.float32))
    a = _C.AttnResArgs()
    a.layer_residual = ref(t["layer_residual"], op, "layer_residual")
    a.layer_residual_add = ref(t["layer_residual_add"], op, "layer_residual_add")
    if add2:
        a.layer_residual_add2 = ref(t["layer_residual_add2"], op, "layer_residual_add2")
    a.block_residual = ref_leading_rows(t["bank"], N - 1, op, "block_residual")
    a.res_weight = ref(t["res_weight"], op, "res_weight")
    a.rms_weight = ref(t["rms_weight"], op, "rms_weight")
    if op != "attn_res":
        a.norm_weight = ref(t["norm_weight"], op, "norm_weight")
    a.output = ref(out["output"], op, "output")
    a.updated = ref(out["updated"], op, "updated")
    if tap:
        a.mixture = ref(out["mixture"], op, "mixture")
    if diagnostics:
        a.rsigma, a.probs, a.logits = (ref(out[k], op, k) for k in ("rsigma", "probs", "logits"))
    a.snapshot_slot = slot
    a.stream = stream_of(t["layer_residual"])
    _C.run(OPS[op], a, options if options is not None else _C.Options())
    if dev.type == "cuda":
        torch.cuda.synchronize()
    out["layer_residual"] = t["layer_residual"]
    out["snapshot"] = t["bank"][slot] if slot >= 0 else None
    return out


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.int16 if a.dtype == BF16 else torch.int32),
                       b.contiguous().view(torch.int16 if b.dtype == BF16 else torch.int32))


def check_tap(inp, N, add2, slot, options=None):
    mixed = run("attn_res", inp, N, add2=add2, diagnostics=True, slot=slot, options=options)
    normed = run("attn_res_add_rmsnorm", inp, N, add2=add2, tap=True, slot=slot, options=options)
    assert same_bits(mixed["output"], normed["mixture"])
    assert same_bits(mixed["updated"], normed["updated"])
    assert same_bits(mixed["snapshot"], normed["updated"])
    assert torch.isfinite(mixed["probs"]).all()
    bare = run("attn_res", inp, N, add2=add2, slot=slot, options=options)  # no diagnostics: none written
    assert same_bits(bare["output"], mixed["output"]) and bare["probs"].isnan().all()


def check_in_place(op, inp, N, add2, slot, options=None, tap=False, diagnostics=False):
    kw = dict(add2=add2, slot=slot, options=options, tap=tap, diagnostics=diagnostics)
    out = run(op, inp, N, **kw)
    inp_ = run(op, inp, N, in_place=True, **kw)
    assert same_bits(inp_["layer_residual"], out["updated"])
    assert same_bits(out["layer_residual"], inp["layer_residual"])  # out of place: the prefix is untouched
    for k in ("output",) + (("mixture",) if tap else ()) + (("rsigma", "probs", "logits") if diagnostics else ()):
        assert same_bits(inp_[k], out[k]), k
    if slot >= 0:
        assert same_bits(inp_["snapshot"], out["updated"])


@pytest.mark.parametrize("N", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("add2", [False, True])
def test_cpu_mixture_is_the_add_rmsnorm_tap(N, add2):
    check_tap(inputs(3, N, 64, "cpu", N * 2 + add2, slot=N), N, add2, N)


@pytest.mark.parametrize("N", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("op,add2", [("attn_res", False), ("attn_res", True), ("attn_res_add_rmsnorm", True),
                                     ("attn_res_add_rmsnorm_persistent", False)])
def test_cpu_in_place_equals_out_of_place(op, add2, N):
    slot = -1 if op == "attn_res_add_rmsnorm_persistent" else N
    check_in_place(op, inputs(4, N, 64, "cpu", N, slot=N), N, add2, slot, tap=op == "attn_res_add_rmsnorm",
                   diagnostics=op == "attn_res")


def test_cpu_attn_res_add_refusals():
    inp = inputs(2, 3, 64, "cpu", 0)
    with pytest.raises(attnres.ArgumentError, match="^attn_res: layer_residual_add2 requires layer_residual_add$"):
        a = _C.AttnResArgs()
        a.layer_residual = ref(inp["layer_residual"], "attn_res", "layer_residual")
        a.layer_residual_add2 = ref(inp["layer_residual_add2"], "attn_res", "layer_residual_add2")
        _C.validate(_C.AttnResOp.attn_res, a)


# ---------------------------------------------------------------------------------------------------- CUDA
def _forced(kernel, **extra):
    o = _C.Options()
    o.kernel = getattr(_C.KernelKind, kernel)
    for k, v in extra.items():
        setattr(o, k, v)
    return o


# (name, options, T, H, the N the kernel is planned for)
GPU_KERNELS = [
    ("single_cta", lambda: _forced("single_cta"), 3, 2048, [1, 2, 4]),
    ("single_cta_streaming", lambda: _forced("single_cta", _stream_min_tokens=1), 300, 7168, [1, 2, 4]),
    ("split_k", lambda: _forced("split_k"), 5, 7168, [1, 2, 5, 9, 16]),
    ("split_k_one_block", lambda: _forced("split_k"), 5, 1024, [1, 2, 5, 9, 16]),
]


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")
@pytest.mark.parametrize("name,options,T,H,Ns", GPU_KERNELS, ids=[k[0] for k in GPU_KERNELS])
def test_cuda_per_token_kernels(name, options, T, H, Ns):
    for N in Ns:
        inp = inputs(T, N, H, "cuda", N, slot=N)
        for add2 in (False, True):
            check_tap(inp, N, add2, N, options())
            check_in_place("attn_res", inp, N, add2, N, options(), diagnostics=True)
            check_in_place("attn_res_add_rmsnorm", inp, N, add2, N, options(), tap=True)


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")
@pytest.mark.parametrize("N", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("passes", [1, 2])
def test_cuda_persistent_in_place(N, passes):
    """In place on either pass mode (two passes mix from the `updated` row, never the overwritten prefix)."""
    inp = inputs(40, N, 2048, "cuda", N, slot=N)
    opts = _forced("persistent", _persistent_passes=passes)
    for op in ("attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent"):
        check_in_place(op, inp, N, False, -1, opts)
    check_in_place("attn_res_add_rmsnorm", inp, N, True, -1, opts)  # two addends
    check_in_place("attn_res", inp, N, False, N, opts)  # the engines' call: the snapshot row written too
