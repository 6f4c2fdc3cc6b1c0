// Design (a) of the fused all-reduce site: ONE kernel, the EXCHANGE instances of the per-token kernel
// (cuda/attn_res_per_token.cuh) for modes add and add2, bf16 output, single_cta / split_k. Each thread
// exchanges its vector of this rank's partial through the communicator (cuda/all_reduce_protocol.cuh) in place
// of loading the site's addend. Same launch geometry as the plain op's (cuda/attn_res_launch.cu).
#include <cuda_runtime.h>

#include "backend.hpp"
#include "cuda/attn_res_per_token.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"

namespace attnres::detail {

namespace {

using ExchangeKernelFn = void (*)(PerTokenExchangeParams);

template <bool CLUSTER>
ExchangeKernelFn by_site(AllReduceSite site, int max_candidates) {
  return site == AllReduceSite::add ? per_token_instance<Mode::add, CLUSTER, Fp8Mode::none, true>(max_candidates)
                                    : per_token_instance<Mode::add2, CLUSTER, Fp8Mode::none, true>(max_candidates);
}

}  // namespace

void cuda_all_reduce_attn_res(const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn, const Plan& plan) {
  const bool cluster = plan.kernel == KernelKind::split_k && plan.cluster > 1;
  const ExchangeKernelFn kernel =
      cluster ? by_site<true>(site, plan.max_candidates) : by_site<false>(site, plan.max_candidates);
  if (kernel == nullptr || attn.fp8 != Fp8Scales::none ||
      (plan.kernel != KernelKind::split_k && plan.kernel != KernelKind::single_cta))
    throw UnsupportedError("all_reduce_attn_res_add_rmsnorm: no one-kernel instance for the plan (kernel " +
                           std::string(kernel_name(plan.kernel)) + ", N bucket " +
                           std::to_string(plan.max_candidates) + ")");
  PerTokenExchangeParams p{};
  static_cast<PerTokenParams&>(p) = make_per_token_params(attn, plan);
  const int64_t T = attn.layer_residual.shape[0];
  p.x = make_exchange(ar.comm, T, static_cast<uint32_t>(T * plan.cluster));
  p.partial = tensor_ptr<const __nv_bfloat16>(ar.input);
  p.partial_stride = ar.input.strides[0];
  p.reduced = tensor_ptr<__nv_bfloat16>(ar.output);
  p.reduced_stride = ar.output.strides[0];
  DeviceGuard guard(attn.layer_residual.device.index);

  launch_kernel(kernel, p, dim3(static_cast<unsigned>(T) * static_cast<unsigned>(plan.cluster)),
                dim3(static_cast<unsigned>(plan.threads)), 0, static_cast<cudaStream_t>(attn.stream),
                cluster ? plan.cluster : 1, plan.pdl, "all_reduce_attn_res_add_rmsnorm (one kernel) launch");
}

}  // namespace attnres::detail
