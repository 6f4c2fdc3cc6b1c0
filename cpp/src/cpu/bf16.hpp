// bfloat16 <-> float32 on the host, bit-exact with the contract: round to nearest even, subnormals kept,
// NaN stays NaN (quieted).
#pragma once

#include <cstdint>
#include <cstring>

namespace attnres::detail {

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even; overflow carries into inf
  return static_cast<uint16_t>(u >> 16);
}

// Floating-point environment guard: the add path must keep subnormals even when the host process set
// flush-to-zero / denormals-are-zero (some libraries do). Restores the caller's mode on exit.
class KeepSubnormals {
 public:
  KeepSubnormals();
  ~KeepSubnormals();
  KeepSubnormals(const KeepSubnormals&) = delete;
  KeepSubnormals& operator=(const KeepSubnormals&) = delete;

 private:
  uint64_t saved_ = 0;
};

}  // namespace attnres::detail
