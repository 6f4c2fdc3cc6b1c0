"""attnres.plan: the kernel a call takes (or why it is declined), a pure function of device, shape, outputs
and options (cpp/src/plan.cpp, plan_tuning.hpp). The CUDA geometry cases run where a Hopper GPU is visible.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import attnres
from attnres import _C
from conftest import requires_cuda
from helpers import max_cluster_python

OPS = ("attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent")
FAST_H = (2304, 4096, 7168, 8192)
PERSISTENT_TAP = "the persistent kernel does not emit the pre-norm mixture tap"
ATTN_RES_NOT_PERSISTENT = ("the persistent kernel does not emit the fp32 diagnostics: attn_res with diagnostics "
                           "runs on the per-token kernels")
MAX_CLUSTER = max_cluster_python()


def _flags(op):
    """The outputs a typical call of `op` asks for."""
    return {"attn_res": {"diagnostics": True}, "attn_res_rmsnorm": {}, "attn_res_add_rmsnorm": {"add": True},
            "attn_res_add_rmsnorm_persistent": {"add": True}}[op]


def _devices_without_a_gpu_needed(device):
    """The plan's device list for the 'every device' checks: the fixture's device, plus a CUDA device
    described by a build without the CUDA backend (the plan answers for it without a GPU)."""
    out = [device]
    if device == "cpu" and not _C.cuda_backend_built():
        out.append("cuda")
    return out


# ----------------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_take_the_cpu_backend(op):
    topo = attnres.Options(topology="persistent") if op == "attn_res_add_rmsnorm_persistent" else None
    for T, N, H in itertools.product((1, 7, 33, 5000), (1, 5, 16), (8, 1160, 7168, 16384)):
        p = attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cpu", options=topo, **_flags(op))
        assert p.accepted and p.kernel == "cpu" and p.decline is None, (op, T, N, H, p)


@pytest.mark.parametrize("kernel", ["single_cta", "split_k", "persistent"])
@pytest.mark.parametrize("op", OPS)
def test_forced_cuda_kernels_are_declined_on_cpu(op, kernel):
    p = attnres.plan(op, tokens=2, candidates=3, hidden=64, device="cpu", options=attnres.Options(kernel=kernel),
                     **_flags(op))
    assert not p.accepted and p.kernel is None
    assert p.decline == (ATTN_RES_NOT_PERSISTENT if (op, kernel) == ("attn_res", "persistent") else
                         f"kernel {kernel} runs on CUDA devices; the tensors are on cpu"), p


def test_attn_res_declines_the_forced_persistent_kernel(device):
    """Forcing the persistent kernel on attn_res is declined with the same reason on every device: only the
    per-token kernels emit the fp32 diagnostics."""
    for dev in _devices_without_a_gpu_needed(device):
        p = attnres.plan("attn_res", tokens=100, candidates=9, hidden=7168, device=dev, diagnostics=True,
                         options=attnres.Options(kernel="persistent"))
        assert p.decline == ATTN_RES_NOT_PERSISTENT, (dev, p)


def test_forcing_the_cpu_kernel_on_cpu_is_accepted():
    p = attnres.plan("attn_res", tokens=2, candidates=3, hidden=64, options=attnres.Options(kernel="cpu"))
    assert p.accepted and p.kernel == "cpu"


@pytest.mark.skipif(_C.cuda_backend_built(), reason="describes a build without the CUDA backend")
def test_cuda_device_without_the_backend_is_declined():
    p = attnres.plan("attn_res_add_rmsnorm", tokens=1, candidates=9, hidden=7168, device="cuda", add=True)
    assert p.decline == "attnres was built without the CUDA backend"


# ------------------------------------------------------------------------------- topology rules, every device
@pytest.mark.parametrize("options", [attnres.Options(topology="persistent"), attnres.Options(kernel="persistent"),
                                     attnres.Options(topology="split", split_max_tokens=4)],
                         ids=["topology_persistent", "kernel_persistent", "split_above_ceiling"])
def test_persistent_routing_declines_the_tap_and_takes_two_addends_and_the_snapshot(options, device):
    """The persistent route declines the tap on every device (the same decline on the CPU); it takes one addend or
    two, writes the snapshot row, and runs attn_res without the fp32 diagnostics."""
    for dev in _devices_without_a_gpu_needed(device):
        base = dict(tokens=5, candidates=9, hidden=7168, device=dev, options=options)
        p = attnres.plan("attn_res_add_rmsnorm", add=True, tap=True, **base)
        assert p.decline == PERSISTENT_TAP, (dev, p)
        p = attnres.plan("attn_res_rmsnorm", tap=True, **base)
        assert p.decline == PERSISTENT_TAP, (dev, p)
        accepted = "cpu" if dev == "cpu" else "persistent"
        for op, flags in (("attn_res_add_rmsnorm", {"add": True}), ("attn_res_add_rmsnorm", {"add": True, "add2": True}),
                          ("attn_res_rmsnorm", {}), ("attn_res", {}), ("attn_res", {"add": True}),
                          ("attn_res", {"add": True, "add2": True})):
            p = attnres.plan(op, snapshot=True, **flags, **base)
            if dev == "cpu" and options.kernel == "persistent":
                assert p.decline == "kernel persistent runs on CUDA devices; the tensors are on cpu", (dev, op, p)
            elif _C.cuda_backend_built() or dev == "cpu":
                assert p.accepted and p.kernel == accepted, (dev, op, flags, p)
        p = attnres.plan("attn_res", diagnostics=True, **base)
        if options.kernel == "persistent":
            assert p.decline == ATTN_RES_NOT_PERSISTENT, (dev, p)
        elif _C.cuda_backend_built() or dev == "cpu":
            assert p.accepted and p.kernel != "persistent", (dev, p)


def test_persistent_op_routes_to_the_persistent_kernel_on_every_device(device):
    """The persistent op routes to the persistent kernel whatever the options say (seen through its decline of the
    tap)."""
    for dev in _devices_without_a_gpu_needed(device):
        for options in (None, attnres.Options(), attnres.Options(topology="split", split_max_tokens=64),
                        attnres.Options(kernel="split_k")):
            p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=1, candidates=9, hidden=7168, device=dev,
                             add=True, tap=True, options=options)
            assert p.decline == PERSISTENT_TAP, (dev, options, p)


def test_split_topology_routes_by_token_count(device):
    opts = attnres.Options(topology="split", split_max_tokens=8)
    for T in (1, 7, 8):  # at or below the ceiling: the per-token path, which takes add2
        p = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=9, hidden=7168, device=device, add=True,
                         add2=True, options=opts)
        assert p.accepted, (T, p)
        if device == "cuda":
            assert p.kernel in ("single_cta", "split_k"), (T, p)
    for T in (9, 64, 4096):  # above: the persistent path, with one addend or two
        for add2 in (False, True):
            p = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=9, hidden=7168, device=device, add=True,
                             add2=add2, options=opts)
            assert p.kernel == ("cpu" if device == "cpu" else "persistent"), (T, add2, p)


def test_default_split_ceiling_is_the_measured_crossover(device):
    """One default (the C++ library's, 64 from the H200 crossover) in attnres.Options, the custom ops' schemas and
    the plan: split sends T <= 64 to the per-token kernels and T = 65 to the persistent one."""
    import torch

    assert attnres.Options().split_max_tokens == attnres._C.Options().split_max_tokens == 64
    for op in ("attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm", "attn_res_add_rmsnorm_snapshot"):
        schema = getattr(torch.ops.attnres, op).default._schema
        assert [a.default_value for a in schema.arguments if a.name == "split_max_tokens"] == [64], op
    split = attnres.Options(topology="split")
    for T, persistent in ((64, False), (65, True)):
        p = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=9, hidden=7168, device=device, add=True,
                         options=split)
        if device == "cuda":
            assert (p.kernel == "persistent") == persistent, (T, p)
        else:
            assert p.kernel == "cpu", (T, p)


def test_split_ceiling_zero_sends_every_call_to_persistent(device):
    p = attnres.plan("attn_res_add_rmsnorm", tokens=1, candidates=3, hidden=64, device=device, add=True, tap=True,
                     options=attnres.Options(topology="split", split_max_tokens=0))
    assert p.decline == PERSISTENT_TAP


def test_attn_res_never_routes_to_persistent(device):
    """Only the per-token kernels emit the fp32 diagnostics."""
    for options in (attnres.Options(topology="persistent"), attnres.Options(topology="split", split_max_tokens=0)):
        p = attnres.plan("attn_res", tokens=100, candidates=9, hidden=7168, device=device, diagnostics=True,
                         options=options)
        assert p.accepted, p
        assert p.kernel in (("cpu",) if device == "cpu" else ("single_cta", "split_k")), p


def test_plan_is_pure(device):
    queries = [dict(op=op, tokens=T, candidates=N, hidden=H, device=device, **_flags(op))
               for op in OPS for T, N, H in ((1, 9, 7168), (32, 3, 2304), (5, 16, 16384))]
    options = (None, attnres.Options(pdl=False), attnres.Options(topology="split", split_max_tokens=2),
               attnres.Options(kernel="split_k"))
    first = [attnres.plan(**q, options=o) for q in queries for o in options]
    # interleave other queries, then ask again: nothing is remembered between calls
    attnres.plan("attn_res", tokens=64, candidates=2, hidden=8, device=device)
    again = [attnres.plan(**q, options=o) for q in queries for o in options]
    assert first == again


def test_plan_option_errors_raise(device):
    opts = _C.Options()
    opts.split_max_tokens = -1
    q = _C.PlanQuery()
    q.op, q.tokens, q.candidates, q.hidden = _C.AttnResOp.attn_res, 1, 2, 64
    info = _C.query_device(_C.DeviceType.cpu, 0)
    with pytest.raises(attnres.ArgumentError, match=r"^attn_res: options\.split_max_tokens must be >= 0$"):
        _C.plan_query(q, info, opts)
    opts = _C.Options()
    opts.cluster = MAX_CLUSTER + 1
    with pytest.raises(attnres.ArgumentError, match=rf"^attn_res: options\.cluster must be in \[0, {MAX_CLUSTER}\], "
                       rf"got {MAX_CLUSTER + 1}$"):
        _C.plan_query(q, info, opts)
    opts.cluster = MAX_CLUSTER
    assert _C.plan_query(q, info, opts).accepted


# ---------------------------------------------------------------------------------------------------- CUDA
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS[:3])
def test_cuda_automatic_choice_at_kimi_hidden(op):
    """split_k for N >= 5 (single_cta's registers hold at most 4..8 rows); below, whichever the H200
    measurement picked (plan_tuning.hpp), but single_cta only on a prefix N = 1..b (never back and forth)."""
    for T in (1, 8, 32):
        kernels = []
        for N in range(1, 17):
            p = attnres.plan(op, tokens=T, candidates=N, hidden=7168, device="cuda", **_flags(op))
            assert p.accepted and p.kernel in ("single_cta", "split_k"), (op, T, N, p)
            kernels.append(p.kernel)
        assert all(k == "split_k" for k in kernels[4:]), (op, T, kernels)
        b = kernels.count("single_cta")
        assert kernels[:b] == ["single_cta"] * b, (op, T, kernels)


def _geometry_ok(p, N, H):
    assert p.threads % 32 == 0 and p.threads >= 32, p
    assert p.cluster >= 1, p
    assert p.cluster * p.threads * max(p.vectors, 1) * 8 >= H, f"{p} does not cover H = {H}"
    # The N the kernel instance is built for: N itself on split_k's clusters from N = 3, else N's bucket.
    assert N <= p.max_candidates <= 16, p
    if p.kernel == "split_k" and p.cluster > 1 and N >= 3:
        assert p.max_candidates == N, p
    if p.kernel == "single_cta":
        assert p.cluster == 1 and p.threads <= 1024, p
    else:
        assert p.kernel == "split_k" and p.threads <= 256 and p.cluster <= MAX_CLUSTER, p
        assert p.cluster <= max(H // 8, 1), p  # never more blocks than 16-byte vectors in a row


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS[:3])
def test_cuda_plan_never_raises_and_geometry_is_sane(op):
    for N, H, T in itertools.product(range(1, 17), FAST_H + (8, 200, 16384), range(1, 65)):
        p = attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cuda", **_flags(op))
        assert p.accepted, (op, T, N, H, p)
        _geometry_ok(p, N, H)


@requires_cuda
@pytest.mark.gpu
def test_cuda_forced_single_cta_limits():
    """Forced single_cta is accepted exactly inside the limits its decline message states (H <= 8192: 1024
    threads x 8 elements; N: the register budget, at most 8)."""
    import re
    probe = attnres.plan("attn_res_add_rmsnorm", tokens=4, candidates=16, hidden=16384, device="cuda", add=True,
                         options=attnres.Options(kernel="single_cta"))
    m = re.fullmatch(r"single_cta holds a token's rows in one block's registers: it needs H <= (\d+) and N <= (\d+) "
                     r"\(use split_k\)", probe.decline or "")
    assert m, probe
    max_h, max_n = int(m.group(1)), int(m.group(2))
    assert max_h == 8192 and 1 <= max_n <= 8
    for N, H in itertools.product(range(1, 17), FAST_H + (8, 200, 8200, 16384)):
        p = attnres.plan("attn_res_add_rmsnorm", tokens=4, candidates=N, hidden=H, device="cuda", add=True,
                         options=attnres.Options(kernel="single_cta"))
        if N > max_n or H > max_h:
            assert not p.accepted and p.decline.startswith("single_cta holds a token's rows"), (N, H, p)
        else:
            assert p.accepted and p.kernel == "single_cta", (N, H, p)
            _geometry_ok(p, N, H)


@requires_cuda
@pytest.mark.gpu
def test_cuda_forced_split_k_accepts_every_supported_shape():
    for N, H in itertools.product(range(1, 17), FAST_H + (8, 16384)):
        p = attnres.plan("attn_res_add_rmsnorm", tokens=4, candidates=N, hidden=H, device="cuda", add=True,
                         add2=True, tap=True, snapshot=True, options=attnres.Options(kernel="split_k"))
        assert p.accepted and p.kernel == "split_k", (N, H, p)
        _geometry_ok(p, N, H)


@requires_cuda
@pytest.mark.gpu
def test_cuda_cluster_override_and_pdl_flag():
    p = attnres.plan("attn_res_add_rmsnorm", tokens=1, candidates=9, hidden=7168, device="cuda", add=True,
                     options=attnres.Options(kernel="split_k", cluster=MAX_CLUSTER, pdl=False))
    assert p.kernel == "split_k" and p.cluster == MAX_CLUSTER and p.pdl is False
    _geometry_ok(p, 9, 7168)
    p = attnres.plan("attn_res_add_rmsnorm", tokens=1, candidates=9, hidden=7168, device="cuda", add=True)
    assert p.pdl is True
    # a cluster larger than the row has vectors is clamped to the number of vectors
    p = attnres.plan("attn_res", tokens=1, candidates=9, hidden=32, device="cuda",
                     options=attnres.Options(kernel="split_k", cluster=MAX_CLUSTER))
    assert p.accepted and p.cluster == min(MAX_CLUSTER, 4), p
    p = attnres.plan("attn_res", tokens=1, candidates=9, hidden=7168, device="cuda",
                     options=attnres.Options(kernel="split_k", cluster=1))
    assert not p.accepted and "use a larger cluster" in p.decline


@requires_cuda
@pytest.mark.gpu
def test_cuda_forced_cpu_kernel_and_token_limit_declined():
    p = attnres.plan("attn_res", tokens=1, candidates=2, hidden=64, device="cuda", options=attnres.Options(kernel="cpu"))
    assert p.decline.startswith("kernel cpu runs on CPU tensors; the tensors are on cuda:")
    p = attnres.plan("attn_res", tokens=(1 << 26) + 1, candidates=2, hidden=64, device="cuda")
    assert p.decline == f"T = {(1 << 26) + 1} exceeds the per-launch limit of {1 << 26} tokens"


@requires_cuda
@pytest.mark.gpu
def test_cuda_persistent_op_takes_the_persistent_kernel():
    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=4096, candidates=9, hidden=7168, device="cuda",
                     add=True, options=attnres.Options(topology="persistent"))
    # The default geometry on a Hopper GPU: two blocks per SM, whose half of the shared memory holds 8 rows of
    # H = 7168, fewer than a token's 10 (N = 9 and the prefix), so each token streams in two passes.
    sms = attnres.backend_info()["cuda_devices"][0]["sms"]
    assert p.kernel == "persistent" and p.blocks_per_sm == 2 and p.blocks == min(4096, 2 * sms), p
    assert p.slots < 9 + 1 and p.passes == 2, p


@pytest.mark.parametrize("tokens,candidates,hidden", [(1, 17, 7168), (1, 0, 64), (0, 2, 7168), (1, 2, 7),
                                                      (1, 2, 16392), (1, 2, 0)])
def test_plan_never_accepts_a_shape_the_ops_reject(tokens, candidates, hidden, device):
    """A caller deciding between the fused path and materializing first must not be told that a call the op
    would reject (T < 1, N outside [1, 16], H not a multiple of 8 in [8, 16384]) runs: the plan raises a
    ValueError (attnres.ArgumentError) or declines."""
    for op in OPS:
        try:
            p = attnres.plan(op, tokens=tokens, candidates=candidates, hidden=hidden, device=device, **_flags(op))
        except ValueError:
            continue
        assert not p.accepted, f"{op} T={tokens} N={candidates} H={hidden}: plan accepts with {p}"


# ------------------------------------------------------------------------------------ route and decline code
def test_plan_names_its_route_and_decline_code():
    base = dict(candidates=9, hidden=7168, device="h200", add=True)
    assert attnres.plan("attn_res_add_rmsnorm", tokens=1, **base).route == "per_token"
    p = attnres.plan("attn_res_add_rmsnorm", tokens=4096, candidates=2, hidden=7168, device="h200", add=True)
    assert (p.kernel, p.route, p.decline_code) == ("single_cta", "stream", "none"), p
    p = attnres.plan("attn_res_add_rmsnorm", tokens=4096, **base)
    assert (p.kernel, p.route) == ("persistent", "persistent"), p
    assert attnres.plan("attn_res_add_rmsnorm", tokens=4, candidates=3, hidden=64, add=True).route == "cpu"
    p = attnres.plan("attn_res_add_rmsnorm", tokens=4096, tap=True, options=attnres.Options(topology="persistent"),
                     **base)
    assert (p.route, p.decline_code, p.decline) == ("none", "persistent_unsupported_feature", PERSISTENT_TAP), p
    p = attnres.plan("attn_res_add_rmsnorm", tokens=4096, add2=True, options=attnres.Options(topology="persistent"),
                     **base)
    assert (p.kernel, p.route) == ("persistent", "persistent"), p
    # Two addends on the automatic topology stay per-token (not yet measured against split_k).
    assert attnres.plan("attn_res_add_rmsnorm", tokens=4096, add2=True, **base).route == "per_token"
    p = attnres.plan("attn_res", tokens=0, candidates=2, hidden=64)
    assert (p.route, p.decline_code) == ("none", "bad_shape"), p
    # The names are the binding's enum names.
    assert set(_C.DeclineCode.__members__) >= {"none", "bad_shape", "no_cuda_backend", "compute_capability",
                                               "persistent_unsupported_feature",
                                               "persistent_not_resident"}
    assert set(_C.Route.__members__) == {"none", "per_token", "stream", "persistent", "cpu", "token_blocks"}


def test_the_tuning_modules_report_through_plan_info():
    from attnres import _persistent_tuning, _stream_tuning

    p = _stream_tuning.plan(0, tokens=4096, candidates=2, hidden=7168, device="h200")
    assert isinstance(p, attnres.PlanInfo) and p.route == "stream", p
    p = _persistent_tuning.plan(_persistent_tuning.Variant("one", blocks_per_sm=1), tokens=4096, candidates=9,
                                hidden=7168, device="h200")
    assert isinstance(p, attnres.PlanInfo) and p.route == "persistent" and p.blocks_per_sm == 1, p
    p = _persistent_tuning.plan(_persistent_tuning.Variant("bad", slots=64), tokens=4096, candidates=9, hidden=7168,
                                device="h200")
    assert (p.accepted, p.decline_code) == (False, "persistent_slots"), p


# ----------------------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize("name", ["tokens", "candidates", "hidden"])
@pytest.mark.parametrize("value", [1.5, 2.0, True, False, "4", None, 1 << 63, -(1 << 63) - 1, 1 << 70])
def test_plan_counts_must_be_int64(name, value):
    kw = dict(tokens=4, candidates=3, hidden=64)
    kw[name] = value
    with pytest.raises(attnres.ArgumentError, match=f"^attnres.plan: {name} must be "):
        attnres.plan("attn_res", **kw)


def test_plan_counts_accept_integer_types():
    np = pytest.importorskip("numpy")
    p = attnres.plan("attn_res", tokens=np.int64(4), candidates=np.int32(3), hidden=64, diagnostics=np.True_)
    assert p.accepted and p.kernel == "cpu", p
    with pytest.raises(attnres.ArgumentError, match="^attnres.plan: tokens must be an int"):
        attnres.plan("attn_res", tokens=np.True_, candidates=3, hidden=64)
    # The extremes of int64 are ints: the plan declines them, nothing raises.
    assert attnres.plan("attn_res", tokens=(1 << 63) - 1, candidates=2, hidden=64, device="h200").decline_code == \
        "too_many_tokens"
    assert attnres.plan("attn_res", tokens=-(1 << 63), candidates=2, hidden=64).decline_code == "bad_shape"


@pytest.mark.parametrize("flag", ["add", "add2", "tap", "snapshot", "diagnostics", "fp8_pow2_scales"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_plan_flags_must_be_bools(flag, value):
    with pytest.raises(attnres.ArgumentError, match=f"^attnres.plan: {flag} must be a bool"):
        attnres.plan("attn_res_add_rmsnorm", tokens=4, candidates=3, hidden=64, **{flag: value})


@pytest.mark.parametrize("device", ["H200", "h100", "H100", " h200 ", "CPU", "cpu"])
def test_plan_device_names_are_case_insensitive(device):
    p = attnres.plan("attn_res_add_rmsnorm", tokens=4, candidates=3, hidden=64, device=device, add=True)
    assert p.accepted and p.kernel == ("cpu" if "cpu" in device.lower() else "split_k"), p


@pytest.mark.parametrize("device", ["h300", "gpu", "cuda:x", "", "meta", "H200:0", 1.5, True, object(), ["cpu"]])
def test_plan_device_errors_name_the_accepted_forms(device):
    with pytest.raises(attnres.ArgumentError, match=r"^attnres.plan: device .* is not supported") as e:
        attnres.plan("attn_res", tokens=4, candidates=3, hidden=64, device=device)
    for form in ("'cpu'", "'cuda'", "'cuda:N'", "torch.device", "'h100'", "'h200'", "dict of DeviceInfo properties"):
        assert form in str(e.value), (form, str(e.value))


def test_plan_accepts_every_device_form_it_did():
    assert attnres.plan("attn_res", tokens=4, candidates=3, hidden=64, device=torch.device("cpu")).kernel == "cpu"
    props = {"cc_major": 9, "cc_minor": 0, "sm_count": 132, "shared_memory_per_block_optin": 232448}
    described = attnres.plan("attn_res_add_rmsnorm", tokens=4096, candidates=9, hidden=7168, device=props, add=True)
    assert described == attnres.plan("attn_res_add_rmsnorm", tokens=4096, candidates=9, hidden=7168, device="h200",
                                     add=True)
    # A device index, as torch.device takes it (a CUDA build's index names cuda:N, GPU or not; a CPU build has no
    # accelerator for it: a clear error).
    try:
        index_names_cuda = torch.device(0).type == "cuda"
    except RuntimeError:  # no accelerator in this build of torch
        index_names_cuda = False
    if index_names_cuda:
        assert attnres.plan("attn_res", tokens=4, candidates=3, hidden=64, device=0) == \
            attnres.plan("attn_res", tokens=4, candidates=3, hidden=64, device="cuda:0")
    else:
        with pytest.raises(attnres.ArgumentError, match="^attnres.plan: device 0 is not supported"):
            attnres.plan("attn_res", tokens=4, candidates=3, hidden=64, device=0)
    info = _C.described_device("h200")
    assert attnres.plan("attn_res", tokens=4, candidates=3, hidden=64, device=info).accepted
    assert not info.queried and not _C.query_device(_C.DeviceType.cpu, 0).queried
    for bad in ({**props, "sm_count": 1 << 40}, {**props, "cc_major": 9.0}, {**props, "sm_count": True}):
        with pytest.raises(attnres.ArgumentError, match="^attnres.plan: the described device's"):
            attnres.plan("attn_res", tokens=4, candidates=3, hidden=64, device=bad)


def test_plan_other_argument_errors():
    with pytest.raises(attnres.ArgumentError, match="^attnres.plan: op must be one of"):
        attnres.plan("attn_res_fast", tokens=1, candidates=2, hidden=64)
    with pytest.raises(attnres.ArgumentError, match="^attnres.plan: fp8 must be one of"):
        attnres.plan("attn_res_rmsnorm", tokens=1, candidates=2, hidden=64, fp8="e4m3")
    with pytest.raises(attnres.ArgumentError,
                       match=r"^attnres.plan: options must be an attnres.Options \(anything with to_c\(\)\) or None"):
        attnres.plan("attn_res", tokens=1, candidates=2, hidden=64, options={"topology": "persistent"})


def test_two_addends_need_three_ring_slots():
    """Two passes hold the prefix and both addends at once: with two addends the ring needs three slots."""
    from attnres import _persistent_tuning as tuning

    def plan(slots, add2):
        return attnres.plan("attn_res_add_rmsnorm", tokens=4096, candidates=9, hidden=7168, device="h200", add=True,
                            add2=add2, options=tuning.Variant("ring", slots=slots, passes=2).options())
    assert plan(2, False).accepted
    p = plan(2, True)
    assert (p.accepted, p.decline_code) == (False, "persistent_slots") and " fits 3 to " in p.decline, p
    p = plan(3, True)
    assert p.accepted and (p.kernel, p.slots, p.passes) == ("persistent", 3, 2), p
