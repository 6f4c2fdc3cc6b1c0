"""The vLLM plugin's mechanics on the CPU (attnres.integrations.vllm; docs/integrations.md).

vLLM is not installed here: stand-in modules at vLLM's import paths (this file's own minimal code) hold a
reference `attn_res` written from the contract vLLM's function follows — prefix updated in place, the block
write, the token-major bank, the one-rounding norm — a package that re-exports it, and a model module that
imports it by name, as vLLM 0.33.0's Kimi K3 does. The plugin runs in its test-only CPU mode (attnres's CPU
backend). The GPU run against vLLM's real function is tools/engines/bench_vllm.py and test_vllm.sh.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tomllib
import types

import pytest
import torch

import attnres
from attnres import reference
from attnres.integrations import _common
from attnres.integrations import vllm as plugin
from helpers import ROOT

BF16 = torch.bfloat16


def reference_attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
                       block_write_idx, eps, output_norm_eps):
    """vLLM's contract in fp32 with its one rounding of the output (the stand-in for vLLM's function)."""
    p = prefix.float()
    if delta is not None:
        p = (p + delta.float()).to(prefix.dtype)
        prefix.copy_(p)
        p = p.float()
    if block_write_idx >= 0:
        blocks[:, block_write_idx] = p.to(blocks.dtype)
    values = torch.cat([blocks[:, :num_blocks].float(), p[:, None]], dim=1)  # [T, N, H]
    q = norm_weight.float() * qk_weight.float()
    logits = (values * q).sum(-1) * torch.rsqrt(values.pow(2).mean(-1) + eps)
    mixed = (logits.softmax(-1)[..., None] * values).sum(1)
    if output_norm_weight is not None:
        mixed = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + output_norm_eps) * output_norm_weight.float()
    return mixed.to(prefix.dtype)


MODEL_SOURCE = """
from vllm.models.kimi_k3.nvidia.ops import attn_res

def call(*args, **kwargs):
    return attn_res(*args, **kwargs)
"""


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


@pytest.fixture
def fake_vllm(monkeypatch):
    """Installs the stand-in vLLM tree in sys.modules (removed afterwards) and resets the plugin's state."""
    capability = {"major": 9}
    platform = types.SimpleNamespace(
        is_cuda=lambda: True,
        get_device_capability=lambda device_id=0: (capability["major"], 0),
        is_device_capability_family=lambda cap, device_id=0: capability["major"] == cap // 10)
    ops_mod = _module(plugin.OPS_MODULE, attn_res=reference_attn_res)
    tree = {
        "vllm": _module("vllm", __path__=[]),
        "vllm.platforms": _module("vllm.platforms", current_platform=platform),
        "vllm.models": _module("vllm.models", __path__=[]),
        "vllm.models.kimi_k3": _module("vllm.models.kimi_k3", __path__=[]),
        "vllm.models.kimi_k3.nvidia": _module("vllm.models.kimi_k3.nvidia", __path__=[]),
        plugin.OPS_PACKAGE: _module(plugin.OPS_PACKAGE, __path__=[], attn_res=reference_attn_res),
        plugin.OPS_MODULE: ops_mod,
    }
    for name, m in tree.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(plugin, "SETTINGS", plugin.Settings(allow_cpu=True, table=_table_all_faster()))
    monkeypatch.setattr(plugin, "_original", None)
    monkeypatch.setattr(plugin, "_device_ok", {})
    monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    monkeypatch.delenv(plugin.ENV_PDL, raising=False)
    plugin.FALLBACKS.reset()
    ns = types.SimpleNamespace(capability=capability, ops=ops_mod, package=tree[plugin.OPS_PACKAGE])
    yield ns
    plugin.FALLBACKS.reset()


def _import_model(monkeypatch) -> types.ModuleType:
    """Imports the stand-in model module the way Python would: executing its `from ... import attn_res`."""
    model = types.ModuleType(plugin.MODEL_MODULE)
    monkeypatch.setitem(sys.modules, plugin.MODEL_MODULE, model)
    exec(MODEL_SOURCE, model.__dict__)
    return model


TOKENS = [1, 2, 4, 8, 32, 256, 4096]


def _table(faster: dict, tokens=TOKENS, device="cpu", hidden=64) -> _common.Table:
    return _common.Table({"schema": 1, "device": device, "hidden": hidden, "tokens": tokens, "faster": faster})


def _table_all_faster(hidden=64) -> _common.Table:
    sites = [plugin.site(d, n, w) for d in (False, True) for n in (False, True) for w in (False, True)]
    return _table({s: {str(t): list(range(1, 17)) for t in TOKENS} for s in sites}, hidden=hidden)


def _inputs(T=4, NB=9, H=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g)).to(BF16)  # noqa: E731
    return dict(prefix=r(T, H), delta=r(T, H), blocks=r(T, NB, H), norm_weight=(1 + r(H, scale=0.1).float()).to(BF16),
                qk_weight=r(H, scale=0.5), output_norm_weight=(1 + r(H, scale=0.1).float()).to(BF16))


