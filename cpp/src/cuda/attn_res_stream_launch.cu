// Launcher of the streaming single_cta (cuda/attn_res_stream.cuh): as many blocks as are resident on the device
// (never more than T), each looping over the tokens blockIdx.x, + gridDim.x, ... with the next token's rows
// prefetched into the plan's shared memory. No allocation, no synchronisation: capturable in CUDA graphs.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backend.hpp"
#include "cuda/attn_res_stream.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"

namespace attnres::detail {

namespace {

using KernelFn = void (*)(PerTokenParams);

KernelFn stream_by_mode(Mode mode, int max_candidates, int buffers) {
  switch (mode) {
    case Mode::mix: return stream_instance<Mode::mix>(max_candidates, buffers);
    case Mode::norm: return stream_instance<Mode::norm>(max_candidates, buffers);
    case Mode::add: return stream_instance<Mode::add>(max_candidates, buffers);
    case Mode::add2: return stream_instance<Mode::add2>(max_candidates, buffers);
    case Mode::mix_add: return stream_instance<Mode::mix_add>(max_candidates, buffers);
    case Mode::mix_add2: return stream_instance<Mode::mix_add2>(max_candidates, buffers);
  }
  return nullptr;
}

}  // namespace

void launch_attn_res_stream(AttnResOp op, const AttnResArgs& a, const Plan& plan) {
  const Mode mode = mode_of(op, a);
  const KernelFn kernel = a.fp8 == Fp8Scales::none ? stream_by_mode(mode, plan.max_candidates, plan.slots)
                                                  : stream_fp8_instance(mode, a.fp8, plan.max_candidates, plan.slots);
  const PerTokenParams params = make_per_token_params(a, plan);
  // block128's groups must align with split_k's chunks (cuda/attn_res_stream.cuh, the FP8 epilogue).
  const bool groups_align = a.fp8 != Fp8Scales::block128 || params.chunk % 16 == 0;
  if (kernel == nullptr || !groups_align || plan.cluster != 1 || plan.vectors != kStreamVectors ||
      plan.threads > kStreamMaxThreads ||
      plan.smem_bytes != tuning::stream_smem_bytes(plan.max_candidates, mode_has_add(mode), mode_has_add2(mode),
                                                   plan.threads, plan.slots))
    throw UnsupportedError(std::string(op_name(op)) + ": no streaming single_cta instance for the plan (N bucket " +
                           std::to_string(plan.max_candidates) + ", fp8 = " + fp8_scales_name(a.fp8) + ", " +
                           std::to_string(plan.slots) + " token buffers, " +
                           std::to_string(plan.threads) + " threads, " +
                           std::to_string(plan.smem_bytes) + " bytes of shared memory)");
  const int device = a.layer_residual.device.index;
  DeviceGuard guard(device);
  const DeviceInfo dev = query_device(a.layer_residual.device);  // cached
  if (plan.smem_bytes > dev.shared_memory_per_block_optin)
    throw UnsupportedError(std::string(op_name(op)) + ": the plan's " + std::to_string(plan.smem_bytes) +
                           " bytes of shared memory exceed the device's " +
                           std::to_string(dev.shared_memory_per_block_optin));
  const void* fn = reinterpret_cast<const void*>(kernel);
  opt_into_shared_memory(fn, device, dev.shared_memory_per_block_optin, false,
                         "cudaFuncSetAttribute(streaming single_cta, shared memory)");
  const int resident = resident_blocks(fn, device, plan.threads, plan.smem_bytes,
                                       "cudaOccupancyMaxActiveBlocksPerMultiprocessor(streaming single_cta)");
  if (resident < 1)
    throw UnsupportedError(std::string(op_name(op)) + ": a streaming single_cta block of " +
                           std::to_string(plan.threads) + " threads and " + std::to_string(plan.smem_bytes) +
                           " bytes of shared memory does not fit an SM");
  const int64_t blocks = std::min<int64_t>(params.tokens, static_cast<int64_t>(std::max(dev.sm_count, 1)) * resident);
  launch_kernel(kernel, params, dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(plan.threads)),
                static_cast<size_t>(plan.smem_bytes), static_cast<cudaStream_t>(a.stream), 1, plan.pdl,
                "attn_res streaming kernel launch");
}

}  // namespace attnres::detail
