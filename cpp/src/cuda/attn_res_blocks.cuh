// The token-block single_cta: one block per token (grid = T), several blocks resident per SM, so that a token's
// serial chain of barriers and block sums overlaps other tokens' loads on the same SM instead of stalling it
// (the streaming single_cta's one block per SM reduces its tokens one after the other).
//
//   * Layout. C = split_k_cluster(H) rank chunks of p.chunk vectors; the block has ceil(C / S) groups of
//     kChunkThreads threads (S = tuning::kTokenBlocksVectors). Thread t of group g owns vector t of each of the
//     chunks g * S ... g * S + S - 1, so warp w of group g holds, in its slot s, split_k's 32-vector warp w of
//     chunk g * S + s, lane for lane.
//   * Bits. Per value, one reduce-scatter per warp (each value's tree is the butterfly over its 32 lanes), then
//     chunked_sum over the 32-vector warps in chunk order: split_k's order, with the per-vector code of the other
//     kernels (attn_res_steps.cuh, vector_scores). Chunks past C (the last group's padding) hold +0.
//   * Memory. No shared-memory ring: the rows load straight into registers, every load of a token in flight at
//     once; the weights are read where they are used (L1/L2 hits), the mixture is kept packed as bf16 between
//     the norm's two passes.
//   * PDL. Bank rows 0..K-2 are loaded before griddepcontrol.wait, dependents released right after it
//     (attn_res_per_token.cuh "PDL release"); the newest row K-1 is loaded after the wait into its own slot by a
//     predicated load that leaves the slot as it is otherwise (no second register set).
//   * In place (`updated` = layer_residual): a vector's prefix is loaded and stored by the one thread that owns it.
//   * Instances: single_cta's buckets (N <= 2: three blocks per SM; N <= 4: two) and, for the benchmark knob
//     Options::token_blocks_exact_n, N = 3 exactly (three; plan_tuning.hpp kTokenBlocksExactCandidates).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/attn_res_per_token.cuh"
#include "cuda/attn_res_steps.cuh"
#include "plan_tuning.hpp"

namespace attnres::detail {

// The rank chunks one group of kChunkThreads threads covers (each thread one vector of each) and the most groups a
// block has: split_k_cluster(H) <= kMaxCluster chunks.
constexpr int kBlocksVectors = tuning::kTokenBlocksVectors;
constexpr int kBlocksMaxThreads = kChunkThreads * ((kMaxClusterRanks + kBlocksVectors - 1) / kBlocksVectors);
constexpr int kBlocksMaxWarpSlots = kBlocksMaxThreads / 32 * kBlocksVectors;  // 32-vector warps of a token

constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

// MIN_BLOCKS: the blocks resident per SM the registers are bounded for (tuning::token_blocks_per_sm). FP8: the
// e4m3 epilogue after the norm (the norm modes; fp8_epilogue_vectors), a compile-time variant.
template <int NMAX, Mode MODE, int MIN_BLOCKS, Fp8Mode FP8 = Fp8Mode::none>
__global__ void __launch_bounds__(kBlocksMaxThreads, MIN_BLOCKS)
    attn_res_blocks_kernel(const __grid_constant__ PerTokenParams p) {
  constexpr int S = kBlocksVectors;
  constexpr bool kNorm = mode_has_norm(MODE);
  constexpr bool kAdd = mode_has_add(MODE);
  constexpr bool kAdd2 = mode_has_add2(MODE);
  constexpr int kValues = 2 * NMAX;                      // (sumsq, dot) per candidate
  constexpr int kEarlyRows = NMAX - 2;                   // rows that may be loaded before the wait
  static_assert(S * kValues <= 32, "one reduce-scatter per warp");
  static_assert(NMAX <= kSingleCtaMaxCandidates, "single_cta's buckets");
  static_assert(FP8 == Fp8Mode::none || kNorm, "the FP8 epilogue quantizes the normed output");

  __shared__ float warp_part[kBlocksMaxWarpSlots][kValues];
  __shared__ float totals[kValues];
  __shared__ float warp_sq[kBlocksMaxWarpSlots];
  __shared__ float block_sq;
  __shared__ uint32_t fp8_warp_amax[FP8 == Fp8Mode::per_token ? kBlocksMaxThreads / 32 : 1];

  const int tid = threadIdx.x, lane = tid & 31;
  const int group = tid / kChunkThreads, chunk_lane = tid % kChunkThreads, group_warp = chunk_lane >> 5;
  const int warp_slots = static_cast<int>(blockDim.x) / 32 * S;  // whole groups: chunks past C hold +0
  const int K = p.snapshots, N = K + 1;
  const int token = blockIdx.x;
  const bool scores = N > 1 || (!kNorm && p.rsigma != nullptr);

  bool valid[S];
  int64_t col[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const int vec = (group * S + s) * p.chunk + chunk_lane;
    valid[s] = chunk_lane < p.chunk && vec < p.vectors;
    col[s] = static_cast<int64_t>(vec) * 8;
  }
  const __nv_bfloat16* bank = p.bank + token * p.bank_token_stride;
  const __nv_bfloat16* const prefix_row = p.layer_residual + token * p.lr_stride;

  // ---- before the grid dependency: bank rows 0..K-2 (no earlier kernel of the step writes them) ----
  uint4 rows[S][NMAX - 1];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int n = 0; n < NMAX - 1; ++n)
      rows[s][n] = n < kEarlyRows ? load16_if(bank + n * p.bank_snapshot_stride + col[s], valid[s] && n + 1 < K)
                                  : make_uint4(0, 0, 0, 0);

