// Every limit of the library in one place: the supported range of the ops (a call outside it is rejected,
// never computed) and the kernel-shape limits the plan and the CUDA kernels are both built from. The
// static_asserts tie the dependent ones together, so changing one limit without the others fails to compile
// instead of overflowing a buffer. Host and device code include this header (constexpr only).
#pragma once

#include <cstdint>

namespace attnres {

// Tensors cross the API as TensorRef: at most this many dimensions.
constexpr int kMaxRank = 4;

// The attention-residual ops: N = K + 1 candidates, hidden size H.
constexpr int64_t kMaxCandidates = 16;
constexpr int64_t kMaxHidden = 16384;
constexpr int64_t kHiddenMultiple = 8;  // the kernels move 16-byte vectors of 8 bf16

// moe_finalize: T tokens, k routes per token, hidden size D.
constexpr int64_t kMoeFinalizeMaxRoutes = 32;
constexpr int64_t kMoeFinalizeMaxTokens = 16384;
constexpr int64_t kMoeFinalizeMaxHidden = 16384;
constexpr int64_t kMoeFinalizeHiddenMultiple = 8;

// all_reduce and the ops fused with it: the world sizes the one-shot kernels are built for (every rank's
// partial is read in one pass of an unrolled loop over W; a world outside this set takes NCCL).
constexpr int32_t kAllReduceWorldSizes[] = {2, 4, 8};
constexpr int kNumAllReduceWorldSizes = sizeof(kAllReduceWorldSizes) / sizeof(kAllReduceWorldSizes[0]);

// Compile-time buckets of N the per-token kernels are instantiated for (registers and instructions per
// thread scale with the bucket; N itself is a runtime value <= the bucket). Why these: plan_tuning.hpp.
constexpr int32_t kCandidateBuckets[] = {2, 4, 9, 12, 16};
constexpr int kNumCandidateBuckets = sizeof(kCandidateBuckets) / sizeof(kCandidateBuckets[0]);

// single_cta: one 16-byte vector per thread and row in one block; the block limit of 1024 threads bounds H
// to 8192 and the 64-register cap of a 1024-thread block bounds N to 4.
constexpr int64_t kSingleCtaMaxThreads = 1024;
constexpr int64_t kSingleCtaMaxCandidates = 4;
// split_k: blocks of at most 256 threads (the N = 16 bucket keeps its rows in 64 registers without
// spilling), clusters of at most the portable 8 blocks.
constexpr int64_t kSplitKMaxThreads = 256;
constexpr int32_t kMaxCluster = 8;

namespace limits_detail {
constexpr bool buckets_ascending() {
  for (int i = 1; i < kNumCandidateBuckets; ++i)
    if (kCandidateBuckets[i] <= kCandidateBuckets[i - 1]) return false;
  return true;
}
constexpr bool is_bucket(int64_t n) {
  for (int i = 0; i < kNumCandidateBuckets; ++i)
    if (kCandidateBuckets[i] == n) return true;
  return false;
}
}  // namespace limits_detail

static_assert(limits_detail::buckets_ascending(), "candidate buckets must be strictly ascending");
static_assert(kAllReduceWorldSizes[0] >= 2, "a one-shot all-reduce world has at least 2 ranks");
static_assert(kCandidateBuckets[kNumCandidateBuckets - 1] == kMaxCandidates,
              "the largest per-token bucket must be the ops' N limit");
static_assert(limits_detail::is_bucket(kSingleCtaMaxCandidates), "single_cta's N limit must be a bucket");
static_assert(kMaxHidden % kHiddenMultiple == 0, "H limit must be a multiple of the vector width");
static_assert(kMaxHidden / kHiddenMultiple <= kMaxCluster * kSplitKMaxThreads,
              "split_k must cover the largest H with one vector per thread");
static_assert(kMoeFinalizeMaxHidden % kMoeFinalizeHiddenMultiple == 0, "D limit must be a multiple of 8");

}  // namespace attnres
