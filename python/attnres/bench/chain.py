"""The Kimi K3 decode-chain benchmark: one decode step of the 93-layer, H = 7168 schedule with the
MoE-tail fold on and off, each step captured as one CUDA graph and the two graphs replayed interleaved.

What the graph holds: the residual stream only — the 187 attention-residual sites, the snapshot writes, the
dense layer's residual add and the MoE tails (two eager bf16 adds per MoE layer with the fold off, none with
it on). The attention and MoE sub-layers are stand-ins and stay out of the timed region: one eager fold-off
step of the real model (`KimiK3Model`, its stand-ins included) records every sub-layer's output, and the timed
chains are copies of that model whose sub-layers hand back the recorded tensors. Because the sites are
deterministic, the recorded outputs are exactly what the stand-ins would return inside the timed step, so the
timed chain computes the same bits as the model it was recorded from — checked in the same run
(`equals_model`).

In the same run the two chains are compared bit for bit: every site's prefix, normed output and tap, the
snapshot bank and the model output (`bitwise_equal`, `diffs`). The saving per MoE layer is the difference of
the two medians over the number of MoE layers (92 for Kimi K3).

`device="cpu"` runs the same code on the CPU backend with a small config, timed eagerly with
time.perf_counter (no graphs): it exercises the code path (CI), it is not a measurement of the fold.

L2: the chain is not rotated over input sets (a step is one graph). At T = 1 its working set (site weights,
sub-layer outputs, bank, what the sites write) is ~17 MB and stays in the 60 MB L2 across replays, so the
sites and adds run warmer than in production, where gigabytes of weights stream between two sites;
`working_set_bytes` says how much.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter
from typing import Callable

import torch
from torch import Tensor

import attnres
from attnres.models.kimi_k3 import (ChainTrace, KimiK3Config, KimiK3Model, KimiK3Output, ResidualSettings,
                                    compare_outputs, compare_traces)
from attnres.models.kimi_k3.residual import FUSED_ADD2, PathRecord

from .timing import Timing, quantile, time_interleaved

TOKENS = (1, 4, 8, 32)
QUICK_TOKENS = (1, 32)
PROVIDERS = {True: "chain/fold_on", False: "chain/fold_off"}
TIMER_GRAPH = "cuda_graph_events"
TIMER_CPU = "cpu_eager_perf_counter"
BANK_FILL = -3.0  # bank rows before the step writes them: bf16-exact and finite, so whole banks compare bitwise
POISON = {True: float("nan"), False: float("inf")}  # different per chain: an output no replay wrote differs


def cpu_config() -> KimiK3Config:
    """The CPU stand-in for the real schedule: the tools' shared small config (KimiK3Config.cpu())."""
    return KimiK3Config.cpu()


class SiteTrace(ChainTrace):
    """A ChainTrace of the sites only. The bank after every layer would need a clone per layer inside the timed
    graph; the final bank is compared instead (compare_outputs)."""

    def layer_end(self, layer: int, bank_storage: Tensor) -> None:
        pass


# ------------------------------------------------------------------------------------------ sub-layer feeds
class _Recorder:
    """Wraps a stand-in during the recording step: returns what the stand-in returns, keeps the tensors."""

    def __init__(self, inner, moe: bool):
        self.inner, self.moe = inner, moe
        self.out: Tensor | None = None
        self.parts: tuple[Tensor, Tensor] | None = None

    def __call__(self, x: Tensor, *, return_parts: bool = False):
        if not self.moe:
            self.out = self.inner(x)
            return self.out
        # The stand-in's own routed + shared is the same bf16 add of the same two tensors.
        self.parts = self.inner(x, return_parts=True)
        return self.parts if return_parts else self.parts[0] + self.parts[1]


class _Fed:
    """A sub-layer replaced by its recorded output (attention, the dense MLP)."""

    def __init__(self, out: Tensor):
        self.out = out

    def __call__(self, x: Tensor) -> Tensor:
        return self.out


