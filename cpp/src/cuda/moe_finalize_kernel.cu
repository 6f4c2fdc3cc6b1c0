// The CUDA kernel of moe_finalize (sm_90): one block per token.
//
// Latency is the whole game at decode sizes (T <= 16, k = 16, D = 3584: ~115 KB per token), so a block
//  1. issues the loads that depend on nothing (the shared row, the norm weight) together with the route map
//     (index and weights, read by warp 0 into shared memory): one round trip;
//  2. issues route_chunk routes' 16-byte row slices per thread before using any (k <= route_chunk: one more
//     round trip), then accumulates them in j order (cuda/moe_combine.cuh, shared with moe_finalize_all_reduce);
//  3. with a norm, the two-rounding RMSNorm of cuda/moe_norm.cuh (the sum of squares in a fixed order: warp
//     butterfly, warps in index order), shared with moe_finalize_all_reduce.
//
// Numerics: every step of the combine and the shared add is an explicit mul.rn.f32 / add.rn.f32 (never
// contracted into an FMA, never flushed even under fast-math), so `routed` and the shared sum equal the CPU
// backend's bit for bit. Out-of-range routes cannot be rejected without a host round trip; a token with one
// gets an all-NaN output row instead (docs/ops/moe_finalize.md), and no out-of-bounds row is ever read.
//
// PDL: the kernel waits on the grid dependency before its first global read (any input may come from the
// kernel just before it) and releases dependents right after that wait: a dependent may then start its
// pre-wait section while this kernel runs, but only once this kernel's predecessor has completed, so every
// kernel two or more launches back is complete before any pre-wait load (attn_res_per_token.cuh, "PDL
// release"; docs/ops/pdl.md). This kernel reads nothing before its wait and writes nothing a dependent reads
// before its own wait.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attnres/moe_finalize.hpp"
#include "cuda/cuda_check.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/launch_utils.hpp"
#include "cuda/moe_combine.cuh"
#include "cuda/moe_norm.cuh"

namespace attnres::detail {

namespace {

constexpr int kMaxThreads = 512;
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kMaxRoutes = 32;  // one warp reads the route map
static_assert(kMoeFinalizeMaxRoutes == kMaxRoutes, "the route map is read by one warp");

struct MoeParams {
  const char* rows;            // [R, D] bf16
  const void* weights;         // [T, k] fp32 or bf16, dense
  const int32_t* index;        // [T, k], dense
  const char* shared;          // [T, D] bf16 or nullptr
  const uint4* norm_weight;    // [D] bf16 as 16-byte vectors, or nullptr
  char* output;                // [T, D] bf16
  int64_t rows_stride, shared_stride, output_stride;  // bytes
  int64_t num_rows;            // R
  int32_t routes;              // k
  int32_t vectors;             // D / 8
  float hidden, eps, scale;
};

// bf16 pairs packed little-endian in 32-bit words, and the explicit product (cuda/moe_norm.cuh).
using moe_norm::hi;
using moe_norm::lo;
using moe_norm::mul_rn;
using moe_norm::pack;
using moe_norm::word;

template <typename W>
__device__ __forceinline__ float load_weight(const void* weights, int64_t i);
template <>
__device__ __forceinline__ float load_weight<float>(const void* weights, int64_t i) {
  return __ldg(static_cast<const float*>(weights) + i);
}
template <>
__device__ __forceinline__ float load_weight<__nv_bfloat16>(const void* weights, int64_t i) {
  const uint32_t bits = __ldg(static_cast<const unsigned short*>(weights) + i);
  return __uint_as_float(bits << 16);
}

template <int VPT, int CHUNK, typename W>
__global__ void __launch_bounds__(kMaxThreads) moe_finalize_single_cta(const MoeParams p) {
  __shared__ int32_t s_index[kMaxRoutes];
  __shared__ float s_weight[kMaxRoutes];
  __shared__ int s_bad;
  __shared__ float s_partial[kMaxWarps];
  __shared__ float s_r;

  const int tid = threadIdx.x;
  const int64_t t = blockIdx.x;

  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  // Loads that depend on no route, in flight together with the route map.
  uint4 sh[VPT], nw[VPT];
#pragma unroll
  for (int u = 0; u < VPT; ++u) {
    const int vec = tid + u * blockDim.x;
    sh[u] = make_uint4(0, 0, 0, 0);
    nw[u] = make_uint4(0, 0, 0, 0);
    if (vec < p.vectors) {
      if (p.shared) sh[u] = __ldg(reinterpret_cast<const uint4*>(p.shared + t * p.shared_stride) + vec);
      if (p.norm_weight) nw[u] = __ldg(p.norm_weight + vec);
    }
  }
  if (tid < kMaxRoutes) {
    int32_t r = -1;
    float w = 0.0f;
    if (tid < p.routes) {
      r = __ldg(p.index + t * p.routes + tid);
      w = load_weight<W>(p.weights, t * p.routes + tid);
    }
    const bool bad = tid < p.routes && (r < -1 || static_cast<int64_t>(r) >= p.num_rows);
    const unsigned any_bad = __ballot_sync(0xffffffffu, bad);
    s_index[tid] = bad ? -1 : r;
    s_weight[tid] = w;
    if (tid == 0) s_bad = any_bad != 0u;
  }
  __syncthreads();

  char* out_row = p.output + t * p.output_stride;
  if (s_bad) {  // block-uniform: the whole token is poisoned, nothing out of bounds is read
    const uint4 nan4 = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
      const int vec = tid + u * blockDim.x;
      if (vec < p.vectors) reinterpret_cast<uint4*>(out_row)[vec] = nan4;
    }
    return;
  }

