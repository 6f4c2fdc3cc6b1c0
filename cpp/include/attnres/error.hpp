// Errors raised by the library. Every message names the op, the argument and the rule, e.g.
// "attn_res_add_rmsnorm: layer_residual_add2 requires layer_residual_add".
#pragma once

#include <stdexcept>
#include <string>

namespace attnres {

// Base of everything the library throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A violated precondition of the contract (shape, dtype, device, layout, range, aliasing). Raised before
// anything is launched; nothing has been written.
class ArgumentError : public Error {
 public:
  using Error::Error;
};

// A valid call that this build or device cannot run (no CUDA backend, compute capability < 9.0, a plan that
// declines, e.g. the persistent kernel asked for the tap). Raised before anything is launched.
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

// The CUDA runtime reported an error during a launch.
class CudaError : public Error {
 public:
  using Error::Error;
};

}  // namespace attnres
