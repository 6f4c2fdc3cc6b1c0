// The streaming single_cta: single_cta with more tokens than SMs (N <= 4, every mode). The grid
// holds as many blocks as are resident and each loops over the tokens b, b + gridDim.x, ...:
//
//   * A thread owns kStreamVectors 16-byte vectors of every row: those of the "lanes" (warp * kStreamVectors +
//     v) * 32 + lane of single_cta's one-block layout (split_k's rank chunks, kChunkThreads lanes each). So a
//     warp holds kStreamVectors of split_k's 32-vector warps, and every per-vector value (a vector's partial
//     sums, its mixture, its output) is computed by single_cta's instructions.
//   * The reductions keep single_cta's order, value for value: a warp's partial sums go through one
//     reduce-scatter, whose tree for every value is the butterfly over that value's 32 lanes (lane pairs at
//     distances 16, 8, 4, 2, 1), then chunked_sum over the 32-vector warps in order. So a token's bits are
//     single_cta's, which are split_k's (plan_tuning.hpp split_k_chunk). Fewer, fatter threads: the per-token
//     work that is not per vector (the softmax, the block sums, the addresses, the barriers) is issued once per
//     kStreamVectors vectors, ~20 % fewer instructions per token than one vector per thread; on the H200 that
//     was level with one addend and 5 % faster with two (docs/performance.md: a block's step is bound by its
//     serial chain of barriers and block sums, not by the instruction count).
//   * Each thread copies its vectors of the next BUFFERS - 1 tokens' rows into shared memory (cp.async, a ring of
//     BUFFERS token buffers, the plan's choice (plan_tuning.hpp stream_buffers): slot s of lane l in buffer b at
//     stream_buffer[(b * slots + s) * lanes + l], plan_tuning.hpp stream_slots) while the block reduces the
//     current token, and reads only its own slots back (cp.async.wait_group makes a thread's copies visible to
//     itself): a token's DRAM round trip overlaps the previous tokens' arithmetic.
//     One phase: the token's rows are all in shared memory before its reduction starts.
//   * Before griddepcontrol.wait only the first token's bank rows 0..K-2 are copied (what no earlier kernel of
//     the decode step writes); dependents are released right after the wait, as in the per-token kernel
//     (attn_res_per_token.cuh "PDL release" and docs/ops/pdl.md have the argument, which holds unchanged: every
//     later token's rows are copied after the wait).
//   * In place (`updated` = layer_residual): a token's prefix is copied before its updated row is stored, by the
//     block that owns the token; the prefetched tokens are other rows.
//   * Every shared array is written only after a barrier that follows its last read of the previous token, and a
//     stream buffer is refilled only by the thread that read it, a token later: the iterations need no barrier
//     of their own.
//   * FP8 output (the Fp8Mode instances): single_cta's epilogue (attn_res_per_token.cuh fp8_epilogue) over a
//     thread's kStreamVectors vectors: per_token, the block's maximum through one more barrier; block128, each
//     128-column group one half of a 32-vector warp (two warp reductions, no shared memory), which needs groups
//     aligned with split_k's chunks (a chunk a multiple of 16 vectors: the plan streams block128 only there).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/attn_res_per_token.cuh"
#include "cuda/attn_res_steps.cuh"
#include "plan_tuning.hpp"

