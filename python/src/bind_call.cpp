// attnres._C.attn_res_call: one call of an attention-residual op straight from torch tensors.
//
// The library never reaches into torch's C++ ABI, so one build of attnres runs with any torch. A tensor's
// pointer, shape and strides come from DLPack's C exchange table where torch publishes it (torch >= 2.10: one C
// call per tensor, no allocation), else from its Python attributes (data_ptr(), shape, stride(), the device);
// both in this one C++ call, a fraction of building a TensorRef per tensor in Python. Nothing here allocates a
// DLPack capsule or synchronises a stream, so calls capture in CUDA graphs.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstdint>
#include <string>

#include "attnres/attnres.hpp"
#include "dlpack_exchange.hpp"

namespace nb = nanobind;
using namespace attnres;

namespace {

// A tensor attribute: its interned name, and the C getter of torch's getset descriptor on torch.Tensor (which
// torch.nn.Parameter inherits unchanged). For an object whose type is exactly one of those two, calling the
// getter is what attribute lookup would do after finding that data descriptor, without the lookup.
struct Attr {
  PyObject* name = nullptr;
  getter get = nullptr;
  void* closure = nullptr;
};

// torch's types and the attribute names, looked up once (torch is imported by the package before any call).
struct Torch {
  PyObject* tensor_type = nullptr;
  PyObject* parameter_type = nullptr;
  PyObject* is_grad_enabled = nullptr;
  PyObject* dispatch_stack_len = nullptr;
  PyObject* torch_function_mode = nullptr;
  PyObject* raw_stream = nullptr;      // torch._C._cuda_getCurrentRawStream(index) -> int (CUDA builds)
  PyObject* current_stream = nullptr;  // torch.cuda.current_stream(index) (fallback)
  PyObject* strided = nullptr;         // torch.strided
  const dlpack_exchange::Api* exchange = nullptr;  // torch's DLPack exchange table, when it has one
  std::array<std::pair<PyObject*, DType>, 17> dtypes{};
  PyObject *s_data_ptr, *s_shape, *s_stride, *s_get_device, *s_device, *s_cuda_stream;
  Attr dtype, is_cuda, is_cpu, layout, is_nested, requires_grad;
};

// torch's DLPack exchange table (dlpack_exchange.hpp), or nullptr when this torch has none of a known version.
const dlpack_exchange::Api* exchange_api(PyObject* tensor_type) {
  PyObject* capsule = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
  if (!capsule) {
    PyErr_Clear();
    return nullptr;
  }
  auto* api = static_cast<const dlpack_exchange::Api*>(PyCapsule_GetPointer(capsule, dlpack_exchange::kCapsuleName));
  Py_DECREF(capsule);  // the table lives as long as the process (the standard's rule for producers)
  if (!api) {
    PyErr_Clear();
    return nullptr;
  }
  for (const dlpack_exchange::Header* h = &api->header; h; h = h->prev_api)
    if (h->version.major == dlpack_exchange::kMajorVersion) {
      const auto* found = reinterpret_cast<const dlpack_exchange::Api*>(h);
      return found->dltensor_from_py_object_no_sync && found->current_work_stream ? found : nullptr;
    }
  return nullptr;
}

PyObject* attr(PyObject* o, const char* name) {
  PyObject* r = PyObject_GetAttrString(o, name);
  if (!r) throw nb::python_error();
  return r;  // kept for the process's lifetime
}

// The getter is used only when torch.Tensor and torch.nn.Parameter resolve `name` to the same getset
// descriptor; otherwise every read goes through attribute lookup.
Attr tensor_attr(PyObject* tensor_type, PyObject* parameter_type, const char* name) {
  Attr a;
  a.name = PyUnicode_InternFromString(name);
  PyObject* on_tensor = PyObject_GetAttr(tensor_type, a.name);
  PyObject* on_parameter = on_tensor ? PyObject_GetAttr(parameter_type, a.name) : nullptr;
  if (on_tensor && on_parameter && on_tensor == on_parameter && Py_IS_TYPE(on_tensor, &PyGetSetDescr_Type)) {
    const PyGetSetDef* def = reinterpret_cast<PyGetSetDescrObject*>(on_tensor)->d_getset;
    a.get = def->get;
    a.closure = def->closure;
  }
  Py_XDECREF(on_tensor);
  Py_XDECREF(on_parameter);
  PyErr_Clear();
  return a;
}

const Torch& torch_api() {
  static Torch* t = [] {
    auto* t = new Torch();
    PyObject* torch = PyImport_ImportModule("torch");
    if (!torch) throw nb::python_error();
    PyObject* C = attr(torch, "_C");
    t->tensor_type = attr(torch, "Tensor");
    PyObject* nn = PyImport_ImportModule("torch.nn");
    if (!nn) throw nb::python_error();
    t->parameter_type = attr(nn, "Parameter");
    t->is_grad_enabled = attr(torch, "is_grad_enabled");
    t->dispatch_stack_len = attr(C, "_len_torch_dispatch_stack");
    t->torch_function_mode = attr(C, "_is_torch_function_mode_enabled");
    t->raw_stream = PyObject_GetAttrString(C, "_cuda_getCurrentRawStream");
    if (!t->raw_stream) PyErr_Clear();
    t->strided = attr(torch, "strided");
    t->exchange = exchange_api(t->tensor_type);
    PyObject* cuda = attr(torch, "cuda");
    t->current_stream = attr(cuda, "current_stream");
    const std::pair<const char*, DType> names[] = {
        {"bfloat16", DType::bf16}, {"float32", DType::f32}, {"int32", DType::i32}, {"float16", DType::f16},
        {"float64", DType::f64},   {"int64", DType::i64},   {"uint8", DType::u8},  {"bool", DType::boolean},
        {"int8", DType::i8},       {"int16", DType::i16},   {"uint16", DType::u16}, {"uint32", DType::u32},
        {"uint64", DType::u64},    {"complex32", DType::c32}, {"complex64", DType::c64},
        {"complex128", DType::c128}, {"float8_e4m3fn", DType::e4m3}};
    for (size_t i = 0; i < t->dtypes.size(); ++i) t->dtypes[i] = {attr(torch, names[i].first), names[i].second};
    t->s_data_ptr = PyUnicode_InternFromString("data_ptr");
    t->s_shape = PyUnicode_InternFromString("shape");
    t->s_stride = PyUnicode_InternFromString("stride");
    t->s_get_device = PyUnicode_InternFromString("get_device");
    t->s_device = PyUnicode_InternFromString("device");
    t->s_cuda_stream = PyUnicode_InternFromString("cuda_stream");
    for (auto [field, name] : {std::pair{&t->dtype, "dtype"}, {&t->is_cuda, "is_cuda"}, {&t->is_cpu, "is_cpu"},
                               {&t->layout, "layout"}, {&t->is_nested, "is_nested"},
                               {&t->requires_grad, "requires_grad"}})
      *field = tensor_attr(t->tensor_type, t->parameter_type, name);
    return t;
  }();
  return *t;
}

// A new reference, or a thrown python_error.
PyObject* checked(PyObject* r) {
  if (!r) throw nb::python_error();
  return r;
}

struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(checked(o)) {}
  ~Ref() { Py_DECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

int64_t as_int(PyObject* o) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

bool truth(PyObject* o) {
  const int r = PyObject_IsTrue(o);
  if (r < 0) throw nb::python_error();
  return r == 1;
}

bool plain(PyObject* o, const Torch& t) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(o));
  return type == t.tensor_type || type == t.parameter_type;
}

