"""Plan = launch: for every call of a grid of shapes, modes and options, the plan run() launched (the launch
record, _C._last_launch) is, field for field, what attnres.plan answers for the same call on the same device
(and what _C.plan_call answers for its arguments); a declined call launches nothing and raises the plan's own
decline. On the GPU the plan includes the occupancy calculator's answer (cpp/src/run.cpp), so the persistent
kernel's blocks per SM agree too. Calls are built with attnres._C directly (AttnResArgs, _tensors.ref, _C.run).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

import attnres
from attnres import _C, fp8 as _fp8
from attnres._tensors import ref, ref_leading_rows
from attnres.planning import plan_info
from conftest import requires_cuda

FIELDS = ("kernel", "route", "decline", "decline_code", "cluster", "threads", "vectors", "max_candidates", "pdl",
          "blocks", "blocks_per_sm", "slots", "passes", "smem_bytes")


@dataclass(frozen=True)
class Mode:
    name: str
    op: str
    addends: int = 0
    tap: bool = False
    snapshot: bool = False
    fp8: str | None = None


MODES = (
    Mode("attn_res", "attn_res"),
    Mode("rmsnorm", "attn_res_rmsnorm"),
    Mode("rmsnorm_tap", "attn_res_rmsnorm", tap=True),
    Mode("rmsnorm_fp8_token", "attn_res_rmsnorm", fp8="per_token"),
    Mode("add", "attn_res_add_rmsnorm", addends=1),
    Mode("add_tap", "attn_res_add_rmsnorm", addends=1, tap=True),
    Mode("add_snapshot", "attn_res_add_rmsnorm", addends=1, snapshot=True),
    Mode("add_fp8_token", "attn_res_add_rmsnorm", addends=1, fp8="per_token"),
    Mode("add_fp8_block128", "attn_res_add_rmsnorm", addends=1, fp8="block128"),
    Mode("add2", "attn_res_add_rmsnorm", addends=2),
    Mode("add2_tap_snapshot", "attn_res_add_rmsnorm", addends=2, tap=True, snapshot=True),
    Mode("persistent_op", "attn_res_add_rmsnorm_persistent", addends=1),
    Mode("persistent_op_no_add", "attn_res_add_rmsnorm_persistent"),
)
OPTIONS = {
    "auto": attnres.Options(),
    "per_token": attnres.Options(topology="per_token"),
    "persistent": attnres.Options(topology="persistent"),
    "split": attnres.Options(topology="split"),
    "single_cta": attnres.Options(kernel="single_cta"),
    "split_k": attnres.Options(kernel="split_k"),
}


class Buffers:
    """Every tensor a call of the grid can take, allocated once at the largest T and N and sliced per call."""

    def __init__(self, max_tokens: int, max_candidates: int, hidden: int, device: str):
        g = torch.Generator(device=device).manual_seed(hidden)
        bf = dict(dtype=torch.bfloat16, device=device)

        def rand(*shape):
            return (torch.randn(*shape, generator=g, device=device) * 0.5).to(torch.bfloat16)

        T, H = max_tokens, hidden
        self.hidden, self.device = H, device
        self.prefix, self.add, self.add2 = rand(T, H), rand(T, H), rand(T, H)
        # One row more than the largest K: the snapshot row of a call with K = N - 1 candidates is row K.
        self.bank = torch.empty(max_candidates, T, H, **bf)
        self.bank.copy_(rand(max_candidates, 1, H).expand(max_candidates, T, H))
        self.res_weight, self.rms_weight, self.norm_weight = rand(H) * 0.1, rand(H) + 1, rand(H) + 1
        self.output, self.updated, self.mixture = (torch.empty(T, H, **bf) for _ in range(3))
        self.output_fp8 = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=device)

    def call(self, mode: Mode, T: int, N: int) -> tuple[_C.AttnResArgs, dict]:
        """The call's arguments, and the attnres.plan keywords of the same call."""
        op, H, K = mode.op, self.hidden, N - 1
        # TensorRefs hold bare pointers: the call's own tensors live until the next call.
        self.alive = []

        def own(t):
            self.alive.append(t)
            return t

        a = _C.AttnResArgs()
        a.layer_residual = ref(self.prefix[:T], op, "layer_residual")
        a.block_residual = ref_leading_rows(self.bank[:, :T], K, op, "block_residual")
        a.res_weight = ref(self.res_weight, op, "res_weight")
        a.rms_weight = ref(self.rms_weight, op, "rms_weight")
        a.output = ref(self.output[:T], op, "output")
        if op != "attn_res":
            a.norm_weight = ref(self.norm_weight, op, "norm_weight")
        else:
            for name in ("rsigma", "probs", "logits"):
                setattr(a, name, ref(own(torch.empty(N, T, dtype=torch.float32, device=self.device)), op, name))
        if mode.addends >= 1:
            a.layer_residual_add = ref(self.add[:T], op, "layer_residual_add")
            a.updated = ref(self.updated[:T], op, "updated")
        if mode.addends == 2:
            a.layer_residual_add2 = ref(self.add2[:T], op, "layer_residual_add2")
        if mode.tap:
            a.mixture = ref(self.mixture[:T], op, "mixture")
        if mode.snapshot:
            a.snapshot_slot = K
        if mode.fp8:
            a.fp8 = getattr(_C.Fp8Scales, mode.fp8)
            a.output_fp8 = ref(self.output_fp8[:T], op, "output_fp8")
            a.fp8_scales = ref(own(_fp8.empty_scales(mode.fp8, T, H, self.device)), op, "fp8_scales")
        if self.device == "cuda":
            a.stream = torch.cuda.current_stream().cuda_stream
        query = dict(tokens=T, candidates=N, hidden=H, device=self.device, add=mode.addends >= 1,
                     add2=mode.addends == 2, tap=mode.tap, snapshot=mode.snapshot, diagnostics=op == "attn_res",
                     fp8=mode.fp8)
        return a, query


