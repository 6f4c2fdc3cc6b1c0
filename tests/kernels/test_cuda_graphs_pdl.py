"""CUDA graphs, programmatic dependent launch and streams (all CUDA-only).

* a captured call replays to the eager bits, with its outputs poisoned (NaN) before every replay and fresh
  inputs copied into the captured buffers (so the replay cannot pass on stale values);
* PDL on and off give identical bits;
* a chain of PDL-launched calls, each consuming the previous call's `updated` as its prefix, equals the same
  calls run one at a time on settled inputs (eagerly and inside a graph); so does a chain in which each call's
  newest bank row is the snapshot row the previous call wrote;
* every launch goes on the caller's stream (a busy non-default stream orders the call after its own work);
* capturing a call does not raise (no synchronisation, allocation outside the graph pool or host copy).
"""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres.graphs import capture
from conftest import requires_cuda
from helpers import assert_same_bits, kernel_options, make_inputs

pytestmark = [requires_cuda, pytest.mark.gpu]

SHAPES = [(1, 5, 7168), (8, 3, 2304), (32, 9, 7168), (3, 16, 4096)]
NAN = float("nan")


# Each variant: the plan flags of the call, and a function (inputs, options) -> the tensors it produced,
# including the bank row a snapshot call writes.
def _attn_res(inp, opts):
    return list(attnres.attn_res(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight,
                                 inp.rms_eps, options=opts))


def _rmsnorm_tap(inp, opts):
    return list(attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight,
                                         inp.norm_weight, inp.rms_eps, inp.norm_eps, return_mixture=True,
                                         options=opts))


def _add_one(inp, opts):
    return list(attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, inp.res_weight,
                                             inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                             options=opts))


def _add2_tap_snapshot(inp, opts):
    out = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, inp.res_weight,
                                       inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                       layer_residual_add2=inp.add2, return_mixture=True,
                                       snapshot_slot=inp.spare_slot, options=opts)
    return list(out) + [inp.bank_row(inp.spare_slot)]


def _persistent(inp, opts):
    return list(attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual, inp.block_residual, inp.res_weight,
                                                        inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                                        layer_residual_add=inp.add, options=opts))


VARIANTS = {
    "attn_res": ("attn_res", {"diagnostics": True}, _attn_res),
    "rmsnorm_tap": ("attn_res_rmsnorm", {"tap": True}, _rmsnorm_tap),
    "add": ("attn_res_add_rmsnorm", {"add": True}, _add_one),
    "add2_tap_snapshot": ("attn_res_add_rmsnorm", {"add": True, "add2": True, "tap": True, "snapshot": True},
                          _add2_tap_snapshot),
    "persistent": ("attn_res_add_rmsnorm_persistent", {"add": True}, _persistent),
}


def _runs(variant, T, N, H, pdl=True):
    """(kernel name, Options) for every kernel that runs the variant on this GPU. Where this build declines
    the variant (the persistent kernel), checks that a call raises the plan's reason and returns []."""
    op, flags, fn = VARIANTS[variant]
    if op == "attn_res_add_rmsnorm_persistent":
        opts = attnres.Options(topology="persistent", pdl=pdl)
        p = attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cuda", options=opts, **flags)
        if p.accepted:
            return [(p.kernel, opts)]
        inp = make_inputs(T, N, H, addends=1, seed=1, device="cuda")
        with pytest.raises(attnres.UnsupportedError, match=f"^{op}: "):
            fn(inp, opts)
        return []
    out = []
    for kernel, opts in kernel_options("cuda", op, T, N, H, **flags):
        out.append((kernel, attnres.Options(kernel=opts.kernel, pdl=pdl)))
    return out


def _refill(inp, seed):
    """Fresh values in every input buffer (same shapes and layout), in place."""
    fresh = make_inputs(inp.T, inp.N, inp.H, layout=inp.layout, addends=2, seed=seed, device="cuda", spare_rows=2)
    for name, buf in inp.buffers.items():
        buf.copy_(fresh.buffers[name])


def _poison(tensors):
    for t in tensors:
        t.fill_(NAN)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,N,H", SHAPES)