namespace attnres::detail {

constexpr int kStreamVectors = tuning::kStreamVectors;
constexpr int kStreamMaxThreads = kSingleCtaMaxThreads / kStreamVectors;
static_assert(kChunkThreads % 32 == 0, "a 32-vector warp lies in one chunk (the block128 epilogue's groups)");

// Registers bounded for one block per SM (90-120 at bucket 2, ptxas -v; one 448-thread block at H = 7168): two
// blocks (64 registers, a few words spilled) measured 10-15 % slower with the addend and 3-5 % at N = 2 without,
// 5-9 % faster only at N = 1 without (H100, same-run A/B, h100_6dfd1bd_stream_blocks_ab.txt).
template <int NMAX, Mode MODE, int BUFFERS, Fp8Mode FP8 = Fp8Mode::none>
__global__ void __launch_bounds__(kStreamMaxThreads, 1)
    attn_res_stream_kernel(const __grid_constant__ PerTokenParams p) {
  constexpr int V = kStreamVectors;
  constexpr bool kNorm = mode_has_norm(MODE);
  static_assert(kNorm || FP8 == Fp8Mode::none, "attn_res has no normed output to quantize");
  constexpr bool kAdd = mode_has_add(MODE);
  constexpr bool kAdd2 = mode_has_add2(MODE);
  constexpr int kMaxWarps = kSingleCtaMaxThreads / 32;  // split_k's 32-vector warps of one token
  constexpr int kValues = 2 * NMAX;                     // (sumsq, dot) per candidate
  constexpr int kSlots = tuning::stream_slots(NMAX, kAdd, kAdd2);
  // kAhead: the tokens past the current one whose copies are in flight when a step starts; each step then issues
  // one more, into the buffer the thread read a step earlier.
  constexpr int kBuffers = BUFFERS, kAhead = kBuffers - 2;
  static_assert(kAhead >= 0, "at least two buffers");
  static_assert(NMAX <= kSingleCtaMaxCandidates, "single_cta's buckets");
  static_assert(32 % V == 0 && (V & (V - 1)) == 0, "a power-of-two share of a warp");

  __shared__ float warp_part[kMaxWarps][kValues];  // per 32-vector warp: (sumsq, dot) per candidate
  __shared__ float totals[kValues];                // the token's sums
  __shared__ float warp_sq[kMaxWarps];             // the mixture's sum of squares, per 32-vector warp
  __shared__ float block_sq;                       // the token's
  __shared__ uint32_t fp8_warp_amax[FP8 == Fp8Mode::per_token ? kStreamMaxThreads / 32 : 1];  // per real warp
  extern __shared__ uint4 stream_buffer[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int lanes = static_cast<int>(blockDim.x) * V;  // single_cta's threads: one per vector of the layout
  const int vwarps = lanes >> 5;
  const int K = p.snapshots, N = K + 1;
  const bool scores = N > 1 || (!kNorm && p.rsigma != nullptr);
  int token = blockIdx.x;

  // Lane (warp * V + v) * 32 + lane of the one-block layout: chunk l / kChunkThreads, kChunkThreads lanes each.
  int lane_of[V];
  bool valid[V];
  int64_t col[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    lane_of[v] = (warp * V + v) * 32 + lane;
    const int chunk_lane = lane_of[v] % kChunkThreads;
    const int vec = lane_of[v] / kChunkThreads * p.chunk + chunk_lane;
    valid[v] = chunk_lane < p.chunk && vec < p.vectors;
    col[v] = static_cast<int64_t>(vec) * 8;
  }

  // Token t's rows into `buffer`. early: the bank rows 0..K-2; late: the newest row (and the zero rows past it),
  // the prefix and the addends.
  const auto copy_token = [&](int t, int buffer, bool early, bool late) {
    const __nv_bfloat16* bank = p.bank + t * p.bank_token_stride;
    const __nv_bfloat16* prefix = p.layer_residual + t * p.lr_stride;
    const __nv_bfloat16* add = p.add + t * p.add_stride;
    const __nv_bfloat16* add2 = p.add2 + t * p.add2_stride;
    const uint32_t slot = lanes * sizeof(uint4);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const uint32_t base = shared_address(stream_buffer + buffer * kSlots * lanes + lane_of[v]);
#pragma unroll
      for (int n = 0; n + 1 < NMAX; ++n) {
        if (n + 1 < K ? early : late) {
          const bool real = valid[v] && n < K;  // a zero row past K: the source is not read (any valid address)
          cp_async16_zfill(base + n * slot, real ? bank + n * p.bank_snapshot_stride + col[v] : p.res_weight, real);
        }
      }
      if (late) {
        cp_async16_zfill(base + (NMAX - 1) * slot, prefix + col[v], valid[v]);
        if constexpr (kAdd) cp_async16_zfill(base + NMAX * slot, add + col[v], valid[v]);
        if constexpr (kAdd2) cp_async16_zfill(base + (NMAX + 1) * slot, add2 + col[v], valid[v]);
      }
    }
  };

  // ---- before the grid dependency: the weights and the first token's bank rows 0..K-2 ----
  uint4 res_w[V], rms_w[V], norm_w[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    res_w[v] = load16_if(p.res_weight + col[v], valid[v]);
    rms_w[v] = load16_if(p.rms_weight + col[v], valid[v]);
    norm_w[v] = load16_if(p.norm_weight + col[v], kNorm && valid[v]);
  }
  copy_token(token, 0, true, false);

  grid_dependency_wait();
  // Release dependents here, not after the last store: attn_res_per_token.cuh "PDL release".
  launch_dependents();
  copy_token(token, 0, false, true);
  cp_async_commit();
  // The next kAhead tokens, one commit group per token (empty past T): at every step the token's group is the
  // oldest of kAhead + 1 in flight.
#pragma unroll
  for (int a = 1; a <= kAhead; ++a) {
    const int t = token + a * static_cast<int>(gridDim.x);
    if (t < p.tokens) copy_token(t, a, true, true);
    cp_async_commit();
  }
  // The per-warp slots of warps the token does not have hold +0 for chunked_sum<.., PADDED> (written once; the
  // first token's first barrier orders them before any read).
  for (int i = tid; i < kMaxWarps * kValues; i += blockDim.x)
    if (i / kValues >= vwarps) warp_part[i / kValues][i % kValues] = 0.0f;
  if (tid < kMaxWarps && tid >= vwarps) warp_sq[tid] = 0.0f;

  float q[V][8];  // rms_weight * res_weight in fp32, never rounded
#pragma unroll
  for (int v = 0; v < V; ++v) {
    float a[8], b[8];
    unpack8(res_w[v], a);
    unpack8(rms_w[v], b);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[v][e] = b[e] * a[e];
  }

  for (int step = 0;; ++step) {
    // This thread's copies of the token (issued kAhead + 1 steps ago) are all it reads: no barrier. Then the copies
    // of the token kAhead + 1 steps ahead go out, into the buffer this thread read a step ago.
    cp_async_wait_group<kAhead>();
    uint4 rows[V][NMAX], prefix[V], add[V], add2[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const uint4* mine = stream_buffer + (step % kBuffers) * kSlots * lanes + lane_of[v];
#pragma unroll
      for (int n = 0; n + 1 < NMAX; ++n) rows[v][n] = mine[n * lanes];
      rows[v][NMAX - 1] = make_uint4(0, 0, 0, 0);
      prefix[v] = mine[(NMAX - 1) * lanes];
      add[v] = kAdd ? mine[NMAX * lanes] : make_uint4(0, 0, 0, 0);
      add2[v] = kAdd2 ? mine[(NMAX + 1) * lanes] : make_uint4(0, 0, 0, 0);
    }
    const int next = token + static_cast<int>(gridDim.x), ahead = token + (kAhead + 1) * static_cast<int>(gridDim.x);
    if (ahead < p.tokens) copy_token(ahead, (step + kAhead + 1) % kBuffers, true, true);
    cp_async_commit();

#pragma unroll
    for (int v = 0; v < V; ++v) {
      if constexpr (kAdd) {
        prefix[v] = add_to_prefix<MODE>(prefix[v], add[v], add2[v]);
        if (valid[v] && p.updated) store16(p.updated + token * p.updated_stride + col[v], prefix[v]);
      }
      // Without an addend the snapshot row is layer_residual itself.
      if (valid[v] && p.snapshot) store16(p.snapshot + token * p.bank_token_stride + col[v], prefix[v]);
    }
    // Candidate n: bank row n < K, P at n = K, zero past it.
    const auto candidate = [&](int v, int n) {
      return n < K ? rows[v][n] : (n == K ? prefix[v] : make_uint4(0, 0, 0, 0));
    };

    // ---- the candidates' (sum of squares, dot with q): warp (reduce-scatter), block (warps in order) ----
    // N = 1 without diagnostics needs no score: the mixture is P (single_candidate_rule), whatever its logit, so
    // the scoring's reduction and barriers are skipped (uniform over the launch) and the probabilities are the
    // rule's, the same values candidate_softmax gives at N = 1: the same bits.
    float prob[NMAX];
    if (scores) {
      constexpr int kWidth = scatter_width(V * kValues) < 8 ? 8 : scatter_width(V * kValues);
      constexpr int kLanesPerValue = 32 / kWidth;
      float part[kWidth];
#pragma unroll
      for (int i = V * kValues; i < kWidth; ++i) part[i] = 0.0f;
#pragma unroll
      for (int v = 0; v < V; ++v)
#pragma unroll
        for (int n = 0; n < NMAX; ++n)
          vector_scores(candidate(v, n), q[v], part[v * kValues + 2 * n], part[v * kValues + 2 * n + 1]);
      {
        const float sum = warp_reduce_scatter<kWidth>(part, lane);
        const int index = lane / kLanesPerValue;
        if (lane % kLanesPerValue == 0 && index < V * kValues) warp_part[warp * V + index / kValues][index % kValues] = sum;
      }
      __syncthreads();
      if (tid < 2 * N) totals[tid] = chunked_sum<kMaxWarps, true>(&warp_part[0][tid], kValues, vwarps);
      __syncthreads();

      // ---- softmax over the N candidates, computed identically by every thread ----
      float rsigma[NMAX], logit[NMAX];
      candidate_softmax<NMAX>(totals, N, p.inv_hidden, p.rms_eps, rsigma, logit, prob);
      if constexpr (!kNorm) {
        // fp32 diagnostics: the values the mixture used.
        if (tid < N && p.rsigma) store_diagnostics<NMAX>(p, token, tid, rsigma, logit, prob);
      }
    } else {
#pragma unroll
      for (int n = 0; n < NMAX; ++n) prob[n] = single_candidate_rule(1, n, 0.0f);
    }

    // ---- the mixture, rounded to bf16 once (ops.md step 6) ----
    float mix[V][8];
#pragma unroll
    for (int v = 0; v < V; ++v) {
#pragma unroll
      for (int e = 0; e < 8; ++e) mix[v][e] = 0.0f;
      if (valid[v]) {
        // Unconditional over the bucket: past N the probability and the row are zero, and a sum that starts at
        // +0 is unchanged by +0.
#pragma unroll
        for (int n = 0; n < NMAX; ++n) {
          float x[8];
          unpack8(candidate(v, n), x);
#pragma unroll
          for (int e = 0; e < 8; ++e) mix[v][e] = fmaf(prob[n], x[e], mix[v][e]);
        }
        const uint4 mixed = pack8(mix[v]);
        unpack8(mixed, mix[v]);  // from here on the mixture is its bf16 value
        if constexpr (!kNorm) {
          store16(p.output + token * p.output_stride + col[v], mixed);
        } else {
          if (p.mixture) store16(p.mixture + token * p.mixture_stride + col[v], mixed);
        }
      }
    }

    if constexpr (kNorm) {
      // ---- trailing RMSNorm in Kimi's two-rounding order (ops.md step 7) ----
      float sq[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        sq[v] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) sq[v] = fmaf(mix[v][e], mix[v][e], sq[v]);
      }
      // Each 32-vector warp's butterfly (warp_sum's tree), V of them in one reduce-scatter.
      const float sum = warp_reduce_scatter<V>(sq, lane);
      if (lane % (32 / V) == 0) warp_sq[warp * V + lane / (32 / V)] = sum;
      __syncthreads();
      if (tid == 0) block_sq = chunked_sum<kMaxWarps, true>(warp_sq, 1, vwarps);
      __syncthreads();
      const float total = block_sq;
      uint4 out[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        out[v] = make_uint4(0, 0, 0, 0);
        if (valid[v]) {
          out[v] = rms_output8(mix[v], total, p.inv_hidden, p.norm_eps, norm_w[v]);
          if (FP8 == Fp8Mode::none || p.output != nullptr)  // the FP8-only call stores no bf16 output
            store16(p.output + token * p.output_stride + col[v], out[v]);
        }
      }
      if constexpr (FP8 != Fp8Mode::none)
        fp8_epilogue_vectors<FP8, V, kStreamMaxThreads / 32>(p, out, valid, col, token, lane, warp, fp8_warp_amax);
    }

    token = next;
    if (token >= p.tokens) break;
  }
}