class _FedMoE:
    """The MoE runtime replaced by its recorded parts. Unsummed parts go to the fold; the summed form is the
    first of the eager chain's two tail adds, and stays in the timed graph."""

    def __init__(self, routed: Tensor, shared: Tensor):
        self.routed, self.shared = routed, shared

    def __call__(self, y: Tensor, *, return_parts: bool = False):
        if return_parts:
            return self.routed, self.shared
        return self.routed + self.shared


def with_sublayers(model: KimiK3Model, make: Callable, settings: ResidualSettings) -> KimiK3Model:
    """A shallow copy of the model (same weights) whose layers' attention and MLP are make(layer) -> (attn, mlp),
    with its own settings and path record."""
    clone = copy.copy(model)
    clone.settings = settings
    clone.paths = PathRecord()
    clone.layers = []
    for layer in model.layers:
        c = copy.copy(layer)
        c.attention, c.mlp = make(layer)
        clone.layers.append(c)
    return clone


def _record(model: KimiK3Model, x0: Tensor, pdl: bool):
    """One eager fold-off step of the real model (stand-ins included); returns the fed models' sub-layers, the
    step's output and trace (the reference the timed chain must reproduce)."""
    recorders = {}

    def make(layer):
        recorders[layer.layer] = (_Recorder(layer.attention, False), _Recorder(layer.mlp, layer.is_moe))
        return recorders[layer.layer]

    recording = with_sublayers(model, make, ResidualSettings(fold=False, pdl=pdl))
    trace = SiteTrace()
    out = recording(x0, bank=recording.allocate_bank(x0.shape[0], fill=BANK_FILL), trace=trace)
    feeds = {}
    for index, (attn, mlp) in recorders.items():
        feeds[index] = (_Fed(attn.out), _FedMoE(*mlp.parts) if mlp.moe else _Fed(mlp.out))
    return feeds, out, trace


# ------------------------------------------------------------------------------------------ one chain
class Chain:
    """One variant: the fed model with its settings and its own bank; `last` holds the last step's output and
    trace (inside a graph: tensors of the graph's pool, rewritten by every replay)."""

    def __init__(self, model: KimiK3Model, feeds: dict, x0: Tensor, fold: bool, pdl: bool):
        self.fold = fold
        self.model = with_sublayers(model, lambda layer: feeds[layer.layer], ResidualSettings(fold=fold, pdl=pdl))
        self.x0 = x0
        self.bank = self.model.allocate_bank(x0.shape[0], fill=BANK_FILL)
        self.last: tuple[KimiK3Output, SiteTrace] | None = None

    def step(self) -> None:
        self.model.paths.clear()  # Python only: the record holds exactly the last step's decisions
        trace = SiteTrace()
        self.last = (self.model(self.x0, bank=self.bank, trace=trace), trace)

    def poison_outputs(self) -> None:
        """Overwrites every site output. Nothing in the chain reads them (the sub-layers are fed), so the next
        replay must write each of them back."""
        out, trace = self.last
        for s in trace.sites:
            s.output.fill_(POISON[self.fold])

    def paths(self) -> list[list]:
        counts = Counter((e.kind, e.path, e.kernel, e.reason) for e in self.model.paths.entries)
        return [[*key, n] for key, n in sorted(counts.items())]

    def folded_sites(self) -> int:
        return len(self.model.paths.select(path=FUSED_ADD2))


def trace_diffs(a: Chain | tuple, b: Chain | tuple) -> list[str]:
    (out_a, tr_a), (out_b, tr_b) = (x.last if isinstance(x, Chain) else x for x in (a, b))
    return compare_traces(tr_a, tr_b) + compare_outputs(out_a, out_b)


