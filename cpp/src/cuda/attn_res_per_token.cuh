// The per-token attention-residual kernel: single_cta (CLUSTER = false, one block per token) and split_k
// (CLUSTER = true, one thread-block cluster per token, H split across its blocks, partial sums exchanged
// through distributed shared memory in rank order). One body serves both and every mode, so the
// arithmetic is the same instruction sequence whatever the variant:
//
//   * Each thread owns one 16-byte vector (8 elements) of every candidate row and keeps all N of them in
//     registers: every load of a token is issued before any is used (one DRAM round trip, not N).
//   * Before griddepcontrol.wait it loads what no earlier kernel of the decode step writes: the weights and
//     bank rows 0..K-2. The newest row K-1 (which the previous op may just have written as its snapshot),
//     the prefix and the addends are loaded after the wait.
//   * The candidates' partial sums are reduced in two phases: the bank rows loaded before the wait while the
//     post-wait loads are in flight, then only the newest row and P once those land (one order per value,
//     so the bits are those of a single reduction).
//   * The addends only change the value of the last candidate (the add modes form P; mix and norm load it):
//     the reduction and mixing code is shared, which makes the add2 fold bitwise invisible, and attn_res with
//     addends (mix_add, mix_add2) gives attn_res_add_rmsnorm's mixture bit for bit.
//   * In place (`updated` = layer_residual): each vector of a token's prefix is loaded and stored by the one
//     thread that owns it, the store after the load it depends on, so no thread reads an updated prefix.
//   * Fixed reduction orders everywhere (butterfly in the warp, warps in order, cluster ranks in order), no
//     atomics: identical bits run to run, and a token's result does not depend on T or its position.
//   * One order for every kernel (plan_tuning.hpp split_k_chunk): split_k's, a function of H alone. A one-block
//     launch (single_cta, or split_k at a cluster of one) lays split_k's rank chunks out inside the block, one
//     chunk per kChunkThreads threads, and sums its warps chunk by chunk (chunked_sum), so its bits are
//     split_k's; the persistent kernel reproduces the same order (attn_res_persistent.cuh).
//   * split_k exchanges partial sums by pushing them into every peer's shared memory (st.async completing
//     on the peer's mbarrier): each block waits on its own mbarrier, never on a cluster-wide barrier.
//   * With more tokens than SMs single_cta streams instead (attn_res_stream.cuh), or runs one block per token with
//     several per SM (attn_res_blocks.cuh): the same steps and order.
//   * PDL release: dependents are released (griddepcontrol.launch_dependents) right after the block's
//     griddepcontrol.wait, not after its last store. Why that is safe (docs/ops/pdl.md has the long form):
//     launch_dependents gives a dependent no memory visibility, whatever its position: a dependent's
//     post-wait reads are ordered by its own wait (which waits for this grid's completion and flush), and
//     its pre-wait reads may only touch data that this grid does not write (the bank rows 0..K-2 and the
//     weights: the contract). What the position does decide is which EARLIER grids have completed when a
//     dependent's pre-wait section starts: the dependent can start only once every block of this grid has
//     released, and a block releases only after its wait returned, i.e. after this grid's predecessor
//     completed. So every grid two or more launches before a kernel has completed (and its writes are
//     visible) before that kernel's pre-wait loads run, by induction along the chain. A release at kernel
//     entry would break exactly this: the pre-wait loads of a kernel could then overlap a kernel two launches
//     earlier that is still writing the rows they read (tests/kernels/test_pdl_release.py; tools/pdl_teeth.sh runs
//     it against an entry-release build to show that it catches that).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <utility>

#include "attnres/limits.hpp"
#include "cuda/attn_res_params.cuh"
#include "cuda/attn_res_steps.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/fp8_epilogue.cuh"
#include "plan_tuning.hpp"

namespace attnres::detail {

// The plan's limits (attnres/limits.hpp) size the kernel's shared arrays and launch bounds.
constexpr int kMaxClusterRanks = attnres::kMaxCluster;
constexpr int kSingleCtaMaxThreads = static_cast<int>(attnres::kSingleCtaMaxThreads);
constexpr int kSplitKMaxThreads = static_cast<int>(attnres::kSplitKMaxThreads);
// A one-block launch gives each of split_k's rank chunks (<= 128 vectors: plan_tuning.hpp) this many threads.
constexpr int kChunkThreads = static_cast<int>(tuning::kSplitKBlockVectors);
constexpr int kChunkWarps = kChunkThreads / 32;

// sum_{i < count} base[i * stride] in index order (warps of a block, or ranks of a cluster); the loads are
// issued together (unrolled to MAX, clamped index, masked add: adding +0 to a sum that started at +0 changes
// no bits).
template <int MAX>
__device__ __forceinline__ float ordered_sum(const float* base, int stride, int count) {
  float v[MAX];
#pragma unroll
  for (int i = 0; i < MAX; ++i) v[i] = base[(i < count ? i : 0) * stride];
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < MAX; ++i) s += i < count ? v[i] : 0.0f;
  return s;
}