// A new reference to o.<a>, or a thrown python_error.
PyObject* get_attr(PyObject* o, const Attr& a, const Torch& t) {
  return checked(a.get && plain(o, t) ? a.get(o, a.closure) : PyObject_GetAttr(o, a.name));
}

// Rows arguments ([T, H] tensors of the token rows) may come as [T, 1, H]: read as [T, H] through strides.
// `shape`/`stride` give dimension i of the tensor's `ndim`.
template <typename Shape, typename Stride>
void set_dims(TensorRef& r, Py_ssize_t ndim, bool rows, const char* op, const char* name, Shape shape,
              Stride stride) {
  const bool squeeze = rows && ndim == 3 && shape(1) == 1;
  const Py_ssize_t kept = squeeze ? 2 : ndim;
  if (kept > kMaxRank)
    throw ArgumentError(std::string(op) + ": " + name + " has rank " + std::to_string(ndim) +
                        ": the library takes tensors of rank <= " + std::to_string(kMaxRank));
  r.ndim = static_cast<int32_t>(kept);
  for (Py_ssize_t i = 0, j = 0; i < ndim; ++i) {
    if (squeeze && i == 1) continue;
    r.shape[j] = shape(i);
    r.strides[j] = stride(i);
    ++j;
  }
}

// The library's dtype of a DLPack dtype, for the dtypes the kernels take (torch's codes: DLConvertor's
// getDLDataType); other for the rest, which the attribute read names in its error.
DType dl_dtype(const dlpack_exchange::DLTensor& d) {
  if (d.dtype.lanes != 1) return DType::other;
  const auto code = static_cast<uint8_t>(d.dtype.code);
  const uint8_t bits = d.dtype.bits;
  if (code == dlpack_exchange::kDLBfloat && bits == 16) return DType::bf16;
  if (code == dlpack_exchange::kDLFloat && bits == 32) return DType::f32;
  if (code == dlpack_exchange::kDLFloat8_e4m3fn && bits == 8) return DType::e4m3;
  return DType::other;
}