def _call(fn, x, *, delta=True, norm=True, num_blocks=3, block_write_idx=-1, eps=0.1, output_norm_eps=0.5):
    """Calls fn on a private copy of x; returns (output, prefix after, blocks after)."""
    prefix, blocks = x["prefix"].clone(), x["blocks"].clone()
    out = fn(prefix, x["delta"] if delta else None, blocks, x["norm_weight"], x["qk_weight"],
             x["output_norm_weight"] if norm else None, num_blocks=num_blocks, block_write_idx=block_write_idx,
             eps=eps, output_norm_eps=output_norm_eps)
    return out, prefix, blocks


def test_register_rebinds_every_name_model_imported_after(fake_vllm, monkeypatch):
    plugin.register()
    assert fake_vllm.ops.attn_res is plugin.attn_res
    assert fake_vllm.package.attn_res is plugin.attn_res
    assert _import_model(monkeypatch).attn_res is plugin.attn_res
    assert plugin._original is reference_attn_res


def test_register_rebinds_a_model_imported_before(fake_vllm, monkeypatch):
    model = _import_model(monkeypatch)
    assert model.attn_res is reference_attn_res
    plugin.register()
    assert model.attn_res is plugin.attn_res


def test_register_twice_keeps_the_engine_function_as_fallback(fake_vllm):
    plugin.register()
    plugin.register()
    assert plugin._original is reference_attn_res
    plugin.unregister()
    assert fake_vllm.ops.attn_res is reference_attn_res and fake_vllm.package.attn_res is reference_attn_res


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_switched_off_by_environment(fake_vllm, monkeypatch, value):
    monkeypatch.setenv(plugin.ENV_SWITCH, value)
    plugin.register()
    assert fake_vllm.ops.attn_res is reference_attn_res and plugin._original is None


def test_not_rebound_on_another_gpu_generation(fake_vllm):
    fake_vllm.capability["major"] = 10
    plugin.SETTINGS.allow_cpu = False  # the production path: the platform check runs
    plugin.register()
    assert fake_vllm.ops.attn_res is reference_attn_res


def test_register_never_raises_without_vllm(monkeypatch):
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    monkeypatch.setattr(plugin, "SETTINGS", plugin.Settings(allow_cpu=True))
    monkeypatch.setattr(plugin, "_original", None)
    plugin.register()
    assert plugin._original is None


# (delta, norm, num_blocks, block_write_idx, T): vLLM's sites — pre/post-attention add_rmsnorm, the block-write
# layer's pre-attention (write at num_blocks) and post-attention (no delta), layer 0 (N = 1 with a write), the
# output (no norm), the auxiliary capture (neither); T across the per-token and streaming ranges.
CASES = [(True, True, 3, -1, 4), (True, True, 4, 4, 8), (False, True, 5, -1, 1), (False, True, 0, 0, 2),
         (True, False, 8, -1, 32), (False, False, 2, -1, 4), (True, True, 0, -1, 3), (True, True, 8, 8, 33),
         (True, False, 2, 6, 4), (False, False, 1, 1, 5)]


@pytest.mark.parametrize("delta,norm,num_blocks,write,T", CASES)
def test_served_calls_match_the_engine(fake_vllm, delta, norm, num_blocks, write, T):
    plugin.register()
    x = _inputs(T=T)
    kw = dict(delta=delta, norm=norm, num_blocks=num_blocks, block_write_idx=write)
    out, prefix, blocks = _call(fake_vllm.ops.attn_res, x, **kw)
    assert plugin.FALLBACKS.served == 1 and not plugin.FALLBACKS.reasons
    ref_out, ref_prefix, ref_blocks = _call(reference_attn_res, x, **kw)
    # side effects bitwise: the bf16 prefix update and the block write are the same roundings
    assert torch.equal(prefix.view(torch.int16), ref_prefix.view(torch.int16))
    assert torch.equal(blocks.view(torch.int16), ref_blocks.view(torch.int16))
    # the output within the contract's tolerance (attnres rounds the mixture before its norm; vLLM does not)
    assert out.dtype == BF16 and out.shape == ref_out.shape
    reference.check_close(out, ref_out.double(), "output")
    if num_blocks == 0:  # one candidate: the mixture is the (updated) prefix itself
        if not norm:
            assert torch.equal(out, prefix)


