// The persistent attention-residual kernel (sm_90): one block per SM (two through a tuning knob) loops over
// tokens (round-robin), and every candidate row reaches shared memory through a bulk asynchronous copy
// (cp.async.bulk, completing on an mbarrier with a transaction count) into a ring of row slots.
// attn_res_rmsnorm and attn_res_add_rmsnorm (one addend) under the persistent topology,
// attn_res_add_rmsnorm_persistent, and attn_res without the fp32 diagnostics (no trailing norm: the NORM = false
// instances, whose output is the mixture of step 3) run here, each with or without a snapshot row write.
//
// Roles. Warps 0..W-1 consume (W <= 8, persistent_layout.hpp consumer_threads), the last warp produces:
// its lane 0 streams, token after token, the rows bank[0..K-1], prefix, addend (with the addend) into the
// ring, each into the next slot once the consumers have released it (empty mbarrier, one arrival per
// consumer warp); a slot's full mbarrier completes when its bytes have landed.
//
// Per token the consumers
//   1. score every row as it arrives (per vector: sum of squares and dot with q over its 8 elements, a
//      butterfly per split_k warp, the warp's pair to shared memory); the prefix row and the addend form
//      P = bf16(prefix + add) first (add.rn.f32, no flush: ops.md step 1) and `updated` is stored, and P
//      into the snapshot row when the call writes one (the row is >= K: never a candidate of this call);
//   2. after one consumer barrier, every warp sums the per-warp pairs in split_k's order and computes the same
//      softmax (lane n: candidate n), so the N probabilities need no second barrier;
//   3. mix row by row, n = 0..K-1 then P (one pass: recomputed from the prefix and addend slots; two passes
//      with an addend: the `updated` row streamed back; the same bits either way), as an
//      fma chain per element in that order, releasing each slot after its row; round the mixture to bf16
//      once (ops.md step 6);
//   4. trailing norm in Kimi's two-rounding order (ops.md step 7): the mixture's sum of squares through a
//      second consumer barrier, then output = bf16(bf16(mixture * r) * norm_weight); without the norm
//      (NORM = false) the bf16 mixture is the output and the second barrier does not exist.
// The formulas are the per-token kernels' (attn_res_per_token.cuh): rsqrtf(fmaf(ss, 1/H, eps)), __expf of
// the max-subtracted logit, the denominator summed over n in order from +0, probabilities times 1/denominator,
// the N = 1 probability forced to 1, the mixture's fma chain over n in order, the same rounding boundaries.
//
// Bitwise split_k's: every sum over H runs in split_k's order (plan_tuning.hpp split_k_chunk;
// persistent_layout.hpp assigns the vectors): per vector an fma chain over its 8 elements; per split_k warp a
// butterfly over its 32 lanes (warp_reduce_scatter: the xor-16..1 tree of warp_sum); per rank chunk its warps
// in order from +0 (in registers when one consumer warp holds the chunk, else in step 2 / 4); the chunks in
// order from +0. split_k mixes its whole N bucket (plan_tuning.hpp candidate_bucket), the rows past N as
// fma(0, 0, acc) = acc + 0, which turns a -0 mixture element into +0; `mix_pad` repeats that once.
//
// Two modes, chosen by the plan from (N, H, shared memory) only (or forced by a tuning knob) and giving
// identical bits:
//   * one pass (passes = 1): a token's N (+1) rows stay in their slots from scoring to mixing; the ring has at
//     least one slot more than a token needs, so the next token streams while this one is mixed and rows are
//     released one by one as they are mixed;
//   * two passes (passes = 2, when a token's rows do not fit the ring, e.g. H = 16384, N = 16): each row is
//     released right after scoring and streamed again to mix. The second pass streams the bank rows again (from
//     L2 when they are still there) and, with an addend, the `updated` row that step 1 stored (P's bits: the
//     same value the one-pass mix recomputes from the prefix and addends) instead of the prefix and addends:
//     one row instead of 1 + ADDS, and the prefix is never read after `updated` is written, so the update may
//     be in place. Without an addend it streams the prefix again. Either way the arithmetic repeats and the
//     results do not change.
//
// Determinism: which thread owns an element and every reduction order depend on H only (the plan's consumer
// count and vector bucket), never on T, on the block that runs the token, on the grid, on the blocks per SM,
// on the ring depth or on the passes (the tuning knobs of attnres::Options change only those).
//
// PDL: before griddepcontrol.wait the consumers load the weights (into registers, once per block; for H > 8192
// the norm weight into thread-private shared memory) and the producer may issue copies of the first token's
// bank rows 0..K-2 (written two or more calls ago) into slots never used yet; it executes the wait before the
// first copy of a newest bank row K-1, a prefix or an addend, and every consumer waits before it reads a row
// or stores anything. Each thread releases dependents (griddepcontrol.launch_dependents) right after its own
// wait: the first release of a block counts, and whichever thread issues it has passed a wait, so this
// grid's predecessor has completed. A dependent's pre-wait section therefore starts only once every kernel
// two or more launches back has completed, which is what the bank rows 0..K-2 read before the wait rely on
// (attn_res_per_token.cuh, "PDL release"; docs/ops/pdl.md).
//
// Proxy ordering: ring slots are written only by the copy engine (async proxy) and only read by the
// consumers (generic loads, released through the empty mbarrier's arrive/wait). No generic store ever writes
// a slot, so no fence.proxy.async is needed before a slot is reused; a change that stores into a slot must
// add fence.proxy.async.shared::cta before its release. The mbarrier initialisation is published to the
// async proxy with fence.mbarrier_init before the first copy. The second pass's copy of `updated` reads global
// memory the consumers wrote with generic stores: each consumer thread fences its stores to the async proxy
// (fence.proxy.async.global) and then arrives on named barrier 2, which the producer warp syncs on before it
// issues that copy (the barrier orders the stores before the copy; the fence makes them visible to it).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/attn_res_steps.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/fp8_epilogue.cuh"
#include "persistent_layout.hpp"

