#!/usr/bin/env python3
"""vLLM's own Kimi K3 attn_res (Triton, vLLM 0.33.0) against the attnres plugin's path, on one Hopper GPU.

Three steps (docs/integrations.md, "Refreshing the table"):

  prepare SRC     (any machine) SRC: the vLLM 0.33.0 wheel or an unpacked copy of it. Builds build/engines/vllm/
                  (ignored): vLLM's real ops/attn_res.py and ops/__init__.py, plus minimal stand-ins written
                  here for the three modules they import that need vLLM's compiled library or its config
                  system (vllm._custom_ops, vllm.platforms, vllm.triton_utils). Copy build/engines to the GPU host.
  run --out F     (GPU) PYTHONPATH=build/engines/vllm. For each site (call form), T and N: both
                  functions on the same inputs, the max |delta| of the outputs, whether the side effects (prefix,
                  blocks) are bitwise equal, and the per-call time of each by CUDA-graph replay over rotating
                  input sets (attnres.bench.timing). --sites/--tokens/--candidates split a long sweep.
  prepare-flaggems SRC  (any machine, optional) SRC: a checkout of FlagGems-vllm (github.com/flagos-ai/FlagGems-vllm)
                  or its src/flaggems_vllm/ops/attn_res.py. Builds build/engines/flaggems/ (ignored): that file as
                  it is, plus stand-ins for the package modules it imports (runtime, utils). `run --flaggems` then
                  times FlagGems' Hopper kernel beside the other two (PYTHONPATH gets build/engines/flaggems too),
                  at the points its fixed-configuration kernel serves: an addend or a snapshot write, N <= 9.
  table F...      merges run files of one GPU into its table, python/attnres/integrations/tables/vllm/<GPU>.json:
                  a point is "faster" when attnres's median is below vLLM's by --margin (default 3%) and its side
                  effects were bitwise equal. Points not run stay unmeasured (the plugin falls back there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "build" / "engines" / "vllm"
FLAGGEMS = ROOT / "build" / "engines" / "flaggems"
FLAGGEMS_FILE = "src/flaggems_vllm/ops/attn_res.py"
FLAGGEMS_MAX_BLOCKS = 8  # its bank is [T, 8, H]
# common/mtp.py: vLLM's own test module (tools/engines/test_vllm.sh) imports it beside attn_res.
REAL_FILES = ("vllm/models/kimi_k3/nvidia/ops/attn_res.py", "vllm/models/kimi_k3/nvidia/ops/__init__.py",
              "vllm/models/kimi_k3/common/mtp.py")
SITES = ("add_rmsnorm", "add_rmsnorm_write", "rmsnorm", "rmsnorm_write", "add_mix", "mix")
TOKENS = (1, 4, 8, 32, 256, 4096)

# Stand-ins: only what ops/attn_res.py touches. The native-kernel branch needs SM100 and torch.ops._C (absent),
# so _custom_ops is never called on Hopper; the platform answers from torch as vLLM's CudaPlatform does.
STANDINS = {
    "vllm/__init__.py": "",
    "vllm/_custom_ops.py": "# stand-in: vLLM's compiled ops are not loaded; attn_res.py calls them on SM100 only\n",
    "vllm/platforms/__init__.py": '''"""Stand-in for vllm.platforms: what attn_res.py and the attnres plugin ask, answered from torch."""
import torch


class _Platform:
    device_type = "cuda"

    @staticmethod
    def is_cuda():
        return True

    @staticmethod
    def get_device_capability(device_id=0):
        return torch.cuda.get_device_capability(device_id)

    @staticmethod
    def has_device_capability(capability, device_id=0):
        major, minor = torch.cuda.get_device_capability(device_id)
        want = capability if isinstance(capability, tuple) else divmod(capability, 10)
        return (major, minor) >= tuple(want)

    @staticmethod
    def is_rocm():
        return torch.version.hip is not None

    @staticmethod
    def is_device_capability_family(capability, device_id=0):
        major, minor = torch.cuda.get_device_capability(device_id)
        return (major * 10 + minor) // 10 == capability // 10

    @staticmethod
    def is_arch_support_pdl():
        return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9


current_platform = _Platform()
''',
    "vllm/triton_utils/__init__.py": "import triton\nimport triton.language as tl\n",
    "vllm/models/__init__.py": "",
    "vllm/models/kimi_k3/__init__.py": "",
    "vllm/models/kimi_k3/nvidia/__init__.py": "",
    "vllm/models/kimi_k3/common/__init__.py": "",
}


def prepare(src: Path) -> None:
    if STANDIN.exists():
        shutil.rmtree(STANDIN)
    for rel, text in STANDINS.items():
        (STANDIN / rel).parent.mkdir(parents=True, exist_ok=True)
        (STANDIN / rel).write_text(text)
    for rel in REAL_FILES:
        if src.is_file():
            with zipfile.ZipFile(src) as z:
                data = z.read(rel)
        else:
            data = (src / rel).read_bytes()
        (STANDIN / rel).parent.mkdir(parents=True, exist_ok=True)
        (STANDIN / rel).write_bytes(data)
    print(f"prepared {STANDIN} (copy build/engines to the GPU host; run there with PYTHONPATH=build/engines/vllm and attnres installed)")


# Stand-ins for the flaggems_vllm modules ops/attn_res.py imports. The fixed-configuration kernel (the sites with an
# addend or a snapshot write) needs none of them at run time beyond the device queries; the autotuned kernel of the
# other sites needs FlagGems' tuned configs, which are not loaded, so those sites are not measured.
FLAGGEMS_STANDINS = {
    "flaggems_vllm/__init__.py": 'from .ops.attn_res import attn_res  # noqa: F401\n',
    "flaggems_vllm/ops/__init__.py": "",
    "flaggems_vllm/runtime/__init__.py": '''"""Stand-in: the CUDA device module, and no tuned configs."""
import torch

torch_device_fn = torch.cuda


def get_tuned_config(name):
    return []
''',
    "flaggems_vllm/utils/__init__.py": '''"""Stand-in: no FlagTree TLE (stock Triton), launch caching off, the autotuned kernel not callable."""


def has_triton_tle(*version):
    return False


def libentry():
    return lambda fn: fn


class _Untuned:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise NotImplementedError("stand-in: FlagGems' tuned configs are not loaded; the autotuned kernel "
                                  "(no addend, no snapshot write) is not measured")


def libtuner(**kwargs):
    return _Untuned
''',
    "flaggems_vllm/utils/device_info.py": '''"""Stand-in: the device queries, from torch."""
import torch


def get_device_capability():
    return torch.cuda.get_device_capability()


def get_sm_count():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
''',
}


def prepare_flaggems(src: Path) -> None:
    data = (src if src.is_file() else src / FLAGGEMS_FILE).read_bytes()
    if FLAGGEMS.exists():
        shutil.rmtree(FLAGGEMS)
    for rel, text in FLAGGEMS_STANDINS.items():
        (FLAGGEMS / rel).parent.mkdir(parents=True, exist_ok=True)
        (FLAGGEMS / rel).write_text(text)
    (FLAGGEMS / "flaggems_vllm/ops/attn_res.py").write_bytes(data)
    print(f"prepared {FLAGGEMS} (run with PYTHONPATH=build/engines/vllm:build/engines/flaggems and --flaggems)")


def _flaggems_serves(a, bank_rows):
    """The points FlagGems' fixed-configuration kernel serves: an addend or a snapshot write, K <= 8 rows."""
    return (a["delta"] or a["block_write_idx"] >= 0) and a["num_blocks"] <= FLAGGEMS_MAX_BLOCKS \
        and bank_rows >= FLAGGEMS_MAX_BLOCKS