  grid_dependency_wait();
  launch_dependents();

  // ---- after it: the newest bank row K-1 into its slot, the prefix, the addends ----
  uint4 prefix[S], add[S], add2[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
#pragma unroll
    for (int n = 0; n < NMAX - 1; ++n)
      rows[s][n] = load16_or_keep(rows[s][n], bank + n * p.bank_snapshot_stride + col[s], valid[s] && n + 1 == K);
    prefix[s] = load16_if(prefix_row + col[s], valid[s]);
    add[s] = kAdd ? load16_if(p.add + token * p.add_stride + col[s], valid[s]) : make_uint4(0, 0, 0, 0);
    add2[s] = kAdd2 ? load16_if(p.add2 + token * p.add2_stride + col[s], valid[s]) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if constexpr (kAdd) {
      prefix[s] = add_to_prefix<MODE>(prefix[s], add[s], add2[s]);
      if (valid[s] && p.updated) store16(p.updated + token * p.updated_stride + col[s], prefix[s]);
    }
    // Without an addend the snapshot row is layer_residual itself.
    if (valid[s] && p.snapshot) store16(p.snapshot + token * p.bank_token_stride + col[s], prefix[s]);
  }
  // Candidate n: bank row n < K, P at n = K, zero past it.
  const auto candidate = [&](int s, int n) {
    return n < K ? rows[s][n < NMAX - 1 ? n : 0] : (n == K ? prefix[s] : make_uint4(0, 0, 0, 0));
  };

  // ---- the candidates' (sum of squares, dot with q): warp (reduce-scatter), block (32-vector warps in order) ----
  float prob[NMAX];
  if (scores) {
    // The values one reduce-scatter takes: every slot's at once, or one slot's at a time where the registers are
    // bounded for three blocks per SM and all of them would not fit (the exact N = 3 instance: 8 partial sums
    // live instead of 32). Each value's tree is warp_sum's butterfly either way: the same bits.
    constexpr int kSlotsPerScatter = MIN_BLOCKS >= 3 && S * kValues > 16 ? 1 : S;
    constexpr int kWidth = scatter_width(kSlotsPerScatter * kValues);
    constexpr int kLanesPerValue = 32 / kWidth;
#pragma unroll
    for (int s0 = 0; s0 < S; s0 += kSlotsPerScatter) {
      float part[kWidth];
#pragma unroll
      for (int i = kSlotsPerScatter * kValues; i < kWidth; ++i) part[i] = 0.0f;
#pragma unroll
      for (int s = s0; s < s0 + kSlotsPerScatter; ++s) {
        // q = rms_weight * res_weight in fp32, never rounded; read here, not held across the loads.
        float q[8], a[8], b[8];
        unpack8(load16_if(p.res_weight + col[s], valid[s]), a);
        unpack8(load16_if(p.rms_weight + col[s], valid[s]), b);
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = b[e] * a[e];
#pragma unroll
        for (int n = 0; n < NMAX; ++n)
          vector_scores(candidate(s, n), q, part[(s - s0) * kValues + 2 * n], part[(s - s0) * kValues + 2 * n + 1]);
      }
      const float sum = warp_reduce_scatter<kWidth>(part, lane);
      const int index = lane / kLanesPerValue;
      if (lane % kLanesPerValue == 0 && index < kSlotsPerScatter * kValues)
        warp_part[(group * S + s0 + index / kValues) * kChunkWarps + group_warp][index % kValues] = sum;
    }
    __syncthreads();
    if (tid < 2 * N) totals[tid] = chunked_sum<kBlocksMaxWarpSlots>(&warp_part[0][tid], kValues, warp_slots);
    __syncthreads();

    float rsigma[NMAX], logit[NMAX];
    candidate_softmax<NMAX>(totals, N, p.inv_hidden, p.rms_eps, rsigma, logit, prob);
    if constexpr (!kNorm) {
      if (tid < N && p.rsigma) store_diagnostics<NMAX>(p, token, tid, rsigma, logit, prob);
    }
  } else {
#pragma unroll
    for (int n = 0; n < NMAX; ++n) prob[n] = single_candidate_rule(1, n, 0.0f);
  }

