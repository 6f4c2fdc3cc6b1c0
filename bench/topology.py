"""The automatic topology's grid (python -m bench topology): attn_res_add_rmsnorm with one addend under
the default options and on every kernel the call can run on, forced (split_k; single_cta for N <= 4; the
persistent kernel), at T in {128, 256, 512, 1024, 2048, 4096} x N = 3..16, H = 7168, cold L2 (the project's
harness: rotating sets past twice the L2, peers.calls_per_graph calls per graph), all of a point interleaved.
`--no-add`: attn_res_rmsnorm (no addend) instead, at N = 1..16 (no snapshot yet at N = 1: the op is an RMSNorm).
`--mix`: attn_res (no trailing norm, no fp32 diagnostics) with the addend, or without it (with `--no-add`): the op
takes the thresholds of the normed op of the same addend.

It is the measurement behind tuning::automatic_persistent_min_tokens (cpp/src/plan_tuning.hpp): the
persistent kernel's time grows with N, split_k's with its candidate bucket, so which is faster depends on both.
Read from the records: per point the fastest forced kernel and the default's time over it; the check that the
default is within TOLERANCE of the fastest at every point (N <= 2 with the addend is the streaming single_cta's
rule, measured by the peers and decode suites)."""

from __future__ import annotations

from .grid import measure
from .peers import FORCED, H_DEFAULT, run_point

TOKENS = (128, 256, 512, 1024, 2048, 4096)
CANDIDATES = tuple(range(3, 17))
QUICK_TOKENS = (256, 1024, 4096)
QUICK_CANDIDATES = (4, 6, 9, 10, 12)
# Without the addend: every N, the streaming single_cta's N <= 2 and the plain RMSNorm of N = 1 included.
CANDIDATES_NO_ADD = tuple(range(1, 17))
QUICK_CANDIDATES_NO_ADD = (1, 2, 5, 9, 12)
TOLERANCE = 0.03


def points(quick: bool = False, add: bool = True, tokens: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """tokens: the T values instead of the grid's (the candidates stay the grid's)."""
    cands = (QUICK_CANDIDATES if quick else CANDIDATES) if add else (
        QUICK_CANDIDATES_NO_ADD if quick else CANDIDATES_NO_ADD)
    return [(T, N) for T in (tokens or (QUICK_TOKENS if quick else TOKENS)) for N in cands]


def run(quick: bool = False, H: int = H_DEFAULT, copy_tbs: float | None = None, progress=None,
        repeats: int = 25, add: bool = True, tokens: tuple[int, ...] | None = None, mix: bool = False) -> list[dict]:
    """copy_tbs: the run's copy rate for the records' pct_copy (None: not recorded). add=False: attn_res_rmsnorm;
    mix: attn_res (with the addend or, add=False, without)."""
    return measure(points(quick, add, tokens),
                   lambda T, N: run_point(T, N, H, copy_tbs, repeats, suite="topology", regimes=("cold",), add=add,
                                          mix=mix),
                   lambda T, N: f"topology T={T} N={N}{_label(add, mix)}", progress)


def _add(record: dict) -> bool:
    return record.get("add", True)  # records from before the no-addend grid are of the one-addend op


def _mix(record: dict) -> bool:
    return record.get("op") == "attn_res"


def _label(add: bool, mix: bool) -> str:
    return (" attn_res" if mix else "") + ("" if add else " (no addend)")


# ------------------------------------------------------------------------------------------- reading records
def rows(records: list[dict]) -> list[dict]:
    """Per (op, T, N, H), the one-addend op first: the default's kernel and time, the fastest forced kernel and its
    time, ratio = default / fastest."""
    rec = [r for r in records if r.get("suite") == "topology" and r.get("regime") == "cold"]
    out = []
    for key in sorted({(_mix(r), not _add(r), r["T"], r["N"], r["H"]) for r in rec}):
        at = {r["provider"]: r for r in rec if (_mix(r), not _add(r), r["T"], r["N"], r["H"]) == key}
        default = at.get("attnres/default")
        forced = {p.split("/", 1)[1]: r["median_us"] for p, r in at.items() if p != "attnres/default"}
        if default is None or not forced:
            continue
        best = min(forced, key=forced.get)
        out.append({"mix": key[0], "add": not key[1], "T": key[2], "N": key[3], "H": key[4],
                    "kernel": default["default_kernel"],
                    "default_us": default["median_us"], "best": best, "best_us": forced[best],
                    "ratio": default["median_us"] / forced[best], "forced": forced})
    return out


def target(records: list[dict]) -> tuple[str, str, str, bool] | None:
    got = rows(records)
    if not got:
        return None
    worst = max(got, key=lambda r: r["ratio"])
    slow = [r for r in got if r["ratio"] > 1 + TOLERANCE]
    measured = (f"within {100 * TOLERANCE:.0f}% at {len(got) - len(slow)} of {len(got)} points; worst "
                f"{worst['ratio']:.3f}x at T={worst['T']} N={worst['N']}{_op_label(worst)} ({worst['kernel']} "
                f"{worst['default_us']:.1f} vs {worst['best']} {worst['best_us']:.1f} us)")
    return ("topology", f"the default options within {100 * TOLERANCE:.0f}% of the fastest kernel, T = 128..4096, "
            "N = 3..16 with one addend, N = 1..16 without", measured, not slow)


def _op_label(row: dict) -> str:
    return _label(row["add"], row["mix"])


def summary(records: list[dict]) -> list[str]:
    got = rows(records)
    if not got:
        return []
    names = tuple(FORCED)
    lines = []
    for i, r in enumerate(got):
        if i == 0 or (r["add"], r["mix"]) != (got[i - 1]["add"], got[i - 1]["mix"]):
            op = "attn_res" if r["mix"] else ("attn_res_add_rmsnorm" if r["add"] else "attn_res_rmsnorm")
            lines.append(f"topology grid: µs per call, {op}, {'one addend' if r['add'] else 'no addend'}, "
                         "cold L2; the default's kernel / µs, then each kernel forced; ratio = default / fastest")
            lines.append(f"{'T':>6} {'N':>3}  {'default':<11}{'µs':>9}" + "".join(f"{n:>12}" for n in names)
                         + f"{'ratio':>8}")
        lines.append(f"{r['T']:6d} {r['N']:3d}  {r['kernel']:<11}{r['default_us']:9.2f}"
                     + "".join((f"{r['forced'][n]:.2f}" if n in r["forced"] else "-").rjust(12) for n in names)
                     + f"{r['ratio']:7.3f}" + ("" if r["ratio"] <= 1 + TOLERANCE else " !"))
    return lines
