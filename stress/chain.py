"""The decode-chain campaign (python -m stress chain).

`chain` runs the decode chain (`attnres.models.kimi_k3`, stand-in sub-layers) twice, fold on and fold off,
for --steps dependent steps: step s + 1's input is bf16(step s's output + embedding[s mod 97]), so a
difference in any bit at any step changes everything after it. On CUDA each chain's step is one CUDA graph
(--eager: no graphs). Every step writes an order-weighted integer digest of its output, taps and bank into a
per-step table (inside the graph), so the two chains are compared at every step; every --check-every steps
and at the last step the whole state — every site's prefix, output and tap, the bank after every layer, the
model output and the next input — is compared bit for bit, and the first graph replay is compared with the
eager step it was captured from.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import Tensor

from .checks import bits, same_bits
from .progress import Progress

BF16 = torch.bfloat16


def _digest_weights(n: int, device) -> Tensor:
    g = torch.Generator().manual_seed(0xD16E57)
    return torch.randint(1, 1 << 20, (n,), generator=g, dtype=torch.int64).to(device)


class _ChainRun:
    """One chain (fold on or off): a shallow copy of the model with its settings, its bank, its input buffer,
    the step counter and the digest table, all on the device, so one step is capturable as a graph."""

    def __init__(self, model, fold: bool, x0: Tensor, embeddings: Tensor, steps: int, weights: Tensor):
        from attnres.models.kimi_k3 import ResidualSettings
        from attnres.models.kimi_k3.residual import PathRecord
        self.fold = fold
        self.model = copy.copy(model)
        self.model.settings = ResidualSettings(fold=fold)
        self.model.paths = PathRecord(keep=False)
        self.x = x0.clone()
        self.emb = embeddings
        self.bank = self.model.allocate_bank(x0.shape[0], fill=-3.0)
        self.step_index = torch.zeros((), dtype=torch.int64, device=x0.device)
        self.digests = torch.zeros(steps + 1, dtype=torch.int64, device=x0.device)
        self.w = weights
        self.last = None  # (KimiK3Output, ChainTrace) of the latest step (graph: the pool's tensors)

    def _digest(self, tensors: list[Tensor]) -> Tensor:
        total = torch.zeros((), dtype=torch.int64, device=self.x.device)
        for i, t in enumerate(tensors):
            b = bits(t).reshape(-1).to(torch.int64)
            total = total * 1000003 + (b * self.w[:b.numel()]).sum() + i
        return total

    def step(self) -> None:
        from attnres.models.kimi_k3 import ChainTrace
        trace = ChainTrace()
        out = self.model(self.x, bank=self.bank, trace=trace)
        self.last = (out, trace)
        state = [out.output, self.bank.storage] + [out.taps[k] for k in sorted(out.taps)]
        self.digests.index_copy_(0, self.step_index.reshape(1), self._digest(state).reshape(1))
        e = self.emb.index_select(0, self.step_index.remainder(self.emb.shape[0]).reshape(1))[0]
        self.x.copy_((out.output.float() + e.float()).to(BF16))
        self.step_index.add_(1)

    def reset(self, x0: Tensor) -> None:
        self.x.copy_(x0)
        self.step_index.zero_()
        self.digests.zero_()
        self.bank.storage.fill_(-3.0)


def _compare_state(a: _ChainRun, b: _ChainRun) -> list[str]:
    from attnres.models.kimi_k3 import compare_outputs, compare_traces
    (out_a, tr_a), (out_b, tr_b) = a.last, b.last
    diffs = compare_traces(tr_a, tr_b) + compare_outputs(out_a, out_b)
    if not same_bits(a.x, b.x):
        diffs.append("next input differs")
    return diffs


def _snapshot_state(run: _ChainRun):
    """Clones of everything a later comparison reads (graph tensors are rewritten by the next replay)."""
    from attnres.models.kimi_k3 import ChainTrace, KimiK3Output, SnapshotBank
    out, trace = run.last
    tr = ChainTrace(sites=[type(s)(s.site, s.prefix.clone(), s.output.clone(), None if s.tap is None else s.tap.clone())
                           for s in trace.sites], banks=[(layer, b.clone()) for layer, b in trace.banks])
    o = KimiK3Output(out.output.clone(), {k: v.clone() for k, v in out.taps.items()},
                     SnapshotBank(out.bank.storage.clone(), out.bank.layout), out.num_snapshots)
    return o, tr


def chain_config(device: str, layers: int | None, hidden: int | None, block: int | None):
    from attnres.models.kimi_k3 import KimiK3Config, kimi_k3_full_attention_layers
    if device == "cuda" or hidden == 7168:
        cfg = KimiK3Config.real()
        if layers is not None and layers != cfg.num_layers:
            caps = tuple(c for c in cfg.capture_layers if c < layers)
            cfg = cfg.with_(num_layers=layers, full_attention_layers=kimi_k3_full_attention_layers(layers),
                            capture_layers=caps)
        if block is not None:
            cfg = cfg.with_(snapshot_block=block)
        if hidden is not None and hidden != cfg.hidden_size:
            cfg = cfg.with_(hidden_size=hidden)
        return cfg
    base = KimiK3Config.cpu()
    return KimiK3Config.small(hidden_size=hidden or base.hidden_size, num_layers=layers or base.num_layers,
                              snapshot_block=block or base.snapshot_block)


def run_chain(steps: int, *, device: str = "cuda", tokens: int = 1, layers: int | None = None,
              hidden: int | None = None, block: int | None = None, check_every: int = 100, eager: bool = False,
              seed: int = 0, max_seconds: float | None = None, quiet: bool = False) -> dict:
    """`steps` dependent steps of both chains (fewer when max_seconds runs out first: "stopped_early")."""
    from attnres.models.kimi_k3 import KimiK3Model, ResidualSettings
    from attnres.models.kimi_k3.residual import FUSED_ADD2, PathRecord
    if device not in ("cpu", "cuda"):
        raise ValueError(f"chain: device must be cpu or cuda, got {device!r}")
    if steps < 1 or check_every < 1 or tokens < 1:
        raise ValueError("chain: steps, check_every and tokens must be >= 1")
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("chain: --device cuda needs a CUDA GPU")
    graphs = cuda and not eager
    cfg = chain_config(device, layers, hidden, block).with_(seed=seed)
    torch_threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = KimiK3Model(cfg, settings=ResidualSettings(fold=False), device=device, keep_paths=False)
    g = torch.Generator().manual_seed(seed * 7919 + 13)
    embeddings = torch.randn(97, tokens, cfg.hidden_size, generator=g).to(BF16).to(device)
    x0 = model.embed(tokens, step=seed)
    state_numel = max(x0.numel() * (2 + len(cfg.capture_layers)), cfg.num_snapshots * x0.numel())
    weights = _digest_weights(state_numel, device)
    runs = {fold: _ChainRun(model, fold, x0, embeddings, steps, weights) for fold in (True, False)}

    # How many sites take the fold per step (the path record of one eager step).
    probe = copy.copy(model)
    probe.settings, probe.paths = ResidualSettings(fold=True), PathRecord()
    probe(x0, bank=probe.allocate_bank(tokens, fill=-3.0))
    folded = len(probe.paths.select(path=FUSED_ADD2))

    diffs_total: list[str] = []
    checked_steps: list[int] = []
    first_bad: int | None = None

    def check(step: int, extra: list[str] | None = None) -> None:
        nonlocal first_bad
        diffs = _compare_state(runs[True], runs[False]) + (extra or [])
        checked_steps.append(step)
        if diffs and first_bad is None:
            first_bad = step
        diffs_total.extend(f"step {step}: {d}" for d in diffs[:10])

    graph_vs_eager: list[str] = []
    if graphs:
        # The eager step the graph must reproduce, run on a side stream: it is also the capture's warm-up
        # (plan cache, cuBLAS workspaces and lazy initialisation stay out of the graph).
        eager_state = {}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fold, r in runs.items():
                r.step()
                eager_state[fold] = _snapshot_state(r)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        compiled = {}
        for fold, r in runs.items():
            r.reset(x0)
            r.last = None
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                r.step()
            compiled[fold] = graph
        torch.cuda.synchronize()
        for r in runs.values():
            r.reset(x0)  # the capture did not run the step, but reset anyway: replays start from step 0
        torch.cuda.synchronize()
    progress = Progress(steps, "chain", quiet)
    t_steps = time.perf_counter()
    stopped_early = False
    last_step = 0
    try:
        for step in range(1, steps + 1):
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                stopped_early = True
                break
            last_step = step
            for fold, r in runs.items():
                if graphs:
                    compiled[fold].replay()
                else:
                    r.step()
            if graphs and step == 1:
                torch.cuda.synchronize()
                from attnres.models.kimi_k3 import compare_outputs, compare_traces
                for fold, r in runs.items():
                    o, tr = eager_state[fold]
                    d = compare_traces(r.last[1], tr) + compare_outputs(r.last[0], o)
                    graph_vs_eager += [f"fold={fold}: {x}" for x in d[:10]]
            if step % check_every == 0 or step == steps:
                if cuda:
                    torch.cuda.synchronize()
                check(step)
            progress.update(1, f"diffs {len(diffs_total)}")
        if cuda:
            torch.cuda.synchronize()
        if stopped_early and last_step and last_step not in checked_steps:
            check(last_step)
    finally:
        progress.close()
        torch.set_num_threads(torch_threads)
    step_wall = time.perf_counter() - t_steps
    d_on, d_off = runs[True].digests[:last_step].cpu(), runs[False].digests[:last_step].cpu()
    digest_diff = (d_on != d_off).nonzero().flatten().tolist()
    first_digest = digest_diff[0] + 1 if digest_diff else None
    steps_done = int(runs[True].step_index.item())
    ok = not diffs_total and not digest_diff and not graph_vs_eager and steps_done == last_step
    return {
        "mode": "chain", "device": device, "graph": graphs, "seed": seed, "tokens": tokens,
        "layers": cfg.num_layers, "hidden": cfg.hidden_size, "snapshot_block": cfg.snapshot_block,
        "sites_per_step": 2 * cfg.num_layers + 1, "folded_sites_per_step": folded, "steps": steps_done,
        "checked_steps": len(checked_steps), "check_every": check_every,
        "mismatched_checks": len({d.split(":")[0] for d in diffs_total}), "first_mismatch_step": first_bad,
        "digest_mismatch_steps": len(digest_diff), "first_digest_mismatch_step": first_digest,
        "graph_vs_eager_diffs": graph_vs_eager[:10], "diffs": diffs_total[:20],
        "mismatches": len({d.split(":")[0] for d in diffs_total}) + len(digest_diff) + (1 if graph_vs_eager else 0),
        "wall_s": round(time.perf_counter() - t0, 2), "stopped_early": stopped_early,
        "steps_per_s": round(2 * last_step / max(step_wall, 1e-9), 1),  # both chains' steps
        "ok": ok,
    }
