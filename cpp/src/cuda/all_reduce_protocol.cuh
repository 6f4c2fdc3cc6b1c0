// The one-shot exchange shared by the all-reduce kernels (all_reduce_kernel.cu, moe_finalize_all_reduce_kernel.cu).
//
// Layout. Every rank owns a region of bf16 elements [3 slots][W sources][capacity + 1 rows][width], initialised
// to the sentinel -0.0 (0x8000) by the communicator, and a uint32 state [generation, error, arrivals,
// tokens of slot 0, 1, 2, error details (peer, its T, ours), unused]. Rows 0..capacity-1 of a (slot, source)
// hold tokens; row `capacity` is the header: its first 8 bytes, one u64 (T | width << 32), never the sentinel
// pattern (T < 2^31, width <= 16384). A call with generation g:
//   1. pushes this rank's partial (each -0.0 element replaced by +0.0, so no real value is the sentinel) into
//      slot g % 3, source index `rank`, of every rank's region (its own included), and its header into every
//      peer's region (one thread: token 0, vector 0);
//   2. polls its own region's slot g % 3 until no element of any source is the sentinel and every peer's
//      header is written and equal to its own (T and width), then sums the W values in rank order 0..W-1 in
//      fp32 and rounds once to bf16 (the same bits on every rank: the same values, the same order). A header
//      that differs sets the error word (kAllReduceErrorTokenMismatch / WidthMismatch, the peer, both values)
//      and the thread writes no output: every thread checks every peer's header before it writes, so a
//      mismatched call writes nothing on any rank (a peer with fewer rows is caught by its header, not by
//      the bounded wait; a peer with more rows is caught although this rank's rows all arrived);
//   3. clears (writes the sentinel into) slot (g + 2) % 3 = (g - 1) % 3 of its own region, the rows the
//      previous call used (their count is in the state) and the W headers, and records its own token count
//      for slot g % 3;
//   4. the last block of the grid to finish resets the arrival counter and advances the generation.
// Nothing comes from the host per call, so a CUDA graph replays the call indefinitely.
//
// Memory ordering (PTX memory model; peers' regions are mapped over NVLink / CUDA IPC, so the scope is .sys):
//   * Data is its own flag. Pushes are st.volatile and polls ld.volatile, which the PTX model treats as
//     relaxed operations at system scope: a poll that reads a non-sentinel element reads the value the peer
//     pushed for this generation (no other write to that location happens between the clear of step 3 and
//     the next push, see below), so no separate flag, fence or acquire is needed to consume the data.
//     Each 2-byte element is checked on its own, so a 16-byte push that becomes visible piecewise is never
//     consumed half-written. The header is one aligned 8-byte st.volatile / ld.volatile (single-copy atomic),
//     checked as a whole; it is its own flag exactly as the data are (it is written once per call into a slot
//     the owner cleared, and cleared with the slot's rows), and header and rows need no order between them:
//     the reader waits for both.
//   * Slot reuse. Rank r clears slot s = (g - 1) % 3 during call g; peers write s again only in call g + 2.
//     (a) No peer still writes s when the clear runs: rank r finished call g - 1, so it saw every peer's
//     push into s (rows and header; a call that failed sets the error word, and every later call exits before
//     touching any slot). (b) No peer writes s for call g + 2 before the clear is performed: a peer starts call
//     g + 2 only after reading rank r's push of call g + 1, which rank r issues in a later kernel than the
//     clear. Each thread ends with fence.acq_rel.sys after its clears (release side, cumulative over the
//     kernel-boundary ordering to the next call's pushes) and a peer's consumption of that push is followed,
//     before its own next pushes, by the same fence (acquire side): the clear happens before the peer's
//     write in causality order. The fence is the kernel's last work, after the outputs and off the critical
//     path.
//   * The generation and the arrival counter are read and written only by this rank's kernels; the counter
//     is an atomic at gpu scope (__threadfence before the increment of the generation publishes the block's
//     state writes); consecutive calls are ordered by the stream (griddepcontrol.wait under PDL, which waits
//     for the previous grid's completion and memory flush).
//   * PDL. The kernel waits on the grid dependency before reading anything (the partial comes from the
//     kernel before it; the state from the previous call). It may release its dependents right after that
//     wait (early trigger), before the exchange: their griddepcontrol.wait still waits for this whole grid to
//     complete, so they only overlap their independent loads (bank rows, weights) with the exchange. Never
//     before the wait: a dependent's pre-wait loads could then overlap the kernel before this one
//     (docs/ops/pdl.md).
//   * Bounded wait. Polls give up when %globaltimer passes the call's deadline (comm.timeout_ns after the
//     block started polling): the block sets the error word (kAllReduceErrorTimeout, and the late source)
//     and writes no output. The first failure of a call wins the error word (atomicCAS from 0): its details
//     (words 6..8) are written by that thread only, so they describe one failure. A call that finds the error word set exits at once, writing nothing, so a broken
//     communicator never hangs again; the host reads the word (Communicator.check()).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "attnres/all_reduce.hpp"
#include "cuda/device_utils.cuh"

