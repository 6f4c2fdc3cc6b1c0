// FP8 (e4m3fn) quantization on the host, bit-exact with the CUDA epilogue (cuda/fp8_epilogue.cuh) and the
// contract of docs/ops/attn_res_rmsnorm.md ("FP8 output"):
//
//   amax = max |x| over the group, NaN-propagating (|x| compared as unsigned bit patterns: NaN > inf > finite)
//   s    = max(amax, 1e-10f) / 448 (IEEE fp32 division; a NaN amax gives the canonical NaN 0x7FC00000)
//   pow2: s = 2^ceil(log2 s) from s's bits (a non-zero mantissa rounds the exponent up; inf and NaN stay)
//   code = e4m3(clamp(x / s, -448, 448)): IEEE fp32 division, NaN kept by the clamp, round to nearest even;
//          every NaN becomes 0x7F.
#pragma once

#include <cstdint>
#include <cstring>

namespace attnres::detail {

constexpr float kFp8Max = 448.0f;
constexpr float kFp8MinAmax = 1e-10f;
constexpr uint8_t kFp8NaN = 0x7F;

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// |x| as a bit pattern; the max of these over a group is the group's NaN-propagating amax.
inline uint32_t abs_bits(float x) { return f32_bits(x) & 0x7fffffffu; }

// The scale of a group from its amax bits.
inline float fp8_scale(uint32_t amax_bits, bool pow2) {
  if (amax_bits > 0x7f800000u) return bits_f32(0x7fc00000u);  // NaN in the group
  const float amax = bits_f32(amax_bits);
  const float s = (amax > kFp8MinAmax ? amax : kFp8MinAmax) / kFp8Max;
  if (!pow2) return s;
  const uint32_t b = f32_bits(s);  // s >= 1e-10 / 448 is normal, or inf
  if ((b & 0x007fffffu) == 0) return s;
  return bits_f32((b & 0x7f800000u) + 0x00800000u);  // never overflows: s <= FLT_MAX / 448
}

// float -> e4m3fn, round to nearest even, for |v| <= 448 or NaN (the clamp came first).
inline uint8_t f32_to_e4m3(float v) {
  const uint32_t u = f32_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return kFp8NaN;
  const int exp32 = static_cast<int>(a >> 23) - 127;
  if (exp32 >= -6) {
    // e4m3 normal: keep 3 of the 23 mantissa bits, round to nearest even; a carry moves into the exponent.
    const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    return static_cast<uint8_t>(sign | (r - ((127u - 7u) << 3)));
  }
  // e4m3 subnormal: the value in units of 2^-9, an integer in [0, 8] after rounding (8: the smallest normal).
  const uint32_t mant = (a >> 23) != 0 ? (a & 0x7fffffu) | 0x800000u : (a & 0x7fffffu);
  const int e = (a >> 23) != 0 ? exp32 : -126;        // a = mant * 2^(e - 23)
  const int shift = 23 - 9 - e;                        // value / 2^-9 = mant >> shift; shift >= 21
  if (shift >= 32) return sign;                        // below 2^-10: rounds to zero
  const uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  const uint32_t code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  return static_cast<uint8_t>(sign | code);
}

// x / s clamped to [-448, 448] with NaN kept, then rounded.
inline uint8_t fp8_code(float x, float s) {
  float v = x / s;
  if (v > kFp8Max) v = kFp8Max;
  if (v < -kFp8Max) v = -kFp8Max;
  return f32_to_e4m3(v);
}

}  // namespace attnres::detail
