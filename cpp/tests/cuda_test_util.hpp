// Shared helpers of the GPU suites (test_cuda_backend.cpp, test_attn_res_addend.cpp): the skip rule, CUDA
// error checks, device mirrors of a Case's buffers and a non-blocking stream. CUDA builds only: include it
// under #if ATTNRES_WITH_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

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

// Device copies of every buffer of a Case (poisoned outputs and padding included), with the same views.
class DeviceMirror {
 public:
  explicit DeviceMirror(const Case& c) : owner_(&c) {
    for (const Buffer* b : c.buffers()) {
      void* p = nullptr;
      cuda_ok(cudaMalloc(&p, b->nbytes() ? b->nbytes() : 16), "cudaMalloc");
      ptrs_.push_back(p);
      if (b->nbytes()) cuda_ok(cudaMemcpy(p, b->host(), b->nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    }
    // A pageable-memory cudaMemcpy may return before its DMA lands, and the tests launch on non-blocking
    // streams that do not order after the legacy stream: wait for the uploads here.
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  ~DeviceMirror() {
    for (void* p : ptrs_) cudaFree(p);
  }
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;

  void* base(const Buffer& b) const {
    const auto all = owner_->buffers();
    for (size_t i = 0; i < all.size(); ++i)
      if (all[i] == &b) return ptrs_[i];
    throw std::logic_error("buffer of another case");
  }
  AttnResArgs args(cudaStream_t stream) const {
    AttnResArgs a = owner_->args_on([this](const Buffer& b) { return base(b); }, kCuda0);
    a.stream = stream;
    return a;
  }
  Case download() const {
    Case out = *owner_;
    const auto dst = out.buffers();
    for (size_t i = 0; i < dst.size(); ++i)
      if (dst[i]->nbytes()) cuda_ok(cudaMemcpy(dst[i]->host(), ptrs_[i], dst[i]->nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return out;
  }

 private:
  const Case* owner_;
  std::vector<void*> ptrs_;
};

// A non-blocking stream, destroyed on scope exit; sync() waits for it and reports a kernel error.
class Stream {
 public:
  Stream() { cuda_ok(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s_); }
  cudaStream_t get() const { return s_; }
  void sync() const {
    cuda_ok(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
    cuda_ok(cudaGetLastError(), "kernel");
  }

 private:
  cudaStream_t s_ = nullptr;
};

}  // namespace attnres_test
