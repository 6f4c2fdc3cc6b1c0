"""The persistent kernel's geometry variants benchmark (python -m bench persistent --variants) without a GPU: the
variants of each point on a described H200, its readers of records (summary, bit check, the per-token time and
the model fit), the suite end to end on the CPU backend, and its command line."""

from __future__ import annotations

import pytest
import torch

from attnres import _persistent_tuning as tuning
from bench import persistent_variants as pv
from bench.cli import main as bench_main


def test_benchmark_variants_of_each_point():
    for N in (2, 9):
        got = pv.variants(4096, N, 7168, True, device="h200")
        assert [v.name for v, _ in got] == list(pv.NAMES)
        plans = {v.name: p for v, p in got}
        assert all(p.accepted for p in plans.values()), {k: p.decline for k, p in plans.items()}
        assert plans["spare1"].slots == N + 2 and plans["spare1"].passes == 1
        assert plans["half_ring"].slots == plans["two_blocks"].slots == 8
        assert plans["half_ring"].blocks_per_sm == 1 and plans["two_blocks"].blocks_per_sm == 2
        assert plans["two_pass"].passes == 2 and plans["one_block"].slots == 16
        assert all(plans[n].blocks_per_sm == 1 for n in ("one_block", "spare1", "two_pass", "half_ring"))
        assert (plans["default"].blocks_per_sm, plans["default"].slots) == (2, 8)  # the plan's: two blocks
        assert (plans["two_blocks_two_pass"].blocks_per_sm, plans["two_blocks_two_pass"].passes) == (2, 2)
        assert plans["default"].passes == (1 if N + 1 <= 8 else 2)  # one pass wherever a token's rows fit
        assert len({p.threads for p in plans.values()}) == 1  # the bits' geometry never moves
    assert pv.points() == [(4096, 2, True), (16384, 2, True), (4096, 9, True), (16384, 9, True)]
    assert pv.points((4096,), (8,), add=False) == [(4096, 8, False)]
    no_add = {v.name: p for v, p in pv.variants(4096, 8, 7168, False, device="h200")}
    assert no_add["spare1"].slots == 9 and no_add["default"].passes == 1  # without the addend: N rows


def _rec(provider, us, *, T=4096, N=9, equal=True, copy=4.27):
    nbytes = 100_000_000
    gbps = nbytes / (us * 1e-6) / 1e9
    variant = provider.split(":", 1)[1] if ":" in provider else None
    geometry = {"blocks": 132, "blocks_per_sm": 1, "threads": 256, "slots": 16, "passes": 1, "smem_bytes": 0}
    return {"suite": "persistent_variants", "provider": provider, "variant": variant, "T": T, "N": N, "H": 7168,
            "add": True, "bytes": nbytes, "gbps": gbps, "copy_tbs": copy, "pct_copy": 100 * gbps / (copy * 1000),
            "geometry": geometry if variant else None, "bitwise_equal": equal, "median_us": us, "p10_us": us,
            "p90_us": us}


def test_summary_and_bit_check_read_the_records():
    recs = [_rec("attnres/persistent:default", 40.0), _rec("attnres/persistent:two_blocks", 32.0),
            _rec(pv.PER_TOKEN, 45.0),
            {"suite": "persistent_variants", "provider": "attnres/persistent:spare1", "variant": "spare1", "T": 4096,
             "N": 9, "H": 7168, "add": True, "declined": "persistent_slots = 99: ..."},
            {"suite": "decode", "provider": "x"}]
    lines = pv.summary(recs)
    assert lines[0] == "persistent variants T=4096 N=9 H=7168 add (copy floor 4.27 TB/s)"
    two = next(line for line in lines if "two_blocks" in line)
    assert "1.25x default" in two and "73.2% of copy" in two and "BITS DIFFER" not in two
    assert any("spare1" in line and "declined: persistent_slots = 99" in line for line in lines)
    assert pv.differing(recs) == []
    recs.append(_rec("attnres/persistent:two_pass", 50.0, equal=False))
    assert pv.differing(recs) == [(4096, 9, 7168, "attnres/persistent:two_pass")]
    assert any("two_pass" in line and "BITS DIFFER" in line for line in pv.summary(recs))


