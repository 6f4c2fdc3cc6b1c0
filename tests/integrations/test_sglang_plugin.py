"""The SGLang plugin (attnres.integrations.sglang) on the CPU, against stand-in modules at SGLang's import paths:
our own minimal HookRegistry (the API of sglang/srt/plugins/hook_registry.py: register, REPLACE, apply_hooks
rebinding stale `from X import Y` names) and an attn_residual module whose functions are written from the
contract of SGLang's Triton path (fp32 scores rsigma * <row, norm.weight * proj.weight>, softmax, fp32 mixture
rounded once, then out_norm called on it). The stand-ins are generated into tmp_path per test."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import attnres.integrations.sglang as plugin
from attnres.integrations import _common
from attnres.integrations.sglang_table import SHIPPED_DIR, Shipped, Table, TableError, table_dict
from helpers import ROOT

B = torch.bfloat16

STANDINS = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/plugins/__init__.py": "",
    "sglang/srt/plugins/hook_registry.py": '''
        import enum, functools, pkgutil, sys, types

        class HookType(enum.Enum):
            BEFORE = "before"
            AFTER = "after"
            AROUND = "around"
            REPLACE = "replace"

        class HookRegistry:
            _hooks = {}
            _patched = set()

            @classmethod
            def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
                cls._hooks.setdefault(target, []).append((hook_type, hook))

            @classmethod
            def apply_hooks(cls):
                for target, hooks in cls._hooks.items():
                    if target in cls._patched:
                        continue
                    owner_path, attr = target.rsplit(".", 1)
                    owner = pkgutil.resolve_name(owner_path)
                    before = fn = getattr(owner, attr)
                    for kind, hook in hooks:
                        assert kind is HookType.REPLACE, "the stand-in implements REPLACE only"
                        fn = _replacing(fn, hook)
                    setattr(owner, attr, fn)
                    for mod in list(sys.modules.values()):
                        if isinstance(mod, types.ModuleType) and mod is not owner:
                            for name, value in list(vars(mod).items()):
                                if value is before:
                                    setattr(mod, name, fn)
                    cls._patched.add(target)

        def _replacing(original, hook):
            @functools.wraps(original)
            def wrapper(*args, **kwargs):
                return hook(*args, **kwargs)
            wrapper.__wrapped__ = original
            return wrapper
    ''',
    "sglang/srt/layers/__init__.py": "",
    "sglang/srt/layers/layernorm.py": '''
        import torch

        class RMSNorm(torch.nn.Module):
            def __init__(self, hidden_size, eps=1e-6, cast_x_before_out_mul=False):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.bfloat16))
                self.variance_epsilon = eps
                self.cast_x_before_out_mul = cast_x_before_out_mul
                self.variance_size_override = None
                self.override_orig_dtype = None

            def forward(self, x):
                dtype = x.dtype
                x = x.float()
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                if self.cast_x_before_out_mul:
                    return self.weight * x.to(dtype)
                return (x * self.weight).to(dtype)

        class GemmaRMSNorm(RMSNorm):
            def forward(self, x):
                dtype = x.dtype
                x = x.float()
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                return (x * (1.0 + self.weight.float())).to(dtype)
    ''',
    "sglang/srt/layers/linear.py": '''
        import torch

        class ReplicatedLinear(torch.nn.Module):
            def __init__(self, input_size, output_size, bias=False):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(output_size, input_size, dtype=torch.bfloat16))
                self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=torch.bfloat16)) if bias else None

            def forward(self, x):
                y = x @ self.weight.t()
                return (y if self.bias is None else y + self.bias), None
    ''',
    "sglang/srt/layers/attn_residual.py": '''
        import torch
        from sglang.srt.layers.layernorm import RMSNorm
        from sglang.srt.layers.linear import ReplicatedLinear

        CALLS = []  # which stand-in ran, so a test can tell SGLang's path from the plugin's

        def _mix(prefix_sum, bank, nvb, score_proj, score_norm):
            cw = score_norm.weight.float() * score_proj.weight.reshape(-1).float()
            rows = torch.cat([bank[:, :nvb], prefix_sum[:, None]], 1).float()
            rsigma = torch.rsqrt(rows.pow(2).mean(-1) + score_norm.variance_epsilon)
            probs = torch.softmax((rows @ cw) * rsigma, dim=-1)
            return (probs[..., None] * rows).sum(1).to(prefix_sum.dtype)

        def _aggregate_fused(prefix_sum, bank, nvb, score_proj, score_norm, out_norm):
            CALLS.append("_aggregate_fused")
            return out_norm(_mix(prefix_sum, bank, nvb, score_proj, score_norm))

        def _aggregate(prefix_sum, bank, nvb, score_proj, score_norm, out_norm, write_bank_row=False):
            CALLS.append("_aggregate")
            if prefix_sum.shape[0] == 0:
                return prefix_sum
            if write_bank_row:  # the fast path's in-kernel snapshot of the prefix into row nvb
                bank[:, nvb].copy_(prefix_sum)
            return _aggregate_fused(prefix_sum, bank, nvb, score_proj, score_norm, out_norm)

        def _aggregate_fused_add(prefix_a, prefix_b, bank, nvb, score_proj, score_norm, out_norm,
                                 write_bank_row=False):
            CALLS.append("_aggregate_fused_add")
            prefix = prefix_a + prefix_b
            return _aggregate(prefix, bank, nvb, score_proj, score_norm, out_norm,
                              write_bank_row=write_bank_row), prefix

        def aggregate_stream(prefix_sum, bank, nvb, score_proj, score_norm):
            CALLS.append("aggregate_stream")
            if nvb == 0:
                return prefix_sum
            return _mix(prefix_sum, bank, nvb, score_proj, score_norm)
    ''',
    "sglang/srt/models/__init__.py": "",
    "sglang/srt/models/kimi_k3.py": "from sglang.srt.layers.attn_residual import aggregate_stream, _aggregate\n",
}

ENTRIES = ("_aggregate", "_aggregate_fused", "_aggregate_fused_add", "aggregate_stream")


def _purge_sglang():
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


@pytest.fixture
def sgl(tmp_path, monkeypatch):
    """The stand-in SGLang on sys.path, a fresh plugin state, the switch and table variables unset."""
    for rel, text in STANDINS.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    monkeypatch.delenv(plugin.ENV_TABLE, raising=False)
    monkeypatch.setattr(plugin, "_STATE", plugin._State())
    _purge_sglang()
    import importlib

    ns = type("SGL", (), {})()
    ns.hooks = importlib.import_module("sglang.srt.plugins.hook_registry")
    ns.ar = importlib.import_module("sglang.srt.layers.attn_residual")
    ns.kimi = importlib.import_module("sglang.srt.models.kimi_k3")
    ns.ln = importlib.import_module("sglang.srt.layers.layernorm")
    ns.lin = importlib.import_module("sglang.srt.layers.linear")
    ns.originals = {name: getattr(ns.ar, name) for name in ENTRIES}
    yield ns
    _purge_sglang()


def _load(sgl, table=None):
    """What SGLang's load_plugins does with our entry point, then the test's table (cpu, every point faster)."""
    plugin.register()
    sgl.hooks.HookRegistry.apply_hooks()
    plugin.set_table(table if table is not None else _cpu_table())
    sgl.ar.CALLS.clear()


def _cpu_table(H=64, tokens=(1, 3, 33), use=True, device="cpu"):
    rows = [{"entry": e, "tokens": t, "candidates": n, "use_attnres": use}
            for e in ("_aggregate", "_aggregate+write", "_aggregate_fused", "_aggregate_fused_add",
                      "_aggregate_fused_add+write", "aggregate_stream") for t in tokens for n in range(1, 17)]
    return Table(device, H, rows)


def _modules(sgl, H, seed=0, cast=False):
    g = torch.Generator().manual_seed(seed)
    proj = sgl.lin.ReplicatedLinear(H, 1)
    score_norm, out_norm = sgl.ln.RMSNorm(H, eps=1e-6), sgl.ln.RMSNorm(H, eps=1e-5, cast_x_before_out_mul=cast)
    with torch.no_grad():
        proj.weight.copy_(0.5 * torch.randn(1, H, generator=g))
        score_norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
        out_norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
    return proj, score_norm, out_norm


def _inputs(T, NB, H, seed=1):
    g = torch.Generator().manual_seed(seed)
    bank = torch.randn(T, NB, H, generator=g).to(B)
    return torch.randn(T, H, generator=g).to(B), torch.randn(T, H, generator=g).to(B), bank


def _close(got, want):
    """attnres's bf16 tolerance against SGLang's path (docs/ops/common.md section 9; the two paths differ by
    reduction order and, for the normed output, by attnres's second rounding)."""
    g, w = got.double().flatten(), want.double().flatten()
    rel = (g - w).norm() / w.norm().clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(g, w, dim=0)
    assert rel < 5e-3 and cos > 0.9999, (float(rel), float(cos))


def _call(sgl, entry, prefix, add, bank, nvb, mods, write=False):
    proj, score_norm, out_norm = mods
    fn = getattr(sgl.ar, entry)
    if entry == "_aggregate":
        return fn(prefix, bank, nvb, proj, score_norm, out_norm, write_bank_row=write)
    if entry == "_aggregate_fused":
        return fn(prefix, bank, nvb, proj, score_norm, out_norm)
    if entry == "_aggregate_fused_add":
        return fn(prefix, add, bank, nvb, proj, score_norm, out_norm, write_bank_row=write)
    return fn(prefix, bank, nvb, proj, score_norm)


def _both(sgl, entry, T, NB, nvb, H=64, write=False, cast=False):
    """The plugin's call and SGLang's (the stand-in) on identical copies; returns both results and banks."""
    mods = _modules(sgl, H, cast=cast)
    prefix, add, bank = _inputs(T, NB, H)
    inputs = (prefix.clone(), add.clone())
    bank_p, bank_s = bank.clone(), bank.clone()
    got = _call(sgl, entry, prefix, add, bank_p, nvb, mods, write)
    assert torch.equal(prefix, inputs[0]) and torch.equal(add, inputs[1]), "an input was written"
    with plugin.sglang_functions():
        want = _call(sgl, entry, prefix, add, bank_s, nvb, mods, write)
    return got, want, bank_p, bank_s


def test_module_imports_without_sglang():
    code = "import sys, attnres.integrations.sglang as p; assert 'sglang' not in sys.modules; print(p.ENTRY_POINTS)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_register_without_sglang_leaves_a_log_not_an_error(caplog, monkeypatch):
    monkeypatch.setattr(plugin, "_STATE", plugin._State())
    _purge_sglang()
    with caplog.at_level(logging.ERROR, logger=plugin.__name__):
        plugin.register()  # sglang is not importable here
    assert not plugin.stats()["registered"] and "not registered" in caplog.text


def test_hooks_registered_and_stale_names_rebound(sgl):
    _load(sgl)
    for name in ENTRIES:
        hooked = getattr(sgl.ar, name)
        assert hooked is not sgl.originals[name] and hooked.__wrapped__ is sgl.originals[name]
        assert plugin.original(name) is sgl.originals[name]
    assert sgl.kimi.aggregate_stream is sgl.ar.aggregate_stream  # kimi_k3's `from ... import` rebound
    assert sgl.kimi._aggregate is sgl.ar._aggregate
    assert plugin.stats()["registered"]
    plugin.register()  # idempotent: a second load registers nothing more
    assert len(sgl.hooks.HookRegistry._hooks[f"{plugin.MODULE}._aggregate"]) == 1


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("T,NB,nvb", [(1, 9, 8), (3, 9, 0), (3, 9, 4), (33, 3, 2), (3, 17, 15)])
def test_results_and_side_effects_equal_sglang(sgl, entry, T, NB, nvb):
    _load(sgl)
    got, want, bank_p, bank_s = _both(sgl, entry, T, NB, nvb)
    replaced = not (entry == "aggregate_stream" and nvb == 0)
    assert plugin.stats()["attnres_calls"] == ({entry: 1} if replaced else {}), plugin.stats()
    assert torch.equal(bank_p, bank_s), "the bank changed"
    if entry == "_aggregate_fused_add":
        _close(got[0], want[0])
        assert torch.equal(got[1], want[1]), "the prefix is not a + b bit for bit"
    else:
        _close(got, want)


def test_aggregate_stream_nvb0_returns_the_prefix_itself(sgl):
    _load(sgl)
    prefix, _, bank = _inputs(2, 3, 64)
    assert sgl.ar.aggregate_stream(prefix, bank, 0, *_modules(sgl, 64)[:2]) is prefix


@pytest.mark.parametrize("entry", ["_aggregate", "_aggregate_fused_add"])
@pytest.mark.parametrize("nvb", [0, 3])
def test_bank_row_write_is_bitwise(sgl, entry, nvb):
    _load(sgl)
    got, want, bank_p, bank_s = _both(sgl, entry, 5, 4, nvb, write=True)
    assert plugin.stats()["attnres_calls"] == {entry + "+write": 1}, plugin.stats()
    assert torch.equal(bank_p, bank_s), "snapshot row or another bank row differs"
    prefix = got[1] if entry == "_aggregate_fused_add" else None
    if prefix is not None:
        assert torch.equal(bank_p[:, nvb], prefix)


def test_hf_two_rounding_out_norm_is_closer(sgl):
    """With cast_x_before_out_mul (bf16(x * r) then * weight) SGLang's norm rounds twice as attnres does."""
    _load(sgl)
    got, want, _, _ = _both(sgl, "_aggregate", 8, 9, 8, cast=True)
    _close(got, want)
    assert plugin.stats()["attnres_calls"] == {"_aggregate": 1}


def _decline_case(sgl, kind):
    H, T, NB, nvb = 64, 2, 4, 3
    mods = list(_modules(sgl, H))
    prefix, add, bank = _inputs(T, NB, H)
    if kind == "fp32 prefix":
        prefix, add, bank = prefix.float(), add.float(), bank.float()
    elif kind == "too many candidates":
        prefix, add, bank = _inputs(T, 20, H)
        nvb = 16
    elif kind == "gemma out_norm":
        g = sgl.ln.GemmaRMSNorm(H, eps=1e-5)
        mods[2] = g
    elif kind == "fp8-fused out_norm":
        mods[2]._quant_linear = object()
    elif kind == "score_proj bias":
        mods[0] = sgl.lin.ReplicatedLinear(H, 1, bias=True)
    elif kind == "no tokens":
        prefix, add, bank = prefix[:0], add[:0], bank[:0]
    return prefix, add, bank, nvb, tuple(mods)


@pytest.mark.parametrize("kind,reason", [
    ("fp32 prefix", "prefix_sum is torch.float32, attnres takes bfloat16"),
    ("too many candidates", "N = nvb + 1 > 16 candidates"),
    ("gemma out_norm", "out_norm is GemmaRMSNorm, not SGLang's RMSNorm"),
    ("fp8-fused out_norm", "out_norm fuses the next projection's FP8 input quantisation"),
    ("score_proj bias", "score_proj has a bias"),
    ("no tokens", "no tokens (T = 0)"),
])
def test_unsupported_calls_fall_back_to_sglang_recorded(sgl, caplog, kind, reason):
    _load(sgl, _cpu_table(tokens=(1, 2)))
    prefix, add, bank, nvb, mods = _decline_case(sgl, kind)
    with caplog.at_level(logging.DEBUG, logger=plugin.__name__):
        for _ in range(2):
            got = _call(sgl, "_aggregate_fused_add", prefix, add, bank, nvb, mods)
    with plugin.sglang_functions():
        want = _call(sgl, "_aggregate_fused_add", prefix, add, bank, nvb, mods)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # SGLang's function ran: same bits
    s = plugin.stats()
    assert s["attnres_calls"] == {} and s["fallbacks"] == {"_aggregate_fused_add": {reason: 2}}, s
    assert caplog.text.count(reason) == 1, "one debug log per reason"
    # The nested _aggregate inside SGLang's fallback stayed SGLang's (no second decision, no attnres call).
    assert sgl.ar.CALLS[:2] == ["_aggregate_fused_add", "_aggregate"]


def test_attnres_error_falls_back(sgl):
    """A call attnres refuses (H = 12 is not a multiple of 8) runs SGLang's function, reason recorded."""
    _load(sgl, _cpu_table(H=12))
    mods = _modules(sgl, 12)
    prefix, _, bank = _inputs(2, 3, 12)
    got = sgl.ar._aggregate(prefix, bank, 2, *mods)
    with plugin.sglang_functions():
        want = sgl.ar._aggregate(prefix, bank, 2, *mods)
    assert torch.equal(got, want)
    (reason,) = plugin.stats()["fallbacks"]["_aggregate"]
    assert reason.startswith("attnres declined: ArgumentError:") and "multiple of #" in reason


def test_table_consulted(sgl):
    prefix, add, bank = _inputs(2, 3, 64)
    mods = _modules(sgl, 64)
    _load(sgl, Table.empty())
    sgl.ar._aggregate(prefix, bank, 2, *mods)
    _load_table = plugin.set_table
    _load_table(_cpu_table(device="NVIDIA H200"))
    sgl.ar._aggregate(prefix, bank, 2, *mods)
    _load_table(_cpu_table(H=7168))
    sgl.ar._aggregate(prefix, bank, 2, *mods)
    _load_table(_cpu_table(use=False, tokens=(2,)))
    sgl.ar._aggregate(prefix, bank, 2, *mods)
    assert plugin.stats()["fallbacks"]["_aggregate"] == {
        "table: not measured (empty table)": 1, "table: measured on NVIDIA H200, not on cpu": 1,
        "table: measured at H = 7168, not at H = 64": 1, "table: SGLang not measured slower at T = 2, N = 3": 1}
    _load_table(_cpu_table(tokens=(2,)))
    sgl.ar._aggregate(prefix, bank, 2, *mods)
    assert plugin.stats()["attnres_calls"] == {"_aggregate": 1}


def test_table_buckets():
    rows = [{"entry": "e", "tokens": t, "candidates": 9, "use_attnres": u} for t, u in ((1, True), (4, False),
                                                                                           (8, True), (32, True))]
    t = Table("dev", 64, rows)
    v = {T: t.verdict("e", T, 9, 64, "dev") for T in (1, 2, 4, 6, 8, 9, 32, 5000)}
    assert v[1] is None and v[8] is None and v[9] is None and v[32] is None and v[5000] is None
    assert v[2] == "table: SGLang not measured slower at 1 < T < 4, N = 9"
    assert v[4] == "table: SGLang not measured slower at T = 4, N = 9" and v[6] is not None
    assert t.verdict("e", 1, 8, 64, "dev") == "table: e not measured at N = 8"


def test_table_files(tmp_path):
    files = sorted(SHIPPED_DIR.glob("*.json"))
    assert files
    for shipped in files:  # the shipped tables follow the schema, each in the file named after its GPU
        t = Table.load(shipped)
        assert t.rows and _common.table_file("sglang", t.device) == shipped and t.hidden == 7168
    doc = table_dict("cpu", 64, [{"entry": "e", "tokens": 1, "candidates": 2, "use_attnres": True,
                                  "attnres_us": 1.0, "sglang_us": 2.0}], {"by": "test"}, "note")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert Table.load(path).verdict("e", 1, 2, 64, "cpu") is None
    for bad in ({"schema": 99, "rows": []}, {"schema": 1, "rows": [{"entry": "e"}]},
                {"schema": 1, "rows": [{"entry": "e", "tokens": 1, "candidates": 2, "use_attnres": True}]}):
        with pytest.raises(TableError):
            Table.from_dict(bad)


def test_table_from_environment(sgl, tmp_path, monkeypatch, caplog):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table_dict("cpu", 64, _cpu_table().rows, {}, "test")))
    monkeypatch.setenv(plugin.ENV_TABLE, str(path))
    plugin.register()
    assert plugin.stats()["table"] == str(path)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.set_table(path)
    assert "falling back to SGLang's functions everywhere" in caplog.text
    assert plugin._STATE.table.rows == []


