"""The peers suite's code that runs without a GPU (bench/peers.py): its points (the kernels issue's
table and the persistent range), the warm regime's set count, the providers a point is timed on, the comparison
with the peers' figures and the target read from records, the summary, and the CLI."""

from __future__ import annotations

import pytest

from bench import peers
from bench.targets import targets
from cli_checks import assert_bench_suite_cli

ISSUE_POINTS = {(1, 1), (1, 2), (1, 5), (1, 9), (1, 12), (8, 9), (32, 9), (128, 9), (1024, 9), (4096, 2), (4096, 9)}


def test_points_are_the_issue_table_and_the_persistent_range():
    pts = peers.points()
    assert set(peers.PEERS) == ISSUE_POINTS
    assert set(pts) == ISSUE_POINTS | {(T, N) for T in (1024, 4096, 16384) for N in (2, 9, 12)}
    assert len(pts) == len(set(pts)) == 17 and pts == sorted(pts)
    quick = peers.points(quick=True)
    assert set(quick) < set(pts) and set(quick) <= ISSUE_POINTS
    # Every peer figure beats vLLM's or is vLLM's own.
    assert all(p.best_us <= p.vllm_us for p in peers.PEERS.values())


def test_warm_sets_fit_in_half_the_l2():
    l2 = 60 * 2**20
    assert peers.warm_sets(1000, l2) == 8  # capped
    assert peers.warm_sets(l2 // 2 // 3, l2) == 3
    assert peers.warm_sets(l2 // 2, l2) == 1
    assert peers.warm_sets(l2 // 2 + 1, l2) == 0  # no warm regime: one set alone is more than half the L2
    # T = 128, N = 9 has a warm regime on an H200-size L2, T = 1024 does not.
    assert peers.warm_sets(peers.op_bytes(128, 9, 7168, True), l2) >= 1
    assert peers.warm_sets(peers.op_bytes(1024, 9, 7168, True), l2) == 0


def test_providers_are_the_kernels_the_plan_accepts():
    got = {pt: list(peers._providers(*pt, 7168, device="h200")) for pt in [(1, 1), (1, 9), (4096, 2), (16384, 12)]}
    assert got[(1, 1)] == ["attnres/default", "attnres/split_k", "attnres/single_cta", "attnres/persistent"]
    assert got[(1, 9)] == ["attnres/default", "attnres/split_k", "attnres/persistent"]  # single_cta: N <= 4
    assert got[(4096, 2)] == got[(1, 1)]
    assert got[(16384, 12)] == got[(1, 9)]
    # The op without an addend (the topology suite's --no-add) is asked about as itself: the persistent kernel
    # runs it (no snapshot write), single_cta up to N = 4.
    assert list(peers._providers(4096, 5, 7168, device="h200", add=False)) == got[(1, 9)]
    assert list(peers._providers(256, 1, 7168, device="h200", add=False)) == got[(1, 1)]


def _rec(T, N, us, provider="attnres/default", regime="warm", kernel="split_k"):
    peer = peers.PEERS.get((T, N))
    return {"suite": "peers", "provider": provider, "regime": regime, "T": T, "N": N, "H": 7168,
            "median_us": us, "p10_us": us, "p90_us": us, "pct_copy": 50.0, "default_kernel": kernel,
            "peer_best_us": peer.best_us if peer else None, "peer_best": peer.best if peer else None,
            "peer_vllm_us": peer.vllm_us if peer else None}


def test_comparison_takes_the_default_warm_figure_else_cold():
    recs = [_rec(1, 9, 2.0), _rec(1, 9, 3.0, regime="cold"), _rec(1, 9, 1.0, provider="attnres/split_k"),
            _rec(4096, 2, 90.0, regime="cold", kernel="single_cta"),  # no warm regime there
            _rec(16384, 9, 900.0, regime="cold"),  # no peer figure: not compared
            {"suite": "decode", "provider": "attnres/add", "T": 1, "N": 9}]
    rows = peers.comparison(recs)
    assert [(r["T"], r["N"], r["regime"], r["ours_us"]) for r in rows] == [(1, 9, "warm", 2.0), (4096, 2, "cold", 90.0)]
    assert rows[0]["ratio"] == pytest.approx(2.0 / 6.38) and rows[1]["ratio"] == pytest.approx(90.0 / 79.5)
    assert rows[1]["kernel"] == "single_cta" and rows[1]["peer"].startswith("FlagGems")


def test_target_is_met_only_when_ahead_everywhere():
    ahead = [_rec(1, 9, 2.0), _rec(128, 9, 10.0)]
    row = peers.target(ahead)
    assert row[0] == "peers" and row[3] is True and "ahead at 2 of 2 points" in row[2]
    behind = ahead + [_rec(4096, 2, 85.6, regime="cold")]
    row = peers.target(behind)
    assert row[3] is False and "ahead at 2 of 3" in row[2] and "T=4096 N=2" in row[2] and "1.08x" in row[2]
    level = [_rec(1, 1, 2.21)]  # level is not ahead
    assert peers.target(level)[3] is False
    assert peers.target([{"suite": "decode"}]) is None
    assert any(r[0] == "peers" for r in targets(behind))


def test_summary_lines():
    recs = [_rec(1, 9, 2.0), _rec(1, 9, 3.0, regime="cold"), _rec(1, 9, 2.5, provider="attnres/split_k"),
            _rec(16384, 9, 900.0, regime="cold", kernel="persistent")]
    lines = peers.summary(recs)
    assert lines[0].startswith("peers: µs per call")
    row19 = next(line for line in lines if line.split()[:2] == ["1", "9"])
    assert "2.00 / 3.00" in row19 and "6.38" in row19 and "7.09" in row19 and "0.31x" in row19
    row_big = next(line for line in lines if line.split()[:2] == ["16384", "9"])
    assert "persistent" in row_big and "- / 900.0" in row_big and row_big.rstrip().endswith("-")
    assert peers.summary([{"suite": "decode"}]) == []


def test_cli(capsys):
    assert_bench_suite_cli(capsys, "  peers       the default options and every kernel forced", ["peers", "--quick"])


def test_record_with_and_without_the_copy_rate():
    t = {"median_us": 10.0, "p10_us": 9.0, "p90_us": 11.0, "min_us": 9.0, "calls": 32, "repeats": 25}
    r = peers.record("peers", "attnres/default", "warm", 128, 9, 7168, 1, 4.0, "split_k", t, gpu="NVIDIA H200")
    nbytes = peers.op_bytes(128, 9, 7168, True)
    assert r["bytes"] == nbytes and r["gbps"] == pytest.approx(nbytes / 10e-6 / 1e9)
    assert r["pct_copy"] == pytest.approx(100 * r["gbps"] / 4000) and r["peer_best_us"] == 10.50
    r = peers.record("topology", "attnres/split_k", "cold", 256, 6, 7168, 5, None, "persistent", t)
    assert r["pct_copy"] is None and r["peer_best_us"] is None and r["suite"] == "topology"
    other_h = peers.record("peers", "x", "cold", 1, 9, 4096, 1, 0.0, None, t, gpu="NVIDIA H200")
    assert other_h["peer_best_us"] is None  # another H
    assert peers.summary([r | {"suite": "peers"}])[2].split()[:2] == ["256", "6"]
    # Without the addend: the op's own bytes, no peer figure (the peers' are of the one-addend op).
    r = peers.record("topology", "attnres/default", "cold", 128, 9, 7168, 1, 4.0, "split_k", t, add=False,
                     gpu="NVIDIA H200")
    assert r["add"] is False and r["bytes"] == peers.op_bytes(128, 9, 7168, False) < nbytes
    assert r["peer_best_us"] is None


def test_calls_per_graph_amortize_the_replay_launch():
    one = peers.op_bytes(1, 9, 7168, True)
    assert peers.calls_per_graph(8, one) == 250  # 500 us of ~2 us calls
    assert peers.calls_per_graph(600, one) == 600  # every cold set once at least
    big = peers.op_bytes(4096, 9, 7168, True)
    assert peers.calls_per_graph(1, big) == peers.MIN_CALLS
    mid = peers.op_bytes(128, 9, 7168, True)
    assert peers.MIN_CALLS < peers.calls_per_graph(1, mid) < 250


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H20", None])
def test_the_h200_figures_are_compared_on_an_h200_only(gpu):
    """The peers' figures are an H200's: a record of another GPU (or of an unknown one) carries none, so the
    comparison, the target and the summary's peer columns leave it out."""
    t = {"median_us": 100.0, "p10_us": 99.0, "p90_us": 101.0, "min_us": 99.0, "calls": 4, "repeats": 25}
    r = peers.record("peers", "attnres/default", "cold", 4096, 2, 7168, 4, 3.0, "single_cta", t, gpu=gpu)
    assert r["peer_best_us"] is None and r["peer_vllm_us"] is None
    assert peers.comparison([r]) == [] and peers.target([r]) is None
    row = next(line for line in peers.summary([r]) if line.split()[:2] == ["4096", "2"])
    assert row.split()[-3:] == ["-", "-", "-"]
    on_h200 = peers.record("peers", "attnres/default", "cold", 4096, 2, 7168, 4, 3.0, "single_cta", t,
                           gpu="NVIDIA H200")
    assert on_h200["peer_best_us"] == 79.5 and peers.target([on_h200])[3] is False
