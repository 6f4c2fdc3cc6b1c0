"""The single-GPU all-reduce benchmark (python -m bench allreduce): on the CPU its records, the
fused-vs-unfused bitwise check (with teeth), the summary table and the CLI, which refuses cleanly without a GPU;
on the GPU (the `gpu` marker) one quick point of every site under graph replay."""

from __future__ import annotations

import json

import pytest
import torch

from bench import allreduce
from bench.cli import main as bench_main

from conftest import HAS_CUDA, requires_cuda

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# Providers per point: every site has every provider.
PER_T = len(allreduce.PROVIDERS) * len(allreduce.SITES)


@pytest.fixture(scope="module")
def cpu_records():
    return allreduce.run(tokens=(1, 2), device="cpu", repeats=1)


def test_cpu_records_cover_every_site_token_and_provider(cpu_records):
    keys = sorted((r["site"], r["T"], r["provider"]) for r in cpu_records)
    assert keys == sorted((s, T, p) for s in allreduce.SITES for T in (1, 2) for p in allreduce.PROVIDERS)
    for r in cpu_records:
        assert r["suite"] == "allreduce" and r["W"] == 2 and r["device"] == "cpu"
        assert r["graph"] is False and r["lower_bound"] is False and r["timer"] == allreduce.TIMER_CPU
        assert r["bitwise_equal"] is True
        assert r["median_us"] > 0 and r["p10_us"] <= r["p90_us"]
        shape = ("D", "k") if r["site"] == "moe_finalize" else ("H", "N")
        assert all(key in r for key in shape)


def test_bitwise_check_has_teeth(monkeypatch):
    """A fused op whose output differs by one ulp on one rank: the point's bitwise_equal is False."""
    original = allreduce.all_reduce_attn_res_add_rmsnorm

    def off_by_one(comm, *args, **kwargs):
        reduced, updated, output = original(comm, *args, **kwargs)
        if comm.rank == 1:
            output = output.clone()
            output.view(torch.int16).view(-1)[0] += 1
        return reduced, updated, output

    monkeypatch.setattr(allreduce, "all_reduce_attn_res_add_rmsnorm", off_by_one)
    records = allreduce.run(tokens=(1,), device="cpu", repeats=1, sites=("add",))
    assert {r["bitwise_equal"] for r in records} == {False}


def test_moe_finalize_runs_at_its_own_tokens():
    """The MoE finalize's points (its token gate's A/B) need not be the sites' T."""
    records = allreduce.run(tokens=(1,), moe_tokens=(2, 3), device="cpu", repeats=1)
    points = sorted({(r["site"], r["T"]) for r in records})
    assert points == [("add", 1), ("add2", 1), ("moe_finalize", 2), ("moe_finalize", 3)]
    assert all(r["bitwise_equal"] for r in records)


def test_a_stalled_point_names_itself(monkeypatch):
    """A point whose exchange stalls (CommunicatorError from world.check) fails the run naming the point."""
    from attnres.comm import CommunicatorError

    def stalled(site, T, world, *args):
        raise CommunicatorError("rank 0 timed out")

    monkeypatch.setattr(allreduce, "_point", stalled)
    with pytest.raises(CommunicatorError, match="allreduce add T=1: the one-GPU world's exchange stalled"):
        allreduce.run(tokens=(1,), device="cpu", repeats=1, sites=("add",))


def test_summary_table(cpu_records):
    lines = allreduce.summary(cpu_records)
    assert allreduce.CPU_NOTE in lines[0] and "fused-plain" in lines[1]
    assert len(lines) == 2 + len(allreduce.SITES) * 2
    assert all(line.endswith("equal") for line in lines[2:])
    assert allreduce.summary([]) == []


def test_run_rejects_bad_arguments():
    with pytest.raises(ValueError, match="device"):
        allreduce.run(device="tpu")
    with pytest.raises(ValueError, match="repeats"):
        allreduce.run(device="cpu", repeats=0)
    with pytest.raises(ValueError, match="tokens"):
        allreduce.run(device="cpu", tokens=(0,))
    with pytest.raises(ValueError, match="moe_tokens"):
        allreduce.run(device="cpu", tokens=(1,), moe_tokens=())
    if HAS_CUDA:
        with pytest.raises(ValueError, match="T <= 32 on one GPU"):
            allreduce.run(device="cuda", tokens=(1,), moe_tokens=(64,))
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            allreduce.run(device="cuda")


def test_cli_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "ar.json"
    code = bench_main(["allreduce", "--device", "cpu", "--tokens", "1", "--repeats", "1", "--commit", "test",
                       "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["commit"] == "test"
    assert data["note"] == allreduce.CPU_NOTE
    assert len(data["records"]) == PER_T
    assert "not a measurement" in capsys.readouterr().out


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal without a GPU")
def test_cli_refuses_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "ar.json"
    assert bench_main(["allreduce", "--out", str(out)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


@requires_cuda
@pytest.mark.gpu
def test_gpu_quick_point_under_graph_replay():
    """Every site under per-rank graph replay (a graph per rank on the rank's stream); a long replay stays
    live: the exchange never waits out its bound (world.check inside run raises if it did)."""
    records = allreduce.run(tokens=(1, 4), device="cuda", repeats=3)
    assert len(records) == 2 * PER_T
    for r in records:
        assert r["graph"] is True and r["lower_bound"] is True and r["world"] == "in_process_one_gpu"
        assert r["bitwise_equal"] is True, r
        assert r["sets"] >= 8 and 0 < r["median_us"] < 1000
    assert allreduce.LOWER_BOUND in allreduce.summary(records)[0]
