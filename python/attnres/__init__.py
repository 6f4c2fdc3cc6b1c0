"""attnres: attention-residual decode epilogues (Kimi K3 and other Attention-Residual models).

Public API: the ops (attn_res, attn_res_rmsnorm, attn_res_add_rmsnorm; attn_res_add_rmsnorm_persistent is an
alias with Options(topology="persistent")), moe_finalize, the all-reduce ops, Options, plan(), backend_info()
and the errors (all subclasses of AttnResError). torch.ops.attnres.* are registered on import. The float64 oracle is
attnres.reference; the Kimi K3 decode chain is attnres.models.kimi_k3.
"""

from . import _C
from .errors import ArgumentError, AttnResError, CudaError, UnsupportedError

# The C++ library's exceptions are raised as these classes; _C.<name> names them too.
_C._set_error_types(AttnResError, ArgumentError, UnsupportedError, CudaError)
_C.Error, _C.ArgumentError, _C.UnsupportedError, _C.CudaError = AttnResError, ArgumentError, UnsupportedError, CudaError

from .ops import attn_res, attn_res_add_rmsnorm, attn_res_add_rmsnorm_persistent, attn_res_rmsnorm  # noqa: E402
from .moe import moe_finalize, supports_fused_moe_finalize  # noqa: E402
from .all_reduce import all_reduce, all_reduce_attn_res_add_rmsnorm, moe_finalize_all_reduce  # noqa: E402
from .options import Options  # noqa: E402
from .planning import PlanInfo, backend_info, plan  # noqa: E402

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