// A dense strided CPU or CUDA tensor of a kernel dtype through torch's DLPack exchange table: one C call, no torch
// attribute read. False (nothing read) for anything else: torch's table refuses (returns -1 with a Python error,
// cleared here) another layout, a nested, quantized or meta tensor and a tensor without storage; another device
// or dtype is left to the attribute read, which names what is wrong.
bool read_exchange(PyObject* o, const Torch& t, TensorRef& r, bool rows, const char* op, const char* name) {
  if (!t.exchange || !plain(o, t)) return false;
  dlpack_exchange::DLTensor d;
  if (t.exchange->dltensor_from_py_object_no_sync(o, &d) != 0) {
    PyErr_Clear();
    return false;
  }
  const int32_t type = d.device.device_type;
  const DType dtype = dl_dtype(d);
  if ((type != dlpack_exchange::kDLCUDA && type != dlpack_exchange::kDLCPU) || dtype == DType::other ||
      d.ndim < 0 || (d.ndim > 0 && (d.shape == nullptr || d.strides == nullptr)))
    return false;
  set_dims(r, d.ndim, rows, op, name, [&](Py_ssize_t i) { return d.shape[i]; },
           [&](Py_ssize_t i) { return d.strides[i]; });
  r.dtype = dtype;
  r.device = type == dlpack_exchange::kDLCUDA ? Device{DeviceType::cuda, d.device.device_id}
                                               : Device{DeviceType::cpu, 0};
  r.data = static_cast<char*>(d.data) + d.byte_offset;
  return true;
}

// A tensor argument: through the exchange table when `exchange` and it can answer, else through torch's Python
// attributes after screening the type, device and layout (a clear ArgumentError for what the library cannot read).
TensorRef read_tensor(PyObject* o, const Torch& t, const char* op, const char* name, bool rows,
                      bool exchange = true) {
  TensorRef r;
  if (o == Py_None) return r;
  if (exchange && read_exchange(o, t, r, rows, op, name)) return r;
  if (!PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(t.tensor_type)))
    throw ArgumentError(std::string(op) + ": " + name + " must be a torch.Tensor, got " + Py_TYPE(o)->tp_name);
  {
    Ref dtype(get_attr(o, t.dtype, t));
    r.dtype = DType::other;
    for (const auto& [obj, code] : t.dtypes)
      if (obj == dtype.p) r.dtype = code;
  }
  const bool is_cuda = truth(Ref(get_attr(o, t.is_cuda, t)).p);
  if (!is_cuda && !truth(Ref(get_attr(o, t.is_cpu, t)).p)) {
    Ref dev(PyObject_GetAttr(o, t.s_device));
    Ref text(PyObject_Str(dev.p));
    throw ArgumentError(std::string(op) + ": " + name + " is on " + PyUnicode_AsUTF8(text.p) +
                        ": only cpu and cuda tensors are supported");
  }
  r.device = Device{is_cuda ? DeviceType::cuda : DeviceType::cpu, 0};
  {
    Ref layout(get_attr(o, t.layout, t));
    if (layout.p != t.strided) {
      Ref text(PyObject_Str(layout.p));
      throw ArgumentError(std::string(op) + ": " + name + " must be a dense strided tensor, got layout " +
                          PyUnicode_AsUTF8(text.p));
    }
    if (truth(Ref(get_attr(o, t.is_nested, t)).p))
      throw ArgumentError(std::string(op) + ": " + name + " must be a dense strided tensor, got a nested tensor");
  }
  if (is_cuda) r.device.index = static_cast<int32_t>(as_int(Ref(PyObject_CallMethodNoArgs(o, t.s_get_device)).p));
  Ref shape(PyObject_GetAttr(o, t.s_shape));
  Ref stride(PyObject_CallMethodNoArgs(o, t.s_stride));
  const Py_ssize_t ndim = PyTuple_Size(shape.p);
  if (ndim < 0) throw nb::python_error();
  set_dims(r, ndim, rows, op, name, [&](Py_ssize_t i) { return as_int(PyTuple_GET_ITEM(shape.p, i)); },
           [&](Py_ssize_t i) { return as_int(PyTuple_GET_ITEM(stride.p, i)); });
  Ref ptr(PyObject_CallMethodNoArgs(o, t.s_data_ptr));
  r.data = reinterpret_cast<void*>(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(ptr.p)));
  if (PyErr_Occurred()) throw nb::python_error();
  return r;
}

