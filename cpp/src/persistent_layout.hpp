// Shared-memory layout of the persistent kernel, in one place for the plan (which sizes the ring from the
// device's shared-memory budget), the launcher and the kernel (which take the offsets from here). W = the
// consumer warps of H (consumer_threads / 32), N = the call's candidates, S = the ring's slots:
//
//   [0, partials_bytes)    per candidate and consumer warp: (sum of squares, dot with q)   [N][W][2] fp32; the
//                          FP8 block128 epilogue's group amax reuses it                    [H / 128] u32
//   [mix_squares_offset)   per consumer warp: the mixture's sum of squares                 [8] fp32, then
//                          the FP8 epilogue's amax (per_token)                             [8] u32
//   [barriers_offset)      the ring's mbarriers: full[S], then empty[S]                     8 bytes each
//   [norm_weight_offset)   H > 8192 only: the norm weight, bf16 (each thread's own vectors)  slot_bytes
//   [ring_offset, ...)     S row slots of slot_bytes each (128-byte aligned)
//
// The header is sized for the call's N and W, not for the largest: at H = 7168 two blocks per SM then fit 8 slots
// for N <= 14 (a token of N <= 7 with the addend, or N <= 8 without, in one pass) where a header sized for N = 16
// and 8 warps left room for 7.
//
// constexpr functions: usable from host code (plan.cpp, no CUDA) and device code alike.
#pragma once

#include <cstdint>

#include "attnres/limits.hpp"
#include "plan_tuning.hpp"