namespace attnres::detail {

struct PersistentParams {
  const __nv_bfloat16* layer_residual;
  const __nv_bfloat16* add;   // nullptr without an addend
  const __nv_bfloat16* add2;  // nullptr without a second addend
  const __nv_bfloat16* bank;
  const __nv_bfloat16* res_weight;
  const __nv_bfloat16* rms_weight;
  const __nv_bfloat16* norm_weight;
  __nv_bfloat16* output;   // nullptr: the FP8-only call (FP8 instances only)
  __nv_bfloat16* updated;  // nullptr without an addend
  __nv_bfloat16* snapshot; // bank row `snapshot_slot` of token 0 (token stride bank_token_stride); nullptr: none
  int64_t lr_stride, add_stride, add2_stride, bank_snapshot_stride, bank_token_stride, output_stride, updated_stride;
  int32_t tokens;     // T
  int32_t snapshots;  // K (N = K + 1)
  int32_t vectors;    // H / 8
  int32_t consumers;  // consumer threads (a multiple of 32, <= 256)
  int32_t chunks;     // split_k's rank chunks (tuning::split_k_cluster)
  int32_t chunk;      // vectors per chunk (tuning::split_k_chunk)
  int32_t warps_per_chunk;  // consumer warps per chunk (persistent::warps_per_chunk)
  int32_t mix_pad;    // 1 when split_k's N bucket is larger than N (one acc + 0 after the mixture)
  int32_t slots;      // ring depth
  int32_t passes;     // 1 or 2
  uint32_t row_bytes;   // 2H
  uint32_t slot_bytes;  // persistent::slot_bytes(H)
  // The header's offsets (persistent_layout.hpp, sized for this call's N and consumer warps).
  uint32_t mix_squares_offset, barriers_offset, norm_weight_offset, ring_offset;
  float inv_hidden;
  float rms_eps, norm_eps;
  // FP8 epilogue (the Fp8Mode instances only): codes [T, H], scales [T, G] with strides {token, group}.
  uint8_t* output_fp8;
  float* fp8_scales;
  int64_t output_fp8_stride;
  int64_t fp8_scales_stride[2];
  int32_t fp8_pow2;
};

// ---- PTX helpers of this kernel (the shared ones live in device_utils.cuh) ----
// Whether the phase of parity `parity` of a CTA-local mbarrier has completed (try_wait may suspend the thread
// for a while first). CTA scope (acquire.cta, the default): device_utils.cuh's mbarrier_wait_parity acquires
// at cluster scope for split_k's exchanges, which compiles to an L1 invalidation (CCTL.IVALL) after every
// successful wait, once per row here.
__device__ __forceinline__ bool try_wait_parity(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Every wait of this kernel is on data already in flight or on another warp of the same block that is not
// waiting on anything outside the block (the grid dependency is resolved before the first wait that could
// depend on it): none legitimately lasts more than microseconds. One that has not completed after
// kWatchdogNs means the ring protocol is broken; the kernel traps (the launch fails with an error the caller
// sees) instead of hanging the stream forever. The clock is read only once a wait has failed.
constexpr uint64_t kWatchdogNs = 10ull * 1000 * 1000 * 1000;
__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  if (try_wait_parity(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!try_wait_parity(bar, parity))
    if (global_timer_ns() - start > kWatchdogNs) __trap();
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Global -> shared bulk copy completing `bytes` on `bar` (16-byte aligned addresses, size a multiple of 16:
// validate.cpp enforces 16-byte aligned rows on CUDA and H % 8 == 0 makes 2H a multiple of 16). A lone CTA is
// a cluster of one, so its shared::cta addresses are valid shared::cluster addresses.
__device__ __forceinline__ void bulk_copy_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// Barrier 1 among the consumer warps only (the producer warp never waits on it).
__device__ __forceinline__ void consumer_barrier(int consumers) {
  asm volatile("bar.sync 1, %0;" ::"r"(consumers) : "memory");
}
// Barrier 2, a two-pass token's `updated` row: every consumer thread, once its stores of the row are issued,
// fences them to the async proxy and arrives (without waiting); the producer warp syncs before it copies the row
// back for the mixing pass. One phase per token: the consumers reach the next token's arrival only after rows
// the producer issues after this sync.
__device__ __forceinline__ void updated_stored_arrive(int consumers) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("bar.arrive 2, %0;" ::"r"(consumers + persistent::kProducerThreads) : "memory");
}
__device__ __forceinline__ void updated_stored_sync(int consumers) {
  asm volatile("bar.sync 2, %0;" ::"r"(consumers + persistent::kProducerThreads) : "memory");
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// Position in the ring: slot and the parity of the ring's pass it is in.
struct RingCursor {
  uint32_t slot = 0, phase = 0;
  __device__ __forceinline__ void advance(uint32_t slots) {
    if (++slot == slots) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

// The producer warp: streams the rows of every token of this block (twice per token in two-pass mode).
__device__ __forceinline__ void produce_rows(const PersistentParams& p, int adds, uint32_t full0, uint32_t empty0,
                                             uint32_t ring, int lane) {
  const int K = p.snapshots;
  RingCursor cur;
  bool waited = false;
  int issued = 0;  // before the wait: copies issued, all into slots never used yet
  for (int t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    for (int pass = 0; pass < p.passes; ++pass) {
      // The mixing pass of a two-pass token with an addend streams `updated` (P) in place of the prefix and addends.
      const bool mix_updated = pass == 1 && adds > 0;
      const int rows = mix_updated ? K + 1 : K + 1 + adds;
      for (int r = 0; r < rows; ++r) {
        if (mix_updated && r == K) updated_stored_sync(p.consumers);  // every consumer stored and fenced its part
        const __nv_bfloat16* src =
            r < K ? p.bank + t * p.bank_token_stride + r * p.bank_snapshot_stride
                  : (mix_updated  ? p.updated + t * p.updated_stride
                     : r == K     ? p.layer_residual + t * p.lr_stride
                     : r == K + 1 ? p.add + t * p.add_stride
                                  : p.add2 + t * p.add2_stride);
        // Bank rows 0..K-2 may be read before the grid dependency resolves; the newest row K-1 (the previous
        // call may have written it as its snapshot), the prefix and the addend only after. Before it, only
        // into fresh slots: a wait for a released slot would wait on consumers that are themselves waiting
        // for the dependency (and the watchdog below counts on no wait depending on it).
        if (!waited && (r >= K - 1 || issued == p.slots)) {
          grid_dependency_wait();
          launch_dependents();  // after the wait: see "PDL" in the header comment
          waited = true;
        }
        ++issued;
        wait_parity(empty0 + 8 * cur.slot, cur.phase ^ 1u);  // a fresh barrier passes parity 1
        if (lane == 0) {
          const uint32_t full = full0 + 8 * cur.slot;
          mbarrier_expect_tx(full, p.row_bytes);
          bulk_copy_to_shared(ring + cur.slot * p.slot_bytes, src, p.row_bytes, full);
        }
        __syncwarp();
        cur.advance(static_cast<uint32_t>(p.slots));
      }
    }
  }
  if (!waited) {
    grid_dependency_wait();
    launch_dependents();
  }
}

// P for this thread's vector: the prefix, or the per-token kernels' update with ADDS addends (attn_res_steps.cuh
// add_to_prefix: bf16(prefix + add), or bf16(prefix + bf16(add + add2)), non-flushing fp32 adds).
template <int ADDS>
__device__ __forceinline__ uint4 prefix_vector(const unsigned char* const (&rows)[3], uint32_t offset) {
  const uint4 pre = *reinterpret_cast<const uint4*>(rows[0] + offset);
  if constexpr (ADDS == 0) {
    return pre;
  } else {
    const uint4 add = *reinterpret_cast<const uint4*>(rows[1] + offset);
    const uint4 add2 = ADDS == 2 ? *reinterpret_cast<const uint4*>(rows[2] + offset) : make_uint4(0, 0, 0, 0);
    return add_to_prefix<ADDS == 2 ? Mode::add2 : Mode::add>(pre, add, add2);
  }
}

// The token's last 1 + ADDS rows (the prefix, then the addends) from `cur` on: their cursors (`cur` advanced past
// them) and slot addresses.
template <int ADDS>
struct TailRows {
  RingCursor at[1 + ADDS];
  const unsigned char* rows[3];
  __device__ __forceinline__ TailRows(RingCursor& cur, uint32_t slots, const unsigned char* ring, uint32_t slot_bytes) {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (i <= ADDS) {
        at[i] = cur;
        cur.advance(slots);
      }
      rows[i] = ring + at[i <= ADDS ? i : 0].slot * slot_bytes;
    }
  }
  __device__ __forceinline__ void wait(uint32_t full0) const {
#pragma unroll
    for (int i = 0; i <= ADDS; ++i) wait_parity(full0 + 8 * at[i].slot, at[i].phase);
  }
  __device__ __forceinline__ void release(uint32_t empty0) const {
#pragma unroll
    for (int i = 0; i <= ADDS; ++i) mbarrier_arrive(empty0 + 8 * at[i].slot);
  }
  // P of the vector at `offset` (prefix_vector).
  __device__ __forceinline__ uint4 p_vector(uint32_t offset) const { return prefix_vector<ADDS>(rows, offset); }
};

// A thread's V vectors get vector_scores chains of their own (device_utils.cuh): V independent chains instead of
// one 8V long, which is the latency a row's scoring costs; this sums them.
// The sum over j of the warp sums of v[j] (j = 0..V-1), as split_k sums a chunk's warps: each v[j] a butterfly
// over the lanes (warp_reduce_scatter: lane l ends with value l / (32 / M)), then added in j order from +0.
// Returned on lanes 0 (value group 0) and 1 (group 1) when G = 2 groups of V values are interleaved as
// v[G * j + group]; every lane returns the group lane % G.
template <int G, int V>
__device__ __forceinline__ float chunk_warps_sum(const float (&v)[G * V], int lane) {
  constexpr int M = G * V, kLanes = 32 / M;  // lanes per value after the reduce-scatter
  const float h = warp_reduce_scatter<M>(v, lane);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) s += __shfl_sync(0xffffffffu, h, (G * j + lane % G) * kLanes);
  return s;
}

// A row's (sum of squares, dot) of this consumer warp's chunk warps, summed in order; lane 0 stores the sum of
// squares, lane 1 the dot at row_partials[warp] (step 2 adds the consumer warps up in split_k's order).
template <int V>
__device__ __forceinline__ void store_warp_partials(const float (&ssj)[V], const float (&dotj)[V], float* row_partials,
                                                    int warp, int lane) {
  float v[2 * V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    v[2 * j] = ssj[j];
    v[2 * j + 1] = dotj[j];
  }
  const float s = chunk_warps_sum<2, V>(v, lane);
  if (lane < 2) row_partials[warp * 2 + lane] = s;
}

// sum over the consumer warps' values base[w * stride] in split_k's order: each chunk's warps_per_chunk values
// in order from +0, then the chunks in order from +0.
__device__ __forceinline__ float chunked_sum(const float* base, int stride, int chunks, int warps_per_chunk) {
  float s = 0.0f;
  for (int c = 0; c < chunks; ++c) {
    float part = 0.0f;
    for (int k = 0; k < warps_per_chunk; ++k) part += base[(c * warps_per_chunk + k) * stride];
    s += part;
  }
  return s;
}

// V: 16-byte vectors per consumer thread (1, 2, 4 or 8); ADDS: the addends, 0, 1 or 2 (with any, writes `updated`:
// bf16(prefix + add), or bf16(prefix + bf16(add + add2))); FP8: the e4m3
// epilogue (step 5), a compile-time variant; BLOCKS_PER_SM: 1, or 2 for the tuning knob's instances (at most
// kTwoBlocksMaxThreads threads, registers capped so that two blocks are resident; the same code, the same bits);
// NORM: the trailing norm (false: attn_res's output, the mixture; no FP8 epilogue).
template <int V, int ADDS, Fp8Mode FP8 = Fp8Mode::none, int BLOCKS_PER_SM = 1, bool NORM = true>
__global__ void __launch_bounds__(BLOCKS_PER_SM == 1 ? persistent::kMaxThreads : persistent::kTwoBlocksMaxThreads,
                                  BLOCKS_PER_SM)
    attn_res_persistent_kernel(const __grid_constant__ PersistentParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* const partials = reinterpret_cast<float*>(smem);  // [n][consumer warp][2]
  float* const mix_squares = reinterpret_cast<float*>(smem + p.mix_squares_offset);  // [warp]
  const uint32_t full0 = shared_address(smem + p.barriers_offset);
  const uint32_t empty0 = full0 + 8u * static_cast<uint32_t>(p.slots);
  const uint32_t ring = shared_address(smem + p.ring_offset);
  const unsigned char* const ring_ptr = smem + p.ring_offset;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = p.warps_per_chunk;
  const int C = p.consumers, consumer_warps = C >> 5;
  const int K = p.snapshots, N = K + 1;
  const uint32_t S = static_cast<uint32_t>(p.slots);
  const bool two_pass = p.passes == 2;
  // The V = 8 instance (H > 8192) keeps the norm weight in shared memory: with it in registers too, the 9-warp
  // block's register cap (168: three warps share a quarter of the register file) spilled.
  constexpr bool kNormInRegisters = !persistent::norm_weight_in_shared(V);
  static_assert(NORM || FP8 == Fp8Mode::none, "attn_res has no normed output to quantize");

  if (tid == 0) {
    for (uint32_t s = 0; s < S; ++s) {
      mbarrier_init(full0 + 8 * s, 1);                                         // the producer's expect_tx arrive
      mbarrier_init(empty0 + 8 * s, static_cast<uint32_t>(consumer_warps));  // one arrive per consumer warp
    }
    fence_mbarrier_init_cluster();  // the initialisation is visible to the copy engine (async proxy)
  }
  __syncthreads();

  if (warp == consumer_warps) {
    produce_rows(p, ADDS, full0, empty0, ring, lane);
  } else if (warp < consumer_warps) {
    // ---- once per block, before the grid dependency: q = rms_weight * res_weight (fp32, never rounded) and
    // the norm weight, for this thread's vectors (below) ----
    // Vector j of this thread (persistent_layout.hpp owned_vector): index first + 32 j, byte offset in a row
    // `offset(j)`, present when `valid(j)` (recomputed rather than kept: registers are the scarce resource of
    // the V = 8 instance).
    const int in_chunk = persistent::position_in_chunk(warp, lane, 0, V, G);
    const int first = persistent::chunk_of_warp(warp, G) * p.chunk + in_chunk;
    const auto valid = [&](int j) { return in_chunk + 32 * j < p.chunk && first + 32 * j < p.vectors; };
    const auto offset = [&](int j) { return static_cast<uint32_t>(first + 32 * j) * 16u; };
    float q[V][8];
    uint4 norm_w[kNormInRegisters ? V : 1];
    unsigned char* const norm_smem = smem + p.norm_weight_offset;  // V = 8: thread-private
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t col = valid(j) ? static_cast<int64_t>(first + 32 * j) * 8 : 0;
      const uint4 res = load16_if(p.res_weight + col, valid(j));
      const uint4 rms = load16_if(p.rms_weight + col, valid(j));
      if constexpr (NORM) {
        const uint4 nw = load16_if(p.norm_weight + col, valid(j));
        if constexpr (kNormInRegisters) {
          norm_w[j] = nw;
        } else {
          // Only this thread ever reads these 16 bytes back: no barrier, and never a ring slot.
          if (valid(j)) *reinterpret_cast<uint4*>(norm_smem + offset(j)) = nw;
        }
      }
      float a[8], b[8];
      unpack8(res, a);
      unpack8(rms, b);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[j][e] = b[e] * a[e];
    }
    grid_dependency_wait();
    launch_dependents();  // after the wait: see "PDL" in the header comment

    RingCursor cur;
    for (int t = blockIdx.x; t < p.tokens; t += gridDim.x) {
      const RingCursor first = cur;  // the token's first row (one pass: also where mixing starts)

      // ---- 1. scores, row by row as the rows land ----
      for (int n = 0; n < K; ++n) {
        wait_parity(full0 + 8 * cur.slot, cur.phase);
        const unsigned char* row = ring_ptr + cur.slot * p.slot_bytes;
        float ssj[V], dotj[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const uint4 x = valid(j) ? *reinterpret_cast<const uint4*>(row + offset(j)) : make_uint4(0, 0, 0, 0);
          vector_scores(x, q[j], ssj[j], dotj[j]);
        }
        store_warp_partials<V>(ssj, dotj, partials + n * consumer_warps * 2, warp, lane);
        if (two_pass) {
          __syncwarp();
          if (lane == 0) mbarrier_arrive(empty0 + 8 * cur.slot);
        }
        cur.advance(S);
      }
      {
        const TailRows<ADDS> tail(cur, S, ring_ptr, p.slot_bytes);
        tail.wait(full0);
        float ssj[V], dotj[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const uint4 P = valid(j) ? tail.p_vector(offset(j)) : make_uint4(0, 0, 0, 0);
          if constexpr (ADDS > 0) {
            if (valid(j)) store16(p.updated + t * p.updated_stride + offset(j) / 2, P);
          }
          if (valid(j) && p.snapshot) store16(p.snapshot + t * p.bank_token_stride + offset(j) / 2, P);
          vector_scores(P, q[j], ssj[j], dotj[j]);  // the same code as a bank row's: only P's value differs
        }
        store_warp_partials<V>(ssj, dotj, partials + K * consumer_warps * 2, warp, lane);
        if (two_pass) {
          if constexpr (ADDS > 0) updated_stored_arrive(C);  // the mixing pass copies `updated` back
          __syncwarp();
          if (lane == 0) tail.release(empty0);
        }
      }
      consumer_barrier(C);

      // ---- 2. softmax, computed identically by every consumer warp; lane n holds candidate n ----
      float prob;
      {
        float ss = 1.0f, dot = 0.0f;
        if (lane < N) {
          const float* mine = partials + lane * consumer_warps * 2;
          ss = chunked_sum(mine, 2, p.chunks, G);
          dot = chunked_sum(mine + 1, 2, p.chunks, G);
        }
        const float rsigma = candidate_rsigma(ss, p.inv_hidden, p.rms_eps);
        const float logit = lane < N ? rsigma * dot : -INFINITY;
        const float max_logit = warp_max(logit);
        // Past N the probability is 0 by selection, not by exp(-inf - max) (NaN when no logit is finite).
        const float e = lane < N ? __expf(logit - max_logit) : 0.0f;
        float denom = 0.0f;  // over n in order from +0, as the per-token kernels sum it
        for (int n = 0; n < N; ++n) denom += __shfl_sync(0xffffffffu, e, n);
        // Selected again after the normalisation: lanes past N stay 0 even when the denominator is NaN.
        prob = single_candidate_rule(N, lane, lane < N ? e * softmax_scale(N, denom) : 0.0f);
      }

      // ---- 3. the mixture, row by row, each slot released once its row is mixed ----
      float acc[V][8];
#pragma unroll
      for (int j = 0; j < V; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[j][e] = 0.0f;
      RingCursor mix = two_pass ? cur : first;
      for (int n = 0; n < K; ++n) {
        if (two_pass) wait_parity(full0 + 8 * mix.slot, mix.phase);
        const float pn = __shfl_sync(0xffffffffu, prob, n);
        const unsigned char* row = ring_ptr + mix.slot * p.slot_bytes;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float x[8];
          unpack8(valid(j) ? *reinterpret_cast<const uint4*>(row + offset(j)) : make_uint4(0, 0, 0, 0), x);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][e] = fmaf(pn, x[e], acc[j][e]);
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty0 + 8 * mix.slot);
        mix.advance(S);
      }
      {
        // A two-pass token with an addend mixes P from `updated` (one row, TailRows<0>: taken as it is), every
        // other the prefix and addends.
        const float pK = __shfl_sync(0xffffffffu, prob, K);
        const auto mix_tail = [&](const auto& tail) {
          if (two_pass) tail.wait(full0);
#pragma unroll
          for (int j = 0; j < V; ++j) {
            float x[8];
            unpack8(valid(j) ? tail.p_vector(offset(j)) : make_uint4(0, 0, 0, 0), x);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[j][e] = fmaf(pK, x[e], acc[j][e]);
          }
          __syncwarp();
          if (lane == 0) tail.release(empty0);
        };
        if (two_pass && ADDS > 0) {
          mix_tail(TailRows<0>(mix, S, ring_ptr, p.slot_bytes));
        } else {
          mix_tail(TailRows<ADDS>(mix, S, ring_ptr, p.slot_bytes));
        }
      }
      if (two_pass) cur = mix;
      if (p.mix_pad) {
#pragma unroll
        for (int j = 0; j < V; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][e] += 0.0f;  // split_k's fma(0, 0, acc) for its rows past N
      }

      // ---- 4. trailing RMSNorm, two roundings (without it, the rounded mixture is the output) ----
      if constexpr (!NORM) {
#pragma unroll
        for (int j = 0; j < V; ++j)
          if (valid(j)) store16(p.output + t * p.output_stride + offset(j) / 2, pack8(acc[j]));
        // The norm's barrier also keeps the next token's step 1 from overwriting the partials before every
        // consumer warp has read them in step 2; without the norm this barrier alone does that.
        consumer_barrier(C);
      } else {
        uint4 mixed[V];
        float sqj[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          mixed[j] = pack8(acc[j]);  // the mixture's one rounding to bf16
          float m[8];
          unpack8(mixed[j], m);
          sqj[j] = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) sqj[j] = fmaf(m[e], m[e], sqj[j]);  // invalid vectors: +0 (acc stayed 0)
        }
        const float sq = chunk_warps_sum<1, V>(sqj, lane);
        if (lane == 0) mix_squares[warp] = sq;
        consumer_barrier(C);
        const float total = chunked_sum(mix_squares, 1, p.chunks, G);
        const float r = norm_scale(total, p.inv_hidden, p.norm_eps);
        const auto norm_vector = [&](int j) -> uint4 {  // the norm weight of vector j (a valid one)
          if constexpr (kNormInRegisters) {
            return norm_w[j];
          } else {
            return *reinterpret_cast<const uint4*>(norm_smem + offset(j));
          }
        };
        // With FP8 the outputs stay in registers for step 5 where they fit (V <= 4: 16 registers).
        constexpr bool kKeepOutput = FP8 != Fp8Mode::none && V <= 4;
        uint4 kept[kKeepOutput ? V : 1];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (!valid(j)) continue;
          float m[8];
          unpack8(mixed[j], m);
          const uint4 out = rms_output8_scaled(m, r, norm_vector(j));
          if (FP8 == Fp8Mode::none || p.output != nullptr)  // the FP8-only call stores no bf16 output
            store16(p.output + t * p.output_stride + offset(j) / 2, out);
          if constexpr (kKeepOutput) kept[j] = out;
        }

        // ---- 5. FP8: the output's groups (per_token: the token, across the consumer warps; block128: 16
        // consecutive vectors), then codes and scales. The output vectors are kept from step 4 (V <= 4) or
        // recomputed from the mixture (the same instructions, the same bits; V = 8, whose registers are the
        // scarce resource). For a fixed j the 32 lanes of a warp
        // own 32 consecutive vectors (persistent_layout.hpp owned_vector; vector offset(j) / 16), so when the
        // chunk is a multiple of 16 vectors each 128-column group lies on 16 aligned lanes of one warp (a
        // butterfly); other chunks (H with H / 8 not a multiple of 16 per chunk) let a group straddle two chunks,
        // hence two warps: those reduce through shared memory. Every reduction is a max of bit patterns:
        // order-independent. ----
        if constexpr (FP8 != Fp8Mode::none) {
          const auto output_vector = [&](int j) {
            if constexpr (kKeepOutput) return valid(j) ? kept[j] : make_uint4(0, 0, 0, 0);
            float m[8];
            unpack8(mixed[j], m);
            const uint4 w = kNormInRegisters || valid(j) ? norm_vector(j) : make_uint4(0, 0, 0, 0);
            return valid(j) ? rms_output8_scaled(m, r, w) : make_uint4(0, 0, 0, 0);
          };
          uint32_t amax[V];
          if constexpr (FP8 == Fp8Mode::per_token) {
            uint32_t mine = 0;
#pragma unroll
            for (int j = 0; j < V; ++j) mine = max(mine, amax_bits8(output_vector(j)));
            uint32_t* const warp_amax =
                reinterpret_cast<uint32_t*>(smem + p.mix_squares_offset + persistent::kFp8AmaxInMixSquares);
            mine = warp_max_u32(mine);
            if (lane == 0) warp_amax[warp] = mine;
            consumer_barrier(C);
            uint32_t token_amax = 0;
            for (int w = 0; w < consumer_warps; ++w) token_amax = max(token_amax, warp_amax[w]);
#pragma unroll
            for (int j = 0; j < V; ++j) amax[j] = token_amax;
          } else if (p.chunk % 16 == 0) {
#pragma unroll
            for (int j = 0; j < V; ++j) amax[j] = half_warp_max_u32(amax_bits8(output_vector(j)), lane);
          } else {
            // The partials block is free here: every consumer read its partials (step 2) before step 4's
            // barrier, and the next token writes them only after the last barrier below. H / 128 <= 128 groups.
            uint32_t* const group_amax = reinterpret_cast<uint32_t*>(partials);
            for (int g = tid; g < p.vectors / 16; g += C) group_amax[g] = 0u;
            consumer_barrier(C);
#pragma unroll
            for (int j = 0; j < V; ++j)
              if (valid(j)) atomicMax(&group_amax[offset(j) / 256], amax_bits8(output_vector(j)));
            consumer_barrier(C);
#pragma unroll
            for (int j = 0; j < V; ++j) amax[j] = valid(j) ? group_amax[offset(j) / 256] : 0u;
            consumer_barrier(C);
          }
#pragma unroll
          for (int j = 0; j < V; ++j) {
            if (!valid(j)) continue;
            const float sc = fp8_scale(amax[j], p.fp8_pow2 != 0);
            const int v = static_cast<int>(offset(j) / 16);  // the vector's index
            *reinterpret_cast<uint2*>(p.output_fp8 + t * p.output_fp8_stride + static_cast<int64_t>(v) * 8) =
                fp8_codes8(output_vector(j), sc);
            if constexpr (FP8 == Fp8Mode::per_token) {
              if (v == 0) p.fp8_scales[t * p.fp8_scales_stride[0]] = sc;
            } else {
              if ((v & 15) == 0) p.fp8_scales[t * p.fp8_scales_stride[0] + (v >> 4) * p.fp8_scales_stride[1]] = sc;
            }
          }
        }
      }
    }
  }
}