// The instance of single_cta bucket `max_candidates` with `buffers` token buffers (nullptr where none is built:
// tuning::stream_buffers_built).
template <Mode M, Fp8Mode F = Fp8Mode::none>
auto stream_instance(int max_candidates, int buffers) -> void (*)(PerTokenParams) {
  constexpr int kB0 = kCandidateBuckets[0], kB1 = kCandidateBuckets[1];
  static_assert(kB0 == 2 && kB1 == kSingleCtaMaxCandidates, "single_cta's buckets");
  static_assert(tuning::stream_buffers_built(kB0, 2) && tuning::stream_buffers_built(kB0, 3) &&
                    tuning::stream_buffers_built(kB0, 4) && !tuning::stream_buffers_built(kB0, 5) &&
                    tuning::stream_buffers_built(kB1, 2) && tuning::stream_buffers_built(kB1, 3) &&
                    !tuning::stream_buffers_built(kB1, 4),
                "the instances below are the ones tuning::stream_buffers_built names");
  if (max_candidates == kB0) {
    switch (buffers) {
      case 2: return attn_res_stream_kernel<kB0, M, 2, F>;
      case 3: return attn_res_stream_kernel<kB0, M, 3, F>;
      case 4: return attn_res_stream_kernel<kB0, M, 4, F>;
      default: return nullptr;
    }
  }
  if (max_candidates == kB1) {
    switch (buffers) {
      case 2: return attn_res_stream_kernel<kB1, M, 2, F>;
      case 3: return attn_res_stream_kernel<kB1, M, 3, F>;
      default: return nullptr;
    }
  }
  return nullptr;
}

// The FP8 instances (the norm modes; nullptr for any other mode or an unbuilt bucket or buffer count), in their
// own translation unit (cuda/attn_res_stream_fp8_instances.cu).
auto stream_fp8_instance(Mode mode, Fp8Scales fp8, int max_candidates, int buffers) -> void (*)(PerTokenParams);

}  // namespace attnres::detail