namespace attnres::persistent {

// The partials buffer is sized for every candidate the ops accept.
constexpr int32_t kMaxCandidates = static_cast<int32_t>(attnres::kMaxCandidates);
constexpr int32_t kMaxConsumerWarps = 8;    // 256 consumer threads
constexpr int32_t kProducerThreads = 32;    // one producer warp
constexpr int32_t kMaxThreads = kMaxConsumerWarps * 32 + kProducerThreads;
constexpr int32_t kMaxSlots = 64;

constexpr int64_t kMixSquaresBytes = 64;
// The FP8 epilogue's per-warp amax (per_token mode): the upper half of the mixture-squares block, unused by it.
constexpr int64_t kFp8AmaxInMixSquares = 4 * kMaxConsumerWarps;
static_assert(kFp8AmaxInMixSquares + 4 * kMaxConsumerWarps <= kMixSquaresBytes, "FP8 amax fits");
constexpr int64_t kSlotAlign = 128;

constexpr int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The consumers reproduce split_k's reduction order (plan_tuning.hpp split_k_chunk): lane l of a consumer warp
// owns, as its vector j, lane l of one split_k warp ("chunk warp") of one rank chunk, so a butterfly per j gives
// split_k's warp sums bit for bit. Consumer warps are assigned to chunks in order, warps_per_chunk(H) to each:
//   * one per chunk warp (vectors_per_thread = 1) when all chunk warps fit the 8 consumer warps (H <= 2048);
//   * otherwise one per chunk, holding its chunk warps as j = 0.. (vectors_per_thread = that count's bucket
//     1/2/4/8; the j past it own nothing), which sums them in order itself.
// A function of H only: the thread that owns an element, hence every reduction order, never depends on T or
// on the grid.
constexpr int32_t warps_per_chunk(int64_t hidden) {
  const int32_t chunk_warps = tuning::split_k_chunk_warps(hidden);
  return tuning::split_k_cluster(hidden) * chunk_warps <= kMaxConsumerWarps ? chunk_warps : 1;
}
constexpr int32_t vectors_per_thread(int64_t hidden) {
  const int32_t per = tuning::split_k_chunk_warps(hidden) / warps_per_chunk(hidden);  // exact: 1 or chunk_warps
  return per <= 1 ? 1 : per <= 2 ? 2 : per <= 4 ? 4 : 8;
}
constexpr int32_t consumer_threads(int64_t hidden) {
  return tuning::split_k_cluster(hidden) * warps_per_chunk(hidden) * 32;
}
// The vector (index into the row's H / 8) that consumer warp `warp`, lane `lane` owns as its vector j, or -1 when
// it owns none there (past its chunk warp's lanes, its chunk or the row). Consumer warp w serves chunk
// w / warps_per_chunk and, within it, chunk warps (w % warps_per_chunk) * V + j.
constexpr int32_t chunk_of_warp(int32_t warp, int32_t warps_per_chunk_) { return warp / warps_per_chunk_; }
constexpr int32_t position_in_chunk(int32_t warp, int32_t lane, int32_t j, int32_t vectors_per_thread_,
                                    int32_t warps_per_chunk_) {
  return ((warp % warps_per_chunk_) * vectors_per_thread_ + j) * 32 + lane;
}
constexpr int32_t owned_vector(int32_t warp, int32_t lane, int32_t j, int32_t vectors_per_thread_,
                               int32_t warps_per_chunk_, int32_t chunk, int32_t vectors) {
  const int32_t in_chunk = position_in_chunk(warp, lane, j, vectors_per_thread_, warps_per_chunk_);
  const int32_t v = chunk_of_warp(warp, warps_per_chunk_) * chunk + in_chunk;
  return in_chunk < chunk && v < vectors ? v : -1;
}

// The 8-vector bucket keeps the norm weight in shared memory (registers: see the kernel).
constexpr bool norm_weight_in_shared(int32_t vectors) { return vectors == 8; }

// One slot holds one candidate row (2H bytes), padded so every slot starts 128-byte aligned.
constexpr int64_t slot_bytes(int64_t hidden) { return round_up(2 * hidden, kSlotAlign); }
// The header's blocks (see the layout above); 16-byte multiples, so the mbarriers are 8-byte aligned.
constexpr int64_t partials_bytes(int64_t candidates, int64_t hidden) {
  const int64_t scores = candidates * (consumer_threads(hidden) / 32) * 2 * 4;
  const int64_t fp8_groups = (hidden / 8 + 15) / 16 * 4;
  return round_up(scores > fp8_groups ? scores : fp8_groups, 16);
}
constexpr int64_t mix_squares_offset(int64_t candidates, int64_t hidden) { return partials_bytes(candidates, hidden); }
constexpr int64_t barriers_offset(int64_t candidates, int64_t hidden) {
  return mix_squares_offset(candidates, hidden) + kMixSquaresBytes;
}
constexpr int64_t norm_weight_offset(int64_t slots, int64_t candidates, int64_t hidden) {
  return round_up(barriers_offset(candidates, hidden) + 16 * slots, kSlotAlign);
}
constexpr int64_t ring_offset(int64_t slots, int64_t candidates, int64_t hidden) {
  return norm_weight_offset(slots, candidates, hidden) +
         (norm_weight_in_shared(vectors_per_thread(hidden)) ? slot_bytes(hidden) : 0);
}
constexpr int64_t smem_bytes(int64_t slots, int64_t candidates, int64_t hidden) {
  return ring_offset(slots, candidates, hidden) + slots * slot_bytes(hidden);
}

// Blocks per SM: 2 where that geometry exists (two_blocks_fit), 1 otherwise (the plan's automatic choice), or
// either forced by attnres::Options::persistent_blocks_per_sm.
// Two blocks share the SM's shared memory (sm_90: the 227 KB a block may opt into plus the 1 KB the
// system reserves per block make the SM's 228 KB) and its register file: their instance is built for at most
// kTwoBlocksMaxThreads threads (launch bounds of two blocks per SM: <= 128 registers per thread).
constexpr int32_t kMaxBlocksPerSm = 2;
constexpr int64_t kReservedSharedPerBlock = 1024;  // cudaDevAttrReservedSharedMemoryPerBlock on sm_90
constexpr int32_t kTwoBlocksMaxThreads = 256;
// The dynamic shared memory one block may use when `blocks_per_sm` blocks share an SM whose blocks may each
// opt into `optin` bytes.
constexpr int64_t block_budget(int64_t optin, int32_t blocks_per_sm) {
  return blocks_per_sm <= 1 ? optin : (optin + kReservedSharedPerBlock) / blocks_per_sm - kReservedSharedPerBlock;
}

// The most slots (<= kMaxSlots) whose layout for `candidates` fits `budget` bytes; 0 when not even one does.
constexpr int32_t max_slots(int64_t budget, int64_t candidates, int64_t hidden) {
  for (int32_t s = kMaxSlots; s >= 1; --s)
    if (smem_bytes(s, candidates, hidden) <= budget) return s;
  return 0;
}

// Whether the two-blocks-per-SM geometry exists for a row of `hidden` elements on a device whose blocks may
// opt into `optin` bytes: an instance (at most kTwoBlocksMaxThreads threads) and a ring of at
// least tuning::kPersistentMinSlots slots in half the SM's shared memory. Its launch bounds (two blocks of
// kTwoBlocksMaxThreads) cap the registers, and block_budget leaves each block its reserved kilobyte, so both
// blocks are resident wherever this holds; the plan on a queried GPU still asks the occupancy calculator
// (attnres::plan, run.cpp) and falls back to one block per SM for an automatic geometry.
constexpr bool two_blocks_fit(int64_t hidden, int64_t optin) {
  return consumer_threads(hidden) + kProducerThreads <= kTwoBlocksMaxThreads &&
         max_slots(block_budget(optin, 2), kMaxCandidates, hidden) >= tuning::kPersistentMinSlots;
}

static_assert(consumer_threads(attnres::kMaxHidden) <= kMaxConsumerWarps * 32,
              "the persistent kernel's consumer warps must cover the largest H");
static_assert(vectors_per_thread(attnres::kMaxHidden) <= 8, "the persistent kernel has vector buckets up to 8");

}  // namespace attnres::persistent