// split_k's two-level order inside one block: the warps of each kChunkWarps-warp chunk in order from +0, then the
// chunks in order from +0 (what a cluster of one block per chunk computes with ordered_sum twice). Past `count`
// every term is +0, which changes no sum that started at +0. Shorter than ordered_sum's one chain of MAX adds.
// PADDED: every one of the MAX slots holds a value, +0 past `count` (the streaming single_cta zeroes them once),
// so no index clamp or mask is needed: the same terms, the same bits, and ~120 instructions fewer at MAX = 32
// where one warp sums while the block waits at the next barrier.
template <int MAX, bool PADDED = false>
__device__ __forceinline__ float chunked_sum(const float* base, int stride, int count) {
  static_assert(MAX % kChunkWarps == 0, "whole chunks");
  float v[MAX];
#pragma unroll
  for (int i = 0; i < MAX; ++i) v[i] = base[(PADDED || i < count ? i : 0) * stride];
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < MAX / kChunkWarps; ++c) {
    float chunk = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunkWarps; ++k)
      chunk += PADDED || c * kChunkWarps + k < count ? v[c * kChunkWarps + k] : 0.0f;
    s += chunk;
  }
  return s;
}

// The power of two (>= 4, <= 32) that holds `values` values: a warp_reduce_scatter's width.
constexpr int scatter_width(int values) { return values <= 4 ? 4 : values <= 8 ? 8 : values <= 16 ? 16 : 32; }

// Every word of `v` ORed with `bits`.
__device__ __forceinline__ uint4 or_word(uint4 v, uint32_t bits) {
  return make_uint4(v.x | bits, v.y | bits, v.z | bits, v.w | bits);
}

// Pushes `value` into `recv_slot` (this block's slot of a by-rank array) in the block of cluster rank `r`.
__device__ __forceinline__ void push_to_rank(const float* recv_slot, uint64_t* bar, float value, int r) {
  st_async_f32(map_to_rank(shared_address(recv_slot), r), value, map_to_rank(shared_address(bar), r));
}
// The same into every block of the cluster, one after the other. A value that one thread holds goes this way;
// a value every thread holds (the norm's block sum of squares, the FP8 per-token amax) is pushed
// by threads 0..ranks-1, one rank each, which measured faster than one thread pushing to every rank; the
// candidates' values keep this loop, which measured faster than one (value, rank) pair per thread
// (docs/performance.md).
__device__ __forceinline__ void push_to_ranks(const float* recv_slot, uint64_t* bar, float value, int ranks) {
  for (int r = 0; r < ranks; ++r) push_to_rank(recv_slot, bar, value, r);
}

// The codes of vector `vec` of a token's bf16 output `out`, whose group's amax is `amax`, and the group's scale
// (stored by the thread owning the group's first vector).
template <Fp8Mode FP8>
__device__ __forceinline__ void fp8_store(const PerTokenParams& p, uint4 out, int token, int vec, uint32_t amax) {
  const float s = fp8_scale(amax, p.fp8_pow2 != 0);
  *reinterpret_cast<uint2*>(p.output_fp8 + token * p.output_fp8_stride + static_cast<int64_t>(vec) * 8) =
      fp8_codes8(out, s);
  if constexpr (FP8 == Fp8Mode::per_token) {
    if (vec == 0) p.fp8_scales[token * p.fp8_scales_stride[0]] = s;
  } else {
    if ((vec & 15) == 0) p.fp8_scales[token * p.fp8_scales_stride[0] + (vec >> 4) * p.fp8_scales_stride[1]] = s;
  }
}

// The FP8 epilogue of a one-block layout where each thread holds V vectors of a token's bf16 output (the streaming
// and token-block single_cta): vector v of a warp's 32 lanes is 32 consecutive vectors of one rank chunk from a
// multiple of 32, so with chunks of a multiple of 16 vectors a 128-column group is 16 aligned lanes (block128: two
// half-warp maxima); per_token takes the block's maximum through shared memory (`warp_amax`, kMaxWarps entries; one
// barrier). Every maximum is of bit patterns: order-independent, the bits of every other kernel.
template <Fp8Mode FP8, int V, int kMaxWarps>
__device__ __forceinline__ void fp8_epilogue_vectors(const PerTokenParams& p, const uint4 (&out)[V],
                                                     const bool (&valid)[V], const int64_t (&col)[V], int token,
                                                     int lane, int warp, uint32_t* warp_amax) {
  uint32_t amax[V];
#pragma unroll
  for (int v = 0; v < V; ++v) amax[v] = valid[v] ? amax_bits8(out[v]) : 0u;
  if constexpr (FP8 == Fp8Mode::per_token) {
    uint32_t mine = amax[0];
#pragma unroll
    for (int v = 1; v < V; ++v) mine = max(mine, amax[v]);
    mine = warp_max_u32(mine);
    if (lane == 0) warp_amax[warp] = mine;
    __syncthreads();
    const int warps = static_cast<int>(blockDim.x) >> 5;
    uint32_t block = 0;
#pragma unroll
    for (int i = 0; i < kMaxWarps; ++i) block = max(block, warp_amax[min(i, warps - 1)]);
#pragma unroll
    for (int v = 0; v < V; ++v) amax[v] = block;
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) amax[v] = half_warp_max_u32(amax[v], lane);
  }
