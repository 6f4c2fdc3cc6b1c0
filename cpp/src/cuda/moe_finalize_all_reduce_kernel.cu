// MoE finalize + one-shot all-reduce + latent RMSNorm in one kernel (sm_90): one block per token, moe_finalize's
// geometry (plan_moe_finalize: `vectors` 16-byte slices per thread, `route_chunk` routes in flight).
//
//   1. the local-route combine, exactly moe_finalize's without shared and norm: acc = sum_j w_j * rows[index_j]
//      over routes with index >= 0 (explicit mul.rn / add.rn in j order), partial = bf16(scale * acc); a token
//      with an out-of-range route contributes an all-NaN partial (so every rank's reduced row is NaN);
//   2. the one-shot exchange of the partial (cuda/all_reduce_protocol.cuh: push, poll, fp32 sum in rank
//      order, one rounding) -> the reduced latent x;
//   3. moe_finalize's two-rounding RMSNorm of x, the one of cuda/moe_norm.cuh (per thread in element order,
//      warp butterfly, warps in index order): the same bits as moe_finalize(norm_weight=...) run on x.
#include <cuda_runtime.h>

#include "backend.hpp"
#include "cuda/all_reduce_protocol.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"
#include "cuda/moe_combine.cuh"
#include "cuda/moe_norm.cuh"

namespace attnres::detail {

namespace {

constexpr int kMaxThreads = 512;
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kMaxRoutes = 32;

struct FusedParams {
  Exchange x;
  const char* rows;
  const void* weights;
  const int32_t* index;
  const uint4* norm_weight;
  char* output;
  char* reduced;  // or nullptr
  int64_t rows_stride, output_stride, reduced_stride;  // bytes
  int64_t num_rows;
  int32_t routes, vectors;
  float hidden, eps, scale;
};

using moe_norm::hi;
using moe_norm::lo;
using moe_norm::mul_rn;
using moe_norm::pack;
using moe_norm::word;

template <typename Wt>
__device__ __forceinline__ float load_weight(const void* w, int64_t i) {
  if constexpr (sizeof(Wt) == 4) return static_cast<const float*>(w)[i];
  else return __uint_as_float(static_cast<uint32_t>(static_cast<const unsigned short*>(w)[i]) << 16);
}

template <int W, int VPT, int CHUNK, typename Wt>
__global__ void __launch_bounds__(kMaxThreads) moe_finalize_all_reduce(const FusedParams p) {
  __shared__ int32_t s_index[kMaxRoutes];
  __shared__ float s_weight[kMaxRoutes];
  __shared__ int s_bad;
  __shared__ float s_partial[kMaxWarps];
  __shared__ float s_r;
  __shared__ uint32_t s_generation, s_ok;

  const int tid = threadIdx.x;
  const int64_t t = blockIdx.x;
  grid_dependency_wait();
  // Released right after the wait (docs/ops/pdl.md): dependents still wait for this grid's completion before
  // reading anything it writes, and their pre-wait loads overlap the exchange.
  launch_dependents();

  uint4 nw[VPT];
#pragma unroll
  for (int u = 0; u < VPT; ++u) {
    const int vec = tid + u * blockDim.x;
    nw[u] = load16_if(reinterpret_cast<const __nv_bfloat16*>(p.norm_weight + vec), vec < p.vectors);
  }
  if (tid < kMaxRoutes) {
    int32_t r = -1;
    float w = 0.0f;
    if (tid < p.routes) {
      r = p.index[t * p.routes + tid];
      w = load_weight<Wt>(p.weights, t * p.routes + tid);
    }
    const bool bad = tid < p.routes && (r < -1 || static_cast<int64_t>(r) >= p.num_rows);
    const unsigned any_bad = __ballot_sync(0xffffffffu, bad);
    s_index[tid] = bad ? -1 : r;
    s_weight[tid] = w;
    if (tid == 0) s_bad = any_bad != 0u;
  }
  if (tid == 0) {
    uint32_t g;
    s_ok = begin_call(p.x, g) ? 1u : 0u;
    s_generation = g;
  }
  __syncthreads();
  if (!s_ok) return;
  const uint32_t generation = s_generation;

  // 1. The local-route partial.
  float acc[VPT][8];
  moe_combine_routes<VPT, CHUNK>(acc, p.rows, p.rows_stride, s_index, s_weight, p.routes, p.vectors, tid,
                                 blockDim.x);

  // 2. Exchange and reduce; x holds the reduced latent (bf16).
  uint4 x[VPT];
  bool ok = true;
#pragma unroll
  for (int u = 0; u < VPT; ++u) {
    const int vec = tid + u * blockDim.x;
    uint4 partial;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      word(partial, i) = s_bad ? 0x7fc07fc0u : pack(mul_rn(acc[u][2 * i], p.scale), mul_rn(acc[u][2 * i + 1], p.scale));
    x[u] = make_uint4(0, 0, 0, 0);
    if (vec < p.vectors) {
      uint4 got[W];
      if (exchange_vector<W>(p.x, generation % 3u, t, vec, partial, got)) {
        float sum[8];
        sum_in_rank_order<W>(got, sum);
        x[u] = pack8(sum);
      } else {
        ok = false;
      }
    }
  }
  // A timed-out thread leaves the block without outputs; the norm needs every thread, so the block decides once.
  const bool block_ok = __syncthreads_and(ok) != 0;

  if (block_ok) {
    // 3. The two-rounding RMSNorm, moe_finalize's own (cuda/moe_norm.cuh); block-uniform, as it must be.
    const float r = moe_norm::inverse_rms<VPT>(x, s_partial, &s_r, p.hidden, p.eps);
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
      const int vec = tid + u * blockDim.x;
      if (vec >= p.vectors) continue;
      if (p.reduced) reinterpret_cast<uint4*>(p.reduced + t * p.reduced_stride)[vec] = x[u];
      uint4 out;
      moe_norm::apply(out, x[u], nw[u], r);
      reinterpret_cast<uint4*>(p.output + t * p.output_stride)[vec] = out;
    }
  }
#pragma unroll
  for (int u = 0; u < VPT; ++u) {
    const int vec = tid + u * blockDim.x;
    if (vec < p.vectors) clear_previous<W>(p.x, generation, t, p.x.tokens, vec);
  }
  end_call(p.x, generation);
}

template <int VPT>
constexpr int route_chunk() {
  return VPT == 1 ? 16 : VPT == 2 ? 8 : 2;
}

template <int W, int VPT, typename Wt>
void launch(const FusedParams& p, const MoeFinalizePlan& fp, const AllReducePlan& plan, cudaStream_t stream) {
  constexpr int kChunk = route_chunk<VPT>();
  if (fp.route_chunk != kChunk) throw CudaError("attnres: moe_finalize_all_reduce plan and kernel disagree on the route chunk");
  launch_kernel(moe_finalize_all_reduce<W, VPT, kChunk, Wt>, p, dim3(static_cast<unsigned>(p.x.tokens)),
                dim3(static_cast<unsigned>(plan.threads)), 0, stream, 1, plan.pdl, "moe_finalize_all_reduce launch");
}

template <int W>
void by_vectors(const FusedParams& p, const MoeFinalizePlan& fp, const AllReducePlan& plan, bool f32, cudaStream_t s) {
  switch (fp.vectors) {
    case 1: return f32 ? launch<W, 1, float>(p, fp, plan, s) : launch<W, 1, __nv_bfloat16>(p, fp, plan, s);
    case 2: return f32 ? launch<W, 2, float>(p, fp, plan, s) : launch<W, 2, __nv_bfloat16>(p, fp, plan, s);
    case 4: return f32 ? launch<W, 4, float>(p, fp, plan, s) : launch<W, 4, __nv_bfloat16>(p, fp, plan, s);
    default: throw CudaError("attnres: moe_finalize_all_reduce: unsupported vectors per thread " + std::to_string(fp.vectors));
  }
}

}  // namespace

