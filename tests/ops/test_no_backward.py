"""The ops are inference ops with no backward: a call whose inputs require grad must not hand back outputs that
silently carry no gradient. Calling with requires_grad inputs and then backward() raises an error whose
message names the op and says it has no backward (raised at the call or at backward(), either is fine); under
torch.no_grad / torch.inference_mode the same inputs work and give the bits of the plain call."""

from __future__ import annotations

import re

import pytest
import torch

import attnres

BF16 = torch.bfloat16
T, K, H, R, ROUTES = 2, 3, 64, 5, 2


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape, dtype=BF16: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return {
        "layer_residual": rnd(T, H), "layer_residual_add": rnd(T, H), "block_residual": rnd(K, T, H),
        "res_weight": rnd(H), "rms_weight": rnd(H).abs() + 0.5, "norm_weight": rnd(H).abs() + 0.5,
        "rows": rnd(R, H), "weights": torch.rand(T, ROUTES, generator=g), "shared": rnd(T, H),
        "index": torch.randint(0, R, (T, ROUTES), generator=g, dtype=torch.int32),
    }


def _attn_res(x):
    return attnres.attn_res(x["layer_residual"], x["block_residual"], x["res_weight"], x["rms_weight"], 1e-6)


def _attn_res_rmsnorm(x):
    return attnres.attn_res_rmsnorm(x["layer_residual"], x["block_residual"], x["res_weight"], x["rms_weight"],
                                    x["norm_weight"], 1e-6, 1e-6)


def _attn_res_add_rmsnorm(x):
    return attnres.attn_res_add_rmsnorm(x["layer_residual"], x["layer_residual_add"], x["block_residual"],
                                        x["res_weight"], x["rms_weight"], x["norm_weight"], 1e-6, 1e-6)


def _moe_finalize(x):
    return attnres.moe_finalize(x["rows"], x["weights"], x["index"], shared=x["shared"], norm_weight=x["norm_weight"],
                                eps=1e-6)


# op -> (call, the float inputs it reads)
OPS = {
    "attn_res": (_attn_res, ("layer_residual", "block_residual", "res_weight", "rms_weight")),
    "attn_res_rmsnorm": (_attn_res_rmsnorm, ("layer_residual", "block_residual", "res_weight", "rms_weight",
                                             "norm_weight")),
    "attn_res_add_rmsnorm": (_attn_res_add_rmsnorm, ("layer_residual", "layer_residual_add", "block_residual",
                                                     "res_weight", "rms_weight", "norm_weight")),
    "moe_finalize": (_moe_finalize, ("rows", "weights", "shared", "norm_weight")),
}
CASES = [(op, name) for op, (_, names) in OPS.items() for name in names]


def _tensors(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    return [t for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _with_grad(name: str) -> dict[str, torch.Tensor]:
    x = _inputs()
    x[name] = x[name].detach().requires_grad_(True)
    return x


@pytest.mark.parametrize("op, name", CASES, ids=[f"{op}-{name}" for op, name in CASES])
def test_backward_through_an_op_raises_naming_it(op, name):
    call, _ = OPS[op]
    x = _with_grad(name)
    with pytest.raises(Exception) as e:
        out = call(x)
        sum(t.float().sum() for t in _tensors(out)).backward()
    message = str(e.value)
    assert re.search(rf"\b{op}\b", message), message
    assert re.search(r"\bno backward\b", message, re.IGNORECASE), message
    assert x[name].grad is None


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("op, name", CASES, ids=[f"{op}-{name}" for op, name in CASES])
def test_requires_grad_inputs_work_without_autograd(op, name, mode):
    call, _ = OPS[op]
    plain = _tensors(call(_inputs()))
    with mode():
        out = _tensors(call(_with_grad(name)))
    assert len(out) == len(plain)
    for got, want in zip(out, plain):
        assert not got.requires_grad
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.dtype == BF16 else got,
                                                       want.view(torch.uint8) if want.dtype == BF16 else want)
