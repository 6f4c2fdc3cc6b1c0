// Host-side helpers shared by the launchers (attention-residual per-token and persistent, MoE finalize, all-reduce).
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "attnres/attn_res.hpp"
#include "attnres/tensor.hpp"
#include "cuda/cuda_check.cuh"

namespace attnres::detail {

// The typed device pointer of a tensor view, nullptr when the (optional) tensor is absent.
template <typename T>
T* tensor_ptr(const TensorRef& t) {
  return t.present() ? static_cast<T*>(t.data) : nullptr;
}

// Launches on the tensors' device, restoring the caller's current device afterwards (a library must not
// change the thread's current device behind its caller's back).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The scalars and FP8 outputs that the per-token and persistent kernels' parameters share, from the call.
template <typename Params>
void set_shared_params(Params& p, const AttnResArgs& a) {
  const int64_t H = a.layer_residual.shape[1];
  p.tokens = static_cast<int32_t>(a.layer_residual.shape[0]);
  p.snapshots = static_cast<int32_t>(a.block_residual.shape[0]);
  p.vectors = static_cast<int32_t>(H / 8);
  p.inv_hidden = static_cast<float>(1.0 / static_cast<double>(H));
  p.rms_eps = static_cast<float>(a.rms_eps);
  p.norm_eps = static_cast<float>(a.norm_eps);
  if (a.fp8 != Fp8Scales::none) {
    p.output_fp8 = tensor_ptr<uint8_t>(a.output_fp8);
    p.fp8_scales = tensor_ptr<float>(a.fp8_scales);
    p.output_fp8_stride = a.output_fp8.strides[0];
    p.fp8_scales_stride[0] = a.fp8_scales.strides[0];
    p.fp8_scales_stride[1] = a.fp8_scales.strides[1];
    p.fp8_pow2 = a.fp8_pow2_scales ? 1 : 0;
  }
}

// Dynamic shared memory above 48 KB must be opted into per kernel and device. Done once per (kernel, device) at
// the device's full opt-in size less the kernel's static shared memory (one value, so two threads racing here set the same thing), so every later
// launch of that kernel fits whatever the plan sizes; `max_carveout` also asks for the largest shared-memory
// carveout (the driver picks the L1/shared split per launch, and one sized for a single block would leave a
// second resident block without room). cudaFuncSetAttribute is neither a stream operation nor a
// synchronisation: it is legal while a CUDA graph is being captured
// (tests/kernels/test_cuda_graphs_pdl.py::test_first_call_inside_a_capture).
inline void opt_into_shared_memory(const void* kernel, int device, int optin_bytes, bool max_carveout,
                                   const char* what) {
  static std::mutex mutex;
  static std::set<std::pair<int, const void*>> done;
  std::lock_guard<std::mutex> lock(mutex);
  if (done.count({device, kernel})) return;
  // The opt-in bounds static + dynamic shared memory: the dynamic part may take what the static arrays leave.
  cudaFuncAttributes attributes{};
  cuda_check(cudaFuncGetAttributes(&attributes, kernel), what);
  const int dynamic = optin_bytes - static_cast<int>(attributes.sharedSizeBytes);
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic), what);
  if (max_carveout)
    cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared),
               what);
  done.insert({device, kernel});
}

// The blocks of `kernel` the occupancy calculator says fit one SM with `threads` threads and `smem_bytes` of
// dynamic shared memory. A host-side calculation, not a stream operation; its answer is kept per (device, kernel,
// threads, shared memory), so a capture after an eager call asks nothing. Asked after the shared-memory opt-in,
// whose carveout it depends on.
inline int resident_blocks(const void* kernel, int device, int threads, int smem_bytes, const char* what) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, int>, int> resident;
  const auto key = std::make_tuple(device, kernel, threads, smem_bytes);
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = resident.find(key);
  if (it != resident.end()) return it->second;
  int blocks = 0;
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, static_cast<size_t>(smem_bytes)),
             what);
  resident.emplace(key, blocks);
  return blocks;
}

// cudaLaunchKernelEx of `kernel` on `stream`: `grid` blocks of `block` threads with `smem` bytes of dynamic shared
// memory, in thread-block clusters of `cluster` blocks along x when cluster > 1, and with programmatic stream
// serialization when `pdl` (the kernel may start before its predecessor on the stream completes; it waits for
// it with griddepcontrol.wait). No allocation, no synchronisation: capturable in CUDA graphs.
template <typename Params>
void launch_kernel(void (*kernel)(Params), const Params& params, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, int cluster, bool pdl, const char* what) {
  cudaLaunchAttribute attrs[2];
  unsigned count = 0;
  if (cluster > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = static_cast<unsigned>(cluster);
    attrs[count].val.clusterDim.y = 1;
    attrs[count].val.clusterDim.z = 1;
    ++count;
  }
  if (pdl) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  cuda_check(cudaLaunchKernelEx(&config, kernel, params), what);
}

}  // namespace attnres::detail
