"""tools/engines/bench_vllm.py's FlagGems step on the CPU: prepare-flaggems copies the kernel file as it is and writes
the stand-ins, whose answers the fixed-configuration path relies on (no TLE, launch caching off, the autotuned
kernel refusing clearly); `run --flaggems` times FlagGems only where its fixed-configuration kernel serves."""

from __future__ import annotations

import importlib.util

import pytest

from helpers import ROOT


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_vllm():
    return _load(ROOT / "tools" / "engines" / "bench_vllm.py", "bench_vllm")


@pytest.mark.parametrize("as_checkout", [True, False])
def test_prepare_copies_the_file_and_writes_the_standins(bench_vllm, tmp_path, monkeypatch, as_checkout):
    text = b"# FlagGems' attn_res.py stands here\n"
    src = tmp_path / "src_checkout"
    (src / "src/flaggems_vllm/ops").mkdir(parents=True)
    (src / bench_vllm.FLAGGEMS_FILE).write_bytes(text)
    out = tmp_path / "flaggems"
    monkeypatch.setattr(bench_vllm, "FLAGGEMS", out)
    bench_vllm.prepare_flaggems(src if as_checkout else src / bench_vllm.FLAGGEMS_FILE)
    assert (out / "flaggems_vllm/ops/attn_res.py").read_bytes() == text
    assert {p.relative_to(out).as_posix() for p in out.rglob("*.py")} == \
        set(bench_vllm.FLAGGEMS_STANDINS) | {"flaggems_vllm/ops/attn_res.py"}

    utils = _load(out / "flaggems_vllm/utils/__init__.py", "fg_utils")
    assert utils.has_triton_tle(3, 6, 0) is False
    fn = object()
    assert utils.libentry()(fn) is fn
    tuned = utils.libtuner(configs=[], key=[])(fn)
    with pytest.raises(NotImplementedError, match="tuned configs are not loaded"):
        tuned[(1,)]
    runtime = _load(out / "flaggems_vllm/runtime/__init__.py", "fg_runtime")
    assert runtime.get_tuned_config("attn_res_post") == []


def test_prepare_without_the_file_fails_and_keeps_the_old_folder(bench_vllm, tmp_path, monkeypatch):
    out = tmp_path / "flaggems"
    (out / "keep").mkdir(parents=True)
    monkeypatch.setattr(bench_vllm, "FLAGGEMS", out)
    with pytest.raises(FileNotFoundError):
        bench_vllm.prepare_flaggems(tmp_path / "no_checkout")
    assert (out / "keep").is_dir()


@pytest.mark.parametrize("site,K,bank_rows,served", [
    ("add_rmsnorm", 0, 12, True), ("add_rmsnorm", 8, 12, True), ("add_rmsnorm", 11, 12, False),
    ("add_rmsnorm", 4, 6, False), ("add_rmsnorm_write", 3, 9, True), ("rmsnorm_write", 2, 9, True),
    ("add_mix", 5, 9, True), ("rmsnorm", 4, 9, False), ("mix", 4, 9, False)])
def test_flaggems_points(bench_vllm, site, K, bank_rows, served):
    assert bench_vllm._flaggems_serves(bench_vllm._args(site, K), bank_rows) is served



def test_against_reports_the_output_gap_and_the_side_effects_bits(bench_vllm):
    import torch
    ref = {"prefix": torch.tensor([1.0, -0.0]).bfloat16(), "blocks": torch.ones(2, 2).bfloat16()}
    same = {k: v.clone() for k, v in ref.items()}
    r = bench_vllm._against(torch.tensor([1.0, 2.0]), ref, torch.tensor([1.0, 2.5]), same)
    assert r == {"max_abs_diff": 0.5, "prefix_bitwise": True, "blocks_bitwise": True}
    signed_zero = dict(same, prefix=torch.tensor([1.0, 0.0]).bfloat16())  # equal values, other bits
    other_row = dict(same, blocks=torch.tensor([[1.0, 1.0], [1.0, 1.0078125]]).bfloat16())
    assert bench_vllm._against(torch.zeros(1), ref, torch.zeros(1), signed_zero)["prefix_bitwise"] is False
    assert bench_vllm._against(torch.zeros(1), ref, torch.zeros(1), other_row)["blocks_bitwise"] is False


def test_every_call_is_checked_on_the_inputs_as_drawn(bench_vllm):
    """The checks run each call on its own copy of the drawn inputs: an in-place call (vLLM's updates the prefix)
    must not hand its result to the next one, and the drawn set stays as it was for the timed copies."""
    import torch

    def in_place(bump):
        def call(s):
            def run():
                s["prefix"] += s["delta"] + bump
                s["blocks"][:, 0] = s["prefix"]
                return s["prefix"] * 2
            return run
        return call

    drawn = {"prefix": torch.ones(2, 4).bfloat16(), "delta": torch.full((2, 4), 0.5).bfloat16(),
             "blocks": torch.zeros(2, 3, 4).bfloat16()}
    kept = {k: v.clone() for k, v in drawn.items()}
    r = bench_vllm._against_vllm(in_place(0.0), {"same": in_place(0.0), "off": in_place(1.0)}, drawn)
    assert r["same"] == {"max_abs_diff": 0.0, "prefix_bitwise": True, "blocks_bitwise": True}
    assert r["off"] == {"max_abs_diff": 2.0, "prefix_bitwise": False, "blocks_bitwise": False}
    assert all(torch.equal(drawn[k], kept[k]) for k in drawn)


def test_standing_counts_each_peer_and_both(bench_vllm):
    t = lambda us: {"median_us": us}  # noqa: E731
    points = [{"T": 1, "N": 9, "attnres": t(2.0), "vllm": t(8.0), "flaggems": t(7.0)},
              {"T": 4096, "N": 2, "attnres": t(111.0), "vllm": t(112.0), "flaggems": t(103.0)},
              {"T": 4096, "N": 12, "attnres": t(337.0), "vllm": t(350.0)},  # FlagGems not timed: vLLM decides
              {"T": 128, "N": 1, "attnres": t(5.8), "vllm": t(5.5), "flaggems": t(5.8)}]  # level is not ahead
    assert bench_vllm._standing(points) == (
        "attnres ahead of vLLM at 3 of 4 points, of FlagGems at 1 of 3, of every kernel timed at 2 of 4; "
        "behind at T=4096 N=2, T=128 N=1")