// The caller's current stream on a CUDA device, as torch sees it.
void* current_stream(const Torch& t, int32_t index) {
  if (t.exchange) {
    void* stream = nullptr;
    if (t.exchange->current_work_stream(dlpack_exchange::kDLCUDA, index, &stream) == 0) return stream;
    PyErr_Clear();
  }
  if (t.raw_stream) {
    Ref s(PyObject_CallFunction(t.raw_stream, "i", index));
    return reinterpret_cast<void*>(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(s.p)));
  }
  Ref stream(PyObject_CallFunction(t.current_stream, "i", index));
  Ref handle(PyObject_GetAttr(stream.p, t.s_cuda_stream));
  return reinterpret_cast<void*>(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(handle.p)));
}

Fp8Scales fp8_mode(const char* op, PyObject* fp8) {
  if (fp8 == Py_None) return Fp8Scales::none;
  if (PyUnicode_Check(fp8)) {
    const char* s = PyUnicode_AsUTF8(fp8);
    if (!s) throw nb::python_error();
    const std::string v(s);
    if (v == "none") return Fp8Scales::none;
    if (v == "per_token") return Fp8Scales::per_token;
    if (v == "block128") return Fp8Scales::block128;
  }
  Ref text(PyObject_Repr(fp8));
  throw ArgumentError(std::string(op) + ": fp8 must be None, 'per_token' or 'block128', got " +
                      PyUnicode_AsUTF8(text.p));
}

// The argument slots of attn_res_call, in order (what the Python layer passes).
constexpr const char* kSlots[] = {"layer_residual", "layer_residual_add", "layer_residual_add2", "block_residual",
                                  "res_weight",     "rms_weight",         "norm_weight",         "output",
                                  "updated",        "mixture",            "rsigma",              "probs",
                                  "logits",         "output_fp8",         "fp8_scales"};
constexpr int kNumSlots = sizeof(kSlots) / sizeof(kSlots[0]);
constexpr bool kRows[kNumSlots] = {true, true, true, false, false, false, false, true,
                                   true, true, false, false, false, true, false};

TensorRef* slot(AttnResArgs& a, int i) {
  TensorRef* refs[kNumSlots] = {&a.layer_residual, &a.layer_residual_add, &a.layer_residual_add2,
                                &a.block_residual, &a.res_weight,         &a.rms_weight,
                                &a.norm_weight,    &a.output,             &a.updated,
                                &a.mixture,        &a.rsigma,             &a.probs,
                                &a.logits,         &a.output_fp8,         &a.fp8_scales};
  return refs[i];
}

}  // namespace

// A snapshot call takes the whole bank [rows, T, H] and the candidate count K: the candidates are its first K
// rows and the snapshot row must be one of its rows, so nothing outside the tensor the schema declares as
// mutated is written. Trims block_residual to the K candidate rows (keeping the bank's base pointer).
// num_snapshots of a call that is not a snapshot call (block_residual is the candidates).
constexpr int64_t kNotSnapshot = INT64_MIN;

void apply_bank_rows(const std::string& name, AttnResArgs& a, int64_t num_snapshots) {
  if (num_snapshots == kNotSnapshot) return;
  if (num_snapshots < 0)
    throw ArgumentError(name + ": num_snapshots must be >= 0, got " + std::to_string(num_snapshots));
  TensorRef& bank = a.block_residual;
  if (!bank.present() || bank.ndim != 3) return;  // validate() rejects the rank
  const int64_t rows = bank.shape[0];
  if (num_snapshots > rows)
    throw ArgumentError(name + ": num_snapshots " + std::to_string(num_snapshots) + " exceeds the bank's " +
                        std::to_string(rows) + " rows");
  if (a.snapshot_slot >= rows)
    throw ArgumentError(name + ": snapshot_slot " + std::to_string(a.snapshot_slot) + " lies outside the bank's " +
                        std::to_string(rows) + " rows (the bank must hold at least " +
                        std::to_string(a.snapshot_slot + 1) + " snapshot rows)");
  bank.shape[0] = num_snapshots;
}

