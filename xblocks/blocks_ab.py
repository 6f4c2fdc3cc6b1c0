"""Token-block experiment: bits against split_k, then the cold-L2 A/B of the default against ATTNRES_X_BLOCKS variants.
usage: python3 xblocks/blocks_ab.py bits|time OUTPREFIX"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import attnres
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, make_sets
from bench.prefill import op_bytes, _call
from bench.floors import copy_bandwidth_tbs

H = 7168
VARIANTS = os.environ.get("AB_VARIANTS", "7:4,7:3,4:2,4:3").split(",")


def fits(v, N):
    S = int(v.split(":")[0])
    return N <= 2 or S * 8 <= 32


class env:
    def __init__(self, v): self.v = v
    def __enter__(self):
        if self.v: os.environ["ATTNRES_X_BLOCKS"] = self.v
    def __exit__(self, *a):
        os.environ.pop("ATTNRES_X_BLOCKS", None)


def u16(t): return t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.contiguous().view(torch.int32)


def results(case, s, T, N, opts):
    w3 = (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)
    pre = s.prefix.clone()
    bank = s.bank.clone()
    if case == "norm":
        r = attnres.attn_res_rmsnorm(pre, bank, *w3, return_mixture=True, options=opts)
    elif case == "norm_snap":
        big = torch.zeros(N, T, H, dtype=torch.bfloat16, device="cuda"); big[: N - 1] = bank
        r = attnres.attn_res_rmsnorm(pre, big[: N - 1], *w3, snapshot_slot=N - 1, options=opts)
        r = (r, big)
    elif case == "add":
        r = attnres.attn_res_add_rmsnorm(pre, s.routed, bank, *w3, return_mixture=True, options=opts)
    elif case == "add_inplace":
        r = attnres.attn_res_add_rmsnorm(pre, s.routed, bank, *w3, out=(pre, None), options=opts)
        r = (r[1], pre)
    elif case == "add2":
        r = attnres.attn_res_add_rmsnorm(pre, s.routed, bank, *w3, layer_residual_add2=s.shared, options=opts)
    elif case == "mix":
        r = attnres.attn_res(pre, bank, s.res_weight, s.rms_weight, EPS, diagnostics=True, options=opts)
    elif case == "mix_add":
        r = attnres.attn_res(pre, bank, s.res_weight, s.rms_weight, EPS, layer_residual_add=s.routed, diagnostics=True, options=opts)
    elif case == "mix_add2":
        r = attnres.attn_res(pre, bank, s.res_weight, s.rms_weight, EPS, layer_residual_add=s.routed,
                             layer_residual_add2=s.shared, diagnostics=False, options=opts)
    r = r if isinstance(r, tuple) else (r,)
    torch.cuda.synchronize()
    return [u16(x).clone() for x in r]


def bits():
    cases = ["norm", "norm_snap", "add", "add_inplace", "add2", "mix", "mix_add", "mix_add2"]
    bad = checked = 0
    ref_opts = attnres.Options(kernel="split_k")
    for T in (1, 3, 133, 1000):
        for N in (1, 2, 3, 4):
            s = make_sets(T, N, H, 1, seed=T * 10 + N)[0]
            # a few non-finite and zero rows
            if T >= 3:
                s.prefix[1].zero_()
                s.routed[2, 5] = float("inf")
            for case in cases:
                ref = results(case, s, T, N, ref_opts)
                for v in VARIANTS:
                    if not fits(v, N):
                        continue
                    with env(v):
                        got = results(case, s, T, N, attnres.Options(kernel="single_cta"))
                    checked += 1
                    same = all(torch.equal(a, b) for a, b in zip(ref, got))
                    if not same:
                        bad += 1
                        diffs = [int((a != b).sum()) for a, b in zip(ref, got)]
                        print(f"MISMATCH {v} {case} T={T} N={N} differing={diffs}")
    print(f"bits: {checked - bad}/{checked} variant calls equal split_k bit for bit")
    return bad == 0


def time_points(points, out):
    copy = copy_bandwidth_tbs()
    print(f"copy {copy:.3f} TB/s", flush=True)
    recs = []
    for op, T, N in points:
        nbytes = op_bytes(op, T, N, H)
        count = rotating_sets(nbytes, minimum=1)
        sets = make_sets(T, N, H, count, seed=T * 100 + N)
        from bench.peers import calls_per_graph
        calls = calls_per_graph(count, nbytes)
        graphs = {}
        for v in ["default"] + [v for v in VARIANTS if fits(v, N)]:
            with env(None if v == "default" else v + ":all"):
                graphs[v] = (capture([_call(op, sets[i % count], attnres.Options()) for i in range(calls)]), calls)
        t = time_interleaved(graphs, repeats=int(os.environ.get("AB_REPEATS", "15")))
        line = f"{op:5s} T={T:6d} N={N}"
        for v, tt in t.items():
            pct = 100 * nbytes / (tt.median_us * 1e-6) / 1e12 / copy
            recs.append(dict(op=op, T=T, N=N, variant=v, us=tt.median_us, pct_copy=pct, copy_tbs=copy))
            line += f" | {v} {tt.median_us:8.2f} {pct:5.1f}%"
        print(line, flush=True)
        json.dump(recs, open(out, "w"), indent=1)
        del graphs, sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    what, out = sys.argv[1], sys.argv[2]
    if what == "bits":
        sys.exit(0 if bits() else 1)
    ops = os.environ.get("AB_OPS", "norm,add").split(",")
    Ts = [int(x) for x in os.environ.get("AB_TS", "4096").split(",")]
    Ns = [int(x) for x in os.environ.get("AB_NS", "1,2,3,4").split(",")]
    time_points([(op, T, N) for T in Ts for op in ops for N in Ns], out)
