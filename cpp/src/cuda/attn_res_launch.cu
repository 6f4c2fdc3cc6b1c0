// Launcher of the per-token kernels: maps validated arguments and the plan onto one kernel instance and
// launches it on the caller's stream with cudaLaunchKernelEx (cluster dimension for split_k, the PDL
// attribute when enabled). No allocation, no synchronisation, configuration from shapes only: capturable
// in CUDA graphs.
#include <cuda_runtime.h>

#include "backend.hpp"
#include "cuda/attn_res_per_token.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"
#include "layout.hpp"

namespace attnres::detail {

namespace {

using KernelFn = void (*)(PerTokenParams);

template <Mode M, bool CLUSTER, Fp8Mode F>
KernelFn by_bucket(int max_candidates) {
  // The buckets of plan_tuning.hpp. single_cta is planned for N <= 4 only (a 1024-thread block has 64
  // registers per thread; the N <= 8 instance spilled 160 bytes); the CLUSTER = false instances of the larger
  // buckets serve split_k's one-block clusters (<= 256 threads, kMaxThreadsOf).
  // One case per entry of kCandidateBuckets (attnres/limits.hpp): a bucket added there without an instance
  // here fails the static_assert.
  static_assert(kNumCandidateBuckets == 5, "one case per candidate bucket");
  switch (max_candidates) {
    case kCandidateBuckets[0]: return attn_res_per_token_kernel<kCandidateBuckets[0], M, CLUSTER, F>;
    case kCandidateBuckets[1]: return attn_res_per_token_kernel<kCandidateBuckets[1], M, CLUSTER, F>;
    case kCandidateBuckets[2]: return attn_res_per_token_kernel<kCandidateBuckets[2], M, CLUSTER, F>;
    case kCandidateBuckets[3]: return attn_res_per_token_kernel<kCandidateBuckets[3], M, CLUSTER, F>;
    case kCandidateBuckets[4]: return attn_res_per_token_kernel<kCandidateBuckets[4], M, CLUSTER, F>;
    default: return nullptr;
  }
}

template <bool CLUSTER, Fp8Mode F>
KernelFn by_mode(Mode mode, int max_candidates) {
  switch (mode) {
    case Mode::mix:
      if constexpr (F == Fp8Mode::none) return by_bucket<Mode::mix, CLUSTER, F>(max_candidates);
      return nullptr;  // attn_res has no normed output (validated)
    case Mode::norm: return by_bucket<Mode::norm, CLUSTER, F>(max_candidates);
    case Mode::add: return by_bucket<Mode::add, CLUSTER, F>(max_candidates);
    case Mode::add2: return by_bucket<Mode::add2, CLUSTER, F>(max_candidates);
  }
  return nullptr;
}

template <bool CLUSTER>
KernelFn by_fp8(Fp8Scales fp8, Mode mode, int max_candidates) {
  switch (fp8) {
    case Fp8Scales::none: return by_mode<CLUSTER, Fp8Mode::none>(mode, max_candidates);
    case Fp8Scales::per_token: return by_mode<CLUSTER, Fp8Mode::per_token>(mode, max_candidates);
    case Fp8Scales::block128: return by_mode<CLUSTER, Fp8Mode::block128>(mode, max_candidates);
  }
  return nullptr;
}

}  // namespace

PerTokenParams make_per_token_params(const AttnResArgs& a, const Plan& plan) {
  PerTokenParams p{};
  const int64_t H = a.layer_residual.shape[1];
  p.layer_residual = tensor_ptr<const __nv_bfloat16>(a.layer_residual);
  p.add = tensor_ptr<const __nv_bfloat16>(a.layer_residual_add);
  p.add2 = tensor_ptr<const __nv_bfloat16>(a.layer_residual_add2);
  p.bank = tensor_ptr<const __nv_bfloat16>(a.block_residual);
  p.res_weight = tensor_ptr<const __nv_bfloat16>(a.res_weight);
  p.rms_weight = tensor_ptr<const __nv_bfloat16>(a.rms_weight);
  p.norm_weight = tensor_ptr<const __nv_bfloat16>(a.norm_weight);
  p.output = tensor_ptr<__nv_bfloat16>(a.output);
  p.updated = tensor_ptr<__nv_bfloat16>(a.updated);
  p.mixture = tensor_ptr<__nv_bfloat16>(a.mixture);
  if (a.snapshot_slot >= 0) p.snapshot = tensor_ptr<__nv_bfloat16>(snapshot_rows(a.block_residual, a.snapshot_slot));
  p.rsigma = tensor_ptr<float>(a.rsigma);
  p.probs = tensor_ptr<float>(a.probs);
  p.logits = tensor_ptr<float>(a.logits);
  p.lr_stride = a.layer_residual.strides[0];
  p.add_stride = a.layer_residual_add.present() ? a.layer_residual_add.strides[0] : 0;
  p.add2_stride = a.layer_residual_add2.present() ? a.layer_residual_add2.strides[0] : 0;
  p.bank_snapshot_stride = a.block_residual.strides[0];
  p.bank_token_stride = a.block_residual.strides[1];
  p.output_stride = a.output.strides[0];
  p.updated_stride = a.updated.present() ? a.updated.strides[0] : 0;
  p.mixture_stride = a.mixture.present() ? a.mixture.strides[0] : 0;
  for (int i = 0; i < 2; ++i) {
    p.rsigma_stride[i] = a.rsigma.present() ? a.rsigma.strides[i] : 0;
    p.probs_stride[i] = a.probs.present() ? a.probs.strides[i] : 0;
    p.logits_stride[i] = a.logits.present() ? a.logits.strides[i] : 0;
  }
  p.tokens = static_cast<int32_t>(a.layer_residual.shape[0]);
  p.snapshots = static_cast<int32_t>(a.block_residual.shape[0]);
  p.vectors = static_cast<int32_t>(H / 8);
  // A cluster: each block's share. One block (single_cta, split_k at a cluster of one): split_k's chunk, laid out
  // once per kChunkThreads threads, so the block reduces in split_k's order (plan.cpp one_block_threads).
  p.chunk = plan.cluster > 1 ? (p.vectors + plan.cluster - 1) / plan.cluster : tuning::split_k_chunk(H);
  p.inv_hidden = static_cast<float>(1.0 / static_cast<double>(H));
  p.rms_eps = static_cast<float>(a.rms_eps);
  p.norm_eps = static_cast<float>(a.norm_eps);
  if (a.fp8 != Fp8Scales::none) {
    p.output_fp8 = tensor_ptr<uint8_t>(a.output_fp8);
    p.fp8_scales = tensor_ptr<float>(a.fp8_scales);
    p.output_fp8_stride = a.output_fp8.strides[0];
    p.fp8_scales_stride[0] = a.fp8_scales.strides[0];
    p.fp8_scales_stride[1] = a.fp8_scales.strides[1];
    p.fp8_pow2 = a.fp8_pow2_scales ? 1 : 0;
  }
  return p;
}

namespace {

Mode mode_of(AttnResOp op, const AttnResArgs& a) {
  if (op == AttnResOp::attn_res) return Mode::mix;
  if (!a.layer_residual_add.present()) return Mode::norm;
  return a.layer_residual_add2.present() ? Mode::add2 : Mode::add;
}

}  // namespace

void cuda_attn_res(AttnResOp op, const AttnResArgs& a, const Plan& plan) {
  // split_k with a one-block cluster (H <= 1024) runs the instance without the cluster exchange.
  const bool cluster = plan.kernel == KernelKind::split_k && plan.cluster > 1;
  const KernelFn kernel = cluster ? by_fp8<true>(a.fp8, mode_of(op, a), plan.max_candidates)
                                  : by_fp8<false>(a.fp8, mode_of(op, a), plan.max_candidates);
  if (kernel == nullptr)
    throw UnsupportedError(std::string(op_name(op)) + ": no kernel instance for the plan (kernel " +
                           kernel_name(plan.kernel) + ", N bucket " + std::to_string(plan.max_candidates) + ")");
  const PerTokenParams params = make_per_token_params(a, plan);
  DeviceGuard guard(a.layer_residual.device.index);

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
  config.gridDim = dim3(static_cast<unsigned>(params.tokens) * static_cast<unsigned>(plan.cluster), 1, 1);
  config.blockDim = dim3(static_cast<unsigned>(plan.threads), 1, 1);
  config.dynamicSmemBytes = 0;
  config.stream = static_cast<cudaStream_t>(a.stream);
  config.attrs = attrs;
  config.numAttrs = n_attrs;
  cuda_check(cudaLaunchKernelEx(&config, kernel, params), "attn_res kernel launch");
}

}  // namespace attnres::detail
