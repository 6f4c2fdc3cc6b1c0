"""The prefill grid benchmark (python -m bench prefill) without a GPU: its points, the bytes each op must move,
the default plan of its calls on the described GPUs, its readers of records (summary, target) and its command
line."""

from __future__ import annotations

import pytest
import torch

from bench import prefill
from bench.cli import main as bench_main
from bench.targets import targets


def test_points():
    full = prefill.points()
    assert len(full) == 4 * 3 * 16 and full[0] == ("mix", 1024, 1) and full[-1] == ("add2", 16384, 16)
    assert prefill.points(quick=True) == [(op, 4096, N) for op in prefill.OPS for N in (1, 2, 5, 9, 12, 16)]
    assert prefill.points(tokens=(256,), candidates=(3,)) == [(op, 256, 3) for op in prefill.OPS]
    assert prefill.points(tokens=(256, 1024), candidates=(3,), ops=("add2",)) == [("add2", 256, 3), ("add2", 1024, 3)]


def test_bytes_per_op():
    row, T, N, H = 2 * 7168, 10, 5, 7168
    assert prefill.op_bytes("mix", T, N, H) == T * row * (N + 1) + 2 * row
    assert prefill.op_bytes("norm", T, N, H) == T * row * (N + 1) + 3 * row
    assert prefill.op_bytes("add", T, N, H) == T * row * (N + 1 + 2) + 3 * row
    assert prefill.op_bytes("add2", T, N, H) == T * row * (N + 2 + 2) + 3 * row
    assert prefill.op_bytes("norm", T, 1, H) == T * row * 2 + 3 * row  # N = 1: the prefix read, the output written


@pytest.mark.parametrize("device", ["h100", "h200"])
def test_every_point_has_a_plan(device):
    """The grid's calls are all accepted by the default options (what the suite times)."""
    for op, T, N in prefill.points():
        p = prefill.plan(op, T, N, 7168, device=device)
        assert p.accepted and p.kernel in ("single_cta", "split_k", "persistent"), (op, T, N, p)


def _rec(op: str, T: int, N: int, pct: float, us: float = 100.0, provider: str = "attnres/default") -> dict:
    return {"suite": "prefill", "provider": provider, "op": op, "T": T, "N": N, "H": 7168, "copy_tbs": 3.0,
            "pct_copy": pct, "median_us": us, "kernel": "split_k", "route": "per_token"}


def test_forced_providers():
    """--forced: every kernel the plan accepts for the call when forced (single_cta only up to N = 4; the
    persistent kernel with two addends too)."""
    assert list(prefill.providers("add2", 4096, 9, 7168, False, device="h100")) == ["attnres/default"]
    assert list(prefill.providers("norm", 4096, 3, 7168, True, device="h100")) == [
        "attnres/default", "attnres/split_k", "attnres/single_cta", "attnres/persistent"]
    assert list(prefill.providers("add2", 4096, 9, 7168, True, device="h100")) == [
        "attnres/default", "attnres/split_k", "attnres/persistent"]


def test_forced_kernels_in_the_readers():
    """The target reads the default alone; the summary names a forced kernel faster than the default by > 3 %."""
    records = [_rec("add", 4096, 9, 85.0, 269.0), _rec("add", 4096, 9, 70.0, 330.0, "attnres/split_k"),
               _rec("add", 4096, 9, 95.0, 240.0, "attnres/persistent"), _rec("add", 4096, 2, 91.0, 80.0),
               _rec("add", 4096, 2, 90.0, 79.0, "attnres/split_k")]
    assert prefill.target(records)[2].startswith("1 of 2 points; lowest 85.0% at add T=4096 N=9")
    assert prefill.fastest_forced(records)[("add", 4096, 9)]["provider"] == "attnres/persistent"
    lines = prefill.summary(records)
    assert any(line.startswith("   9") and "(persistent 1.12)" in line for line in lines)
    assert any(line.startswith("   2") and "(split_k" not in line for line in lines)


