"""torch.ops.attnres.*: registration, fake (meta) implementations, torch.library.opcheck, and
torch.compile(fullgraph=True) equal to eager bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnres
from helpers import BF16, ROOT, assert_same_bits, make_inputs

OP_NAMES = ("attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm", "attn_res_snapshot", "attn_res_rmsnorm_snapshot",
            "attn_res_add_rmsnorm_snapshot")
OPTION_ARGS = ("topology", "split_max_tokens", "pdl", "force_kernel", "cluster")
OUTPUTS = {"attn_res": ("updated", "output", "rsigma", "probs", "logits"),
           "attn_res_rmsnorm": ("output", "mixture", "output_fp8", "fp8_scales"),
           "attn_res_add_rmsnorm": ("updated", "output", "mixture", "output_fp8", "fp8_scales")}
# Features after the options (so positional calls of the schema without them stay valid).
LATER = {"attn_res": (), "attn_res_rmsnorm": ("fp8_only",), "attn_res_add_rmsnorm": ("fp8_only",)}
# The persistent kernel is an option of the family op (the persistent ops are gone).
PERSISTENT = {"topology": "persistent"}


def test_ops_are_registered_with_their_schemas():
    for name in OP_NAMES:
        family = name.removesuffix("_snapshot")
        snapshot = name.endswith("_snapshot")
        op = getattr(torch.ops.attnres, name)
        schema = op.default._schema
        args = [a.name for a in schema.arguments]
        assert args[0] == "layer_residual", (name, args)
        later = LATER[family]
        assert tuple(args[len(args) - len(later) - 5:len(args) - len(later)]) == OPTION_ARGS, (name, args)
        assert tuple(args[len(args) - len(later):]) == later, (name, args)
        assert [r.name for r in schema.returns] == list(OUTPUTS[family]), (name, schema)
        mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated == (["bank"] if snapshot else []), (name, mutated)
        # .out: the same arguments, then every output as a keyword-only mutable Tensor?; returns nothing
        out = op.out._schema
        out_args = [a.name for a in out.arguments]
        assert out_args[:len(args)] == args and tuple(out_args[len(args):]) == OUTPUTS[family], (name, out_args)
        assert all(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
                   for a in out.arguments[len(args):]), (name, out)
        assert not out.returns, (name, out)


def _op_calls(inp):
    """(name, args) for every custom op and its output variants, on the case's tensors."""
    lr, add, add2, bank = inp.layer_residual, inp.add, inp.add2, inp.block_residual
    w3 = (inp.res_weight, inp.rms_weight, inp.norm_weight)
    eps = (inp.rms_eps, inp.norm_eps)
    full_bank = inp.bank_buffer if inp.layout == "snapshot_major" else None
    calls = [
        ("attn_res", (lr, bank, inp.res_weight, inp.rms_weight, inp.rms_eps), {}),
        ("attn_res", (lr, bank, inp.res_weight, inp.rms_weight, inp.rms_eps), {"diagnostics": False}),
        ("attn_res_rmsnorm", (lr, bank, *w3, *eps, False), {}),
        ("attn_res_rmsnorm", (lr, bank, *w3, *eps, True), {}),
        ("attn_res_rmsnorm", (lr, bank, *w3, *eps, True), {"fp8": "per_token"}),
        ("attn_res_add_rmsnorm", (lr, add, None, bank, *w3, *eps, False), {}),
        ("attn_res_add_rmsnorm", (lr, add, add2, bank, *w3, *eps, True), {}),
        ("attn_res_add_rmsnorm", (lr, add, add2, bank, *w3, *eps, False),
         {"fp8": "per_token", "fp8_pow2_scales": True}),
        ("attn_res_add_rmsnorm", (lr, add, None, bank, *w3, *eps, True), {"fp8": "per_token", "fp8_only": True}),
        ("attn_res_rmsnorm", (lr, bank, *w3, *eps, False), {"fp8": "per_token", "fp8_only": True}),
        # the former persistent ops: the family ops with topology="persistent"
        ("attn_res_add_rmsnorm", (lr, add, None, bank, *w3, *eps), PERSISTENT),
        ("attn_res_rmsnorm", (lr, bank, *w3, *eps), PERSISTENT),
    ]
    if full_bank is not None:
        calls.append(("attn_res_add_rmsnorm_snapshot", (lr, add, add2, full_bank, inp.K, inp.K, *w3, *eps, True), {}))
        calls.append(("attn_res_rmsnorm_snapshot", (lr, full_bank, inp.K, inp.K, *w3, *eps, False), {}))
        calls.append(("attn_res_snapshot", (lr, full_bank, inp.K, inp.K, inp.res_weight, inp.rms_weight,
                                            inp.rms_eps), {}))
    return calls