def _inputs(T, NB, H, sets, seed, device):
    """`sets` input sets drawn on `device` (at T = 4096 a set is ~0.6 GB: drawn on the CPU it took seconds)."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, device=device)).to(**bf16)  # noqa: E731
    weights = dict(norm_weight=(1 + r(H, scale=0.1).float()).to(**bf16), qk_weight=r(H, scale=0.05),
                   output_norm_weight=(1 + r(H, scale=0.1).float()).to(**bf16))
    return [dict(prefix=r(T, H), delta=r(T, H, scale=0.3), blocks=r(T, NB, H), **weights) for _ in range(sets)]


def _clone(s):
    return {k: v.clone() for k, v in s.items()}


def _args(site, K):
    write = site.endswith("_write")
    return dict(delta=site.startswith("add_"), norm="rmsnorm" in site, num_blocks=K, block_write_idx=K if write else -1)


def _caller(fn, s, a, eps=1e-5, bank_rows=None):
    """bank_rows: pass the bank's first rows only (a view: FlagGems' kernel takes a [T, 8, H] bank)."""
    blocks = s["blocks"] if bank_rows is None else s["blocks"][:, :bank_rows]
    return lambda: fn(s["prefix"], s["delta"] if a["delta"] else None, blocks, s["norm_weight"], s["qk_weight"],
                      s["output_norm_weight"] if a["norm"] else None, num_blocks=a["num_blocks"],
                      block_write_idx=a["block_write_idx"], eps=eps, output_norm_eps=eps if a["norm"] else 0.0)


def _against(out_ref, s_ref, out, s):
    """One call's output and side effects against the reference call's on the same inputs."""
    import torch
    bits = lambda k: bool(torch.equal(s_ref[k].view(torch.int16), s[k].view(torch.int16)))  # noqa: E731
    return {"max_abs_diff": float((out_ref.float() - out.float()).abs().max()),
            "prefix_bitwise": bits("prefix"), "blocks_bitwise": bits("blocks")}


def _standing(points) -> str:
    """One line over a run's points: where attnres's median is below vLLM's, FlagGems' (where timed) and both."""
    def ahead(p, peer):
        return p["attnres"]["median_us"] < p[peer]["median_us"]
    fg = [p for p in points if "flaggems" in p]
    both = [p for p in points if ahead(p, "vllm") and ("flaggems" not in p or ahead(p, "flaggems"))]
    behind = [f"T={p['T']} N={p['N']}" for p in points if p not in both]
    return (f"attnres ahead of vLLM at {sum(ahead(p, 'vllm') for p in points)} of {len(points)} points, of FlagGems at "
            f"{sum(ahead(p, 'flaggems') for p in fg)} of {len(fg)}, of every kernel timed at {len(both)} of "
            f"{len(points)}" + (f"; behind at {', '.join(behind)}" if behind else ""))


def _against_vllm(vllm_call, calls, inputs):
    """vLLM's call and each of `calls` (name -> inputs -> call), once eagerly, each on its own copy of `inputs`
    (all of them drawn before any call runs: the calls update prefix and bank in place). name -> _against."""
    copies = {name: _clone(inputs) for name in ("vllm", *calls)}
    out_ref = vllm_call(copies["vllm"])()
    return {name: _against(out_ref, copies["vllm"], call(copies[name])(), copies[name]) for name, call in calls.items()}


def run(args) -> None:
    import torch
    from vllm.models.kimi_k3.nvidia.ops.attn_res import attn_res as vllm_attn_res

    import attnres
    from attnres.bench.timing import capture, rotating_sets, time_interleaved
    from attnres.integrations import vllm as plugin
    flaggems_attn_res = None
    if args.flaggems:
        from flaggems_vllm import attn_res as flaggems_attn_res

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    if torch.cuda.get_device_capability(dev)[0] != 9:
        sys.exit(f"bench_vllm: {name} is not compute capability 9.x")
    served = lambda *a, **k: plugin._serve(*a, **k)  # noqa: E731  the path the plugin serves, table bypassed
    results = {"device": name, "hidden": args.hidden, "bank_rows": args.bank_rows, "attnres": attnres.__version__,
               "torch": torch.__version__, "pdl": args.pdl, "flaggems": args.flaggems, "points": []}
    plugin.SETTINGS.options = None if args.pdl else attnres.Options(pdl=False)
    t0 = time.time()
    for site in args.sites:
        for T in args.tokens:
            for N in args.candidates:
                K = N - 1
                if site.endswith("_write") and K >= args.bank_rows:
                    continue
                if args.max_seconds and time.time() - t0 > args.max_seconds:
                    continue  # out of time: these points stay unmeasured (the plugin falls back there)
                a = _args(site, K)
                sets = rotating_sets(T * args.hidden * 2 * (2 + args.bank_rows))
                v_sets = _inputs(T, args.bank_rows, args.hidden, sets, T * 100 + N, dev)
                kernels = {"vllm": lambda s: _caller(vllm_attn_res, s, a), "attnres": lambda s: _caller(served, s, a)}
                if flaggems_attn_res is not None and _flaggems_serves(a, args.bank_rows):
                    kernels["flaggems"] = lambda s: _caller(flaggems_attn_res, s, a, bank_rows=FLAGGEMS_MAX_BLOCKS)
                # numerics first, and every kernel's own input sets before any capture: capturing runs the calls
                # eagerly, and they update prefix and bank in place
                checks = _against_vllm(kernels["vllm"], {k: c for k, c in kernels.items() if k != "vllm"}, v_sets[0])
                own = {k: v_sets if k == "vllm" else [_clone(s) for s in v_sets] for k in kernels}
                torch.cuda.synchronize()
                point = {"site": site, "T": T, "N": N, **checks["attnres"]}
                if "flaggems" in checks:
                    point["flaggems_vs_vllm"] = checks["flaggems"]
                graphs = {k: (capture([call(s) for s in own[k]]), sets) for k, call in kernels.items()}
                t = time_interleaved(graphs, repeats=args.repeats)
                point.update({k: v.as_dict() for k, v in t.items()})
                point["speedup"] = t["vllm"].median_us / t["attnres"].median_us
                fg = ""
                if "flaggems" in t:
                    point["speedup_vs_flaggems"] = t["flaggems"].median_us / t["attnres"].median_us
                    d = point["flaggems_vs_vllm"]
                    fg = (f"  flaggems {t['flaggems'].median_us:8.2f} us  x{point['speedup_vs_flaggems']:.2f} "
                          f"(vs vllm: max|d| {d['max_abs_diff']:.3g}, side effects "
                          f"{'==' if d['prefix_bitwise'] and d['blocks_bitwise'] else '!='})")
                results["points"].append(point)
                print(f"{site:18s} T={T:5d} N={N:2d}  vllm {t['vllm'].median_us:8.2f} us  attnres "
                      f"{t['attnres'].median_us:8.2f} us  x{point['speedup']:.2f}  max|d| {point['max_abs_diff']:.3g}  "
                      f"prefix {'==' if point['prefix_bitwise'] else '!='}  blocks "
                      f"{'==' if point['blocks_bitwise'] else '!='}{fg}", flush=True)
                del v_sets, own, graphs
                torch.cuda.empty_cache()
                # after every point: a sweep stopped at a time limit keeps what it measured
                Path(args.out).write_text(json.dumps(results, indent=1))
    if results["points"]:
        print(_standing(results["points"]))
    print(f"wrote {args.out}")


def table(args) -> None:
    runs = [json.loads(Path(f).read_text()) for f in args.files]
    keys = {(r["device"], r["hidden"], r["pdl"]) for r in runs}
    if len(keys) != 1:
        sys.exit(f"bench_vllm table: the runs differ in device / hidden / pdl: {sorted(keys)}")
    device, hidden, pdl = keys.pop()
    tokens, faster = set(), {}
    for r in runs:
        for p in r["points"]:
            tokens.add(p["T"])
            ok = p["prefix_bitwise"] and p["blocks_bitwise"] and \
                p["attnres"]["median_us"] < (1 - args.margin) * p["vllm"]["median_us"]
            ns = faster.setdefault(p["site"], {}).setdefault(str(p["T"]), [])
            if ok:
                ns.append(p["N"])
    data = {"schema": 1, "note": f"bench_vllm.py: attnres faster by > {args.margin:.0%} (median), side effects "
                                 f"bitwise; PDL {'on' if pdl else 'off'}", "device": device, "hidden": hidden,
            "vllm": "0.33.0", "attnres": runs[0]["attnres"], "tokens": sorted(tokens),
            "faster": {s: {t: sorted(ns) for t, ns in sorted(per.items(), key=lambda x: int(x[0]))}
                       for s, per in faster.items()}}
    from attnres.integrations import _common
    # The checkout's copy of the table, wherever attnres is installed.
    shipped = ROOT / "python" / "attnres" / "integrations" / \
        _common.table_file("vllm", device).relative_to(Path(_common.__file__).parent)
    write = Path(args.write) if args.write else shipped
    write.parent.mkdir(parents=True, exist_ok=True)
    write.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {write}: {sum(len(n) for per in faster.values() for n in per.values())} faster points "
          f"of {sum(len(r['points']) for r in runs)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("src", type=Path)
    pf = sub.add_parser("prepare-flaggems")
    pf.add_argument("src", type=Path)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES)
    r.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    r.add_argument("--candidates", nargs="+", type=int, default=list(range(1, 10)))
    r.add_argument("--hidden", type=int, default=7168)
    r.add_argument("--bank-rows", type=int, default=9, help="NB of the token-major bank [T, NB, H]")
    r.add_argument("--repeats", type=int, default=25)
    r.add_argument("--max-seconds", type=float, default=0,
                   help="stop measuring new points after this long (0: no limit); the file keeps what was measured")
    r.add_argument("--flaggems", action="store_true",
                   help="also time FlagGems-vllm's kernel (prepare-flaggems; PYTHONPATH gets build/engines/flaggems)")
    r.add_argument("--no-pdl", dest="pdl", action="store_false", help="attnres with PDL off (ATTNRES_VLLM_PDL=0)")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    t.add_argument("--margin", type=float, default=0.03)
    t.add_argument("--write", help="default: the GPU's shipped table, python/attnres/integrations/tables/vllm/<GPU>.json")
    args = ap.parse_args(argv)
    {"prepare": lambda: prepare(args.src), "prepare-flaggems": lambda: prepare_flaggems(args.src),
     "run": lambda: run(args), "table": lambda: table(args)}[args.cmd]()


if __name__ == "__main__":
    main()