namespace attnres::detail {

struct Exchange {
  __nv_bfloat16* buffers[kAllReduceMaxWorld];
  uint32_t* state;
  int32_t world, rank;
  int32_t tokens;  // T of this call
  int64_t capacity, width;  // token rows per (slot, source) before the header row; elements per row
  int64_t timeout_ns;
  uint32_t total_blocks;
};

// The kernels' view of a communicator for a call of `tokens` tokens over `total_blocks` blocks (all_reduce_kernel.cu).
Exchange make_exchange(const CommRef& comm, int64_t tokens, uint32_t total_blocks);

enum StateWord : int { kGeneration = 0, kError = 1, kArrivals = 2, kTokens0 = 3, kLateSource = 6, kPeerValue = 7,
                       kOwnValue = 8 };

__device__ __forceinline__ uint32_t load_volatile_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_volatile_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t load_volatile_u64(const void* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_volatile_u64(void* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint4 load_volatile16(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ void store_volatile16(void* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

constexpr uint32_t kSentinelPair = 0x80008000u;
constexpr uint4 kSentinel4 = {kSentinelPair, kSentinelPair, kSentinelPair, kSentinelPair};
constexpr uint64_t kSentinelHeader = (static_cast<uint64_t>(kSentinelPair) << 32) | kSentinelPair;

__device__ __forceinline__ bool pair_has_sentinel(uint32_t w) {
  return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u;
}
__device__ __forceinline__ bool has_sentinel(uint4 v) {
  return pair_has_sentinel(v.x) || pair_has_sentinel(v.y) || pair_has_sentinel(v.z) || pair_has_sentinel(v.w);
}
// -0.0 -> +0.0 in both halves; every other value (NaN included) unchanged.
__device__ __forceinline__ uint32_t pair_without_neg_zero(uint32_t w) {
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}
__device__ __forceinline__ uint4 without_neg_zero(uint4 v) {
  return make_uint4(pair_without_neg_zero(v.x), pair_without_neg_zero(v.y), pair_without_neg_zero(v.z),
                    pair_without_neg_zero(v.w));
}

// Element offset of (slot, source, token, vector) in a region: [3][W][capacity + 1][width].
__device__ __forceinline__ int64_t slot_offset(const Exchange& x, uint32_t slot, int source, int64_t token, int vec) {
  return ((static_cast<int64_t>(slot) * x.world + source) * (x.capacity + kAllReduceHeaderRows) + token) * x.width +
         static_cast<int64_t>(vec) * 8;
}
// The header of (slot, source) in `region`: the first 8 bytes of row `capacity` (16-byte aligned: rows are).
__device__ __forceinline__ uint64_t* header_ptr(const Exchange& x, __nv_bfloat16* region, uint32_t slot, int source) {
  return reinterpret_cast<uint64_t*>(region + slot_offset(x, slot, source, x.capacity, 0));
}
__device__ __forceinline__ uint64_t own_header(const Exchange& x) {
  return static_cast<uint64_t>(static_cast<uint32_t>(x.tokens)) | (static_cast<uint64_t>(x.width) << 32);
}

// Sets the error word to `code` if no failure was recorded yet; only the first failure writes its details.
__device__ __forceinline__ void record_error(const Exchange& x, uint32_t code, int peer, uint32_t peer_value,
                                             uint32_t own_value) {
  if (atomicCAS(x.state + kError, 0u, code) == 0u) {
    store_volatile_u32(x.state + kLateSource, static_cast<uint32_t>(peer));
    store_volatile_u32(x.state + kPeerValue, peer_value);
    store_volatile_u32(x.state + kOwnValue, own_value);
  }
}

// The call's generation, or false when the communicator is broken (error word set): then nothing is done.
__device__ __forceinline__ bool begin_call(const Exchange& x, uint32_t& generation) {
  generation = load_volatile_u32(x.state + kGeneration);
  return load_volatile_u32(x.state + kError) == 0u;
}

// Steps 1-2 for one 16-byte vector of token `token`: push `mine` to every rank (and, from token 0 vector 0, the
// header to every peer), then wait for every source's vector and every peer's header. On success got[s] holds
// source s's vector; on a timeout or a peer's header that differs, the error word is set and false returned.
template <int W>
__device__ __forceinline__ bool exchange_vector(const Exchange& x, uint32_t slot, int64_t token, int vec, uint4 mine,
                                                uint4 (&got)[W]) {
  mine = without_neg_zero(mine);
  const uint64_t header = own_header(x);
#pragma unroll
  for (int dst = 0; dst < W; ++dst) store_volatile16(x.buffers[dst] + slot_offset(x, slot, x.rank, token, vec), mine);
  if (token == 0 && vec == 0) {
#pragma unroll
    for (int dst = 0; dst < W; ++dst)
      if (dst != x.rank) store_volatile_u64(header_ptr(x, x.buffers[dst], slot, x.rank), header);
  }
  __nv_bfloat16* own = x.buffers[x.rank];
  uint32_t pending = (1u << W) - 1u;
  uint32_t headers = pending & ~(1u << x.rank);
  const uint64_t deadline = global_timer_ns() + static_cast<uint64_t>(x.timeout_ns);
  while (true) {
#pragma unroll
    for (int s = 0; s < W; ++s) {
      if (pending & (1u << s)) {
        got[s] = load_volatile16(own + slot_offset(x, slot, s, token, vec));
        if (!has_sentinel(got[s])) pending &= ~(1u << s);
      }
      if (headers & (1u << s)) {
        const uint64_t h = load_volatile_u64(header_ptr(x, own, slot, s));
        if (h == header) {
          headers &= ~(1u << s);
        } else if (h != kSentinelHeader) {
          const uint32_t peer_tokens = static_cast<uint32_t>(h), peer_width = static_cast<uint32_t>(h >> 32);
          if (peer_width != static_cast<uint32_t>(x.width))
            record_error(x, kAllReduceErrorWidthMismatch, s, peer_width, static_cast<uint32_t>(x.width));
          else
            record_error(x, kAllReduceErrorTokenMismatch, s, peer_tokens, static_cast<uint32_t>(x.tokens));
          return false;
        }
      }
    }
    if ((pending | headers) == 0u) return true;
    if (global_timer_ns() > deadline) {
      record_error(x, kAllReduceErrorTimeout, __ffs(pending | headers) - 1, 0u, static_cast<uint32_t>(x.tokens));
      return false;
    }
  }
}

// The contract's sum: fp32 in rank order, one rounding (the caller packs).
template <int W>
__device__ __forceinline__ void sum_in_rank_order(const uint4 (&got)[W], float (&acc)[8]) {
  unpack8(got[0], acc);
#pragma unroll
  for (int s = 1; s < W; ++s) {
    float f[8];
    unpack8(got[s], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = add_rn_keep_subnormals(acc[e], f[e]);
  }
}

// Step 3 for one vector column: rows row0, row0 + step, ... below the previous call's token count, every
// source, of slot (g + 2) % 3 in this rank's region; the thread of row 0, vector 0 also clears the slot's W
// headers. Ends with the system-scope fence of the slot-reuse argument.
template <int W>
__device__ __forceinline__ void clear_previous(const Exchange& x, uint32_t generation, int64_t row0, int64_t step,
                                               int vec) {
  const uint32_t slot = (generation + 2u) % 3u;
  const int64_t rows = static_cast<int64_t>(load_volatile_u32(x.state + kTokens0 + slot));
  __nv_bfloat16* own = x.buffers[x.rank];
  for (int64_t t = row0; t < rows; t += step)
#pragma unroll
    for (int s = 0; s < W; ++s) store_volatile16(own + slot_offset(x, slot, s, t, vec), kSentinel4);
  if (row0 == 0 && vec == 0) {
#pragma unroll
    for (int s = 0; s < W; ++s) store_volatile_u64(header_ptr(x, own, slot, s), kSentinelHeader);
  }
  __threadfence_system();
}

// Step 4, once per block after every thread's work: record T for this slot, count the block, and let the
// last block advance the generation.
__device__ __forceinline__ void end_call(const Exchange& x, uint32_t generation) {
  __syncthreads();
  if (threadIdx.x == 0) {
    store_volatile_u32(x.state + kTokens0 + generation % 3u, static_cast<uint32_t>(x.tokens));
    __threadfence();
    const uint32_t arrived = atomicAdd(x.state + kArrivals, 1u);
    if (arrived + 1u == x.total_blocks) {
      store_volatile_u32(x.state + kArrivals, 0u);
      __threadfence();
      store_volatile_u32(x.state + kGeneration, generation + 1u);
    }
  }
}

}  // namespace attnres::detail
