#!/usr/bin/env python3
"""SGLang's AttnRes functions against the attnres plugin's replacements, on the GPU (the H200), and the table the
plugin consults on that GPU (python/attnres/integrations/tables/sglang/<GPU>.json; docs/integrations.md).

SGLang's own code runs: sglang/srt/layers/attn_residual.py and sglang/srt/plugins/hook_registry.py are taken from
an unpacked SGLang wheel (--sglang-src, copied to the GPU host; tools/engines/sglang_prepare.sh copies
them). The modules attn_residual imports that need SGLang's compiled dependencies are replaced by minimal
stand-ins generated here into an ignored folder: RMSNorm (its CUDA forward is one fused kernel, sgl_kernel's
rmsnorm; the stand-in is one Triton kernel of the same arithmetic), ReplicatedLinear (a weight), utils
(is_cuda/is_hip/is_npu). The plugin is registered and applied through SGLang's real HookRegistry.

Per point (entry point, T, N = nvb + 1; H = 7168 unless --hidden): one correctness call each way on identical
inputs (max |delta| of the normed output / mixture, the prefix a + b and the bank bitwise), then CUDA-graph replay
timing, interleaved (attnres.bench.timing): "sglang" (SGLang's function, hooks bypassed), "attnres" (the hooked
entry point, table forced open), and "sglang_mix_only" (SGLang's path without its output RMSNorm: _mix_fused, after
the a + b add for _aggregate_fused_add). attnres is marked faster only when its p90 is below the p10 of the *lower*
of SGLang's two timings: SGLang's path minus its norm cannot be slower than SGLang's path with sgl_kernel's norm,
so the verdict does not rest on the stand-in norm's speed.

    python3 tools/engines/bench_sglang.py --sglang-src build/engines/sglang_ref --out $OUT/sglang.json \
        --write-table python/attnres/integrations/tables/sglang/NVIDIA_H200.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "build" / "engines" / "sglang_runtime"  # ignored (/build/)
COPIED = ("sglang/srt/layers/attn_residual.py", "sglang/srt/plugins/hook_registry.py")
ENTRIES = ("_aggregate", "_aggregate_fused", "_aggregate_fused_add", "aggregate_stream")
TOKENS = (1, 4, 8, 32, 256, 4096)
CANDIDATES = tuple(range(1, 10))

STANDINS = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    # SGLang's plugins/__init__.py imports its environment module; the registry itself needs only the stdlib.
    "sglang/srt/plugins/__init__.py": "",
    "sglang/srt/layers/__init__.py": "",
    "sglang/srt/utils.py": """\
import torch

def is_cuda():
    return torch.version.cuda is not None and torch.cuda.is_available()

def is_hip():
    return False

def is_npu():
    return False
""",
    "sglang/srt/layers/linear.py": """\
import torch

class ReplicatedLinear(torch.nn.Module):
    # The score projection Linear(H, 1, bias=False): SGLang's kernels read only its weight.
    def __init__(self, input_size, output_size, bias=False, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=torch.bfloat16),
                                         requires_grad=False)
        self.bias = None

    def forward(self, x):
        return x @ self.weight.t(), None
""",
    "sglang/srt/layers/layernorm.py": """\
import torch
import triton
import triton.language as tl

@triton.jit
def _rmsnorm_row(x_ptr, w_ptr, o_ptr, stride_x, stride_o, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + offs, (x * r * w).to(o_ptr.dtype.element_ty), mask=mask)

class RMSNorm(torch.nn.Module):
    # SGLang's RMSNorm on CUDA without a residual: one kernel, bf16(x * rsqrt(mean(x^2) + eps) * w) in fp32.
    def __init__(self, hidden_size, eps=1e-6, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.bfloat16))
        self.variance_epsilon = eps
        self.variance_size_override = None
        self.override_orig_dtype = None
        self.cast_x_before_out_mul = False

    def forward(self, x):
        out = torch.empty_like(x)
        H = x.shape[-1]
        _rmsnorm_row[(x.shape[0],)](x, self.weight, out, x.stride(0), out.stride(0), H, self.variance_epsilon,
                                    BLOCK=triton.next_power_of_2(H), num_warps=8)
        return out