def test_graph_replay_equals_eager(variant, T, N, H):
    runs = _runs(variant, T, N, H)
    for kernel, opts in runs:
        inp = make_inputs(T, N, H, layout="token_major", addends=2, seed=T * N, device="cuda", spare_rows=2)
        fn = VARIANTS[variant][2]
        graph, captured = capture(lambda: fn(inp, opts))
        for seed in (101, 202):
            _refill(inp, seed)
            _poison(captured)
            graph.replay()
            torch.cuda.synchronize()
            replayed = [t.clone() for t in captured]
            eager = fn(inp, opts)
            torch.cuda.synchronize()
            for i, (r, e) in enumerate(zip(replayed, eager)):
                assert_same_bits(r, e, f"{variant} kernel={kernel} output #{i}: graph replay vs eager")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,N,H", SHAPES)
def test_pdl_on_and_off_give_identical_bits(variant, T, N, H):
    on, off = _runs(variant, T, N, H, pdl=True), _runs(variant, T, N, H, pdl=False)
    fn = VARIANTS[variant][2]
    inp = make_inputs(T, N, H, layout="snapshot_major", addends=2, seed=T + N, device="cuda", spare_rows=2)
    for (kernel, o_on), (_, o_off) in zip(on, off):
        a = [t.clone() for t in fn(inp, o_on)]
        b = [t.clone() for t in fn(inp, o_off)]
        torch.cuda.synchronize()
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_bits(x, y, f"{variant} kernel={kernel} output #{i}: PDL on vs off")


def _chain(inp, addends, opts, links: int, settle: bool):
    """links calls, each taking the previous call's updated as its prefix (and, every other link, an
    attn_res_rmsnorm on that prefix in between). settle: synchronise and copy between calls."""
    prefix = inp.layer_residual
    outs = []
    for i in range(links):
        add = addends[i][0]
        add2 = addends[i][1]
        updated, output = attnres.attn_res_add_rmsnorm(prefix, add, inp.block_residual, inp.res_weight,
                                                       inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                                       layer_residual_add2=add2, options=opts)
        outs += [updated, output]
        if i % 2:
            outs.append(attnres.attn_res_rmsnorm(updated, inp.block_residual, inp.res_weight, inp.rms_weight,
                                                 inp.norm_weight, inp.rms_eps, inp.norm_eps, options=opts))
        prefix = updated
        if settle:
            torch.cuda.synchronize()
            prefix = updated.clone()
            torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("T,N,H", SHAPES)
def test_pdl_chained_calls_equal_settled_calls(T, N, H):
    links = 24
    inp = make_inputs(T, N, H, layout="token_major", addends=2, seed=7 * T + N, device="cuda")
    g = torch.Generator().manual_seed(T + N + H)
    addends = [tuple(torch.randn(T, H, generator=g).to(torch.bfloat16).cuda() for _ in range(2)) for _ in range(links)]
    for kernel, opts in _runs("add2_tap_snapshot", T, N, H, pdl=True):
        settled = [t.clone() for t in _chain(inp, addends, attnres.Options(kernel=opts.kernel, pdl=False), links,
                                             settle=True)]
        for attempt in range(3):
            chained = _chain(inp, addends, opts, links, settle=False)
            torch.cuda.synchronize()
            for i, (c, s) in enumerate(zip(chained, settled)):
                assert_same_bits(c, s, f"kernel={kernel} attempt {attempt}: chained output #{i} vs settled")
        graph, captured = capture(lambda: _chain(inp, addends, opts, links, settle=False))
        _poison(captured)
        graph.replay()
        torch.cuda.synchronize()
        for i, (c, s) in enumerate(zip(captured, settled)):
            assert_same_bits(c, s, f"kernel={kernel}: graph-replayed chain output #{i} vs settled")


def _snapshot_chain(bank_buffer, prefix0, addends, weights, kernel, pdl, settle):
    """Link i reads bank rows 0..i (row i written by link i - 1 as its snapshot) and writes row i + 1."""
    outs, prefix = [], prefix0
    for i, add in enumerate(addends):
        K = i + 1
        opts = attnres.Options(kernel=kernel, pdl=pdl)
        updated, output = attnres.attn_res_add_rmsnorm(prefix, add, bank_buffer[:K], *weights, 1e-5, 1e-5,
                                                       snapshot_slot=K, options=opts)
        outs += [updated, output]
        prefix = updated
        if settle:
            torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("kernel", ["auto", "single_cta", "split_k"])