def _runs_here(name, args, kwargs, device) -> bool:
    """The persistent kernel may be declined on CUDA by this build (test_plan covers the reason)."""
    if kwargs.get("topology") != "persistent":
        return True
    lr = args[0]
    add = args[1] if name == "attn_res_add_rmsnorm" else None
    bank = args[3] if name == "attn_res_add_rmsnorm" else args[1]
    return attnres.plan("attn_res_add_rmsnorm_persistent", tokens=lr.shape[0], candidates=bank.shape[0] + 1,
                        hidden=lr.shape[-1], device=device, add=add is not None,
                        options=attnres.Options(topology="persistent")).accepted


def test_fake_implementations_match_the_real_outputs(device):
    inp = make_inputs(3, 4, 64, layout="snapshot_major", addends=2, seed=1, device=device)
    for name, args, kwargs in _op_calls(inp):
        if not _runs_here(name, args, kwargs, device):
            continue
        op = getattr(torch.ops.attnres, name)
        real = op(*args, **kwargs)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            fake = op(*fake_args, **kwargs)
        assert len(fake) == len(real), name
        for i, (f, r) in enumerate(zip(fake, real)):
            assert (tuple(f.shape), f.dtype, f.device) == (tuple(r.shape), r.dtype, r.device), (name, i, f, r)


def test_fake_shapes_under_meta_tensors():
    """All-meta inputs (shape inference without data) give the documented output shapes."""
    inp = make_inputs(5, 3, 200, addends=2, seed=2, device="meta")
    T, N, H = 5, 3, 200
    upd, mixture, *diag = torch.ops.attnres.attn_res(inp.layer_residual, inp.block_residual, inp.res_weight,
                                                     inp.rms_weight, 1e-5)
    assert upd.shape == (0,)
    assert mixture.shape == (T, H) and mixture.dtype == BF16 and mixture.device.type == "meta"
    assert all(d.shape == (N, T) and d.dtype == torch.float32 for d in diag)
    out, tap, q, s = torch.ops.attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, inp.res_weight,
                                                        inp.rms_weight, inp.norm_weight, 1e-5, 1e-5, False)
    assert out.shape == (T, H) and tap.shape == (0,) and q.shape == (0,) and s.shape == (0,)
    out, tap, q, s = torch.ops.attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, inp.res_weight,
                                                        inp.rms_weight, inp.norm_weight, 1e-5, 1e-5, True,
                                                        fp8="per_token")
    assert out.shape == (T, H) and tap.shape == (T, H) and q.shape == (T, H) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (T, 1) and s.dtype == torch.float32
    # the former persistent op without an addend: attn_res_rmsnorm on the persistent topology
    out, tap, q, s = torch.ops.attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, inp.res_weight,
                                                        inp.rms_weight, inp.norm_weight, 1e-5, 1e-5, **PERSISTENT)
    assert tap.shape == (0,) and out.shape == (T, H)
    upd, out, tap, q, s = torch.ops.attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, None,
                                                                 inp.block_residual, inp.res_weight, inp.rms_weight,
                                                                 inp.norm_weight, 1e-5, 1e-5, **PERSISTENT)
    assert upd.shape == (T, H) and out.shape == (T, H) and tap.shape == (0,) and q.shape == (0,)


def test_opcheck(device):
    inp = make_inputs(3, 4, 64, layout="snapshot_major", addends=2, seed=3, device=device)
    for name, args, kwargs in _op_calls(inp):
        if not _runs_here(name, args, kwargs, device):
            continue
        torch.library.opcheck(getattr(torch.ops.attnres, name).default, args, kwargs)


def _every_public_op(lr, add, add2, bank, res_w, rms_w, norm_w):
    eps = (1e-5, 1e-6)
    mixture, rsigma, probs, logits = attnres.attn_res(lr, bank, res_w, rms_w, eps[0])
    out1 = attnres.attn_res_rmsnorm(lr, bank, res_w, rms_w, norm_w, *eps)
    out2, tap2 = attnres.attn_res_rmsnorm(lr, bank, res_w, rms_w, norm_w, *eps, return_mixture=True)
    upd3, out3, tap3 = attnres.attn_res_add_rmsnorm(lr, add, bank, res_w, rms_w, norm_w, *eps,
                                                    layer_residual_add2=add2, return_mixture=True)
    upd4, out4 = attnres.attn_res_add_rmsnorm(lr, add, bank, res_w, rms_w, norm_w, *eps)
    # surrounding PyTorch ops, so the compiled graph is more than the custom ops alone
    following = torch.nn.functional.silu(out3.float()).to(BF16)
    return [mixture, rsigma, probs, logits, out1, out2, tap2, upd3, out3, tap3, upd4, out4, following]


def _persistent(lr, add, bank, res_w, rms_w, norm_w):
    return list(attnres.attn_res_add_rmsnorm_persistent(lr, bank, res_w, rms_w, norm_w, 1e-5, 1e-6,
                                                        layer_residual_add=add))


