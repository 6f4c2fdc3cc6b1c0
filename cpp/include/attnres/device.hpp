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
  // Queried from a visible GPU by query_device (not described): the plan may then also ask the GPU's occupancy
  // calculator (attnres::plan), so it is the plan that run() launches there.
  bool queried = false;
};

// True when the CUDA backend was compiled into this build.
bool cuda_backend_built();

// Number of CUDA devices visible (0 without the CUDA backend or without a GPU); never throws.
int cuda_device_count();

// Queries (and caches) the device's properties: a CUDA device is queried once per process, and every later
// call returns the cached properties without a lock (the call path asks on every launch). The reference stays
// valid for the process's lifetime. For a CUDA device without the CUDA backend the result has
// cuda_backend = false and the plan declines; an index out of range throws ArgumentError.
const DeviceInfo& query_device(Device device);

// The properties of a GPU the plan depends on, without the GPU: "h100" (SXM, 132 SMs) or "h200" (132 SMs),
// both compute capability 9.0 with 227 KB of opt-in shared memory per block, as cuda:0 of a build with the
// CUDA backend. plan(query, described_device("h200"), options) is the plan a CUDA build takes on that GPU.
// Throws ArgumentError for any other name.
DeviceInfo described_device(const std::string& name);

}  // namespace attnres
