"""The figures of results files (python -m bench plot, no GPU): each figure from whichever file holds its suite."""

from __future__ import annotations

import json

import pytest

from bench.plots import bandwidth_series, make_plots


def test_plots_combine_results_files_and_skip_absent_suites(tmp_path):
    """`bench plot --out a.json,b.json`: figures come from whichever file holds their suite (each titled with its
    own run), a suite absent from every file draws nothing, and the GB/s series is bytes over the median."""
    decode = {"suite": "decode", "provider": "attnres/add2", "T": 4, "N": 9, "H": 7168, "bytes": 4_000_000,
              "median_us": 2.0, "p10_us": 1.9, "p90_us": 2.1}
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"meta": {"gpu": "GPU-A", "commit": "aaa"}, "floors": {"copy_tbs": 3.0},
                             "records": [decode, {**decode, "T": 8, "bytes": 8_000_000}]}))
    only_a = make_plots([str(a)], str(tmp_path / "p1"))
    assert sorted(p.rsplit("/", 1)[1] for p in only_a) == ["gbps_vs_T_N9.png", "us_vs_N_T1.png", "us_vs_T_N9.png"]
    series = bandwidth_series([decode])
    assert series["attnres/add2 (decode sweep)"][0][:2] == (4, pytest.approx(2000.0))  # 4 MB in 2 µs = 2000 GB/s
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"meta": {"gpu": "GPU-B", "commit": "bbb"}, "records": []}))
    assert make_plots([str(b)], str(tmp_path / "p2")) == []
