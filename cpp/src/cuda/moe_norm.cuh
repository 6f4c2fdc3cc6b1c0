// The two-rounding latent RMSNorm of moe_finalize (docs/ops/moe_finalize.md), one copy for the two kernels that
// apply it: moe_finalize_kernel.cu (moe_finalize with a norm weight) and moe_finalize_all_reduce_kernel.cu (on the
// reduced latent). For the same x both must give the same bits (tests/tp/test_all_reduce.py checks the fused op's
// norm against moe_finalize's bit for bit), so the reduction order and every rounding are written here once:
//
//   ss     per thread over its x in element order (slice u = 0.., word i = 0..3, low half first), fmaf;
//          a warp butterfly (xor 16, 8, 4, 2, 1: every lane ends with the same bits); the warps' partials
//          added in warp order by thread 0 (add.rn.f32)
//   r      1 / sqrt(ss / D + eps), IEEE-rounded division, square root and add
//   out    bf16(bf16(x * r) * w), each product an explicit mul.rn.f32 (never contracted, never flushed)
//
// x and w are bf16 pairs packed little-endian in 32-bit words, eight elements per uint4 slice.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/device_utils.cuh"

namespace attnres::detail::moe_norm {

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Element 2i of a word is its low half.
__device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ uint32_t bf16_bits(float x) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(x)));
}
__device__ __forceinline__ uint32_t pack(float a, float b) { return bf16_bits(a) | (bf16_bits(b) << 16); }

__device__ __forceinline__ uint32_t& word(uint4& v, int i) { return (&v.x)[i]; }
__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return (&v.x)[i]; }

// r of the block's token. Every thread of the block must call it (two __syncthreads); x past the row's end must
// be zero. s_partial holds one float per warp of the block, s_r one float, both in shared memory.
template <int VPT>
__device__ __forceinline__ float inverse_rms(const uint4 (&x)[VPT], float* s_partial, float* s_r, float hidden,
                                             float eps) {
  const int tid = threadIdx.x;
  float ss = 0.0f;
#pragma unroll
  for (int u = 0; u < VPT; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float a = lo(word(x[u], i)), b = hi(word(x[u], i));
      ss = fmaf(a, a, ss);
      ss = fmaf(b, b, ss);
    }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  if ((tid & 31) == 0) s_partial[tid >> 5] = ss;
  __syncthreads();
  if (tid == 0) {
    float total = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total = add_rn_keep_subnormals(total, s_partial[w]);
    *s_r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, hidden), eps)));
  }
  __syncthreads();
  return *s_r;
}

// One slice of the output, out = bf16(bf16(x * r) * w) element by element (out may be x).
__device__ __forceinline__ void apply(uint4& out, const uint4& x, const uint4& w, float r) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t xv = word(x, i), wv = word(w, i);
    const uint32_t normed = pack(mul_rn(lo(xv), r), mul_rn(hi(xv), r));
    word(out, i) = pack(mul_rn(lo(normed), lo(wv)), mul_rn(hi(normed), hi(wv)));
  }
}

}  // namespace attnres::detail::moe_norm