def test_shipped_tables_by_gpu(tmp_path, monkeypatch, caplog):
    """Without ATTNRES_SGLANG_TABLE each call consults its GPU's shipped table; a GPU without one, or with a
    broken one (a warning), runs SGLang's function."""
    monkeypatch.setattr(_common, "TABLES_DIR", tmp_path)
    (tmp_path / "sglang").mkdir()
    doc = table_dict("GPU A", 64, [{"entry": "e", "tokens": 1, "candidates": 2, "use_attnres": True}], {}, "n")
    (tmp_path / "sglang" / "GPU_A.json").write_text(json.dumps(doc))
    (tmp_path / "sglang" / "GPU_B.json").write_text("{not json")
    shipped = Shipped(plugin._table_error)
    assert shipped.verdict("e", 1, 2, 64, "GPU A") is None
    assert shipped.verdict("e", 1, 3, 64, "GPU A") == "table: e not measured at N = 3"
    assert shipped.verdict("e", 1, 2, 64, "GPU C") == _common.NOT_MEASURED_HERE
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert shipped.verdict("e", 1, 2, 64, "GPU B") == "table: not measured (empty table)"
    assert "falling back to SGLang's functions everywhere" in caplog.text


def test_register_installs_the_shipped_tables(sgl, monkeypatch):
    monkeypatch.delenv(plugin.ENV_TABLE, raising=False)
    plugin.register()
    assert isinstance(plugin._STATE.table, Shipped) and plugin.stats()["table"] == str(SHIPPED_DIR)


