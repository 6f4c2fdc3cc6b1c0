// Launcher of the persistent kernel: maps validated arguments and the plan (ring depth, passes, consumer
// threads, vector bucket, grid) onto one kernel instance and launches it on the caller's stream with
// cudaLaunchKernelEx (the PDL attribute when enabled). No allocation, no synchronisation, configuration
// from shapes and the device only: capturable in CUDA graphs.
#include <cuda_runtime.h>

#include "backend.hpp"
#include "cuda/attn_res_persistent.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"
#include "layout.hpp"
#include "persistent_layout.hpp"

namespace attnres::detail {

namespace {

template <Fp8Mode F, int BLOCKS_PER_SM = 1>
PersistentKernel by_adds(int adds, int vectors) {
  switch (adds) {
    case 0: return persistent_instance<0, F, BLOCKS_PER_SM, true>(vectors);
    case 1: return persistent_instance<1, F, BLOCKS_PER_SM, true>(vectors);
    case 2: return persistent_instance<2, F, BLOCKS_PER_SM, true>(vectors);
    default: return nullptr;
  }
}

// `norm`: attn_res_rmsnorm / attn_res_add_rmsnorm (and the persistent op); else attn_res, whose instances have no
// FP8 epilogue (the plan declines FP8 without a norm before any kernel is chosen).
template <int BLOCKS_PER_SM>
PersistentKernel by_fp8(Fp8Scales fp8, int adds, int vectors) {
  switch (fp8) {
    case Fp8Scales::none: return by_adds<Fp8Mode::none, BLOCKS_PER_SM>(adds, vectors);
    case Fp8Scales::per_token: return by_adds<Fp8Mode::per_token, BLOCKS_PER_SM>(adds, vectors);
    case Fp8Scales::block128: return by_adds<Fp8Mode::block128, BLOCKS_PER_SM>(adds, vectors);
  }
  return nullptr;
}

// adds: the call's addends, 0, 1 or 2.
PersistentKernel select_kernel(bool norm, Fp8Scales fp8, int adds, int vectors, int blocks_per_sm) {
  if (!norm) return fp8 == Fp8Scales::none ? persistent_mix_instance(adds, vectors, blocks_per_sm) : nullptr;
  if (blocks_per_sm == 1) return by_fp8<1>(fp8, adds, vectors);
  if (blocks_per_sm == 2) return by_fp8<2>(fp8, adds, vectors);
  return nullptr;
}

int addends(const AttnResArgs& a) {
  return (a.layer_residual_add.present() ? 1 : 0) + (a.layer_residual_add2.present() ? 1 : 0);
}

// The blocks of the plan's geometry resident per SM, after opting `kernel` into the device's shared memory (two
// blocks per SM also ask for the largest carveout).
int persistent_resident(PersistentKernel kernel, int device, int optin, const Plan& plan) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  opt_into_shared_memory(fn, device, optin, plan.blocks_per_sm > 1,
                         "cudaFuncSetAttribute(persistent kernel, shared memory)");
  return resident_blocks(fn, device, plan.threads, plan.smem_bytes,
                         "cudaOccupancyMaxActiveBlocksPerMultiprocessor(persistent kernel)");
}

}  // namespace

int cuda_attn_res_persistent_resident(AttnResOp op, const AttnResArgs& a, const Plan& plan) {
  const PersistentKernel kernel =
      select_kernel(op != AttnResOp::attn_res, a.fp8, addends(a), plan.vectors, plan.blocks_per_sm);
  if (kernel == nullptr) return 0;
  const int device = a.layer_residual.device.index;
  DeviceGuard guard(device);
  const int optin = query_device(a.layer_residual.device).shared_memory_per_block_optin;  // cached
  return persistent_resident(kernel, device, optin, plan);
}