""",
}


def prepare(src: Path, root: Path = RUNTIME, standins: dict = STANDINS, copied: tuple = COPIED) -> Path:
    """The runtime tree: SGLang's files copied, the stand-ins written. Returns its root.
    tools/engines/sglang_pytest_plugin.py builds its own tree (more files) in another folder this way."""
    missing = [rel for rel in copied if not (src / rel).is_file()]
    if missing:
        sys.exit(f"bench_sglang: {src} lacks {missing} (run tools/engines/sglang_prepare.sh and copy its folder to this machine)")
    shutil.rmtree(root, ignore_errors=True)
    for rel, text in standins.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for rel in copied:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    return root


class _Open:
    """A table that lets every call through (what is being measured is whether it should)."""
    source = "<bench: open>"

    def verdict(self, *_):
        return None


def _ints(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return tuple(out)


def decide(row: dict) -> bool:
    """attnres only where it is correct and faster than SGLang's cheaper timing beyond the noise."""
    if row["attnres"] is None:
        return False  # the plugin declined the call (row["fallbacks"] says why): nothing to measure
    ok = row["prefix_bitwise"] and row["bank_bitwise"] and row["rel_l2"] < 5e-3 and row["cosine"] > 0.9999
    floor = min(row["sglang"]["p10_us"], row["sglang_mix_only"]["p10_us"])
    return bool(ok and row["attnres"]["p90_us"] < floor)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-src", type=Path, default=ROOT / "build" / "engines" / "sglang_ref",
                    help="folder holding sglang/srt/layers/attn_residual.py and sglang/srt/plugins/hook_registry.py")
    ap.add_argument("--sglang-version", default="0.5.23")
    ap.add_argument("--entries", default=",".join(ENTRIES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--candidates", default="1-9")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--max-sets", type=int, default=1024, help="cap on rotating input sets per graph")
    ap.add_argument("--out", type=Path, help="results JSON (every row, timings and checks)")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="stop measuring new points after this long (0: no limit); what was measured is written")
    ap.add_argument("--write-table", type=Path, help="write the plugin's table here")
    ap.add_argument("--merge", action="store_true", help="keep --write-table's rows for points not measured now")
    ap.add_argument("--prepare-only", action="store_true", help="generate the runtime tree and stop (no GPU)")
    args = ap.parse_args()

    root = prepare(args.sglang_src.resolve())
    if args.prepare_only:
        print(f"bench_sglang: runtime tree in {root}")
        return 0
    sys.path.insert(0, str(root))
    try:  # the installed attnres (a wheel); the checkout's python/ only without one (it has no extension module)
        import attnres._C  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "python"))
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_sglang: needs a CUDA GPU")
    torch.set_grad_enabled(False)  # SGLang's forward runs without autograd
    from sglang_bench_points import measure_point  # noqa: E402 (tools/engines, next to this file)

    import attnres.integrations.sglang as plugin
    from attnres.integrations.sglang_table import Table, TableError, table_dict
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    HookRegistry.apply_hooks()
    if not plugin.stats()["registered"]:
        sys.exit("bench_sglang: the plugin did not register (is ATTNRES_SGLANG=0 set?)")
    plugin.set_table(_Open())
    import sglang.srt.layers.attn_residual as ar

    device = torch.cuda.get_device_name()
    entries = [e for e in args.entries.split(",") if e]
    rows, t0 = [], time.time()
    for entry in entries:
        for T in _ints(args.tokens):
            for N in _ints(args.candidates):
                if entry == "aggregate_stream" and N == 1:
                    continue  # nvb = 0: SGLang returns the prefix itself, nothing is replaced
                if args.max_seconds and time.time() - t0 > args.max_seconds:
                    continue  # out of time: the points measured so far are written; the rest stay unmeasured
                row = measure_point(plugin, ar, entry, T, N, args.hidden, args.repeats, args.max_sets)
                row["use_attnres"] = decide(row)
                rows.append(row)
                times = ("declined: " + json.dumps(row["fallbacks"]) if row["attnres"] is None else
                         f"attnres {row['attnres']['median_us']:9.2f} us  sglang {row['sglang']['median_us']:9.2f} "
                         f"(mix only {row['sglang_mix_only']['median_us']:9.2f})")
                print(f"{entry:22s} T={T:5d} N={N} {times}  max|d| {row['max_abs_diff']:.3g}  prefix/bank bitwise "
                      f"{row['prefix_bitwise']}/{row['bank_bitwise']}  -> "
                      f"{'attnres' if row['use_attnres'] else 'sglang'}", flush=True)
                torch.cuda.empty_cache()
    measured = {"commit": os.environ.get("ATTNRES_COMMIT", "unknown"), "sglang": args.sglang_version,
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0),
                "criterion": "correct and attnres p90 < min(sglang p10, sglang_mix_only p10), CUDA-graph replay"}
    if args.out:
        args.out.write_text(json.dumps({"device": device, "hidden": args.hidden, "measured": measured,
                                        "rows": rows}, indent=1))
    if args.write_table:
        keep = []
        if args.merge and args.write_table.exists():
            try:
                old = Table.load(args.write_table)
            except TableError as e:
                sys.exit(f"bench_sglang: cannot merge into {e}")
            if old.rows and (old.device, old.hidden) != (device, args.hidden):
                sys.exit(f"bench_sglang: {args.write_table} was measured on {old.device} at H = {old.hidden}")
            now = {(r["entry"], r["tokens"], r["candidates"]) for r in rows}
            keep = [r for r in old.rows if (r["entry"], r["tokens"], r["candidates"]) not in now]
        table_rows = keep + [{"entry": r["entry"], "tokens": r["tokens"], "candidates": r["candidates"],
                              "use_attnres": r["use_attnres"],
                              "attnres_us": r["attnres"]["median_us"] if r["attnres"] else None,
                              "sglang_us": r["sglang"]["median_us"] if r["sglang"] else None,
                              "sglang_mix_only_us": r["sglang_mix_only"]["median_us"] if r["sglang"] else None}
                             for r in rows]
        note = ("attnres runs where use_attnres is true; every other call runs SGLang's own function. "
                "Regenerate with tools/engines/bench_sglang.py (docs/integrations.md).")
        args.write_table.write_text(json.dumps(table_dict(device, args.hidden, table_rows, measured, note),
                                               indent=1) + "\n")
        print(f"bench_sglang: wrote {args.write_table} ({len(table_rows)} rows)")
    bad = [r for r in rows if not (r["prefix_bitwise"] and r["bank_bitwise"])]
    print(f"bench_sglang: {len(rows)} points, {sum(r['use_attnres'] for r in rows)} take attnres, "
          f"{len(bad)} with a bitwise side-effect mismatch; plugin stats {plugin.stats()['fallbacks'] or 'no fallbacks'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