# ------------------------------------------------------------------------------------------ timing
def _capture_step(chain: Chain) -> torch.cuda.CUDAGraph:
    """As timing.capture: one eager step on a side stream first (plan cache, lazy initialisation, allocator
    growth stay out of the graph), then the step captured. The warm-up's tensors are dropped before the
    capture so that nothing allocated outside the graph is freed while it is being captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain.step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    chain.last = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.step()
    torch.cuda.synchronize()
    return graph


def _time_graphs(chains: dict[bool, Chain], repeats: int, warmup: int):
    """CUDA: each chain's step captured as one graph, replayed interleaved. Returns the timings and the graphs
    (the chains' last outputs live in the graphs' pools: keep the graphs until they are compared)."""
    graphs = {fold: _capture_step(c) for fold, c in chains.items()}
    timings = time_interleaved({fold: (g, 1) for fold, g in graphs.items()}, repeats=repeats, warmup=warmup)
    # The bitwise check reads what one more replay of each wrote over poisoned outputs.
    for c in chains.values():
        c.poison_outputs()
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    return timings, graphs


def _time_eager(chains: dict[bool, Chain], repeats: int, warmup: int) -> dict[bool, Timing]:
    """CPU: the eager step, interleaved, wall clock (no graphs on the CPU)."""
    for _ in range(warmup):
        for c in chains.values():
            c.step()
    samples = {fold: [] for fold in chains}
    for _ in range(repeats):
        for fold, c in chains.items():
            t0 = time.perf_counter()
            c.step()
            samples[fold].append((time.perf_counter() - t0) * 1e6)
    out = {}
    for fold, values in samples.items():
        v = sorted(values)
        out[fold] = Timing(statistics.median(v), quantile(v, 0.1), quantile(v, 0.9), v[0], 1, repeats)
    return out


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _working_set(model: KimiK3Model, feeds: dict, chain: Chain) -> int:
    """Bytes one step touches: site weights, sub-layer outputs, bank, input, and what the sites write."""
    weights = [t for layer in model.layers for w in (layer.attn_site, layer.mlp_site)
               for t in (w.res_weight, w.rms_weight, w.norm_weight)]
    weights += [model.output_site.res_weight, model.output_site.rms_weight, model.output_site.norm_weight]
    fed = [t for attn, mlp in feeds.values() for t in
           ((attn.out, mlp.routed, mlp.shared) if isinstance(mlp, _FedMoE) else (attn.out, mlp.out))]
    written = [t for s in chain.last[1].sites for t in (s.prefix, s.output, s.tap)]
    return _nbytes(weights + fed + written + [chain.bank.storage, chain.x0])


def _plan_info(T: int, N: int, H: int, device: str, pdl: bool) -> dict:
    p = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=N, hidden=H, device=device, add=True, add2=True,
                     options=ResidualSettings(pdl=pdl).options)
    return {"N": N, "kernel": p.kernel, "cluster": p.cluster, "threads": p.threads, "pdl": p.pdl,
            "decline": p.decline}


# ------------------------------------------------------------------------------------------ the suite
def run_point(model: KimiK3Model, T: int, *, device: str, pdl: bool = True, repeats: int = 25, warmup: int = 3,
              seed: int = 0) -> list[dict]:
    """Both chains at T tokens: two records (fold on, fold off) with the timing, the paths and the checks."""
    cfg = model.config
    x0 = model.embed(T, step=seed)
    feeds, model_out, model_trace = _record(model, x0, pdl)
    chains = {fold: Chain(model, feeds, x0, fold, pdl) for fold in (True, False)}  # dict order: on, off, on, ...
    graphs = None
    if device == "cuda":
        timings, graphs = _time_graphs(chains, repeats, warmup)
        timer = TIMER_GRAPH
    else:
        timings = _time_eager(chains, repeats, warmup)
        timer = TIMER_CPU
    diffs = trace_diffs(chains[True], chains[False])
    model_diffs = trace_diffs(chains[False], (model_out, model_trace))
    moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))
    on, off = timings[True], timings[False]
    saving = off.median_us - on.median_us
    common = {
        "suite": "chain", "T": T, "H": cfg.hidden_size, "layers": cfg.num_layers, "snapshot_block": cfg.snapshot_block,
        "moe_layers": moe_layers, "sites": len(chains[False].last[1].sites), "device": device, "timer": timer,
        "graph": device == "cuda", "pdl": pdl, "seed": seed,
        "working_set_bytes": _working_set(model, feeds, chains[False]),
        "step_saving_us": saving, "saving_per_moe_layer_us": saving / max(moe_layers, 1),
        # Noise of the difference: the two spreads (p10-p90) combined.
        "saving_noise_us": ((on.p90_us - on.p10_us) ** 2 + (off.p90_us - off.p10_us) ** 2) ** 0.5,
        "bitwise_equal": not diffs, "diffs": diffs[:10], "equals_model": not model_diffs,
        "model_diffs": model_diffs[:10],
        # The geometry behind the paths' kernel names, at the output site's N (the largest).
        "plan_add2": _plan_info(T, cfg.output_candidates, cfg.hidden_size, device, pdl),
    }
    records = []
    for fold in (True, False):
        c = chains[fold]
        records.append({**common, "provider": PROVIDERS[fold], "fold": fold, "folded_sites": c.folded_sites(),
                        "paths": c.paths(), **timings[fold].as_dict()})
    del graphs  # releases the graphs' pools after the comparison
    return records


def run(*, tokens=TOKENS, device: str = "cuda", config: KimiK3Config | None = None, pdl: bool = True,
        repeats: int = 25, warmup: int = 3, seed: int = 0, progress=None) -> list[dict]:
    """The chain suite: for each T, the fold-on and fold-off records. config: Kimi K3's real one on CUDA,
    cpu_config() on the CPU."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"chain: device must be 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("chain: device 'cuda' needs a CUDA GPU (use device='cpu' for the CPU code path)")
    if repeats < 1 or warmup < 0:
        raise ValueError("chain: repeats must be >= 1 and warmup >= 0")
    config = config or (KimiK3Config.real() if device == "cuda" else cpu_config())
    model = KimiK3Model(config.with_(seed=seed), settings=ResidualSettings(fold=False, pdl=pdl), device=device,
                        keep_paths=False)
    records = []
    for i, T in enumerate(tokens):
        records += run_point(model, T, device=device, pdl=pdl, repeats=repeats, warmup=warmup, seed=seed)
        if progress:
            progress(i + 1, len(tokens), f"chain T={T}")
    return records


