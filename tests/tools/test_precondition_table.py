"""tools/precondition_table.py (docs/preconditions.md): every precondition message in the source, in every op
family (attention ops with their FP8 output, moe_finalize, the all-reduce ops), has a test that provokes it, the
page shows what the script generates, and the checker behind that claim can fail."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from helpers import ROOT


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("precondition_table", ROOT / "tools" / "precondition_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["precondition_table"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def messages(table):
    return table.collect()


def _find(messages, family, text):
    found = [m for m in messages if m.family == family and m.text() == text]
    assert found, f"{family}: no message {text!r}"
    return found[0]


def test_every_precondition_message_has_a_test(table, messages):
    uncovered = [f"{m.source}: {m.text()}" for m in messages if not m.tests and not m.unreachable]
    assert not uncovered, "messages no test provokes (add a rejection test):\n" + "\n".join(uncovered)
    listed = {(m.family, m.arg, m.text()) for m in messages}
    stale = [key for key in table.UNREACHABLE if key not in listed]
    assert not stale, f"UNREACHABLE entries for messages that no longer exist: {stale}"


def test_every_source_contributes_its_messages(messages):
    by_file = {}
    for m in messages:
        by_file.setdefault(m.source.split(":")[0], []).append(m)
    for path in ("cpp/src/checks.hpp", "cpp/src/validate.cpp", "cpp/src/plan.cpp", "cpp/src/moe_finalize_validate.cpp",
                 "python/attnres/_tensors.py", "python/attnres/ops.py", "python/attnres/_attn_ops.py",
                 "python/attnres/options.py", "python/attnres/planning.py", "python/attnres/moe_ops.py",
                 "python/attnres/moe_tail.py", "cpp/src/all_reduce_validate.cpp", "python/attnres/all_reduce.py",
                 "python/attnres/fp8.py"):
        assert by_file.get(path), f"no message parsed from {path}"
    # Each fail(...) site of the validators is listed (a site with a computed argument at least once; a message
    # raised at two sites, e.g. all_reduce's "output overlaps gathered", is listed once).
    for path, minimum in (("cpp/src/validate.cpp", 20), ("cpp/src/moe_finalize_validate.cpp", 18),
                          ("cpp/src/all_reduce_validate.cpp", 25)):
        sites = {m.source for m in by_file[path]}
        text = (ROOT / path).read_text()
        calls = text.count("fail(") - text.count("void fail(")
        assert len(sites) >= min(minimum, calls), (path, len(sites), calls)


def test_known_messages_and_their_tests(messages):
    m = _find(messages, "attention", "layer_residual must hold T >= 1 tokens, got shape <...>")
    assert any("test_zero_tokens" in t for t in m.tests) and any("ZeroTokens" in t for t in m.tests), m.tests
    m = _find(messages, "moe", "rows row stride <...> must be a multiple of 8 elements (16 bytes)")
    assert any("rows_padded_stride_68" in t for t in m.tests), m.tests
    m = _find(messages, "attention", "options.cluster must be in [0, <...>], got <...>")
    assert any("ClusterTooLarge" in t for t in m.tests), m.tests
    m = _find(messages, "moe", "weights must be float32 or bfloat16, got <dtype>")
    assert any("weights_f16" in t for t in m.tests), m.tests
    assert "a.weights.dtype != DType::f32" in m.rule
    m = _find(messages, "attention", "Options.pdl must be a bool, got <...>")
    assert m.language == "Python" and any("test_options_validation" in t for t in m.tests)


def test_every_family_is_read(table, messages):
    """The three families, the FP8 output's rules among the attention ops', the shared checks per family."""
    assert {m.family for m in messages} == set(table.FAMILIES)
    m = _find(messages, "all_reduce", "comm.world_size must be in [1, <...>], got <...>")
    assert any("AllReduceRejections.WorldSize" in t for t in m.tests), m.tests
    m = _find(messages, "all_reduce", "gathered has a null data pointer")  # checks.hpp's layout, all-reduce callers
    assert any("GatheredLayoutAndDevice" in t for t in m.tests), m.tests
    m = _find(messages, "attention", "fp8_scales must be 4-byte aligned")
    assert m.source.startswith("cpp/src/validate.cpp") and m.tests, m
    # A shared check that no validator of a family calls is not listed for it (moe_finalize's scale alone is).
    assert not [m for m in messages if m.family != "moe" and "must be finite, got" in m.text()]


def test_docs_page_is_the_generated_table(table, messages):
    text = table.DOC.read_text()
    begin, end = "<!-- precondition-table:begin -->\n", "<!-- precondition-table:end -->"
    shown = text[text.index(begin) + len(begin):text.index(end)]
    assert shown == table.markdown(messages) + "\n", \
        "docs/preconditions.md is stale: run python3 tools/precondition_table.py --write-docs"
    assert len(text.encode()) <= 40_000, "docs/preconditions.md is over 40 KB: make the table more compact"


def test_checker_reports_a_message_whose_tests_are_gone(table, messages):
    """Without the rejection test files, their messages must come back as untested: the matcher does not
    count unrelated literals as coverage."""
    literals = [lit for lit in table.test_literals()
                if not any(name in lit.where for name in ("test_rejections", "test_moe_finalize"))]
    picked = [_find(messages, "attention", "snapshot_slot is out of range"),
              _find(messages, "moe", "rows row stride <...> must be a multiple of 8 elements (16 bytes)"),
              _find(messages, "moe", "index has a null data pointer")]
    copies = [table.Message(m.family, m.source, m.arg, m.parts, m.rule, m.language) for m in picked]
    table.coverage(copies, literals)
    assert [c.tests for c in copies[:2]] == [[], []], [c.tests for c in copies]
    assert copies[2].tests == []


def test_a_literal_that_stops_early_still_counts_but_a_bare_name_does_not(table):
    msg = table.Message("moe", "x:1", "rows", [("lit", "has an overlapping layout (shape "), ("var", "any"),
                                               ("lit", "): every element must have its own address")], "", "C++")
    lits = [table.TestLiteral("rows has an overlapping lay", "moe", "a"),  # 18 characters of the rule: counts
            table.TestLiteral("rows has an", "moe", "b"),  # too little of the rule
            table.TestLiteral("rows_overlapping", "moe", "c"),  # a case id, not a message
            table.TestLiteral("rows has an overlapping layout (shape [2, 64], strides [0, 1]): every element", "attention",
                              "d")]  # another family
    table.coverage([msg], lits)
    assert msg.tests == ["a"]


def test_cli_check_passes(table, capsys):
    assert table.main(["--check"]) == 0
    assert "0 without a test" in capsys.readouterr().out
