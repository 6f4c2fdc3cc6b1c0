// Launcher of the per-token kernels: maps validated arguments and the plan onto one kernel instance and
// launches it on the caller's stream with cudaLaunchKernelEx (cluster dimension for split_k, the PDL
// attribute when enabled). No allocation, no synchronisation, configuration from shapes only: capturable
// in CUDA graphs.
#include <cuda_runtime.h>

#include <algorithm>

#include "backend.hpp"
#include "cuda/attn_res_per_token.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"
#include "layout.hpp"

namespace attnres::detail {

namespace {

using KernelFn = PerTokenKernel;

// CLUSTER = false serves single_cta (planned for N <= 4: a 1024-thread block has 64 registers per thread, and the
// N <= 8 instance spilled 160 bytes) and split_k's one-block clusters (<= 256 threads, kMaxThreadsOf).
template <bool CLUSTER, Fp8Mode F>
KernelFn by_mode(Mode mode, int max_candidates) {
  switch (mode) {
    case Mode::mix:
      if constexpr (F == Fp8Mode::none) return per_token_instance<Mode::mix, CLUSTER, F>(max_candidates);
      return nullptr;  // attn_res has no normed output (validated)
    case Mode::norm: return per_token_instance<Mode::norm, CLUSTER, F>(max_candidates);
    case Mode::add: return per_token_instance<Mode::add, CLUSTER, F>(max_candidates);
    case Mode::add2: return per_token_instance<Mode::add2, CLUSTER, F>(max_candidates);
    case Mode::mix_add:
    case Mode::mix_add2:
      if constexpr (F == Fp8Mode::none) return mix_add_instance(mode, CLUSTER, max_candidates);
      return nullptr;  // attn_res has no normed output (validated)
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
  set_shared_params(p, a);
  // A cluster: each block's share. One block (single_cta, split_k at a cluster of one): split_k's chunk, laid out
  // once per kChunkThreads threads, so the block reduces in split_k's order (plan.cpp one_block_threads).
  p.chunk = plan.cluster > 1 ? (p.vectors + plan.cluster - 1) / plan.cluster : tuning::split_k_chunk(H);
  return p;
}


void cuda_attn_res(AttnResOp op, const AttnResArgs& a, const Plan& plan) {
  if (plan.route == Route::token_blocks) return launch_attn_res_blocks(op, a, plan);
  if (plan.kernel == KernelKind::single_cta && plan.smem_bytes > 0) return launch_attn_res_stream(op, a, plan);
  // split_k with a one-block cluster (H <= 1024) runs the instance without the cluster exchange.
  const bool cluster = plan.kernel == KernelKind::split_k && plan.cluster > 1;
  const KernelFn kernel = cluster ? by_fp8<true>(a.fp8, mode_of(op, a), plan.max_candidates)
                                  : by_fp8<false>(a.fp8, mode_of(op, a), plan.max_candidates);
  if (kernel == nullptr)
    throw UnsupportedError(std::string(op_name(op)) + ": no kernel instance for the plan (kernel " +
                           kernel_name(plan.kernel) + ", N bucket " + std::to_string(plan.max_candidates) + ")");
  const PerTokenParams params = make_per_token_params(a, plan);
  // An exact-N instance computes N = plan.max_candidates whatever the arguments hold: the two must agree.
  const int N = params.snapshots + 1;
  if (plan.max_candidates != (tuning::split_k_exact(cluster, N) ? N : tuning::candidate_bucket(N)))
    throw UnsupportedError(std::string(op_name(op)) + ": the plan's N instance " +
                           std::to_string(plan.max_candidates) + " does not fit the call's N = " + std::to_string(N));
  DeviceGuard guard(a.layer_residual.device.index);

  launch_kernel(kernel, params, dim3(static_cast<unsigned>(params.tokens) * static_cast<unsigned>(plan.cluster)),
                dim3(static_cast<unsigned>(plan.threads)), 0, static_cast<cudaStream_t>(a.stream),
                cluster ? plan.cluster : 1, plan.pdl, "attn_res kernel launch");
}

}  // namespace attnres::detail