using PersistentKernel = void (*)(PersistentParams);

// The instance for `vectors` per consumer thread (nullptr for none). Two blocks per SM have no 8-vector bucket
// (H > 8192 takes more than kTwoBlocksMaxThreads threads); the plan declines that geometry.
template <int ADDS, Fp8Mode FP8, int BLOCKS_PER_SM, bool NORM>
PersistentKernel persistent_instance(int vectors) {
  switch (vectors) {
    case 1: return attn_res_persistent_kernel<1, ADDS, FP8, BLOCKS_PER_SM, NORM>;
    case 2: return attn_res_persistent_kernel<2, ADDS, FP8, BLOCKS_PER_SM, NORM>;
    case 4: return attn_res_persistent_kernel<4, ADDS, FP8, BLOCKS_PER_SM, NORM>;
    case 8:
      if constexpr (BLOCKS_PER_SM == 1) return attn_res_persistent_kernel<8, ADDS, FP8, 1, NORM>;
      return nullptr;
    default: return nullptr;
  }
}

// attn_res's instances (NORM = false; nullptr for none), in their own translation unit
// (cuda/attn_res_persistent_mix_instances.cu).
PersistentKernel persistent_mix_instance(int adds, int vectors, int blocks_per_sm);

}  // namespace attnres::detail
