"""The persistent kernel on the GPU (cpp/src/cuda/attn_res_persistent.cuh; all CUDA-only, skipped elsewhere).

* every op that reaches it (the persistent op with and without its addend, attn_res_rmsnorm and
  attn_res_add_rmsnorm under the persistent topology) against the float64 oracle over a covering grid: T in
  {33, 300, 1024, 4096, 16384}, every N in 1..16, the fast-path H (2304, 4096, 7168, 8192), odd H (2056, 200,
  8) and H = 16384, snapshot-major / token-major / contiguous banks, padded prefix rows, unequal eps pairs,
  one-pass and two-pass rings; `updated` bit for bit against PyTorch's `prefix + add` for every token;
* every token agrees with the per-token split_k kernel within the op tolerance;
* bitwise properties: run to run, a token's bits independent of T, of its position and of the grid, CUDA-graph
  replay equals eager (outputs poisoned before each replay), PDL on and off, PDL chains that interleave
  per-token and persistent calls (each reading what the previous one wrote: the updated prefix, the newest
  bank row) equal the settled sequence, subnormal sums kept, inputs untouched;
* two addends: the plan takes them, the model layer folds the tail into the persistent kernel, bitwise the eager
  sequence (tests/kernels/test_persistent_add2.py holds every geometry to split_k's bits).

Large T: inputs are drawn on the GPU; the oracle checks a sample of tokens (first, last, block and lap
boundaries of the 132-block grid, random ones) since a token's result depends only on its own rows, while
the split_k comparison and the bit checks cover every token.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import attnres
from attnres import reference
from attnres.models.kimi_k3 import PathRecord, PendingTail, ResidualSettings, SiteWeights, SnapshotBank, attn_res_site
from attnres.models.kimi_k3 import residual as R
from attnres.planning import device_info
from conftest import requires_cuda
from helpers import Inputs, assert_same_bits, assert_storage_unchanged, count_subnormal, make_inputs

pytestmark = [requires_cuda, pytest.mark.gpu]

BF16 = torch.bfloat16
NAN = float("nan")
PERSISTENT = attnres.Options(topology="persistent")
SPLIT_K = attnres.Options(kernel="split_k")

E_SAME = (1e-5, 1e-5)
E_NORM_BIG = (1e-6, 1e-2)
E_RMS_BIG = (1e-2, 1e-6)
E_ZERO = (0.0, 1e-5)


# ------------------------------------------------------------------------------------------------ inputs
def gpu_inputs(T: int, N: int, H: int, *, layout: str = "snapshot_major", add: bool = True, seed: int = 0,
               eps: tuple[float, float] = E_SAME, row_pad: int = 0, weight_2d: bool = False,
               bank_scale=(0.1, 8.0), prefix_scale=(0.5, 2.0), add_scale=0.5) -> Inputs:
    """helpers.make_inputs' cases, drawn on the GPU (T up to 16384 at H = 7168 in well under a second): bank
    rows log-uniform in bank_scale, prefix rows in prefix_scale, NaN in every byte the call must not read
    (spare bank rows, row padding)."""
    if eps[0] != eps[1]:  # rows whose mean square is comparable to the larger eps (test_ops_oracle.py)
        bank_scale, prefix_scale, add_scale = (0.03, 0.3), (0.03, 0.3), 0.05
    g = torch.Generator(device="cuda").manual_seed(seed)
    K = N - 1

    def rows(n: int, scale) -> torch.Tensor:
        x = torch.randn(n, H, generator=g, device="cuda")
        x = torch.where(x == 0, torch.full_like(x, 0.5), x)  # never zero
        lo, hi = math.log(scale[0]), math.log(scale[1])
        return x * torch.exp(lo + (hi - lo) * torch.rand(n, 1, generator=g, device="cuda"))

    values = rows(K * T, bank_scale).reshape(K, T, H).to(BF16)
    if layout == "contiguous":
        bank = values
        block, spare = bank, None
    elif layout == "snapshot_major":
        bank = torch.full((K + 2, T, H), NAN, dtype=BF16, device="cuda")
        bank[:K] = values
        block, spare = bank[:K], K
    else:
        bank = torch.full((T, K + 2, H), NAN, dtype=BF16, device="cuda")
        bank[:, :K] = values.transpose(0, 1)
        block, spare = bank.transpose(0, 1)[:K], K

    def padded(x: torch.Tensor) -> torch.Tensor:
        if row_pad == 0:
            return x.contiguous()
        buf = torch.full((T, H + row_pad), NAN, dtype=BF16, device="cuda")
        buf[:, :H] = x
        return buf

    prefix = padded(rows(T, prefix_scale).to(BF16))
    addend = padded((torch.randn(T, H, generator=g, device="cuda") * add_scale).to(BF16)) if add else None
    res_w = (torch.randn(H, generator=g, device="cuda") * 0.02).to(BF16)
    rms_w = (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(BF16)
    norm_w = (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(BF16)
    if weight_2d:
        res_w = res_w.reshape(1, H)
    buffers = {"bank": bank, "prefix": prefix, "res_weight": res_w, "rms_weight": rms_w, "norm_weight": norm_w}
    if addend is not None:
        buffers["add"] = addend
    return Inputs(T=T, N=N, H=H, layout=layout, layer_residual=prefix[:, :H],
                  add=None if addend is None else addend[:, :H], add2=None, block_residual=block, bank_buffer=bank,
                  res_weight=res_w, rms_weight=rms_w, norm_weight=norm_w, rms_eps=eps[0], norm_eps=eps[1],
                  spare_slot=spare, buffers=buffers)


def sample_tokens(T: int, count: int = 96, seed: int = 0) -> torch.Tensor:
    """Token indices the oracle checks: all of them for small T; else the first and last, the grid's block and
    lap boundaries (blocks take tokens b, b + G, b + 2G, ...; G = 132 on the H200), and random ones."""
    if T <= count:
        return torch.arange(T)
    fixed = {0, 1, 2, T - 2, T - 1}
    for b in (131, 132, 133, 263, 264, 265, 1023, 1024, 4095, 4096):
        if b < T:
            fixed.add(b)
    g = torch.Generator().manual_seed(seed)
    rand = torch.randperm(T, generator=g)[: count - len(fixed)].tolist()
    return torch.tensor(sorted(fixed | set(rand)))


def oracle_on(inp: Inputs, tokens: torch.Tensor, *, add: bool) -> reference.Result:
    idx = tokens.to(inp.device)
    return reference.attn_res(inp.layer_residual[idx], inp.block_residual[:, idx], inp.res_weight, inp.rms_weight,
                              inp.rms_eps, layer_residual_add=inp.add[idx] if add else None,
                              norm_weight=inp.norm_weight, norm_eps=inp.norm_eps)


def check_rows(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """The contract's rule over the tensor, and no token far off: a corrupted row can hide in a large T's
    tensor-wide relative error, not in its own."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    reference.check_close(actual, expected, what)
    a, e = actual.double(), expected.double()
    rel = (a - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-300)
    worst = int(rel.argmax())
    limit = 1e-2 if actual.shape[-1] >= 64 else 3e-2  # a handful of elements: one ulp is a large share
    assert float(rel[worst]) < limit, f"{what}: row {worst} relative L2 error {float(rel[worst]):.2e} (> {limit})"