@pytest.mark.parametrize("three_d", [False, True], ids=["2d", "3d"])
def test_compile_fullgraph_equals_eager(three_d, device):
    torch._dynamo.reset()
    inp = make_inputs(4, 5, 256, layout="token_major", addends=2, seed=4, device=device)
    lr, add, add2 = inp.layer_residual, inp.add, inp.add2
    if three_d:
        lr, add, add2 = lr.unsqueeze(1), add.unsqueeze(1), add2.unsqueeze(1)
    args = (lr, add, add2, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight)
    eager = _every_public_op(*args)
    compiled = torch.compile(_every_public_op, fullgraph=True)(*args)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert_same_bits(c, e, f"compiled output #{i}")
    pargs = (lr, add, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight)
    if _runs_here("attn_res_add_rmsnorm", (inp.layer_residual, add, None, inp.block_residual), PERSISTENT, device):
        for i, (c, e) in enumerate(zip(torch.compile(_persistent, fullgraph=True)(*pargs), _persistent(*pargs))):
            assert_same_bits(c, e, f"compiled persistent output #{i}")


def test_compile_snapshot_op_writes_the_bank(device):
    """The snapshot custom op declares its bank mutation, so the compiled graph keeps the write."""
    torch._dynamo.reset()
    inp = make_inputs(3, 4, 128, layout="snapshot_major", addends=2, seed=5, device=device)

    def step(lr, add, add2, bank, res_w, rms_w, norm_w):
        upd, out, *_ = torch.ops.attnres.attn_res_add_rmsnorm_snapshot(lr, add, add2, bank, 3, 3, res_w, rms_w, norm_w,
                                                                       1e-5, 1e-5, False)
        return upd, out

    eager_bank = inp.bank_buffer.clone()
    compiled_bank = inp.bank_buffer.clone()
    rest = (inp.res_weight, inp.rms_weight, inp.norm_weight)
    upd_e, out_e = step(inp.layer_residual, inp.add, inp.add2, eager_bank, *rest)
    upd_c, out_c = torch.compile(step, fullgraph=True)(inp.layer_residual, inp.add, inp.add2, compiled_bank, *rest)
    assert_same_bits(upd_c, upd_e, "compiled updated")
    assert_same_bits(out_c, out_e, "compiled output")
    assert_same_bits(compiled_bank, eager_bank, "bank after the compiled snapshot write")
    assert_same_bits(compiled_bank[3], upd_e, "snapshot row")


def test_compile_fullgraph_public_snapshot_call(device):
    """attnres.attn_res_add_rmsnorm(..., snapshot_slot=...) traced whole: the public wrapper must not break the
    graph (it inspects block_residual's storage in Python before dispatching)."""
    torch._dynamo.reset()
    inp = make_inputs(3, 4, 128, layout="snapshot_major", addends=1, seed=6, device=device)

    def step(lr, add, bank, res_w, rms_w, norm_w):
        return attnres.attn_res_add_rmsnorm(lr, add, bank[:3], res_w, rms_w, norm_w, 1e-5, 1e-5, snapshot_slot=3)

    rest = (inp.res_weight, inp.rms_weight, inp.norm_weight)
    eager_bank, compiled_bank = inp.bank_buffer.clone(), inp.bank_buffer.clone()
    eager = step(inp.layer_residual, inp.add, eager_bank, *rest)
    compiled = torch.compile(step, fullgraph=True)(inp.layer_residual, inp.add, compiled_bank, *rest)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert_same_bits(c, e, f"compiled output #{i}")
    assert_same_bits(compiled_bank, eager_bank, "bank after the compiled snapshot write")


def test_compiled_snapshot_call_outside_the_storage_is_refused(device):
    """The storage check also runs inside the snapshot op, so a compiled call cannot write past the bank."""
    torch._dynamo.reset()
    inp = make_inputs(3, 4, 128, layout="snapshot_major", addends=1, seed=7, device=device, spare_rows=1)

    def step(lr, add, bank, res_w, rms_w, norm_w):
        return attnres.attn_res_add_rmsnorm(lr, add, bank[:3], res_w, rms_w, norm_w, 1e-5, 1e-5, snapshot_slot=5)

    bank = inp.bank_buffer.clone()
    # Refused while tracing (the fake implementation checks the bank's rows; the compiler wraps the error) or,
    # where the traced view passes, by the real op's storage check.
    with pytest.raises(Exception) as e:
        torch.compile(step, fullgraph=True)(inp.layer_residual, inp.add, bank, inp.res_weight, inp.rms_weight,
                                            inp.norm_weight)
    assert "ArgumentError" in repr(e.value) or isinstance(e.value, attnres.ArgumentError), repr(e.value)
    assert "attn_res_add_rmsnorm: snapshot_slot 5 lies outside" in str(e.value)
    assert_same_bits(bank, inp.bank_buffer, "bank after the refused compiled call")


def test_op_pages_show_the_registered_schemas():
    """Each family's page (docs/ops/<family>.md) shows every overload's schema exactly as registered."""
    for name in OP_NAMES:
        family = name.removesuffix("_snapshot")
        page = (ROOT / "docs" / "ops" / f"{family}.md").read_text()
        op = getattr(torch.ops.attnres, name)
        for overload in (op.default, op.out):
            assert str(overload._schema) in page, (family, str(overload._schema))
