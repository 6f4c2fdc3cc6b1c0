"""The random-call campaign (python -m stress calls).

`calls` draws each call from a generator seeded by (seed, call index): an op (attn_res, attn_res_rmsnorm with
or without the tap, attn_res_add_rmsnorm with one or two addends, tap and snapshot write, the persistent op
where the plan takes it, moe_finalize), T (1..64 mostly, sometimes up to --max-tokens), N 1..16, H from the fast
paths {7168, 2304, 4096, 8192} or a random multiple of 8, a bank layout (contiguous, snapshot-major, token-major,
row-padded), padded prefix rows, eps, and on CUDA a forced kernel and PDL on or off. Storage the call must not
read (spare bank rows, padding, moe rows no route names) holds NaN. The calls are issued round-robin on
--streams CUDA streams; every --graph-every calls one call is also captured in a CUDA graph and replayed twice
(once over poisoned outputs, once after fresh values were copied into its input buffers), and each replay must
equal the eager call bit for bit. Every result is compared with the same call on the CPU backend (dense CPU
copies of the inputs): `updated`, the snapshot row and moe_finalize without its norm bit for bit (the
contract's exact outputs, docs/ops/*.md "Determinism"), every other output within the contract's tolerance
(attnres.reference.check_close) or within 2 bf16 ulps of it elementwise; fp32 logits within the rule or within
the worst-case fp32 error bound of their dot product. Every input buffer must keep its bits (the requested
snapshot row must hold `updated`). With --device cpu the "device" call is the CPU backend on the random
layout and, every --oracle-every calls, the float64 oracle checks it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

import attnres
from attnres.graphs import capture
from attnres.moe import moe_finalize

from .checks import compare, inputs_unchanged, oracle_check, same_bits
from .draw import Spec, draw_spec
from .inputs import NAN, Call
from .progress import Progress

MAX_FAILURES_LISTED = 20


def _options(s: Spec) -> attnres.Options:
    if s.op == "attn_res_add_rmsnorm_persistent":
        return attnres.Options(topology="persistent", pdl=s.pdl)
    return attnres.Options(kernel=s.kernel, pdl=s.pdl)


def run_op(s: Spec, v: dict, options: attnres.Options | None) -> dict[str, Tensor]:
    """The op of the call spec on the views v (any device). options None: the library's defaults (the reference)."""
    if s.op == "moe_finalize":
        out = moe_finalize(v["rows"], v["weights"], v["index"], shared=v["shared"], norm_weight=v["norm_weight"],
                           eps=s.norm_eps, scale=s.scale, pdl=s.pdl if options is not None else True)
        return {"output": out}
    w = (v["res_weight"], v["rms_weight"])
    if s.op == "attn_res":
        m, rsigma, probs, logits = attnres.attn_res(v["prefix"], v["block"], *w, s.rms_eps, options=options)
        return {"mixture": m, "rsigma": rsigma, "probs": probs, "logits": logits}
    if s.op == "attn_res_rmsnorm":
        r = attnres.attn_res_rmsnorm(v["prefix"], v["block"], *w, v["norm_weight"], s.rms_eps, s.norm_eps,
                                     return_mixture=s.tap, options=options)
        return {"output": r[0], "mixture": r[1]} if s.tap else {"output": r}
    if s.op == "attn_res_add_rmsnorm":
        r = attnres.attn_res_add_rmsnorm(v["prefix"], v["add"], v["block"], *w, v["norm_weight"], s.rms_eps,
                                         s.norm_eps, layer_residual_add2=v["add2"], return_mixture=s.tap,
                                         snapshot_slot=s.snapshot if (s.snapshot >= 0 and options is not None)
                                         else None, options=options)
        out = {"updated": r[0], "output": r[1]}
        if s.tap:
            out["mixture"] = r[2]
        return out
    updated, output = attnres.attn_res_add_rmsnorm_persistent(
        v["prefix"], v["block"], *w, v["norm_weight"], s.rms_eps, s.norm_eps, layer_residual_add=v["add"],
        options=options if options is not None else attnres.Options(topology="persistent"))
    return {"output": output} if updated is None else {"updated": updated, "output": output}


# The device-side call. A hook of its own (stress.calls.device_call, looked up here at every call) so that
# tests can corrupt it and prove the checker catches it.
def device_call(s: Spec, call: Call) -> dict[str, Tensor]:
    return run_op(s, call.views, _options(s))


