// Tuning constants of the plan. Each one is either a hardware/register limit (say which) or a measured
// choice on the H200 (docs/performance.md has the run it came from).
#pragma once

#include <cstdint>

#include "attnres/limits.hpp"

namespace attnres::tuning {

// The kernel-shape limits live in attnres/limits.hpp; why they have these values:
// * Buckets of N (kCandidateBuckets): Kimi K3's sites use N = 2..9. No bucket of 6: measured on the H200
//   (T = 1, H = 7168, add2), N = 5-6 in a bucket of 6 took 3.80 us, N = 7-9 in the bucket of 9 took 3.47 us.
// * single_cta's N <= 4 (kSingleCtaMaxCandidates): the N <= 8 instance spilled 160 bytes (ptxas -v).
// * Clusters of at most the portable 8 blocks (kMaxCluster): 16 (non-portable) was measured no faster on the
//   H200 (T = 1, N = 9, H = 7168: 3.60 us vs 3.59 us at 8; docs/performance.md).
using attnres::kCandidateBuckets;
using attnres::kMaxCluster;
using attnres::kNumCandidateBuckets;
using attnres::kSingleCtaMaxCandidates;
using attnres::kSingleCtaMaxThreads;
using attnres::kSplitKMaxThreads;

// The smallest bucket that holds n candidates (the per-token kernels' instance; the persistent kernel repeats
// what the bucket's padding does to the mixture).
constexpr int32_t candidate_bucket(int64_t n) {
  for (int32_t b : kCandidateBuckets)
    if (n <= b) return b;
  return kCandidateBuckets[kNumCandidateBuckets - 1];
}


// The persistent kernel (cuda/attn_res_persistent.cuh, persistent_layout.hpp). Automatic geometry: two blocks
// per SM, each with a ring in half the SM's shared memory, wherever that geometry exists
// (persistent::two_blocks_fit: no FP8, <= 256 threads, >= kPersistentMinSlots slots), one block with the whole
// 227 KB otherwise. Measured on the H200 (bench_results/h200_dbab092_persistent_variants.json, H = 7168, add,
// python -m attnres.bench persistent --variants): two blocks of 7 slots took 107.8 us at T = 4096, N = 2 and
// 926.7 us at T = 16384, N = 9 (two passes), one block of 16 slots 164.6 and 1155.7 us: one block cannot
// keep enough rows in flight while its consumers reduce and mix. Options::persistent_blocks_per_sm forces either.
// One pass keeps a token's rows resident from scoring to mixing; it needs the ring to hold them plus at
// least this many slots, so the next token's rows stream while this one is reduced and mixed (otherwise
// nothing is in flight between a token's last row landing and its first row being released). At H = 7168
// (16 slots) that is N <= 14 with an addend, N <= 15 without; larger tokens take two passes.
constexpr int64_t kPersistentOnePassSpareSlots = 1;
// Two passes hold at most the prefix and the addend at once; with fewer slots the plan declines.
constexpr int32_t kPersistentMinSlots = 2;

// Grid x is T * cluster blocks (< 2^31).
constexpr int64_t kMaxTokensPerLaunch = int64_t{1} << 26;

// single_cta vs split_k (automatic choice). Up to one token per SM, split_k is faster at every point measured on
// the H200 (add2, H = 7168, CUDA-graph replay, cold L2), N = 2 included (T = 1: 3.16 us vs 4.15 us; T = 8: 3.29
// vs 4.28; T = 32: 3.93 vs 4.50): one SM cannot keep a token's rows in flight as fast as 7-8 SMs do. With more
// tokens than SMs single_cta streams (stream_slots above), and for N <= 2 (the bucket of 2) at H = 7168 that was
// faster than split_k and the persistent kernel from T = 256 on (bench_results/h200_c5f5581_stream_ab.json, add,
// us per call: T = 256 9.36 vs split_k 9.93; 1024: 27.9 vs 32.3; 4096: 95.2 vs 114.3 and persistent 114.7;
// 16384: 352 vs 431 and 406; add2 at 4096: 106.6 vs 120.9), slower at T = 128 (5.97 vs 5.55, streaming
// forced), and slower than split_k for N = 3, 4 at every T (the bucket of 4: 161.7 vs 145.0 at 4096). With the
// padded block sums (bench_results/h200_1b20642_stream_padded_ab.txt): 86.6 vs split_k 114.1 us at T = 4096, N = 2,
// 8.74 vs 9.97 at T = 256, and level in the bucket of 4 (143.1 vs 141.0 at T = 4096, N = 4); with two vectors per
// thread (bench_results/h200_641e258_stream_ab.txt): 85.6 vs 113.2, 8.57 vs 9.88, 143.7 vs 139.8, and with two
// addends 91.3 vs 118.6. Taken where the one-block layout has more than 512 threads (H > 4096), as at the measured
// H (where one block of it filled an SM's registers; the bound was measured on the one-vector kernel); the plan
// keeps split_k where the streaming buffers do not fit (plan.cpp).
constexpr int64_t kAutomaticStreamMinTokens = 256;
constexpr int64_t kAutomaticStreamMaxCandidates = 2;
constexpr int64_t kAutomaticStreamMinThreads = 513;
inline bool prefer_single_cta(int64_t tokens, int64_t candidates, int64_t hidden) {
  return tokens >= kAutomaticStreamMinTokens && candidates <= kAutomaticStreamMaxCandidates &&
         hidden / 8 >= kAutomaticStreamMinThreads;
}

// The streaming single_cta (cuda/attn_res_stream.cuh): min(T, resident) blocks loop over the tokens,
// each prefetching its next token's rows into shared memory (cp.async) while it reduces the current one. Per
// buffer, slots 0 .. bucket - 2 hold the bank rows, slot bucket - 1 the prefix, then the addends; two buffers.
constexpr int32_t stream_slots(int32_t bucket, bool add, bool add2) {
  return bucket + (add ? 1 : 0) + (add2 ? 1 : 0);
}
// The 16-byte vectors of a row each of its threads owns: the lanes of single_cta's one-block layout per thread.
constexpr int32_t kStreamVectors = 2;
// The token buffers: the token being reduced and kStreamBuffers - 1 being copied. Three (two tokens in flight)
// measured no faster on the H200 (bench_results/h200_641e258_stream_ab.txt: T = 4096, N = 2 85.3 vs 86.2 us,
// add2 95.0 vs 92.0, T = 256 9.40 vs 8.63): a block's step is bound by its own arithmetic, not by the copy.
constexpr int32_t kStreamBuffers = 2;
// The buffers' bytes for a block of `threads` threads (kStreamVectors lanes each).
constexpr int64_t stream_smem_bytes(int32_t bucket, bool add, bool add2, int32_t threads) {
  return int64_t{kStreamBuffers} * stream_slots(bucket, add, add2) * threads * kStreamVectors * 16;
}
// Options::stream_min_tokens that no call reaches (the one-kernel all-reduce site plans with it).
constexpr int64_t kNeverStream = kMaxTokensPerLaunch + 1;
// What the plan leaves of the block's shared memory for the kernel's static arrays (~1.3 KB in the one-block
// instances of buckets 2 and 4: the per-warp partial sums).
constexpr int64_t kStreamStaticSharedBytes = 4096;

// split_k cluster size: enough blocks that each owns at most kSplitKBlockVectors vectors (1024 elements),
// capped at the portable 8. A function of H only, never of T: a token's result must not depend on how many
// tokens share the call. It fixes the reduction order of every kernel (see split_k_chunk). Measured at H = 7168
// (7 blocks): 3.66 us at T = 1, N = 9 (8 blocks: 3.59 us) and 5.37 us at T = 32 (8 blocks: 5.76 us).
constexpr int64_t kSplitKBlockVectors = 128;
constexpr int32_t split_k_cluster(int64_t hidden) {
  const int64_t vecs = hidden / 8;
  int64_t c = (vecs + kSplitKBlockVectors - 1) / kSplitKBlockVectors;
  if (c < 1) c = 1;
  if (c > kMaxCluster) c = kMaxCluster;
  return static_cast<int32_t>(c);
}

// The reference reduction order, which every CUDA kernel reproduces so that output and mixture bits do not
// depend on the kernel: the row's H / 8 vectors are cut into split_k_cluster(H) rank chunks of split_k_chunk(H)
// vectors (the last may be shorter or empty); a sum over H is, per vector, an fma chain over its 8 elements,
// then per 32-vector warp of a chunk a butterfly over the lanes (xor 16, 8, 4, 2, 1; lanes past the chunk or
// the row add +0), then the chunk's warps in order from +0, then the chunks in order from +0.
constexpr int32_t split_k_chunk(int64_t hidden) {
  const int64_t vecs = hidden / 8, c = split_k_cluster(hidden);
  return static_cast<int32_t>((vecs + c - 1) / c);
}
constexpr int32_t split_k_chunk_warps(int64_t hidden) { return (split_k_chunk(hidden) + 31) / 32; }

// The automatic topology: the persistent kernel where it was measured faster than split_k — one addend (no
// add2), on the two-blocks-per-SM geometry (the persistent plan's for the call: `two_blocks_per_sm`), and
// T >= automatic_persistent_min_tokens(N, H); the per-token kernels everywhere else. The bits are the same either
// way (both reduce in split_k's order). What decides it: the persistent kernel's time grows with N (it streams
// the N - 1 bank rows, the prefix and the addend; each row costs it ~2.5x its transfer time, docs/performance.md),
// split_k's with its candidate bucket (kCandidateBuckets: its instance computes the whole bucket, zero rows
// included). The table is the H200's grid (python -m attnres.bench topology, bench_results/
// h200_80e29ff_topology.json: H = 7168, add, cold L2, CUDA-graph replay, us per call, persistent vs split_k):
//   * N = 5..8 and 10, below the top of split_k's bucket of 9 or 12: persistent faster from T = 256 (N = 5: from
//     128, 8.81 vs 9.47): at T = 256 13.7-17.2 vs 17.8-18.5 (N = 5..8), 19.8 vs 21.1 (N = 10); at 1024 40.5 vs
//     62.4 (N = 5), 69.2 vs 74.9 (N = 10); slower at T = 128 for N = 7..10 (10.2-13.9 vs 9.9-11.5).
//   * N = 9, the bucket's top: level at T = 256 (18.6 vs 18.7), faster from 512 (32.8 vs 34.5; 1024: 60.2 vs
//     65.5; 4096: 236.3 vs 253.8).
//   * N = 3, 4, the bucket of 4: N = 3 level at T = 1024 (34.7 both), faster from 2048 (63.4 vs 66.4; 4096: 120.4
//     vs 130.3); N = 4 slower up to 2048 (69.4 vs 67.6), level at 4096 (133.4 vs 133.1).
//   * N <= 2: the streaming single_cta first where H > 4096 (prefer_single_cta); elsewhere the persistent kernel
//     beat split_k at T = 4096 (bench_results/h200_dbab092_persistent_variants.json: 107.8 vs 111.2).
//   * N >= 11: never faster (N = 11 level at T = 256 and 512, 21.4 and 39.7 both; slower at every other point,
//     T = 4096: 310.8 vs 295.1 at N = 11, 493.1 vs 348.8 at 16): split_k's buckets of 12 and 16 add little
//     over 9's.
// One block per SM was slower than split_k at every point (629.8 vs 430.7 at T = 16384, N = 2), and so was the
// persistent kernel without the addend (bench_results/h200_c99ff4f_persistent_quick.json: 1089 vs 980 us at
// T = 16384, N = 9). The thresholds below T = 4096 were measured at H = 7168 only and are taken where the
// per-token kernels run as they do there (H > 4096: split_k's cluster of more than four blocks); at H <= 4096 the
// rule keeps T >= 4096 and the same range of N.
constexpr int64_t kAutomaticPersistentMinTokens = 4096;  // at H <= 4096, and where the table says so
constexpr int64_t kNeverPersistent = kMaxTokensPerLaunch + 1;
// By N = 1 .. 16 (index N - 1), H > 4096.
constexpr int64_t kAutomaticPersistentMinTokensByN[kMaxCandidates] = {
    4096, 4096, 2048, 4096, 128, 256, 256, 256, 512, 256, kNeverPersistent, kNeverPersistent,
    kNeverPersistent, kNeverPersistent, kNeverPersistent, kNeverPersistent};
constexpr int64_t kAutomaticPersistentMeasuredMinHidden = 4097;
constexpr int64_t automatic_persistent_min_tokens(int64_t candidates, int64_t hidden) {
  if (candidates < 1 || candidates > kMaxCandidates) return kNeverPersistent;
  const int64_t measured = kAutomaticPersistentMinTokensByN[candidates - 1];
  if (measured == kNeverPersistent || hidden >= kAutomaticPersistentMeasuredMinHidden) return measured;
  return kAutomaticPersistentMinTokens;
}
constexpr bool automatic_prefers_persistent(int64_t tokens, int64_t candidates, int64_t hidden, bool add,
                                            bool two_blocks_per_sm) {
  return add && two_blocks_per_sm && tokens >= automatic_persistent_min_tokens(candidates, hidden);
}

// The fused all-reduce site's automatic design (all_reduce_attn_res_add_rmsnorm): one kernel (the per-token
// kernel exchanges the partial, design a) or two kernels joined by PDL (the one-shot all-reduce, then the plain
// op, design b). Measured on the H200 (python -m attnres.bench allreduce: the in-process W = 2 world, H = 7168,
// N = 9, site add): since the plain per-token kernel reduces its candidates in two phases, two kernels are the
// faster design at every T measured (bench_results/h200_b430bf0_allreduce.json: 7.02 / 7.63 / 8.54 / 15.09 us at
// T = 1 / 4 / 8 / 32, against 7.39 / 7.70 / 8.65 / 15.41 for one kernel, and against one kernel's best earlier
// measurement, 7.24 / 7.88 / 9.63 / 18.62 in bench_results/h200_f25619c_allreduce.json), so automatic takes two
// kernels at every T (a bound of 0 tokens); one kernel remains an explicit choice.
constexpr int64_t kAutomaticOneKernelMaxTokens = 0;
inline bool automatic_prefers_one_kernel(int64_t tokens, int64_t candidates, int64_t hidden, int32_t world_size) {
  (void)candidates;
  (void)hidden;
  (void)world_size;
  return tokens <= kAutomaticOneKernelMaxTokens;
}

}  // namespace attnres::tuning
