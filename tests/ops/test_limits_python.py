"""The Python layer reads every library limit from attnres._C.limits (built from attnres/limits.hpp and
all_reduce.hpp) and restates none: each Python-facing limit equals its _C.limits entry, and the checks built on
them reject exactly past the C++ bound."""

from __future__ import annotations

import importlib

import pytest
import torch

import attnres
from attnres import _C

LIMITS = _C.limits
all_reduce_module = importlib.import_module("attnres.all_reduce")  # attnres.all_reduce is also the function


def test_the_all_reduce_limits_are_in_the_dict_and_agree_with_the_module_constants():
    assert LIMITS["all_reduce_max_world"] == _C.ALL_REDUCE_MAX_WORLD
    assert LIMITS["all_reduce_world_sizes"] == sorted(LIMITS["all_reduce_world_sizes"])
    assert LIMITS["all_reduce_world_sizes"][-1] == LIMITS["all_reduce_max_world"]
    assert LIMITS["all_reduce_width_multiple"] >= 1 and LIMITS["all_reduce_max_width"] % LIMITS[
        "all_reduce_width_multiple"] == 0
    assert LIMITS["all_reduce_slots"] >= 1


# module -> {its constant: the _C.limits key it must equal}
PYTHON_LIMITS = {
    "attnres.options": {"MAX_CLUSTER": "max_cluster"},
    "attnres.models.kimi_k3.config": {"MAX_CANDIDATES": "max_candidates", "MAX_HIDDEN": "max_hidden",
                                      "HIDDEN_MULTIPLE": "hidden_multiple"},
    "attnres.comm.communicator": {"MAX_WORLD": "all_reduce_max_world", "MAX_WIDTH": "all_reduce_max_width",
                                "WIDTH_MULTIPLE": "all_reduce_width_multiple", "SLOTS": "all_reduce_slots"},
    "attnres.all_reduce": {"_MAX_ROUTES": "moe_finalize_max_routes", "_MAX_WIDTH": "all_reduce_max_width",
                           "_WIDTH_MULTIPLE": "all_reduce_width_multiple"},
    "attnres.moe_tail": {"MAX_TOKENS": "moe_finalize_max_tokens", "MAX_ROUTES": "moe_finalize_max_routes"},
}
CASES = [(module, name, key) for module, names in PYTHON_LIMITS.items() for name, key in names.items()]


@pytest.mark.parametrize("module, name, key", CASES, ids=[f"{m}.{n}" for m, n, _ in CASES])
def test_each_python_limit_is_read_from_the_library(module, name, key):
    assert getattr(importlib.import_module(module), name) == LIMITS[key]


def test_moe_world_sizes_are_the_librarys():
    assert all_reduce_module.MOE_WORLD_SIZES == tuple(LIMITS["all_reduce_world_sizes"])


def test_model_config_hidden_bounds_are_the_ops():
    from attnres.models.kimi_k3 import KimiK3Config

    top, step = LIMITS["max_hidden"], LIMITS["hidden_multiple"]
    assert KimiK3Config.small(hidden_size=top).hidden_size == top
    assert KimiK3Config.small(hidden_size=step).hidden_size == step
    for bad in (top + step, step // 2 if step > 1 else 0, top - 1, 0, True):
        with pytest.raises(ValueError, match=rf"^KimiK3Config.hidden_size must be a multiple of {step} in "
                                             rf"\[{step}, {top}\], got "):
            KimiK3Config.small(hidden_size=bad)


def test_tail_route_hidden_bounds_are_the_ops():
    from attnres.models.kimi_k3.residual import DEFER, HIDDEN, ResidualSettings, tail_route

    s = ResidualSettings(fold=True)
    top, step = LIMITS["max_hidden"], LIMITS["hidden_multiple"]
    assert tail_route(s, tokens=1, hidden=top, dtype=torch.bfloat16).path == DEFER
    assert tail_route(s, tokens=1, hidden=top + step, dtype=torch.bfloat16).reason == HIDDEN
    assert tail_route(s, tokens=1, hidden=step + 1, dtype=torch.bfloat16).reason == HIDDEN


def test_communicator_width_bounds_are_the_librarys():
    from attnres.comm.communicator import _check_shape_args

    top, step = LIMITS["all_reduce_max_width"], LIMITS["all_reduce_width_multiple"]
    _check_shape_args(2, 1, top, 1.0)
    _check_shape_args(2, 1, step, 1.0)
    for bad in (top + step, step + 1, 0):
        with pytest.raises(attnres.ArgumentError, match=rf"^Communicator: width must be a multiple of {step} in "
                                                        rf"\[{step}, {top}\], got {bad}$"):
            _check_shape_args(2, 1, bad, 1.0)


def test_moe_finalize_all_reduce_gate_bounds_are_the_librarys():
    gate = all_reduce_module.supports_moe_finalize_all_reduce
    routes, width = LIMITS["moe_finalize_max_routes"], LIMITS["all_reduce_max_width"]
    assert gate(1, routes, 64, 2, max_tokens=16) == (True, "")
    assert gate(1, routes + 1, 64, 2, max_tokens=16) == (False, f"k = {routes + 1} is outside [1, {routes}]")
    assert gate(1, 16, width + 8, 2, max_tokens=16)[1].startswith(f"D = {width + 8} is not a multiple of")
    for w in range(1, LIMITS["all_reduce_max_world"] + 2):
        ok, why = gate(1, 16, 64, w, max_tokens=16)
        assert ok == (w in LIMITS["all_reduce_world_sizes"]), (w, why)
        if not ok:
            assert why == f"world size {w} has no fused kernel (2, 4 or 8)"


def test_bench_hidden_bound_is_the_ops(capsys):
    from bench.cli import main

    bad = LIMITS["max_hidden"] + LIMITS["hidden_multiple"]
    with pytest.raises(SystemExit) as e:
        main(["persistent", "--hidden", str(bad)])
    assert e.value.code == 2
    assert f"--hidden must be a multiple of {LIMITS['hidden_multiple']} in [" in capsys.readouterr().err