def reference_call(s: Spec, cpu_views: dict) -> dict[str, Tensor]:
    return run_op(s, cpu_views, None)


def _check_job(s: Spec, cpu_views: dict, got: dict[str, Tensor], oracle: bool) -> tuple[list[str], list[str]]:
    """Runs in a worker thread (the library releases the GIL): the CPU reference call and the comparisons."""
    dense = {k: (None if t is None else t.contiguous()) for k, t in cpu_views.items()}
    try:
        ref = reference_call(s, dense)
    except Exception as err:  # noqa: BLE001  (any refusal of a valid call is a finding)
        return [f"the CPU backend raised {type(err).__name__}: {err}"], []
    problems = compare(s, got, ref, dense)
    oracle_problems = oracle_check(s, got, dense) if oracle else []
    return problems, oracle_problems


# ------------------------------------------------------------------------------------------ the runner
@dataclass
class CallStats:
    calls: int = 0
    checked: int = 0
    mismatches: int = 0
    input_mutations: int = 0
    graph_captures: int = 0
    graph_replays: int = 0
    graph_mismatches: int = 0
    oracle_checks: int = 0
    oracle_mismatches: int = 0
    errors: int = 0
    shapes: set = field(default_factory=set)
    ops: dict = field(default_factory=dict)
    variants: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)

    def fail(self, kind: str, s: Spec, detail: str) -> None:
        if len(self.failures) < MAX_FAILURES_LISTED:
            self.failures.append({"kind": kind, "call": s.index, "detail": detail[:500], "spec": json.loads(s.describe())})

    def count(self, s: Spec) -> None:
        self.calls += 1
        self.shapes.add(s.shape_key())
        self.ops[s.op] = self.ops.get(s.op, 0) + 1
        tags = [f"layout={s.layout}"] if s.op != "moe_finalize" else [f"weights={s.weights_dtype}"]
        tags += [f"kernel={s.kernel}", f"pdl={s.pdl}"]
        for flag, on in (("add2", s.addends == 2), ("add", s.addends == 1), ("tap", s.tap),
                         ("snapshot", s.snapshot >= 0), ("row_pad", s.row_pad > 0), ("shared", s.shared),
                         ("norm", s.norm), ("remote", s.remote > 0), ("T>64", s.T > 64)):
            if on:
                tags.append(flag)
        for t in tags:
            self.variants[t] = self.variants.get(t, 0) + 1


def _graph_round(call: Call, stats: CallStats) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Captures the call, replays it over poisoned outputs (and a poisoned snapshot row) on the captured
    inputs, then again after fresh values were copied into its buffers; each replay must equal the eager
    call that follows it bit for bit. Returns the last eager outputs and the clones of the buffers taken
    right after the refill (what the caller's input check compares with)."""
    s = call.spec
    graph, captured = capture(lambda: device_call(s, call))
    stats.graph_captures += 1
    eager, before = {}, {}
    for round_ in range(2):
        if round_ == 1:
            call.refill(s.seed ^ 0x5EED)  # spare bank rows NaN again, like every fresh buffer
            before = {k: b.clone() for k, b in call.buffers.items()}
        for t in captured.values():
            t.fill_(NAN)
        if s.snapshot >= 0:
            call.bank_row(call.buffers["bank"], s.snapshot).fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: t.clone() for k, t in captured.items()}
        row = call.bank_row(call.buffers["bank"], s.snapshot).clone() if s.snapshot >= 0 else None
        eager = device_call(s, call)
        torch.cuda.synchronize()
        stats.graph_replays += 1
        bad = [k for k in eager if not same_bits(replayed[k], eager[k])]
        if row is not None and not same_bits(row, eager["updated"]):
            bad.append("snapshot row")
        if bad:
            stats.graph_mismatches += 1
            stats.fail("graph", s, f"replay {round_} differs from the eager call in {bad}")
    del graph
    return eager, before


