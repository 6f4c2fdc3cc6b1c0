"""The regression guard (python -m bench guard) without a GPU: its comparison on synthetic records (regression,
drift of the machine, noise, improvements, missing keys), the committed baseline, the physical-GPU note, and the
command line."""

from __future__ import annotations

import json
import math

import pytest

from bench import guard
from bench.cli import main as bench_main
from helpers import ROOT

BASELINE = str(ROOT / "bench_results" / "h200_4aed4f9.json")


# ------------------------------------------------------------------------------------------ guard
def _record(point: guard.Point, median: float, rel_spread: float = 0.004) -> dict:
    r = dict(point.key)
    half = median * rel_spread / 2
    r.update(median_us=median, p10_us=median - half, p90_us=median + half, min_us=median - half)
    if point.role == guard.KERNEL and r["suite"] == "decode":
        r.update(kernel="split_k", cluster=7)
    return r


BASE_US = {"decode add2 T=1 N=2": 2.97, "decode add2 T=1 N=9": 3.51, "decode add2 T=32 N=9": 5.45,
           "moe_finalize T=1": 4.87, "eager tail adds T=1 N=2": 3.22, "eager tail adds T=1 N=9": 3.22,
           "eager tail adds T=32 N=9": 4.11}


def _records(scale=None, spread: float = 0.004, skip=()) -> list[dict]:
    """One record per guard point; scale: label -> factor on the baseline median (default 1)."""
    scale = scale or {}
    return [_record(p, BASE_US[p.label] * scale.get(p.label, 1.0), spread) for p in guard.points()
            if p.label not in skip]


def _status(report) -> dict:
    return {r.point.label: r.status for r in report.rows}


def test_guard_points_are_the_brief():
    labels = [p.label for p in guard.points()]
    assert labels == list(BASE_US)
    assert [p.role for p in guard.points()].count(guard.REFERENCE) == 3


def test_guard_flags_a_20_percent_regression():
    report = guard.compare(_records(), _records({"decode add2 T=1 N=9": 1.2}))
    status = _status(report)
    assert status.pop("decode add2 T=1 N=9") == guard.REGRESSION
    assert set(status.values()) == {guard.OK}
    assert report.exit_code() == 1
    assert report.drift == pytest.approx(1.0)
    text = "\n".join(guard.format_report(report))
    assert "REGRESSION" in text and "+20.0%" in text


def test_guard_passes_a_1_percent_change():
    report = guard.compare(_records(), _records({label: 1.01 for label in BASE_US}))
    assert set(_status(report).values()) == {guard.OK}
    assert report.exit_code() == 0
    assert "no regression" in guard.format_report(report)[-1]


def test_guard_separates_machine_drift_from_a_kernel_change():
    everything_slower = guard.compare(_records(), _records({label: 1.2 for label in BASE_US}))
    assert everything_slower.drift == pytest.approx(1.2)
    status = _status(everything_slower)
    assert {status[p.label] for p in guard.points() if p.role == guard.KERNEL} == {guard.DRIFT}
    assert {status[p.label] for p in guard.points() if p.role == guard.REFERENCE} == {guard.MOVED}
    assert everything_slower.exit_code() == 0
    assert "the machine moved" in "\n".join(guard.format_report(everything_slower))

    # The machine 10% slower and one kernel 40% slower: a regression on both counts.
    scale = {label: 1.1 for label in BASE_US} | {"decode add2 T=32 N=9": 1.4}
    mixed = guard.compare(_records(), _records(scale))
    assert _status(mixed)["decode add2 T=32 N=9"] == guard.REGRESSION
    assert _status(mixed)["decode add2 T=1 N=2"] == guard.DRIFT
    assert mixed.exit_code() == 1

    # The machine 15% faster, the kernel unchanged: slower only against the reference (reported, not failed).
    faster_machine = guard.compare(_records(), _records({label: 0.85 for label in BASE_US if "eager" in label}))
    assert _status(faster_machine)["decode add2 T=1 N=2"] == guard.VS_REF
    assert faster_machine.exit_code() == 0


def test_guard_noise_widens_the_bound():
    """A 20% change inside 15%-wide spreads on both sides is noise: 3 x hypot(15%, 15%) > 20%."""
    report = guard.compare(_records(spread=0.15), _records({"decode add2 T=1 N=9": 1.2}, spread=0.15))
    row = next(r for r in report.rows if r.point.label == "decode add2 T=1 N=9")
    assert row.bound == pytest.approx(3 * math.hypot(0.15, 0.15))
    assert row.status == guard.OK and report.exit_code() == 0


