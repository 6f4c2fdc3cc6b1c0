"""The single-GPU benchmark of the fused all-reduce epilogues (python -m bench allreduce).

The world: attnres.comm.InProcessWorld with W = 2 ranks on one GPU, each rank's kernels on its own stream, the
peers' buffers in the same GPU's memory. Per site and T, these variants, each called by every rank:

* plain       the op without any reduction (the single-GPU epilogue): attn_res_add_rmsnorm with the partial as
              its addend (site add) or second addend (site add2); moe_finalize of the local routes with the norm;
* all_reduce  the standalone one-shot all_reduce alone;
* unfused     the standalone one-shot all_reduce, then the plain op on the reduced sum (two launches; three for
              the MoE finalize: the local combine, the all_reduce, the norm);
* fused       all_reduce_attn_res_add_rmsnorm (site add / add2: two kernels joined by PDL) or
              moe_finalize_all_reduce (one kernel).

Shapes: Kimi K3's sites, H = 7168 with N = 9 candidates (8 bank rows), and its MoE latent, D = 3584 with k = 16
routes, at T in {1, 4, 8, 32} (the MoE finalize at T = 1..32: its token gate's A/B; MAX_TOKENS_ONE_GPU says
why not more). Every variant's calls of
one point are captured as one CUDA graph per rank (rank r's part of every call, on the rank's own stream),
repeated over rotating input sets (more bytes than twice the L2, bench/timing.py); one replay of a variant
launches every rank's graph on its stream, forked from and joined back into the timing stream
(`replay_ranks`); the variants are replayed interleaved (time_interleaved) and the per-site time is replay
time / calls. After timing, each point checks that the fused op's outputs of every set equal the unfused
path's bit for bit on every rank (`bitwise_equal`). Nothing runs eagerly on CUDA (`capture_ranks` says why).

A lower bound: the peers' partials are read from local HBM, not across NVLink, and the W = 2 ranks share one
GPU's SMs; two GPUs pay the NVLink latency on top (the two-GPU measurement is a separate run). Both ranks'
kernels must be resident at once for the exchange to progress, which they are at these sizes.

`device="cpu"` runs the same variants on the CPU backend with a small shape, timed eagerly with
time.perf_counter (no graphs): it exercises the code and the bitwise check (CI), it measures nothing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import attnres
from attnres.all_reduce import all_reduce, all_reduce_attn_res_add_rmsnorm, moe_finalize_all_reduce
from attnres.bench.timing import Timing, quantile, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, make_sets, step_bytes
from attnres.moe import moe_finalize
from attnres.comm import CommunicatorError, InProcessWorld

WORLD = 2
TOKENS = (1, 4, 8, 32)
QUICK_TOKENS = (1, 8)
# The MoE finalize's points set its token gate (ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS): fused vs unfused,
# same run, around the crossover.
MOE_TOKENS = (1, 2, 4, 8, 16, 32)
QUICK_MOE_TOKENS = (1, 8, 16, 32)
SITE_H, SITE_N = 7168, 9
MOE_D, MOE_K = 3584, 16
CPU_SHAPE = {"H": 64, "N": 3, "D": 64, "k": 4}
SITES = ("add", "add2", "moe_finalize")
PROVIDERS = ("plain", "all_reduce", "unfused", "fused")
MOE_SCALE = 2.827
TIMER_GRAPH = "cuda_graph_events"
TIMER_CPU = "cpu_eager_perf_counter"
LOWER_BOUND = ("in-process W = 2 world on one GPU (each rank on its own stream, the peers' buffers in local "
               "memory instead of across NVLink): a lower bound of the two-GPU per-site time")
CPU_NOTE = "CPU eager, wall clock: exercises the code, not a measurement"
# The in-process world needs every rank's exchanging blocks resident at once, and PDL lets each rank's next
# kernel hold resident blocks while it waits: at T = 64 the MoE finalize's 2 ranks x 2 grids x 64 blocks of
# 448 threads no longer fit the H200 beside each other, and its exchange stalled until the bounded wait expired.
# Separate GPUs do not share the hazard (each rank's blocks fit its own GPU).
MAX_TOKENS_ONE_GPU = 32


@dataclass
class MoeSet:
    rows: torch.Tensor  # [T * k + 8, D] bf16: permuted rows with padding, as a MoE runner leaves them
    weights: torch.Tensor  # [T, k] f32
    index: torch.Tensor  # [T, k] int32, -1 for the routes another rank owns
    norm_weight: torch.Tensor  # [D] bf16
    ones: torch.Tensor  # [T, 1] f32 and arange [T, 1] int32: the norm of the unfused path as moe_finalize
    arange: torch.Tensor


def _moe_sets(T: int, k: int, D: int, count: int, seed: int, device: str) -> list[MoeSet]:
    g = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(count):
        R = T * k + 8
        index = torch.randperm(R, generator=g, device=device)[: T * k].reshape(T, k).to(torch.int32)
        index[:, k // 2:] = -1  # half the routes are another rank's
        sets.append(MoeSet(rows=torch.randn(R, D, generator=g, device=device).to(torch.bfloat16),
                           weights=torch.softmax(torch.randn(T, k, generator=g, device=device), dim=-1),
                           index=index,
                           norm_weight=(1 + 0.1 * torch.randn(D, generator=g, device=device)).to(torch.bfloat16),
                           ones=torch.ones(T, 1, device=device),
                           arange=torch.arange(T, dtype=torch.int32, device=device).view(T, 1)))
    return sets


@dataclass
class Variant:
    """One variant of one call: fn(comm, inputs[r]) is rank r's part of it (its kernels on the current stream);
    `gathered` is what the CPU backend reduces (every rank's partial), unused on CUDA."""
    fn: Callable[[object, object], object]
    inputs: list
    gathered: list | None = None

    def run_all(self, world: InProcessWorld) -> list:
        """Every rank's part, the ranks concurrent (CUDA: each on its own stream)."""
        return world.run(self.fn, self.inputs, gathered=self.gathered)

    def rank_call(self, world: InProcessWorld, r: int) -> Callable[[], object]:
        return lambda: self.fn(world.comms[r], self.inputs[r])


def _site_calls(site: str, ranks: list) -> dict[str, Variant]:
    """The five variants of one call of site add / add2; ranks[r] is rank r's StepSet (its `shared` is the
    rank's partial)."""
    partials = [s.shared for s in ranks]

    def weights(s):
        return (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)

    def plain(s, addend):
        if site == "add":
            return attnres.attn_res_add_rmsnorm(s.prefix, addend, s.bank, *weights(s))
        return attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *weights(s), layer_residual_add2=addend)

    def fused(c, s):
        return all_reduce_attn_res_add_rmsnorm(c, s.shared, s.prefix, s.bank, *weights(s), site=site,
                                               layer_residual_add=s.routed if site == "add2" else None)

    def unfused(c, s):
        reduced = all_reduce(c, s.shared)
        return (reduced, *plain(s, reduced))

    return {
        "plain": Variant(lambda c, s: plain(s, s.shared), ranks, partials),
        "all_reduce": Variant(lambda c, s: all_reduce(c, s.shared), ranks, partials),
        "unfused": Variant(unfused, ranks, partials),
        "fused": Variant(fused, ranks, partials),
    }


