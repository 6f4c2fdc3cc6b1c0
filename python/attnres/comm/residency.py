"""Which calls an InProcessWorld on one GPU can make: every rank's exchanging blocks must be resident at once.

The W ranks of an in-process world are W streams of one GPU, and each rank's exchange spins until every peer's
partial arrives: a rank whose blocks cannot become resident (the SMs already hold its peers' spinning blocks, and
under PDL the blocks of each rank's next kernel, waiting) never writes its partial, and every rank waits out its
bounded wait. Such a call is refused before anything is launched (UnsupportedError naming the limit).

The demand of one call, in blocks: each rank's exchange is one thread per 16-byte vector of a token, in blocks
of the plan's 128 threads (`blocks_per_token` blocks per token); the fused attention site launches its epilogue
under PDL with the same per-token shape (H / 8 threads per token: the split-K cluster's blocks at H = 7168), so
it holds twice the exchange's blocks. `moe_finalize_all_reduce` is one block per token of its plan's threads
(448 at D = 7168), and counts twice as well: a chained call's PDL-launched successor waits resident beside it
(W = 2 at T = 64, D = 3584, stalled on the H200 that way). Its kernel's launch bounds (512 threads) let it take up
to 128 registers per thread, so an SM is only sure to hold 65536 / (128 x threads) of its blocks (one at D =
7168: W = 8 at T = 33, two blocks per SM by threads alone, stalled on the H100).

The budget: `sm_count` x the blocks of that size that fit RESIDENT_THREADS_PER_SM (and the register file, for
moe_finalize_all_reduce). Hopper keeps at most 2048 threads resident per SM, but the spinning exchange and the
epilogue's clusters are held back by registers, cluster placement and other work on the GPU before that: on the
H200, W = 2 at T = 32 (869 threads per SM) progresses at every site and the plain all-reduce at W = 4, T = 32
(869) too, while the fused site stalled at W = 4, T = 32 (1737) and, on an H100 shared with other test
processes, once at W = 4, T = 18 (977). The budget, 896 (seven 128-thread blocks), keeps every call at or under
the measured 869. Ranks on separate GPUs, or in separate processes, are not limited by this.
"""

from __future__ import annotations

from .. import _C

RESIDENT_THREADS_PER_SM = 896
EXCHANGE_THREADS = 128  # the one-shot kernel's block (cpp/src/all_reduce_run.cpp, kThreads)
VECTOR_ELEMENTS = 8  # bf16 elements per 16-byte vector, one per thread
# The ops whose exchanging grids hold their blocks resident, and how many grids of their shape each rank holds:
# the all-reduce alone; the fused site's exchange and its PDL-launched epilogue; moe_finalize_all_reduce and a
# chained call's PDL-launched successor (its block is its plan's, _grid).
GRIDS = {"all_reduce": 1, "all_reduce_attn_res_add_rmsnorm": 2, "moe_finalize_all_reduce": 2}
MOE = "moe_finalize_all_reduce"
REGISTERS_PER_SM = 65536  # sm_90's register file, 32-bit registers
# The most registers per thread moe_finalize_all_reduce's kernel may take: its __launch_bounds__(512) caps it at
# 65536 / 512 (cpp/src/cuda/moe_finalize_all_reduce_kernel.cu, kMaxThreads).
MOE_REGISTERS_PER_THREAD = REGISTERS_PER_SM // 512


def _grid(op: str, width: int, info) -> tuple[int, int]:
    """(threads per block, blocks per token) a rank of `op` holds resident at width D."""
    if op == MOE:
        q = _C.MoeFinalizeQuery()
        q.tokens, q.routes, q.hidden = 1, 1, width
        q.rows_dtype, q.weights_dtype = _C.DType.bf16, _C.DType.f32
        plan = _C.moe_finalize_plan_query(q, info, _C.MoeFinalizeOptions())
        return (plan.threads, GRIDS[op]) if plan.accepted else (EXCHANGE_THREADS, 0)
    blocks = -(-(width // VECTOR_ELEMENTS) // EXCHANGE_THREADS)
    return EXCHANGE_THREADS, GRIDS[op] * blocks


def max_tokens(op: str, world_size: int, width: int, device) -> int:
    """The largest T whose W ranks fit the budget at once (0: not even T = 1) on `device` (a torch device or a
    described GPU, attnres.planning.device_info)."""
    from ..planning import device_info

    info = device_info(device)
    threads, per_token = _grid(op, width, info)
    if per_token == 0:
        return 0
    return info.sm_count * blocks_per_sm(op, threads) // (world_size * per_token)


def blocks_per_sm(op: str, threads: int) -> int:
    """The blocks of `threads` threads of `op` one SM is sure to hold at once, within the budget."""
    blocks = RESIDENT_THREADS_PER_SM // threads
    if op == MOE:
        blocks = min(blocks, REGISTERS_PER_SM // (MOE_REGISTERS_PER_THREAD * threads))
    return blocks


def check_resident(op: str, world_size: int, tokens: int, width: int, device) -> None:
    """UnsupportedError when W ranks of `op` at T = tokens cannot all be resident on `device` at once."""
    if op not in GRIDS:
        return
    from ..planning import device_info

    info = device_info(device)
    limit = max_tokens(op, world_size, width, info)
    if tokens > limit:
        threads, per_token = _grid(op, width, info)
        raise _C.UnsupportedError(
            f"{op}: an InProcessWorld of {world_size} ranks on one GPU ({info.sm_count} SMs) takes at most T = "
            f"{limit} at width {width} (every rank's blocks must be resident at once: {world_size} x {per_token} "
            f"block(s) of {threads} threads per token, at most {blocks_per_sm(op, threads)} per SM); got T = "
            f"{tokens}. Use fewer ranks, fewer tokens per call, or ranks on separate GPUs (docs/tp.md)")