void bind_call(nb::module_& m) {
  m.attr("NOT_SNAPSHOT") = kNotSnapshot;
  // Runs the op; returns False without doing anything when `direct` and the call needs torch's dispatcher
  // (a tensor subclass, an argument that is not a tensor, autograd, an active dispatch or function mode):
  // the Python layer then goes through torch.ops.attnres.*.
  m.def(
      "attn_res_call",
      [](AttnResOp op, nb::tuple tensors, double rms_eps, double norm_eps, int64_t snapshot_slot,
         int64_t num_snapshots, nb::handle fp8, bool fp8_pow2_scales, const Options& options, bool direct) {
        const Torch& t = torch_api();
        const char* name = op_name(op);
        if (tensors.size() != static_cast<size_t>(kNumSlots))
          throw ArgumentError(std::string(name) + ": attn_res_call takes " + std::to_string(kNumSlots) +
                              " tensor slots");
        if (direct) {
          for (int i = 0; i < kNumSlots; ++i) {
            PyObject* o = tensors[i].ptr();
            if (o != Py_None && !plain(o, t)) return false;
          }
          if (as_int(Ref(PyObject_CallNoArgs(t.dispatch_stack_len)).p) != 0) return false;
          if (truth(Ref(PyObject_CallNoArgs(t.torch_function_mode)).p)) return false;
          if (truth(Ref(PyObject_CallNoArgs(t.is_grad_enabled)).p)) {
            for (int i = 0; i < kNumSlots; ++i) {
              PyObject* o = tensors[i].ptr();
              if (o != Py_None && truth(Ref(get_attr(o, t.requires_grad, t)).p)) return false;
            }
          }
        }
        AttnResArgs a;
        for (int i = 0; i < kNumSlots; ++i) *slot(a, i) = read_tensor(tensors[i].ptr(), t, name, kSlots[i], kRows[i]);
        a.rms_eps = rms_eps;
        a.norm_eps = norm_eps;
        a.snapshot_slot = snapshot_slot;
        a.fp8 = fp8_mode(name, fp8.ptr());
        a.fp8_pow2_scales = fp8_pow2_scales;
        apply_bank_rows(name, a, num_snapshots);
        if (a.layer_residual.device.type == DeviceType::cuda && a.layer_residual.device.index >= 0)
          a.stream = current_stream(t, a.layer_residual.device.index);
        {
          nb::gil_scoped_release release;
          run(op, a, options);
        }
        return true;
      },
      nb::arg("op"), nb::arg("tensors"), nb::arg("rms_eps"), nb::arg("norm_eps"), nb::arg("snapshot_slot"),
      nb::arg("num_snapshots"), nb::arg("fp8").none(), nb::arg("fp8_pow2_scales"), nb::arg("options"),
      nb::arg("direct"));

  // How the call path reads a tensor (tests compare the exchange-table read with the attribute read).
  m.def(
      "_read_tensor",
      [](nb::handle tensor, bool rows, bool exchange) {
        return read_tensor(tensor.ptr(), torch_api(), "attnres._read_tensor", "tensor", rows, exchange);
      },
      nb::arg("tensor"), nb::arg("rows"), nb::arg("exchange"));
  m.def("_has_dlpack_exchange", []() { return torch_api().exchange != nullptr; });

  // The same preconditions for a traced (fake) call: TensorRefs of the fake tensors (synthetic addresses), the
  // bank's rows rule, then validate() without requiring the outputs.
  m.def(
      "attn_res_check",
      [](AttnResOp op, AttnResArgs a, int64_t num_snapshots, nb::handle fp8) {
        a.fp8 = fp8_mode(op_name(op), fp8.ptr());
        apply_bank_rows(op_name(op), a, num_snapshots);
        validate(op, a, /*require_outputs=*/false);
      },
      nb::arg("op"), nb::arg("args"), nb::arg("num_snapshots"), nb::arg("fp8").none());
  // The bank rule alone, for ops that build their AttnResArgs themselves (the fused all-reduce site).
  m.def("attn_res_bank_rows", [](const std::string& name, AttnResArgs& a, int64_t num_snapshots) {
    apply_bank_rows(name, a, num_snapshots);
  });
}
