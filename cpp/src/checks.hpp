// Precondition checks shared by every op's validation: one wording for one rule, whichever op reports it.
// Messages: "<op>: <argument> <rule>".
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "attnres/error.hpp"
#include "attnres/tensor.hpp"
#include "layout.hpp"

namespace attnres::detail {

class Checker {
 public:
  // `op` must outlive the checker (an op's name literal, or the validator's argument): nothing is copied until
  // a check fails, so a call that passes allocates nothing here.
  explicit Checker(std::string_view op) : op_(op) {}

  [[noreturn]] void fail(const std::string& arg, const std::string& rule) const {
    throw ArgumentError(op_text() + ": " + arg + " " + rule);
  }

  std::string op_text() const { return std::string(op_); }

  void dtype(const char* arg, const TensorRef& t, DType want) const {
    if (t.dtype != want) fail(arg, std::string("must be ") + dtype_name(want) + ", got " + dtype_name(t.dtype));
  }

  // Non-negative strides, innermost stride 1, no element reachable through two indices, a data pointer: a
  // padded or sliced view works through its strides or is refused, never read as if dense.
  void layout(const char* arg, const TensorRef& t) const {
    for (int i = 0; i < t.ndim; ++i)
      if (t.strides[i] < 0) fail(arg, "has a negative stride " + t.strides_string());
    int64_t bytes = 0;
    if (!byte_extent(t, bytes))
      fail(arg, "has a layout whose extent overflows 64-bit address arithmetic (shape " + t.shape_string() +
                    ", strides " + t.strides_string() + "): no allocation can back it");
    if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1)
      fail(arg, "must have a contiguous last dimension (stride 1), got strides " + t.strides_string());
    if (!non_overlapping(t))
      fail(arg, "has an overlapping layout (shape " + t.shape_string() + ", strides " + t.strides_string() +
                    "): every element must have its own address");
    if (t.numel() > 0 && t.data == nullptr) fail(arg, "has a null data pointer");
  }

  void device(const char* arg, const TensorRef& t, Device want, const char* ref_arg) const {
    if (t.device != want)
      fail(arg, "is on " + device_name(t.device) + " but " + ref_arg + " is on " + device_name(want) +
                    " (all tensors must be on one device)");
  }

  // The kernels compute in fp32: a double that is finite but overflows fp32 (1e39) is refused as well.
  void eps(const char* arg, double v) const {
    if (!std::isfinite(v) || v < 0) fail(arg, "must be finite and >= 0, got " + number_string(v));
    if (!finite_as_f32(v)) fail(arg, "must be finite and >= 0, got " + number_string(v) + f32_overflow);
  }

  void finite(const char* arg, double v) const {
    if (!std::isfinite(v)) fail(arg, "must be finite, got " + number_string(v));
    if (!finite_as_f32(v)) fail(arg, "must be finite, got " + number_string(v) + f32_overflow);
  }

  static constexpr const char* f32_overflow = " (infinite as float32, the precision the kernels compute in)";
  // |v| below FLT_MAX + half an ulp rounds to a finite float (the cast itself would be undefined above it).
  static bool finite_as_f32(double v) { return std::isfinite(v) && std::fabs(v) < 0x1.ffffffp+127; }

  // The CUDA kernels read and write 16-byte vectors (8 x bf16): base pointer and every outer stride aligned.
  void aligned16(const char* arg, const TensorRef& t) const {
    if (!t.present() || t.numel() == 0) return;
    bool ok = reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
    for (int i = 0; i + 1 < t.ndim; ++i)
      if (t.shape[i] > 1 && (t.strides[i] * dtype_size(t.dtype)) % 16 != 0) ok = false;
    if (!ok)
      fail(arg, "must be 16-byte aligned for the CUDA kernels (base pointer and outer strides a multiple of "
                "16 bytes), got strides " + t.strides_string());
  }

 private:
  std::string_view op_;
};

}  // namespace attnres::detail
