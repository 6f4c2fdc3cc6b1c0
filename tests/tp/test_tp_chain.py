"""Tensor parallelism (docs/tp.md): the Kimi K3 decode chain with TP stand-in sub-layers on two ranks.

On the CPU (CI) two gloo ranks are spawned and run the checks of tp_check.checks on a small config; with two
Hopper GPUs the same checks run on NCCL with Kimi K3's real config (93 layers, H = 7168), and skip otherwise.
Asserted: every rank ends each step with bit-identical prefixes, bank and outputs; TP = 2 equals the TP = 1
chain on the summed partials bitwise; fold on == fold off under TP; the chain's MoE consumes the local-route
finalize + all-reduce + latent norm; the finalize under TP against the TP = 1 finalize within the stated
bound. Then the checks' teeth (one deliberate fault at a time must fail them), three ranks (the tolerance
path), and the pieces in one process: Shards, the stand-ins, the launcher's environment, the command line.
"""

from __future__ import annotations

import json
from dataclasses import replace
import os
import subprocess
import sys

import pytest
import torch

from attnres.models.kimi_k3 import ChainTrace, KimiK3Config, ResidualSettings, compare_outputs, compare_traces
from attnres.models.kimi_k3.residual import FUSED_ADD2
from attnres.models.kimi_k3.sublayers import _LayerRandom
from attnres.models.kimi_k3.tp import (Shards, StandInRoutedExperts, TPAttention, TPDenseMLP, TPMoE, latent_width,
                                       permuted_rows, shard_range, tensor_parallel_model)
from helpers import checkout_env
from tp_check import checks as C
from tp_check.cli import check_rank_variants, default_opts, main
from tp_check.launch import (NO_MULTICAST_ENV, cuda_ranks_available, forbid_multicast, launch, resolve_device,
                             under_torchrun)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TWO_GPUS, NO_TWO_GPUS = cuda_ranks_available(2)
ONE_GPU, NO_ONE_GPU = cuda_ranks_available(1)
BACKENDS = ["gloo-cpu", pytest.param("nccl-cuda", marks=[pytest.mark.gpu,
                                                         pytest.mark.skipif(not TWO_GPUS, reason=NO_TWO_GPUS)])]
# Checks per T at W = 2: per step 2 rank agreement, 2 all-reduce audits, 2 one-shot rank agreements, 2 one-shot
# chains against the torch.distributed chain, 2 TP-vs-TP1 chains, 1 fold; 2 watched
# MoE layers; 5 finalize. W > 2 has no bitwise TP-vs-TP1 chain or finalize check.
EXPECTED_PER_T = {"chain": lambda steps, w=2: (11 if w == 2 else 9) * steps + 2,
                  "finalize": lambda w=2: 5 if w == 2 else 4}


def _run(device: str, nprocs: int = 2, variants=({},), **opts) -> list[list[C.Check]]:
    opts = default_opts(device=device, threads=1 if device == "cpu" else None, **opts)
    return launch(check_rank_variants, nprocs, opts, list(variants))[0]


def _select(checks: list[C.Check], *words: str) -> list[C.Check]:
    return [c for c in checks if all(w in c.name for w in words)]


