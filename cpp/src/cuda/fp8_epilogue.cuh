// The FP8 (e4m3fn) epilogue's per-thread arithmetic, bit-exact with the CPU backend (cpu/fp8.hpp) and the
// contract of docs/ops/attn_res_rmsnorm.md ("FP8 output"). Each thread holds 8 consecutive bf16 outputs; the
// group's amax is the max of |x|'s bit patterns (an integer max: exact, order-independent, NaN-propagating),
// reduced by the kernel over the group's threads.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace attnres::detail {

// The FP8 variant of a kernel instance (compile time; attn_res.hpp Fp8Scales without `none` at run time).
enum class Fp8Mode : int { none = 0, per_token = 1, block128 = 2 };

// max |x| bits over the 8 bf16 values of `v` (the fp32 bit pattern of the bf16 magnitude).
__device__ __forceinline__ uint32_t amax_bits8(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m = max(m, (w[i] & 0x7fffu) << 16);
    m = max(m, (w[i] >> 16 & 0x7fffu) << 16);
  }
  return m;
}

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }

// Max over aligned groups of 16 lanes (one 128-column group of 16 vectors).
__device__ __forceinline__ uint32_t half_warp_max_u32(uint32_t v) {
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// x / s with IEEE division's codes, for the finite scales (s normal: 1e-10 / 448 <= s <= FLT_MAX / 448) and the
// dividends of their groups (|x| <= amax): the fast path of CUDA's division (the reciprocal refined once, the
// product corrected once by its exact residual, the sign the dividend's) without its per-quotient range check
// and slow-path call (FCHK). With the check every division was a branch region of its own and a thread's eight
// ran one after the other; here `r` is computed once per scale and the quotients issue together. Checked on
// the GPU for every bf16 amax and every bf16 dividend of its group (cpp/tests/test_fp8_quotient.cu, 1.07e9
// pairs): the scales and the codes equal IEEE division's, and so does every quotient of magnitude >= 2^-24
// (below that the codes are zero whatever the last bits). On the H200 the FP8 add2 op at T = 1, N = 9 lost
// 0.13-0.15 us (bench_results/h200_3ff09db_fp8_div_ab.txt).
struct Fp8Divisor {
  float s, r;
};
__device__ __forceinline__ Fp8Divisor fp8_divisor(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  return {s, __fmaf_rn(r, __fmaf_rn(-s, r, 1.0f), r)};
}
__device__ __forceinline__ float fp8_quotient(float x, Fp8Divisor d) {
  const float q0 = __fmul_rn(x, d.r);
  return copysignf(__fmaf_rn(d.r, __fmaf_rn(-d.s, q0, x), q0), x);
}

// s = max(amax, 1e-10) / 448 (IEEE division's bits), optionally rounded up to a power of two; NaN amax: NaN;
// an infinite amax: inf.
__device__ __forceinline__ float fp8_scale(uint32_t amax_bits, bool pow2) {
  if (amax_bits > 0x7f800000u) return __uint_as_float(0x7fc00000u);
  const float amax = __uint_as_float(amax_bits);
  const float s =
      amax_bits == 0x7f800000u ? amax : fp8_quotient(amax > 1e-10f ? amax : 1e-10f, fp8_divisor(448.0f));
  if (!pow2) return s;
  const uint32_t b = __float_as_uint(s);
  return (b & 0x007fffffu) == 0 ? s : __uint_as_float((b & 0x7f800000u) + 0x00800000u);
}

// clamp(v, -448, 448) with NaN kept (the comparisons are false for NaN).
__device__ __forceinline__ float fp8_clamp(float v) { return v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v); }

// Two values to e4m3, round to nearest even: `lo` in the low byte. The inputs are already clamped, so
// satfinite never saturates a finite value; NaN codes are made 0x7F (the contract's one NaN code).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  uint32_t r = d;
  if (lo != lo) r = (r & 0xff00u) | 0x7fu;
  if (hi != hi) r = (r & 0x00ffu) | 0x7f00u;
  return r;
}

// The 8 codes of the 8 bf16 values of `v` with scale s, as one 8-byte word (element 0 in the lowest byte):
// e4m3(clamp(x / s)). POW2 (s a power of two, inf or NaN: fp8_scale): x * (1 / s), with 1 / s exact (2^-k, a
// normal number for the scales' range 2^-42 .. 2^120, 0 for s = inf), the one rounding of the same exact value
// x * 2^-k as the division (the same bits, NaN and signed zeros included). Otherwise a finite scale divides by
// fp8_quotient, an inf or NaN one by IEEE division.
template <bool POW2>
__device__ __forceinline__ uint2 fp8_codes8(uint4 v, float s) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float x[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
  float q[8];
  if (POW2) {
    const float inv_s = __frcp_rn(s);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = x[e] * inv_s;
  } else if (s <= 3.40282347e38f) {  // finite (false for NaN)
    const Fp8Divisor d = fp8_divisor(s);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = fp8_quotient(x[e], d);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = __fdiv_rn(x[e], s);
  }
  uint32_t c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] = e4m3x2(fp8_clamp(q[2 * i]), fp8_clamp(q[2 * i + 1]));
  return make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
}
// fp8_codes8 for the launch's scales (pow2: fp8_scale's power-of-two rounding).
__device__ __forceinline__ uint2 fp8_codes8(uint4 v, float s, bool pow2) {
  return pow2 ? fp8_codes8<true>(v, s) : fp8_codes8<false>(v, s);
}

}  // namespace attnres::detail
