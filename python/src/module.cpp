// attnres._C: the C++ API as Python objects. No logic beyond conversion: tensors arrive as TensorRef
// (pointer, dtype, device, shape, strides as integers, built by attnres/_tensors.py), so no DLPack import
// runs in the call path and nothing synchronizes a stream (graph capture stays legal).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <iterator>
#include <vector>

#include "attnres/attnres.hpp"

namespace nb = nanobind;
using namespace attnres;

namespace {

TensorRef make_tensor_ref(uintptr_t data, DType dtype, DeviceType device_type, int32_t device_index,
                          const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  if (shape.size() > static_cast<size_t>(kMaxRank))
    throw ArgumentError("attnres: tensors of rank " + std::to_string(shape.size()) + " are not supported (max " +
                        std::to_string(kMaxRank) + ")");
  if (strides.size() != shape.size()) throw ArgumentError("attnres: shape and strides differ in length");
  TensorRef t;
  t.data = reinterpret_cast<void*>(data);
  t.dtype = dtype;
  t.device = Device{device_type, device_index};
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}

struct ErrorTypes {
  PyObject *base = nullptr, *argument = nullptr, *unsupported = nullptr, *cuda = nullptr;
};
ErrorTypes& error_types() {
  static ErrorTypes types;
  return types;
}

std::vector<int64_t> dims(const int64_t* v, int n) { return std::vector<int64_t>(v, v + (n < 0 ? 0 : n)); }

}  // namespace

void bind_moe_finalize(nanobind::module_&);
void bind_all_reduce(nanobind::module_&);
void bind_call(nanobind::module_&);