# ------------------------------------------------------------------------------------------------ calls
# How a call reaches the persistent kernel: the persistent op, or the per-token ops under the topology.
def call(inp: Inputs, via: str, add: bool, options: attnres.Options | None = None):
    """(updated or None, output)."""
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    if via == "persistent_op":
        return attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual, inp.block_residual, *w,
                                                       layer_residual_add=inp.add if add else None,
                                                       options=options)
    options = options or PERSISTENT
    if add:
        return attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w, options=options)
    return None, attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, options=options)


def split_k(inp: Inputs, add: bool):
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    if add:
        return attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w, options=SPLIT_K)
    return None, attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, options=SPLIT_K)


def persistent_plan(inp: Inputs, via: str, add: bool, options=None):
    op = {"persistent_op": "attn_res_add_rmsnorm_persistent", "topology": "attn_res_add_rmsnorm" if add else
          "attn_res_rmsnorm"}[via]
    return attnres.plan(op, tokens=inp.T, candidates=inp.N, hidden=inp.H, device="cuda", add=add,
                        options=options or PERSISTENT)


# ------------------------------------------------------------------------------------------------ the grid
# (T, N, H, layout, add, via, eps, extra gpu_inputs arguments); every N in 1..16 appears, every T, every H.
CASES = [
    (33, 2, 7168, "token_major", True, "persistent_op", E_SAME, {}),
    (300, 9, 7168, "snapshot_major", True, "persistent_op", E_RMS_BIG, {}),
    (300, 9, 7168, "token_major", False, "topology", E_SAME, {}),
    (1024, 12, 7168, "contiguous", True, "topology", E_NORM_BIG, {"row_pad": 8}),
    (4096, 9, 7168, "token_major", True, "persistent_op", E_SAME, {}),  # the bandwidth target's shape (docs/performance.md)
    (16384, 5, 2304, "snapshot_major", True, "persistent_op", E_SAME, {}),
    (16384, 3, 7168, "token_major", True, "topology", E_SAME, {}),
    (1024, 16, 7168, "snapshot_major", True, "persistent_op", E_SAME, {}),  # two passes
    (300, 15, 7168, "token_major", True, "persistent_op", E_NORM_BIG, {}),  # two passes: 16 rows, 7 slots
    (300, 14, 7168, "token_major", True, "persistent_op", E_SAME, {}),  # two passes: 15 rows, 8 slots
    (1024, 7, 7168, "token_major", True, "persistent_op", E_SAME, {}),  # one pass, no spare slot: 8 rows, 8 slots
    (300, 8, 7168, "snapshot_major", False, "persistent_op", E_RMS_BIG, {}),  # the same without the addend
    (33, 16, 16384, "token_major", True, "persistent_op", E_SAME, {}),  # two passes, norm weight in smem
    (300, 4, 16384, "snapshot_major", True, "topology", E_RMS_BIG, {}),  # one pass at H = 16384
    (1024, 3, 4096, "contiguous", False, "persistent_op", E_SAME, {}),
    (300, 7, 8192, "token_major", True, "persistent_op", E_ZERO, {"row_pad": 16}),
    (4096, 2, 8192, "snapshot_major", True, "topology", E_SAME, {}),
    (1024, 11, 2056, "token_major", True, "persistent_op", E_SAME, {"row_pad": 16}),  # odd H: a partial warp
    (300, 6, 2304, "snapshot_major", False, "topology", E_NORM_BIG, {"weight_2d": True}),
    (33, 13, 200, "token_major", True, "persistent_op", E_SAME, {}),
    (300, 1, 1160, "snapshot_major", True, "persistent_op", E_SAME, {}),  # N = 1: the mixture is P
    (1024, 10, 8, "contiguous", True, "topology", E_SAME, {}),  # one 16-byte vector per row
    (4096, 16, 2056, "snapshot_major", False, "persistent_op", E_RMS_BIG, {}),
    (1024, 8, 4096, "token_major", True, "persistent_op", E_SAME, {}),
]


