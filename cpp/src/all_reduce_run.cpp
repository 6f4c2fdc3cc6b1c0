// all_reduce and its fused ops: the plans (pure functions of the call's shape, the device and the options)
// and the entry points that validate, plan and hand the call to a backend. Every call is validated and
// planned in full before anything is launched, so a rejected or declined call writes nothing.
#include <string>

#include "attnres/all_reduce.hpp"
#include "attnres/error.hpp"
#include "attnres/version.hpp"
#include "backend.hpp"
#include "layout.hpp"
#include "plan_tuning.hpp"

namespace attnres {

namespace {

constexpr int32_t kThreads = 128;  // one 16-byte vector per thread; D = 7168 is 7 blocks per token

AllReducePlan declined(std::string reason) {
  AllReducePlan p;
  p.decline = std::move(reason);
  return p;
}

std::string num(int64_t v) { return std::to_string(v); }

// The device rules shared by both ops' plans; empty when the device can run the exchange.
std::string device_decline(const DeviceInfo& dev, int32_t world, const AllReduceOptions& o) {
  if (o.kernel != KernelKind::automatic && o.kernel != KernelKind::cpu && o.kernel != KernelKind::single_cta)
    return std::string("kernel ") + kernel_name(o.kernel) + " does not implement the all-reduce (cpu or single_cta)";
  if (dev.device.type == DeviceType::cpu)
    return o.kernel == KernelKind::single_cta ? "kernel single_cta runs on CUDA devices; the tensors are on cpu" : "";
  if (!dev.cuda_backend) return "attnres was built without the CUDA backend";
  if (dev.cc_major < 9)
    return device_name(dev.device) + " has compute capability " + num(dev.cc_major) + "." + num(dev.cc_minor) +
           "; the CUDA kernels need 9.0 (Hopper) or newer";
  if (o.kernel == KernelKind::cpu) return "kernel cpu runs on CPU tensors; the tensors are on " + device_name(dev.device);
  if (!all_reduce_world_supported(world))
    return "world size " + num(world) + " has no CUDA kernel instance (2, 4 or 8)";
  return {};
}

AllReducePlan accepted_plan(const DeviceInfo& dev, int64_t width, const AllReduceOptions& o) {
  AllReducePlan p;
  p.kernel = dev.device.type == DeviceType::cpu ? KernelKind::cpu : KernelKind::single_cta;
  const int64_t vectors = width / 8;
  p.threads = kThreads;
  p.blocks_per_token = static_cast<int32_t>((vectors + kThreads - 1) / kThreads);
  p.pdl = o.pdl;
  p.early_trigger = o.early_trigger;
  return p;
}

}  // namespace

bool all_reduce_world_supported(int32_t world_size) { return world_size == 2 || world_size == 4 || world_size == 8; }

AllReducePlan plan_all_reduce(const AllReduceQuery& q, const DeviceInfo& dev, const AllReduceOptions& o) {
  if (q.tokens < 1) return declined("T = " + num(q.tokens) + " tokens: T must be >= 1");
  if (q.width < 8 || q.width > kAllReduceMaxWidth || q.width % 8 != 0)
    return declined("D = " + num(q.width) + " is not a multiple of 8 in [8, " + num(kAllReduceMaxWidth) + "]");
  const std::string why = device_decline(dev, q.world_size, o);
  if (!why.empty()) return declined(why);
  return accepted_plan(dev, q.width, o);
}

AllReducePlan plan_all_reduce(const AllReduceArgs& a, const AllReduceOptions& o) {
  validate_all_reduce(a, /*require_output=*/false, /*read_data=*/false);
  AllReduceQuery q;
  q.world_size = a.comm.world_size;
  q.tokens = a.comm.device.type == DeviceType::cuda ? a.input.shape[0] : a.gathered.shape[1];
  q.width = a.comm.width;
  q.device = a.comm.device;
  return plan_all_reduce(q, query_device(a.comm.device), o);
}

namespace {

void launch_all_reduce(const AllReduceArgs& a, const AllReducePlan& p) {
  switch (p.kernel) {
    case KernelKind::cpu:
      detail::cpu_all_reduce(a);
      return;
#if ATTNRES_WITH_CUDA
    case KernelKind::single_cta:
      detail::cuda_all_reduce(a, p);
      return;
#endif
    default:
      throw UnsupportedError(std::string("all_reduce: kernel ") + kernel_name(p.kernel) + " is not available in this build");
  }
}

}  // namespace

void all_reduce(const AllReduceArgs& a, const AllReduceOptions& o) {
  validate_all_reduce(a, /*require_output=*/true);
  const AllReducePlan p = plan_all_reduce(a, o);
  if (!p.accepted()) throw UnsupportedError("all_reduce: " + p.decline);
  launch_all_reduce(a, p);
}

namespace {

// The two kernels of the site share the all-reduce's tensors with the attention op's: whatever the attention
// op writes (its outputs and the snapshot row) must not alias the partial or the gathered partials the
// all-reduce reads, and the reduced sum the all-reduce writes must alias no attention input but the addend it is
// (the plain op refuses the same aliasing: "snapshot row overlaps layer_residual_add").
void check_site_aliasing(const char* op, const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn) {
  struct Named {
    const char* name;
    const TensorRef* ref;
  };
  TensorRef snapshot;
  if (attn.snapshot_slot >= 0 && attn.block_residual.present())
    snapshot = detail::snapshot_rows(attn.block_residual, attn.snapshot_slot);
  const Named written[] = {{"output", &attn.output},   {"updated", &attn.updated},       {"mixture", &attn.mixture},
                           {"rsigma", &attn.rsigma},   {"probs", &attn.probs},           {"logits", &attn.logits},
                           {"output_fp8", &attn.output_fp8}, {"fp8_scales", &attn.fp8_scales},
                           {"snapshot row", &snapshot}};
  const Named read[] = {{"partial", &ar.input}, {"gathered", &ar.gathered}};
  for (const Named& w : written)
    for (const Named& r : read)
      if (w.ref->present() && r.ref->present() && detail::overlaps(*w.ref, *r.ref))
        throw ArgumentError(std::string(op) + ": " + w.name + " overlaps " + r.name +
                            " (the all-reduce reads it; outputs must not alias inputs)");
  const Named inputs[] = {{"layer_residual", &attn.layer_residual},
                          {"layer_residual_add", site == AllReduceSite::add2 ? &attn.layer_residual_add : nullptr},
                          {"block_residual", &attn.block_residual},
                          {"res_weight", &attn.res_weight},
                          {"rms_weight", &attn.rms_weight},
                          {"norm_weight", &attn.norm_weight}};
  for (const Named& in : inputs)
    if (in.ref != nullptr && in.ref->present() && ar.output.present() && detail::overlaps(ar.output, *in.ref))
      throw ArgumentError(std::string(op) + ": reduced overlaps " + in.name + " (outputs must not alias inputs)");
}

void check_site_addend(const char* op, const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn) {
  const TensorRef& addend = site == AllReduceSite::add ? attn.layer_residual_add : attn.layer_residual_add2;
  const char* addend_name = site == AllReduceSite::add ? "layer_residual_add" : "layer_residual_add2";
  if (!addend.present() || addend.data != ar.output.data || addend.ndim != 2 ||
      addend.shape[0] != ar.output.shape[0] || addend.shape[1] != ar.output.shape[1] ||
      addend.strides[0] != ar.output.strides[0])
    throw ArgumentError(std::string(op) + ": " + addend_name + " must be the all-reduce's output (the reduced sum "
                        "is the site's addend)");
  if (site == AllReduceSite::add && attn.layer_residual_add2.present())
    throw ArgumentError(std::string(op) + ": site add takes one addend (layer_residual_add2 must be absent)");
}

}  // namespace

namespace {

struct SitePlans {
  AllReducePlan ar;
  Plan attn;
};

SitePlans plan_site(const char* op, const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn,
                    const AllReduceOptions& ar_options, const Options& attn_options, bool require_outputs,
                    bool read_data) {
  if (site != AllReduceSite::add && site != AllReduceSite::add2)
    throw ArgumentError(std::string(op) + ": site must be add or add2");
  validate_all_reduce(ar, require_outputs, read_data);
  validate(AttnResOp::attn_res_add_rmsnorm, attn, require_outputs);
  check_site_addend(op, ar, site, attn);
  check_site_aliasing(op, ar, site, attn);
  SitePlans s;
  s.ar = plan_all_reduce(ar, ar_options);
  if (!s.ar.accepted()) return s;
  s.attn = plan(AttnResOp::attn_res_add_rmsnorm, attn, attn_options);
  if (!s.attn.accepted()) s.ar = declined("attn_res_add_rmsnorm: " + s.attn.decline);
  return s;
}

}  // namespace

AllReducePlan plan_all_reduce_attn_res_add_rmsnorm(const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn,
                                                   const AllReduceOptions& ar_options, const Options& attn_options) {
  return plan_site("all_reduce_attn_res_add_rmsnorm", ar, site, attn, ar_options, attn_options,
                   /*require_outputs=*/false, /*read_data=*/false).ar;
}

void all_reduce_attn_res_add_rmsnorm(const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn,
                                     const AllReduceOptions& ar_options, const Options& attn_options) {
  const char* op = "all_reduce_attn_res_add_rmsnorm";
  const SitePlans s = plan_site(op, ar, site, attn, ar_options, attn_options, /*require_outputs=*/true,
                                /*read_data=*/true);
  if (!s.ar.accepted()) throw UnsupportedError(std::string(op) + ": " + s.ar.decline);
  launch_all_reduce(ar, s.ar);
  run(AttnResOp::attn_res_add_rmsnorm, attn, attn_options);
}

AllReducePlan plan_moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& a, const AllReduceOptions& o) {
  validate_moe_finalize_all_reduce(a, /*require_output=*/false, /*read_data=*/false);
  MoeFinalizeOptions fo;
  fo.pdl = o.pdl;
  fo.kernel = o.kernel;
  const MoeFinalizePlan fp = plan_moe_finalize(a.finalize, fo);
  if (!fp.accepted()) return declined("moe_finalize: " + fp.decline);
  const std::string why = device_decline(query_device(a.comm.device), a.comm.world_size, o);
  if (!why.empty()) return declined(why);
  AllReducePlan p = accepted_plan(query_device(a.comm.device), a.comm.width, o);
  p.threads = fp.threads;  // one block per token, moe_finalize's geometry (its norm's reduction order)
  p.blocks_per_token = 1;
  return p;
}

void moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& a, const AllReduceOptions& o) {
  validate_moe_finalize_all_reduce(a, /*require_output=*/true);
  const AllReducePlan p = plan_moe_finalize_all_reduce(a, o);
  if (!p.accepted()) throw UnsupportedError("moe_finalize_all_reduce: " + p.decline);
  switch (p.kernel) {
    case KernelKind::cpu:
      detail::cpu_moe_finalize_all_reduce(a);
      return;
#if ATTNRES_WITH_CUDA
    case KernelKind::single_cta: {
      MoeFinalizeOptions fo;
      fo.pdl = o.pdl;
      detail::cuda_moe_finalize_all_reduce(a, plan_moe_finalize(a.finalize, fo), p);
      return;
    }
#endif
    default:
      throw UnsupportedError(std::string("moe_finalize_all_reduce: kernel ") + kernel_name(p.kernel) +
                             " is not available in this build");
  }
}

}  // namespace attnres