def run_calls(count: int, *, device: str = "cuda", streams: int = 4, seed: int = 0, start: int = 0,
              graph_every: int = 100, batch: int = 64, workers: int | None = None, max_tokens: int = 256,
              oracle_every: int | None = None, max_seconds: float | None = None, quiet: bool = False) -> dict:
    """`count` calls from index `start` (fewer when max_seconds runs out first: "stopped_early")."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"calls: device must be cpu or cuda, got {device!r}")
    cuda = device == "cuda"
    if cuda and not (torch.cuda.is_available() and attnres.backend_info()["cuda_devices"]):
        raise RuntimeError("calls: --device cuda needs the CUDA backend and a visible Hopper GPU")
    if oracle_every is None:
        oracle_every = 0 if cuda else 1
    dev = torch.device(device)
    workers = workers or max(1, (os.cpu_count() or 2) - (1 if cuda else 0))
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: intra-op threads only spin; the pool runs the checks in parallel
    cuda_streams = [torch.cuda.Stream() for _ in range(max(1, streams))] if cuda else []
    stats = CallStats()
    progress = Progress(count, "calls", quiet)
    pool = ThreadPoolExecutor(max_workers=workers)
    futures: list[tuple[Spec, Future]] = []
    pending: list[tuple[Call, dict, dict]] = []
    t0 = time.perf_counter()
    stopped_early = False

    def collect(block: bool) -> None:
        keep = []
        for s, fut in futures:
            if not block and not fut.done():
                keep.append((s, fut))
                continue
            try:
                problems, oracle_problems = fut.result()
            except Exception as err:  # noqa: BLE001
                stats.errors += 1
                stats.fail("error", s, f"check raised {type(err).__name__}: {err}")
                continue
            stats.checked += 1
            if problems:
                stats.mismatches += 1
                stats.fail("mismatch", s, "; ".join(problems))
            if oracle_problems:
                stats.oracle_mismatches += 1
                stats.fail("oracle", s, "; ".join(oracle_problems))
        futures[:] = keep

    def flush() -> None:
        if cuda:
            torch.cuda.synchronize()
        for call, before, outputs in pending:
            s = call.spec
            why = inputs_unchanged(call, before, outputs)
            if why:
                stats.input_mutations += 1
                stats.fail("input_mutation", s, why)
            cpu_views = {k: (None if t is None else t.cpu()) for k, t in call.views.items()}
            got = {k: t.cpu() for k, t in outputs.items()}
            oracle = oracle_every > 0 and s.index % oracle_every == 0
            stats.oracle_checks += oracle
            futures.append((s, pool.submit(_check_job, s, cpu_views, got, oracle)))
        pending.clear()
        collect(block=len(futures) > 8 * workers)

    try:
        for i in range(start, start + count):
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                stopped_early = True
                break
            s = draw_spec(seed, i, device, max_tokens)
            stats.count(s)
            graph = cuda and graph_every > 0 and (i - start) % graph_every == graph_every - 1
            try:
                if graph:
                    if pending:
                        flush()
                    call = Call(s, dev)
                    outputs, before = _graph_round(call, stats)
                else:
                    stream = cuda_streams[i % len(cuda_streams)] if cuda else None
                    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                        call = Call(s, dev)
                        before = {k: b.clone() for k, b in call.buffers.items()}
                        outputs = device_call(s, call)
            except Exception as err:  # noqa: BLE001  (a valid call that raises is a finding)
                stats.errors += 1
                stats.fail("error", s, f"{type(err).__name__}: {err}")
                progress.update(1)
                continue
            pending.append((call, before, outputs))
            if len(pending) >= batch:
                flush()
            progress.update(1, f"mismatches {stats.mismatches + stats.input_mutations + stats.graph_mismatches}")
        flush()
        collect(block=True)
    finally:
        pool.shutdown(wait=True)
        progress.close()
        torch.set_num_threads(torch_threads)
    wall = time.perf_counter() - t0
    return {
        "mode": "calls", "device": device, "seed": seed, "start": start, "calls": stats.calls,
        "checked": stats.checked, "distinct_shapes": len(stats.shapes), "ops": dict(sorted(stats.ops.items())),
        "variants": dict(sorted(stats.variants.items())), "streams": len(cuda_streams) if cuda else 0,
        "graph_captures": stats.graph_captures, "graph_replays": stats.graph_replays,
        "graph_mismatches": stats.graph_mismatches, "mismatches": stats.mismatches,
        "input_mutation_failures": stats.input_mutations, "errors": stats.errors,
        "oracle_checks": stats.oracle_checks, "oracle_mismatches": stats.oracle_mismatches,
        "wall_s": round(wall, 2), "calls_per_s": round(stats.calls / max(wall, 1e-9), 1), "workers": workers,
        "stopped_early": stopped_early,
        "failures": stats.failures,
        "ok": stats.mismatches + stats.input_mutations + stats.graph_mismatches + stats.errors
        + stats.oracle_mismatches == 0 and stats.checked == stats.calls - stats.errors,
    }