NB_MODULE(_C, m) {
  m.doc() = "attnres C++ library bindings (internal: use the attnres package)";
  m.attr("__version__") = ATTNRES_VERSION;
  // The Python package keeps module-lifetime references to these types (torch.library registrations hold
  // its functions until interpreter exit), which nanobind's shutdown check would report as leaks.
  nb::set_leak_warnings(false);

  // The library's exceptions become attnres.errors' classes (one base, AttnResError; ArgumentError is also a
  // ValueError), registered by the package at import through _set_error_types. Defined in Python: a class
  // with two bases is plain there, and its __module__ reads "attnres" in tracebacks.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    const auto raise = [](PyObject* type, PyObject* fallback, const char* what) {
      PyErr_SetString(type ? type : fallback, what);
    };
    try {
      std::rethrow_exception(p);
    } catch (const ArgumentError& e) {
      raise(error_types().argument, PyExc_ValueError, e.what());
    } catch (const UnsupportedError& e) {
      raise(error_types().unsupported, PyExc_RuntimeError, e.what());
    } catch (const CudaError& e) {
      raise(error_types().cuda, PyExc_RuntimeError, e.what());
    } catch (const Error& e) {
      raise(error_types().base, PyExc_RuntimeError, e.what());
    }
  });
  m.def("_set_error_types", [](nb::handle base, nb::handle argument, nb::handle unsupported, nb::handle cuda) {
    ErrorTypes& t = error_types();
    t.base = base.inc_ref().ptr();  // kept for the process's lifetime
    t.argument = argument.inc_ref().ptr();
    t.unsupported = unsupported.inc_ref().ptr();
    t.cuda = cuda.inc_ref().ptr();
  });

  nb::enum_<DType>(m, "DType")
      .value("bf16", DType::bf16)
      .value("f32", DType::f32)
      .value("i32", DType::i32)
      .value("f16", DType::f16)
      .value("f64", DType::f64)
      .value("i64", DType::i64)
      .value("u8", DType::u8)
      .value("other", DType::other)
      .value("boolean", DType::boolean)
      .value("i8", DType::i8)
      .value("i16", DType::i16)
      .value("u16", DType::u16)
      .value("u32", DType::u32)
      .value("u64", DType::u64)
      .value("c32", DType::c32)
      .value("c64", DType::c64)
      .value("c128", DType::c128)
      .value("e4m3", DType::e4m3);
  nb::enum_<Fp8Scales>(m, "Fp8Scales")
      .value("none", Fp8Scales::none)
      .value("per_token", Fp8Scales::per_token)
      .value("block128", Fp8Scales::block128);
  nb::enum_<DeviceType>(m, "DeviceType").value("cpu", DeviceType::cpu).value("cuda", DeviceType::cuda);
  nb::enum_<AttnResOp>(m, "AttnResOp")
      .value("attn_res", AttnResOp::attn_res)
      .value("attn_res_rmsnorm", AttnResOp::attn_res_rmsnorm)
      .value("attn_res_add_rmsnorm", AttnResOp::attn_res_add_rmsnorm)
      .value("attn_res_add_rmsnorm_persistent", AttnResOp::attn_res_add_rmsnorm_persistent);
  nb::enum_<Topology>(m, "Topology")
      .value("per_token", Topology::per_token)
      .value("persistent", Topology::persistent)
      .value("split", Topology::split)
      .value("auto", Topology::automatic);
  nb::enum_<KernelKind>(m, "KernelKind")
      .value("auto", KernelKind::automatic)
      .value("cpu", KernelKind::cpu)
      .value("single_cta", KernelKind::single_cta)
      .value("split_k", KernelKind::split_k)
      .value("persistent", KernelKind::persistent);

  nb::class_<TensorRef>(m, "TensorRef")
      .def(nb::init<>())
      .def("__init__",
           [](TensorRef* self, uintptr_t data, DType dtype, DeviceType device_type, int32_t device_index,
              const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
             new (self) TensorRef(make_tensor_ref(data, dtype, device_type, device_index, shape, strides));
           },
           nb::arg("data"), nb::arg("dtype"), nb::arg("device_type"), nb::arg("device_index"), nb::arg("shape"),
           nb::arg("strides"))
      .def_prop_ro("present", &TensorRef::present)
      .def_prop_ro("dtype", [](const TensorRef& t) { return t.dtype; })
      .def_prop_ro("device_type", [](const TensorRef& t) { return t.device.type; })
      .def_prop_ro("device_index", [](const TensorRef& t) { return t.device.index; })
      .def_prop_ro("shape", [](const TensorRef& t) { return dims(t.shape, t.ndim); })
      .def_prop_ro("strides", [](const TensorRef& t) { return dims(t.strides, t.ndim); })
      .def_prop_ro("data", [](const TensorRef& t) { return reinterpret_cast<uintptr_t>(t.data); });

  nb::class_<AttnResArgs>(m, "AttnResArgs")
      .def(nb::init<>())
      .def_rw("layer_residual", &AttnResArgs::layer_residual)
      .def_rw("layer_residual_add", &AttnResArgs::layer_residual_add)
      .def_rw("layer_residual_add2", &AttnResArgs::layer_residual_add2)
      .def_rw("block_residual", &AttnResArgs::block_residual)
      .def_rw("res_weight", &AttnResArgs::res_weight)
      .def_rw("rms_weight", &AttnResArgs::rms_weight)
      .def_rw("norm_weight", &AttnResArgs::norm_weight)
      .def_rw("rms_eps", &AttnResArgs::rms_eps)
      .def_rw("norm_eps", &AttnResArgs::norm_eps)
      .def_rw("output", &AttnResArgs::output)
      .def_rw("updated", &AttnResArgs::updated)
      .def_rw("mixture", &AttnResArgs::mixture)
      .def_rw("rsigma", &AttnResArgs::rsigma)
      .def_rw("probs", &AttnResArgs::probs)
      .def_rw("logits", &AttnResArgs::logits)
      .def_rw("snapshot_slot", &AttnResArgs::snapshot_slot)
      .def_rw("fp8", &AttnResArgs::fp8)
      .def_rw("fp8_pow2_scales", &AttnResArgs::fp8_pow2_scales)
      .def_rw("output_fp8", &AttnResArgs::output_fp8)
      .def_rw("fp8_scales", &AttnResArgs::fp8_scales)
      .def_prop_rw(
          "stream", [](const AttnResArgs& a) { return reinterpret_cast<uintptr_t>(a.stream); },
          [](AttnResArgs& a, uintptr_t s) { a.stream = reinterpret_cast<void*>(s); });

  nb::class_<Options>(m, "Options")
      .def(nb::init<>())
      .def_rw("topology", &Options::topology)
      .def_rw("split_max_tokens", &Options::split_max_tokens)
      .def_rw("pdl", &Options::pdl)
      .def_rw("kernel", &Options::kernel)
      .def_rw("cluster", &Options::cluster)
      // Benchmark-only tuning knobs of the persistent kernel (attnres._persistent_tuning): underscored, and not
      // part of attnres.Options nor of the torch.ops schemas.
      .def_rw("_persistent_blocks_per_sm", &Options::persistent_blocks_per_sm)
      .def_rw("_persistent_slots", &Options::persistent_slots)
      .def_rw("_persistent_passes", &Options::persistent_passes)
      .def_rw("_stream_min_tokens", &Options::stream_min_tokens)
      .def_rw("_stream_buffers", &Options::stream_buffers)
      .def_rw("_token_blocks_min_tokens", &Options::token_blocks_min_tokens)
      .def_rw("_token_blocks_exact_n", &Options::token_blocks_exact_n);

  nb::class_<PlanQuery>(m, "PlanQuery")
      .def(nb::init<>())
      .def_rw("op", &PlanQuery::op)
      .def_rw("tokens", &PlanQuery::tokens)
      .def_rw("candidates", &PlanQuery::candidates)
      .def_rw("hidden", &PlanQuery::hidden)
      .def_rw("add", &PlanQuery::add)
      .def_rw("add2", &PlanQuery::add2)
      .def_rw("tap", &PlanQuery::tap)
      .def_rw("snapshot", &PlanQuery::snapshot)
      .def_rw("diagnostics", &PlanQuery::diagnostics)
      .def_rw("fp8", &PlanQuery::fp8)
      .def_rw("fp8_pow2_scales", &PlanQuery::fp8_pow2_scales);

  nb::enum_<Route>(m, "Route")
      .value("none", Route::none)
      .value("per_token", Route::per_token)
      .value("stream", Route::stream)
      .value("persistent", Route::persistent)
      .value("cpu", Route::cpu)
      .value("token_blocks", Route::token_blocks);
  {
    nb::enum_<DeclineCode> codes(m, "DeclineCode");
    for (int32_t c = 0; c <= static_cast<int32_t>(DeclineCode::split_k_threads); ++c)
      codes.value(decline_code_name(static_cast<DeclineCode>(c)), static_cast<DeclineCode>(c));
  }
  m.def("route_name", [](Route r) { return std::string(route_name(r)); });
  m.def("decline_code_name", [](DeclineCode c) { return std::string(decline_code_name(c)); });

  nb::class_<Plan>(m, "Plan")
      .def_ro("kernel", &Plan::kernel)
      .def_ro("route", &Plan::route)
      .def_ro("decline", &Plan::decline)
      .def_ro("decline_code", &Plan::decline_code)
      .def_ro("cluster", &Plan::cluster)
      .def_ro("threads", &Plan::threads)
      .def_ro("vectors", &Plan::vectors)
      .def_ro("max_candidates", &Plan::max_candidates)
      .def_ro("pdl", &Plan::pdl)
      .def_ro("blocks", &Plan::blocks)
      .def_ro("blocks_per_sm", &Plan::blocks_per_sm)
      .def_ro("slots", &Plan::slots)
      .def_ro("passes", &Plan::passes)
      .def_ro("smem_bytes", &Plan::smem_bytes)
      .def_prop_ro("accepted", &Plan::accepted);

  // Writable: attnres.plan() answers for a described GPU (explicit properties) without the GPU.
  nb::class_<DeviceInfo>(m, "DeviceInfo")
      .def(nb::init<>())
      .def_prop_rw("device_type", [](const DeviceInfo& d) { return d.device.type; },
                   [](DeviceInfo& d, DeviceType t) { d.device.type = t; })
      .def_prop_rw("device_index", [](const DeviceInfo& d) { return d.device.index; },
                   [](DeviceInfo& d, int32_t i) { d.device.index = i; })
      .def_rw("cuda_backend", &DeviceInfo::cuda_backend)
      .def_rw("cc_major", &DeviceInfo::cc_major)
      .def_rw("cc_minor", &DeviceInfo::cc_minor)
      .def_rw("sm_count", &DeviceInfo::sm_count)
      .def_rw("shared_memory_per_block_optin", &DeviceInfo::shared_memory_per_block_optin)
      .def_rw("name", &DeviceInfo::name)
      .def_ro("queried", &DeviceInfo::queried);  // read-only: set by query_device alone

  // The limits of attnres/limits.hpp, for the Python layer (which never restates them).
  nb::dict limits;
  limits["max_rank"] = kMaxRank;
  limits["max_candidates"] = kMaxCandidates;
  limits["max_hidden"] = kMaxHidden;
  limits["hidden_multiple"] = kHiddenMultiple;
  limits["candidate_buckets"] = std::vector<int32_t>(std::begin(kCandidateBuckets), std::end(kCandidateBuckets));
  limits["single_cta_max_threads"] = kSingleCtaMaxThreads;
  limits["single_cta_max_candidates"] = kSingleCtaMaxCandidates;
  limits["split_k_max_threads"] = kSplitKMaxThreads;
  limits["max_cluster"] = kMaxCluster;
  limits["moe_finalize_max_routes"] = kMoeFinalizeMaxRoutes;
  limits["moe_finalize_max_tokens"] = kMoeFinalizeMaxTokens;
  limits["moe_finalize_max_hidden"] = kMoeFinalizeMaxHidden;
  limits["moe_finalize_hidden_multiple"] = kMoeFinalizeHiddenMultiple;
  m.attr("limits") = limits;

  m.def("cuda_backend_built", &cuda_backend_built);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("query_device", [](DeviceType type, int32_t index) { return query_device(Device{type, index}); });
  m.def("described_device", &described_device, nb::arg("name"));
  m.def("op_name", [](AttnResOp op) { return std::string(op_name(op)); });
  m.def("kernel_name", [](KernelKind k) { return std::string(kernel_name(k)); });
  m.def("validate", &validate, nb::arg("op"), nb::arg("args"), nb::arg("require_outputs") = true);
  m.def("plan_query", [](const PlanQuery& q, const DeviceInfo& d, const Options& o) { return plan(q, d, o); });
  m.def("plan_call", [](AttnResOp op, const AttnResArgs& a, const Options& o) { return plan(op, a, o); });
  // The GIL is released: the CPU backend computes, the CUDA backend only enqueues.
  m.def("run", &run, nb::arg("op"), nb::arg("args"), nb::arg("options"), nb::call_guard<nb::gil_scoped_release>());
  // The plan the calling thread's latest run() launched and the thread's count of runs (tests: plan = launch).
  m.def("_last_launch", []() {
    const detail::LaunchRecord& r = detail::last_launch();
    return nb::make_tuple<nb::rv_policy::copy>(r.plan, r.launches);  // a copy: the record changes on the next run
  });
  bind_moe_finalize(m);
  bind_all_reduce(m);
  bind_call(m);
}
