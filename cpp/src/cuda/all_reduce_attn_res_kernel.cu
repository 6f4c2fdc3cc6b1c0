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

template <Mode M, bool CLUSTER>
ExchangeKernelFn by_bucket(int max_candidates) {
  static_assert(kNumCandidateBuckets == 5, "one case per candidate bucket");
  switch (max_candidates) {
    case kCandidateBuckets[0]: return attn_res_per_token_kernel<kCandidateBuckets[0], M, CLUSTER, Fp8Mode::none, true>;
    case kCandidateBuckets[1]: return attn_res_per_token_kernel<kCandidateBuckets[1], M, CLUSTER, Fp8Mode::none, true>;
    case kCandidateBuckets[2]: return attn_res_per_token_kernel<kCandidateBuckets[2], M, CLUSTER, Fp8Mode::none, true>;
    case kCandidateBuckets[3]: return attn_res_per_token_kernel<kCandidateBuckets[3], M, CLUSTER, Fp8Mode::none, true>;
    case kCandidateBuckets[4]: return attn_res_per_token_kernel<kCandidateBuckets[4], M, CLUSTER, Fp8Mode::none, true>;
    default: return nullptr;
  }
}

template <bool CLUSTER>
ExchangeKernelFn by_site(AllReduceSite site, int max_candidates) {
  return site == AllReduceSite::add ? by_bucket<Mode::add, CLUSTER>(max_candidates)
                                    : by_bucket<Mode::add2, CLUSTER>(max_candidates);
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

  cudaLaunchAttribute attrs[2];
  unsigned n_attrs = 0;
  if (cluster) {
    attrs[n_attrs].id = cudaLaunchAttributeClusterDimension;
    attrs[n_attrs].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
    attrs[n_attrs].val.clusterDim.y = 1;
    attrs[n_attrs].val.clusterDim.z = 1;
    ++n_attrs;
  }
  if (plan.pdl) {
    attrs[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++n_attrs;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(T) * static_cast<unsigned>(plan.cluster), 1, 1);
  config.blockDim = dim3(static_cast<unsigned>(plan.threads), 1, 1);
  config.dynamicSmemBytes = 0;
  config.stream = static_cast<cudaStream_t>(attn.stream);
  config.attrs = attrs;
  config.numAttrs = n_attrs;
  cuda_check(cudaLaunchKernelEx(&config, kernel, p), "all_reduce_attn_res_add_rmsnorm (one kernel) launch");
}

}  // namespace attnres::detail
