// Small device helpers shared by the kernels: 16-byte bf16 vectors, the non-flushing add, PDL and cluster
// barriers written as explicit PTX so no compiler flag can change their meaning.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace attnres::detail {

// 8 bf16 values in one 16-byte vector, loaded only when `pred` holds (zeros otherwise). A predicated PTX
// load instead of an `if`: the load sequence stays one basic block, so ptxas keeps every load of a token in
// flight at once. (With a branch around each load it waited for each load before the next: measured on the
// H200 as one DRAM round trip per candidate row, ~0.6 us each.) A plain ld.global, not ld.global.nc:
// ptxas 13.0 hoisted griddepcontrol.wait above .nc loads (SASS: ACQBULK before the LDGs), which turned the
// PDL prefetch into post-wait loads; coherent loads stay where the program puts them.
__device__ __forceinline__ uint4 load16_if(const __nv_bfloat16* p, bool pred) {
  uint4 v;
  asm volatile(
      "{\n"
      "  .reg .pred q;\n"
      "  setp.ne.b32 q, %5, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  mov.b32 %1, 0;\n"
      "  mov.b32 %2, 0;\n"
      "  mov.b32 %3, 0;\n"
      "  @q ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred))
      : "memory");
  return v;
}
// `v` replaced by the 16 bytes at p only when `pred` holds: a predicated load into the same registers, so merging a
// row that may or may not have been loaded earlier takes no second register set.
__device__ __forceinline__ uint4 load16_or_keep(uint4 v, const __nv_bfloat16* p, bool pred) {
  asm volatile(
      "{\n"
      "  .reg .pred q;\n"
      "  setp.ne.b32 q, %5, 0;\n"
      "  @q ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred))
      : "memory");
  return v;
}
__device__ __forceinline__ void store16(__nv_bfloat16* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 word.
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// One vector's (sum of squares, dot with q) — a candidate row's partial sums in every AttnRes kernel: fma chains
// over its 8 elements in order.
// `v`, which the compiler can no longer prove equal to any earlier value: what is computed from it is
// recomputed, not kept alive from before (no instruction).
__device__ __forceinline__ uint4 opaque(uint4 v) {
  asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
  return v;
}

__device__ __forceinline__ void vector_scores(uint4 x, const float (&q)[8], float& ss, float& dot) {
  float f[8];
  unpack8(x, f);
  ss = 0.0f;
  dot = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    ss = fmaf(f[e], f[e], ss);
    dot = fmaf(f[e], q[e], dot);
  }
}

// fp32 -> bf16, round to nearest even; cvt.rn.bf16x2.f32 keeps subnormals.
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// The prefix-update add (ops.md step 1): round-to-nearest fp32 add with no flush to zero, written as PTX so
// that -ftz / --use_fast_math cannot turn it into add.ftz.
__device__ __forceinline__ float add_rn_keep_subnormals(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Asynchronous 16-byte copy global -> shared (cp.async, L2 only), or 16 zero bytes when `pred` is false (the
// source is then not read; `gmem` must still be a valid address). Completion is tracked per thread: a thread's
// cp_async_wait_all() makes its own copies visible to itself (no barrier when each thread reads only its own).
__device__ __forceinline__ void cp_async16_zfill(uint32_t smem, const void* gmem, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(pred ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// All but this thread's PENDING most recent groups of copies complete (and visible to it).
template <int PENDING>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// Programmatic dependent launch (sm_90). Both are no-ops when the launch did not enable PDL.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Cluster barrier without memory ordering (barrier.cluster.arrive.release compiles to MEMBAR.ALL.GPU, a
// full wait for every outstanding store); used once, to publish the mbarrier initialisation.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// mbarrier-based exchange through distributed shared memory: each block pushes its values into every peer's
// shared memory with st.async, which completes bytes on the peer's mbarrier; a block waits only on its own
// mbarrier (no cluster-wide barrier per exchange).
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "  selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// The shared::cluster address of `local` (a shared::cta address of this block) in block `rank`.
__device__ __forceinline__ uint32_t map_to_rank(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ void st_async_f32(uint32_t remote, float v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote),
               "r"(__float_as_uint(v)), "r"(remote_bar)
               : "memory");
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Warp reduce-scatter of M values per lane (M a power of two, <= 32): afterwards lane l holds the warp's sum of
// value index l / (32 / M). Each level halves the values a lane carries (M/2 + M/4 + ... shuffles instead of
// 5 per value); once one value is left, butterfly levels finish the sum. A fixed tree: deterministic, and
// lanes holding the same index hold the same bits (each pairwise add is commutative).
template <int M, int OFFSET = 16>
__device__ __forceinline__ float warp_reduce_scatter(const float (&v)[M], int lane) {
  if constexpr (M == 1) {
    float x = v[0];
#pragma unroll
    for (int o = OFFSET; o >= 1; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
  } else {
    const bool upper = (lane & OFFSET) != 0;
    float next[M / 2];
#pragma unroll
    for (int i = 0; i < M / 2; ++i) {
      const float send = upper ? v[i] : v[i + M / 2];
      const float keep = upper ? v[i + M / 2] : v[i];
      next[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFFSET);
    }
    return warp_reduce_scatter<M / 2, OFFSET / 2>(next, lane);
  }
}

// Butterfly sum over the 32 lanes: a fixed tree, and every lane ends with the same bits (each pairwise add
// is commutative, so lane i and lane i^m compute the same value at every level).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// The global nanosecond timer (%globaltimer): the deadlines of the all-reduce exchange and the persistent
// kernel's watchdog.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace attnres::detail