def _moe_calls(world: InProcessWorld, ranks: list[MoeSet]) -> dict[str, Variant]:
    # The CPU backend reduces gathered partials (each rank's local combine); CUDA ignores `gathered`.
    cpu = world.device.type == "cpu"
    gathered = [moe_finalize(s.rows, s.weights, s.index, eps=0.0, scale=MOE_SCALE) for s in ranks] if cpu else None

    def unfused(c, s):
        partial = moe_finalize(s.rows, s.weights, s.index, eps=0.0, scale=MOE_SCALE)
        reduced = all_reduce(c, partial)
        return reduced, moe_finalize(reduced, s.ones, s.arange, norm_weight=s.norm_weight, eps=EPS)

    # all_reduce alone needs a partial of the shape: the CPU partials, or (CUDA) the first T rows of the rows.
    ar_inputs = gathered if cpu else [s.rows[: s.index.shape[0]] for s in ranks]
    return {
        "plain": Variant(lambda c, s: moe_finalize(s.rows, s.weights, s.index, norm_weight=s.norm_weight, eps=EPS,
                                                   scale=MOE_SCALE), ranks, gathered),
        "all_reduce": Variant(lambda c, p: all_reduce(c, p), ar_inputs),
        "unfused": Variant(unfused, ranks, gathered),
        "fused": Variant(lambda c, s: moe_finalize_all_reduce(c, s.rows, s.weights, s.index, s.norm_weight, eps=EPS,
                                                              scale=MOE_SCALE), ranks, gathered),
    }


