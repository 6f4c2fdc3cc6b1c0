"""The package's benchmark code that runs without a GPU: the decode-chain suite's CPU path (fold on/off bitwise
equal, records well formed, the checks have teeth), target P6 (docs/performance.md: the fold saves >= 0.2 ms per
93-layer step) in results.targets(), the chain plot's data, and the CLI (python -m attnres.bench)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnres.bench import chain, results
from attnres.bench.cli import main as bench_main
from attnres.bench.plots import chain_series
from attnres.models.kimi_k3 import KimiK3Config

# 9 layers, block 4: dense layer 0, MoE on 1..8, snapshots at 0/4/8 (N up to 4), taps of layers 1 and 3.
TINY = KimiK3Config.small(hidden_size=64, num_layers=9, snapshot_block=4)
TINY_TOKENS = (1, 3)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def tiny_records():
    return chain.run(device="cpu", config=TINY, tokens=TINY_TOKENS, repeats=3, warmup=1, seed=5)


def _by(records, provider, T):
    (r,) = [r for r in records if r["provider"] == provider and r["T"] == T]
    return r


# ------------------------------------------------------------------------------------------ chain, CPU path
def test_chain_cpu_records_are_well_formed(tiny_records):
    assert sorted((r["T"], r["provider"]) for r in tiny_records) == sorted(
        (T, p) for T in TINY_TOKENS for p in ("chain/fold_on", "chain/fold_off"))
    json.loads(json.dumps(tiny_records))  # a results file can hold them
    for r in tiny_records:
        assert r["suite"] == "chain" and r["device"] == "cpu" and r["graph"] is False
        assert r["timer"] == chain.TIMER_CPU
        assert (r["H"], r["layers"], r["snapshot_block"]) == (64, 9, 4)
        assert r["moe_layers"] == 8
        assert r["sites"] == 2 * 9 + 1  # pre-attention + pre-MLP per layer, and the output site
        assert r["calls"] == 1 and r["repeats"] == 3
        assert 0 < r["min_us"] <= r["p10_us"] <= r["median_us"] <= r["p90_us"]
        assert r["working_set_bytes"] > 0
        assert r["plan_add2"]["kernel"] == "cpu" and r["plan_add2"]["N"] == TINY.output_candidates
    for T in TINY_TOKENS:
        on, off = _by(tiny_records, "chain/fold_on", T), _by(tiny_records, "chain/fold_off", T)
        assert on["fold"] is True and off["fold"] is False
        assert on["step_saving_us"] == pytest.approx(off["median_us"] - on["median_us"])
        assert on["saving_per_moe_layer_us"] == pytest.approx(on["step_saving_us"] / 8)
        spread = math.hypot(on["p90_us"] - on["p10_us"], off["p90_us"] - off["p10_us"])
        assert on["saving_noise_us"] == pytest.approx(spread)


def test_chain_cpu_fold_on_off_bitwise_equal_and_paths(tiny_records):
    for r in tiny_records:
        assert r["bitwise_equal"] is True and r["diffs"] == []
        assert r["equals_model"] is True and r["model_diffs"] == []
    for T in TINY_TOKENS:
        on, off = _by(tiny_records, "chain/fold_on", T), _by(tiny_records, "chain/fold_off", T)
        paths_on = {(kind, path): n for kind, path, _, _, n in on["paths"]}
        paths_off = {(kind, path): n for kind, path, _, _, n in off["paths"]}
        # Every MoE tail deferred and consumed by the next pre-attention site (layers 2..8) or the output.
        assert on["folded_sites"] == 8
        assert paths_on[("moe_tail", "defer")] == 8
        assert paths_on[("pre_attn", "fused_add2")] == 7 and paths_on[("output", "fused_add2")] == 1
        assert off["folded_sites"] == 0
        assert paths_off[("moe_tail", "sum")] == 8 and ("pre_attn", "fused_add2") not in paths_off
        assert all(kernel in ("cpu", "torch", "") for _, _, kernel, _, _ in on["paths"] + off["paths"])


def test_chain_bitwise_check_has_teeth(monkeypatch):
    """A fold that drops the shared part changes only the fold-on chain: the two chains differ."""
    monkeypatch.setattr(chain._FedMoE, "__call__",
                        lambda self, y, *, return_parts=False:
                        (self.routed, torch.zeros_like(self.shared)) if return_parts else self.routed + self.shared)
    records = chain.run(device="cpu", config=TINY, tokens=(2,), repeats=1, warmup=0)
    for r in records:
        assert r["bitwise_equal"] is False
        assert any("output differs" in d for d in r["diffs"]), r["diffs"]
        assert r["equals_model"] is True  # the fold-off chain is untouched


def test_chain_model_check_has_teeth(monkeypatch):
    """A fed sub-layer that does not return what the model's stand-in returned: both chains agree with each
    other, and the check against the model's eager step fails."""
    original = chain._Fed.__call__

    def off_by_one_ulp(self, x):
        out = original(self, x).clone()
        out.view(torch.int16).view(-1)[0] += 1
        return out

    monkeypatch.setattr(chain._Fed, "__call__", off_by_one_ulp)
    records = chain.run(device="cpu", config=TINY, tokens=(1,), repeats=1, warmup=0)
    for r in records:
        assert r["bitwise_equal"] is True
        assert r["equals_model"] is False and r["model_diffs"]