def _case_id(c) -> str:
    T, N, H, layout, add, via, eps, extra = c
    return f"T{T}-N{N}-H{H}-{layout}-{'add' if add else 'noadd'}-{via}-eps{eps[0]:g},{eps[1]:g}" + "".join(
        f"-{k}" for k in extra)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_against_the_oracle_and_split_k(case):
    T, N, H, layout, add, via, eps, extra = case
    inp = gpu_inputs(T, N, H, layout=layout, add=add, seed=zlib.crc32(_case_id(case).encode()), eps=eps, **extra)
    p = persistent_plan(inp, via, add)
    assert p.accepted and p.kernel == "persistent", p
    ctx = f"{_case_id(case)} plan(slots={p.slots}, passes={p.passes}, threads={p.threads}, blocks={p.blocks})"
    before = inp.storage_snapshot()
    updated, output = call(inp, via, add)
    torch.cuda.synchronize()
    assert_storage_unchanged(before, inp)
    assert output.shape == (T, H) and output.dtype == BF16
    if add:
        # PyTorch's bf16 add on the CPU: an fp32 add rounded to bf16, no flush (reference.prefix_update)
        assert_same_bits(updated, reference.prefix_update(inp.layer_residual.cpu(), inp.add.cpu()),
                         f"{ctx}: updated vs torch prefix + add")
    else:
        assert updated is None
    tokens = sample_tokens(T, seed=T + N)
    ref = oracle_on(inp, tokens, add=add)
    check_rows(output[tokens.cuda()], ref.output, f"{ctx}: output vs oracle")
    if N == 1:  # the mixture is P: the output is the two-rounding norm of P alone
        P = reference.prefix_update(inp.layer_residual.cpu(), inp.add.cpu() if add else None)
        check_rows(output, reference.two_rounding_rmsnorm(P.cpu(), inp.norm_weight.cpu(), inp.norm_eps),
                   f"{ctx}: N = 1 output")
    sk_updated, sk_output = split_k(inp, add)
    check_rows(output, sk_output, f"{ctx}: output vs split_k")
    if add:
        assert_same_bits(updated, sk_updated, f"{ctx}: updated vs split_k")
    again = call(inp, via, add)[1]
    assert_same_bits(again, output, f"{ctx}: second run")


