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

KernelFn blocks_bf16_instance(Mode mode, int max_candidates) {
  switch (mode) {
    case Mode::mix: return blocks_instance<Mode::mix>(max_candidates);
    case Mode::norm: return blocks_instance<Mode::norm>(max_candidates);
    case Mode::add: return blocks_instance<Mode::add>(max_candidates);
    case Mode::add2: return blocks_instance<Mode::add2>(max_candidates);
    case Mode::mix_add: return blocks_instance<Mode::mix_add>(max_candidates);
    case Mode::mix_add2: return blocks_instance<Mode::mix_add2>(max_candidates);
  }
  return nullptr;
}

}  // namespace

void launch_attn_res_blocks(AttnResOp op, const AttnResArgs& a, const Plan& plan) {
  const Mode mode = mode_of(op, a);
  const KernelFn kernel = a.fp8 == Fp8Scales::none ? blocks_bf16_instance(mode, plan.max_candidates)
                                                   : blocks_fp8_instance(mode, a.fp8, plan.max_candidates);
  const PerTokenParams params = make_per_token_params(a, plan);
  const int chunks = tuning::split_k_cluster(a.layer_residual.shape[1]);
  const int threads = (chunks + kBlocksVectors - 1) / kBlocksVectors * kChunkThreads;
  static_assert(kMaxClusterRanks <= 2 * kBlocksVectors, "two groups of 128 threads at most (kBlocksMaxThreads)");
  // block128's groups must be 16 aligned lanes: chunks of a multiple of 16 vectors (the plan's rule).
  const bool groups_aligned = a.fp8 != Fp8Scales::block128 || tuning::split_k_chunk(a.layer_residual.shape[1]) % 16 == 0;
  if (kernel == nullptr || !groups_aligned || plan.cluster != 1 || plan.vectors != kBlocksVectors ||
      plan.threads != threads || plan.smem_bytes != 0 ||
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
