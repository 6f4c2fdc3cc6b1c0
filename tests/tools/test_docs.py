"""The docs stay true to the tree: every relative link in README.md and docs/ resolves (the file, and its #anchor
by GitHub's rules), every results file they cite is committed, every `python -m attnres ...` (or `torchrun ... -m
attnres...`) command line shown in them, and every one of the checkout's harnesses (`python -m bench ...`,
`stress`, `tp_check`), parses with its entry point's own argparse parser (nothing runs: a few seconds for all of
them), no page is over 40 KB, and the CPU demo's H200 figures are the committed file's."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from helpers import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
MAX_PAGE_BYTES = 40_000

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _block_lines(text: str) -> set[int]:
    """Line numbers inside fenced code blocks (and their fences) or indented code blocks."""
    out, fenced, previous = set(), False, ""
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            out.add(n)
        elif fenced or (line.startswith("    ") and line.strip() and (not previous.strip() or n - 1 in out)
                        and not line.lstrip().startswith(("*", "-", "|"))):
            out.add(n)
        previous = line
    return out


def _prose_and_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose lines with inline code removed, code: code-block lines and inline code spans)."""
    prose, code = [], []
    blocks = _block_lines(text)
    for n, line in enumerate(text.splitlines(), 1):
        if n in blocks:
            code.append((n, line))
            continue
        code += [(n, m.group(2)) for m in INLINE_CODE.finditer(line)]
        prose.append((n, INLINE_CODE.sub("", line)))
    return prose, code


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: markup dropped, lower case, punctuation other than '-' and '_' removed,
    spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    blocks = _block_lines(path.read_text())
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m or n in blocks:
            continue
        base = github_anchor(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")  # GitHub numbers repeated headings
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    return out


def relative_links() -> list[tuple[Path, int, str]]:
    out = []
    for page in PAGES:
        prose, _ = _prose_and_code(page.read_text())
        for n, line in prose:
            for m in LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                out.append((page, n, target))
    return out


def test_github_anchor_rules():
    assert github_anchor("4. Errors and the preconditions every attention op checks") == \
        "4-errors-and-the-preconditions-every-attention-op-checks"
    assert github_anchor("`moe_finalize` and the all-reduce (W = 2)") == "moe_finalize-and-the-all-reduce-w--2"
    assert github_anchor("3. Property-based tests (fuzzing)") == "3-property-based-tests-fuzzing"


def test_every_relative_link_resolves():
    links = relative_links()
    assert len(links) > 50, "the link parser found almost nothing: it is broken"
    broken = []
    for page, n, target in links:
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        where = f"{_rel(page)}:{n}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading #{anchor} in {_rel(dest)})")
        elif anchor and dest.suffix != ".md" and not re.fullmatch(r"L\d+(-L\d+)?", anchor):
            broken.append(f"{where} (an anchor into a non-markdown file)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_page_is_over_40_kb():
    big = [f"{_rel(p)}: {p.stat().st_size} bytes" for p in PAGES if p.stat().st_size > MAX_PAGE_BYTES]
    assert not big, big


RESULTS_FILE = re.compile(r"\b(h200(?:x\d)?_[0-9a-f]{7}_[\w*]+\.(?:json|txt))")


def test_every_cited_results_file_exists():
    """A figure's results file, cited with or without its `bench_results/` folder (a `*` is a pattern)."""
    cited, missing = 0, []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for name in RESULTS_FILE.findall(line):
                cited += 1
                if not list((ROOT / "bench_results").glob(name)):
                    missing.append(f"{_rel(page)}:{n}: {name}")
    assert cited > 20, "the results-file pattern found almost nothing: it is broken"
    assert not missing, "results files cited but not in bench_results/:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------------------- command lines
# `python -m attnres...` and `torchrun [its options] -m attnres...`, and the same of the harnesses that run from a
# checkout (bench, stress, tp_check): the arguments up to a comment or shell operator.
HARNESSES = ("bench", "stress", "tp_check")
COMMAND = re.compile(r"(?:python3?|torchrun(?:\s+--?[\w-]+(?:[= ]\d+)?)*) -m ((?:attnres|" + "|".join(HARNESSES)
                     + r")\b(?:\.\w+)*)((?:\s+[^\s#;|&`)]+)*)")


def commands() -> list[tuple[Path, int, str, list[str]]]:
    out = []
    for page in PAGES:
        _, code = _prose_and_code(page.read_text())
        for n, line in code:
            for m in COMMAND.finditer(line):
                try:
                    argv = shlex.split(m.group(2))
                except ValueError:  # an unbalanced quote: not a command line as shown
                    argv = [m.group(2)]
                out.append((page, n, m.group(1), argv))
    return out


def _parser_of(module: str) -> argparse.ArgumentParser:
    """The argparse parser of `python -m module`: its own parser(), or its cli's."""
    for name in (f"{module}.cli", f"{module}.__main__", module):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                continue
            raise
        if callable(getattr(mod, "parser", None)):
            return mod.parser()
    raise AssertionError(f"python -m {module}: no entry point with a parser() found")


def parse(module: str, argv: list[str]) -> None:
    """Parses argv as `python -m module` would (the top-level command forwards bench to its own parser); raises
    AssertionError with argparse's message when it does not parse."""
    if module == "attnres" and argv and not argv[0].startswith("-"):
        top = importlib.import_module("attnres.__main__")
        if argv[0] in top.FORWARDED:
            forwarded = top.FORWARDED[argv[0]][0]
            return parse(forwarded.removesuffix(".__main__").removesuffix(".cli"), argv[1:])
    if argv and argv[-1] in ("…", "..."):  # "python -m attnres …": any command line of it
        argv = argv[:-1]
    if not argv:  # the entry point named in prose ("`python -m stress`"): it must exist
        _parser_of(module)
        return None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parser_of(module).parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise AssertionError(err.getvalue().strip().splitlines()[-1]) from None


def test_every_shown_command_line_parses():
    found = commands()
    assert len(found) > 20, "the command parser found almost nothing: it is broken"
    failures = []
    for page, n, module, argv in found:
        try:
            parse(module, argv)
        except AssertionError as e:
            failures.append(f"{_rel(page)}:{n}: python -m {module} {' '.join(argv)}: {e}")
    assert not failures, "command lines in the docs that do not parse:\n" + "\n".join(failures)


def test_the_command_check_has_teeth():
    parse("attnres", ["demo", "--tokens", "1,8"])
    parse("stress", ["calls", "--count", "10"])
    for module, argv in (("attnres", ["demo", "--steps", "1"]), ("attnres", ["demo", "--fold", "on"]),
                         ("stress", ["calls", "--no-such-flag"])):
        with pytest.raises(AssertionError, match="unrecognized arguments|invalid choice"):
            parse(module, argv)


def test_the_demo_quotes_the_committed_h200_results():
    """The CPU demo's H200 lines are the committed results file's figures (a rerun that replaces the file must
    update attnres/demo.py with it)."""
    import json

    from attnres import demo

    data = json.loads((ROOT / demo.H200_CHAIN_FILE).read_text())
    assert data["meta"]["gpu"].startswith("NVIDIA H200")
    got = {}
    for r in data["records"]:
        assert r["suite"] == "chain" and r["graph"] and r["layers"] == 93 and r["moe_layers"] == demo.H200_MOE_LAYERS
        got.setdefault(r["T"], {})[r["fold"]] = r["median_us"]
    assert set(got) == set(demo.H200_CHAIN_US)
    for t, (off, on) in demo.H200_CHAIN_US.items():
        assert off == pytest.approx(got[t][False], abs=0.01) and on == pytest.approx(got[t][True], abs=0.01), t
