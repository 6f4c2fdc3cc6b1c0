"""The tensor-parallel suite (`python -m bench tp`; under torchrun or spawning its own ranks): Kimi K3's
93-layer decode step under TP = 2 as one CUDA graph per variant, with the NCCL all-reduce time separated, and
the latencies a fused one-shot all-reduce + AttnRes epilogue would have to beat (docs/tp.md).

Per T (default 1 and 8), five graphs replayed interleaved, with a cross-rank barrier before every sample:

* `tp_chain/fold_on`, `tp_chain/fold_off`: the step as the TP chain runs it. Sub-layers are fed (as in the
  chain suite) — each rank's recorded partials of attention, dense MLP and shared expert are copied into the
  all-reduce buffer (what a row-parallel GEMM's epilogue writes) and all-reduced (NCCL, in the graph); the MoE
  runs attnres.moe_finalize on its recorded local-route pieces (remote routes -1) and all-reduces the [T, 3584]
  latent partial; the routed output after the latent norm and up-projection is fed (sub-layer compute).
  Three all-reduces per MoE layer ([T, 7168] attention, [T, 3584] latent, [T, 7168] shared), two at layer 0.
* `tp_chain_no_comm/fold_on`, `/fold_off`: the same graphs with the all-reduce hook replaced by the identity
  (same copies, same ops, no communication; the numbers it computes are not the chain's).
  comm_us = step(tp_chain) - step(no_comm): what the all-reduces cost inside the step.
* `tp_comm_only`: the step's all-reduces alone, same sizes and order, no compute.

Checks, after one more replay over poisoned outputs: fold on == fold off bitwise; the fed TP chain equals the
TP model's own eager step (the recording) bitwise; every rank holds bit-identical traces; the latents the
graph all-reduced equal the recording's. A check that fails makes the command exit 1.

Plus per-call latencies (CUDA graph of many back-to-back calls): NCCL all-reduce of [T, 7168] and [T, 3584]
bf16 (with --symm-mem also torch's symmetric-memory one-shot all-reduce, P2P loads over NVLink: the floor of a
one-shot design); and the ops a fused epilogue would absorb (attn_res_add_rmsnorm with add2 at N = 9, the
local-route moe_finalize, the finalize with its norm, the torch latent norm).

With --device cpu (gloo), the same steps run eagerly, timed by wall clock: it exercises the code and the
checks, it measures nothing.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import Tensor

import attnres
from attnres.bench import results
from attnres.bench.chain import BANK_FILL, Chain, SiteTrace, trace_diffs, with_sublayers
from attnres.bench.timing import Timing, quantile, rotating_sets, time_interleaved
from attnres.bench.workloads import attnres_call, make_sets
from attnres.graphs import capture
from attnres.models.kimi_k3 import KimiK3Config, ResidualSettings
from attnres.models.kimi_k3.tp import (ROUTED_SCALE, Shards, finalize_partial, shard_range,
                                       tensor_parallel_model)
from attnres.moe import moe_finalize, rmsnorm_two_rounding
from tp_check.checks import ranks_disagree
from tp_check.launch import NO_MULTICAST_ENV, RankContext, init, launch, shutdown, under_torchrun

TOKENS = (1, 8)
H, LATENT, K_ROUTES = 7168, 3584, 16
AR_CALLS = 64  # all-reduces per latency graph (distinct buffers)
VARIANTS = ("tp_chain", "tp_chain_no_comm")


def cpu_config() -> KimiK3Config:
    return KimiK3Config.small(hidden_size=256, num_layers=10, snapshot_block=4, capture_layers=(1, 3))


# ------------------------------------------------------------------------------------------ recording
class _RecordingReduce:
    """The reduction hook of the recording step: all-reduces, and keeps (input, output) of every call."""

    def __init__(self, inner):
        self.inner = inner
        self.log: list[tuple[Tensor, Tensor]] = []

    def __call__(self, t: Tensor) -> Tensor:
        before = t.clone()
        out = self.inner(t)
        self.log.append((before, out.clone()))
        return out


class _Recorder:
    """Wraps a TP stand-in during the recording step: returns what it returns; keeps the all-reduces it made
    (and for the MoE its parts and this rank's pieces)."""

    def __init__(self, inner, log: list, moe: bool, rank: int):
        self.inner, self.log, self.moe, self.rank = inner, log, moe, rank
        self.reduced: list[tuple[Tensor, Tensor]] = []
        self.parts = self.pieces = None

    def __call__(self, x: Tensor, *, return_parts: bool = False):
        start = len(self.log)
        if not self.moe:
            out = self.inner(x)
            self.reduced = self.log[start:]
            return out
        self.parts = self.inner(x, return_parts=True)  # routed + shared below: the same add inner(x) does
        self.reduced = self.log[start:]
        self.pieces = self.inner.local_pieces(x, self.rank)
        return self.parts if return_parts else self.parts[0] + self.parts[1]


class _FedPartial:
    """Attention / dense MLP fed: the recorded partial copied into a fresh buffer, then the all-reduce."""

    def __init__(self, partial: Tensor, shards: Shards):
        self.partial, self.shards = partial, shards

    def __call__(self, x: Tensor) -> Tensor:
        return self.shards.reduce([self.partial.clone()])


class _FedMoE:
    """The MoE fed: moe_finalize on the recorded local-route pieces, the latent all-reduce (kept in `latent` for
    the check), the recorded routed output (latent norm + up-projection: sub-layer compute), the shared
    expert's recorded partial all-reduced. All-reduces in TPMoE's order: latent, then shared."""

    def __init__(self, pieces, routed: Tensor, shared_partial: Tensor, shards: Shards):
        self.pieces, self.routed, self.shared_partial, self.shards = pieces, routed, shared_partial, shards
        self.latent: Tensor | None = None

    def __call__(self, y: Tensor, *, return_parts: bool = False):
        self.latent = self.shards.reduce([finalize_partial(self.pieces, ROUTED_SCALE)])
        shared = self.shards.reduce([self.shared_partial.clone()])
        if return_parts:
            return self.routed, shared
        return self.routed + shared


def _record(ctx: RankContext, config: KimiK3Config, T: int, pdl: bool, seed: int):
    """One eager fold-off step of the TP model on this rank; returns the recorders per layer, the input, and
    the step's output and site trace (what the fed chains must reproduce), and the all-reduce log."""
    hook = _RecordingReduce(ctx.shards().all_reduce)
    model = tensor_parallel_model(config, Shards.of_rank(ctx.rank, ctx.world_size, hook),
                                  settings=ResidualSettings(fold=False, pdl=pdl), device=ctx.device, keep_paths=False)
    recorders = {}

    def make(layer):
        recorders[layer.layer] = (_Recorder(layer.attention, hook.log, False, ctx.rank),
                                  _Recorder(layer.mlp, hook.log, layer.is_moe, ctx.rank))
        return recorders[layer.layer]

    recording = with_sublayers(model, make, ResidualSettings(fold=False, pdl=pdl))
    x0 = model.embed(T, step=seed)
    trace = SiteTrace()
    out = recording(x0, bank=recording.allocate_bank(T, fill=BANK_FILL), trace=trace)
    return model, recorders, x0, (out, trace), hook.log


def _feeds(recorders: dict, shards: Shards) -> dict:
    feeds = {}
    for index, (attn, mlp) in recorders.items():
        fed_attn = _FedPartial(attn.reduced[0][0], shards)
        if mlp.moe:
            fed_mlp = _FedMoE(mlp.pieces, mlp.parts[0], mlp.reduced[1][0], shards)
        else:
            fed_mlp = _FedPartial(mlp.reduced[0][0], shards)
        feeds[index] = (fed_attn, fed_mlp)
    return feeds


def _no_comm(ctx: RankContext) -> Shards:
    return Shards(ctx.world_size, (ctx.rank,), all_reduce=lambda t: t)


# ------------------------------------------------------------------------------------------ timing
def _capture(fn) -> torch.cuda.CUDAGraph:
    """attnres.graphs.capture, thread_local: NCCL's watchdog thread queries events while this thread captures."""
    return capture(fn, capture_error_mode="thread_local")[0]


def _timing(values: list[float], calls: int) -> Timing:
    v = sorted(values)
    return Timing(statistics.median(v), quantile(v, 0.1), quantile(v, 0.9), v[0], calls, len(v))


def _time_ranked(ctx: RankContext, runs: dict, repeats: int, warmup: int, calls: dict | None = None
                 ) -> dict[str, Timing]:
    """runs: name -> a CUDA graph (replayed) or, on the CPU, a callable. Interleaved; every rank enters each
    sample together (barrier), so no rank's wait for a late peer is counted as the peer's work."""
    calls = calls or {}
    cuda = ctx.device.type == "cuda"

    def go(r):
        return r.replay() if cuda else r()

    for _ in range(warmup):
        for r in runs.values():
            go(r)
    ctx.barrier()
    samples = {name: [] for name in runs}
    if cuda:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for name, r in runs.items():
            ctx.barrier()
            if cuda:
                start.record()
                go(r)
                stop.record()
                stop.synchronize()
                us = start.elapsed_time(stop) * 1e3
            else:
                t0 = time.perf_counter()
                go(r)
                us = (time.perf_counter() - t0) * 1e6
            samples[name].append(us / calls.get(name, 1))
    return {name: _timing(v, calls.get(name, 1)) for name, v in samples.items()}


def _ranked(ctx: RankContext, timings: dict[str, Timing]) -> dict[str, list[float]]:
    """Every rank's median per name (all ranks get them)."""
    medians = ctx.all_gather_object({n: t.median_us for n, t in timings.items()})
    return {n: [m[n] for m in medians] for n in timings}


# ------------------------------------------------------------------------------------------ the chain
def chain_point(ctx: RankContext, config: KimiK3Config, T: int, *, pdl: bool = True, repeats: int = 25,
                warmup: int = 3, seed: int = 0) -> list[dict]:
    model, recorders, x0, (model_out, model_trace), log = _record(ctx, config, T, pdl, seed)
    chains = {}
    for variant, shards in (("tp_chain", ctx.shards()), ("tp_chain_no_comm", _no_comm(ctx))):
        for fold in (True, False):
            chains[variant, fold] = Chain(model, _feeds(recorders, shards), x0, fold, pdl)
    buffers = [before.clone() for before, _ in log]

    def comm_only():
        for b in buffers:
            dist.all_reduce(b)

    cuda = ctx.device.type == "cuda"
    ctx.barrier()
    if cuda:
        runs = {f"{v}/fold_{'on' if f else 'off'}": _capture(c.step) for (v, f), c in chains.items()}
        runs["tp_comm_only"] = _capture(comm_only)
    else:
        runs = {f"{v}/fold_{'on' if f else 'off'}": c.step for (v, f), c in chains.items()}
        runs["tp_comm_only"] = comm_only
    timings = _time_ranked(ctx, runs, repeats, warmup)
    ranked = _ranked(ctx, timings)

    # The checks read what one more replay of each wrote over poisoned outputs.
    if cuda:
        for c in chains.values():
            c.poison_outputs()
        ctx.barrier()
        for r in runs.values():
            r.replay()
        torch.cuda.synchronize()
    tp_on, tp_off = chains["tp_chain", True], chains["tp_chain", False]
    fold_diffs = trace_diffs(tp_on, tp_off)
    model_diffs = trace_diffs(tp_off, (model_out, model_trace))
    disagree = sorted({r for c in (tp_on, tp_off) for r in ranks_disagree(
        ctx, [t for s in c.last[1].sites for t in (s.prefix, s.output, s.tap)] + [c.last[0].output,
                                                                                   c.last[0].bank.storage])})
    recorded_latents = [rec[1].reduced[0][1] for _, rec in sorted(recorders.items()) if rec[1].moe]
    latents_equal = _latents_equal(chains, recorded_latents)
    moe_layers = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    sizes = sorted({tuple(b.shape) for b in buffers})
    common = {
        "suite": "tp", "kind": "chain", "T": T, "H": config.hidden_size, "layers": config.num_layers,
        "moe_layers": moe_layers, "world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
        "graph": cuda, "timer": "cuda_graph_events" if cuda else "cpu_eager_perf_counter", "pdl": pdl, "seed": seed,
        "all_reduces_per_step": len(buffers), "all_reduce_shapes": [list(s) for s in sizes],
        "fold_bitwise_equal": not fold_diffs, "fold_diffs": fold_diffs[:10], "equals_model": not model_diffs,
        "model_diffs": model_diffs[:10], "ranks_identical": not disagree, "ranks_differing": disagree,
        "latents_equal": latents_equal,
    }
    med = {name: t.median_us for name, t in timings.items()}
    derived = {}
    for fold in ("on", "off"):
        derived[fold] = {"comm_us": med[f"tp_chain/fold_{fold}"] - med[f"tp_chain_no_comm/fold_{fold}"]}
    fold_saving = med["tp_chain/fold_off"] - med["tp_chain/fold_on"]
    records = []
    for name, t in timings.items():
        fold = name.rsplit("_", 1)[-1] if "/" in name else None
        extra = {"fold": fold == "on"} if fold else {}
        if name.startswith("tp_chain/"):
            extra.update(derived[fold], fold_saving_us=fold_saving,
                         comm_only_us=med["tp_comm_only"], per_all_reduce_in_step_us=derived[fold]["comm_us"] /
                         max(len(buffers), 1))
        records.append({**common, "provider": name, **extra, **t.as_dict(), "rank_medians_us": ranked[name]})
    return records


def _latents_equal(chains: dict, recorded: list[Tensor]) -> bool:
    """The latents the TP chains' fed MoE layers all-reduced equal the recording's, bit for bit."""
    for fold in (True, False):
        fed = [layer.mlp for layer in chains["tp_chain", fold].model.layers if isinstance(layer.mlp, _FedMoE)]
        if len(fed) != len(recorded):
            return False
        for f, want in zip(fed, recorded, strict=True):
            if f.latent is None or not torch.equal(f.latent.view(torch.int16), want.view(torch.int16)):
                return False
    return True


# ------------------------------------------------------------------------------------------ latencies
def all_reduce_latency(ctx: RankContext, shapes, *, repeats: int = 25, warmup: int = 3,
                       symm_mem: bool = False) -> list[dict]:
    """Per-call all-reduce latency (NCCL on CUDA): AR_CALLS back-to-back in-place all-reduces of distinct [T, D]
    bf16 buffers in one graph; with symm_mem, torch's symmetric-memory one-shot all-reduce too (opt-in: its
    set-up is collective, and a rank that failed it alone would leave the other waiting)."""
    records = []
    cuda = ctx.device.type == "cuda"
    for T, D in shapes:
        g = torch.Generator().manual_seed(T * 7 + D)
        bufs = [(1e-3 * torch.randn(T, D, generator=g)).to(torch.bfloat16).to(ctx.device) for _ in range(AR_CALLS)]

        def nccl(bufs=bufs):
            for b in bufs:
                dist.all_reduce(b)

        runs, errors = {f"{ctx.backend}_all_reduce": _capture(nccl) if cuda else nccl}, {}
        keep_alive = []  # what a captured graph reads: a CUDA graph does not keep its buffers alive
        if cuda and symm_mem:
            one_shot, why = _symm_mem_one_shot(ctx, T, D)
            if one_shot is not None:
                runs["symm_mem_one_shot_all_reduce"], buf = one_shot
                keep_alive.append(buf)
            else:
                errors["symm_mem_one_shot_all_reduce"] = why
        timings = _time_ranked(ctx, runs, repeats, warmup, calls={n: AR_CALLS for n in runs})
        ranked = _ranked(ctx, timings)
        for name, t in timings.items():
            records.append({"suite": "tp", "kind": "all_reduce", "provider": name, "T": T, "D": D,
                            "bytes": T * D * 2, "world_size": ctx.world_size, "backend": ctx.backend,
                            "graph": cuda, **t.as_dict(), "rank_medians_us": ranked[name]})
        for name, why in errors.items():
            records.append({"suite": "tp", "kind": "all_reduce", "provider": name, "T": T, "D": D,
                            "bytes": T * D * 2, "world_size": ctx.world_size, "unavailable": why})
    return records


def _symm_mem_one_shot(ctx: RankContext, T: int, D: int):
    """((graph, buffer), "") : a graph of AR_CALLS one-shot all-reduces through torch's symmetric memory (P2P loads
    over NVLink, no multicast) and the symmetric buffer it reads, which the caller must keep alive while it
    replays the graph; or (None, why) where this torch or machine does not offer it. (At 3a47675 the buffer was
    freed on return and the first replay read freed symmetric memory: an illegal memory access.)"""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before rendezvous by older torch
            symm_mem.enable_symm_mem_for_group(group)
        buf = symm_mem.empty(T, D, dtype=torch.bfloat16, device=ctx.device)
        symm_mem.rendezvous(buf, group)
        buf.normal_()
        op = torch.ops.symm_mem.one_shot_all_reduce

        def run():
            for _ in range(AR_CALLS):
                op(buf, "sum", group)

        ctx.barrier()
        graph = _capture(run)
        ctx.barrier()
        return (graph, buf), ""
    except Exception as e:  # an optional comparison: any failure is recorded, not fatal
        return None, f"{type(e).__name__}: {e}"[:300]


def _finalize_sets(T: int, count: int, rank: int, world: int, seed: int, device):
    """Local-route finalize inputs at Kimi K3's shape: k = 16 routes of 64 experts, this rank's contiguous half
    local (the others -1), rows in a permuted buffer."""
    g = torch.Generator().manual_seed(seed * 131 + T)
    sets = []
    owned = shard_range(64, world, rank)
    for _ in range(count):
        ids = torch.stack([torch.randperm(64, generator=g)[:K_ROUTES] for _ in range(T)])
        local = (ids >= owned.start) & (ids < owned.stop)
        index = torch.full((T, K_ROUTES), -1, dtype=torch.int32)
        n = int(local.sum())
        index[local] = torch.randperm(n + 8, generator=g)[:n].to(torch.int32)
        rows = torch.randn(n + 8, LATENT, generator=g).to(torch.bfloat16)
        weights = torch.softmax(torch.randn(T, K_ROUTES, generator=g), -1)
        norm_weight = (1 + 0.1 * torch.randn(LATENT, generator=g)).to(torch.bfloat16)
        whole = torch.randperm(T * K_ROUTES + 8, generator=g)[:T * K_ROUTES].reshape(T, K_ROUTES).to(torch.int32)
        rows_whole = torch.randn(T * K_ROUTES + 8, LATENT, generator=g).to(torch.bfloat16)
        sets.append(tuple(t.to(device) for t in (rows, weights, index, norm_weight, rows_whole, whole)))
    return sets


def op_latency(ctx: RankContext, tokens, *, repeats: int = 25, pdl: bool = True) -> list[dict]:
    """The ops a fused all-reduce epilogue would absorb, per call (rank-local, CUDA graphs over rotating
    inputs as the decode suite): the fold's consumer (add2, N = 9), the local-route finalize, the finalize with
    its norm (TP = 1), and the torch latent RMSNorm that follows the all-reduce under TP."""
    records = []
    options = attnres.Options(pdl=pdl)
    for T in tokens:
        step = make_sets(T, 9, H, rotating_sets((9 + 4) * T * H * 2), seed=T, device="cuda")
        fin = _finalize_sets(T, rotating_sets((T * K_ROUTES + 8) * LATENT * 4), ctx.rank, ctx.world_size, T,
                             ctx.device)
        latent = [torch.randn(T, LATENT, device=ctx.device).to(torch.bfloat16) for _ in range(len(fin))]
        calls = {
            "attnres/add2_N9": [attnres_call(s, "add2", options) for s in step],
            "attnres/moe_finalize_local_routes": [
                (lambda s=s: moe_finalize(s[0], s[1], s[2], eps=1e-5, scale=ROUTED_SCALE)) for s in fin],
            "attnres/moe_finalize_with_norm_tp1": [
                (lambda s=s: moe_finalize(s[4], s[1], s[5], norm_weight=s[3], eps=1e-5, scale=ROUTED_SCALE))
                for s in fin],
            "torch/latent_rmsnorm": [(lambda x=x, s=s: rmsnorm_two_rounding(x, s[3], 1e-5))
                                     for x, s in zip(latent, fin, strict=True)],
        }
        graphs = {name: (_capture(lambda cs=cs: [c() for c in cs]), len(cs)) for name, cs in calls.items()}
        for name, t in time_interleaved(graphs, repeats=repeats).items():
            D = H if name == "attnres/add2_N9" else LATENT
            records.append({"suite": "tp", "kind": "op", "provider": name, "T": T, "D": D, "N": 9 if D == H else None,
                            "k": None if D == H else K_ROUTES, "rank": ctx.rank, **t.as_dict()})
    return records


# ------------------------------------------------------------------------------------------ the suite
def run_rank(opts: dict) -> list[dict] | None:
    """One rank of the suite; rank 0 saves the results and returns them (the other ranks return None)."""
    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    ctx = init(opts["device"])
    try:
        cuda = ctx.device.type == "cuda"
        config = opts.get("config") or (KimiK3Config.real() if cuda else cpu_config())
        tokens, repeats = opts["tokens"], opts["repeats"]
        records = []
        for i, T in enumerate(tokens if opts.get("chain", True) else ()):
            records += chain_point(ctx, config, T, pdl=opts["pdl"], repeats=repeats, seed=opts["seed"])
            if ctx.rank == 0:
                print(f"[{i + 1}/{len(tokens)}] tp chain T={T}", flush=True)
        if opts.get("latencies", True):
            shapes = [(T, D) for T in tokens for D in ((H, LATENT) if cuda else (config.hidden_size,))]
            records += all_reduce_latency(ctx, shapes, repeats=repeats, symm_mem=opts.get("symm_mem", False))
            if cuda:
                records += op_latency(ctx, tokens, repeats=repeats, pdl=opts["pdl"])
        if ctx.rank != 0:
            return None
        meta = results.metadata(opts.get("commit"), device="cuda" if cuda else "cpu")
        nccl = torch.cuda.nccl.version() if cuda else None
        meta.update(world_size=ctx.world_size, backend=ctx.backend,
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                    env={k: os.environ.get(k) for k in NO_MULTICAST_ENV})
        results.save(opts["out"], meta, records)
        print(f"\n{meta.get('gpu') or 'CPU'} x{ctx.world_size} ({ctx.backend}) commit {meta['commit']}: "
              f"{len(records)} records -> {opts['out']}")
        for line in summary(records):
            print(line)
        return records
    finally:
        shutdown()


_CHECK_DETAIL = {"fold_bitwise_equal": "fold_diffs", "equals_model": "model_diffs",
                 "ranks_identical": "ranks_differing", "latents_equal": None}


def failed_checks(records: list[dict]) -> list[str]:
    """The chain checks that failed, one line each ([] when all passed)."""
    bad = []
    for r in records:
        if r.get("kind") == "chain" and r["provider"] == "tp_chain/fold_on":
            for key, detail in _CHECK_DETAIL.items():
                if not r[key]:
                    bad.append(f"T={r['T']}: {key} is false" + (f" ({r.get(detail)})" if detail else ""))
    return bad


def summary(records: list[dict]) -> list[str]:
    lines = []
    chain = {(r["T"], r["provider"]): r for r in records if r.get("kind") == "chain"}
    for T in sorted({T for T, _ in chain}):
        on, off = chain[T, "tp_chain/fold_on"], chain[T, "tp_chain/fold_off"]
        nc_on, nc_off = chain[T, "tp_chain_no_comm/fold_on"], chain[T, "tp_chain_no_comm/fold_off"]
        comm = chain[T, "tp_comm_only"]
        label = "graph replay" if on["graph"] else "CPU eager, wall clock: exercises the code, not a measurement"
        lines.append(
            f"tp T={T} x{on['world_size']} ({label}): step fold off {off['median_us'] / 1e3:.3f} ms, on "
            f"{on['median_us'] / 1e3:.3f} ms (saves {on['fold_saving_us']:.1f} us); without the all-reduces "
            f"{nc_off['median_us'] / 1e3:.3f} / {nc_on['median_us'] / 1e3:.3f} ms -> all-reduces cost "
            f"{off['comm_us']:.1f} / {on['comm_us']:.1f} us in the step ({on['all_reduces_per_step']} calls, "
            f"{on['per_all_reduce_in_step_us']:.2f} us each); the all-reduces alone {comm['median_us']:.1f} us; "
            f"fold bitwise {'equal' if on['fold_bitwise_equal'] else 'DIFFERENT'}, "
            f"{'equals' if on['equals_model'] else 'DIFFERS FROM'} the TP model's eager step, ranks "
            f"{'identical' if on['ranks_identical'] else 'DIFFER'}")
    for r in records:
        if r.get("kind") == "all_reduce":
            if "unavailable" in r:
                lines.append(f"all-reduce {r['provider']} [{r['T']}, {r['D']}]: unavailable ({r['unavailable']})")
            else:
                lines.append(f"all-reduce {r['provider']} [{r['T']}, {r['D']}] bf16 ({r['bytes']} B): "
                             f"{r['median_us']:.2f} us per call (p10-p90 {r['p10_us']:.2f}-{r['p90_us']:.2f}; "
                             f"rank medians {', '.join(f'{m:.2f}' for m in r['rank_medians_us'])})")
        elif r.get("kind") == "op":
            lines.append(f"op {r['provider']} T={r['T']} D={r['D']}: {r['median_us']:.2f} us per call "
                         f"(p10-p90 {r['p10_us']:.2f}-{r['p90_us']:.2f})")
    return lines


def main(args) -> int:
    """`python -m bench tp` (args from bench/cli.py): under torchrun, this process is one rank;
    otherwise --nproc ranks are spawned. Exit 1 if a chain check failed."""
    if args.no_latencies and args.latencies_only:
        raise SystemExit("bench tp: --no-latencies and --latencies-only exclude each other")
    opts = dict(device=args.device, tokens=args.tokens, repeats=args.repeats, pdl=not args.no_pdl, seed=0,
                out=args.out or "bench_results_tp.json", commit=args.commit, config=args.config,
                latencies=not args.no_latencies, chain=not args.latencies_only, symm_mem=args.symm_mem,
                threads=1 if args.device == "cpu" else None)
    if under_torchrun():
        records = run_rank(opts)
        if records is None:  # rank != 0: rank 0 reports
            return 0
    else:
        records = launch(run_rank, args.nproc, opts)[0]
    bad = failed_checks(records)
    for line in bad:
        print(f"tp: check failed: {line}", file=sys.stderr)
    return 1 if bad else 0