def _fields(p: _C.Plan) -> dict:
    return {f: getattr(p, f) for f in FIELDS}


def check_call(buffers: Buffers, mode: Mode, T: int, N: int, options_name: str) -> str:
    """Runs one call and holds its launch record to the plans; returns its route ("none" when declined)."""
    options = OPTIONS[options_name]
    what = f"{mode.name} T={T} N={N} H={buffers.hidden} options={options_name}"
    args, query = buffers.call(mode, T, N)
    op = getattr(_C.AttnResOp, mode.op)
    c_options = options.to_c()
    public = attnres.plan(mode.op, options=options, **query)
    from_args = _C.plan_call(op, args, c_options)
    assert plan_info(from_args) == public, what
    _, before = _C._last_launch()
    try:
        _C.run(op, args, c_options)
    except _C.UnsupportedError as e:
        assert not public.accepted, f"{what}: the plan accepts ({public}) but the launch raised {e}"
        assert str(e) == f"{mode.op}: {public.decline}", what
        assert _C._last_launch()[1] == before, f"{what}: a declined call recorded a launch"
        return "none"
    launched, count = _C._last_launch()
    assert count == before + 1, what
    assert public.accepted, f"{what}: the plan declines ({public.decline}) but the call launched"
    assert _fields(launched) == _fields(from_args), what
    assert plan_info(launched) == public, f"{what}: launched {plan_info(launched)}, planned {public}"
    return public.route


SMALL_T, LARGE_T = (1, 8, 64, 200, 256, 1024), (4096, 16384)
ALL_N, FEW_N = (1, 2, 3, 5, 9, 12, 16), (2, 9, 16)


def _shapes():
    return [(T, N) for T in SMALL_T for N in ALL_N] + [(T, N) for T in LARGE_T for N in FEW_N]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("H", [1024, 4096, 7168])
def test_every_launch_is_its_plan(H):
    buffers = Buffers(max(LARGE_T), max(ALL_N), H, "cuda")
    routes = set()
    for (T, N), mode, options_name in itertools.product(_shapes(), MODES, OPTIONS):
        routes.add(check_call(buffers, mode, T, N, options_name))
    torch.cuda.synchronize()  # any launch failure surfaces here, inside the test
    # The grid reaches every CUDA route and some declines.
    assert {"per_token", "stream", "persistent", "none"} <= routes, routes
    # The token-block kernel is the H100's automatic choice at T = 4096 (N = 2; plan_tuning.hpp).
    if H == 7168 and torch.cuda.get_device_name().startswith("NVIDIA H100"):
        assert "token_blocks" in routes, routes


@pytest.mark.gpu
@requires_cuda
def test_the_occupancy_answer_is_in_the_plan():
    """The plan for a shape on the queried GPU is the plan of a call of that shape (the occupancy calculator
    included), and forcing two blocks per SM is accepted exactly where both are resident."""
    from attnres import _persistent_tuning as tuning

    buffers = Buffers(4096, 9, 7168, "cuda")
    for blocks_per_sm in (0, 1, 2):
        variant = tuning.Variant("v", blocks_per_sm=blocks_per_sm)
        shape = tuning.plan(variant, tokens=4096, candidates=9, hidden=7168, device="cuda")
        args, _ = buffers.call(Mode("persistent_op", "attn_res_add_rmsnorm_persistent", addends=1), 4096, 9)
        from_args = _C.plan_call(_C.AttnResOp.attn_res_add_rmsnorm_persistent, args, variant.options().to_c())
        assert plan_info(from_args) == shape, blocks_per_sm
        if shape.accepted:
            _C.run(_C.AttnResOp.attn_res_add_rmsnorm_persistent, args, variant.options().to_c())
            assert plan_info(_C._last_launch()[0]) == shape
        else:
            assert shape.decline_code == "persistent_not_resident", shape
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_the_cpu_backend_records_its_launch(mode):
    buffers = Buffers(8, 5, 128, "cpu")
    routes = set()
    for T, N, options_name in itertools.product((1, 8), (1, 2, 5), OPTIONS):
        routes.add(check_call(buffers, mode, T, N, options_name))
    # Every accepted CPU call is route cpu; forcing a CUDA kernel (and the persistent route's declines) do not
    # launch.
    assert routes <= {"cpu", "none"} and "cpu" in routes and "none" in routes, routes


def test_the_record_is_per_thread():
    """The record is the calling thread's: a thread that has run nothing sees no launch."""
    import threading

    buffers = Buffers(2, 3, 64, "cpu")
    args, _ = buffers.call(MODES[0], 2, 3)
    _C.run(_C.AttnResOp.attn_res, args, attnres.Options().to_c())
    assert _C._last_launch()[1] >= 1 and _C._last_launch()[0].route == _C.Route.cpu
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_C._last_launch()))
    thread.start()
    thread.join()
    plan, count = seen[0]
    assert count == 0 and plan.route == _C.Route.none and plan.kernel == _C.KernelKind.auto
