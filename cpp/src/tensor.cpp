#include "attnres/tensor.hpp"

#include <algorithm>
#include <charconv>
#include <string>

#include "attnres/error.hpp"
#include "layout.hpp"

namespace attnres {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bfloat16";
    case DType::f32: return "float32";
    case DType::i32: return "int32";
    case DType::f16: return "float16";
    case DType::f64: return "float64";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
    case DType::other: return "an unsupported dtype";
    case DType::boolean: return "bool";
    case DType::i8: return "int8";
    case DType::i16: return "int16";
    case DType::u16: return "uint16";
    case DType::u32: return "uint32";
    case DType::u64: return "uint64";
    case DType::c32: return "complex32";
    case DType::c64: return "complex64";
    case DType::c128: return "complex128";
    case DType::e4m3: return "float8_e4m3fn";
  }
  return "an unsupported dtype";
}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 2;
    case DType::f32: return 4;
    case DType::i32: return 4;
    case DType::f16: return 2;
    case DType::f64: return 8;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::other: return 1;
    case DType::boolean: return 1;
    case DType::i8: return 1;
    case DType::i16: return 2;
    case DType::u16: return 2;
    case DType::u32: return 4;
    case DType::u64: return 8;
    case DType::c32: return 4;
    case DType::c64: return 8;
    case DType::c128: return 16;
    case DType::e4m3: return 1;
  }
  return 1;
}

std::string device_name(Device device) {
  if (device.type == DeviceType::cpu) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

// Shapes and strides come from any caller (a DLPack producer may describe a view no allocation could back):
// every product and sum here is checked, and a view whose element count or byte extent does not fit in int64
// is refused rather than wrapped (a wrapped extent would let two tokens' rows share an address).
int64_t TensorRef::numel() const {
  if (!present()) return 0;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] == 0) return 0;
    if (__builtin_mul_overflow(n, shape[i], &n))
      throw ArgumentError("tensor of shape " + shape_string() + " has more elements than int64 can count");
  }
  return n;
}

void TensorRef::byte_range(uintptr_t& lo, uintptr_t& hi) const {
  lo = hi = 0;
  if (!present() || numel() == 0) return;
  // Strides are validated non-negative before ranges are compared, so the first element is the lowest.
  int64_t bytes = 0;
  if (!detail::byte_extent(*this, bytes))
    throw ArgumentError("tensor of shape " + shape_string() + " and strides " + strides_string() +
                        " spans more bytes than 64-bit address arithmetic holds");
  lo = reinterpret_cast<uintptr_t>(data);
  hi = lo + static_cast<uintptr_t>(bytes);
}

// Plain string concatenation, no iostreams: on the H200 machine, Python processes that had torch loaded
// segfaulted inside std::ostringstream when this code built an error message (every rejection whose message
// printed a shape or strides crashed its pytest worker; ctest, without torch, passed the same checks).
static std::string list_string(const int64_t* v, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

std::string number_string(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string TensorRef::shape_string() const { return list_string(shape, ndim < 0 ? 0 : ndim); }
std::string TensorRef::strides_string() const { return list_string(strides, ndim < 0 ? 0 : ndim); }

TensorRef make_ref(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape,
                   std::initializer_list<int64_t> strides) {
  if (shape.size() > static_cast<size_t>(kMaxRank))
    throw ArgumentError("make_ref: rank " + std::to_string(shape.size()) + " exceeds the maximum of " +
                        std::to_string(kMaxRank));
  if (strides.size() != 0 && strides.size() != shape.size())
    throw ArgumentError("make_ref: " + std::to_string(strides.size()) + " strides given for rank " +
                        std::to_string(shape.size()));
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int32_t>(shape.size());
  std::copy(shape.begin(), shape.end(), t.shape);
  if (strides.size() == 0) {
    int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      t.strides[d] = stride;
      stride *= t.shape[d];
    }
  } else {
    std::copy(strides.begin(), strides.end(), t.strides);
  }
  return t;
}

}  // namespace attnres
