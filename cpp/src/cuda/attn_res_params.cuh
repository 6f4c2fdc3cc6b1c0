// Kernel parameters of the per-token attention-residual kernels (single_cta and split_k), built by the
// launcher from validated AttnResArgs and the plan. Strides are in elements; pointers are 16-byte aligned
// and token strides multiples of 8 elements (validated).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "attnres/attn_res.hpp"

namespace attnres::detail {

// What the kernel computes; a compile-time variant, so each instance carries only its own work.
enum class Mode : int {
  mix = 0,      // attn_res without an addend: mixture + fp32 diagnostics
  norm = 1,     // attn_res_rmsnorm: trailing norm, prefix read from layer_residual
  add = 2,      // attn_res_add_rmsnorm with one addend
  add2 = 3,     // attn_res_add_rmsnorm with two addends (the MoE-tail fold)
  mix_add = 4,  // attn_res with one addend: the mixture of the updated prefix, no trailing norm
  mix_add2 = 5, // attn_res with two addends
};

// The work a mode carries, as compile-time facts (each instance branches on none of them at run time).
constexpr bool mode_has_norm(Mode m) { return m == Mode::norm || m == Mode::add || m == Mode::add2; }
constexpr bool mode_has_add(Mode m) {
  return m == Mode::add || m == Mode::add2 || m == Mode::mix_add || m == Mode::mix_add2;
}
constexpr bool mode_has_add2(Mode m) { return m == Mode::add2 || m == Mode::mix_add2; }

struct PerTokenParams {
  const __nv_bfloat16* layer_residual;
  const __nv_bfloat16* add;
  const __nv_bfloat16* add2;
  const __nv_bfloat16* bank;
  const __nv_bfloat16* res_weight;
  const __nv_bfloat16* rms_weight;
  const __nv_bfloat16* norm_weight;
  __nv_bfloat16* output;    // nullptr: the FP8-only call (FP8 instances only)
  __nv_bfloat16* updated;   // nullptr: not requested
  __nv_bfloat16* mixture;   // nullptr: no tap
  __nv_bfloat16* snapshot;  // bank row `snapshot_slot` of token 0; nullptr: no snapshot write
  float* rsigma;            // nullptr: no diagnostics
  float* probs;
  float* logits;
  int64_t lr_stride, add_stride, add2_stride;  // token strides
  int64_t bank_snapshot_stride, bank_token_stride;
  int64_t output_stride, updated_stride, mixture_stride;
  int64_t rsigma_stride[2], probs_stride[2], logits_stride[2];  // [n, t]
  int32_t tokens;      // T
  int32_t snapshots;   // K (N = K + 1)
  int32_t vectors;     // H / 8
  int32_t chunk;       // vectors owned by one block of the cluster
  float inv_hidden;    // 1 / H (the mean as a product: no division, whose slow-path branch breaks ILP)
  float rms_eps, norm_eps;
  // FP8 epilogue (the Fp8Mode instances only): codes [T, H], scales [T, G] with strides {token, group}.
  uint8_t* output_fp8;
  float* fp8_scales;
  int64_t output_fp8_stride;
  int64_t fp8_scales_stride[2];
  int32_t fp8_pow2;  // 1: power-of-two scales
};

// The parameters of a validated per-token call under `plan` (cuda/attn_res_launch.cu).
PerTokenParams make_per_token_params(const AttnResArgs& args, const Plan& plan);

// The mode of a validated call.
inline Mode mode_of(AttnResOp op, const AttnResArgs& a) {
  const bool add = a.layer_residual_add.present(), add2 = a.layer_residual_add2.present();
  if (op == AttnResOp::attn_res) return !add ? Mode::mix : add2 ? Mode::mix_add2 : Mode::mix_add;
  if (!add) return Mode::norm;
  return add2 ? Mode::add2 : Mode::add;
}

// The per-token instance of attn_res with addends (modes mix_add, mix_add2; bf16 only) for split_k clusters
// (`cluster`) or one-block launches, N bucket `max_candidates`; nullptr for none. Its own translation unit
// (cuda/attn_res_mix_add_instances.cu), which builds alongside the other modes' (cuda/attn_res_launch.cu).
using PerTokenKernel = void (*)(PerTokenParams);
PerTokenKernel mix_add_instance(Mode mode, bool cluster, int max_candidates);

// Launches the streaming single_cta (plan.smem_bytes > 0) for a validated call (cuda/attn_res_stream_launch.cu).
void launch_attn_res_stream(AttnResOp op, const AttnResArgs& args, const Plan& plan);

// Launches the token-block single_cta (plan.route token_blocks) for a validated call (cuda/attn_res_blocks_launch.cu).
void launch_attn_res_blocks(AttnResOp op, const AttnResArgs& args, const Plan& plan);

}  // namespace attnres::detail
