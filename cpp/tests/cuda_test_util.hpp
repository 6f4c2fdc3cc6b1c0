// Shared helpers of the GPU suites (test_cuda_backend.cpp, test_attn_res_addend.cpp): the skip rule and the
// CUDA error check. CUDA builds only: include it under #if ATTNRES_WITH_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "test_util.hpp"

namespace attnres_test {

// Why the GPU suites cannot run here ("" when they can).
inline std::string gpu_skip_reason() {
  if (attnres::cuda_device_count() == 0) return "no CUDA device visible";
  const attnres::DeviceInfo info = attnres::query_device(kCuda0);
  if (info.cc_major < 9)
    return info.name + " has compute capability " + std::to_string(info.cc_major) + "." +
           std::to_string(info.cc_minor) + " < 9.0";
  return "";
}

#define REQUIRE_HOPPER()                           \
  do {                                             \
    const std::string why_not = gpu_skip_reason(); \
    if (!why_not.empty()) GTEST_SKIP() << why_not; \
  } while (0)

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace attnres_test
