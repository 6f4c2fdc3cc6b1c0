"""pytest plugin for tools/engines/test_sglang.sh: activates the attnres SGLang plugin before SGLang's AttnRes test
modules import attn_residual, serves every call attnres supports (the measured table is bypassed: the point is to
run SGLang's own checks against attnres), and fails the session if no call was served through attnres — a run
that only exercised SGLang's functions proves nothing.

Without an installed SGLang (ATTNRES_SGLANG_SRC names the copied wheel files, tools/engines/sglang_prepare.sh), the
SGLang package is a tree built in build/engines/sglang_test_runtime (ignored): SGLang's own attn_residual.py, hook
registry and CI-registration markers, and minimal stand-ins for the modules they and the tests import that need
SGLang's compiled kernels or its server stack (below, and bench_sglang.STANDINS)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import bench_sglang

RUNTIME = bench_sglang.ROOT / "build" / "engines" / "sglang_test_runtime"
# sglang/test/ci/ci_register.py: the tests call its register_*_ci markers at import (stdlib only, a no-op at run time).
COPIED = bench_sglang.COPIED + ("sglang/test/ci/ci_register.py",)

STANDINS = dict(bench_sglang.STANDINS)
STANDINS.update({
    # The real package is sglang/srt/utils/ (its __init__ pulls in the server stack); the tests and attn_residual
    # use only these four.
    "sglang/srt/utils.py": """\
import torch

def is_cuda():
    return torch.cuda.is_available() and torch.version.cuda is not None

def is_hip():
    return False

def is_npu():
    return False

def get_device_sm():
    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor
""",
    "sglang/test/__init__.py": "",
    "sglang/test/ci/__init__.py": "",
    # SGLang's CustomTestCase adds CI-only behaviour (retries, waits for an idle GPU, server teardown) on top of
    # unittest.TestCase and imports the whole server stack; without retries a failure fails here at once.
    "sglang/test/test_utils.py": """\
import unittest

class CustomTestCase(unittest.TestCase):
    pass
""",
    "sglang/kernels/__init__.py": "",
    "sglang/kernels/ops/__init__.py": "",
    "sglang/kernels/ops/attention/__init__.py": "",
    # SGLang's SM100+ TMA kernel is JIT-compiled through its kernel build (tvm_ffi), absent here; attn_residual
    # takes it only on SM100+ and its test skips below SM100, so on Hopper nothing calls this.
    "sglang/kernels/ops/attention/attn_res.py": """\
def attn_res_fused_tma(*args, **kwargs):
    raise RuntimeError("SGLang's SM100 TMA kernel is not available from the copied wheel files (stand-in)")
""",
})


def prepare(src: Path) -> Path:
    return bench_sglang.prepare(src, RUNTIME, STANDINS, COPIED)


def pytest_configure(config):
    src = os.environ.get("ATTNRES_SGLANG_SRC")
    if src:
        if "sglang" in sys.modules:
            raise RuntimeError("sglang was imported before the stand-in tree was put on sys.path")
        sys.path.insert(0, str(prepare(Path(src).resolve())))
    import attnres.integrations.sglang as plugin
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    if not plugin.stats()["registered"]:
        raise RuntimeError("attnres SGLang plugin did not register (see the log): nothing would be tested")
    HookRegistry.apply_hooks()
    module = sys.modules[plugin.MODULE]
    unhooked = [n for n in plugin.ENTRY_POINTS if getattr(module, n) is plugin.original(n)]
    if unhooked:  # apply_hooks logs a failure and goes on
        raise RuntimeError(f"SGLang's HookRegistry did not replace {unhooked} (see the log)")
    if os.environ.get("ATTNRES_SGLANG_TEST_TABLE", "all") == "all":
        plugin.set_table(bench_sglang._Open())


def _served() -> int:
    import attnres.integrations.sglang as plugin

    return sum(plugin.stats()["attnres_calls"].values())


def pytest_terminal_summary(terminalreporter):
    import attnres.integrations.sglang as plugin

    s = plugin.stats()
    terminalreporter.write_line(f"attnres SGLang plugin: {_served()} calls served by attnres "
                                f"(by entry point: {s['attnres_calls'] or 'none'}); SGLang's function ran by entry "
                                f"point and reason: {s['fallbacks'] or 'none'}")


def pytest_sessionfinish(session, exitstatus):
    if _served() == 0 and exitstatus == 0 and not session.config.option.collectonly:
        session.exitstatus = 1
