"""The topology suite's code that runs without a GPU (bench/topology.py): its grid, the rows and the
target read from records (the default within 3% of the fastest forced kernel), the summary, and the CLI."""

from __future__ import annotations

import pytest

from bench import topology
from bench.targets import targets
from cli_checks import assert_bench_suite_cli


def test_grid():
    pts = topology.points()
    assert {T for T, _ in pts} == {128, 256, 512, 1024, 2048, 4096}
    assert {N for _, N in pts} == set(range(3, 17)) and len(pts) == 6 * 14 == len(set(pts))
    quick = topology.points(quick=True)
    assert set(quick) < set(pts) and len(quick) == 15
    # --no-add: attn_res_rmsnorm at every N, N = 1 (a plain RMSNorm) and the single_cta's N <= 2 included
    bare = topology.points(add=False)
    assert {N for _, N in bare} == set(range(1, 17)) and len(bare) == 6 * 16
    assert {N for _, N in topology.points(quick=True, add=False)} == {1, 2, 5, 9, 12}
    assert topology.points(add=False, tokens=(4096,)) == [(4096, N) for N in range(1, 17)]  # --tokens


def _rec(T, N, provider, us, kernel="split_k", regime="cold", add=None):
    rec = {"suite": "topology", "provider": provider, "regime": regime, "T": T, "N": N, "H": 7168,
           "median_us": us, "default_kernel": kernel}
    return rec if add is None else rec | {"add": add}  # None: a record from before the no-addend grid


def _point(T, N, default_us, kernel, add=None, **forced):
    return [_rec(T, N, "attnres/default", default_us, kernel, add=add)] + [
        _rec(T, N, f"attnres/{name}", us, kernel, add=add) for name, us in forced.items()]


def test_rows_and_target():
    recs = (_point(1024, 6, 45.1, "persistent", split_k=63.5, persistent=45.0)
            + _point(4096, 12, 298.3, "split_k", split_k=298.0, persistent=342.2)
            + [_rec(1024, 6, "attnres/default", 1.0, "persistent", regime="warm")])
    got = topology.rows(recs)
    assert [(r["T"], r["N"], r["best"]) for r in got] == [(1024, 6, "persistent"), (4096, 12, "split_k")]
    assert got[0]["ratio"] == pytest.approx(45.1 / 45.0)
    row = topology.target(recs)
    assert row[0] == "topology" and row[3] is True and "within 3% at 2 of 2 points" in row[2]
    slow = recs + _point(4096, 16, 479.3, "persistent", split_k=347.8, persistent=479.3)
    row = topology.target(slow)
    assert row[3] is False and "1 of 3" not in row[2] and "2 of 3" in row[2] and "T=4096 N=16" in row[2]
    assert topology.target([{"suite": "decode"}]) is None
    assert any(r[0] == "topology" for r in targets(slow))


def test_summary_marks_a_slow_default():
    recs = (_point(1024, 6, 45.1, "persistent", split_k=63.5, persistent=45.0)
            + _point(4096, 16, 479.3, "persistent", split_k=347.8, persistent=479.3))
    lines = topology.summary(recs)
    assert lines[0].startswith("topology grid")
    fast = next(line for line in lines if line.split()[:2] == ["1024", "6"])
    assert "63.50" in fast and "45.00" in fast and "-" in fast and not fast.endswith("!")
    assert next(line for line in lines if line.split()[:2] == ["4096", "16"]).endswith(" !")
    assert topology.summary([]) == []


def test_the_op_without_an_addend_is_its_own_row():
    recs = (_point(4096, 5, 215.0, "split_k", add=False, split_k=215.0, persistent=143.0)
            + _point(4096, 5, 147.0, "persistent", add=True, split_k=250.0, persistent=147.0))
    got = topology.rows(recs)
    assert [(r["add"], r["kernel"], r["best"]) for r in got] == [(True, "persistent", "persistent"),
                                                                 (False, "split_k", "persistent")]
    row = topology.target(recs)
    assert row[3] is False and "1 of 2" in row[2] and "T=4096 N=5 (no addend)" in row[2]
    lines = topology.summary(recs)
    headers = [line for line in lines if line.startswith("topology grid")]
    assert "one addend" in headers[0] and "no addend" in headers[1] and lines[-1].endswith(" !")


@pytest.mark.parametrize("flag, where", [("--no-add", "the topology suite and persistent --variants only"),
                                         ("--mix", "the topology suite only")])
def test_op_flags_belong_to_the_topology_suite(capsys, flag, where):
    from bench.cli import main as bench_main

    with pytest.raises(SystemExit) as exc:
        bench_main(["persistent", flag])
    assert exc.value.code == 2 and f"{flag} applies to {where}" in capsys.readouterr().err


def test_attn_res_records_are_rows_of_their_own():
    """--mix records (op attn_res) at the same (T, N, addend) as the normed op's are a separate row, labelled."""
    mix = [r | {"op": "attn_res"} for r in _point(4096, 5, 130.0, "persistent", add=False, split_k=180.0,
                                                   persistent=130.0)]
    recs = _point(4096, 5, 137.0, "persistent", add=False, split_k=140.0, persistent=137.0) + mix + _point(
        4096, 8, 219.0, "persistent", add=True, split_k=197.0, persistent=219.0)
    for r in recs[-3:]:
        r["op"] = "attn_res"
    got = topology.rows(recs)
    assert [(r["mix"], r["add"], r["N"]) for r in got] == [(False, False, 5), (True, True, 8), (True, False, 5)]
    row = topology.target(recs)
    assert row[3] is False and "T=4096 N=8 attn_res (" in row[2]
    headers = [line for line in topology.summary(recs) if line.startswith("topology grid")]
    assert len(headers) == 3 and "attn_res_rmsnorm" in headers[0] and "attn_res, one addend" in headers[1]


def test_peers_times_attn_res_without_diagnostics():
    from bench import peers

    assert peers.op_name(True, mix=True) == peers.op_name(False, mix=True) == "attn_res"
    # the persistent kernel runs attn_res without the diagnostics: it is one of the providers
    assert list(peers._providers(4096, 5, 7168, device="h200", add=False, mix=True)) == list(
        peers._providers(4096, 5, 7168, device="h200", add=False))


def test_cli(capsys):
    assert_bench_suite_cli(capsys, "  topology    the automatic topology against every kernel forced",
                           ["topology", "--quick"])
