#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

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

// The first answer for `device`, kept for the process's lifetime (so references to it stay valid).
const DeviceInfo& kept(Device device, DeviceInfo info) {
  static std::mutex mutex;
  static std::map<std::pair<int, int32_t>, std::unique_ptr<const DeviceInfo>> answers;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = answers[{static_cast<int>(device.type), device.index}];
  if (!slot) slot = std::make_unique<const DeviceInfo>(std::move(info));
  return *slot;
}

}  // namespace

const DeviceInfo& query_device(Device device) {
  if (device.type == DeviceType::cpu) {
    static const DeviceInfo& cpu0 = kept(Device{DeviceType::cpu, 0}, uncached_info(Device{DeviceType::cpu, 0}, "cpu"));
    return device.index == 0 ? cpu0 : kept(device, uncached_info(device, "cpu"));
  }
#if ATTNRES_WITH_CUDA
  // Device properties do not change during a process: each device is queried once, its answer published
  // through an atomic pointer that later calls read without a lock.
  constexpr int kFastSlots = 64;
  static std::atomic<const DeviceInfo*> published[kFastSlots];
  const bool slotted = device.index >= 0 && device.index < kFastSlots;
  if (slotted)
    if (const DeviceInfo* info = published[device.index].load(std::memory_order_acquire)) return *info;
  const int count = detail::cuda_device_count();
  if (device.index < 0 || device.index >= count)
    throw ArgumentError("attnres: " + device_name(device) + " does not exist (" + std::to_string(count) +
                        " CUDA devices visible)");
  DeviceInfo queried = detail::cuda_query_device(device.index);
  queried.queried = true;
  const DeviceInfo& info = kept(device, std::move(queried));
  if (slotted) published[device.index].store(&info, std::memory_order_release);
  return info;
#else
  return kept(device, uncached_info(device, "cuda (not built)"));
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