def test_served_through_the_package_name_and_the_model_name(fake_vllm, monkeypatch):
    plugin.register()
    model = _import_model(monkeypatch)
    x = _inputs()
    out, _, _ = _call(model.call, x)
    assert plugin.FALLBACKS.served == 1
    reference.check_close(out, _call(reference_attn_res, x)[0].double())


@pytest.mark.parametrize("change,kw,reason", [
    (lambda x: {k: v.half() for k, v in x.items()}, {}, "dtype not bfloat16"),
    (lambda x: _inputs(H=60), {}, "hidden size not a multiple of 8 in [8, 16384]"),
    (lambda x: x, dict(num_blocks=3, block_write_idx=1), "block_write_idx < num_blocks"),
    (lambda x: x, dict(num_blocks=10), "num_blocks outside the bank"),
    (lambda x: _inputs(NB=20), dict(num_blocks=16), "more than 16 candidates"),
])
def test_fallback_per_call_with_the_reason(fake_vllm, change, kw, reason):
    plugin.register()
    x = change(_inputs())
    out, prefix, blocks = _call(fake_vllm.ops.attn_res, x, **kw)
    ref_out, ref_prefix, ref_blocks = _call(reference_attn_res, x, **kw)
    assert torch.equal(out, ref_out) and torch.equal(prefix, ref_prefix) and torch.equal(blocks, ref_blocks)
    assert plugin.FALLBACKS.reasons == {reason: 1} and plugin.FALLBACKS.served == 0
    # the next supported call is served again: the fallback is per call
    _call(fake_vllm.ops.attn_res, _inputs())
    assert plugin.FALLBACKS.served == 1


def test_library_rejection_falls_back_with_nothing_written(fake_vllm):
    """A call the cheap checks pass but the library rejects (delta aliasing the prefix that is updated in
    place): attnres raises before writing, vLLM's function runs on the untouched inputs."""
    plugin.register()
    x = _inputs()
    prefix, blocks = x["prefix"].clone(), x["blocks"].clone()
    out = fake_vllm.ops.attn_res(prefix, prefix, blocks, x["norm_weight"], x["qk_weight"], x["output_norm_weight"],
                                 num_blocks=3, block_write_idx=-1, eps=1e-6, output_norm_eps=1e-5)
    p2, b2 = x["prefix"].clone(), x["blocks"].clone()
    ref = reference_attn_res(p2, p2, b2, x["norm_weight"], x["qk_weight"], x["output_norm_weight"], 3, -1, 1e-6, 1e-5)
    assert torch.equal(out, ref) and torch.equal(prefix, p2) and torch.equal(blocks, b2)
    assert plugin.FALLBACKS.reasons == {"ArgumentError": 1}


