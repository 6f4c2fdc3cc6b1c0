// moe_finalize: the plan (a pure function of the call's shape, dtypes, device and options) and the entry
// point that validates, plans and hands the call to a backend.
#include <string>

#include "attnres/error.hpp"
#include "attnres/moe_finalize.hpp"
#include "attnres/version.hpp"
#include "backend.hpp"

namespace attnres {

namespace {

MoeFinalizePlan declined(std::string reason) {
  MoeFinalizePlan p;
  p.decline = std::move(reason);
  return p;
}

std::string num(int64_t v) { return std::to_string(v); }

// The supported range, as reasons (the cheap Python predicate reports them without building tensors).
std::string range_decline(const MoeFinalizeQuery& q) {
  if (q.tokens < 1 || q.tokens > kMoeFinalizeMaxTokens)
    return "T = " + num(q.tokens) + " is outside [1, " + num(kMoeFinalizeMaxTokens) + "]";
  if (q.routes < 1 || q.routes > kMoeFinalizeMaxRoutes)
    return "k = " + num(q.routes) + " is outside [1, " + num(kMoeFinalizeMaxRoutes) + "]";
  if (q.hidden < kMoeFinalizeHiddenMultiple || q.hidden > kMoeFinalizeMaxHidden ||
      q.hidden % kMoeFinalizeHiddenMultiple != 0)
    return "D = " + num(q.hidden) + " is not a multiple of 8 in [8, " + num(kMoeFinalizeMaxHidden) + "]";
  if (q.rows_dtype != DType::bf16) return std::string("rows are ") + dtype_name(q.rows_dtype) + " (the kernel reads bfloat16)";
  if (q.weights_dtype != DType::f32 && q.weights_dtype != DType::bf16)
    return std::string("weights are ") + dtype_name(q.weights_dtype) + " (the kernel reads float32 or bfloat16)";
  return {};
}

}  // namespace

MoeFinalizePlan plan_moe_finalize(const MoeFinalizeQuery& q, const DeviceInfo& dev, const MoeFinalizeOptions& o) {
  if (o.kernel != KernelKind::automatic && o.kernel != KernelKind::cpu && o.kernel != KernelKind::single_cta)
    return declined(std::string("kernel ") + kernel_name(o.kernel) + " does not implement moe_finalize (cpu or single_cta)");
  std::string why = range_decline(q);
  if (!why.empty()) return declined(why);

  if (dev.device.type == DeviceType::cpu) {
    if (o.kernel == KernelKind::single_cta) return declined("kernel single_cta runs on CUDA devices; the tensors are on cpu");
    MoeFinalizePlan p;
    p.kernel = KernelKind::cpu;
    return p;
  }
  if (!dev.cuda_backend) return declined("attnres was built without the CUDA backend");
  if (dev.cc_major < 9)
    return declined(device_name(dev.device) + " (" + dev.name + ") has compute capability " + num(dev.cc_major) + "." +
                    num(dev.cc_minor) + "; the CUDA kernels need 9.0 (Hopper) or newer");
  if (o.kernel == KernelKind::cpu)
    return declined("kernel cpu runs on CPU tensors; the tensors are on " + device_name(dev.device));

  // One block per token. Threads own 16-byte slices of the row; a block stays <= 512 threads (128 registers
  // per thread) so that route_chunk * vectors = 16 slices in flight per thread fit next to the fp32
  // accumulators; at 4 slices per thread (D > 8192) the accumulators leave room for 8 in flight.
  const int64_t vecs = q.hidden / 8;
  MoeFinalizePlan p;
  p.kernel = KernelKind::single_cta;
  p.vectors = vecs <= 512 ? 1 : vecs <= 1024 ? 2 : 4;
  p.route_chunk = p.vectors == 1 ? 16 : p.vectors == 2 ? 8 : 2;
  const int64_t per_block = (vecs + p.vectors - 1) / p.vectors;
  p.threads = static_cast<int32_t>((per_block + 31) / 32 * 32);
  p.pdl = o.pdl;
  return p;
}

MoeFinalizePlan plan_moe_finalize(const MoeFinalizeArgs& args, const MoeFinalizeOptions& options) {
  validate_moe_finalize(args, /*require_output=*/false);
  return plan_moe_finalize(moe_finalize_query(args), query_device(args.rows.device), options);
}

void moe_finalize(const MoeFinalizeArgs& args, const MoeFinalizeOptions& options) {
  validate_moe_finalize(args, /*require_output=*/true);
  const MoeFinalizePlan p = plan_moe_finalize(moe_finalize_query(args), query_device(args.rows.device), options);
  if (!p.accepted()) throw UnsupportedError("moe_finalize: " + p.decline);
  switch (p.kernel) {
    case KernelKind::cpu:
      detail::cpu_moe_finalize(args);
      return;
#if ATTNRES_WITH_CUDA
    case KernelKind::single_cta:
      detail::cuda_moe_finalize(args, p);
      return;
#endif
    default:
      throw UnsupportedError(std::string("moe_finalize: kernel ") + kernel_name(p.kernel) +
                             " is not available in this build");
  }
}

}  // namespace attnres