#pragma unroll
  for (int v = 0; v < V; ++v)
    if (valid[v]) fp8_store<FP8>(p, out[v], token, static_cast<int>(col[v] / 8), amax[v]);
}

// The FP8 epilogue of one token from the bf16 output `out` of this thread's vector `vec` (zeros when the
// thread owns none): the group amax (per_token: the whole token, across the cluster; block128: 16 vectors,
// which a block boundary may split when the chunk is not a multiple of 16), the scale, 8 codes per thread, and
// one scale store per group (the thread owning the group's first vector, rank 0's thread 0 for per_token).
template <Fp8Mode FP8, bool CLUSTER, int kMaxWarps>
__device__ __forceinline__ void fp8_epilogue(const PerTokenParams& p, uint4 out, bool valid, int token, int vec,
                                             int rank, int ranks, int tid, int lane, int warp, int warps,
                                             uint32_t* warp_amax, uint32_t* thread_amax, uint32_t (*recv)[2],
                                             uint64_t* bar) {
  const uint32_t mine = valid ? amax_bits8(out) : 0u;
  uint32_t amax;
  if constexpr (FP8 == Fp8Mode::per_token) {
    // The block's maximum first, then one push per rank: fewer single-word pushes per block than every warp
    // pushing to every rank, which measured slower (docs/performance.md).
    const uint32_t w = warp_max_u32(mine);
    if (lane == 0) warp_amax[warp] = w;
    __syncthreads();
    // Unrolled to the array bounds with the index clamped (max(x, x) = x): the loads issue together and no loop
    // branches (the max is order-independent: the same bits).
    uint32_t block = 0;
#pragma unroll
    for (int i = 0; i < kMaxWarps; ++i) block = max(block, warp_amax[min(i, warps - 1)]);
    if constexpr (CLUSTER) {
      if (tid == 0) mbarrier_expect_tx(shared_address(bar), ranks * sizeof(float));
      if (tid < ranks) push_to_rank(reinterpret_cast<const float*>(&recv[rank][0]), bar, __uint_as_float(block), tid);
      mbarrier_wait_parity(shared_address(bar), 0);
      amax = 0;
#pragma unroll
      for (int r = 0; r < kMaxClusterRanks; ++r) amax = max(amax, recv[min(r, ranks - 1)][0]);
    } else {
      amax = block;
    }
  } else if (p.chunk % 16 == 0) {
    // Every group of 16 vectors starts on lane 0 or 16 of one warp (a block's chunk, a multiple of 16 vectors,
    // starts on a 16-aligned vector, and so does each of its warps' halves): the group is one half-warp, reduced
    // by two warp reductions (half_warp_max_u32), with no shared memory and no barrier. A thread past the row or
    // its chunk holds 0, which changes no max; the max is order-independent, so the bits are the shared-memory
    // path's.
    amax = half_warp_max_u32(mine, lane);
  } else {
    // In-block: the max over this block's vectors of the group (at most 16 shared-memory reads). A one-block
    // launch lays its threads out by split_k's rank chunks (kChunkThreads threads per chunk of p.chunk
    // vectors) and owns every vector: vector v is thread (v / chunk) * kChunkThreads + v % chunk there.
    thread_amax[tid] = mine;
    __syncthreads();
    const int first = CLUSTER ? rank * p.chunk : 0;
    const int end = CLUSTER ? min(first + p.chunk, p.vectors) : p.vectors;  // this block's vectors
    const auto thread_of = [&](int v) { return CLUSTER ? v - first : v / p.chunk * kChunkThreads + v % p.chunk; };
    const int g = vec >> 4;
    const int lo = max(g * 16, first), hi = min(g * 16 + 16, end);
    amax = 0;
    for (int v = lo; v < hi; ++v) amax = max(amax, thread_amax[thread_of(v)]);
    if constexpr (CLUSTER) {
      // A group split by a block boundary (the chunk is not a multiple of 16): every block pushes the partial
      // amax of its first and last group (its threads 0 and end - first - 1 computed them above); each thread
      // takes the partials of the other blocks that share its group. fmax of bit patterns: any order gives the
      // same bits.
      const int last = end - first - 1;  // >= 0 unless the block owns no vector
      if (tid == 0) mbarrier_expect_tx(shared_address(bar), ranks * 2 * sizeof(float));
      if (tid == 0)
        push_to_ranks(reinterpret_cast<const float*>(&recv[rank][0]), bar, __uint_as_float(last >= 0 ? amax : 0u),
                      ranks);
      if (tid == max(last, 0)) {
        // A block that owns no vector pushes zeros for both (thread 0 then pushes both).
        push_to_ranks(reinterpret_cast<const float*>(&recv[rank][1]), bar, __uint_as_float(last >= 0 ? amax : 0u),
                      ranks);
      }
      mbarrier_wait_parity(shared_address(bar), 0);
      for (int r = 0; r < ranks; ++r) {
        const int rf = r * p.chunk, re = min(rf + p.chunk, p.vectors);
        if (rf >= re) continue;
        if ((rf >> 4) == g) amax = max(amax, recv[r][0]);
        if (((re - 1) >> 4) == g) amax = max(amax, recv[r][1]);
      }
    }
  }
  if (valid) fp8_store<FP8>(p, out, token, vec, amax);
}