def test_unexpected_error_falls_back(fake_vllm, monkeypatch):
    plugin.register()

    def broken(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(plugin, "_serve", broken)
    x = _inputs()
    out, _, _ = _call(fake_vllm.ops.attn_res, x)
    assert torch.equal(out, _call(reference_attn_res, x)[0])
    assert plugin.FALLBACKS.reasons == {"error RuntimeError": 1}


def test_cpu_tensors_fall_back_outside_test_mode(fake_vllm):
    plugin.register()
    plugin.SETTINGS.allow_cpu = False
    _call(fake_vllm.ops.attn_res, _inputs())
    assert plugin.FALLBACKS.reasons == {"cpu tensors": 1}


def test_reason_logged_once(fake_vllm, caplog):
    plugin.register()
    x = {k: v.half() for k, v in _inputs().items()}
    with caplog.at_level("DEBUG", logger="attnres.integrations.vllm"):
        for _ in range(3):
            _call(fake_vllm.ops.attn_res, x)
    assert plugin.FALLBACKS.reasons == {"dtype not bfloat16": 3}
    assert sum("dtype not bfloat16" in r.getMessage() for r in caplog.records) == 1


def test_the_table_is_consulted(fake_vllm):
    plugin.register()
    plugin.SETTINGS.table = _table({"add_rmsnorm": {"4": [4], "8": [4, 5]}}, tokens=[1, 4, 8, 32])
    x4, x5, x8 = _inputs(T=4), _inputs(T=5), _inputs(T=8)
    _call(fake_vllm.ops.attn_res, x4, num_blocks=3)                      # measured faster: served
    assert plugin.FALLBACKS.served == 1
    _call(fake_vllm.ops.attn_res, x5, num_blocks=3)                      # between 4 and 8, both faster
    assert plugin.FALLBACKS.served == 2
    _call(fake_vllm.ops.attn_res, x5, num_blocks=4)                      # 8 faster but 4 not
    _call(fake_vllm.ops.attn_res, x8, num_blocks=3, block_write_idx=3)  # another site
    _call(fake_vllm.ops.attn_res, x4, norm=False)                        # another site
    assert plugin.FALLBACKS.served == 2
    assert plugin.FALLBACKS.reasons == {"table: engine measured faster (or not measured) here": 1,
                                        "table: site not measured": 2}


def test_table_decisions():
    t = _table({"mix": {"1": [2], "4": [2], "4096": [2]}}, tokens=[1, 4, 32, 4096])
    assert t.decide("mix", 1, 2, 64, "cpu") is None
    assert t.decide("mix", 3, 2, 64, "cpu") is None
    assert t.decide("mix", 5, 2, 64, "cpu") is not None      # 32 not faster
    assert t.decide("mix", 4097, 2, 64, "cpu") == "table: T above the measured range"
    assert t.decide("mix", 1, 2, 64, "NVIDIA H100") == "table: measured on another GPU"
    assert t.decide("mix", 1, 2, 128, "cpu") == "table: hidden size not measured"
    assert t.decide("mix", 1, 3, 64, "cpu") is not None


def test_shipped_tables_name_their_gpu_and_fall_back_elsewhere(fake_vllm):
    """The shipped tables (bench_vllm.py table), one file per GPU named after it, follow the schema, were measured
    at Kimi K3's width, list only known sites, token counts they measured and N in 1..9; a call on a GPU without
    a file (here the CPU) runs vLLM's own function."""
    files = sorted(_common.table_file("vllm", "x").parent.glob("*.json"))
    assert files
    sites = {plugin.site(d, n, w) for d in (False, True) for n in (False, True) for w in (False, True)}
    for path in files:
        data = json.loads(path.read_text())
        assert data["schema"] == 1 and data["hidden"] == 7168 and data["vllm"] == "0.33.0"
        assert isinstance(data["device"], str) and _common.table_file("vllm", data["device"]) == path
        assert set(data["faster"]) <= sites
        for per in data["faster"].values():
            assert {int(t) for t in per} <= set(data["tokens"])
            assert all(set(ns) <= set(range(1, 10)) for ns in per.values())
        table = _common.Table.load(path)
        assert table.decide("add_rmsnorm", 1, 2, 7168, data["device"]) is None  # decode: served everywhere
    plugin.register()
    plugin.SETTINGS.table = None  # the shipped tables
    x = _inputs()
    out, _, _ = _call(fake_vllm.ops.attn_res, x)
    assert torch.equal(out, _call(reference_attn_res, x)[0])
    assert plugin.FALLBACKS.reasons == {_common.NOT_MEASURED_HERE: 1} and plugin.FALLBACKS.served == 0


def test_table_file_names():
    assert _common.table_file("vllm", "NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"
    assert _common.table_file("sglang", "NVIDIA H200").relative_to(_common.TABLES_DIR).as_posix() == \
        "sglang/NVIDIA_H200.json"
    assert _common.table_file("vllm", " a/../b ").name == "a_b.json"  # no path separator survives


def test_shipped_tables_read_a_gpu_file_once(tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(_common, "TABLES_DIR", tmp_path)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "GPU_A.json").write_text("{}")
    shipped = _common.ShippedTables("e", lambda p: loads.append(p) or p.name)
    assert shipped.for_device("GPU A") == "GPU_A.json" and shipped.for_device("GPU A") == "GPU_A.json"
    assert shipped.for_device("GPU B") is None
    assert loads == [tmp_path / "e" / "GPU_A.json"]


def test_unreadable_table_falls_back(tmp_path, fake_vllm):
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    assert _common.table_from_json(bad, plugin.log).empty


def test_pdl_switch(fake_vllm, monkeypatch):
    monkeypatch.setenv(plugin.ENV_PDL, "0")
    plugin.register()
    assert plugin.SETTINGS.options == attnres.Options(pdl=False)
    x = _inputs()
    out, _, _ = _call(fake_vllm.ops.attn_res, x)
    assert plugin.FALLBACKS.served == 1
    reference.check_close(out, _call(reference_attn_res, x)[0].double())


def test_entry_points_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ep = project["entry-points"]
    assert ep["vllm.general_plugins"] == {"attnres": "attnres.integrations.vllm:register"}
    assert ep["sglang.srt.plugins"] == {"attnres": "attnres.integrations.sglang:register"}
    assert project["optional-dependencies"]["vllm"] == ["vllm==0.33.0"]
    assert project["optional-dependencies"]["sglang"] == ["sglang==0.5.23"]
    module, func = ep["vllm.general_plugins"]["attnres"].split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_imports_without_vllm():
    code = "import sys, attnres.integrations.vllm as p; assert 'vllm' not in sys.modules; print(p.site(1, 1, 0))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "add_rmsnorm", r.stderr
