// CUDA runtime error -> attnres::CudaError, naming what was attempted.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "attnres/error.hpp"

namespace attnres::detail {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw CudaError(std::string("attnres: ") + what + " failed: " + cudaGetErrorName(status) + " (" +
                    cudaGetErrorString(status) + ")");
}

}  // namespace attnres::detail
