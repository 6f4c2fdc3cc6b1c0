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

// max |x| bits over the 8 bf16 values of `v` (the fp32 bit pattern of the bf16 magnitude): the magnitudes'
// maxima per 16-bit half (a tree of two-halfword maxima), then the larger half.
__device__ __forceinline__ uint32_t amax_bits8(uint4 v) {
  constexpr uint32_t kMagnitudes = 0x7fff7fffu;
  const uint32_t m =
      __vmaxu2(__vmaxu2(v.x & kMagnitudes, v.y & kMagnitudes), __vmaxu2(v.z & kMagnitudes, v.w & kMagnitudes));
  return max(m << 16, m & 0xffff0000u);
}

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }

// Max over aligned groups of 16 lanes (one 128-column group of 16 vectors; `lane` is the caller's lane): two
// whole-warp reductions, each over one half's values with the other half's as 0 (which changes no max), issued
// back to back; each lane takes its half's. The same bits as a butterfly of four shuffles, whose steps run one
// after the other on every thread's critical path (docs/performance.md).
__device__ __forceinline__ uint32_t half_warp_max_u32(uint32_t v, int lane) {
  const bool upper = lane >= 16;
  const uint32_t lower_max = __reduce_max_sync(0xffffffffu, upper ? 0u : v);
  const uint32_t upper_max = __reduce_max_sync(0xffffffffu, upper ? v : 0u);
  return upper ? upper_max : lower_max;
}

// x / s with IEEE division's codes, for the finite scales (exact: 1e-10 / 448 <= s <= FLT_MAX / 448, or powers of
// two 2^-42 .. 2^120: all normal) and the dividends of their groups (|x| <= amax): the fast path of CUDA's
// division (the reciprocal refined once, the product corrected once by its exact residual) without its
// per-quotient range check and slow-path call (FCHK), which made every division a branch region of its own; here
// `r` is computed once per scale and a thread's eight quotients issue together. The residual is taken as
// s * q0 - x and subtracted (the same value as adding x - s * q0), so a zero dividend keeps its sign (-0 / s = -0:
// q0 = -0, the residual +0, -r * +0 + -0 = -0) with no copysign. Checked on the GPU for every bf16 amax, both
// scale kinds and every bf16 dividend of its group (cpp/tests/test_fp8_quotient.cu, 2.1e9 pairs): the scales and
// the codes equal IEEE division's, and so does every quotient of magnitude >= 2^-24 (below that the codes are
// zero whatever the last bits).
//
// Non-finite scales need no branch or select per quotient: fp8_divisor makes {0, 0} of s = inf (rcp.approx(inf)
// is +0 and the refinement with s' = 0 keeps it) and {0, NaN} of a NaN, so the same three operations give
// x / inf = +-0 with x's sign (q0 = +-0, the residual -x, -0 * -x + q0), NaN for an infinite x (inf * 0), and NaN
// for every x when s is NaN. Every NaN the arithmetic makes is the canonical positive one.
struct Fp8Divisor {
  float s, r;
};
__device__ __forceinline__ Fp8Divisor fp8_divisor(float s) {
  const float finite_s = s <= 3.40282347e38f ? s : 0.0f;  // 0 for inf and NaN
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  return {finite_s, __fmaf_rn(r, __fmaf_rn(-finite_s, r, 1.0f), r)};
}
__device__ __forceinline__ float fp8_quotient(float x, Fp8Divisor d) {
  const float q0 = __fmul_rn(x, d.r);
  return __fmaf_rn(-d.r, __fmaf_rn(d.s, q0, -x), q0);
}

// s = max(amax, 1e-10) / 448 (IEEE division's bits), optionally rounded up to a power of two; NaN amax: NaN;
// an infinite amax: inf. Selects, no branches: the scale is on every thread's critical path, and so the divisor
// 448 comes as a constant: 0x1.24924ap-9 is 1 / 448 correctly rounded, with which the corrected quotient is
// correctly rounded (the residual correction of a correctly rounded reciprocal; checked for every amax).
__device__ __forceinline__ float fp8_scale(uint32_t amax_bits, bool pow2) {
  const float amax = __uint_as_float(amax_bits);
  // fmaxf(NaN, 1e-10) is 1e-10: a finite quotient, replaced below.
  const float q = fp8_quotient(fmaxf(amax, 1e-10f), Fp8Divisor{448.0f, 0x1.24924ap-9f});
  const bool finite = amax_bits < 0x7f800000u;
  const float s = finite ? q : (amax_bits == 0x7f800000u ? amax : __uint_as_float(0x7fc00000u));
  const uint32_t b = __float_as_uint(s);
  // A power of two, inf and NaN stay; a finite s with a mantissa moves up to the next power of two (s <= FLT_MAX /
  // 448: never overflows).
  return pow2 && finite && (b & 0x007fffffu) != 0 ? __uint_as_float((b & 0x7f800000u) + 0x00800000u) : s;
}

// Two values to e4m3, round to nearest even: `lo` in the low byte. satfinite is the contract's clamp to
// [-448, 448] (a magnitude above 448 rounds to 448 or past the largest code, which satfinite makes 448), and it
// makes the canonical NaN (the only one fp8_quotient gives) 0x7F, the contract's one NaN code.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

// The 8 codes of the 8 bf16 values of `v` with scale s, as one 8-byte word (element 0 in the lowest byte):
// e4m3(clamp(x / s)), for every scale fp8_scale makes (finite, exact or a power of two: IEEE division; inf: +-0,
// NaN for an infinite x; NaN: NaN), by one path of three operations per value (fp8_divisor, fp8_quotient), with
// no per-value selects for the non-finite scales nor fixups after the conversion (docs/performance.md).
__device__ __forceinline__ uint2 fp8_codes8(uint4 v, float s) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  const Fp8Divisor d = fp8_divisor(s);
  uint32_t c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    c[i] = e4m3x2(fp8_quotient(__uint_as_float(w[i] << 16), d), fp8_quotient(__uint_as_float(w[i] & 0xffff0000u), d));
  return make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
}

}  // namespace attnres::detail
