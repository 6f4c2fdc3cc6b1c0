// Tuning constants of the plan. Each one is either a hardware/register limit (say which) or a measured
// choice on the H200 (docs/performance.md has the run it came from).
#pragma once

#include <cstdint>
#include <string_view>

#include "attnres/limits.hpp"

namespace attnres::tuning {

// The kernel-shape limits live in attnres/limits.hpp; why they have these values:
// * Buckets of N (kCandidateBuckets): Kimi K3's sites use N = 2..9; a bucket of 6 measured slower for N = 5-6
//   than the bucket of 9 for N = 7-9 (T = 1, H = 7168, add2: 3.80 vs 3.47 us).
// * single_cta's N <= 4 (kSingleCtaMaxCandidates): the N <= 8 instance spilled 160 bytes (ptxas -v).
// * Clusters of at most the portable 8 blocks (kMaxCluster): 16 (non-portable) measured no faster
//   (docs/performance.md).
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

// split_k's launches on a cluster run an instance built for the exact N from this N up, not for N's bucket: K
// is then a compile-time constant, so no loop over the candidates carries a padded row (its predicated load, its
// scores, its exp, its fma into the mixture) and the rows take only N's registers. Within a bucket the padded
// instance's time barely moved with N (docs/performance.md, "Exact N"). The bits are the bucket's (the instance
// repeats the padding's one effect, +0 on the mixture). N <= 2 keeps the bucket of 2 (nothing to drop), and the
// one-block launches (single_cta, a cluster of one) keep the buckets.
constexpr int32_t kSplitKExactMinCandidates = 3;
constexpr bool split_k_exact(bool cluster, int64_t n) { return cluster && n >= kSplitKExactMinCandidates; }

// The persistent kernel (cuda/attn_res_persistent.cuh, persistent_layout.hpp). Automatic geometry: two blocks
// per SM, each with a ring in half the SM's shared memory, wherever that geometry exists
// (persistent::two_blocks_fit: <= 256 threads, >= kPersistentMinSlots slots), one block with the whole
// 227 KB otherwise; one block measured slower, it cannot keep enough rows in flight while its consumers reduce
// and mix (docs/performance.md). Options::persistent_blocks_per_sm forces either.
// One pass keeps a token's rows resident from scoring to mixing and needs a slot per row; the automatic choice
// takes it when the ring also has these spare slots (to stream the next token meanwhile), two passes otherwise.
// Two blocks per SM: none, the SM's other block streams while this one reduces and mixes. At H = 7168 on an H100
// one pass without a spare slot ran 212 us where two passes ran 266 (T = 4096, N = 7, one addend) and level with
// a spare slot where both fit (bench_results/h100_f7e65a6_persistent_slots_ab.json). One block per SM: one spare
// slot (no other block to stream; one pass without a spare is not measured there).
constexpr int64_t persistent_one_pass_spare_slots(int32_t blocks_per_sm) { return blocks_per_sm >= 2 ? 0 : 1; }
// Slots two passes need: they hold at most the prefix and the addends at once (two with one addend or none,
// three with two); with fewer the plan declines.
constexpr int32_t kPersistentMinSlots = 2;
constexpr int32_t persistent_min_slots(bool add2) { return add2 ? kPersistentMinSlots + 1 : kPersistentMinSlots; }

// Grid x is T * cluster blocks (< 2^31).
constexpr int64_t kMaxTokensPerLaunch = int64_t{1} << 26;

// The GPU whose measurements the automatic choices follow: the H100's where the device's name says H100 (the
// persistent kernel is weaker there, the streaming single_cta stronger without the addend), the H200's on every
// other GPU.
enum class TopologyGrid { h200, h100 };
inline TopologyGrid topology_grid(std::string_view device_name) {
  return device_name.rfind("NVIDIA H100", 0) == 0 ? TopologyGrid::h100 : TopologyGrid::h200;
}

// single_cta vs split_k (automatic choice): up to one token per SM split_k measured faster at every point (one SM
// cannot keep a token's rows in flight as fast as 7-8 SMs do); with more tokens than SMs the streaming single_cta
// measured faster for N <= 2 at H = 7168 from T = 256 on, and slower for N = 3, 4 with the addend
// (docs/performance.md). Without the addend on the H100 it is also the fastest kernel at N = 3, 4: 4-12 % ahead
// of split_k and the persistent kernel from T = 512, level at T = 256 (h100_f7e65a6_topology_noadd.json); on the
// H200 the persistent kernel beat it at N = 3 from T = 1024 (h200_4dd1abb_topology_noadd*.json). Taken where the
// one-block layout has more than 512 threads (H > 4096), as at the measured H; the plan keeps split_k where the
// streaming buffers do not fit (plan.cpp).
constexpr int64_t kAutomaticStreamMinTokens = 256;
constexpr int64_t kAutomaticStreamMaxCandidates = 2;
constexpr int64_t kAutomaticStreamMaxCandidatesNoAddH100 = 4;
constexpr int64_t kAutomaticStreamMinThreads = 513;
inline bool prefer_single_cta(int64_t tokens, int64_t candidates, int64_t hidden, bool add,
                              TopologyGrid grid = TopologyGrid::h200) {
  const int64_t most = !add && grid == TopologyGrid::h100 ? kAutomaticStreamMaxCandidatesNoAddH100
                                                          : kAutomaticStreamMaxCandidates;
  return tokens >= kAutomaticStreamMinTokens && candidates <= most && hidden / 8 >= kAutomaticStreamMinThreads;
}

// The streaming single_cta (cuda/attn_res_stream.cuh): min(T, resident) blocks loop over the tokens,
// each prefetching its next token's rows into shared memory (cp.async) while it reduces the current one. Per
// buffer, slots 0 .. bucket - 2 hold the bank rows, slot bucket - 1 the prefix, then the addends; two buffers.
constexpr int32_t stream_slots(int32_t bucket, bool add, bool add2) {
  return bucket + (add ? 1 : 0) + (add2 ? 1 : 0);
}
// The 16-byte vectors of a row each of its threads owns: the lanes of single_cta's one-block layout per thread.
constexpr int32_t kStreamVectors = 2;
// The token buffers: the token being reduced and buffers - 1 being copied (`python -m bench stream`,
// Options::stream_buffers). At H = 7168 one block per SM runs (its registers), so a token that reads one row
// (N = 1 without an addend: an RMSNorm of the prefix) has ~14 KB in flight per SM with two buffers; on the H100
// four buffers ran 12 % faster at T = 4096 and 5 % at T = 1024 (bench_results/h100_5a85df6_stream_buffers.json).
// Everywhere else two: with an addend more buffers ran 1-10 % slower (N = 1..4); without one, N = 2 stayed within
// 3 % either way and N = 3, 4 ran level or slower. The H200's counts are not measured yet: two everywhere.
constexpr int32_t kStreamBuffers = 2;
constexpr int32_t kStreamBuffersOneRowH100 = 4;
constexpr int32_t kStreamMaxBuffers = 4;
constexpr int32_t stream_buffers(int64_t candidates, bool add, bool add2, TopologyGrid grid = TopologyGrid::h200) {
  return (void)add2, grid == TopologyGrid::h100 && candidates == 1 && !add ? kStreamBuffersOneRowH100 : kStreamBuffers;
}
// The buffer counts the streaming kernel is built with, per N bucket (cuda/attn_res_stream.cuh stream_instance).
constexpr bool stream_buffers_built(int32_t bucket, int32_t buffers) {
  return buffers >= 2 && buffers <= (bucket == 2 ? kStreamMaxBuffers : 3);
}
// The buffers' bytes for a block of `threads` threads (kStreamVectors lanes each).
constexpr int64_t stream_smem_bytes(int32_t bucket, bool add, bool add2, int32_t threads, int32_t buffers) {
  return int64_t{buffers} * stream_slots(bucket, add, add2) * threads * kStreamVectors * 16;
}
// What the plan leaves of the block's shared memory for the kernel's static arrays (~1.3 KB in the one-block
// instances of buckets 2 and 4: the per-warp partial sums).
constexpr int64_t kStreamStaticSharedBytes = 4096;

// The token-block single_cta (cuda/attn_res_blocks.cuh): one block per token (grid = T), several resident per SM,
// each thread owning kTokenBlocksVectors vectors of a row (one of each of that many of split_k's rank chunks, so a
// block has ceil(split_k_cluster(H) / 4) groups of kSplitKBlockVectors threads: 256 at H = 7168). It takes no
// shared-memory ring; the SM's other blocks overlap a token's serial chain of barriers and block sums, which the
// streaming single_cta's one block per SM cannot. Registers bounded for 3 blocks per SM at N <= 2 (80 registers,
// no spills, ptxas 13.0) and 2 at N = 3, 4 (128, <= 8 bytes spilled); at N <= 2, 3 blocks of 256 threads ran
// level with or faster than 4 blocks of 128 threads (7 vectors each) and 2 of 256 (h100_6af7c58_token_blocks_ab.txt).
constexpr int32_t kTokenBlocksVectors = 4;
// An instance built for exactly N = 3 (no padded fourth candidate), reached only through the benchmark knob
// Options::token_blocks_exact_n: bounded for 3 blocks per SM (80 registers; 16 bytes spilled without an addend,
// 56-192 with one or two, ptxas 13.0), each slot's scores reduced on their own (8 values per reduce-scatter,
// not 32) so that they fit. An experiment: the bucket's instance holds attn_res_rmsnorm at N = 3 to 74-77 % of
// the copy rate at T = 4096 with two blocks per SM.
constexpr int32_t kTokenBlocksExactCandidates = 3;
// max_candidates: the instance's N (single_cta's bucket 2 or 4, or kTokenBlocksExactCandidates).
constexpr int32_t token_blocks_per_sm(int32_t max_candidates) { return max_candidates <= 3 ? 3 : 2; }
// The automatic choice takes it where it measured faster than the kernel taken before (the streaming single_cta at
// N <= 2, split_k at N = 3 with one addend, the streaming kernel without an addend at N = 3, 4) on the H100 at
// H = 7168, T = 4096 and 16384 (h100_6af7c58_token_blocks_ab.txt, cold L2, interleaved, same run; again at T = 4096
// in h100_68c355c_token_blocks.txt): attn_res_add_rmsnorm N = 1..3 (two addends N = 1, 2), attn_res N = 1, 2 with or
// without addends (with one, N = 3 ran 2-7 % behind split_k), attn_res_rmsnorm N = 2..4 (1-3 % ahead at T = 4096,
// 6 % at N = 2, T = 16384; not N = 1, where the streaming kernel's four token buffers stay 4 % ahead). At T = 2048 it
// ran level or up to 7 % slower but for one addend at N = 1, and at T = 1024 7-30 % slower (2.6 blocks per resident
// slot: the last partial round weighs more), so from T = 4096 on. The H200 is not measured: it keeps the streaming
// kernel. Where the one-block layout has more than 512 threads (H > 4096), as at the measured H.
constexpr int64_t kTokenBlocksMinTokensH100 = 4096;
constexpr int64_t kNeverTokenBlocks = kMaxTokensPerLaunch + 1;
// addends: 0, 1 or 2; norm: the op ends in the RMSNorm (attn_res_rmsnorm, attn_res_add_rmsnorm).
constexpr int64_t automatic_token_blocks_min_tokens(int64_t candidates, int64_t hidden, int32_t addends, bool norm,
                                                    TopologyGrid grid = TopologyGrid::h200) {
  if (grid != TopologyGrid::h100 || hidden / 8 < kAutomaticStreamMinThreads) return kNeverTokenBlocks;
  const bool faster = !norm          ? candidates <= 2
                      : addends == 1 ? candidates <= 3
                      : addends == 2 ? candidates <= 2
                                     : candidates >= 2 && candidates <= 4;
  return faster && candidates >= 1 ? kTokenBlocksMinTokensH100 : kNeverTokenBlocks;
}

// split_k cluster size: enough blocks that each owns at most kSplitKBlockVectors vectors (1024 elements),
// capped at the portable 8. A function of H only, never of T: a token's result must not depend on how many
// tokens share the call. It fixes the reduction order of every kernel (see split_k_chunk). At H = 7168 (7 blocks)
// measured level with 8 blocks at T = 1 and faster at T = 32 (3.66 vs 3.59 us, 5.37 vs 5.76 us).
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

// The automatic topology: the persistent kernel where it was measured faster than split_k (each GPU's grid,
// topology_grid, H = 7168: docs/performance.md) — on the two-blocks-per-SM geometry (the persistent plan's for the call:
// `two_blocks_per_sm`; one block per SM measured slower than split_k everywhere) and
// T >= automatic_persistent_min_tokens(N, H, addends); the per-token kernels everywhere else. The bits are the same
// either way (both reduce in split_k's order). The persistent kernel's time grows with N (it streams every row).
// Without the addend (`python -m bench topology --no-add`) the persistent kernel gains more. The thresholds below
// T = 4096 were measured at H = 7168 only and are taken where the per-token kernels run as they do there (H > 4096:
// split_k's cluster of more than four blocks); at H <= 4096 the rule keeps T >= 4096 and the same range of N.
constexpr int64_t kAutomaticPersistentMinTokens = 4096;  // at H <= 4096, and where the table says so
constexpr int64_t kNeverPersistent = kMaxTokensPerLaunch + 1;
// The H200's, by N = 1 .. 16 (index N - 1), H > 4096, with one addend (h200_80e29ff_topology.json,
// h200_4dd1abb_topology.json) and without (h200_4dd1abb_topology_noadd*.json). They were measured against split_k
// built per candidate bucket (its instance computed the whole bucket), so the persistent kernel won below the top of
// a bucket (N = 5..8, 10) from a few hundred tokens; split_k's exact-N instances (split_k_exact) beat it there on the
// H100 and may on the H200, which is not remeasured yet. Two addends: not measured, never.
constexpr int64_t kAutomaticPersistentMinTokensByN[kMaxCandidates] = {
    4096, 4096, 2048, 4096, 128, 256, 256, 256, 512, 256, kNeverPersistent, kNeverPersistent,
    kNeverPersistent, kNeverPersistent, kNeverPersistent, kNeverPersistent};
constexpr int64_t kAutomaticPersistentMinTokensNoAddByN[kMaxCandidates] = {
    4096, 4096, 256, 512, 128, 128, 256, 256, 512, 256, 256, 256,
    256, kNeverPersistent, kNeverPersistent, kNeverPersistent};
constexpr int64_t kAutomaticPersistentMeasuredMinHidden = 4097;
// The H100's: never, by the rule of bench/prefill.py persistent_from (from the smallest measured T where the
// persistent kernel ran >= 3 % faster than every other kernel, there and at every larger T; `python -m bench
// prefill --forced` prints it). Against split_k's exact-N instances it lost at N = 5..8 at T = 1024 and 4096 with
// one addend, two, and without one (attn_res, which takes the normed op's row): 1.04-1.38x split_k's time
// (h100_924fd69_forced58.json); at T = 128..512 it was never 3 % ahead (h100_954562b_forced58_small.json). At the
// other N it lost to the bucket's split_k already (h100_f7e65a6_topology*.json, h100_5a85df6_add2_grid.json), which
// the exact instances only made faster; N = 3 led by 2 % at T = 4096 only.
// addends: 0 (attn_res_rmsnorm, attn_res), 1 or 2 (attn_res_add_rmsnorm).
constexpr int64_t automatic_persistent_min_tokens(int64_t candidates, int64_t hidden, int32_t addends,
                                                  TopologyGrid grid = TopologyGrid::h200) {
  if (candidates < 1 || candidates > kMaxCandidates || addends < 0 || addends > 2) return kNeverPersistent;
  if (grid == TopologyGrid::h100 || addends == 2) return kNeverPersistent;
  const int64_t measured = (addends == 0 ? kAutomaticPersistentMinTokensNoAddByN
                                         : kAutomaticPersistentMinTokensByN)[candidates - 1];
  if (measured == kNeverPersistent || hidden >= kAutomaticPersistentMeasuredMinHidden) return measured;
  return kAutomaticPersistentMinTokens;
}
constexpr bool automatic_prefers_persistent(int64_t tokens, int64_t candidates, int64_t hidden, int32_t addends,
                                            bool two_blocks_per_sm, TopologyGrid grid = TopologyGrid::h200) {
  return two_blocks_per_sm && tokens >= automatic_persistent_min_tokens(candidates, hidden, addends, grid);
}

}  // namespace attnres::tuning