def test_chain_rejects_bad_arguments():
    with pytest.raises(ValueError, match="device"):
        chain.run(device="tpu", config=TINY, tokens=(1,))
    with pytest.raises(ValueError, match="repeats"):
        chain.run(device="cpu", config=TINY, tokens=(1,), repeats=0)


def test_chain_summary_lines(tiny_records):
    lines = chain.summary(tiny_records)
    assert len(lines) == len(TINY_TOKENS)
    assert all("not a measurement" in line and "bitwise equal" in line for line in lines)


# ------------------------------------- P6: the fold saves >= 0.2 ms per 93-layer step, bitwise equal
def _chain_pair(T, off_ms, on_ms, *, equal=True, graph=True, H=7168, layers=93):
    common = dict(suite="chain", T=T, H=H, layers=layers, moe_layers=layers - 1, graph=graph,
                  device="cuda" if graph else "cpu", bitwise_equal=equal, equals_model=True,
                  saving_noise_us=8.0, step_saving_us=(off_ms - on_ms) * 1e3,
                  saving_per_moe_layer_us=(off_ms - on_ms) * 1e3 / (layers - 1))
    return [dict(common, provider="chain/fold_on", median_us=on_ms * 1e3, p10_us=on_ms * 1e3 - 3,
                 p90_us=on_ms * 1e3 + 3),
            dict(common, provider="chain/fold_off", median_us=off_ms * 1e3, p10_us=off_ms * 1e3 - 3,
                 p90_us=off_ms * 1e3 + 3)]


def _p6(records):
    rows = [row for row in results.targets(records) if row[0] == "P6"]
    return rows[0] if rows else None


def test_targets_p6_from_chain_records():
    met = _p6(_chain_pair(1, 1.25, 0.96) + _chain_pair(32, 1.60, 1.30))
    assert met[3] is True
    assert "saves 0.290 ms" in met[2] and "3.15 us per MoE layer" in met[2] and "bitwise equal at T=[1, 32]" in met[2]

    too_small = _p6(_chain_pair(1, 1.25, 1.15))
    assert too_small[3] is False and "saves 0.100 ms" in too_small[2]

    unequal = _p6(_chain_pair(1, 1.25, 0.96) + _chain_pair(4, 1.3, 1.0, equal=False))
    assert unequal[3] is False and "NOT bitwise equal at T=[4]" in unequal[2]


def test_targets_p6_ignores_cpu_and_other_configs(tiny_records):
    assert _p6(tiny_records) is None
    assert _p6(_chain_pair(1, 1.25, 0.96, graph=False)) is None
    assert _p6(_chain_pair(1, 1.25, 0.96, H=2304)) is None
    assert _p6(_chain_pair(1, 1.25, 0.96, layers=48)) is None
    # The other targets are unaffected by chain records.
    assert [row[0] for row in results.targets(tiny_records)] == []


def test_chain_plot_series_prefers_graph_records(tiny_records):
    series, saving, first = chain_series(tiny_records + _chain_pair(1, 1.25, 0.96))
    assert first["graph"] is True
    assert series == {"chain/fold_on": [(1, 0.96, 0.957, 0.963)], "chain/fold_off": [(1, 1.25, 1.247, 1.253)]}
    assert saving == {1: pytest.approx(290 / 92)}
    cpu_series, _, cpu_first = chain_series(tiny_records)
    assert cpu_first["graph"] is False and [t for t, *_ in cpu_series["chain/fold_on"]] == list(TINY_TOKENS)
    assert chain_series([]) == ({}, {}, None)


# ------------------------------------------------------------------------------------------ CLI
def test_cli_help_lists_the_suites(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("decode", "finalize", "chain", "host", "--device", "--tokens"):
        assert word in out


def test_cli_chain_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "chain.json"
    code = bench_main(["chain", "--device", "cpu", "--hidden", "64", "--layers", "9", "--block", "4", "--tokens",
                       "1,2", "--repeats", "1", "--commit", "test", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["meta"]["gpu"] is None and data["meta"]["device"] == "cpu" and data["meta"]["commit"] == "test"
    assert sorted((r["T"], r["provider"]) for r in data["records"]) == [
        (1, "chain/fold_off"), (1, "chain/fold_on"), (2, "chain/fold_off"), (2, "chain/fold_on")]
    assert all(r["bitwise_equal"] and r["layers"] == 9 and r["H"] == 64 for r in data["records"])
    assert "not a measurement" in capsys.readouterr().out


def test_cli_rejections(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["decode", "--device", "cpu"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit, match="--tokens"):
        bench_main(["chain", "--device", "cpu", "--tokens", "1,x", "--out", str(tmp_path / "c.json")])
    assert not (tmp_path / "c.json").exists()


def test_host_suite_runs_every_case_on_the_cpu():
    """`python -m attnres.bench host --device cpu`'s cases (the FP8 ones included) run and are reported."""
    from attnres.bench import host

    records = host.run(device="cpu", calls=3, rounds=1)
    names = [r["case"] for r in records]
    assert names == list(host.cases("cpu")) and all(r["host_us"] > 0 for r in records)
    assert "attn_res_add_rmsnorm (two addends, FP8-only)" in names
    assert host.summary(records)[-1].startswith("host cost target <= 15.0 us (cpu)")
