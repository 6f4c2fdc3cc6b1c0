// Launcher of the token-block single_cta (cuda/attn_res_blocks.cuh): one block per token, the plan's
// geometry checked against the instance. No allocation, no synchronisation: capturable in CUDA graphs.
#include <cuda_runtime.h>

#include <string>

#include "backend.hpp"
#include "cuda/attn_res_blocks.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"

namespace attnres::detail {

namespace {

using KernelFn = void (*)(PerTokenParams);

template <int NMAX>
KernelFn blocks_by_mode(Mode mode) {
  constexpr int B = tuning::token_blocks_per_sm(NMAX);
  switch (mode) {
    case Mode::mix: return attn_res_blocks_kernel<NMAX, Mode::mix, B>;
    case Mode::norm: return attn_res_blocks_kernel<NMAX, Mode::norm, B>;
    case Mode::add: return attn_res_blocks_kernel<NMAX, Mode::add, B>;
    case Mode::add2: return attn_res_blocks_kernel<NMAX, Mode::add2, B>;
    case Mode::mix_add: return attn_res_blocks_kernel<NMAX, Mode::mix_add, B>;
    case Mode::mix_add2: return attn_res_blocks_kernel<NMAX, Mode::mix_add2, B>;
  }
  return nullptr;
}

// single_cta's buckets (N <= 2, N <= 4) and the exact N = 3 instance (Options::token_blocks_exact_n).
KernelFn blocks_instance(int max_candidates, Mode mode) {
  static_assert(kCandidateBuckets[0] == 2 && kCandidateBuckets[1] == kSingleCtaMaxCandidates, "single_cta's buckets");
  if (max_candidates == kCandidateBuckets[0]) return blocks_by_mode<kCandidateBuckets[0]>(mode);
  if (max_candidates == tuning::kTokenBlocksExactCandidates)
    return blocks_by_mode<tuning::kTokenBlocksExactCandidates>(mode);
  if (max_candidates == kCandidateBuckets[1]) return blocks_by_mode<kCandidateBuckets[1]>(mode);
  return nullptr;
}

}  // namespace

void launch_attn_res_blocks(AttnResOp op, const AttnResArgs& a, const Plan& plan) {
  const KernelFn kernel = a.fp8 == Fp8Scales::none ? blocks_instance(plan.max_candidates, mode_of(op, a)) : nullptr;
  const PerTokenParams params = make_per_token_params(a, plan);
  const int chunks = tuning::split_k_cluster(a.layer_residual.shape[1]);
  const int threads = (chunks + kBlocksVectors - 1) / kBlocksVectors * kChunkThreads;
  static_assert(kMaxClusterRanks <= 2 * kBlocksVectors, "two groups of 128 threads at most (kBlocksMaxThreads)");
  if (kernel == nullptr || plan.cluster != 1 || plan.vectors != kBlocksVectors || plan.threads != threads ||
      plan.smem_bytes != 0 ||
      plan.blocks_per_sm != tuning::token_blocks_per_sm(plan.max_candidates))
    throw UnsupportedError(std::string(op_name(op)) + ": no token-block single_cta instance for the plan (N bucket " +
                           std::to_string(plan.max_candidates) + ", fp8 = " + fp8_scales_name(a.fp8) + ", " +
                           std::to_string(plan.threads) + " threads, " + std::to_string(plan.vectors) +
                           " vectors per thread)");
  DeviceGuard guard(a.layer_residual.device.index);
  launch_kernel(kernel, params, dim3(static_cast<unsigned>(params.tokens)), dim3(static_cast<unsigned>(plan.threads)),
                0, static_cast<cudaStream_t>(a.stream), 1, plan.pdl, "attn_res token-block kernel launch");
}

}  // namespace attnres::detail