// The block size bound of an instance: single_cta is planned for N <= 4 only (buckets 2 and 4, up to 1024
// threads); every other instance runs split_k's blocks of <= 256 threads, the one-block clusters of split_k
// (H <= 1024) included, which launch the CLUSTER = false instance (no exchange, no cluster).
template <int NMAX, bool CLUSTER>
constexpr int kMaxThreadsOf = CLUSTER || NMAX > 4 ? kSplitKMaxThreads : kSingleCtaMaxThreads;

// FP8: the e4m3 epilogue after the trailing norm (norm modes only), a compile-time variant so the bf16-only
// instances carry none of it. EXACT: N = NMAX, a compile-time constant (tuning::split_k_exact), so every
// `n < N` below folds and no padded row costs an instruction; otherwise N = p.snapshots + 1 <= NMAX.
template <int NMAX, Mode MODE, bool CLUSTER, Fp8Mode FP8 = Fp8Mode::none, bool EXACT = false>
__global__ void __launch_bounds__(kMaxThreadsOf<NMAX, CLUSTER>)
    attn_res_per_token_kernel(const __grid_constant__ PerTokenParams p) {
  namespace cg = cooperative_groups;
  constexpr bool kNorm = mode_has_norm(MODE);
  constexpr bool kAdd = mode_has_add(MODE);
  constexpr int kMaxWarps = kMaxThreadsOf<NMAX, CLUSTER> / 32;
  constexpr int kRanks = CLUSTER ? kMaxClusterRanks : 1;

  __shared__ float warp_part[kMaxWarps][2 * NMAX];  // per warp: (sumsq, dot) per candidate
  __shared__ float totals[2 * NMAX];                // the token's sums
  __shared__ float warp_sq[kMaxWarps];              // the mixture's sum of squares, per warp
  __shared__ float block_sq;                        // single_cta: the token's
  __shared__ float recv_part[kRanks][2 * NMAX];     // split_k: every block's (sumsq, dot), by rank
  __shared__ float recv_sq[kRanks];                 // split_k: every block's mixture sum of squares
  __shared__ alignas(8) uint64_t bars[2];           // split_k: completion of the two exchanges
  constexpr bool kFp8 = FP8 != Fp8Mode::none;
  static_assert(!kFp8 || kNorm, "attn_res has no normed output to quantize");
  // FP8: per-warp amax (per_token), per-thread amax (block128 groups that do not align with warps), what the
  // cluster's blocks exchange (per_token: the block's amax; block128: the partial amax of its first and last
  // group), and the exchange's mbarrier.
  __shared__ uint32_t fp8_warp_amax[kFp8 ? kMaxWarps : 1];
  __shared__ uint32_t fp8_thread_amax[kFp8 ? kMaxThreadsOf<NMAX, CLUSTER> : 1];
  __shared__ uint32_t fp8_recv[kFp8 ? kRanks : 1][2];
  __shared__ alignas(8) uint64_t fp8_bar;

  int rank = 0, ranks = 1, token = blockIdx.x;
  if constexpr (CLUSTER) {
    const cg::cluster_group cluster = cg::this_cluster();
    rank = static_cast<int>(cluster.block_rank());
    ranks = static_cast<int>(cluster.num_blocks());
    token = blockIdx.x / ranks;
    // Peers push into our shared memory only after they know our mbarriers exist: init, fence, then a
    // relaxed cluster arrive now and the matching wait just before the first push.
    if (threadIdx.x == 0) {
      mbarrier_init(shared_address(&bars[0]), 1);
      mbarrier_init(shared_address(&bars[1]), 1);
      if constexpr (kFp8) mbarrier_init(shared_address(&fp8_bar), 1);
      fence_mbarrier_init_cluster();
    }
    cluster_arrive_relaxed();
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int K = EXACT ? NMAX - 1 : p.snapshots, N = K + 1;
  // split_k: vector rank * chunk + tid. One block: chunk tid / kChunkThreads, kChunkThreads threads each.
  const int chunk_tid = CLUSTER ? tid : tid % kChunkThreads;
  const int vec = (CLUSTER ? rank : tid / kChunkThreads) * p.chunk + chunk_tid;
  const bool valid = chunk_tid < p.chunk && vec < p.vectors;
  const int64_t col = static_cast<int64_t>(vec) * 8;
  const __nv_bfloat16* bank_row0 = p.bank + token * p.bank_token_stride + col;

  // ---- loads that no earlier kernel of the step writes (before the grid dependency) ----
  // Every load is predicated (load16_if), never branched around: one basic block, all in flight.
  uint4 rows[NMAX];
  const uint4 res_w = load16_if(p.res_weight + col, valid);
  const uint4 rms_w = load16_if(p.rms_weight + col, valid);
  const uint4 norm_w = load16_if(p.norm_weight + col, kNorm && valid);
#pragma unroll
  for (int n = 0; n < NMAX; ++n) rows[n] = load16_if(bank_row0 + n * p.bank_snapshot_stride, valid && n + 1 < K);

  // The post-wait addresses are formed before the wait: their operands are launch parameters, and with the
  // prefix's token stride read after the wait ptxas issued the newest row first and merged it before the
  // prefix load (a second round trip; the FP8 block128 N = 9 one-block instance, tools/sass_check.py).
  const __nv_bfloat16* const prefix_row = p.layer_residual + token * p.lr_stride + col;

  grid_dependency_wait();
  // Release dependents here, not after the last store: see "PDL release" in the header comment.
  launch_dependents();

  // ---- the candidates' (sum of squares, dot with q), reduced over the token in two phases ----
  // Reduction per value: warp (reduce-scatter), block (warps in order), cluster (ranks in order). The early
  // phase takes the bank rows loaded before the wait (0..K-2): it runs once the post-wait loads are issued,
  // so its arithmetic, its barrier and its pushes to the cluster's peers overlap their round trip. The late
  // phase, after they land, reduces only the two candidates they hold (the newest row K-1 and P). Each value's
  // tree is the same in either phase (a reduce-scatter adds lane pairs at distances 16, 8, 4, 2, 1 whatever
  // its width), so the bits are those of one reduction of all 2N values.
  constexpr int kValues = 2 * NMAX;      // warp_part's and recv_part's row: (sumsq, dot) per candidate
  constexpr int kEarly = NMAX - 2;       // rows loaded before the wait: n <= K - 2 <= NMAX - 3
  // The bucket of 2 (N <= 2) has no row to reduce early and keeps one phase: there the two-phase code (its
  // barrier and reordering) measured slower, at N = 5 and 9 faster (docs/performance.md).
  constexpr bool kTwoPhases = kEarly > 0;
  const int early_values = kTwoPhases ? 2 * (K - 1) : 0;  // values 0 .. early_values - 1: the early phase's
  // A cluster of one block (split_k at H <= 1024) is launched as the CLUSTER = false instance
  // (cuda_attn_res): st.async into a cluster of one block is invalid (compute-sanitizer memcheck reports it).
  // The bits are the same: chunked_sum adds its chunks' sums to +0 exactly as the cluster's rank-ordered sum
  // does. A compile-time choice, not a runtime `ranks > 1` test, which would put both paths (more instructions
  // and branches) into every cluster instance.
  constexpr bool exchange = CLUSTER;
  // Before the first push: every peer's mbarriers are initialised (pairs with the arrive), and this block's
  // exchange mbarrier expects every rank's values of both phases.
  auto begin_exchange = [&] {
    cluster_wait();
    if (tid == 0)
      mbarrier_expect_tx(shared_address(&bars[0]), ranks * (2 * N) * sizeof(float));
  };
  // A value's sum over the block's warps, in order (what a block pushes to its cluster's peers).
  const auto block_sum = [&](int i) { return ordered_sum<kMaxWarps>(&warp_part[0][i], kValues, warps); };
  // `zero` is the result of the barrier that closes the post-wait load window (0: no thread's predicate is
  // true). ptxas cannot see that it is zero, so every input of the early phase, ORed with it, depends on the
  // barrier: without that dependency ptxas scheduled the early phase's arithmetic right after the wait, where
  // it waited for the pre-wait rows before the post-wait loads were issued (a second round trip whenever the
  // wait does not block) and delayed the release (tools/sass_check.py). A barrier alone does not order
  // arithmetic that does not depend on it.
  float q[8];
  auto early_phase = [&](uint32_t zero) {
    {
      float a[8], b[8];
      unpack8(or_word(res_w, zero), a);
      unpack8(or_word(rms_w, zero), b);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = b[e] * a[e];  // rms_weight * res_weight in fp32, never rounded
    }
    if constexpr (kTwoPhases) {
      constexpr int kWidth = scatter_width(2 * kEarly), kLanesPerValue = 32 / kWidth;
      float part[kWidth];
#pragma unroll
      for (int i = 2 * kEarly; i < kWidth; ++i) part[i] = 0.0f;
#pragma unroll
      for (int n = 0; n < kEarly; ++n) {
        rows[n] = or_word(rows[n], zero);  // in place: the mixture reads the same (unchanged) value
        vector_scores(rows[n], q, part[2 * n], part[2 * n + 1]);
      }
      const float sum = warp_reduce_scatter<kWidth>(part, lane);
      const int index = lane / kLanesPerValue;
      if (lane % kLanesPerValue == 0 && index < early_values) warp_part[warp][index] = sum;
      __syncthreads();
      if constexpr (exchange) {
        begin_exchange();
        if (tid < early_values) push_to_ranks(&recv_part[rank][tid], &bars[0], block_sum(tid), ranks);
      } else {
        if (tid < early_values) totals[tid] = chunked_sum<kMaxWarps>(&warp_part[0][tid], kValues, warps);
      }
    }
  };

  // ---- the prefix, the addends and the newest bank row: what the step's previous kernel may have written ----
  // One DRAM round trip for all four, which needs every load issued before any loaded value is used. ptxas
  // schedules that, not the source order: with the newest row loaded first, ptxas placed its OR merge (below)
  // before computing the later loads' addresses in some instances, a second round trip. The newest row goes
  // last, so the merge cannot start before every load is out; tools/sass_check.py checks every instance's SASS.
  uint4 prefix = load16_if(prefix_row, valid);
  uint4 add = make_uint4(0, 0, 0, 0), add2 = make_uint4(0, 0, 0, 0);
  if constexpr (kAdd) {
    add = load16_if(p.add + token * p.add_stride + col, valid);
    add2 = load16_if(p.add2 + token * p.add2_stride + col, mode_has_add2(MODE) && valid);
  }
  const uint4 newest = load16_if(bank_row0 + (K - 1) * p.bank_snapshot_stride, valid && K >= 1);
  // The barrier closes the load window.
  if constexpr (kTwoPhases) early_phase(static_cast<uint32_t>(__syncthreads_count(0)));
  else early_phase(0u);
  // rows[K-1] is still zero (its pre-wait load was predicated off): OR merges without a branch. (The early
  // phase above read rows 0..K-2 only.)
#pragma unroll
  for (int n = 0; n < NMAX; ++n)
    if (n + 1 == K)
      rows[n] = make_uint4(rows[n].x | newest.x, rows[n].y | newest.y, rows[n].z | newest.z, rows[n].w | newest.w);
  if constexpr (kAdd) {
    prefix = add_to_prefix<MODE>(prefix, add, add2);
    if (valid && p.updated) store16(p.updated + token * p.updated_stride + col, prefix);
    if (valid && p.snapshot) store16(p.snapshot + token * p.bank_token_stride + col, prefix);
  }

  // ---- the late phase of the candidates' reduction: the newest row and P, then the token's totals ----
  if constexpr (kTwoPhases) {
    float part[4];
    vector_scores(newest, q, part[0], part[1]);  // zero when K = 0: its values (index -2, -1) are not stored
    vector_scores(prefix, q, part[2], part[3]);
    const float sum = warp_reduce_scatter<4>(part, lane);
    const int index = early_values + lane / 8;  // the newest row: 2(K-1), 2K-1; P: 2K, 2K+1
    if (lane % 8 == 0 && index >= 0) warp_part[warp][index] = sum;
    // P joins the rows as candidate K (rows[K] is still zero: its load was predicated off), so the mixture
    // reads rows[n] for every n without a select per element; merged here, ahead of the exchange's wait.
#pragma unroll
    for (int n = 0; n < NMAX; ++n)
      if (n == K)
        rows[n] = make_uint4(rows[n].x | prefix.x, rows[n].y | prefix.y, rows[n].z | prefix.z, rows[n].w | prefix.w);
  } else {
    // One phase: every candidate (rows[0] holds the newest row when K = 1, P is candidate K).
    constexpr int kWidth = scatter_width(kValues) < 8 ? 8 : scatter_width(kValues), kLanesPerValue = 32 / kWidth;
    float part[kWidth];
#pragma unroll
    for (int i = kValues; i < kWidth; ++i) part[i] = 0.0f;
#pragma unroll
    for (int n = 0; n < NMAX; ++n)
      vector_scores(n < K ? rows[n] : (n == K ? prefix : make_uint4(0, 0, 0, 0)), q, part[2 * n], part[2 * n + 1]);
    const float sum = warp_reduce_scatter<kWidth>(part, lane);
    const int index = lane / kLanesPerValue;
    if (lane % kLanesPerValue == 0 && index < kValues) warp_part[warp][index] = sum;
  }
  __syncthreads();
  const bool late_value = tid >= early_values && tid < 2 * N;
  if constexpr (exchange) {
    if constexpr (!kTwoPhases) begin_exchange();
    // Two phases: the late values are the newest row's and P's (2(K-1) .. 2K+1; 0, 1 when K = 0).
    if (late_value) push_to_ranks(&recv_part[rank][tid], &bars[0], block_sum(tid), ranks);
    mbarrier_wait_parity(shared_address(&bars[0]), 0);
    if (tid < 2 * N) totals[tid] = ordered_sum<kMaxClusterRanks>(&recv_part[0][tid], kValues, ranks);
  } else {
    if (late_value) totals[tid] = chunked_sum<kMaxWarps>(&warp_part[0][tid], kValues, warps);
  }
  __syncthreads();
  if constexpr (!kAdd) {
    // The snapshot write without an addend: the row is layer_residual itself. After the load window (the
    // post-wait loads stay together, tools/sass_check.py), before the mixture.
    if (valid && p.snapshot) store16(p.snapshot + token * p.bank_token_stride + col, prefix);
  }

  // ---- softmax over the N candidates, computed identically by every thread of every block ----
  float rsigma[NMAX], logit[NMAX], prob[NMAX];
  candidate_softmax<NMAX>(totals, N, p.inv_hidden, p.rms_eps, rsigma, logit, prob);

  if constexpr (!kNorm) {
    // fp32 diagnostics, written by the cluster's first block: the values the mixture used.
    if (rank == 0 && tid < N && p.rsigma) store_diagnostics<NMAX>(p, token, tid, rsigma, logit, prob);
  }

  // ---- the mixture, rounded to bf16 once (ops.md step 6) ----
  float mix[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint4 mixed = make_uint4(0, 0, 0, 0);
  if (valid) {
    // Unconditional over the bucket: past N the probability and the row are zero, so each such row adds +0,
    // which changes no element but a -0 (to +0).
#pragma unroll
    for (int n = 0; n < NMAX; ++n) {
      float x[8];
      // Candidate n: bank row n < K, P at n = K, zero past it (two phases: P is merged into rows[K] above).
      uint4 row = kTwoPhases ? rows[n] : (n < K ? rows[n] : (n == K ? prefix : make_uint4(0, 0, 0, 0)));
      // EXACT: the rows the early phase scored reach here unchanged, and the compiler kept their unpacked
      // floats alive from the scores to the mixture (8 registers a row instead of 4: 194 at N = 16, half the
      // blocks per SM). Opaque, the row is unpacked again here (2 integer ops a pair). The bucket's rows K-1
      // and K are merged at run time, so it never reused them.
      if constexpr (EXACT) row = opaque(row);
      unpack8(row, x);
#pragma unroll
      for (int e = 0; e < 8; ++e) mix[e] = fmaf(prob[n], x[e], mix[e]);
    }
    if constexpr (EXACT && tuning::candidate_bucket(NMAX) != NMAX) {
      // N's bucket mixes rows past N as fma(+0, +0, acc) = acc + 0, which turns a -0 element into +0; one + 0
      // repeats that (as the persistent kernel's mix_pad does), so every kernel gives the bucket's bits
      // (tests/kernels/test_kernel_bits.py test_a_mixture_over_a_padded_bucket_adds_plus_zero).
#pragma unroll
      for (int e = 0; e < 8; ++e) mix[e] += 0.0f;
    }
    mixed = pack8(mix);
    unpack8(mixed, mix);  // from here on the mixture is its bf16 value
    if constexpr (!kNorm) {
      store16(p.output + token * p.output_stride + col, mixed);
    } else {
      if (p.mixture) store16(p.mixture + token * p.mixture_stride + col, mixed);
    }
  }

  if constexpr (kNorm) {
    // ---- trailing RMSNorm in Kimi's two-rounding order (ops.md step 7) ----
    float sq = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) sq = fmaf(mix[e], mix[e], sq);
    sq = warp_sum(sq);
    if (lane == 0) warp_sq[warp] = sq;
    __syncthreads();
    float total;
    if constexpr (exchange) {
      if (tid == 0) mbarrier_expect_tx(shared_address(&bars[1]), ranks * sizeof(float));
      if (tid < ranks) push_to_rank(&recv_sq[rank], &bars[1], ordered_sum<kMaxWarps>(warp_sq, 1, warps), tid);
      mbarrier_wait_parity(shared_address(&bars[1]), 0);
      total = ordered_sum<kMaxClusterRanks>(recv_sq, 1, ranks);
    } else {
      if (tid == 0) block_sq = chunked_sum<kMaxWarps>(warp_sq, 1, warps);
      __syncthreads();
      total = block_sq;
    }
    uint4 out = make_uint4(0, 0, 0, 0);
    if (valid) {
      out = rms_output8(mix, total, p.inv_hidden, p.norm_eps, norm_w);
      if (!kFp8 || p.output != nullptr)  // the FP8-only call stores no bf16 output
        store16(p.output + token * p.output_stride + col, out);
    }
    if constexpr (kFp8) fp8_epilogue<FP8, CLUSTER, kMaxWarps>(p, out, valid, token, vec, rank, ranks, tid, lane, warp,
                                                              warps, fp8_warp_amax, fp8_thread_amax, fp8_recv, &fp8_bar);
  }

  // No cluster barrier before exit: every push into this block's shared memory completed before its
  // mbarrier waits returned, and it pushes nothing after them.
}

// split_k's cluster instance of mode M and FP8 epilogue F for exactly `candidates` candidates
// (tuning::split_k_exact; nullptr outside [kSplitKExactMinCandidates, kMaxCandidates]). Defined once per (mode,
// epilogue) in the exact-instance translation units (cuda/attn_res_exact_instances_*.cu), which compile in
// parallel; every other unit sees only the extern declarations below.
template <Mode M, Fp8Mode F, int... I>
PerTokenKernel exact_instance_of(int candidates, std::integer_sequence<int, I...>) {
  PerTokenKernel kernel = nullptr;
  ((candidates == tuning::kSplitKExactMinCandidates + I
        ? (kernel = attn_res_per_token_kernel<tuning::kSplitKExactMinCandidates + I, M, true, F, true>)
        : kernel),
   ...);
  return kernel;
}
template <Mode M, Fp8Mode F>
PerTokenKernel exact_instance(int candidates) {
  constexpr int kCount = kMaxCandidates - tuning::kSplitKExactMinCandidates + 1;
  return exact_instance_of<M, F>(candidates, std::make_integer_sequence<int, kCount>{});
}
extern template PerTokenKernel exact_instance<Mode::mix, Fp8Mode::none>(int);
extern template PerTokenKernel exact_instance<Mode::norm, Fp8Mode::none>(int);
extern template PerTokenKernel exact_instance<Mode::add, Fp8Mode::none>(int);
extern template PerTokenKernel exact_instance<Mode::add2, Fp8Mode::none>(int);
extern template PerTokenKernel exact_instance<Mode::mix_add, Fp8Mode::none>(int);
extern template PerTokenKernel exact_instance<Mode::mix_add2, Fp8Mode::none>(int);
extern template PerTokenKernel exact_instance<Mode::norm, Fp8Mode::per_token>(int);
extern template PerTokenKernel exact_instance<Mode::norm, Fp8Mode::block128>(int);
extern template PerTokenKernel exact_instance<Mode::add, Fp8Mode::per_token>(int);
extern template PerTokenKernel exact_instance<Mode::add, Fp8Mode::block128>(int);
extern template PerTokenKernel exact_instance<Mode::add2, Fp8Mode::per_token>(int);
extern template PerTokenKernel exact_instance<Mode::add2, Fp8Mode::block128>(int);

// The instance for the plan's `max_candidates` (nullptr for none): split_k's clusters from
// kSplitKExactMinCandidates the exact-N instance, otherwise one case per entry of kCandidateBuckets
// (attnres/limits.hpp): a bucket added there without an instance here fails the static_assert. The cluster
// instances of the buckets the exact ones replace are never built. Used by the per-token launchers
// (cuda/attn_res_launch.cu, cuda/attn_res_mix_add_instances.cu).
template <Mode M, bool CLUSTER, Fp8Mode F>
auto per_token_instance(int max_candidates) -> PerTokenKernel {
  static_assert(kNumCandidateBuckets == 5, "one case per candidate bucket");
  static_assert(kCandidateBuckets[0] < tuning::kSplitKExactMinCandidates &&
                    kCandidateBuckets[1] >= tuning::kSplitKExactMinCandidates,
                "the exact instances replace every bucket but the first");
  if constexpr (tuning::split_k_exact(CLUSTER, kMaxCandidates)) {
    if (max_candidates >= tuning::kSplitKExactMinCandidates) return exact_instance<M, F>(max_candidates);
    return max_candidates == kCandidateBuckets[0] ? attn_res_per_token_kernel<kCandidateBuckets[0], M, CLUSTER, F>
                                                  : nullptr;
  } else {
    switch (max_candidates) {
      case kCandidateBuckets[0]: return attn_res_per_token_kernel<kCandidateBuckets[0], M, CLUSTER, F>;
      case kCandidateBuckets[1]: return attn_res_per_token_kernel<kCandidateBuckets[1], M, CLUSTER, F>;
      case kCandidateBuckets[2]: return attn_res_per_token_kernel<kCandidateBuckets[2], M, CLUSTER, F>;
      case kCandidateBuckets[3]: return attn_res_per_token_kernel<kCandidateBuckets[3], M, CLUSTER, F>;
      case kCandidateBuckets[4]: return attn_res_per_token_kernel<kCandidateBuckets[4], M, CLUSTER, F>;
      default: return nullptr;
    }
  }
}

}  // namespace attnres::detail
