"""Who reads the environment knobs (docs/knobs.md, "Who reads them"): importing attnres, the ops, attnres.plan,
Options and the command-line entry points read none, so a bad model knob cannot break a caller who only uses
the library; building the model reads every knob and raises KnobError naming the bad one; the MoE finalize
gates read only their own token gate."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import attnres.knobs as knobs
from attnres.knobs import KnobError
from helpers import ROOT

# Every knob set to a value its grammar rejects.
BAD_ENV = {k.name: "garbage" for k in knobs.KNOBS}

# Runs in a fresh interpreter with BAD_ENV; ends by checking that no knob was read at all.
LIBRARY_CALLS = r"""
import torch
import attnres
import attnres.knobs
import attnres.models.kimi_k3 as kimi
from attnres.all_reduce import supports_moe_finalize_all_reduce

b = torch.bfloat16
T, K, H = 2, 3, 64
lr, add, bank = torch.randn(T, H, dtype=b), torch.randn(T, H, dtype=b), torch.randn(K, T, H, dtype=b)
w, ones = torch.randn(H, dtype=b), torch.ones(H, dtype=b)
attnres.attn_res(lr, bank, w, ones, 1e-6)
attnres.attn_res_rmsnorm(lr, bank, w, ones, ones, 1e-6, 1e-6)
attnres.attn_res_add_rmsnorm(lr, add, bank, w, ones, ones, 1e-6, 1e-6)
rows, weights = torch.randn(5, H, dtype=b), torch.rand(T, 2)
index = torch.randint(0, 5, (T, 2), dtype=torch.int32)
attnres.moe_finalize(rows, weights, index, eps=1e-6, norm_weight=ones)
attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=K + 1, hidden=H, add=True)
attnres.backend_info()
attnres.Options(topology="split", split_max_tokens=8).to_c()
assert attnres.supports_fused_moe_finalize(1, 16, 3584, max_tokens=16) == (True, "")
supports_moe_finalize_all_reduce(1, 16, 3584, 2, max_tokens=16)
settings = kimi.ResidualSettings(fold=True)
kimi.KimiK3Model(kimi.KimiK3Config.small(hidden_size=64, num_layers=4, snapshot_block=2), settings=settings)