def test_every_candidate_count_and_pass_mode_is_covered():
    """The grid above has teeth where the kernel branches: every N, both pass modes, every vector bucket."""
    assert {c[1] for c in CASES} == set(range(1, 17))
    assert {c[0] for c in CASES} >= {33, 300, 1024, 4096, 16384}
    assert {c[2] for c in CASES} >= {2304, 4096, 7168, 8192, 16384, 2056}
    def plan(T, N, H, add):
        return attnres.plan("attn_res_add_rmsnorm_persistent", tokens=T, candidates=N, hidden=H, device="cuda", add=add)

    modes = {(p.passes, p.vectors) for p in (plan(T, N, H, add) for T, N, H, layout, add, via, eps, extra in CASES)}
    # every vector bucket the plan can give at some H (the layout follows split_k's chunks)
    buckets = {plan(1, 9, H, True).vectors for H in range(8, 16385, 8)}
    assert {m[0] for m in modes} == {1, 2} and {m[1] for m in modes} == buckets, (modes, buckets)


# ------------------------------------------------------------------------------------------------ bits
@pytest.mark.parametrize("T,N,H,layout", [(1000, 9, 7168, "token_major"), (700, 16, 7168, "snapshot_major"),
                                          (500, 6, 16384, "token_major"), (400, 5, 2304, "snapshot_major")])
def test_token_bits_independent_of_T_position_and_grid(T, N, H, layout):
    """The same token computed in calls of different T (a grid of min(T, SMs) blocks: 1, 5, 131, 132, ...),
    at different positions (another block, another lap), gives the same bits."""
    inp = gpu_inputs(T, N, H, layout=layout, add=True, seed=T + N + H)
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    full_u, full_o = attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual, inp.block_residual, *w,
                                                             layer_residual_add=inp.add)
    for a, b in ((0, 1), (T - 1, T), (131, 136), (3, 134), (132, 264), (17, T - 40), (T - 133, T)):
        u, o = attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual[a:b], inp.block_residual[:, a:b], *w,
                                                       layer_residual_add=inp.add[a:b])
        assert_same_bits(o, full_o[a:b], f"output of tokens [{a}, {b}) in a call of {b - a} vs of {T}")
        assert_same_bits(u, full_u[a:b], f"updated of tokens [{a}, {b})")


@pytest.mark.parametrize("T,N,H", [(2048, 9, 7168), (300, 16, 7168), (300, 3, 16384)])
def test_graph_replay_and_pdl_give_the_eager_bits(T, N, H):
    inp = gpu_inputs(T, N, H, layout="token_major", add=True, seed=7 * T + N)
    w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)

    def run(pdl):
        return list(attnres.attn_res_add_rmsnorm_persistent(
            inp.layer_residual, inp.block_residual, *w, layer_residual_add=inp.add,
            options=attnres.Options(topology="persistent", pdl=pdl)))

    eager = [t.clone() for t in run(True)]
    off = run(False)
    for i, (a, b) in enumerate(zip(eager, off)):
        assert_same_bits(b, a, f"output #{i}: PDL off vs on")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(True)
    for seed in (1, 2):
        fresh = gpu_inputs(T, N, H, layout="token_major", add=True, seed=seed)
        for name, buf in inp.buffers.items():
            buf.copy_(fresh.buffers[name])
        for t in captured:
            t.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        expected = run(False)
        for i, (a, b) in enumerate(zip(captured, expected)):
            assert_same_bits(a, b, f"output #{i}: graph replay (fresh inputs {seed}) vs eager")


