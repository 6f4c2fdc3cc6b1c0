"""attnres: attention-residual decode epilogues (Kimi K3 and other Attention-Residual models).

Public API: the ops (attn_res, attn_res_rmsnorm, attn_res_add_rmsnorm, attn_res_add_rmsnorm_persistent),
Options, plan() and backend_info(). torch.ops.attnres.* are registered on import. The float64 oracle is
attnres.reference; the Kimi K3 decode chain is attnres.models.kimi_k3.
"""

from . import _C
from ._C import ArgumentError, CudaError, UnsupportedError
from ._C import Error as AttnResError
from .ops import attn_res, attn_res_add_rmsnorm, attn_res_add_rmsnorm_persistent, attn_res_rmsnorm
from .moe import moe_finalize, supports_fused_moe_finalize
from .all_reduce import all_reduce, all_reduce_attn_res_add_rmsnorm, moe_finalize_all_reduce
from .options import Options
from .planning import PlanInfo, backend_info, plan

__version__ = _C.__version__

__all__ = [
    "ArgumentError",
    "AttnResError",
    "CudaError",
    "Options",
    "PlanInfo",
    "UnsupportedError",
    "all_reduce",
    "all_reduce_attn_res_add_rmsnorm",
    "attn_res",
    "attn_res_add_rmsnorm",
    "attn_res_add_rmsnorm_persistent",
    "attn_res_rmsnorm",
    "backend_info",
    "moe_finalize",
    "moe_finalize_all_reduce",
    "plan",
    "supports_fused_moe_finalize",
]
