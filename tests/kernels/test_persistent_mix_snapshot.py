"""The persistent kernel's attn_res instances (no trailing norm: the output is the mixture) and its snapshot row
write, on the GPU (cpp/src/cuda/attn_res_persistent.cuh; all CUDA-only, skipped elsewhere).

* attn_res without the fp32 diagnostics (with and without its addend, the prefix updated in place as the engines
  call it) and the normed ops with a snapshot write, under the persistent topology and its geometry knobs
  (blocks per SM, two passes, the smallest ring): every output, `updated` and the snapshot row bit for bit
  against split_k's call, every other byte of the inputs' storage unchanged, outputs poisoned with NaN before
  each call (out=), so a variant that leaves a byte unwritten fails;
* attn_res's persistent output against the float64 oracle on a sample of tokens;
* the automatic plan takes the persistent kernel for attn_res where it takes it for the normed op of the same
  addend, and the call runs it (the launch record);
* CUDA-graph replay and PDL give the eager bits, the snapshot row included.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import attnres
from attnres import _C, reference
from attnres import _persistent_tuning as tuning
from attnres.planning import device_info, plan_info
from conftest import requires_cuda
from helpers import assert_same_bits, assert_storage_unchanged
from test_persistent import check_rows, gpu_inputs, sample_tokens

pytestmark = [requires_cuda, pytest.mark.gpu]

NAN = float("nan")
SPLIT_K = attnres.Options(kernel="split_k")

# (T, N, H, layout, add): every vector bucket (H = 8 .. 16384), one and two passes, N = 1 .. 16.
CASES = [
    (1, 1, 7168, "token_major", False),
    (33, 2, 7168, "token_major", True),
    (300, 5, 7168, "token_major", False),  # vLLM's write site (token-major bank, the row after the candidates)
    (300, 9, 7168, "snapshot_major", True),
    (1024, 12, 7168, "token_major", True),
    (4096, 5, 7168, "token_major", False),
    (300, 16, 7168, "snapshot_major", True),  # two passes
    (33, 16, 16384, "token_major", False),  # two passes, 8 vectors per thread
    (300, 4, 16384, "snapshot_major", True),
    (1024, 11, 2056, "token_major", True),  # odd H: a partial warp
    (33, 13, 200, "snapshot_major", False),
    (1024, 10, 8, "snapshot_major", True),  # one 16-byte vector per row
    (300, 3, 4096, "token_major", False),
]

# The persistent topology under its geometry knobs (attnres._persistent_tuning; 0: the plan's choice).
VARIANTS = {v.name: v for v in (tuning.Variant("default"), tuning.Variant("one_block", blocks_per_sm=1),
                                tuning.Variant("two_blocks", blocks_per_sm=2),
                                tuning.Variant("two_pass", blocks_per_sm=1, passes=2),
                                tuning.Variant("ring2", blocks_per_sm=1, slots=2))}


def _case_id(c) -> str:
    T, N, H, layout, add = c
    return f"T{T}-N{N}-H{H}-{layout}-{'add' if add else 'noadd'}"


def _options(variant: str, pdl: bool = True):
    return VARIANTS[variant].options(pdl)


def _plan(op: str, T: int, N: int, H: int, add: bool, options, *, snapshot: bool = False):
    q = _C.PlanQuery()
    q.op = getattr(_C.AttnResOp, op)
    q.tokens, q.candidates, q.hidden, q.add, q.snapshot = T, N, H, add, snapshot
    return plan_info(_C.plan_query(q, device_info("cuda"), options.to_c()))


def _poisoned(inp, count: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.full((inp.T, inp.H), NAN, dtype=torch.bfloat16, device="cuda") for _ in range(count))


def _call(op: str, inp, add: bool, slot, options, *, in_place: bool = False):
    """The op's outputs (a tuple, `updated` first when the call has an addend), written into NaN-filled out=."""
    w = (inp.res_weight, inp.rms_weight)
    if op == "attn_res":
        if add:
            out = (inp.layer_residual if in_place else _poisoned(inp, 1)[0], _poisoned(inp, 1)[0])
            got = attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps, layer_residual_add=inp.add,
                                   diagnostics=False, snapshot_slot=slot, out=out, options=options)
            return tuple(got)
        got = attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps, diagnostics=False,
                               snapshot_slot=slot, out=_poisoned(inp, 1), options=options)
        return (got,)
    norm = (inp.norm_weight, inp.rms_eps, inp.norm_eps)
    if add:
        return tuple(attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w, *norm,
                                                  snapshot_slot=slot, out=_poisoned(inp, 2), options=options))
    return (attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, *norm, snapshot_slot=slot,
                                     out=_poisoned(inp, 1), options=options),)