  float acc[VPT][8];
  moe_combine_routes<VPT, CHUNK>(acc, p.rows, p.rows_stride, s_index, s_weight, p.routes, p.vectors, tid,
                                 blockDim.x);

  // routed = bf16(scale * acc); x = bf16(routed + shared).
  uint4 x[VPT];
#pragma unroll
  for (int u = 0; u < VPT; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t routed = pack(mul_rn(acc[u][2 * i], p.scale), mul_rn(acc[u][2 * i + 1], p.scale));
      if (p.shared) {
        const uint32_t s = word(sh[u], i);
        routed = pack(add_rn_keep_subnormals(lo(routed), lo(s)), add_rn_keep_subnormals(hi(routed), hi(s)));
      }
      word(x[u], i) = routed;
    }

  if (p.norm_weight) {
    // The two-rounding RMSNorm of the rounded x (cuda/moe_norm.cuh: the order the fused all-reduce shares).
    const float r = moe_norm::inverse_rms<VPT>(x, s_partial, &s_r, p.hidden, p.eps);
#pragma unroll
    for (int u = 0; u < VPT; ++u) moe_norm::apply(x[u], x[u], nw[u], r);
  }

#pragma unroll
  for (int u = 0; u < VPT; ++u) {
    const int vec = tid + u * blockDim.x;
    if (vec < p.vectors) reinterpret_cast<uint4*>(out_row)[vec] = x[u];
  }
}

// Routes loaded per round trip, as in the plan (plan_moe_finalize): 16 slices per thread in flight, fewer at
// 4 slices per thread where the accumulators and the held shared/norm slices take the registers.
template <int VPT>
constexpr int route_chunk() {
  return VPT == 1 ? 16 : VPT == 2 ? 8 : 2;
}

template <int VPT, typename W>
void launch(const MoeParams& p, const MoeFinalizePlan& plan, int64_t tokens, cudaStream_t stream) {
  constexpr int kChunk = route_chunk<VPT>();
  if (plan.route_chunk != kChunk)
    throw CudaError("attnres: moe_finalize plan and kernel disagree on the route chunk");
  launch_kernel(moe_finalize_single_cta<VPT, kChunk, W>, p, dim3(static_cast<unsigned>(tokens)),
                dim3(static_cast<unsigned>(plan.threads)), 0, stream, 1, plan.pdl, "moe_finalize launch");
}

}  // namespace

void cuda_moe_finalize(const MoeFinalizeArgs& a, const MoeFinalizePlan& plan) {
  MoeParams p{};
  p.rows = static_cast<const char*>(a.rows.data);
  p.weights = a.weights.data;
  p.index = static_cast<const int32_t*>(a.index.data);
  p.shared = a.shared.present() ? static_cast<const char*>(a.shared.data) : nullptr;
  p.norm_weight = a.norm_weight.present() ? static_cast<const uint4*>(a.norm_weight.data) : nullptr;
  p.output = static_cast<char*>(a.output.data);
  p.rows_stride = a.rows.strides[0] * 2;
  p.shared_stride = a.shared.present() ? a.shared.strides[0] * 2 : 0;
  p.output_stride = a.output.strides[0] * 2;
  p.num_rows = a.rows.shape[0];
  p.routes = static_cast<int32_t>(a.index.shape[1]);
  p.vectors = static_cast<int32_t>(a.rows.shape[1] / 8);
  p.hidden = static_cast<float>(a.rows.shape[1]);
  p.eps = static_cast<float>(a.eps);
  p.scale = static_cast<float>(a.scale);

  const int64_t tokens = a.index.shape[0];
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  DeviceGuard guard(a.rows.device.index);
  const bool f32 = a.weights.dtype == DType::f32;
  switch (plan.vectors) {
    case 1:
      return f32 ? launch<1, float>(p, plan, tokens, stream) : launch<1, __nv_bfloat16>(p, plan, tokens, stream);
    case 2:
      return f32 ? launch<2, float>(p, plan, tokens, stream) : launch<2, __nv_bfloat16>(p, plan, tokens, stream);
    case 4:
      return f32 ? launch<4, float>(p, plan, tokens, stream) : launch<4, __nv_bfloat16>(p, plan, tokens, stream);
    default:
      throw CudaError("attnres: moe_finalize plan has an unsupported vectors-per-thread count " +
                      std::to_string(plan.vectors));
  }
}

}  // namespace attnres::detail
