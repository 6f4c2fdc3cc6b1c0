// The per-thread steps of the AttnRes contract (docs/ops/common.md) that the per-token kernel
// (attn_res_per_token.cuh), the streaming single_cta (attn_res_stream.cuh) and the persistent kernel
// (attn_res_persistent.cuh) compute with the same instructions, so that their bits agree: the prefix addition,
// the softmax's formulas over the candidates from the token's reduced sums (its scale, its N = 1 rule), attn_res's
// diagnostics, and the trailing norm's output of one 16-byte vector.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/attn_res_params.cuh"
#include "cuda/device_utils.cuh"

namespace attnres::detail {

// ops.md step 1: P = bf16(P + S) with S = add, or S = bf16(add + add2): PyTorch's prefix + (add + add2).
template <Mode MODE>
__device__ __forceinline__ uint4 add_to_prefix(uint4 prefix, uint4 add, uint4 add2) {
  float pf[8], s[8];
  unpack8(prefix, pf);
  unpack8(add, s);
  if constexpr (mode_has_add2(MODE)) {
    float s2[8];
    unpack8(add2, s2);
#pragma unroll
    for (int e = 0; e < 8; ++e) s[e] = round_bf16(add_rn_keep_subnormals(s[e], s2[e]));
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) pf[e] = add_rn_keep_subnormals(pf[e], s[e]);
  return pack8(pf);
}

// A candidate's RMS scale from its sum of squares: rsqrt(mean + eps), the mean a product with 1/H; its logit is
// rsigma * (its dot with q).
__device__ __forceinline__ float candidate_rsigma(float ss, float inv_hidden, float rms_eps) {
  return rsqrtf(fmaf(ss, inv_hidden, rms_eps));
}

// The softmax's normalisation of exp(logit - max): 1 / denom. N = 1: the denominator is exp(0) = 1 for a finite
// logit, so 1 is exact; for a non-finite logit it is NaN, and 0 * NaN would turn the zero probabilities of the
// padding into NaN, which a mixture would pick up. N >= 2: a NaN denominator makes every real probability NaN,
// and the mixture NaN, whatever the padding. So one select on the scale, not one per probability.
__device__ __forceinline__ float softmax_scale(int N, float denom) { return N == 1 ? 1.0f : 1.0f / denom; }

// N = 1: the mixture is P itself (ops.md step 6), also when its logit is not finite (rms_eps = 0 and a zero row:
// rsigma = inf, logit = inf * 0 = NaN): candidate n's probability `prob` becomes 1 for n = 0, 0 past it.
__device__ __forceinline__ float single_candidate_rule(int N, int n, float prob) {
  return N == 1 ? (n == 0 ? 1.0f : 0.0f) : prob;
}

// The softmax over the N candidates from the token's sums (totals: (sum of squares, dot with q) per candidate),
// computed identically by every thread. Branch-free over the bucket (n >= N gets logit -inf, probability 0) so
// the N chains overlap; rsqrt and exp are the MUFU approximations (<= 2 ulp near 0), the mean a product with 1/H.
template <int NMAX>
__device__ __forceinline__ void candidate_softmax(const float* totals, int N, float inv_hidden, float rms_eps,
                                                  float (&rsigma)[NMAX], float (&logit)[NMAX], float (&prob)[NMAX]) {
  float max_logit = -INFINITY;
#pragma unroll
  for (int n = 0; n < NMAX; ++n) {
    const float ss = n < N ? totals[2 * n] : 1.0f, dot = n < N ? totals[2 * n + 1] : 0.0f;
    rsigma[n] = candidate_rsigma(ss, inv_hidden, rms_eps);
    logit[n] = n < N ? rsigma[n] * dot : -INFINITY;
    max_logit = fmaxf(max_logit, logit[n]);
  }
  float denom = 0.0f;
#pragma unroll
  for (int n = 0; n < NMAX; ++n) {
    // Past N the probability is exp(-inf) = 0 by selecting the argument, not by exp(logit - max): with no
    // finite logit max stays -inf (fmaxf drops NaN) and exp(-inf + inf) would be NaN. The argument, not the
    // result, is selected so every exp is issued unconditionally: `n < N ? __expf(..) : 0` became a branch
    // around each MUFU.EX2, which serialised the exps (tools/sass_check.py checks every instance).
    prob[n] = __expf(n < N ? logit[n] - max_logit : -INFINITY);
    denom += prob[n];
  }
  const float inv_denom = softmax_scale(N, denom);
#pragma unroll
  for (int n = 0; n < NMAX; ++n) prob[n] *= inv_denom;
  prob[0] = single_candidate_rule(N, 0, prob[0]);  // prob[n >= 1] is already 0 for N = 1 (the bucket's padding)
}

// attn_res's fp32 diagnostics of `token`: candidate `n` (the calling thread's, < N) gets the values the mixture used.
template <int NMAX>
__device__ __forceinline__ void store_diagnostics(const PerTokenParams& p, int token, int n, const float (&rsigma)[NMAX],
                                                  const float (&logit)[NMAX], const float (&prob)[NMAX]) {
#pragma unroll
  for (int i = 0; i < NMAX; ++i)
    if (i == n) {
      p.rsigma[i * p.rsigma_stride[0] + token * p.rsigma_stride[1]] = rsigma[i];
      p.logits[i * p.logits_stride[0] + token * p.logits_stride[1]] = logit[i];
      p.probs[i * p.probs_stride[0] + token * p.probs_stride[1]] = prob[i];
    }
}

// The trailing RMSNorm's scale from the token's sum of squares of the bf16 mixture: r = rsqrt(mean + eps).
__device__ __forceinline__ float norm_scale(float total, float inv_hidden, float norm_eps) {
  return rsqrtf(fmaf(total, inv_hidden, norm_eps));
}

// The trailing RMSNorm's output of one vector in Kimi's two-rounding order (ops.md step 7): the bf16 mixture
// `mix` times r, rounded, times the weight.
__device__ __forceinline__ uint4 rms_output8_scaled(const float (&mix)[8], float r, uint4 norm_w) {
  float w[8], o[8];
  unpack8(norm_w, w);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = round_bf16(mix[e] * r) * w[e];
  return pack8(o);
}

__device__ __forceinline__ uint4 rms_output8(const float (&mix)[8], float total, float inv_hidden, float norm_eps,
                                             uint4 norm_w) {
  return rms_output8_scaled(mix, norm_scale(total, inv_hidden, norm_eps), norm_w);
}

}  // namespace attnres::detail