def _normed(add: bool) -> str:
    return "attn_res_add_rmsnorm" if add else "attn_res_rmsnorm"


def _run_and_check(op, inp, add, slot, options, want, want_row, what):
    """Runs the call, checks its outputs and the snapshot row bitwise and that nothing else changed."""
    if slot is not None:
        inp.bank_row(slot).fill_(NAN)
    before = inp.storage_snapshot()
    got = _call(op, inp, add, slot, options)
    torch.cuda.synchronize()
    for name, g, e in zip(("updated", "output") if add else ("output",), got, want):
        assert_same_bits(g, e, f"{what}: {name} vs split_k")
    if slot is not None:
        assert_same_bits(inp.bank_row(slot), want_row, f"{what}: snapshot row vs split_k")
        assert_storage_unchanged(before, inp, except_bank_row=slot, expected_row=want_row)
    else:
        assert_storage_unchanged(before, inp)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_persistent_gives_split_k_bits_with_and_without_the_norm_and_the_snapshot(case):
    T, N, H, layout, add = case
    inp = gpu_inputs(T, N, H, layout=layout, add=add, seed=zlib.crc32(_case_id(case).encode()))
    slot = inp.spare_slot
    ran = set()
    for op in ("attn_res", _normed(add)):
        for snapshot in (None, slot):
            if snapshot is not None:
                inp.bank_row(snapshot).fill_(NAN)
            want = _call(op, inp, add, snapshot, SPLIT_K)
            want_row = inp.bank_row(snapshot).clone() if snapshot is not None else None
            if snapshot is not None:  # the snapshot row is P: the updated prefix, else layer_residual itself
                assert_same_bits(want_row, want[0] if add else inp.layer_residual, f"{op}: split_k's snapshot row")
            for variant in VARIANTS:
                opts = _options(variant)
                p = _plan(op, T, N, H, add, opts, snapshot=snapshot is not None)
                if not p.accepted:
                    assert p.decline_code in ("persistent_two_blocks_threads", "persistent_slots",
                                              "persistent_not_resident"), (variant, p)
                    continue
                assert p.kernel == "persistent", (variant, p)
                what = f"{_case_id(case)} {op} snapshot={snapshot is not None} {variant}"
                _run_and_check(op, inp, add, snapshot, opts, want, want_row, what)
                ran.add(variant)
    assert {"default", "one_block", "two_pass"} <= ran, ran


@pytest.mark.parametrize("case", [c for c in CASES if c[4]], ids=_case_id)
def test_in_place_prefix_update_as_the_engines_call_it(case):
    """attn_res with its addend and out=(layer_residual, None): the prefix updated in place (one pass, or two
    passes that mix from the `updated` row), the snapshot row written, the bits of split_k's separate call."""
    T, N, H, layout, add = case
    inp = gpu_inputs(T, N, H, layout=layout, add=True, seed=zlib.crc32(_case_id(case).encode()) + 1)
    slot = inp.spare_slot
    prefix0 = inp.layer_residual.clone()
    want = _call("attn_res", inp, True, slot, SPLIT_K)
    want_row = inp.bank_row(slot).clone()
    opts = _options("default")
    p = _plan("attn_res", T, N, H, True, opts, snapshot=True)
    assert p.kernel == "persistent", p
    inp.bank_row(slot).fill_(NAN)
    updated, mixture = _call("attn_res", inp, True, slot, opts, in_place=True)
    torch.cuda.synchronize()
    assert updated.data_ptr() == inp.layer_residual.data_ptr()
    assert_same_bits(inp.layer_residual, want[0], f"{_case_id(case)}: prefix updated in place")
    assert_same_bits(mixture, want[1], f"{_case_id(case)}: mixture")
    assert_same_bits(inp.bank_row(slot), want_row, f"{_case_id(case)}: snapshot row")
    inp.layer_residual.copy_(prefix0)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] >= 300], ids=_case_id)
