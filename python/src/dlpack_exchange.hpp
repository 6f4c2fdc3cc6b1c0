// The DLPack C exchange table (DLPack >= 1.2, `DLPackExchangeAPI`): a framework publishes it as a PyCapsule
// named "dlpack_exchange_api" in its tensor type's `__dlpack_c_exchange_api__` attribute (torch >= 2.10). Its
// `dltensor_from_py_object_no_sync` fills a caller-owned DLTensor (pointer, device, dtype, shape, strides) from a
// tensor without allocating, copying or synchronising: one C call instead of a Python attribute read per field.
// `current_work_stream` is the framework's current stream (torch.cuda.current_stream). Declared here as the
// standard lays the table out; only the entries attnres calls are typed.
#pragma once

#include <nanobind/ndarray.h>

#include <cstdint>

namespace attnres::dlpack_exchange {

using DLTensor = nanobind::dlpack::dltensor;  // DLPack's DLTensor, field for field

constexpr const char* kCapsuleName = "dlpack_exchange_api";
constexpr uint32_t kMajorVersion = 1;
constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;
// DLDataTypeCode values.
constexpr uint8_t kDLFloat = 2;
constexpr uint8_t kDLBfloat = 4;
constexpr uint8_t kDLFloat8_e4m3fn = 10;

struct Version {
  uint32_t major;
  uint32_t minor;
};

struct Header {
  Version version;
  Header* prev_api;  // an older table, when the framework publishes several
};

struct Api {
  Header header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // 0 on success; -1 with a Python exception set where the tensor has no DLPack description (torch: another
  // layout, a nested, quantized or meta tensor, one without storage). Called with the GIL held.
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_current_stream);
};

}  // namespace attnres::dlpack_exchange