def summary(records: list[dict]) -> list[str]:
    """One line per T: the two step times, the saving and the checks."""
    lines = []
    by_t = {}
    for r in records:
        if r.get("suite") == "chain":
            by_t.setdefault((r["device"], r["T"]), {})[r["provider"]] = r
    for (device, T), pair in sorted(by_t.items()):
        on, off = pair.get(PROVIDERS[True]), pair.get(PROVIDERS[False])
        if not (on and off):
            continue
        label = "graph replay" if on["graph"] else "CPU eager, wall clock: exercises the code, not a measurement"
        lines.append(
            f"chain T={T} ({label}): fold off {off['median_us'] / 1e3:.3f} ms ({off['p10_us'] / 1e3:.3f}-"
            f"{off['p90_us'] / 1e3:.3f}), on {on['median_us'] / 1e3:.3f} ms ({on['p10_us'] / 1e3:.3f}-"
            f"{on['p90_us'] / 1e3:.3f}); saves {on['step_saving_us']:.1f} us/step = "
            f"{on['saving_per_moe_layer_us']:.2f} us per MoE layer (noise {on['saving_noise_us']:.1f} us); "
            f"{on['folded_sites']} folded sites; bitwise {'equal' if on['bitwise_equal'] else 'DIFFERENT'}; "
            f"{'equals' if on['equals_model'] else 'DIFFERS FROM'} the model's eager step")
    return lines
