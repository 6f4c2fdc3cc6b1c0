// Host-side helpers shared by the launchers (attention-residual per-token and persistent, MoE finalize).
#pragma once

#include <cuda_runtime.h>

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

}  // namespace attnres::detail
