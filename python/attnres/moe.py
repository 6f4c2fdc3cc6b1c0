"""The MoE finalize epilogue (docs/ops/moe_finalize.md): the consumer side of a deferred MoE finalize.

A MoE runner called with do_finalize=False hands over `rows [R, D]` (expert outputs in permuted order),
`weights [T, k]` (the buffer the routing used) and `index [T, k]` (int32 row of route (t, j); -1 = remote
expert). This module gathers the public names; each role has its own module:

* `moe_finalize(...)` (moe_ops.py) — the fused op (torch.ops.attnres.moe_finalize): combine in fp32 in j order with one
  rounding, optional shared add, optional two-rounding RMSNorm. Strict: every contract violation raises.
* `unfused_moe_finalize(...)` (moe_unfused.py) — the PyTorch sequence a user would write (gather, weight, fp32 sum, round, add
  shared, norm): the fallback and the benchmark baseline.
* `supports_fused_moe_finalize(...)` (moe_gate.py) — the cheap gate: token count, dtype pair, world size, device, D, k.
* `finalize_moe_output(...)` (moe_tail.py) — the dispatching helper: raises on malformed inputs whichever path it takes,
  then runs the fused op when the gate and the layout allow, else the unfused sequence (finalize, all-reduce
  when world_size > 1, then norm). Each decision is recorded (`record_finalize_decisions`,
  `last_finalize_decision`) and logged at debug level once per distinct (path, reason, T, k, D, device).
* `reference_moe_finalize(...)` (reference.py) — the float64 oracle of the contract (tests, benchmarks).
"""

from __future__ import annotations

from ._tensors import as_tensor  # noqa: F401
from .moe_gate import (  # noqa: F401
    FinalizeDecision,
    _logged,
    last_finalize_decision,
    log,
    record_finalize_decisions,
    supports_fused_moe_finalize,
)
from .moe_ops import KERNELS, OP, check_index_range, moe_finalize, moe_finalize_op  # noqa: F401
from .moe_tail import finalize_moe_output  # noqa: F401
from .moe_unfused import rmsnorm_two_rounding, unfused_moe_finalize  # noqa: F401
from .reference import reference_moe_finalize  # noqa: F401