def test_readers():
    records = [_rec("norm", 1024, 1, 79.0, 13.7), _rec("norm", 4096, 1, 92.0), _rec("add2", 4096, 9, 95.0),
               _rec("norm", 256, 5, 50.0)]  # T = 256 is outside the target
    row = prefill.target(records)
    assert row[0] == "prefill" and row[3] is False
    assert row[2] == "2 of 3 points; lowest 79.0% at norm T=1024 N=1 (split_k, 13.7 us)"
    assert prefill.target([_rec("mix", 4096, 2, 90.0)])[3] is True
    # With the same-bytes copy: reported beside the target, which stays the copy rate's.
    same = [dict(_rec("norm", 1024, 1, 79.0, 13.7), pct_copy_same=93.0), dict(_rec("add", 1024, 2, 91.0), pct_copy_same=85.0)]
    row = prefill.target(same)
    assert row[3] is False and row[2].endswith("; against a copy of the same bytes: 1 of 2, lowest 85.0% at add T=1024 N=2")
    assert prefill.target([_rec("mix", 256, 2, 10.0)]) is None
    assert any(r[0] == "prefill" for r in targets(records))
    lines = prefill.summary(records)
    assert lines[0].startswith("prefill grid: the default options") and "3.00 TB/s" in lines[0]
    assert "norm (attn_res_rmsnorm, 0 addends)" in lines and "add2 (attn_res_add_rmsnorm, 2 addends)" in lines
    assert any("13.7 (79%<) split_k" in line for line in lines)
    assert prefill.summary([]) == []