def _mixed_chain(bank, prefix0, adds, weights, *, pdl: bool, settle: bool):
    """Link i (K = i + 1 snapshots): split_k attn_res_add_rmsnorm writes bank row K as its snapshot; the
    persistent op then reads K + 1 rows — the newest being that snapshot — with the first call's updated as
    its prefix; split_k attn_res_rmsnorm and another persistent call read what that persistent call wrote."""
    outs, prefix = [], prefix0
    for i, (a, b, c) in enumerate(adds):
        K = i + 1
        pk = attnres.Options(kernel="split_k", pdl=pdl)
        ps = attnres.Options(topology="persistent", pdl=pdl)
        u1, o1 = attnres.attn_res_add_rmsnorm(prefix, a, bank[:K], *weights, snapshot_slot=K, options=pk)
        u2, o2 = attnres.attn_res_add_rmsnorm_persistent(u1, bank[:K + 1], *weights, layer_residual_add=b, options=ps)
        o3 = attnres.attn_res_rmsnorm(u2, bank[:K + 1], *weights, options=pk)
        u4, o4 = attnres.attn_res_add_rmsnorm_persistent(u2, bank[:K + 1], *weights, layer_residual_add=c, options=ps)
        outs += [u1, o1, u2, o2, o3, u4, o4]
        prefix = u4
        if settle:
            torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("T,H", [(300, 7168), (2000, 2304)])
