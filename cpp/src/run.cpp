#include "attnres/attn_res.hpp"
#include "attnres/error.hpp"
#include "attnres/version.hpp"
#include "backend.hpp"
#include "plan_arithmetic.hpp"

namespace attnres {

namespace {

thread_local detail::LaunchRecord launch_record;

#if ATTNRES_WITH_CUDA
// The blocks per SM of the persistent plan's instance that the occupancy calculator finds resident on the
// queried device. The launcher picks the instance from the op (normed or not), the FP8 mode, whether an addend
// is streamed and the device, which is all this probe carries.
int resident_blocks_per_sm(const PlanQuery& q, const DeviceInfo& dev, const Plan& p) {
  AttnResArgs probe;
  probe.fp8 = q.fp8;
  probe.layer_residual.device = dev.device;
  if (q.add) probe.layer_residual_add.ndim = 2;  // present(): the ADD instance
  return detail::cuda_attn_res_persistent_resident(q.op, probe, p);
}
#endif

}  // namespace

// The persistent kernel's two blocks per SM must both be resident; the arithmetic sizes them so
// (persistent_layout.hpp two_blocks_fit), and where the occupancy calculator still disagrees an automatic
// geometry is replanned with one block per SM (the same bits: every reduction order depends on H alone) and a
// forced persistent_blocks_per_sm = 2 is declined, so a plan never ends in a launch error.
Plan plan(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  Plan p = detail::plan_arithmetic(q, dev, o);
#if ATTNRES_WITH_CUDA
  if (dev.queried && dev.device.type == DeviceType::cuda && p.accepted() && p.route == Route::persistent &&
      p.blocks_per_sm > 1) {
    const int resident = resident_blocks_per_sm(q, dev, p);
    if (resident < p.blocks_per_sm) {
      if (o.persistent_blocks_per_sm == 0) {
        Options one = o;
        one.persistent_blocks_per_sm = 1;
        return detail::plan_arithmetic(q, dev, one);
      }
      return detail::declined_plan(
          DeclineCode::persistent_not_resident,
          "the plan's " + std::to_string(p.blocks_per_sm) + " blocks per SM are not resident (" +
              std::to_string(resident) + " block(s) of " + std::to_string(p.threads) + " threads and " +
              std::to_string(p.smem_bytes) + " bytes of shared memory fit an SM)");
    }
  }
#endif
  return p;
}

Plan plan(AttnResOp op, const AttnResArgs& args, const Options& options) {
  validate(op, args, /*require_outputs=*/false);
  return plan(plan_query(op, args), query_device(args.layer_residual.device), options);
}

const detail::LaunchRecord& detail::last_launch() { return launch_record; }

void run(AttnResOp op, const AttnResArgs& args, const Options& options) {
  validate(op, args, /*require_outputs=*/true);
  const Plan p = plan(plan_query(op, args), query_device(args.layer_residual.device), options);
  if (!p.accepted()) throw UnsupportedError(std::string(op_name(op)) + ": " + p.decline);
  switch (p.kernel) {
    case KernelKind::cpu:
      detail::cpu_attn_res(op, args);
      break;
#if ATTNRES_WITH_CUDA
    case KernelKind::single_cta:
    case KernelKind::split_k:
      detail::cuda_attn_res(op, args, p);
      break;
    case KernelKind::persistent:
      detail::cuda_attn_res_persistent(op, args, p);
      break;
#endif
    default:
      throw UnsupportedError(std::string(op_name(op)) + ": kernel " + kernel_name(p.kernel) +
                             " is not available in this build");
  }
  launch_record.plan = p;
  ++launch_record.launches;
}

}  // namespace attnres
