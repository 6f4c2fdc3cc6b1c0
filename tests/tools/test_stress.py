"""The stress runner (python -m stress, docs/reliability.md section 5) at CI size, and proof that its checks can
fail: a result with one flipped bit, an output off by 2 %, an input written by the call, and a fold that changes
one bit at one step of the decode chain are each reported as a failure (a checker that cannot fail checks
nothing). The CUDA cases run the same small campaigns on the GPU (streams, graph replays)."""

from __future__ import annotations

import json

import pytest
import torch

import stress
from attnres.models.kimi_k3 import residual
from conftest import requires_cuda

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CALL_OPS = {"attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent", "moe_finalize"}


def _failures(summary, kind):
    return [f for f in summary["failures"] if f["kind"] == kind]


# ------------------------------------------------------------------------------------------------ calls
def test_calls_on_the_cpu_have_no_mismatch():
    summary = stress.run_calls(240, device="cpu", seed=1, workers=2, quiet=True)
    assert summary["ok"], summary["failures"]
    assert summary["calls"] == summary["checked"] == 240
    assert summary["mismatches"] == summary["input_mutation_failures"] == summary["errors"] == 0
    assert summary["oracle_checks"] == 240 and summary["oracle_mismatches"] == 0
    assert set(summary["ops"]) == CALL_OPS
    assert summary["distinct_shapes"] > 200
    for variant in ("add", "add2", "tap", "snapshot", "row_pad", "shared", "norm", "remote", "layout=contiguous",
                    "layout=snapshot_major", "layout=token_major", "layout=strided"):
        assert summary["variants"].get(variant, 0) > 0, variant


def test_specs_are_reproducible_from_seed_and_index():
    a = [stress.draw_spec(7, i, "cpu", 256) for i in range(50)]
    b = [stress.draw_spec(7, i, "cpu", 256) for i in range(50)]
    assert a == b
    assert [s.describe() for s in a] != [stress.draw_spec(8, i, "cpu", 256).describe() for i in range(50)]
    call, again = stress.Call(a[3], torch.device("cpu")), stress.Call(a[3], torch.device("cpu"))
    for name in call.buffers:
        assert stress.same_bits(call.buffers[name], again.buffers[name]), name


def _corrupting(monkeypatch, corrupt):
    real = stress.calls.device_call

    def device_call(s, call):
        out = real(s, call)
        corrupt(s, call, out)
        return out

    monkeypatch.setattr(stress.calls, "device_call", device_call)


def test_checker_catches_one_flipped_bit_in_an_exact_output(monkeypatch):
    def flip(s, call, out):
        t = out.get("updated")
        if t is not None:
            t.view(torch.int16).view(-1)[0] ^= 1  # the last mantissa bit of one element

    _corrupting(monkeypatch, flip)
    summary = stress.run_calls(60, device="cpu", seed=2, workers=2, oracle_every=0, quiet=True)
    with_updated = sum(n for op, n in summary["ops"].items() if op in ("attn_res_add_rmsnorm",
                                                                       "attn_res_add_rmsnorm_persistent"))
    assert not summary["ok"] and summary["mismatches"] > 0
    flagged = _failures(summary, "mismatch")
    assert flagged and all("updated" in f["detail"] for f in flagged)
    assert all(f["spec"]["op"] in ("attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent") for f in flagged)
    assert summary["mismatches"] <= with_updated  # only calls with an updated (persistent without add has none)


def test_checker_catches_an_output_outside_the_tolerance(monkeypatch):
    def scale(s, call, out):
        t = out.get("output", out.get("mixture"))
        t.mul_(1.02)

    _corrupting(monkeypatch, scale)
    summary = stress.run_calls(40, device="cpu", seed=3, workers=2, oracle_every=0, quiet=True)
    assert summary["mismatches"] == summary["calls"] == 40, summary


def test_checker_catches_an_input_written_by_the_call(monkeypatch):
    def write(s, call, out):
        if s.op != "moe_finalize":
            call.views["prefix"][0, 0] += 1

    _corrupting(monkeypatch, write)
    summary = stress.run_calls(30, device="cpu", seed=4, workers=2, oracle_every=0, quiet=True)
    expected = summary["calls"] - summary["ops"].get("moe_finalize", 0)
    assert summary["input_mutation_failures"] == expected > 0
    assert not summary["ok"]


