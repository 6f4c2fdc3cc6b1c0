#include <atomic>
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

namespace {

DeviceInfo uncached_info(Device device, const char* name) {
  DeviceInfo info;
  info.device = device;
  info.cuda_backend = cuda_backend_built();
  info.name = name;
  return info;
}

}  // namespace

const DeviceInfo& query_device(Device device) {
  if (device.type == DeviceType::cpu) {
    static const DeviceInfo cpu0 = uncached_info(Device{DeviceType::cpu, 0}, "cpu");
    if (device.index == 0) return cpu0;
    thread_local DeviceInfo other;  // a CPU device named with another index: answered as asked
    other = uncached_info(device, "cpu");
    return other;
  }
#if ATTNRES_WITH_CUDA
  // Device properties do not change during a process: each device is queried once, its answer published
  // through an atomic pointer that later calls read without the lock.
  constexpr int kFastSlots = 64;
  static std::atomic<const DeviceInfo*> published[kFastSlots];
  const bool slotted = device.index >= 0 && device.index < kFastSlots;
  if (slotted)
    if (const DeviceInfo* info = published[device.index].load(std::memory_order_acquire)) return *info;
  static std::mutex mutex;
  static std::unordered_map<int, const DeviceInfo*> cache;  // kept for the process's lifetime
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device.index);
  if (it != cache.end()) return *it->second;
  const int count = detail::cuda_device_count();
  if (device.index < 0 || device.index >= count)
    throw ArgumentError("attnres: " + device_name(device) + " does not exist (" + std::to_string(count) +
                        " CUDA devices visible)");
  auto* info = new DeviceInfo(detail::cuda_query_device(device.index));
  info->queried = true;
  cache.emplace(device.index, info);
  if (slotted) published[device.index].store(info, std::memory_order_release);
  return *info;
#else
  thread_local DeviceInfo not_built;
  not_built = uncached_info(device, "cuda (not built)");
  return not_built;
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
