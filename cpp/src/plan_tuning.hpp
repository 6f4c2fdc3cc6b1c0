// Tuning constants of the plan. Each one is either a hardware/register limit (say which) or a measured
// choice on the H200 (docs/performance.md has the run it came from).
#pragma once

#include <cstdint>

namespace attnres::tuning {

// Compile-time buckets of N the per-token kernels are instantiated for (registers and instructions per
// thread scale with the bucket; N itself is a runtime value <= the bucket). Kimi K3's sites use N = 2..9.
constexpr int32_t kCandidateBuckets[] = {2, 4, 6, 9, 12, 16};
constexpr int kNumCandidateBuckets = 6;

// single_cta keeps a token's N rows in one block's registers, one 16-byte vector per thread and row:
// 1024 threads (the block limit) x 8 elements bounds H to 8192, and the 64-register cap of a 1024-thread
// block bounds N to 4 (the N <= 8 instance spilled 160 bytes; ptxas -v).
constexpr int64_t kSingleCtaMaxThreads = 1024;
constexpr int64_t kSingleCtaMaxCandidates = 4;

// split_k blocks are compiled for at most 256 threads (so the N = 16 bucket keeps its 64 registers of row
// data without spilling); H = 16384 fits a cluster of 8.
constexpr int64_t kSplitKMaxThreads = 256;
// Portable cluster limit is 8; Hopper allows 16 with the non-portable attribute (set by the launcher).
constexpr int32_t kMaxCluster = 16;

// Grid x is T * cluster blocks (< 2^31).
constexpr int64_t kMaxTokensPerLaunch = int64_t{1} << 26;

// single_cta vs split_k (automatic choice). Starting point: the reference stacks' N <= 4 boundary;
// replaced by the H200 measurement in docs/performance.md.
inline bool prefer_single_cta(int64_t tokens, int64_t candidates, int64_t hidden) {
  (void)tokens;
  (void)hidden;
  return candidates <= 4;
}

// split_k cluster size: enough blocks that each owns at most 128 vectors (1024 elements), capped at the
// portable 8.
inline int32_t split_k_cluster(int64_t hidden) {
  const int64_t vecs = hidden / 8;
  int64_t c = (vecs + 127) / 128;
  if (c < 1) c = 1;
  if (c > 8) c = 8;
  return static_cast<int32_t>(c);
}

}  // namespace attnres::tuning