@pytest.mark.parametrize("value,warns", [("0", False), ("no", True)])
def test_switch_off(sgl, monkeypatch, caplog, value, warns):
    monkeypatch.setenv(plugin.ENV_SWITCH, value)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    sgl.hooks.HookRegistry.apply_hooks()
    assert not sgl.hooks.HookRegistry._hooks or all(
        not k.startswith(plugin.MODULE) for k in sgl.hooks.HookRegistry._hooks)
    for name in ENTRIES:
        assert getattr(sgl.ar, name) is sgl.originals[name]
    assert ("must be 0 or 1" in caplog.text) == warns



def test_bench_decision_rule():
    """tools/engines/bench_sglang.py marks attnres faster only when correct and below SGLang's cheaper timing
    (its path without the output norm) beyond the noise."""
    import importlib.util
    
    path = ROOT / "tools" / "engines" / "bench_sglang.py"
    spec = importlib.util.spec_from_file_location("bench_sglang", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    t = lambda p10, p90: {"p10_us": p10, "p90_us": p90, "median_us": (p10 + p90) / 2}  # noqa: E731
    row = {"prefix_bitwise": True, "bank_bitwise": True, "rel_l2": 1e-3, "cosine": 0.99999,
           "attnres": t(2.0, 2.5), "sglang": t(9.0, 10.0), "sglang_mix_only": t(6.0, 7.0)}
    assert bench.decide(row)
    assert not bench.decide({**row, "sglang_mix_only": t(2.4, 3.0)})  # within the noise of the lower bound
    assert not bench.decide({**row, "prefix_bitwise": False})
    assert not bench.decide({**row, "rel_l2": 1e-2})
    assert not bench.decide({**row, "attnres": None})
