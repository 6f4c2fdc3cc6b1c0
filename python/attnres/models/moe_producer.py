"""A deferred-finalize MoE producer stand-in: a toy routed MoE that either finalizes itself or hands the
pieces (rows, weights, index) to a consumer such as attnres.moe_finalize.

It reproduces the parts of a real MoE runner that the hand-off depends on, deterministically (seeded):

* routing: router logits -> top-k -> softmax over the k picked logits (weights fp32 or bf16, ids int32), or
  routing pre-computed by the caller (topk_weights, topk_ids), which the runner then only reads;
* experts: small random bf16 linear maps; each route's output row is written into a permuted buffer grouped
  by expert, every expert's segment padded to a multiple of `align` rows, plus `align` tail rows; padding
  holds NaN, so a consumer that reads a row the index map does not name produces NaN;
* expert parallelism: experts outside `local_experts` live on another rank: their routes get index -1 and no
  row;
* the runner's own finalize: per token, sum over j in j order of fp32(weight) * fp32(row) in fp32, times the
  routed scaling factor, rounded to bf16 once.

The bug this guards against (a MoE runner's deferred-finalize path): with caller routing, the runner's locally allocated weights buffer is never
written (the routing reads the caller's buffer), yet the deferred path returned it — the consumer then applied
uninitialized memory as routing weights and the model scored 0.00 on GSM8K, silently. Here the deferred path
hands over the buffer the routing used (`_weights_handed_to_consumer`, the one decision point; the regression
test replaces it with the buggy choice to prove it notices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BF16 = torch.bfloat16


@dataclass(frozen=True)
class MoePieces:
    """What a runner returns with do_finalize=False: the inputs of attnres.moe_finalize."""

    rows: Tensor  # [R, D] bf16 expert outputs in permuted order, R >= routes kept, NaN padding rows
    weights: Tensor  # [T, k] the routing weights the runner used (fp32 or bf16)
    index: Tensor  # [T, k] int32: row of route (t, j), -1 for an expert on another rank
    scale: float  # the routed scaling factor the consumer applies to the sum


class ToyRoutedMoE:
    """Routed experts only (no shared expert: that is the consumer's `shared` input)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, seed: int = 0, device="cpu",
                 routed_scale: float = 1.0, local_experts=None, align: int = 8,
                 weights_dtype: torch.dtype = torch.float32):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"ToyRoutedMoE: top_k must be in [1, num_experts = {num_experts}], got {top_k}")
        if weights_dtype not in (torch.float32, BF16):
            raise ValueError(f"ToyRoutedMoE: weights_dtype must be float32 or bfloat16, got {weights_dtype}")
        if align < 1:
            raise ValueError(f"ToyRoutedMoE: align must be >= 1, got {align}")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.device = torch.device(device)
        self.routed_scale = float(routed_scale)
        self.align = align
        self.weights_dtype = weights_dtype
        self.local_experts = sorted(set(range(num_experts) if local_experts is None else local_experts))
        if any(not 0 <= e < num_experts for e in self.local_experts):
            raise ValueError(f"ToyRoutedMoE: local_experts must be expert ids in [0, {num_experts})")
        g = torch.Generator().manual_seed(seed)
        # Drawn on the CPU, then moved: the same seed gives the same bits on every device.
        self.router = (torch.randn(num_experts, hidden, generator=g) * hidden ** -0.5).to(BF16).to(self.device)
        self.experts = (torch.randn(num_experts, hidden, hidden, generator=g) * hidden ** -0.5).to(BF16).to(self.device)

    # ------------------------------------------------------------------------------------------ routing
    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(topk_weights [T, k] in weights_dtype, topk_ids [T, k] int32): softmax over the top-k logits."""
        logits = x.float() @ self.router.float().t()
        values, ids = logits.topk(self.top_k, dim=-1)
        return torch.softmax(values, dim=-1).to(self.weights_dtype), ids.to(torch.int32)

    # ------------------------------------------------------------------------------------------ experts
    def expert_rows(self, x: Tensor, topk_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(rows [R, D] bf16, index [T, k] int32): every local route's expert output in a permuted buffer
        grouped by expert (segments padded to `align` rows, NaN padding), and the route -> row map."""
        T, k = topk_ids.shape
        ids = topk_ids.long().cpu()
        index = torch.full((T, k), -1, dtype=torch.int32)
        segments = []  # (expert, first row, token ids, route slots)
        next_row = 0
        for e in self.local_experts:
            t_ids, j_ids = (ids == e).nonzero(as_tuple=True)  # row-major: (t, j) ascending
            if t_ids.numel() == 0:
                continue
            index[t_ids, j_ids] = torch.arange(next_row, next_row + t_ids.numel(), dtype=torch.int32)
            segments.append((e, next_row, t_ids))
            next_row += -(-t_ids.numel() // self.align) * self.align
        R = next_row + self.align
        rows = torch.full((R, self.hidden), float("nan"), dtype=BF16, device=x.device)
        for e, first, t_ids in segments:
            out = x[t_ids.to(x.device)].float() @ self.experts[e].float().t()
            rows[first:first + t_ids.numel()] = out.to(BF16)
        return rows, index.to(x.device)

    # ------------------------------------------------------------------------------------------ finalize
    def finalize(self, rows: Tensor, weights: Tensor, index: Tensor) -> Tensor:
        """The runner's own finalize: fp32 sum over j in j order of weight * row, times the scale, one
        bf16 rounding. Remote routes (-1) are skipped."""
        T, k = index.shape
        acc = torch.zeros((T, self.hidden), dtype=torch.float32, device=rows.device)
        for j in range(k):
            valid = (index[:, j] >= 0).unsqueeze(-1)
            term = rows[index[:, j].long().clamp(min=0)].float() * weights[:, j:j + 1].float()
            acc = acc + torch.where(valid, term, 0.0)
        return (acc * self.routed_scale).to(BF16)

    def _weights_handed_to_consumer(self, used: Tensor, local: Tensor) -> Tensor:
        """The deferred path returns the weights the routing used: the caller's buffer when the caller
        routed (then `local`, the runner's own buffer, was never written), else the runner's own."""
        return used

    def __call__(self, x: Tensor, *, topk_weights: Tensor | None = None, topk_ids: Tensor | None = None,
                 do_finalize: bool = True):
        """x [T, D] bf16 -> the finalized [T, D] bf16 output, or MoePieces with do_finalize=False."""
        if x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != BF16:
            raise ValueError(f"ToyRoutedMoE: x must be [T, {self.hidden}] bfloat16, got {x.dtype} {list(x.shape)}")
        if (topk_weights is None) != (topk_ids is None):
            raise ValueError("ToyRoutedMoE: pass both topk_weights and topk_ids (pre-computed routing) or neither")
        T = x.shape[0]
        local = torch.empty((T, self.top_k), dtype=self.weights_dtype, device=x.device)
        if topk_ids is None:
            weights, ids = self.route(x)
            local.copy_(weights)
            used = local
        else:
            if tuple(topk_ids.shape) != (T, self.top_k) or tuple(topk_weights.shape) != (T, self.top_k):
                raise ValueError(f"ToyRoutedMoE: pre-computed routing must be [T, k] = [{T}, {self.top_k}], got "
                                 f"{list(topk_weights.shape)} and {list(topk_ids.shape)}")
            ids, used = topk_ids, topk_weights  # input-only: the runner never writes the caller's buffer
        rows, index = self.expert_rows(x, ids)
        if do_finalize:
            return self.finalize(rows, used, index)
        return MoePieces(rows=rows, weights=self._weights_handed_to_consumer(used, local), index=index,
                         scale=self.routed_scale)
