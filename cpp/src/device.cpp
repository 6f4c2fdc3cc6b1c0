#include <mutex>
#include <string>
#include <unordered_map>

#include "attnres/device.hpp"
#include "attnres/error.hpp"
#include "attnres/version.hpp"
#include "backend.hpp"

namespace attnres {

bool cuda_backend_built() { return ATTNRES_WITH_CUDA != 0; }

int cuda_device_count() {
#if ATTNRES_WITH_CUDA
  return detail::cuda_device_count();
#else
  return 0;
#endif
}

DeviceInfo query_device(Device device) {
  DeviceInfo info;
  info.device = device;
  info.cuda_backend = cuda_backend_built();
  if (device.type == DeviceType::cpu) {
    info.name = "cpu";
    return info;
  }
#if ATTNRES_WITH_CUDA
  // Device properties do not change during a process: query once per device, outside the hot path.
  static std::mutex mutex;
  static std::unordered_map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device.index);
  if (it != cache.end()) return it->second;
  const int count = detail::cuda_device_count();
  if (device.index < 0 || device.index >= count)
    throw ArgumentError("attnres: " + device_name(device) + " does not exist (" + std::to_string(count) +
                        " CUDA devices visible)");
  info = detail::cuda_query_device(device.index);
  info.queried = true;
  cache.emplace(device.index, info);
  return info;
#else
  info.name = "cuda (not built)";
  return info;
#endif
}

DeviceInfo described_device(const std::string& name) {
  DeviceInfo info;
  info.device = Device{DeviceType::cuda, 0};
  info.cuda_backend = true;
  info.cc_major = 9;
  info.cc_minor = 0;
  info.shared_memory_per_block_optin = 232448;  // cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90
  if (name == "h200") {
    info.sm_count = 132;
    info.name = "NVIDIA H200";
  } else if (name == "h100") {
    info.sm_count = 132;
    info.name = "NVIDIA H100 80GB HBM3";
  } else {
    throw ArgumentError("attnres: no described device '" + name + "' (h100 or h200)");
  }
  return info;
}

}  // namespace attnres