def test_attn_res_output_against_the_oracle(case):
    T, N, H, layout, add = case
    inp = gpu_inputs(T, N, H, layout=layout, add=add, seed=zlib.crc32(_case_id(case).encode()) + 2)
    got = _call("attn_res", inp, add, None, _options("default"))
    tokens = sample_tokens(T, seed=T + N)
    idx = tokens.cuda()
    ref = reference.attn_res(inp.layer_residual[idx], inp.block_residual[:, idx], inp.res_weight, inp.rms_weight,
                             inp.rms_eps, layer_residual_add=inp.add[idx] if add else None)
    check_rows(got[-1][idx], ref.output, f"{_case_id(case)}: attn_res mixture vs oracle")
    if add:
        assert_same_bits(got[0].cpu(), reference.prefix_update(inp.layer_residual.cpu(), inp.add.cpu()),
                         f"{_case_id(case)}: updated vs torch prefix + add")


@pytest.mark.parametrize("add", [False, True], ids=["noadd", "add"])
def test_automatic_attn_res_runs_the_persistent_kernel_where_the_normed_op_does(add):
    T, N, H = 4096, 5, 7168
    inp = gpu_inputs(T, N, H, layout="token_major", add=add, seed=7 + add)
    normed = attnres.plan(_normed(add), tokens=T, candidates=N, hidden=H, device="cuda", add=add)
    mix = attnres.plan("attn_res", tokens=T, candidates=N, hidden=H, device="cuda", add=add)
    assert mix.kernel == normed.kernel, (mix, normed)
    _call("attn_res", inp, add, inp.spare_slot, None)
    torch.cuda.synchronize()
    launched = plan_info(_C._last_launch()[0])
    assert launched.kernel == mix.kernel, launched
    diag = attnres.plan("attn_res", tokens=T, candidates=N, hidden=H, device="cuda", add=add, diagnostics=True)
    assert diag.kernel != "persistent", diag


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_graph_replay_gives_the_eager_bits(pdl):
    """A captured chain of three persistent attn_res calls (no addend, with addend and snapshot, the normed op
    with snapshot) replays to the eager bits, outputs and snapshot rows poisoned before each replay."""
    T, N, H = 300, 5, 7168
    inp = gpu_inputs(T, N, H, layout="token_major", add=True, seed=11)
    slot = inp.spare_slot
    opts = _options("default", pdl)
    w = (inp.res_weight, inp.rms_weight)
    outs = _poisoned(inp, 4)

    def chain():
        attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps, diagnostics=False,
                         out=(outs[0],), options=opts)
        attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps, layer_residual_add=inp.add,
                         diagnostics=False, snapshot_slot=slot, out=(outs[1], outs[2]), options=opts)
        attnres.attn_res_rmsnorm(outs[1], inp.block_residual, *w, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                 out=(outs[3],), options=opts)

    chain()
    torch.cuda.synchronize()
    eager = [o.clone() for o in outs] + [inp.bank_row(slot).clone()]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain()  # warm-up on the capture stream
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        chain()
    for _ in range(3):
        for o in outs:
            o.fill_(NAN)
        inp.bank_row(slot).fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        for i, (o, e) in enumerate(zip(list(outs) + [inp.bank_row(slot)], eager)):
            assert_same_bits(o, e, f"replay output {i}")
