// Small device helpers shared by the kernels: 16-byte bf16 vectors, the non-flushing add, PDL and cluster
// barriers written as explicit PTX so no compiler flag can change their meaning.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace attnres::detail {

// 8 bf16 values in one 16-byte vector, loaded only when `pred` holds (zeros otherwise). A predicated PTX
// load instead of an `if`: the load sequence stays one basic block, so ptxas keeps every load of a token in
// flight at once. (With a branch around each load it waited for each load before the next: measured on the
// H200 as one DRAM round trip per candidate row, ~0.6 us each.) volatile + "memory" keep the program order
// relative to griddepcontrol.wait.
__device__ __forceinline__ uint4 load_nc16_if(const __nv_bfloat16* p, bool pred) {
  uint4 v;
  asm volatile(
      "{\n"
      "  .reg .pred q;\n"
      "  setp.ne.b32 q, %5, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  mov.b32 %1, 0;\n"
      "  mov.b32 %2, 0;\n"
      "  mov.b32 %3, 0;\n"
      "  @q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
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

// Programmatic dependent launch (sm_90). Both are no-ops when the launch did not enable PDL.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Split cluster barrier: arrive once this block no longer reads peers' shared memory, wait before exiting
// (a block's shared memory must outlive every remote read of it).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// A float of block `rank`'s shared memory at this block's shared address `local` (distributed shared
// memory), or +0 when `pred` is false. Predicated like load_nc16_if so the reads of all ranks overlap.
__device__ __forceinline__ float load_dsmem_if(uint32_t local, int rank, bool pred) {
  float v;
  asm volatile(
      "{\n"
      "  .reg .pred q;\n"
      "  .reg .b32 remote;\n"
      "  setp.ne.b32 q, %3, 0;\n"
      "  mov.b32 %0, 0f00000000;\n"
      "  mapa.shared::cluster.u32 remote, %1, %2;\n"
      "  @q ld.shared::cluster.f32 %0, [remote];\n"
      "}\n"
      : "=f"(v)
      : "r"(local), "r"(rank), "r"(static_cast<int>(pred))
      : "memory");
  return v;
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Butterfly sum over the 32 lanes: a fixed tree, and every lane ends with the same bits (each pairwise add
// is commutative, so lane i and lane i^m compute the same value at every level).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

}  // namespace attnres::detail
