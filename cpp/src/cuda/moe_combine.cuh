// The local-route combine of moe_finalize (docs/ops/moe_finalize.md), one copy for the two kernels that compute
// it: moe_finalize_kernel.cu and moe_finalize_all_reduce_kernel.cu (whose partial must be moe_finalize's bits).
//
//   acc[u][e] += w_j * row_j[e] for the routes j = 0..k-1 in order, each product an explicit mul.rn.f32 and each
//   sum an add.rn.f32 that keeps subnormals (never contracted into an FMA, never flushed); a remote route
//   (index -1) is skipped, not added as zero (+0 added to -0 would change its sign).
//
// CHUNK routes' row slices are loaded before any is used (predicated loads: one basic block, all in flight).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/device_utils.cuh"
#include "cuda/moe_norm.cuh"

namespace attnres::detail {

// Thread `tid` of a block of `threads` owns slices tid + u * threads (u < VPT) of `vectors` 16-byte slices per row;
// s_index / s_weight hold the token's route map (-1 for a remote route and past k; CHUNK divides 32).
template <int VPT, int CHUNK>
__device__ __forceinline__ void moe_combine_routes(float (&acc)[VPT][8], const char* rows, int64_t rows_stride,
                                                   const int32_t* s_index, const float* s_weight, int routes,
                                                   int vectors, int tid, unsigned threads) {
  using moe_norm::hi;
  using moe_norm::lo;
  using moe_norm::mul_rn;
  using moe_norm::word;
#pragma unroll
  for (int u = 0; u < VPT; ++u)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
  for (int j0 = 0; j0 < routes; j0 += CHUNK) {
    uint4 v[CHUNK][VPT];
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const int32_t r = s_index[j0 + c];
#pragma unroll
      for (int u = 0; u < VPT; ++u) {
        const int vec = tid + u * threads;
        v[c][u] = load16_if(reinterpret_cast<const __nv_bfloat16*>(rows + static_cast<int64_t>(r < 0 ? 0 : r) * rows_stride) +
                                static_cast<int64_t>(vec) * 8,
                            r >= 0 && vec < vectors);
      }
    }
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      if (s_index[j0 + c] < 0) continue;
      const float w = s_weight[j0 + c];
#pragma unroll
      for (int u = 0; u < VPT; ++u)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t x = word(v[c][u], i);
          acc[u][2 * i] = add_rn_keep_subnormals(acc[u][2 * i], mul_rn(w, lo(x)));
          acc[u][2 * i + 1] = add_rn_keep_subnormals(acc[u][2 * i + 1], mul_rn(w, hi(x)));
        }
    }
  }
}

}  // namespace attnres::detail
