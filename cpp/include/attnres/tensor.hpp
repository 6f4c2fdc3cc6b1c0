// Caller-owned strided tensor views: the only way data enters the library.
//
// The library never allocates, never copies and never keeps a pointer past the call. A TensorRef is a raw
// pointer plus dtype, device, shape and strides (in elements), so any framework (PyTorch, a serving engine's
// own allocator, a C++ test) can hand its buffers over without conversion.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "attnres/limits.hpp"

namespace attnres {

// The ops take bf16 and fp32 (diagnostics, FP8 scales) tensors and write e4m3 (float8_e4m3fn: 4 exponent
// bits, bias 7, 3 mantissa bits, no infinities, 0x7F / 0xFF NaN, max 448) FP8 outputs; the other codes exist so
// that a wrong dtype is named in the error message instead of being misread. `other` is for a dtype the
// caller's framework has and this list does not (its message says so).
enum class DType : int32_t {
  bf16 = 0, f32 = 1, i32 = 2, f16 = 3, f64 = 4, i64 = 5, u8 = 6, other = 7,
  boolean = 8, i8 = 9, i16 = 10, u16 = 11, u32 = 12, u64 = 13, c32 = 14, c64 = 15, c128 = 16, e4m3 = 17,
};
enum class DeviceType : int32_t { cpu = 0, cuda = 1 };

const char* dtype_name(DType dtype);
int64_t dtype_size(DType dtype);

struct Device {
  DeviceType type = DeviceType::cpu;
  int32_t index = 0;
};
inline bool operator==(Device a, Device b) { return a.type == b.type && a.index == b.index; }
inline bool operator!=(Device a, Device b) { return !(a == b); }
std::string device_name(Device device);
// The shortest text that reads back as exactly v ("-1e-07", "1e+39", "inf"): error messages print doubles.
std::string number_string(double v);

struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::bf16;
  Device device{};
  int32_t ndim = -1;  // -1: the argument is absent (optional inputs and outputs)
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};  // in elements, not bytes

  bool present() const { return ndim >= 0; }
  int64_t numel() const;
  // Half-open byte range [lo, hi) the view can touch; {0, 0} for an empty view.
  void byte_range(uintptr_t& lo, uintptr_t& hi) const;
  std::string shape_string() const;
  std::string strides_string() const;
};

// Builds a view. Empty `strides` means row-major contiguous.
TensorRef make_ref(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape,
                   std::initializer_list<int64_t> strides = {});

}  // namespace attnres
