// The one-shot all-reduce kernel (sm_90): grid (blocks_per_token, T), one 16-byte vector of a token per thread.
// The protocol and its memory-ordering argument are in cuda/all_reduce_protocol.cuh.
#include <cuda_runtime.h>

#include "backend.hpp"
#include "cuda/all_reduce_protocol.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"

namespace attnres::detail {

namespace {

struct AllReduceParams {
  Exchange x;
  const __nv_bfloat16* input;
  __nv_bfloat16* output;
  int64_t input_stride, output_stride;  // elements
  int32_t vectors;                      // D / 8
  bool early_trigger;
};

// The block's view of the call: generation and health, read once by thread 0 (another block may set the
// error word meanwhile; the block must take one branch as a whole).
__device__ __forceinline__ bool block_begin(const Exchange& x, uint32_t& generation) {
  __shared__ uint32_t s_generation, s_ok;
  if (threadIdx.x == 0) {
    uint32_t g;
    s_ok = begin_call(x, g) ? 1u : 0u;
    s_generation = g;
  }
  __syncthreads();
  generation = s_generation;
  return s_ok != 0u;
}

template <int W>
__global__ void __launch_bounds__(128) one_shot_all_reduce(const AllReduceParams p) {
  grid_dependency_wait();
  // Released right after the wait, never before it (docs/ops/pdl.md): the dependent's pre-wait loads then
  // overlap the exchange, and every kernel two or more launches back has completed when they run.
  if (p.early_trigger) launch_dependents();
  uint32_t generation;
  if (!block_begin(p.x, generation)) return;
  const int64_t token = blockIdx.y;
  const int vec = blockIdx.x * blockDim.x + threadIdx.x;
  if (vec < p.vectors) {
    const uint4 mine = load16_if(p.input + token * p.input_stride + static_cast<int64_t>(vec) * 8, true);
    uint4 got[W];
    if (exchange_vector<W>(p.x, generation % 3u, token, vec, mine, got)) {
      float acc[8];
      sum_in_rank_order<W>(got, acc);
      store16(p.output + token * p.output_stride + static_cast<int64_t>(vec) * 8, pack8(acc));
    }
    clear_previous<W>(p.x, generation, token, p.x.tokens, vec);
  }
  end_call(p.x, generation);
  if (!p.early_trigger) {
    __syncthreads();
    if (threadIdx.x == 0) launch_dependents();
  }
}

template <int W>
void launch(const AllReduceParams& p, const AllReducePlan& plan, cudaStream_t stream) {
  launch_kernel(one_shot_all_reduce<W>, p,
                dim3(static_cast<unsigned>(plan.blocks_per_token), static_cast<unsigned>(p.x.tokens)),
                dim3(static_cast<unsigned>(plan.threads)), 0, stream, 1, plan.pdl, "all_reduce launch");
}

}  // namespace

Exchange make_exchange(const CommRef& c, int64_t tokens, uint32_t total_blocks) {
  Exchange x{};
  for (int r = 0; r < kAllReduceMaxWorld; ++r) x.buffers[r] = reinterpret_cast<__nv_bfloat16*>(c.buffers[r]);
  x.state = reinterpret_cast<uint32_t*>(c.state);
  x.world = c.world_size;
  x.rank = c.rank;
  x.tokens = static_cast<int32_t>(tokens);
  x.capacity = c.capacity;
  x.width = c.width;
  x.timeout_ns = c.timeout_ns;
  x.total_blocks = total_blocks;
  return x;
}

void cuda_all_reduce(const AllReduceArgs& a, const AllReducePlan& plan) {
  if (plan.threads != 128) throw CudaError("attnres: all_reduce plan and kernel disagree on the block size");
  const int64_t T = a.input.shape[0];
  AllReduceParams p{};
  p.x = make_exchange(a.comm, T, static_cast<uint32_t>(plan.blocks_per_token * T));
  p.input = tensor_ptr<const __nv_bfloat16>(a.input);
  p.output = tensor_ptr<__nv_bfloat16>(a.output);
  p.input_stride = a.input.strides[0];
  p.output_stride = a.output.strides[0];
  p.vectors = static_cast<int32_t>(a.comm.width / 8);
  p.early_trigger = plan.early_trigger;
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  DeviceGuard guard(a.comm.device.index);
  switch (a.comm.world_size) {
    case 2: return launch<2>(p, plan, stream);
    case 4: return launch<4>(p, plan, stream);
    case 8: return launch<8>(p, plan, stream);
    default:
      throw UnsupportedError("all_reduce: world size " + std::to_string(a.comm.world_size) + " has no CUDA kernel instance");
  }
}

}  // namespace attnres::detail
