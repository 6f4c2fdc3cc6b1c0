"""The wheel holds the library: no module of the attnres package imports the repository's own harnesses (bench,
stress, tp_check, the tests, tools/), which run from a checkout and are not installed; the modules that left
the package have no alias in it. Checked on the package the tests import (the source tree, or the installed
wheel), by reading every module's import statements (nothing is imported)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import attnres

HARNESSES = {"bench", "stress", "tp_check", "tests", "helpers", "conftest", "tools"}
PACKAGE = Path(attnres.__file__).resolve().parent


def harness_imports(source: str, module: str) -> list[str]:
    """The imports of a harness in `source`, the code of module `module` (dotted; relative imports resolved)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package upwards; past the top is outside attnres
                parts = module.split(".")[:-node.level]
                names = [".".join(parts + ([node.module] if node.module else [])) if parts else "<outside attnres>"]
            else:
                names = [node.module]
        else:
            continue
        out += [f"line {node.lineno}: {name}" for name in names
                if name == "<outside attnres>" or name.split(".")[0] in HARNESSES]
    return out


def test_no_module_of_the_package_imports_a_harness():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30, f"found almost no modules under {PACKAGE}"
    found = []
    for path in modules:
        rel = path.relative_to(PACKAGE.parent)  # attnres/bench/cli.py: module attnres.bench.cli
        found += [f"{rel}: {hit}" for hit in harness_imports(path.read_text(), ".".join(rel.with_suffix("").parts))]
    assert not found, "the package imports the repository's harnesses:\n" + "\n".join(found)


def test_the_scan_finds_each_way_of_importing_a_harness():
    code = "import bench.cli\nfrom stress import run_calls\nfrom tp_check.launch import launch\nfrom ... import x\n"
    assert harness_imports(code, "attnres.bench.cli") == ["line 1: bench.cli", "line 2: stress",
                                                         "line 3: tp_check.launch", "line 4: <outside attnres>"]
    ok = "import torch\nfrom attnres.bench import timing\nfrom . import results\nfrom ..graphs import capture\n"
    assert harness_imports(ok, "attnres.bench.cli") == []


@pytest.mark.parametrize("module", ["attnres.tp", "attnres.stress", "attnres.bench.guard", "attnres.bench.tp"])
def test_modules_that_left_the_package_have_no_alias(module):
    assert importlib.util.find_spec(module) is None
