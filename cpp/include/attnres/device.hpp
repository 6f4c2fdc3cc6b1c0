// What the plan needs to know of a device, and whether this build can run on it.
#pragma once

#include <cstdint>
#include <string>

#include "attnres/tensor.hpp"

namespace attnres {

struct DeviceInfo {
  Device device{};
  bool cuda_backend = false;  // this build has the CUDA backend compiled in
  int32_t cc_major = 0, cc_minor = 0;
  int32_t sm_count = 0;
  int32_t shared_memory_per_block_optin = 0;  // bytes a block may opt into (sizes the persistent kernel's ring)
  std::string name;  // "cpu" or the CUDA device name
};

// True when the CUDA backend was compiled into this build.
bool cuda_backend_built();

// Number of CUDA devices visible (0 without the CUDA backend or without a GPU); never throws.
int cuda_device_count();

// Queries (and caches) the device's properties. For a CUDA device without the CUDA backend the result has
// cuda_backend = false and the plan declines; an index out of range throws ArgumentError.
DeviceInfo query_device(Device device);

}  // namespace attnres