@pytest.mark.parametrize("T,H", [(1, 7168), (8, 2304), (32, 4096)])
def test_pdl_newest_bank_row_written_by_the_previous_call(T, H, kernel):
    """The kernels load bank rows 0..K-2 before griddepcontrol.wait and the newest row K-1 after it, so a
    call may read as its newest candidate the snapshot row the call launched just before it wrote."""
    kmax = 16
    g = torch.Generator().manual_seed(T * H)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()  # noqa: E731
    initial = torch.full((kmax + 1, T, H), NAN, dtype=torch.bfloat16).cuda()
    initial[0] = rnd(T, H)
    weights = ((rnd(H) * 0.02), (1 + 0.1 * rnd(H)), (1 + 0.1 * rnd(H)))
    prefix0 = rnd(T, H)
    links = []
    for K in range(1, kmax):
        p = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=K + 1, hidden=H, device="cuda", add=True,
                         snapshot=True, options=attnres.Options(kernel=kernel))
        if not p.accepted:
            break
        links.append(rnd(T, H))
    assert links, f"{kernel} accepts no link of the chain"
    settled_bank = initial.clone()
    settled = [t.clone() for t in _snapshot_chain(settled_bank, prefix0, links, weights, kernel, False, True)]
    for attempt in range(3):
        bank = initial.clone()
        torch.cuda.synchronize()
        chained = _snapshot_chain(bank, prefix0, links, weights, kernel, True, False)
        torch.cuda.synchronize()
        for i, (c, s) in enumerate(zip(chained, settled)):
            assert_same_bits(c, s, f"kernel={kernel} attempt {attempt}: output #{i} (link {i // 2}) vs settled")
        assert_same_bits(bank, settled_bank, f"kernel={kernel} attempt {attempt}: bank after the chain")


@pytest.mark.parametrize("variant", ["attn_res", "rmsnorm_tap", "add2_tap_snapshot", "persistent"])
def test_calls_run_on_the_callers_stream(variant):
    """The call is ordered after earlier work on the caller's (non-default) stream: a slow kernel followed by
    a copy of new input values on that stream must be seen by the call."""
    T, N, H = 4, 6, 4096
    runs = _runs(variant, T, N, H)
    fn = VARIANTS[variant][2]
    for kernel, opts in runs:
        inp = make_inputs(T, N, H, layout="snapshot_major", addends=2, seed=3, device="cuda")
        new_prefix = make_inputs(T, N, H, addends=0, seed=4, device="cuda").layer_residual
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # keep the stream busy for tens of milliseconds
            inp.layer_residual.copy_(new_prefix)
            on_stream = fn(inp, opts)
        stream.synchronize()
        got = [t.clone() for t in on_stream]
        torch.cuda.synchronize()
        expected = fn(inp, opts)  # the same call on settled inputs, default stream
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_bits(a, b, f"{variant} kernel={kernel} output #{i}: on a busy side stream vs settled")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_first_call_inside_a_capture(variant):
    """A shape no other test of this file runs: whatever the launcher initialises on a kernel's first use
    must be legal during capture."""
    T, N, H = 7, 11, 1160
    runs = _runs(variant, T, N, H)
    fn = VARIANTS[variant][2]
    for kernel, opts in runs:
        inp = make_inputs(T, N, H, layout="snapshot_major", addends=2, seed=13, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn(inp, opts)
        _poison(captured)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in captured]
        eager = fn(inp, opts)
        for i, (r, e) in enumerate(zip(replayed, eager)):
            assert_same_bits(r, e, f"{variant} kernel={kernel} output #{i}: first-use capture vs eager")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_capture_does_not_raise(variant):
    T, N, H = 2, 9, 7168
    runs = _runs(variant, T, N, H)
    fn = VARIANTS[variant][2]
    inp = make_inputs(T, N, H, layout="token_major", addends=2, seed=9, device="cuda")
    for _, opts in runs:
        for mode in ("global", "thread_local", "relaxed"):
            graph = torch.cuda.CUDAGraph()
            fn(inp, opts)  # warm-up outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, capture_error_mode=mode):
                fn(inp, opts)
            graph.replay()
            torch.cuda.synchronize()