void cuda_moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& a, const MoeFinalizePlan& fp, const AllReducePlan& plan) {
  const MoeFinalizeArgs& f = a.finalize;
  const int64_t T = f.index.shape[0];
  FusedParams p{};
  p.x = make_exchange(a.comm, T, static_cast<uint32_t>(T));
  p.rows = static_cast<const char*>(f.rows.data);
  p.weights = f.weights.data;
  p.index = static_cast<const int32_t*>(f.index.data);
  p.norm_weight = static_cast<const uint4*>(f.norm_weight.data);
  p.output = static_cast<char*>(f.output.data);
  p.reduced = a.reduced.present() ? static_cast<char*>(a.reduced.data) : nullptr;
  p.rows_stride = f.rows.strides[0] * 2;
  p.output_stride = f.output.strides[0] * 2;
  p.reduced_stride = a.reduced.present() ? a.reduced.strides[0] * 2 : 0;
  p.num_rows = f.rows.shape[0];
  p.routes = static_cast<int32_t>(f.index.shape[1]);
  p.vectors = static_cast<int32_t>(f.rows.shape[1] / 8);
  p.hidden = static_cast<float>(f.rows.shape[1]);
  p.eps = static_cast<float>(f.eps);
  p.scale = static_cast<float>(f.scale);
  const cudaStream_t stream = static_cast<cudaStream_t>(f.stream);
  const bool f32 = f.weights.dtype == DType::f32;
  DeviceGuard guard(a.comm.device.index);
  switch (a.comm.world_size) {
    case 2: return by_vectors<2>(p, fp, plan, f32, stream);
    case 4: return by_vectors<4>(p, fp, plan, f32, stream);
    case 8: return by_vectors<8>(p, fp, plan, f32, stream);
    default:
      throw UnsupportedError("moe_finalize_all_reduce: world size " + std::to_string(a.comm.world_size) +
                             " has no CUDA kernel instance");
  }
}

}  // namespace attnres::detail
