// The FP8 epilogue's scale and codes (cuda/fp8_epilogue.cuh: fp8_scale, fp8_codes8) against IEEE division, for
// every input the kernels can give them: every bf16 amax (finite, inf, NaN), exact and power-of-two scales, and
// every bf16 dividend x with |x| <= amax (x is one of the values the group's amax is the max of): 2.1e9 pairs on
// the GPU.
//
// The reference is the contract's formula written independently: s = max(amax, 1e-10) / 448 (pow2: 2^ceil(log2 s)
// through frexpf) and e4m3(clamp(x / s, -448, 448)) with __fdiv_rn and CUDA's own float -> e4m3 conversion
// (cuda_fp8.h; every NaN code made 0x7F). Checked: the scales bit for bit, the codes byte for byte, and the finite
// scales' quotients (fp8_quotient) bit for bit wherever the reference quotient is at least 2^-24 in magnitude (far
// below the smallest e4m3 code, 2^-9; below it the fast quotient may differ in its last bits, which no code shows).
// A reciprocal multiply x * (1 / s) in place of the division must fail the code check for the exact scales: the
// comparison has teeth.
//
// Skips (with the reason) without a CUDA device.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

// nvcc warns that gtest's TEST macro leaves a static member unreferenced (#177).
#pragma nv_diag_suppress 177

#include <cstdint>
#include <cstdio>
#include <string>

#include "cuda/fp8_epilogue.cuh"

namespace {

using attnres::detail::fp8_codes8;
using attnres::detail::fp8_scale;

constexpr uint32_t kAmaxPatterns = 0x7f82;  // bf16 magnitudes 0 .. 0x7f80 (inf), then 0x7f81: a NaN
constexpr uint32_t kTiny = 0x33800000u;     // 2^-24

struct Counts {
  unsigned long long pairs, scale_mismatches, code_mismatches, quotient_mismatches, naive_code_mismatches;
  uint32_t first_amax, first_x;  // the first code mismatch (amax bf16 pattern | pow2 << 16, x), if any
};

__device__ float reference_scale(uint32_t amax_bits, bool pow2) {
  const float amax = __uint_as_float(amax_bits);
  const float s = amax != amax ? amax : __fdiv_rn(amax > 1e-10f ? amax : 1e-10f, 448.0f);
  if (!pow2 || !(s <= 3.40282347e38f)) return s;
  int e = 0;
  const float m = frexpf(s, &e);  // s = m * 2^e, 0.5 <= m < 1
  return m == 0.5f ? s : ldexpf(1.0f, e);
}
__device__ uint8_t reference_code(float q) {
  if (q != q) return 0x7f;
  const float v = q > 448.0f ? 448.0f : (q < -448.0f ? -448.0f : q);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Block: one amax pattern (x) and scale kind (y: pow2); threads: the dividends in groups of 8 (one uint4 of bf16,
// as a kernel thread holds).
__global__ void check_all_pairs(Counts* out) {
  const uint32_t a = blockIdx.x;
  const bool pow2 = blockIdx.y != 0;
  const uint32_t amax_bits = (a <= 0x7f80u ? a : 0x7fc0u) << 16;
  const float s = fp8_scale(amax_bits, pow2);
  const float ref_s = reference_scale(amax_bits, pow2);
  if (threadIdx.x == 0 && __float_as_uint(s) != __float_as_uint(ref_s)) atomicAdd(&out->scale_mismatches, 1ull);
  unsigned long long pairs = 0, codes = 0, quotients = 0, naive = 0;
  for (uint32_t g = threadIdx.x; g < 65536 / 8; g += blockDim.x) {
    uint32_t w[4];
    bool reachable[8];
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = g * 8 + 2 * i, hi = lo + 1;
      w[i] = lo | (hi << 16);
      reachable[2 * i] = ((lo & 0x7fffu) << 16) <= amax_bits;
      reachable[2 * i + 1] = ((hi & 0x7fffu) << 16) <= amax_bits;
    }
    const uint2 got = fp8_codes8(make_uint4(w[0], w[1], w[2], w[3]), s);
    const uint32_t got_bytes[2] = {got.x, got.y};
    for (int e = 0; e < 8; ++e) {
      if (!reachable[e]) continue;
      const uint32_t xb = (e & 1) ? (w[e / 2] & 0xffff0000u) : (w[e / 2] << 16);
      const float x = __uint_as_float(xb);
      const float q = __fdiv_rn(x, ref_s);
      const uint8_t want = reference_code(q);
      const uint8_t have = static_cast<uint8_t>(got_bytes[e / 4] >> (8 * (e % 4)));
      ++pairs;
      if (have != want) {
        ++codes;
        if (atomicCAS(&out->first_amax, 0xffffffffu, a | blockIdx.y << 16) == 0xffffffffu) out->first_x = xb >> 16;
      }
      if (ref_s <= 3.40282347e38f && (__float_as_uint(q) & 0x7fffffffu) >= kTiny) {
        const float fast = attnres::detail::fp8_quotient(x, attnres::detail::fp8_divisor(ref_s));
        if (__float_as_uint(fast) != __float_as_uint(q)) ++quotients;
      }
      if (!pow2 && reference_code(x * __frcp_rn(ref_s)) != want) ++naive;
    }
  }
  atomicAdd(&out->pairs, pairs);
  atomicAdd(&out->code_mismatches, codes);
  atomicAdd(&out->quotient_mismatches, quotients);
  atomicAdd(&out->naive_code_mismatches, naive);
}

std::string no_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return "no CUDA device";
  }
  return "";
}

TEST(Fp8QuotientGpu, EveryReachablePairMatchesIeeeDivision) {
  if (const std::string why = no_device(); !why.empty()) GTEST_SKIP() << why;
  Counts* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, sizeof(Counts)), cudaSuccess);
  Counts h{};
  h.first_amax = h.first_x = 0xffffffffu;
  ASSERT_EQ(cudaMemcpy(d, &h, sizeof h, cudaMemcpyHostToDevice), cudaSuccess);
  check_all_pairs<<<dim3(kAmaxPatterns, 2), 256>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d);
  std::printf("pairs %llu: scale mismatches %llu, code mismatches %llu, quotient mismatches (|q| >= 2^-24) %llu; "
              "x * (1 / s), exact scales: %llu code mismatches\n",
              h.pairs, h.scale_mismatches, h.code_mismatches, h.quotient_mismatches, h.naive_code_mismatches);
  // Every dividend with |x| <= amax (both signs) for every amax pattern: 2 (a + 1) for magnitude bits a, for the
  // exact and the power-of-two scales.
  unsigned long long want_pairs = 0;
  for (uint32_t a = 0; a < kAmaxPatterns; ++a) want_pairs += 2 * 2ull * ((a <= 0x7f80u ? a : 0x7fc0u) + 1);
  EXPECT_EQ(h.pairs, want_pairs);
  EXPECT_EQ(h.scale_mismatches, 0ull);
  EXPECT_EQ(h.code_mismatches, 0ull) << "first: (pow2 << 16 | amax bf16) 0x" << std::hex << h.first_amax
                                     << ", x bf16 0x" << h.first_x;
  EXPECT_EQ(h.quotient_mismatches, 0ull);
  EXPECT_GT(h.naive_code_mismatches, 0ull) << "the reciprocal multiply must differ somewhere (the check's teeth)";
}

}  // namespace