def test_guard_reports_an_improvement():
    report = guard.compare(_records(), _records({"decode add2 T=1 N=2": 0.8}))
    assert _status(report)["decode add2 T=1 N=2"] == guard.IMPROVED
    assert report.exit_code() == 0


def test_guard_handles_missing_keys():
    # No references in the baseline: raw comparison only; no finalize in the new run.
    refs = [p.label for p in guard.points() if p.role == guard.REFERENCE]
    report = guard.compare(_records(skip=refs), _records({"decode add2 T=1 N=2": 1.2}, skip=["moe_finalize T=1"]))
    status = _status(report)
    assert report.drift is None
    assert all(status[label] == guard.NO_BASELINE for label in refs)
    assert status["moe_finalize T=1"] == guard.NOT_MEASURED
    assert status["decode add2 T=1 N=2"] == guard.REGRESSION
    assert report.exit_code() == 1
    assert "raw comparison only" in "\n".join(guard.format_report(report))

    # Nothing comparable at all (another hidden size's baseline): exit 2, not a silent pass.
    other_h = [dict(r, H=4096) if r["suite"] == "decode" else r for r in _records(skip=["moe_finalize T=1"])]
    nothing = guard.compare(other_h, _records(skip=["moe_finalize T=1"]))
    assert nothing.compared == [] and nothing.exit_code() == 2
    assert guard.compare([], _records()).exit_code() == 2


def test_guard_keys_need_provider_and_shape():
    wrong = [dict(r, provider="attnres/add") if r.get("provider") == "attnres/add2" else r for r in _records()]
    status = _status(guard.compare(wrong, _records()))
    assert all(status[label] == guard.NO_BASELINE for label in BASE_US if label.startswith("decode add2"))


def test_guard_against_the_committed_baseline():
    meta, records = guard.load(BASELINE)
    assert meta["gpu"] == "NVIDIA H200"
    report = guard.compare(records, records, base_meta=meta, new_meta=meta)
    assert len(report.compared) == 4  # every kernel point has a record in the committed file
    assert report.drift == pytest.approx(1.0)
    assert set(_status(report).values()) == {guard.OK}
    assert report.exit_code() == 0


def test_guard_says_whether_baseline_and_new_ran_on_one_physical_gpu():
    base = {"gpu": "NVIDIA H200", "commit": "a", "gpu_uuid": "GPU-1", "host": "h1"}
    recs = _records()
    same = "\n".join(guard.format_report(guard.compare(recs, recs, base_meta=base, new_meta={**base, "commit": "b"})))
    assert "physical GPUs" not in same
    other = {**base, "commit": "b", "gpu_uuid": "GPU-2", "host": "h2"}
    text = "\n".join(guard.format_report(guard.compare(recs, recs, base_meta=base, new_meta=other)))
    assert "NOTE: different physical GPUs (baseline GPU-1 on h1, new GPU-2 on h2)" in text
    old = {"gpu": "NVIDIA H200", "commit": "4aed4f9"}  # results files from before the uuid was recorded
    text = "\n".join(guard.format_report(guard.compare(recs, recs, base_meta=old, new_meta=other)))
    assert "NOTE: unknown physical GPUs (baseline ? on ?, new GPU-2 on h2)" in text


def test_guard_load_rejects_a_file_that_is_not_results(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"meta": {}}))
    with pytest.raises(ValueError, match="records"):
        guard.load(str(path))


# ------------------------------------------------------------------------------------------ CLI
def test_cli_guard_help_and_rejections(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("guard", "--baseline", "--against"):
        assert word in out
    assert bench_main(["guard"]) == 2
    assert "--baseline" in capsys.readouterr().err
    assert bench_main(["guard", "--baseline", str(tmp_path / "missing.json"), "--against", BASELINE]) == 2


def test_cli_guard_against_a_file(tmp_path, capsys):
    base, slower = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps({"meta": {"gpu": "G", "commit": "a"}, "records": _records()}))
    slower.write_text(json.dumps({"meta": {"gpu": "G", "commit": "b"},
                                  "records": _records({"decode add2 T=1 N=2": 1.2})}))
    assert bench_main(["guard", "--baseline", str(base), "--against", str(base)]) == 0
    assert bench_main(["guard", "--baseline", str(base), "--against", str(slower)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "commit b" in out
