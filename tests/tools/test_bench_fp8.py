"""The FP8 benchmark suite (python -m bench fp8) without a GPU: the CLI refuses cleanly and writes
nothing; the grid is the issue's; the table and the target are derived correctly from records (synthetic ones:
the numbers come from the H200)."""

from __future__ import annotations

import pytest
import torch

from bench import fp8, fp8_prefill, prefill
from bench.cli import SUITES, fp8_agrees
from bench.cli import main as bench_main
from bench.targets import targets


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_fp8_suite_refuses_without_a_gpu_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    assert bench_main(["fp8", "--out", str(out)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_fp8_suite_is_registered_with_the_issue_grid():
    assert "fp8" in SUITES
    assert fp8.points() == [(T, N) for T in (1, 4, 8, 32) for N in (2, 9, 12)]
    assert fp8.points(quick=True) == [(1, 9), (32, 9)]
    assert fp8.MODES == ("per_token", "block128") and fp8.TARGET_US == 0.2


def _rec(provider, T, N, median, mode=None, equal=None):
    return {"suite": "fp8", "provider": provider, "mode": mode, "T": T, "N": N, "H": 7168, "median_us": median,
            "bitwise_equal": equal}


def _records(fused_cost=0.1, equal=True):
    recs = []
    for T, N in ((1, 9), (32, 9)):
        recs.append(_rec(fp8.BF16_OP, T, N, 2.0 + T / 100))
        for mode in fp8.MODES:
            recs += [_rec(f"attnres/add2_fp8_{mode}", T, N, 2.0 + T / 100 + fused_cost, mode, equal),
                     _rec(f"add2_then_eager_quant_{mode}", T, N, 30.0, mode),
                     _rec(f"add2_then_compiled_quant_{mode}", T, N, 6.0, mode)]
    return recs


def test_table_and_target_from_records():
    rows = fp8.table(_records(0.1))
    assert len(rows) == 4
    T, N, mode, base, fused, cost, eager, comp, only, only_cost = rows[0]
    assert (T, N, mode) == (1, 9, "per_token") and only is None and only_cost is None
    assert cost == pytest.approx(0.1) and eager == pytest.approx(30.0 - base) and comp == pytest.approx(6.0 - base)
    what, measured, met = fp8.target(_records(0.1))
    assert met and "0.2 us" in what and "bitwise" in measured
    assert fp8.target(_records(0.25))[2] is False  # over the target
    assert fp8.target(_records(0.1, equal=False))[2] is False and "NOT bitwise" in fp8.target(
        _records(0.1, equal=False))[1]
    lines = fp8.summary(_records(0.1))
    assert lines[-1].endswith("-> met") and len(lines) == 1 + 4 + 1
    assert fp8.summary([]) == [] and fp8.target([]) is None


def test_the_target_judges_the_fp8_only_call_where_measured():
    """With FP8-only records the target is their cost (0.15 us: met) although the fused call costs 0.3 us."""
    recs = _records(0.3)
    for T, N in ((1, 9), (32, 9)):
        for mode in fp8.MODES:
            recs.append(_rec(f"attnres/add2_fp8_only_{mode}", T, N, 2.0 + T / 100 + 0.15, mode, True))
    rows = fp8.table(recs)
    assert all(r[9] == pytest.approx(0.15) and r[5] == pytest.approx(0.3) for r in rows)
    what, measured, met = fp8.target(recs)
    assert met and "FP8-only" in what and "+0.150 us" in measured and "(FP8-only)" in measured
    assert fp8.target(_records(0.3))[2] is False
    assert fp8.summary(recs)[1].rstrip().endswith("+0.15")


def test_a_bitwise_mismatch_fails_the_run(capsys):
    assert fp8_agrees(_records()) is True
    assert fp8_agrees(_records(equal=False)) is False
    assert "DIFFERS" in capsys.readouterr().err


def test_an_unmeasured_variant_is_reported():
    recs = _records()
    recs = [r for r in recs if r["provider"] != "add2_then_compiled_quant_block128" or r["T"] != 1]
    recs.append({"suite": "fp8", "provider": "add2_then_compiled_quant_block128", "mode": "block128", "T": 1,
                 "N": 9, "H": 7168, "error": "BackendCompilerFailed: x", "bitwise_equal": None})
    lines = fp8.summary(recs)
    assert any("not measured: BackendCompilerFailed" in line for line in lines)
    row = next(r for r in fp8.table(recs) if r[:3] == (1, 9, "block128"))
    assert row[7] is None


# ------------------------------------------------------------------------------------------- --prefill
def test_prefill_grid_and_cli_checks(capsys):
    assert fp8_prefill.points() == [(op, T, N) for op in ("norm", "add", "add2") for N in (1, 2, 3, 5, 7, 9, 12)
                                    for T in (1024, 4096)]
    assert fp8_prefill.points(quick=True) == [("add", 4096, 2), ("add", 4096, 6), ("add", 4096, 9)]
    assert fp8_prefill.TARGET_FRACTION == 0.03
    for argv in (["prefill", "--prefill"], ["fp8", "--prefill", "--pow2"], ["fp8", "--prefill", "--no-pdl"]):
        with pytest.raises(SystemExit):
            bench_main(argv)
    assert "--prefill" in capsys.readouterr().err


@pytest.mark.parametrize("op,N", [("norm", 1), ("add", 6), ("add2", 9)])
def test_prefill_points_plan_the_fp8_call_on_the_bf16_kernel(op, N):
    """The FP8 call runs where the bf16 call does (both GPUs' plans, T = 1024 and 4096): what the prefill suite's
    target compares."""
    for device in ("h100", "h200"):
        for T in fp8_prefill.TOKENS:
            plans = [prefill.plan(op, T, N, 7168, device, fp8=m) for m in (None, *fp8_prefill.MODES)]
            assert len({(p.kernel, p.route, p.blocks_per_sm) for p in plans}) == 1, (device, T, plans)


def _prefill_rec(op, T, N, mode, median, kernel="persistent", equal=True):
    return {"suite": "fp8_prefill", "provider": fp8_prefill.provider(mode), "op": op, "mode": mode, "T": T, "N": N,
            "H": 7168, "kernel": kernel, "median_us": median, "bitwise_equal": None if mode is None else equal}


def _prefill_records(cost=0.02, equal=True, fp8_kernel="persistent"):
    recs = []
    for op, T, N in (("add", 4096, 6), ("norm", 1024, 2)):
        recs.append(_prefill_rec(op, T, N, None, 100.0))
        for mode in fp8_prefill.MODES:
            recs.append(_prefill_rec(op, T, N, mode, 100.0 * (1 + cost), fp8_kernel, equal))
    return recs


def test_prefill_table_target_and_summary():
    rows = fp8_prefill.table(_prefill_records(0.02))
    assert len(rows) == 4 and rows[0]["op"] == "norm" and rows[0]["cost"] == pytest.approx(0.02)
    ident, what, measured, met = fp8_prefill.target(_prefill_records(0.02))
    assert ident == "fp8 prefill" and "3%" in what and met and "4 of 4 points" in measured
    assert fp8_prefill.target(_prefill_records(0.05))[3] is False
    bad = _prefill_records(0.0, equal=False)
    assert fp8_prefill.target(bad)[3] is False and "NOT bitwise" in fp8_prefill.target(bad)[2]
    assert fp8_agrees(bad) is False
    lines = fp8_prefill.summary(_prefill_records(0.02, fp8_kernel="split_k"))
    assert lines[-1].endswith("-> met") and any("persistent -> split_k" in line for line in lines)
    assert fp8_prefill.summary([]) == [] and fp8_prefill.target([]) is None
    assert any(row[0] == "fp8 prefill" for row in targets(_prefill_records()))


def test_prefill_target_judges_the_fp8_only_calls():
    """With FP8-only records the target is theirs; the calls that also write the bf16 output are reported beside
    (here 10 % over the bf16 call, past the target, while the FP8-only calls are 2 % faster)."""
    recs = _prefill_records(0.10)
    for r in list(recs):
        if r["mode"] is not None:
            recs.append({**r, "provider": fp8_prefill.provider(r["mode"], True), "fp8_only": True,
                         "median_us": 98.0})
    assert fp8_prefill.provider("block128", True) == "attnres/fp8_only_block128"
    assert len(fp8_prefill.table(recs)) == 8
    ident, what, measured, met = fp8_prefill.target(recs)
    assert met and "FP8-only" in what and "4 of 4 points" in measured and "-2.0%" in measured
    lines = fp8_prefill.summary(recs)
    assert any(line.startswith("the FP8 call with the bf16 output too: 0 of 4 points") for line in lines)
    assert any("only block128" in line for line in lines)
    recs.append({**recs[-1], "bitwise_equal": False, "T": 1024, "N": 2, "op": "norm"})
    assert fp8_prefill.target(recs)[3] is False
    assert fp8_prefill.VARIANTS == ((None, False), ("per_token", False), ("block128", False), ("per_token", True),
                                    ("block128", True))