def test_oracle_check_catches_what_both_backends_share(monkeypatch):
    """On the CPU the device call and the reference are the same backend: the float64 oracle is what would see
    a wrong result they agree on (here: both calls' output scaled)."""
    real = stress.calls.run_op

    def run_op(s, v, options):
        out = real(s, v, options)
        for name in ("output", "mixture"):
            if name in out:
                out[name] = (out[name].float() * 1.02).to(out[name].dtype)
        return out

    monkeypatch.setattr(stress.calls, "run_op", run_op)
    summary = stress.run_calls(20, device="cpu", seed=5, workers=2, quiet=True)
    assert summary["mismatches"] == 0 and summary["oracle_mismatches"] == summary["calls"] == 20


def test_cli_prints_the_summary_and_exits_by_the_result(capsys, monkeypatch):
    assert stress.main(["calls", "--count", "12", "--device", "cpu", "--quiet", "--workers", "1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["calls"] == 12 and summary["ok"]

    def flip(s, call, out):
        for t in out.values():
            t.view(torch.uint8).view(-1)[0] ^= 0x40

    _corrupting(monkeypatch, flip)
    assert stress.main(["calls", "--count", "12", "--device", "cpu", "--quiet", "--workers", "1"]) == 1
    captured = capsys.readouterr()
    assert "FAILED mismatch" in captured.err and not json.loads(captured.out.strip().splitlines()[-1])["ok"]
    assert stress.main(["calls", "--count", "0", "--device", "cpu"]) == 2


# ------------------------------------------------------------------------------------------------ chain
def test_chain_fold_on_equals_fold_off_over_dependent_steps():
    summary = stress.run_chain(16, device="cpu", check_every=4, quiet=True)
    assert summary["ok"], summary["diffs"]
    assert summary["steps"] == 16 and summary["checked_steps"] == 4
    assert summary["mismatches"] == summary["digest_mismatch_steps"] == 0
    assert summary["folded_sites_per_step"] > 0


def test_chain_catches_one_bit_at_one_step_between_checks(monkeypatch):
    """The fold changes one bit of one site's output at step 6 only; the full-state checks run at steps 5 and
    10: the per-step digest names step 6, and the divergence carried into step 10's state is seen too."""
    real = residual.try_fold
    calls = {"n": 0}
    cfg = stress.chain_config("cpu", None, None, None)
    folds_per_step = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))  # one consumer per tail

    def try_fold(*args, **kwargs):
        route, result = real(*args, **kwargs)
        calls["n"] += 1
        # run_chain's probe step (counting the folded sites) folds first, then steps 1, 2, ...: step 6's third fold.
        if result is not None and calls["n"] == (1 + 5) * folds_per_step + 3:
            result.output.view(torch.int16).view(-1)[0] ^= 1
        return route, result

    monkeypatch.setattr(residual, "try_fold", try_fold)
    summary = stress.run_chain(10, device="cpu", check_every=5, quiet=True)
    assert not summary["ok"]
    assert summary["first_digest_mismatch_step"] == 6
    assert summary["first_mismatch_step"] == 10
    assert summary["mismatches"] > 0


def test_chain_cli(capsys):
    assert stress.main(["chain", "--steps", "3", "--device", "cpu", "--check-every", "2", "--quiet",
                        "--layers", "9", "--hidden", "64"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] and summary["steps"] == 3 and summary["checked_steps"] == 2 and summary["layers"] == 9
    assert stress.main(["chain", "--steps", "0", "--device", "cpu"]) == 2


# ------------------------------------------------------------------------------------------------ CUDA
@requires_cuda
@pytest.mark.gpu
def test_calls_on_cuda_streams_and_graphs_have_no_mismatch():
    summary = stress.run_calls(300, device="cuda", streams=3, graph_every=25, seed=11, quiet=True)
    assert summary["ok"], summary["failures"]
    assert summary["graph_replays"] == 2 * summary["graph_captures"] == 24 and summary["graph_mismatches"] == 0
    assert summary["mismatches"] == summary["input_mutation_failures"] == 0


@requires_cuda
@pytest.mark.gpu
def test_calls_on_cuda_catch_a_flipped_bit(monkeypatch):
    def flip(s, call, out):
        t = out.get("updated")
        if t is not None:
            t.view(torch.int16).view(-1)[0] ^= 1

    _corrupting(monkeypatch, flip)
    summary = stress.run_calls(40, device="cuda", streams=2, graph_every=0, seed=12, quiet=True)
    assert summary["mismatches"] > 0 and not summary["ok"]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
def test_chain_on_cuda_real_width(eager):
    summary = stress.run_chain(12, device="cuda", layers=13, check_every=4, eager=eager, quiet=True)
    assert summary["ok"], summary
    assert summary["hidden"] == 7168 and summary["graph"] == (not eager) and summary["checked_steps"] == 3
