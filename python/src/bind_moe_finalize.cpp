// attnres._C: the moe_finalize part of the C++ API (conversion only). TensorRef, DType, KernelKind and
// DeviceInfo are registered by module.cpp before this runs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "attnres/attnres.hpp"

namespace nb = nanobind;
using namespace attnres;

void bind_moe_finalize(nb::module_& m) {
  nb::class_<MoeFinalizeArgs>(m, "MoeFinalizeArgs")
      .def(nb::init<>())
      .def_rw("rows", &MoeFinalizeArgs::rows)
      .def_rw("weights", &MoeFinalizeArgs::weights)
      .def_rw("index", &MoeFinalizeArgs::index)
      .def_rw("shared", &MoeFinalizeArgs::shared)
      .def_rw("norm_weight", &MoeFinalizeArgs::norm_weight)
      .def_rw("eps", &MoeFinalizeArgs::eps)
      .def_rw("scale", &MoeFinalizeArgs::scale)
      .def_rw("output", &MoeFinalizeArgs::output)
      .def_prop_rw(
          "stream", [](const MoeFinalizeArgs& a) { return reinterpret_cast<uintptr_t>(a.stream); },
          [](MoeFinalizeArgs& a, uintptr_t s) { a.stream = reinterpret_cast<void*>(s); });

  nb::class_<MoeFinalizeOptions>(m, "MoeFinalizeOptions")
      .def(nb::init<>())
      .def_rw("pdl", &MoeFinalizeOptions::pdl)
      .def_rw("kernel", &MoeFinalizeOptions::kernel);

  nb::class_<MoeFinalizeQuery>(m, "MoeFinalizeQuery")
      .def(nb::init<>())
      .def_rw("tokens", &MoeFinalizeQuery::tokens)
      .def_rw("routes", &MoeFinalizeQuery::routes)
      .def_rw("hidden", &MoeFinalizeQuery::hidden)
      .def_rw("rows_dtype", &MoeFinalizeQuery::rows_dtype)
      .def_rw("weights_dtype", &MoeFinalizeQuery::weights_dtype)
      .def_rw("shared", &MoeFinalizeQuery::shared)
      .def_rw("norm", &MoeFinalizeQuery::norm);

  nb::class_<MoeFinalizePlan>(m, "MoeFinalizePlan")
      .def_ro("kernel", &MoeFinalizePlan::kernel)
      .def_ro("decline", &MoeFinalizePlan::decline)
      .def_ro("threads", &MoeFinalizePlan::threads)
      .def_ro("vectors", &MoeFinalizePlan::vectors)
      .def_ro("route_chunk", &MoeFinalizePlan::route_chunk)
      .def_ro("pdl", &MoeFinalizePlan::pdl)
      .def_prop_ro("accepted", &MoeFinalizePlan::accepted);

  m.def("moe_finalize_validate", &validate_moe_finalize, nb::arg("args"), nb::arg("require_output") = true,
        nb::arg("read_data") = true);
  m.def("moe_finalize_plan_query",
        [](const MoeFinalizeQuery& q, const DeviceInfo& d, const MoeFinalizeOptions& o) { return plan_moe_finalize(q, d, o); });
  m.def("moe_finalize_plan_call",
        [](const MoeFinalizeArgs& a, const MoeFinalizeOptions& o) { return plan_moe_finalize(a, o); });
  // The GIL is released: the CPU backend computes, the CUDA backend only enqueues.
  m.def("moe_finalize", &moe_finalize, nb::arg("args"), nb::arg("options"),
        nb::call_guard<nb::gil_scoped_release>());
}