def test_the_suite_runs_on_the_cpu_backend(monkeypatch):
    """The suite's own code end to end without a GPU: CPU inputs, graphs replaced by eager calls, the plans of a
    described H200, a fake timer. Every variant is called (bits checked against the per-token path) and recorded."""
    from attnres.bench import timing, workloads

    calls = []
    monkeypatch.setattr(pv, "make_sets", lambda *a, **k: workloads.make_sets(*a, **k, device="cpu"))
    monkeypatch.setattr(pv, "rotating_sets", lambda nbytes, minimum: 2)  # (the L2 size needs a GPU)
    monkeypatch.setattr(pv, "capture", lambda fns: calls.append(len(fns)) or [fn() for fn in fns])
    monkeypatch.setattr(pv, "time_interleaved", lambda graphs, repeats: {
        name: timing.Timing(median_us=10.0 + i, p10_us=9.0, p90_us=12.0, min_us=9.0, calls=n, repeats=repeats)
        for i, (name, (_, n)) in enumerate(graphs.items())})
    plan = tuning.plan
    monkeypatch.setattr(tuning, "plan", lambda v, **q: plan(v, **{**q, "device": "h200"}))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    recs = pv.run(H=64, copy_tbs=4.0, repeats=3, tokens=(5,), candidates=(2, 3))
    assert len(calls) == 2 * (len(pv.NAMES) + 1) and set(calls) == {pv.MIN_CALLS}
    assert {(r["N"], r["provider"]) for r in recs} == {(N, p) for N in (2, 3) for p in
                                                      [f"attnres/persistent:{n}" for n in pv.NAMES] + [pv.PER_TOKEN]}
    assert all(r["bitwise_equal"] and r["T"] == 5 and r["add"] for r in recs)
    two = next(r for r in recs if r["variant"] == "two_blocks" and r["N"] == 3)
    assert two["geometry"]["blocks_per_sm"] == 2 and two["geometry"]["blocks"] == 5
    assert pv.differing(recs) == [] and any("two_blocks" in line for line in pv.summary(recs))


def test_token_time_and_model_fit():
    """τ per block = time over ceil(T / blocks) rounds; the fit through N = 2 (R = 3) and N = 9 (R = 10)."""
    a = _rec("attnres/persistent:default", 3.5 * 32, N=2)
    b = _rec("attnres/persistent:default", 7.4 * 32, N=9)
    assert pv.token_time_us(a) == pytest.approx(3.5)  # 4096 tokens over 132 blocks: 32 rounds
    assert pv.token_time_us(_rec(pv.PER_TOKEN, 10.0)) is None
    fit = pv.model_fit([a, b, _rec(pv.PER_TOKEN, 1.0)])
    c_row, c_fix = fit[("default", 4096, 7168, True)]
    assert c_row == pytest.approx((7.4 - 3.5) / 7) and c_fix == pytest.approx(3.5 - 3 * c_row)
    assert any(line.startswith("model fit default T=4096 H=7168: 0.557 us per row") for line in pv.summary([a, b]))


def test_cli(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["tune", "--variants"])
    assert exc.value.code == 2 and "--variants applies to the persistent suite only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench_main(["persistent", "--variants", "--quick"])
    assert exc.value.code == 2 and "--variants has one grid" in capsys.readouterr().err
    for argv, message in ((["persistent", "--no-add"], "--no-add applies to the topology suite and persistent"),
                          (["persistent", "--candidates", "6"],
                           "--candidates applies to persistent --variants, prefill and stream"),
                          (["persistent", "--variants", "--candidates", "6,x"], "--candidates must be"),
                          (["persistent", "--variants", "--candidates", "0"], "--candidates must be")):
        with pytest.raises(SystemExit) as exc:
            bench_main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    if not torch.cuda.is_available():
        assert bench_main(["persistent", "--variants"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