def _run_check_command(cmd: list[str], out, cwd, timeout: int) -> tuple[subprocess.CompletedProcess, list[C.Check]]:
    """Runs a `tp_check check ... --json out` command line as its own process, exactly as a user runs it: exit 0
    and no FAIL line; a stall past `timeout` seconds fails with the command's output so far. Returns the finished
    process and the checks it wrote."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=checkout_env())
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s; its output so far:\n{e.stdout or ''}\n{e.stderr or ''}")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, text
    return proc, [C.Check(**r) for r in json.loads(out.read_text())]


def _assert_all_pass(selected: list[C.Check], count: int) -> None:
    assert len(selected) == count, [c.name for c in selected]
    failed = [c.line() for c in selected if not c.passed]
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------------------------------ two ranks
# One test per spawned group (each spawn costs seconds; under pytest-xdist a fixture shared by several tests
# would be spawned once per worker).
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks(backend, tmp_path):
    """The full check suite on two ranks through the command line (T = 1 and 8, two steps each), run as its own
    process exactly as a user runs it; exit 0, and each family of checks ran as often as it should and passed.
    (In-process under pytest the NCCL case ran past 60 s on the two-H200 machine while the same command alone
    took 12 s; as a subprocess with a timeout, a stall now reports the command's own output so far.)"""
    device = "cpu" if backend == "gloo-cpu" else "cuda"
    out = tmp_path / "checks.json"
    cmd = [sys.executable, "-m", "tp_check", "check", "--device", device, "--tokens", "1,8", "--steps", "2",
           "--json", str(out)]
    _, checks = _run_check_command(cmd, out, tmp_path, timeout=300)
    _assert_all_pass(checks, 2 * (EXPECTED_PER_T["chain"](2) + EXPECTED_PER_T["finalize"]()))
    # Every rank ends each step bit-identical: T in {1, 8} x 2 steps x fold on/off, every site's prefix, output
    # and tap, the bank after every layer, the model output.
    _assert_all_pass(_select(checks, "ranks bit-identical", "step"), 8)
    assert all("2 ranks" in c.detail for c in _select(checks, "ranks bit-identical", "step"))
    # TP = 2 == TP = 1 on the summed partials, bitwise; every all-reduce within its bound.
    _assert_all_pass(_select(checks, "TP=2 == TP=1 on the summed partials (bitwise)"), 8)
    _assert_all_pass(_select(checks, "every all-reduce within"), 8)
    assert all(c.detail.endswith("all-reduces") for c in _select(checks, "every all-reduce within"))
    # The one-shot fused ops in the chain: same bits on every rank, == the torch.distributed chain bitwise.
    _assert_all_pass(_select(checks, "one-shot ops: every rank holds the same bits"), 8)
    fused = _select(checks, "one-shot fused ops == the torch.distributed path (bitwise)")
    _assert_all_pass(fused, 8)
    assert all("attention:fused" in c.detail and "moe_finalize:fused" in c.detail for c in fused)
    assert all("shared:fused" in c.detail for c in fused if "fold on" in c.name)
    # Fold on == fold off under TP, with the fold taken (the comparison is not vacuous).
    _assert_all_pass(_select(checks, "fold on == fold off under TP=2"), 4)
    assert all("fold taken at" in c.detail for c in _select(checks, "fold on == fold off under TP=2"))
    # The chain's MoE consumes the local-route finalize + all-reduce + latent norm.
    _assert_all_pass(_select(checks, "local-route finalize + all-reduce + latent norm"), 4)
    # The finalize under TP at its real shape on CUDA.
    for what in ("every route is local on exactly one rank", "ranks bit-identical after the all-reduce",
                 "TP=2 == the summed local-route partials (bitwise)", "latent (before the norm)",
                 "normed latent vs the TP=1 finalize"):
        _assert_all_pass(_select(checks, "finalize", what), 2)
    assert _select(checks, "finalize", f"D={3584 if device == 'cuda' else 256} k=16")
    # The split really changes the rounding (the tolerance is exercised, not idle).
    assert any(not c.detail.startswith("0 of") for c in _select(checks, "finalize", "latent (before the norm)"))


# ------------------------------------------------------------------------------------------ W ranks on one GPU
# (W, T values, steps, layers): the real width (H = 7168, latent 3584) on a short chain; few steps and small T,
# since each process's kernels get the GPU only in its time slices.
ONE_GPU_RUNS = [(2, "1,4", 2, 14), (4, "1", 1, 6)]


@pytest.mark.gpu
@pytest.mark.skipif(not ONE_GPU, reason=NO_ONE_GPU)
@pytest.mark.parametrize("W,tokens,steps,layers", ONE_GPU_RUNS, ids=[f"W{r[0]}" for r in ONE_GPU_RUNS])
def test_ranks_as_processes_on_one_gpu(W, tokens, steps, layers, tmp_path):
    """`python -m tp_check check --one-gpu`: W processes on cuda:0, gloo for torch.distributed, the one-shot
    ops through CUDA IPC. The same families of checks as on W GPUs pass: ranks bit-identical (torch.distributed
    path and one-shot ops), every all-reduce within its bound, at W = 2 TP == TP = 1 on the summed partials and
    the one-shot chain == the torch.distributed chain bitwise, at W = 4 the one-shot sites taken, fold on == fold
    off, the MoE's local-route finalize, the finalize under TP at the real latent shape."""
    out = tmp_path / "checks.json"
    cmd = [sys.executable, "-m", "tp_check", "check", "--one-gpu", "--device", "cuda", "--nproc", str(W),
           "--tokens", tokens, "--steps", str(steps), "--layers", str(layers), "--block", "4", "--json", str(out)]
    # Below the GPU suite's per-test limit (tools/gpu_check.sh: 180 s), so that a stall shows its output.
    proc, checks = _run_check_command(cmd, out, tmp_path, timeout=170)
    assert f"{W} ranks on gloo (every rank on cuda:0), H=7168" in proc.stdout, proc.stdout + proc.stderr
    n_t = len(tokens.split(","))
    _assert_all_pass(checks, n_t * (EXPECTED_PER_T["chain"](steps, W) + EXPECTED_PER_T["finalize"](W)))
    per_fold = n_t * steps * 2
    _assert_all_pass(_select(checks, "ranks bit-identical", "step"), per_fold)
    assert all(f"{W} ranks" in c.detail for c in _select(checks, "ranks bit-identical", "step"))
    _assert_all_pass(_select(checks, "every all-reduce within"), per_fold)
    _assert_all_pass(_select(checks, "one-shot ops: every rank holds the same bits"), per_fold)
    if W == 2:
        _assert_all_pass(_select(checks, "TP=2 == TP=1 on the summed partials (bitwise)"), per_fold)
        fused = _select(checks, "one-shot fused ops == the torch.distributed path (bitwise)")
    else:
        fused = _select(checks, "one-shot fused ops taken")
    _assert_all_pass(fused, per_fold)
    assert all("attention:fused" in c.detail and "moe_finalize:fused" in c.detail for c in fused)
    assert all("shared:fused" in c.detail for c in fused if "fold on" in c.name)
    folds = _select(checks, f"fold on == fold off under TP={W}")
    _assert_all_pass(folds, n_t * steps)
    assert all("fold taken at" in c.detail for c in folds)
    _assert_all_pass(_select(checks, "local-route finalize + all-reduce + latent norm"), 2 * n_t)
    _assert_all_pass(_select(checks, "finalize", "D=3584 k=16", "ranks bit-identical after the all-reduce"), n_t)


def test_one_gpu_flag_rejections(monkeypatch, capfd):
    """--one-gpu puts every rank on cuda:0: with --device cpu, or where cuda:0 cannot take the ranks, the
    command line refuses before spawning anything (exit 2, the reason on stderr)."""
    import tp_check.launch as L

    with pytest.raises(SystemExit) as e:
        main(["check", "--one-gpu", "--device", "cpu"])
    assert e.value.code == 2
    assert "--one-gpu: one GPU for every rank: device must be 'cuda' or 'auto', got 'cpu'" in capfd.readouterr().err
    monkeypatch.setattr(L, "cuda_ranks_available", lambda n: (False, "no CUDA device visible"))
    for device in ("cuda", "auto"):
        with pytest.raises(SystemExit) as e:
            main(["check", "--one-gpu", "--device", device, "--nproc", "2"])
        assert e.value.code == 2
        assert "--one-gpu: tp_check: one GPU for every rank: no CUDA device visible" in capfd.readouterr().err


def test_resolve_one_gpu_device(monkeypatch):
    import tp_check.launch as L

    asked = []
    monkeypatch.setattr(L, "cuda_ranks_available", lambda n: (asked.append(n), (True, ""))[1])
    assert L.resolve_one_gpu_device("cuda") == "cuda" and L.resolve_one_gpu_device("auto") == "cuda"
    assert asked == [1, 1]  # one GPU, whatever the world size
    for bad in ("cpu", "tpu"):
        with pytest.raises(ValueError, match="device must be 'cuda' or 'auto'"):
            L.resolve_one_gpu_device(bad)
    monkeypatch.setattr(L, "cuda_ranks_available", lambda n: (False, "attnres was built without the CUDA backend"))
    with pytest.raises(RuntimeError, match="one GPU for every rank: attnres was built without the CUDA backend"):
        L.resolve_one_gpu_device("cuda")


def test_one_gpu_option_defaults_off_and_reaches_init(monkeypatch):
    """The rank entry point passes the option to init (the default is the per-GPU / CPU group)."""
    import tp_check.cli as cli

    assert default_opts()["one_gpu"] is False
    seen = []

    class Stop(Exception):
        pass

    def fake_init(device, *, one_gpu=False):
        seen.append((device, one_gpu))
        raise Stop

    monkeypatch.setattr(cli, "init", fake_init)
    monkeypatch.setattr(cli, "shutdown", lambda: None)
    for one_gpu in (False, True):
        with pytest.raises(Stop):
            check_rank_variants(default_opts(device="cuda", one_gpu=one_gpu), [{}])
    assert seen == [("cuda", False), ("cuda", True)]


# ------------------------------------------------------------------------------------------ the checks' teeth
MUTATION_FAILS = {
    # mutation: the checks that must fail (name fragments)
    "skip_all_reduce": ["ranks bit-identical", "TP=2 == TP=1 on the summed partials", "local-route finalize",
                        "every all-reduce within", "finalize T=1 D=256 k=16 E=64: ranks bit-identical",
                        "latent (before the norm)"],
    "norm_before_all_reduce": ["TP=2 == TP=1 on the summed partials", "local-route finalize"],
    "fold_off_sums_partials": ["fold off: TP=2 == TP=1", "fold on == fold off"],
    "rank_dependent_output": ["fold on: ranks bit-identical", "fold on == fold off"],
}


def test_each_fault_fails_the_checks():
    names = list(MUTATION_FAILS)
    results = _run("cpu", variants=[{"mutation": m} for m in names], tokens=(1,), steps=1, layers=8)
    for mutation, checks in zip(names, results, strict=True):
        failed = [c.name for c in checks if not c.passed]
        for fragment in MUTATION_FAILS[mutation]:
            assert any(fragment in name for name in failed), (mutation, fragment, failed)


def test_three_ranks():
    """W = 3: the all-reduce's order is the library's. Ranks still agree bitwise and fold on == off bitwise;
    every all-reduce is within its bound of the exact sum; the finalize within its bound of TP = 1."""
    checks = _run("cpu", nprocs=3, tokens=(4,), steps=1, layers=6)[0]
    _assert_all_pass(checks, EXPECTED_PER_T["chain"](1, 3) + EXPECTED_PER_T["finalize"](3))
    assert "3 ranks" in _select(checks, "ranks bit-identical")[0].detail
    assert _select(checks, "3 ranks' partials") and not _select(checks, "bitwise", "summed")
    _assert_all_pass(_select(checks, "one-shot fused ops decline (world size)"), 2)


# ------------------------------------------------------------------------------------------ the command line
def test_command_line_exits_non_zero_on_a_failed_check(capfd):
    rc = main(["check", "--device", "cpu", "--tokens", "1", "--steps", "1", "--layers", "6", "--no-finalize",
               "--mutation", "rank_dependent_output"])
    text = capfd.readouterr().out
    assert rc == 1 and "FAIL  T=1 step 0 fold on: ranks bit-identical" in text


@pytest.mark.parametrize("bad", [["check", "--tokens", "0"], ["check", "--tokens", "a"], ["check", "--steps", "0"],
                                 ["check", "--mutation", "nope"], []])
def test_command_line_rejects(bad):
    with pytest.raises(SystemExit) as e:
        main(bad)
    assert e.value.code == 2


# ------------------------------------------------------------------------------------------ one process
SMALL = KimiK3Config.small(hidden_size=256, num_layers=10, snapshot_block=4)


def test_shards_reject_malformed_groups():
    for kw in (dict(world_size=0), dict(world_size=2, ranks=(2,), all_reduce=lambda t: t),
               dict(world_size=2, ranks=(0, 0)), dict(world_size=2, ranks=()), dict(world_size=2, ranks=(1,))):
        with pytest.raises(ValueError):
            Shards(**kw)


@pytest.mark.parametrize("size,world", [(64, 2), (7, 3), (5, 5), (896, 8)])
def test_shard_range_partitions(size, world):
    parts = [shard_range(size, world, r) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(size))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        shard_range(size, world, world)


def test_partials_are_real_shares_of_the_total():
    """Each rank's partial is a genuine share (non-zero, not the total), and the summed stand-in is their sum."""
    pool_model = tensor_parallel_model(SMALL, Shards.summed(2))
    x = pool_model.embed(4, step=1)
    for sub in (pool_model.layers[0].attention, pool_model.layers[0].mlp, pool_model.layers[3].attention,
                pool_model.layers[2].mlp.shared_expert):
        assert isinstance(sub, (TPAttention, TPDenseMLP)) or hasattr(sub, "partial")
        p0, p1 = sub.partials(x)
        total = sub(x)
        assert torch.equal(total, p0 + p1)
        assert p0.abs().sum() > 0 and p1.abs().sum() > 0
        assert not torch.equal(total, p0) and not torch.equal(total, p1)
        assert 0.05 < p0.float().std() / total.float().std() < 2


def test_world_one_is_the_whole_projection():
    """Shards() (world 1) computes the whole projection; summed(2) the same total up to the split's rounding."""
    one = tensor_parallel_model(SMALL, Shards())
    two = tensor_parallel_model(SMALL, Shards.summed(2))
    x = one.embed(4, step=2)
    a, b = one.layers[1].attention(x).float(), two.layers[1].attention(x).float()
    assert not torch.equal(a, b)  # two roundings (per partial, then the sum) instead of one
    assert (a - b).abs().max() <= 4 * 2 ** -8 * a.abs().max()


def test_summed_model_fold_on_equals_off_in_one_process():
    model = tensor_parallel_model(SMALL, Shards.summed(2))
    x = model.embed(8, step=3)
    runs = {}
    for fold in (False, True):
        model.settings = ResidualSettings(fold=fold)
        model.paths.clear()
        trace = ChainTrace()
        runs[fold] = (model(x, bank=model.allocate_bank(8, fill=-3.0), trace=trace), trace)
        folded = len(model.paths.select(path=FUSED_ADD2))
    assert folded == SMALL.num_layers - 1
    assert not compare_traces(runs[False][1], runs[True][1]) + compare_outputs(runs[False][0], runs[True][0])


def test_moe_parts_are_reduced_and_finalize_pieces_split_the_routes():
    moe = tensor_parallel_model(SMALL, Shards.summed(2)).layers[2].mlp
    assert isinstance(moe, TPMoE) and moe.D == latent_width(SMALL) == 128
    y = torch.randn(6, SMALL.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    routed, shared = moe(y, return_parts=True)
    assert torch.equal(moe(y), routed + shared)
    assert torch.equal(shared, moe.shared_expert.partial(y, 0) + moe.shared_expert.partial(y, 1))
    local = [moe.local_pieces(y, r) for r in (0, 1)]
    owned = (local[0].index >= 0).int() + (local[1].index >= 0).int()
    assert bool((owned == 1).all())
    whole = moe.all_pieces(y)
    assert bool((whole.index >= 0).all())


def test_permuted_rows_pad_with_nan_and_mark_remote_routes():
    cfg = SMALL
    rnd = _LayerRandom(cfg, 5, role=99, device="cpu")
    experts = StandInRoutedExperts(64, 8, 3, 32, rnd)
    z = torch.randn(5, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).float()
    weights, ids = experts.route(z)
    owned = experts.owned(1, 2)
    p = experts.pieces(z, weights, ids, owned)
    assert owned == range(4, 8)
    local = torch.tensor([[int(e) in owned for e in row] for row in ids])
    assert torch.equal(p.index >= 0, local)
    named = torch.zeros(p.rows.shape[0], dtype=torch.bool)
    named[p.index[p.index >= 0].long()] = True
    assert torch.isnan(p.rows[~named].float()).all() and not torch.isnan(p.rows[named].float()).any()
    for t, j in (p.index >= 0).nonzero().tolist():
        e = int(ids[t, j])
        want = torch.nn.functional.silu(z[t] * experts.scale[e] + experts.bias[e]).to(torch.bfloat16)
        assert torch.equal(p.rows[p.index[t, j]], want)
    rows, index = permuted_rows(lambda e, t: torch.ones(len(t), 8, dtype=torch.bfloat16), 2,
                                torch.tensor([[0, 1], [1, 0]], dtype=torch.int32), range(1, 2), 8, "cpu", align=4)
    assert index.tolist() == [[-1, 0], [1, -1]] and rows.shape == (8, 8)


def test_tp_stand_ins_need_enough_width_and_experts():
    with pytest.raises(ValueError, match="stand-in width"):
        tensor_parallel_model(SMALL.with_(standin_rank=2), Shards.summed(3))
    with pytest.raises(ValueError, match="experts cannot be split"):
        tensor_parallel_model(SMALL.with_(standin_experts=2, standin_top_k=1), Shards.summed(3))


# ------------------------------------------------------------------------------------------ the launcher
def test_forbid_multicast_sets_and_overrides(capfd):
    env = {"NCCL_NVLS_ENABLE": "1", "OTHER": "x"}
    overridden = forbid_multicast(env)
    assert overridden == ["NCCL_NVLS_ENABLE=1"]
    assert {k: env[k] for k in NO_MULTICAST_ENV} == NO_MULTICAST_ENV and env["OTHER"] == "x"
    assert "NCCL_NVLS_ENABLE=1" in capfd.readouterr().err
    assert forbid_multicast(env) == []


def test_spawned_ranks_see_torchrun_variables_and_no_multicast():
    envs = launch(_rank_env, 2)
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert all(e[k] == v for e in envs for k, v in NO_MULTICAST_ENV.items())
    assert not under_torchrun({"RANK": "0"}) and under_torchrun({k: "0" for k in
                                                                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT")})


def _rank_env() -> dict:
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", *NO_MULTICAST_ENV)}


def test_resolve_device():
    assert resolve_device("cpu", 2) == "cpu"
    assert resolve_device("auto", 2) == ("cuda" if TWO_GPUS else "cpu")
    with pytest.raises(ValueError):
        resolve_device("tpu", 2)
    if not TWO_GPUS:
        with pytest.raises(RuntimeError, match="device 'cuda'"):
            resolve_device("cuda", 2)


# ------------------------------------------------------------------------------------------ the benchmark
def test_bench_tp_on_cpu_runs_the_chain_and_its_checks(tmp_path, capfd):
    """`python -m bench tp --device cpu`: two gloo ranks, the five step variants, the checks (fold on ==
    off, fed chain == the TP model's eager step, ranks identical, latents), a JSON results file."""
    from bench.cli import main as bench_main

    out = tmp_path / "tp.json"
    rc = bench_main(["tp", "--device", "cpu", "--tokens", "2", "--repeats", "2", "--layers", "6", "--out", str(out)])
    text = capfd.readouterr().out
    assert rc == 0, text
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["backend"] == "gloo"
    assert {k: data["meta"]["env"][k] for k in NO_MULTICAST_ENV} == NO_MULTICAST_ENV
    chain = {r["provider"]: r for r in data["records"] if r["kind"] == "chain"}
    assert set(chain) == {"tp_chain/fold_on", "tp_chain/fold_off", "tp_chain_no_comm/fold_on",
                          "tp_chain_no_comm/fold_off", "tp_comm_only"}
    on = chain["tp_chain/fold_on"]
    assert on["fold_bitwise_equal"] and on["equals_model"] and on["ranks_identical"] and on["latents_equal"]
    assert on["all_reduces_per_step"] == 2 + 3 * 5 and on["layers"] == 6 and len(on["rank_medians_us"]) == 2
    assert on["comm_us"] == on["median_us"] - chain["tp_chain_no_comm/fold_on"]["median_us"]
    ar = [r for r in data["records"] if r["kind"] == "all_reduce"]
    assert [r["provider"] for r in ar] == ["gloo_all_reduce"] and ar[0]["bytes"] == 2 * on["H"] * 2
    assert "tp T=2 x2" in text and "fold bitwise equal" in text


def test_bench_tp_latencies_only_skips_the_chain(tmp_path, capfd):
    """`--latencies-only`: the all-reduce sweep alone (how gpu_check.sh runs --symm-mem, in a process of its own)."""
    from bench.cli import main as bench_main

    out = tmp_path / "tp_lat.json"
    rc = bench_main(["tp", "--device", "cpu", "--tokens", "2", "--repeats", "2", "--layers", "6", "--latencies-only",
                     "--out", str(out)])
    text = capfd.readouterr().out
    assert rc == 0, text
    records = json.loads(out.read_text())["records"]
    assert records and {r["kind"] for r in records} == {"all_reduce"}, records
    assert "tp chain" not in text


def test_bench_tp_latency_flags_exclude_each_other():
    from bench.cli import main as bench_main

    with pytest.raises(SystemExit, match="exclude each other"):
        bench_main(["tp", "--device", "cpu", "--no-latencies", "--latencies-only"])


def test_bench_tp_reports_a_failed_check():
    from bench.tp import failed_checks

    good = {"kind": "chain", "provider": "tp_chain/fold_on", "T": 1, "fold_bitwise_equal": True, "equals_model": True,
            "ranks_identical": True, "latents_equal": True}
    assert failed_checks([good]) == []
    for key in ("fold_bitwise_equal", "equals_model", "ranks_identical", "latents_equal"):
        assert key in failed_checks([{**good, key: False}])[0]


def test_bench_tp_needs_two_ranks():
    from bench.cli import main as bench_main

    with pytest.raises(SystemExit) as e:
        bench_main(["tp", "--device", "cpu", "--nproc", "1"])
    assert e.value.code == 2


# ------------------------------------------------------------------------------------------ the one-shot gate
def test_fused_all_reduce_gate_reasons_and_knob(monkeypatch):
    """Which communicator a TP site gets, and why not: the knob, the world size, T, width, dtype, device, a
    closed communicator; the knob's default is ATTNRES_FUSED_ALL_REDUCE."""
    from attnres import knobs
    from attnres.all_reduce import record_all_reduce_decisions
    from attnres.models.kimi_k3.residual import PendingPartial
    from attnres.models.kimi_k3.tp import FusedAllReduce
    from attnres.comm import InProcessWorld

    world = InProcessWorld(2, 4, 16)
    comm = world.comms[0]
    fused = FusedAllReduce(hidden=comm, enabled=True)
    t = torch.zeros(2, 16, dtype=torch.bfloat16)
    assert fused.communicator(t, 2) == (comm, "")
    assert "ATTNRES_FUSED_ALL_REDUCE=0" in FusedAllReduce(hidden=comm, enabled=False).communicator(t, 2)[1]
    assert "latent" in fused.communicator(t, 2, latent=True)[1]
    assert "world size 3" in fused.communicator(t, 3)[1]
    assert "capacity 4" in fused.communicator(torch.zeros(5, 16, dtype=torch.bfloat16), 2)[1]
    assert "width 16" in fused.communicator(torch.zeros(2, 24, dtype=torch.bfloat16), 2)[1]
    assert "float32" in fused.communicator(t.float(), 2)[1]
    for on in (True, False):
        monkeypatch.setattr(knobs, "CURRENT", replace(knobs.CURRENT, fused_all_reduce=on))
        assert FusedAllReduce(hidden=comm).enabled is on

    # Knob off: the chain's reductions take the torch.distributed hook, each recorded with the reason.
    calls = []

    def hook(x):
        calls.append(x)
        return x + x

    shards = Shards.of_rank(0, 2, hook, FusedAllReduce(hidden=comm, enabled=False))
    with record_all_reduce_decisions() as seen:
        out = shards.defer([t + 1], "attention")
    assert torch.equal(out, (t + 1) * 2) and len(calls) == 1
    assert [(d.site, d.path, d.reason) for d in seen] == [("attention", "fallback", "ATTNRES_FUSED_ALL_REDUCE=0")]
    # Knob on: the partial is left for its consumer; reducing it instead goes through the one-shot all-reduce.
    shards = Shards.of_rank(0, 2, hook, FusedAllReduce(hidden=comm, enabled=True))
    pending = shards.defer([t + 1], "attention")
    assert isinstance(pending, PendingPartial) and pending.comm is comm and torch.equal(pending.partial, t + 1)
    with record_all_reduce_decisions() as seen:
        pending.fused()
    assert [(d.site, d.path, d.tokens, d.world_size) for d in seen] == [("attention", "fused", 2, 2)]
    world.close()
    assert "closed" in fused.communicator(t, 2)[1]
