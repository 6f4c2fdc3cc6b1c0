"""pytest plugin for tools/engines/test_vllm.sh: activates the attnres vLLM plugin before vLLM's AttnRes test
module imports attn_res, serves every call attnres supports (the measured table is bypassed: the point is to
run vLLM's own checks against attnres), and fails the session if no call was served through attnres — a run
that only exercised vLLM's fallback proves nothing."""

from __future__ import annotations

import os

from attnres.integrations import _common
from attnres.integrations import vllm as plugin

_SITES = [plugin.site(d, n, w) for d in (False, True) for n in (False, True) for w in (False, True)]


def pytest_configure(config):
    plugin.register()
    if plugin._original is None:
        raise RuntimeError("attnres vLLM plugin did not activate (see the log): nothing would be tested")
    if os.environ.get("ATTNRES_VLLM_TEST_TABLE", "all") == "all":
        import torch
        tokens = [1 << i for i in range(0, 21)]
        faster = {s: {str(t): list(range(1, 17)) for t in tokens} for s in _SITES}
        plugin.SETTINGS.table = _common.Table({"schema": 1, "device": torch.cuda.get_device_name(),
                                               "hidden": None, "tokens": tokens, "faster": faster})


def pytest_terminal_summary(terminalreporter):
    f = plugin.FALLBACKS
    terminalreporter.write_line(f"attnres vLLM plugin: {f.served} calls served by attnres; fallbacks by reason: "
                                f"{dict(f.reasons) or 'none'}")


def pytest_sessionfinish(session, exitstatus):
    if plugin.FALLBACKS.served == 0 and exitstatus == 0:
        session.exitstatus = 1