def test_cli(capsys):
    for argv, message in ((["prefill", "--candidates", "17"], "prefill: --candidates must be <= 16"),
                          (["prefill", "--candidates", "0"], "--candidates must be"),
                          (["topology", "--forced"], "--forced applies to the prefill suite only"),
                          (["topology", "--ops", "add2"], "--ops applies to the prefill and stream suites only"),
                          (["prefill", "--ops", "add,add3"], "--ops must be a comma-separated subset"),
                          (["prefill", "--ops", ""], "--ops must be a comma-separated subset"),
                          (["tune", "--candidates", "2"],
                           "--candidates applies to persistent --variants, prefill and stream")):
        with pytest.raises(SystemExit) as exc:
            bench_main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    if not torch.cuda.is_available():
        assert bench_main(["prefill", "--quick"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_suite_runs_on_the_cpu_backend(monkeypatch):
    """The suite's own code end to end without a GPU: CPU inputs, graphs replaced by eager calls of every op, the
    plans of a described H200, a fake timer."""
    from attnres.bench import timing, workloads

    captured = []
    monkeypatch.setattr(prefill, "make_sets", lambda *a, **k: workloads.make_sets(*a, **k, device="cpu"))
    monkeypatch.setattr(prefill, "rotating_sets", lambda nbytes, minimum: 2)  # (the L2 size needs a GPU)
    monkeypatch.setattr(prefill, "calls_per_graph", lambda sets, nbytes: 3)
    monkeypatch.setattr(prefill, "capture", lambda fns: captured.append([fn() for fn in fns]))
    monkeypatch.setattr(prefill, "time_interleaved", lambda graphs, repeats: {
        name: timing.Timing(median_us=10.0, p10_us=9.0, p90_us=12.0, min_us=9.0, calls=n, repeats=repeats)
        for name, (_, n) in graphs.items()})
    plan = prefill.plan
    monkeypatch.setattr(prefill, "plan", lambda op, T, N, H, device="cuda", options=None:
                        plan(op, T, N, H, "h200", options))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    recs = prefill.run(H=64, copy_tbs=4.0, repeats=3, tokens=(5,), candidates=(1, 3))
    assert [(r["op"], r["N"]) for r in recs] == [(op, N) for op in prefill.OPS for N in (1, 3)]
    # Per point the op's graph, then the same-bytes copies' (a read and a write of bytes / 2 each).
    assert len(captured) == 16 and all(len(calls) == 3 for calls in captured)
    copies, captured = captured[1::2], captured[0::2]
    assert all(tuple(c.shape) == (prefill.op_bytes(op, 5, N, 64) // 4,) and c.dtype == torch.bfloat16
               for (op, N), calls in zip([(op, N) for op in prefill.OPS for N in (1, 3)], copies) for c in calls)
    # Each op's calls ran on the CPU backend and returned its outputs: the mixture alone for attn_res without the
    # diagnostics, the output for attn_res_rmsnorm, (updated, output) with an addend.
    shapes = [[tuple(t.shape) for t in (c if isinstance(c, tuple) else (c,))] for c in (calls[0] for calls in captured)]
    assert shapes[0] == [(5, 64)] and shapes[2] == [(5, 64)] and shapes[4] == shapes[6] == [(5, 64), (5, 64)]
    r = recs[0]
    assert r["bytes"] == prefill.op_bytes("mix", 5, 1, 64) and r["gbps"] == pytest.approx(r["bytes"] / 10e-6 / 1e9)
    assert r["pct_copy"] == pytest.approx(100 * r["gbps"] / 4000.0) and r["kernel"] == "split_k"
    assert r["copy_same_us"] == 10.0 and r["pct_copy_same"] == pytest.approx(100.0)
    assert prefill.target(recs) is None  # T = 5 lies outside the target


def test_persistent_from_reads_the_rule_of_the_two_addend_table():
    """persistent_from on synthetic records: the threshold holds at every larger T, and the margin is strict."""
    def forced(N, T, persistent, split_k):
        return [_rec("add2", T, N, 90.0, persistent, "attnres/persistent"),
                _rec("add2", T, N, 90.0, split_k, "attnres/split_k"), _rec("add2", T, N, 90.0, split_k)]
    records = (forced(5, 256, 9.0, 10.0) + forced(5, 1024, 30.0, 40.0) + forced(6, 256, 9.0, 10.0)
               + forced(6, 1024, 39.0, 40.0) + forced(7, 256, 11.0, 10.0) + forced(7, 1024, 38.0, 40.0)
               + [_rec("add", 256, 5, 90.0, 1.0, "attnres/persistent")])  # another op, no other kernel
    assert prefill.persistent_from(records, "add2") == {5: 256, 6: None, 7: 1024}
    assert prefill.persistent_from(records, "add") == {}
    assert any("N=5: 256, N=6: -, N=7: 1024" in line for line in prefill.summary(records))


@pytest.mark.parametrize("op", ["mix", "add", "add2"])
def test_the_h100_table_follows_its_grid(op):
    """The H100's shipped thresholds are the rule applied to the grids committed for them: the --forced run against
    split_k's exact-N instances at N = 5..8 (h100_924fd69_forced58.json), where the persistent kernel had won
    against the bucket's split_k; at every measured (T, N) the default plan of a described H100 takes the persistent
    kernel exactly where the rule says (never). With two addends, the older grid's other N too (it lost there to
    the bucket's split_k already)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "bench_results"
    records = json.loads((results / "h100_924fd69_forced58.json").read_text())["records"]
    start = prefill.persistent_from(records, op)
    assert sorted(start) == [5, 6, 7, 8]
    if op == "add2":
        older = json.loads((results / "h100_5a85df6_add2_grid.json").read_text())["records"]
        start = prefill.persistent_from(older, op) | start
        assert sorted(start) == list(range(1, 17))
        records = older + records
    for N, T0 in start.items():
        for T in sorted({r["T"] for r in records if r["N"] == N}):
            kernel = prefill.plan(op, T, N, 7168, device="h100").kernel
            assert (kernel == "persistent") == (T0 is not None and T >= T0), (N, T, kernel, T0)
