// Device discovery for the plan (runs once per device; never in the call path after the first call).
#include <cuda_runtime.h>

#include "backend.hpp"
#include "cuda/cuda_check.cuh"

namespace attnres::detail {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky error, report none
    return 0;
  }
  return count;
}

DeviceInfo cuda_query_device(int index) {
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties");
  DeviceInfo info;
  info.device = Device{DeviceType::cuda, index};
  info.cuda_backend = true;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.shared_memory_per_block_optin = static_cast<int32_t>(prop.sharedMemPerBlockOptin);
  info.name = prop.name;
  return info;
}

}  // namespace attnres::detail
