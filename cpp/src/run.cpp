#include "attnres/attn_res.hpp"
#include "attnres/error.hpp"
#include "attnres/version.hpp"
#include "backend.hpp"

namespace attnres {

namespace {

// The plan for validated arguments on their device. The automatic persistent geometry's two blocks per SM must
// both be resident; the pure plan sizes them so (persistent_layout.hpp two_blocks_fit), and where the occupancy
// calculator still disagrees the call is replanned with one block per SM (the same bits: every reduction
// order depends on H alone), so an automatic plan never ends in a launch error. A forced
// persistent_blocks_per_sm = 2 is kept and refused by the launcher.
Plan device_plan(AttnResOp op, const AttnResArgs& args, const Options& options) {
  const PlanQuery q = plan_query(op, args);
  const DeviceInfo dev = query_device(args.layer_residual.device);
  Plan p = plan(q, dev, options);
#if ATTNRES_WITH_CUDA
  if (p.accepted() && p.kernel == KernelKind::persistent && p.blocks_per_sm > 1 &&
      options.persistent_blocks_per_sm == 0 && detail::cuda_attn_res_persistent_resident(args, p) < p.blocks_per_sm) {
    Options one = options;
    one.persistent_blocks_per_sm = 1;
    p = plan(q, dev, one);
  }
#endif
  return p;
}

}  // namespace

Plan plan(AttnResOp op, const AttnResArgs& args, const Options& options) {
  validate(op, args, /*require_outputs=*/false);
  return device_plan(op, args, options);
}

void run(AttnResOp op, const AttnResArgs& args, const Options& options) {
  validate(op, args, /*require_outputs=*/true);
  const Plan p = device_plan(op, args, options);
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