def capture_ranks(world: InProcessWorld, variants: list[Variant]) -> tuple[list[torch.cuda.CUDAGraph], list[list]]:
    """One CUDA graph per rank holding that rank's part of every call, in order, captured on world.streams[r];
    returns the graphs and, per rank, what each captured call returned (the tensors a replay overwrites).

    Not one graph with every rank's stream as a branch: CUDA does not promise that a graph's parallel branches
    run concurrently, and a rank spinning on its peers' partials needs its peers running. Nothing runs eagerly
    here: an eager call that makes the caching allocator grow (cudaMalloc) between one rank's launch and its
    peer's serializes the two (an implicit synchronization), so the first rank's exchange waits for a peer that
    cannot start — on the H200 eager warm-up calls stalled until the bounded wait expired (at the same
    generation with one graph for both ranks and with a graph per rank: before any replay). A replay allocates
    nothing."""
    torch.cuda.synchronize(world.device)
    graphs, outs = [], []
    for r, stream in enumerate(world.streams):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs.append([v.rank_call(world, r)() for v in variants])
        graphs.append(graph)
    torch.cuda.synchronize(world.device)
    return graphs, outs


def replay_ranks(world: InProcessWorld, graphs: list[torch.cuda.CUDAGraph]) -> None:
    """Every rank's graph on its own stream, forked from and joined back into the current stream."""
    current = torch.cuda.current_stream(world.device)
    for graph, stream in zip(graphs, world.streams):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            graph.replay()
    for stream in world.streams:
        current.wait_stream(stream)


def _bits(results) -> list[torch.Tensor]:
    out = []
    for r in results:
        for t in (r if isinstance(r, (tuple, list)) else (r,)):
            out.append(t.detach().cpu().contiguous().view(torch.int16))
    return out


def _same_bits(fused: list, unfused: list) -> bool:
    """The fused op's outputs equal the unfused path's bitwise on every rank (the fused returns (reduced,
    updated, output) per rank, as the unfused path here)."""
    a, b = _bits(fused), _bits(unfused)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _time_cpu(world: InProcessWorld, calls: dict[str, Variant], repeats: int) -> dict[str, Timing]:
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call.run_all(world)
            samples[name].append((time.perf_counter() - t0) * 1e6)
    out = {}
    for name, values in samples.items():
        v = sorted(values)
        out[name] = Timing(statistics.median(v), quantile(v, 0.1), quantile(v, 0.9), v[0], 1, repeats)
    return out


def _point(site: str, T: int, world: InProcessWorld, shape: dict, repeats: int, device: str) -> list[dict]:
    W = world.world_size
    if site == "moe_finalize":
        D, k = shape["D"], shape["k"]
        per_rank = (T * k + 8) * D * 2 + T * k * 8 + 2 * T * D * 2 + D * 2
        count = rotating_sets(W * per_rank) if device == "cuda" else 1
        flat = _moe_sets(T, k, D, count * W, seed=1000 + T, device=device)
        call_sets = [_moe_calls(world, flat[i * W:(i + 1) * W]) for i in range(count)]
        shape_keys = {"D": D, "k": k}
    else:
        H, N = shape["H"], shape["N"]
        count = rotating_sets(W * (step_bytes(T, N, H) + T * H * 2)) if device == "cuda" else 1
        flat = make_sets(T, N, H, count * W, seed=100 * T + (site == "add2"), device=device)
        call_sets = [_site_calls(site, flat[i * W:(i + 1) * W]) for i in range(count)]
        shape_keys = {"H": H, "N": N}
    names = [n for n in PROVIDERS if n in call_sets[0]]
    fused_names = ["fused"]
    if device == "cuda":
        replays, outs = {}, {}
        for name in names:
            graphs, outs[name] = capture_ranks(world, [calls[name] for calls in call_sets])
            replays[name] = (lambda g=graphs: replay_ranks(world, g), count)
        timings = time_interleaved(replays, repeats=repeats)
        world.check()  # a timed-out exchange would have produced no outputs: its times mean nothing
        # Every replay recomputes the same calls: the last one's outputs of every set, fused against unfused.
        equal = all(_same_bits([outs[f][r][i] for r in range(W)], [outs["unfused"][r][i] for r in range(W)])
                    for f in fused_names for i in range(count))
    else:
        unfused = call_sets[0]["unfused"].run_all(world)
        equal = all(_same_bits(call_sets[0][f].run_all(world), unfused) for f in fused_names)
        timings = _time_cpu(world, call_sets[0], repeats)
    records = []
    for name in names:
        records.append({"suite": "allreduce", "site": site, "provider": name, "T": T, "W": W, **shape_keys,
                        "world": "in_process_one_gpu" if device == "cuda" else "in_process_cpu",
                        "device": device, "graph": device == "cuda", "sets": count,
                        "timer": TIMER_GRAPH if device == "cuda" else TIMER_CPU, "lower_bound": device == "cuda",
                        "bitwise_equal": equal, **timings[name].as_dict()})
    return records


