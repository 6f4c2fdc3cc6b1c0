"""One random call of the `calls` campaign, drawn from a generator seeded by (seed, call index): an op
(attn_res, attn_res_rmsnorm with or without the tap, attn_res_add_rmsnorm with one or two addends, tap and
snapshot write, the persistent op where the plan takes it, moe_finalize), T (1..64 mostly, sometimes up to
max_tokens), N 1..16, H from the fast paths {7168, 2304, 4096, 8192} or a random multiple of 8, a bank layout
(contiguous, snapshot-major, token-major, row-padded), padded prefix rows, eps, and on CUDA a forced kernel and
PDL on or off. The same seed and index always give the same Spec."""

from __future__ import annotations

import functools
import json
import math
import random
import zlib
from dataclasses import asdict, dataclass

import attnres

FAST_H = (7168, 2304, 4096, 8192)
MOE_FAST_D = (3584, 7168, 4096)
LAYOUTS = ("contiguous", "snapshot_major", "token_major", "strided")


@dataclass
class Spec:
    """One call, drawn from its seed; everything needed to rebuild it."""

    index: int
    seed: int
    op: str
    T: int
    N: int = 0  # attention ops: candidates (K = N - 1)
    H: int = 0  # attention ops: hidden; moe: D
    layout: str = "snapshot_major"
    spare: int = 0  # bank rows past K
    bank_pad: int = 0  # "strided": elements after each bank row
    row_pad: int = 0  # elements after each prefix/addend row
    weight_2d: bool = False
    addends: int = 0
    tap: bool = False
    snapshot: int = -1  # the slot written, -1 none
    diagnostics: bool = False
    rms_eps: float = 1e-5
    norm_eps: float = 1e-5
    kernel: str = "auto"
    pdl: bool = True
    # moe_finalize
    k: int = 0
    R: int = 0
    remote: float = 0.0
    weights_dtype: str = "float32"
    shared: bool = False
    norm: bool = False
    scale: float = 1.0

    def shape_key(self) -> tuple:
        if self.op == "moe_finalize":
            return (self.op, self.T, self.k, self.H)
        return (self.op, self.T, self.N, self.H)

    def describe(self) -> str:
        d = {k: v for k, v in asdict(self).items() if v not in (0, False, -1, "") or k in ("index", "seed", "T")}
        return json.dumps(d, sort_keys=True)


def _draw_tokens(r: random.Random, max_tokens: int) -> int:
    u = r.random()
    if u < 0.55:
        return r.randint(1, 8)
    if u < 0.85:
        return r.randint(9, 32)
    if u < 0.98 or max_tokens <= 64:
        return r.randint(33, min(64, max_tokens))
    return r.randint(65, max_tokens)


def _draw_hidden(r: random.Random, fast: tuple[int, ...]) -> int:
    if r.random() < 0.5:
        return r.choice(fast)
    return 8 * max(1, min(2048, round(math.exp(r.uniform(0.0, math.log(2048.0))))))


def _draw_eps(r: random.Random) -> float:
    u = r.random()
    if u < 0.05:
        return 0.0
    if u < 0.35:
        return 1e-5
    return math.exp(r.uniform(math.log(1e-6), math.log(1e-2)))


@functools.lru_cache(maxsize=65536)
def _plan_accepts(op: str, T: int, N: int, H: int, device: str, add: bool, add2: bool, tap: bool, snapshot: bool,
                  diagnostics: bool, kernel: str) -> bool:
    options = attnres.Options(kernel=kernel) if op != "attn_res_add_rmsnorm_persistent" else \
        attnres.Options(topology="persistent")
    return attnres.plan(op, tokens=T, candidates=N, hidden=H, device=device, add=add, add2=add2, tap=tap,
                        snapshot=snapshot, diagnostics=diagnostics, options=options).accepted


def draw_spec(seed: int, index: int, device: str, max_tokens: int) -> Spec:
    call_seed = zlib.crc32(f"{seed}:{index}".encode())
    r = random.Random(call_seed)
    u = r.random()
    op = ("attn_res" if u < 0.15 else "attn_res_rmsnorm" if u < 0.32 else "attn_res_add_rmsnorm" if u < 0.72
          else "attn_res_add_rmsnorm_persistent" if u < 0.77 else "moe_finalize")
    T = _draw_tokens(r, max_tokens)
    s = Spec(index=index, seed=call_seed, op=op, T=T)
    cuda = device == "cuda"
    if op == "moe_finalize":
        s.H = r.choice(MOE_FAST_D) if r.random() < 0.4 else _draw_hidden(r, MOE_FAST_D)
        s.k = r.choice((8, 16)) if r.random() < 0.5 else r.randint(1, 32)
        s.R = T * s.k + r.randint(0, 8)
        s.remote = r.choice((0.0, 0.0, 0.1, 0.5, 1.0))
        s.weights_dtype = r.choice(("float32", "bfloat16"))
        s.shared, s.norm = r.random() < 0.6, r.random() < 0.5
        s.norm_eps = _draw_eps(r)
        s.scale = r.choice((1.0, 2.827, -1.5, round(r.uniform(-4, 4), 3)))
        s.row_pad = 8 * r.randint(1, 3) if r.random() < 0.3 else 0
        s.pdl = r.random() < 0.7
        return s
    s.N, s.H = r.randint(1, 16), _draw_hidden(r, FAST_H)
    s.layout = r.choice(LAYOUTS)
    s.spare = 0 if s.layout == "contiguous" else r.randint(1, 3)
    s.bank_pad = 8 * r.randint(1, 4) if s.layout == "strided" else 0
    s.row_pad = 8 * r.randint(1, 3) if r.random() < 0.3 else 0
    s.weight_2d = r.random() < 0.2
    s.rms_eps, s.norm_eps = _draw_eps(r), _draw_eps(r)
    if op == "attn_res":
        s.diagnostics = True
    elif op == "attn_res_rmsnorm":
        s.tap = r.random() < 0.5
    elif op == "attn_res_add_rmsnorm":
        s.addends = r.choice((1, 2, 2))
        s.tap = r.random() < 0.4
        if s.spare and r.random() < 0.4:
            s.snapshot = s.N - 1 + r.randrange(s.spare)
    else:
        s.addends = r.choice((0, 1))
    dev = "cuda" if cuda else "cpu"
    flags = (s.addends >= 1, s.addends == 2, s.tap, s.snapshot >= 0, s.diagnostics)
    if op == "attn_res_add_rmsnorm_persistent":
        if not _plan_accepts(op, T, s.N, s.H, dev, *flags, "auto"):
            # The plan declines the persistent kernel here (docs/ops): the same call on the fused op instead.
            s.op, s.addends = "attn_res_add_rmsnorm", max(s.addends, 1)
        return s
    if cuda:
        s.pdl = r.random() < 0.7
        kernel = r.choice(("auto", "auto", "single_cta", "split_k"))
        flags = (s.addends >= 1, s.addends == 2, s.tap, s.snapshot >= 0, s.diagnostics)
        s.kernel = kernel if kernel == "auto" or _plan_accepts(s.op, T, s.N, s.H, dev, *flags, kernel) else "auto"
    return s
