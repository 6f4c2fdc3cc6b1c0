#include "attnres/attn_res.hpp"
#include "attnres/error.hpp"
#include "attnres/version.hpp"
#include "backend.hpp"

namespace attnres {

Plan plan(AttnResOp op, const AttnResArgs& args, const Options& options) {
  validate(op, args, /*require_outputs=*/false);
  return plan(plan_query(op, args), query_device(args.layer_residual.device), options);
}

void run(AttnResOp op, const AttnResArgs& args, const Options& options) {
  validate(op, args, /*require_outputs=*/true);
  const Plan p = plan(plan_query(op, args), query_device(args.layer_residual.device), options);
  if (!p.accepted()) throw UnsupportedError(std::string(op_name(op)) + ": " + p.decline);
  switch (p.kernel) {
    case KernelKind::cpu:
      detail::cpu_attn_res(op, args);
      return;
#if ATTNRES_WITH_CUDA
    case KernelKind::single_cta:
    case KernelKind::split_k:
      detail::cuda_attn_res(op, args, p);
      return;
    case KernelKind::persistent:
      detail::cuda_attn_res_persistent(op, args, p);
      return;
#endif
    default:
      throw UnsupportedError(std::string(op_name(op)) + ": kernel " + kernel_name(p.kernel) +
                             " is not available in this build");
  }
}

}  // namespace attnres
