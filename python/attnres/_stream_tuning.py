"""single_cta's large-T knobs (attnres::Options::stream_min_tokens, stream_buffers, token_blocks_min_tokens and
token_blocks_exact_n), for
the benchmarks' A/B (python -m bench stream) and the tests that hold the streaming and token-block kernels to
split_k's bits at every T. Private: not part of attnres.Options nor of the torch.ops schemas.

single_cta streams from T = min_tokens on: min(T, resident) blocks loop over the tokens, each prefetching its
next token's rows into shared memory while it reduces the current one (cpp/src/cuda/attn_res_stream.cuh).
0 keeps the plan's bound (more tokens than SMs); ALWAYS streams at every T, NEVER at none. The knob
changes no bit: the streaming kernel runs single_cta's arithmetic on every token. A negative value raises
attnres.ArgumentError (naming the op and the knob). buffers: the token buffers (the token being reduced and the
ones whose rows are in flight), 0 for the plan's count, else 2..4 where the call's N bucket is built with it.
blocks_min_tokens: single_cta runs the token-block kernel (one block per token, several per SM;
cpp/src/cuda/attn_res_blocks.cuh) from this T on, before streaming, FP8 calls included; 0 keeps the plan's table
(plan_tuning.hpp automatic_token_blocks_min_tokens; bf16 calls only), ALWAYS at every T, NEVER at none. It changes no
bit either.
blocks_exact_n: at N = 3 the token-block kernel runs its instance built for exactly three candidates (three blocks
per SM) instead of the N = 4 bucket's (two); no effect elsewhere, no bit changed."""

from __future__ import annotations

from torch import Tensor

from . import _C
from . import ops
from .options import Options
from .planning import PlanInfo, device_info, plan_info

ALWAYS = 1
NEVER = 1 << 62


class StreamOptions:
    """What the ops layer's runner asks of an options object (to_c), with the knob set."""

    def __init__(self, min_tokens: int, kernel: str = "single_cta", pdl: bool = True, buffers: int = 0,
                 blocks_min_tokens: int = NEVER, blocks_exact_n: bool = False):
        for name, value in (("stream_min_tokens", min_tokens), ("stream_buffers", buffers),
                            ("token_blocks_min_tokens", blocks_min_tokens)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise _C.ArgumentError(f"{name} must be an int, got {value!r}")
        if not isinstance(blocks_exact_n, bool):
            raise _C.ArgumentError(f"token_blocks_exact_n must be a bool, got {blocks_exact_n!r}")
        self.min_tokens, self.buffers, self.base = min_tokens, buffers, Options(kernel=kernel, pdl=pdl)
        self.blocks_min_tokens, self.blocks_exact_n = blocks_min_tokens, blocks_exact_n

    def to_c(self) -> _C.Options:
        o = self.base.to_c()
        o._stream_min_tokens = self.min_tokens
        o._stream_buffers = self.buffers
        o._token_blocks_min_tokens = self.blocks_min_tokens
        o._token_blocks_exact_n = self.blocks_exact_n
        return o


def plan(min_tokens: int, op: str = "attn_res_add_rmsnorm", *, tokens: int, candidates: int, hidden: int,
         add: bool = True, add2: bool = False, device="cuda", kernel: str = "single_cta", buffers: int = 0,
         blocks_min_tokens: int = NEVER, blocks_exact_n: bool = False) -> PlanInfo:
    """The plan of `op` under the knobs (device: as attnres.plan's, e.g. "h200" without a GPU)."""
    q = _C.PlanQuery()
    q.op = getattr(_C.AttnResOp, op)
    q.tokens, q.candidates, q.hidden, q.add, q.add2 = int(tokens), int(candidates), int(hidden), bool(add), bool(add2)
    opts = StreamOptions(min_tokens, kernel, buffers=buffers, blocks_min_tokens=blocks_min_tokens,
                         blocks_exact_n=blocks_exact_n)
    return plan_info(_C.plan_query(q, device_info(device), opts.to_c()))


def attn_res_add_rmsnorm(min_tokens: int, layer_residual: Tensor, layer_residual_add: Tensor, block_residual: Tensor,
                         res_weight: Tensor, rms_weight: Tensor, norm_weight: Tensor, rms_eps: float = 1e-5,
                         norm_eps: float = 1e-5, *, layer_residual_add2: Tensor | None = None,
                         return_mixture: bool = False, snapshot_slot: int = -1, kernel: str = "single_cta",
                         pdl: bool = True, blocks_min_tokens: int = NEVER,
                         blocks_exact_n: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """attn_res_add_rmsnorm on single_cta under the knobs: (updated, output, mixture; empty when not asked)."""
    result = ops.attn_res_add_rmsnorm(
        layer_residual, layer_residual_add, block_residual, res_weight, rms_weight, norm_weight, float(rms_eps),
        float(norm_eps), layer_residual_add2=layer_residual_add2, return_mixture=True,
        snapshot_slot=None if snapshot_slot < 0 else int(snapshot_slot),
        options=StreamOptions(min_tokens, kernel, pdl, blocks_min_tokens=blocks_min_tokens, blocks_exact_n=blocks_exact_n))
    return result if return_mixture else (*result[:2], result[2].new_empty((0,)))