void cuda_attn_res_persistent(AttnResOp op, const AttnResArgs& a, const Plan& plan) {
  const int adds = addends(a);
  const PersistentKernel kernel = select_kernel(op != AttnResOp::attn_res, a.fp8, adds, plan.vectors, plan.blocks_per_sm);
  const int64_t H = a.layer_residual.shape[1];
  const int64_t N = a.block_residual.shape[0] + 1;  // the header's size depends on it (persistent_layout.hpp)
  const int32_t consumers = plan.threads - persistent::kProducerThreads;
  // The plan and the kernel must agree on the layout; anything else is a bug, refused before launching.
  if (kernel == nullptr || (adds == 2 && !a.layer_residual_add.present()) || plan.slots < 1 || plan.passes < 1 ||
      plan.passes > 2 || plan.blocks < 1 || consumers % 32 != 0 || consumers < 32 ||
      consumers > persistent::kMaxConsumerWarps * 32 || consumers != persistent::consumer_threads(H) ||
      (plan.blocks_per_sm > 1 && plan.threads > persistent::kTwoBlocksMaxThreads) ||
      plan.vectors != persistent::vectors_per_thread(H) ||
      plan.smem_bytes != persistent::smem_bytes(plan.slots, N, H))
    throw UnsupportedError(std::string(op_name(op)) + ": no persistent kernel instance for the plan (vectors " +
                           std::to_string(plan.vectors) + ", threads " + std::to_string(plan.threads) +
                           ", blocks per SM " + std::to_string(plan.blocks_per_sm) +
                           ", slots " + std::to_string(plan.slots) + ", passes " + std::to_string(plan.passes) + ")");

  PersistentParams p{};
  p.layer_residual = tensor_ptr<const __nv_bfloat16>(a.layer_residual);
  p.add = tensor_ptr<const __nv_bfloat16>(a.layer_residual_add);
  p.add2 = tensor_ptr<const __nv_bfloat16>(a.layer_residual_add2);
  p.bank = tensor_ptr<const __nv_bfloat16>(a.block_residual);
  p.res_weight = tensor_ptr<const __nv_bfloat16>(a.res_weight);
  p.rms_weight = tensor_ptr<const __nv_bfloat16>(a.rms_weight);
  p.norm_weight = tensor_ptr<const __nv_bfloat16>(a.norm_weight);
  p.output = tensor_ptr<__nv_bfloat16>(a.output);
  p.updated = tensor_ptr<__nv_bfloat16>(a.updated);
  // The snapshot row of token 0 (validated: snapshot_slot >= K and inside the bank's storage); the kernel adds
  // the bank's token stride per token.
  if (a.snapshot_slot >= 0) p.snapshot = tensor_ptr<__nv_bfloat16>(snapshot_rows(a.block_residual, a.snapshot_slot));
  p.lr_stride = a.layer_residual.strides[0];
  p.add_stride = a.layer_residual_add.present() ? a.layer_residual_add.strides[0] : 0;
  p.add2_stride = a.layer_residual_add2.present() ? a.layer_residual_add2.strides[0] : 0;
  p.bank_snapshot_stride = a.block_residual.strides[0];
  p.bank_token_stride = a.block_residual.strides[1];
  p.output_stride = a.output.strides[0];
  p.updated_stride = a.updated.present() ? a.updated.strides[0] : 0;
  set_shared_params(p, a);
  p.consumers = consumers;
  p.chunks = tuning::split_k_cluster(H);
  p.chunk = tuning::split_k_chunk(H);
  p.warps_per_chunk = persistent::warps_per_chunk(H);
  // split_k's N bucket (plan_tuning.hpp candidate_bucket): it mixes rows past N when the bucket is larger.
  p.mix_pad = tuning::candidate_bucket(p.snapshots + 1) > p.snapshots + 1 ? 1 : 0;
  p.slots = plan.slots;
  p.passes = plan.passes;
  p.row_bytes = static_cast<uint32_t>(2 * H);
  p.slot_bytes = static_cast<uint32_t>(persistent::slot_bytes(H));
  p.mix_squares_offset = static_cast<uint32_t>(persistent::mix_squares_offset(N, H));
  p.barriers_offset = static_cast<uint32_t>(persistent::barriers_offset(N, H));
  p.norm_weight_offset = static_cast<uint32_t>(persistent::norm_weight_offset(plan.slots, N, H));
  p.ring_offset = static_cast<uint32_t>(persistent::ring_offset(plan.slots, N, H));

  const int device = a.layer_residual.device.index;
  DeviceGuard guard(device);
  const int optin = query_device(a.layer_residual.device).shared_memory_per_block_optin;  // cached
  if (plan.smem_bytes > optin)
    throw UnsupportedError(std::string(op_name(op)) + ": the plan's " + std::to_string(plan.smem_bytes) +
                           " bytes of shared memory exceed the device's " + std::to_string(optin));
  // Two blocks per SM only help if both are resident: a plan for two that the instance cannot honour (registers,
  // shared memory) is refused instead of silently running one block per SM. run() replans an automatic
  // geometry with one block per SM before it gets here (cuda_attn_res_persistent_resident); a forced one is
  // refused.
  const int blocks = persistent_resident(kernel, device, optin, plan);
  if (plan.blocks_per_sm > 1 && blocks < plan.blocks_per_sm)
    throw UnsupportedError(std::string(op_name(op)) + ": the plan's " + std::to_string(plan.blocks_per_sm) +
                           " blocks per SM are not resident (" + std::to_string(blocks) + " block(s) of " +
                           std::to_string(plan.threads) + " threads and " + std::to_string(plan.smem_bytes) +
                           " bytes of shared memory fit an SM)");

  launch_kernel(kernel, p, dim3(static_cast<unsigned>(plan.blocks)), dim3(static_cast<unsigned>(plan.threads)),
                static_cast<size_t>(plan.smem_bytes), static_cast<cudaStream_t>(a.stream), 1, plan.pdl,
                "attn_res persistent kernel launch");
}

}  // namespace attnres::detail