  // ---- the mixture, rounded to bf16 once (ops.md step 6), kept packed ----
  uint4 mixed[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    float mix[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) mix[e] = 0.0f;
#pragma unroll
    for (int n = 0; n < NMAX; ++n) {
      float x[8];
      unpack8(candidate(s, n), x);
#pragma unroll
      for (int e = 0; e < 8; ++e) mix[e] = fmaf(prob[n], x[e], mix[e]);
    }
    mixed[s] = valid[s] ? pack8(mix) : make_uint4(0, 0, 0, 0);
    if (valid[s]) {
      if constexpr (!kNorm) {
        store16(p.output + token * p.output_stride + col[s], mixed[s]);
      } else {
        if (p.mixture) store16(p.mixture + token * p.mixture_stride + col[s], mixed[s]);
      }
    }
  }

  if constexpr (kNorm) {
    // ---- trailing RMSNorm in Kimi's two-rounding order (ops.md step 7) ----
    constexpr int kSqWidth = pow2_at_least(S);
    float sq[kSqWidth];
#pragma unroll
    for (int s = 0; s < kSqWidth; ++s) {
      sq[s] = 0.0f;
      if (s < S) {
        float m[8];
        unpack8(mixed[s < S ? s : 0], m);
#pragma unroll
        for (int e = 0; e < 8; ++e) sq[s] = fmaf(m[e], m[e], sq[s]);
      }
    }
    const float sum = warp_reduce_scatter<kSqWidth>(sq, lane);
    {
      const int index = lane / (32 / kSqWidth);
      if (lane % (32 / kSqWidth) == 0 && index < S) warp_sq[(group * S + index) * kChunkWarps + group_warp] = sum;
    }
    __syncthreads();
    if (tid == 0) block_sq = chunked_sum<kBlocksMaxWarpSlots>(warp_sq, 1, warp_slots);
    __syncthreads();
    const float r = norm_scale(block_sq, p.inv_hidden, p.norm_eps);
    if constexpr (FP8 == Fp8Mode::none) {
#pragma unroll
      for (int s = 0; s < S; ++s) {
        if (valid[s]) {
          float m[8];
          unpack8(mixed[s], m);
          store16(p.output + token * p.output_stride + col[s],
                  rms_output8_scaled(m, r, load16_if(p.norm_weight + col[s], true)));
        }
      }
    } else {
      // Slot s of a warp holds 32 consecutive vectors of chunk group * S + s from a multiple of 32: the layout
      // fp8_epilogue_vectors takes (block128 where the chunks are multiples of 16 vectors: the plan's rule).
      uint4 out[S];
#pragma unroll
      for (int s = 0; s < S; ++s) {
        out[s] = make_uint4(0, 0, 0, 0);
        if (valid[s]) {
          float m[8];
          unpack8(mixed[s], m);
          out[s] = rms_output8_scaled(m, r, load16_if(p.norm_weight + col[s], true));
          if (p.output != nullptr)  // the FP8-only call stores no bf16 output
            store16(p.output + token * p.output_stride + col[s], out[s]);
        }
      }
      fp8_epilogue_vectors<FP8, S, kBlocksMaxThreads / 32>(p, out, valid, col, token, lane, tid >> 5, fp8_warp_amax);
    }
  }
}

// The instance for the plan's `max_candidates` (single_cta's buckets 2 and 4, or kTokenBlocksExactCandidates) in
// mode M with the FP8 epilogue F, its registers bounded for tuning::token_blocks_per_sm of it (nullptr for none).
template <Mode M, Fp8Mode F = Fp8Mode::none>
auto blocks_instance(int max_candidates) -> void (*)(PerTokenParams) {
  static_assert(kCandidateBuckets[0] == 2 && kCandidateBuckets[1] == kSingleCtaMaxCandidates, "single_cta's buckets");
  constexpr int kExact = tuning::kTokenBlocksExactCandidates;
  switch (max_candidates) {
    case kCandidateBuckets[0]:
      return attn_res_blocks_kernel<kCandidateBuckets[0], M, tuning::token_blocks_per_sm(kCandidateBuckets[0]), F>;
    case kExact: return attn_res_blocks_kernel<kExact, M, tuning::token_blocks_per_sm(kExact), F>;
    case kCandidateBuckets[1]:
      return attn_res_blocks_kernel<kCandidateBuckets[1], M, tuning::token_blocks_per_sm(kCandidateBuckets[1]), F>;
    default: return nullptr;
  }
}

// The FP8 instances (the norm modes; nullptr for any other mode), in their own translation unit
// (cuda/attn_res_blocks_fp8_instances.cu).
auto blocks_fp8_instance(Mode mode, Fp8Scales fp8, int max_candidates) -> void (*)(PerTokenParams);

}  // namespace attnres::detail