assert "CURRENT" not in vars(attnres.knobs), "something built attnres.knobs.CURRENT"
assert attnres.knobs._read == {}, f"knobs read: {sorted(attnres.knobs._read)}"
print("no knob read")
"""


def _python(args: list[str], env_updates: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in BAD_ENV}
    env.update(env_updates)
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture
def fresh_knobs(monkeypatch):
    """This process's knob state as if nothing had read a knob yet (restored afterwards)."""
    monkeypatch.delattr(knobs, "CURRENT", raising=False)
    monkeypatch.setattr(knobs, "_read", {})
    for name in BAD_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_import_ops_plan_options_gates_and_a_model_with_settings_read_no_knob():
    out = _python(["-c", LIBRARY_CALLS], BAD_ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("no knob read")


@pytest.mark.parametrize("argv", [["attnres", "--help"], ["attnres", "demo", "--help"], ["attnres", "bench", "--help"],
                                  ["bench", "--help"], ["stress", "--help"], ["tp_check", "--help"]], ids=" ".join)
def test_entry_point_help_reads_no_knob(argv):
    out = _python(["-m", *argv], BAD_ENV)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower() and "KnobError" not in out.stderr


def test_demo_runs_with_bad_knobs():
    out = _python(["-m", "attnres", "demo", "--device", "cpu", "--tokens", "1", "--repeats", "1", "--hidden", "64",
                   "--layers", "4", "--block", "2"], BAD_ENV)
    assert out.returncode == 0, out.stderr
    assert "KnobError" not in out.stderr


def test_building_the_model_in_a_fresh_interpreter_raises_naming_the_knob():
    code = ("import attnres.models.kimi_k3 as kimi; "
            "kimi.KimiK3Model(kimi.KimiK3Config.small(hidden_size=64, num_layers=4, snapshot_block=2))")
    out = _python(["-c", code], {"KIMI_K3_MOE_TAIL_ADD_FOLD": "true"})
    assert out.returncode != 0
    assert "KnobError: KIMI_K3_MOE_TAIL_ADD_FOLD: expected 0 or 1, got 'true'" in out.stderr


@pytest.mark.parametrize("name", sorted(BAD_ENV))
def test_building_the_model_raises_naming_each_bad_knob(fresh_knobs, name):
    from attnres.models.kimi_k3 import KimiK3Config, KimiK3Model

    fresh_knobs.setenv(name, "garbage")
    config = KimiK3Config.small(hidden_size=64, num_layers=4, snapshot_block=2)
    with pytest.raises(KnobError, match=rf"^{name}: .*'garbage'"):
        KimiK3Model(config)
    with pytest.raises(KnobError, match=rf"^{name}: "):  # a failed read is not remembered: it raises again
        KimiK3Model(config)
    assert "CURRENT" not in vars(knobs)


def test_tp_chain_reads_the_knobs_when_built(fresh_knobs):
    from attnres.models.kimi_k3.tp import FusedAllReduce

    fresh_knobs.setenv("ATTNRES_FUSED_ALL_REDUCE", "true")
    with pytest.raises(KnobError, match="^ATTNRES_FUSED_ALL_REDUCE: "):
        FusedAllReduce()
    assert FusedAllReduce(enabled=False).enabled is False  # an explicit setting reads no knob


def test_finalize_gate_reads_only_its_own_knob(fresh_knobs):
    from attnres.all_reduce import supports_moe_finalize_all_reduce
    from attnres.moe import supports_fused_moe_finalize

    for name in BAD_ENV:
        if name not in ("ATTNRES_MOE_FINALIZE_MAX_TOKENS", "ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS"):
            fresh_knobs.setenv(name, "garbage")
    fresh_knobs.setenv("ATTNRES_MOE_FINALIZE_MAX_TOKENS", "3")
    fresh_knobs.setenv("ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS", "5")
    assert supports_fused_moe_finalize(3, 16, 3584) == (True, "")
    assert supports_fused_moe_finalize(4, 16, 3584)[1] == ("T = 4 is above the token gate "
                                                          "(ATTNRES_MOE_FINALIZE_MAX_TOKENS = 3)")
    assert "above the token gate 5" in supports_moe_finalize_all_reduce(6, 16, 3584, 2)[1]
    assert sorted(knobs._read) == ["ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS", "ATTNRES_MOE_FINALIZE_MAX_TOKENS"]
    # read once: a later change of the environment does not move the gate
    fresh_knobs.setenv("ATTNRES_MOE_FINALIZE_MAX_TOKENS", "16")
    assert not supports_fused_moe_finalize(4, 16, 3584)[0]


def test_finalize_gate_raises_on_its_own_bad_knob(fresh_knobs):
    from attnres.moe import supports_fused_moe_finalize

    fresh_knobs.setenv("ATTNRES_MOE_FINALIZE_MAX_TOKENS", "16 tokens")
    with pytest.raises(KnobError, match=r"^ATTNRES_MOE_FINALIZE_MAX_TOKENS: .*'16 tokens'"):
        supports_fused_moe_finalize(1, 16, 3584)
    assert supports_fused_moe_finalize(1, 16, 3584, max_tokens=16) == (True, "")  # an explicit gate reads nothing


def test_current_and_value_agree_after_either_is_read_first(fresh_knobs):
    fresh_knobs.setenv("ATTNRES_MOE_FINALIZE_MAX_TOKENS", "7")
    assert knobs.value("ATTNRES_MOE_FINALIZE_MAX_TOKENS") == 7
    fresh_knobs.setenv("ATTNRES_MOE_FINALIZE_MAX_TOKENS", "9")
    assert knobs.CURRENT.moe_finalize_max_tokens == 7
    assert knobs.CURRENT is knobs.CURRENT
    with pytest.raises(KeyError, match="no knob named"):
        knobs.value("KIMI_K3_NOT_A_KNOB")
