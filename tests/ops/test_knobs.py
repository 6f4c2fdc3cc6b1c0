"""Every environment knob (attnres.knobs.KNOBS) against the grammar of docs/knobs.md: valid values, whitespace,
garbage -> KnobError naming the knob, the allowed values and the raw value; integers outside the range clamped
with exactly one logged notice; booleans exactly 0/1; words exactly as listed; read once, at the first use
(tests/ops/test_knobs_not_read_by_ops.py: who reads them)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import attnres.knobs as knobs
from attnres.knobs import BoolKnob, IntKnob, KnobError, WordKnob
from helpers import ROOT

INT_KNOBS = [k for k in knobs.KNOBS if isinstance(k, IntKnob)]
BOOL_KNOBS = [k for k in knobs.KNOBS if isinstance(k, BoolKnob)]
WORD_KNOBS = [k for k in knobs.KNOBS if isinstance(k, WordKnob)]
ids = lambda k: k.name  # noqa: E731

EXPECTED = {  # name -> (default, kind-specific domain): pins the table of docs/knobs.md and model.md
    "KIMI_K3_MOE_TAIL_ADD_FOLD": (False, None),
    "KIMI_K3_FUSED_ATTN_RES": (True, None),
    "KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS": (32, (0, 16384)),
    "KIMI_K3_ATTN_RES_TOPOLOGY": ("auto", ("auto", "per_token", "persistent", "split")),
    "KIMI_K3_AUX_ATTN_RES_STREAM": (True, None),
    "KIMI_K3_ATTN_RES_FP8": ("none", ("none", "per_token", "block128", "per_token_pow2", "block128_pow2")),
    "ATTNRES_MOE_FINALIZE_MAX_TOKENS": (16, (0, 16)),
    "ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS": (16, (0, 16)),
    "ATTNRES_FUSED_ALL_REDUCE": (True, None),
}


def _env(name: str, raw: str) -> dict[str, str]:
    return {name: raw}


def _value(name: str, raw: str | None):
    env = {} if raw is None else _env(name, raw)
    return getattr(knobs.load(env), knobs._FIELDS[name])


def test_every_knob_is_known_with_its_default_and_domain():
    assert sorted(k.name for k in knobs.KNOBS) == sorted(EXPECTED)
    for k in knobs.KNOBS:
        default, domain = EXPECTED[k.name]
        assert k.default == default, k.name
        assert _value(k.name, None) == default
        if isinstance(k, IntKnob):
            assert (k.lo, k.hi) == domain
        if isinstance(k, WordKnob):
            assert k.words == domain


@pytest.mark.parametrize("k", knobs.KNOBS, ids=ids)
@pytest.mark.parametrize("raw", ["", "   ", "\t\n"])
def test_unset_or_blank_takes_the_default(k, raw):
    assert _value(k.name, raw) == k.default


# ------------------------------------------------------------------------------------------------ integers
@pytest.mark.parametrize("k", INT_KNOBS, ids=ids)
def test_int_valid_values_and_whitespace(k):
    mid = (k.lo + k.hi) // 2
    for raw, expected in [(str(k.lo), k.lo), (str(k.hi), k.hi), (str(mid), mid), (f"  {mid}\t", mid),
                          (f"\n{k.hi}\n", k.hi), (f"+{k.hi}", k.hi), (f"0{k.hi}", k.hi)]:
        assert _value(k.name, raw) == expected, raw


@pytest.mark.parametrize("k", INT_KNOBS, ids=ids)
@pytest.mark.parametrize("raw", ["abc", "1.5", "2e3", "0x10", "1_0", "3 4", "--1", "+", "-", "1,", "１", "true", "nan"])
def test_int_garbage_raises_naming_knob_range_and_value(k, raw):
    with pytest.raises(KnobError) as e:
        knobs.load(_env(k.name, raw))
    msg = str(e.value)
    assert k.name in msg and f"[{k.lo}, {k.hi}]" in msg and repr(raw) in msg


@pytest.mark.parametrize("k", INT_KNOBS, ids=ids)
@pytest.mark.parametrize("side", ["above", "below", "far_above"])
def test_int_out_of_range_clamps_with_one_notice(k, side, caplog):
    raw = {"above": str(k.hi + 1), "below": str(k.lo - 1), "far_above": "123456789012345678901234567890"}[side]
    expected = k.lo if side == "below" else k.hi
    with caplog.at_level(logging.DEBUG, logger="attnres.knobs"):
        assert _value(k.name, f" {raw} ") == expected
    notices = [r for r in caplog.records if r.name == "attnres.knobs"]
    assert len(notices) == 1, [r.getMessage() for r in notices]
    text = notices[0].getMessage()
    assert k.name in text and str(expected) in text and raw in text


@pytest.mark.parametrize("k", INT_KNOBS, ids=ids)
def test_int_in_range_logs_nothing(k, caplog):
    with caplog.at_level(logging.DEBUG, logger="attnres.knobs"):
        _value(k.name, str(k.hi))
    assert not [r for r in caplog.records if r.name == "attnres.knobs"]


def test_moe_finalize_zero_disables():
    assert _value("ATTNRES_MOE_FINALIZE_MAX_TOKENS", "0") == 0


# ------------------------------------------------------------------------------------------------ booleans
@pytest.mark.parametrize("k", BOOL_KNOBS, ids=ids)
def test_bool_accepts_exactly_0_and_1(k):
    assert _value(k.name, "0") is False and _value(k.name, "1") is True
    assert _value(k.name, " 1\n") is True and _value(k.name, "\t0 ") is False


@pytest.mark.parametrize("k", BOOL_KNOBS, ids=ids)
@pytest.mark.parametrize("raw", ["true", "false", "yes", "no", "on", "off", "2", "-1", "01", "00", "1.0", "+1", "O",
                                 "l"])
def test_bool_garbage_raises(k, raw):
    with pytest.raises(KnobError) as e:
        knobs.load(_env(k.name, raw))
    msg = str(e.value)
    assert k.name in msg and "0 or 1" in msg and repr(raw) in msg


# ------------------------------------------------------------------------------------------------ words
@pytest.mark.parametrize("k", WORD_KNOBS, ids=ids)
def test_word_accepts_each_listed_word(k):
    for w in k.words:
        assert _value(k.name, w) == w
        assert _value(k.name, f"  {w}\n") == w


@pytest.mark.parametrize("k", WORD_KNOBS, ids=ids)
@pytest.mark.parametrize("raw", ["PER_TOKEN", "Persistent", "per-token", "pertoken", "split,", "1", "AUTO",
                                 "per_token x"])
def test_word_garbage_raises_naming_the_words(k, raw):
    with pytest.raises(KnobError) as e:
        knobs.load(_env(k.name, raw))
    msg = str(e.value)
    assert k.name in msg and repr(raw) in msg and all(w in msg for w in k.words)


# ------------------------------------------------------------------------------------------------ load
def test_load_reads_every_knob_from_one_mapping():
    env = {"KIMI_K3_MOE_TAIL_ADD_FOLD": "1", "KIMI_K3_FUSED_ATTN_RES": "0",
           "KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS": "7", "KIMI_K3_ATTN_RES_TOPOLOGY": "split",
           "KIMI_K3_AUX_ATTN_RES_STREAM": "0", "KIMI_K3_ATTN_RES_FP8": "block128_pow2",
           "ATTNRES_MOE_FINALIZE_MAX_TOKENS": "16",
           "ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS": "3", "ATTNRES_FUSED_ALL_REDUCE": "0", "UNRELATED": "garbage"}
    assert knobs.load(env) == knobs.Knobs(moe_tail_add_fold=True, fused_attn_res=False, fused_attn_res_max_tokens=7,
                                          attn_res_topology="split", aux_attn_res_stream=False,
                                          attn_res_fp8="block128_pow2",
                                          moe_finalize_max_tokens=16, moe_finalize_allreduce_max_tokens=3,
                                          fused_all_reduce=False)


def test_one_bad_knob_fails_the_whole_load():
    with pytest.raises(KnobError, match="KIMI_K3_ATTN_RES_TOPOLOGY"):
        knobs.load({"KIMI_K3_MOE_TAIL_ADD_FOLD": "1", "KIMI_K3_ATTN_RES_TOPOLOGY": "fast"})


def test_knob_error_is_a_value_error():
    assert issubclass(KnobError, ValueError)


# ------------------------------------------------------------------------------------------------ read once
def test_current_is_not_reread_after_the_first_read(monkeypatch):
    before = knobs.CURRENT
    flipped = {"KIMI_K3_MOE_TAIL_ADD_FOLD": "0" if before.moe_tail_add_fold else "1",
               "KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS": str(before.fused_attn_res_max_tokens + 1),
               "KIMI_K3_ATTN_RES_TOPOLOGY": "persistent" if before.attn_res_topology != "persistent" else "split",
               "ATTNRES_MOE_FINALIZE_MAX_TOKENS": "not a number"}
    for name, value in flipped.items():
        monkeypatch.setenv(name, value)
    from attnres.models.kimi_k3 import ResidualSettings

    assert knobs.CURRENT is before
    assert ResidualSettings.from_knobs() == ResidualSettings.from_knobs(before)
    assert ResidualSettings.from_knobs().fold == before.moe_tail_add_fold


def _python(code: str, env_updates: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in EXPECTED}
    env.update(env_updates)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_first_read_takes_the_environment_once_and_a_typo_fails_at_the_model_build():
    code = ("import os, attnres.knobs as k; a = k.CURRENT; os.environ['KIMI_K3_MOE_TAIL_ADD_FOLD'] = '0'; "
            "import attnres.models.kimi_k3 as m; s = m.ResidualSettings.from_knobs(); "
            "print(a.moe_tail_add_fold, a.fused_attn_res_max_tokens, a.attn_res_topology, k.CURRENT is a, s.fold)")
    ok = _python(code, {"KIMI_K3_MOE_TAIL_ADD_FOLD": "1", "KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS": " 8 ",
                        "KIMI_K3_ATTN_RES_TOPOLOGY": "split"})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["True", "8", "split", "True", "True"]

    code = ("import attnres.models.kimi_k3 as m; print('imported', flush=True); "
            "m.KimiK3Model(m.KimiK3Config.small(hidden_size=64, num_layers=4, snapshot_block=2))")
    bad = _python(code, {"KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS": "32tokens"})
    assert bad.returncode != 0
    assert bad.stdout.strip() == "imported"  # importing the model package reads no knob; building it does
    assert "KnobError" in bad.stderr and "KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS" in bad.stderr
    assert "'32tokens'" in bad.stderr


# ------------------------------------------------------------------------------------------------ docs
def test_docs_list_every_knob_with_its_default():
    text = (ROOT / "docs" / "knobs.md").read_text()
    for k in knobs.KNOBS:
        default = {True: "1", False: "0"}.get(k.default, str(k.default)) if isinstance(k, BoolKnob) else str(k.default)
        row = next((line for line in text.splitlines() if line.startswith(f"| `{k.name}`")), None)
        assert row is not None, f"docs/knobs.md has no table row for {k.name}"
        assert f"| `{default}` |" in row, f"docs/knobs.md: {k.name}'s row does not show its default {default}"