def test_pdl_chain_interleaving_per_token_and_persistent_calls(T, H):
    """Every read of data the previous kernel wrote happens after griddepcontrol.wait (the newest bank row,
    the prefix), and no kernel releases its dependents before its last store is issued: the PDL chain equals
    the same calls run one at a time, eagerly and replayed from a CUDA graph."""
    links = 8
    g = torch.Generator(device="cuda").manual_seed(T * H)
    rnd = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g, device="cuda")).to(BF16)  # noqa: E731
    initial = torch.full((links + 2, T, H), NAN, dtype=BF16, device="cuda")
    initial[0] = rnd(T, H, scale=2.0)
    weights = (rnd(H, scale=0.02), (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(BF16),
               (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(BF16), 1e-5, 1e-5)
    prefix0 = rnd(T, H)
    adds = [tuple(rnd(T, H, scale=0.5) for _ in range(3)) for _ in range(links)]
    settled_bank = initial.clone()
    settled = [t.clone() for t in _mixed_chain(settled_bank, prefix0, adds, weights, pdl=False, settle=True)]
    for attempt in range(3):
        bank = initial.clone()
        torch.cuda.synchronize()
        chained = _mixed_chain(bank, prefix0, adds, weights, pdl=True, settle=False)
        torch.cuda.synchronize()
        for i, (c, s) in enumerate(zip(chained, settled)):
            assert_same_bits(c, s, f"attempt {attempt}: output #{i} (link {i // 7}) vs settled")
        assert_same_bits(bank, settled_bank, f"attempt {attempt}: bank after the chain")
    bank = initial.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _mixed_chain(bank, prefix0, adds, weights, pdl=True, settle=False)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _mixed_chain(bank, prefix0, adds, weights, pdl=True, settle=False)
    bank.copy_(initial)
    for t in captured:
        t.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    for i, (c, s) in enumerate(zip(captured, settled)):
        assert_same_bits(c, s, f"graph replay: output #{i} (link {i // 7}) vs settled")
    assert_same_bits(bank, settled_bank, "graph replay: bank after the chain")


def test_subnormal_sums_are_kept():
    """prefix + add with subnormal operands and sums (the CPU-drawn helpers case), bit for bit as PyTorch."""
    inp = make_inputs(300, 5, 2304, layout="snapshot_major", addends=1, seed=41, device="cuda",
                      bank_scale=(5e-40, 3e-39), prefix_scale=(5e-40, 3e-39), add_scale=1e-39)
    assert count_subnormal(inp.layer_residual) > 0 and count_subnormal(inp.add) > 0
    updated, output = attnres.attn_res_add_rmsnorm_persistent(
        inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps,
        inp.norm_eps, layer_residual_add=inp.add)
    expected = reference.prefix_update(inp.layer_residual.cpu(), inp.add.cpu())
    assert count_subnormal(expected) > expected.numel() // 2
    assert_same_bits(updated, expected, "updated with subnormal sums")
    ref = reference.attn_res(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.rms_eps,
                             layer_residual_add=inp.add, norm_weight=inp.norm_weight, norm_eps=inp.norm_eps)
    reference.check_close(output.cpu(), ref.output, "output of subnormal rows")


# ------------------------------------------------------------------------------------------------ add2
def test_two_addends_fold_on_the_persistent_kernel():
    T, k, H = 300, 6, 7168
    g = torch.Generator(device="cuda").manual_seed(5)
    rnd = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g, device="cuda")).to(BF16)  # noqa: E731
    bank = SnapshotBank.allocate(8, T, H, layout="token_major", device="cuda", fill=NAN)
    for s in range(k):
        bank.row(s).copy_(rnd(T, H, scale=(0.5, 1.0, 4.0)[s % 3]))
    w = SiteWeights(rnd(H, scale=0.02), (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(BF16),
                    (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(BF16), 1e-5, 1e-6)
    tail = PendingTail(rnd(T, H, scale=2.0), rnd(T, H), rnd(T, H, scale=0.7))
    settings = ResidualSettings(fold=True, topology="persistent")

    # The library: the plan takes the two-addend call on the persistent kernel, inputs unchanged.
    p = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=k + 1, hidden=H, device="cuda", add=True,
                     add2=True, options=PERSISTENT)
    assert p.accepted and p.kernel == "persistent", p
    before = [t.clone() for t in (*tail, bank.storage)]
    attnres.attn_res_add_rmsnorm(tail.prefix, tail.routed, bank.candidates(k), *w.args(),
                                 layer_residual_add2=tail.shared, options=PERSISTENT)
    for a, b in zip(before, (*tail, bank.storage)):
        assert_same_bits(a, b, "inputs after the two-addend call")

    # The model layer folds the tail into the persistent kernel: bitwise the eager sequence.
    record = PathRecord()
    got = attn_res_site(tail, bank, k, w, settings, site="s", record=record)
    assert [(e.path, e.kernel) for e in record.entries] == [(R.FUSED_ADD2, "persistent")], record.entries
    P = tail.prefix + (tail.routed + tail.shared)  # the eager sequence
    assert_same_bits(got.prefix, P, "folded prefix")
    eager = attnres.attn_res_rmsnorm(P, bank.candidates(k), *w.args(), options=PERSISTENT)
    assert_same_bits(got.output, eager, "model-layer output vs the eager sequence")

    # The addend only changes the last candidate: the one-addend call on the bf16 sum routed + shared equals
    # the no-add call on the materialized prefix, bit for bit.
    u, o = attnres.attn_res_add_rmsnorm_persistent(tail.prefix, bank.candidates(k), *w.args(),
                                                   layer_residual_add=tail.routed + tail.shared)
    assert_same_bits(u, P, "updated of the one-addend call")
    assert_same_bits(o, eager, "output of the one-addend call vs the no-add call on P")
    ref = reference.attn_res(P, bank.candidates(k), w.res_weight, w.rms_weight, w.rms_eps,
                             norm_weight=w.norm_weight, norm_eps=w.norm_eps)
    check_rows(o, ref.output, "output vs oracle")


# ------------------------------------------------------------------------------------------------ plan
def test_plan_on_this_device():
    """The geometry the plan hands the launcher on this GPU: within its shared memory and SM count."""
    info = attnres.backend_info()["cuda_devices"][0]
    optin = device_info("cuda").shared_memory_per_block_optin
    assert optin >= 100 * 1024
    for H in (8, 2056, 2304, 4096, 7168, 8192, 16384):
        for N in (1, 9, 16):
            for T in (1, 33, 5000):
                p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=T, candidates=N, hidden=H,
                                 device="cuda", add=True)
                assert p.kernel == "persistent", p
                assert p.blocks_per_sm in (1, 2) and p.blocks == min(T, p.blocks_per_sm * info["sms"]), p
                # Two blocks share the SM's shared memory (the opt-in limit plus the 1 KB the driver keeps per block).
                assert p.smem_bytes <= optin and (p.blocks_per_sm == 1 or 2 * (p.smem_bytes + 1024) <= optin + 1024), p
                assert p.passes in (1, 2) and p.slots >= 2 and p.threads % 32 == 0 and p.threads <= 288, p
                assert (p.threads - 32) * p.vectors * 8 >= H, p