def run(tokens=TOKENS, device: str = "cuda", repeats: int = 25, progress=None, sites=SITES,
        moe_tokens=None) -> list[dict]:
    """Records of every site x T x provider (docstring of this module); the moe_finalize site at moe_tokens
    (default: tokens)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"allreduce: device must be 'cuda' or 'cpu', got {device!r}")
    if repeats < 1:
        raise ValueError(f"allreduce: repeats must be >= 1, got {repeats}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("allreduce: device 'cuda' needs a CUDA GPU")
    tokens = tuple(tokens)
    moe_tokens = tokens if moe_tokens is None else tuple(moe_tokens)
    for name, values in (("tokens", tokens), ("moe_tokens", moe_tokens)):
        if not values or min(values) < 1:
            raise ValueError(f"allreduce: {name} must be integers >= 1, got {values}")
    shape = {"H": SITE_H, "N": SITE_N, "D": MOE_D, "k": MOE_K} if device == "cuda" else CPU_SHAPE
    if device == "cuda" and max(tokens + moe_tokens) > MAX_TOKENS_ONE_GPU:
        raise ValueError(f"allreduce: T <= {MAX_TOKENS_ONE_GPU} on one GPU (every rank's blocks must be resident "
                         f"at once), got {max(tokens + moe_tokens)}")
    sizes = {"site": (max(tokens), shape["H"]), "moe": (max(moe_tokens), shape["D"])}
    worlds = {key: InProcessWorld(WORLD, cap, width, device=device) for key, (cap, width) in sizes.items()}
    records = []
    points = [(site, T) for site in sites for T in (moe_tokens if site == "moe_finalize" else tokens)]
    try:
        for i, (site, T) in enumerate(points):
            key = "moe" if site == "moe_finalize" else "site"
            try:
                records += _point(site, T, worlds[key], shape, repeats, device)
            except CommunicatorError as e:
                raise CommunicatorError(f"allreduce {site} T={T}: the one-GPU world's exchange stalled ({e})") from e
            if progress:
                progress(i + 1, len(points), f"allreduce {site} T={T}")
    finally:
        for w in worlds.values():
            w.close()
    return records


def summary(records: list[dict]) -> list[str]:
    """A short table: per site and T the medians (us), the
    epilogue's cost over the plain op (fused - plain) and the fusion's saving (unfused - fused)."""
    by_point: dict = {}
    for r in records:
        if r.get("suite") == "allreduce":
            by_point.setdefault((r["device"], r["site"], r["T"]), {})[r["provider"]] = r
    if not by_point:
        return []
    graph = any(r["graph"] for p in by_point.values() for r in p.values())
    lines = [f"allreduce ({LOWER_BOUND if graph else CPU_NOTE}); median us per site",
             f"{'site':<13}{'T':>3}{'plain':>9}{'all_red':>9}{'unfused':>9}{'fused':>9}"
             f"{'fused-plain':>13}{'unfused-fused':>15}  bitwise"]
    order = {s: i for i, s in enumerate(SITES)}
    for (device, site, T), p in sorted(by_point.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9), kv[0][2])):
        if any(name not in p for name in PROVIDERS[:4]):
            continue
        m = {name: p[name]["median_us"] for name in PROVIDERS if name in p}
        lines.append(f"{site:<13}{T:>3}{m['plain']:>9.2f}{m['all_reduce']:>9.2f}{m['unfused']:>9.2f}"
                     f"{m['fused']:>9.2f}{m['fused'] - m['plain']:>+13.2f}{m['unfused'] - m['fused']:>+15.2f}  "
                     f"{'equal' if p['fused']['bitwise_equal'] else 'DIFFERENT'}"
)
    return lines
