// attnres._C: the all-reduce part of the C++ API (conversion only). TensorRef, KernelKind, AttnResArgs, Options
// and MoeFinalizeArgs are registered before this runs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <iterator>
#include <vector>

#include "attnres/attnres.hpp"

namespace nb = nanobind;
using namespace attnres;

void bind_all_reduce(nb::module_& m) {
  m.attr("ALL_REDUCE_MAX_WORLD") = kAllReduceMaxWorld;
  m.attr("ALL_REDUCE_STATE_WORDS") = kAllReduceStateWords;
  m.attr("ALL_REDUCE_ERROR_TIMEOUT") = kAllReduceErrorTimeout;
  m.attr("ALL_REDUCE_ERROR_TOKEN_MISMATCH") = kAllReduceErrorTokenMismatch;
  m.attr("ALL_REDUCE_ERROR_WIDTH_MISMATCH") = kAllReduceErrorWidthMismatch;
  m.attr("ALL_REDUCE_HEADER_ROWS") = kAllReduceHeaderRows;

  // The all-reduce's limits join attnres._C.limits (module.cpp builds it before this runs).
  nb::dict limits = nb::cast<nb::dict>(m.attr("limits"));
  limits["all_reduce_max_world"] = kAllReduceMaxWorld;
  limits["all_reduce_world_sizes"] =
      std::vector<int32_t>(std::begin(kAllReduceWorldSizes), std::end(kAllReduceWorldSizes));
  limits["all_reduce_max_width"] = kAllReduceMaxWidth;
  limits["all_reduce_width_multiple"] = kAllReduceWidthMultiple;
  limits["all_reduce_slots"] = kAllReduceSlots;  // buffer regions a communicator allocates per (rank, source)

  nb::class_<CommRef>(m, "CommRef")
      .def(nb::init<>())
      .def_rw("world_size", &CommRef::world_size)
      .def_rw("rank", &CommRef::rank)
      .def_rw("capacity", &CommRef::capacity)
      .def_rw("width", &CommRef::width)
      .def_rw("timeout_ns", &CommRef::timeout_ns)
      .def_rw("state", &CommRef::state)
      .def_prop_rw(
          "device", [](const CommRef& c) { return std::vector<int32_t>{static_cast<int32_t>(c.device.type), c.device.index}; },
          [](CommRef& c, const std::vector<int32_t>& d) {
            if (d.size() != 2) throw ArgumentError("all_reduce: comm.device must be [type, index]");
            c.device = Device{static_cast<DeviceType>(d[0]), d[1]};
          })
      .def_prop_rw(
          "buffers", [](const CommRef& c) { return std::vector<uintptr_t>(c.buffers, c.buffers + kAllReduceMaxWorld); },
          [](CommRef& c, const std::vector<uintptr_t>& b) {
            if (b.size() > static_cast<size_t>(kAllReduceMaxWorld))
              throw ArgumentError("all_reduce: comm.buffers holds more than " + std::to_string(kAllReduceMaxWorld) + " ranks");
            for (int r = 0; r < kAllReduceMaxWorld; ++r) c.buffers[r] = r < static_cast<int>(b.size()) ? b[r] : 0;
          });

  nb::class_<AllReduceArgs>(m, "AllReduceArgs")
      .def(nb::init<>())
      .def_rw("input", &AllReduceArgs::input)
      .def_rw("gathered", &AllReduceArgs::gathered)
      .def_rw("output", &AllReduceArgs::output)
      .def_rw("comm", &AllReduceArgs::comm)
      .def_prop_rw(
          "stream", [](const AllReduceArgs& a) { return reinterpret_cast<uintptr_t>(a.stream); },
          [](AllReduceArgs& a, uintptr_t s) { a.stream = reinterpret_cast<void*>(s); });

  nb::class_<AllReduceOptions>(m, "AllReduceOptions")
      .def(nb::init<>())
      .def_rw("pdl", &AllReduceOptions::pdl)
      .def_rw("early_trigger", &AllReduceOptions::early_trigger)
      .def_rw("kernel", &AllReduceOptions::kernel);

  nb::class_<AllReducePlan>(m, "AllReducePlan")
      .def_ro("kernel", &AllReducePlan::kernel)
      .def_ro("decline", &AllReducePlan::decline)
      .def_ro("threads", &AllReducePlan::threads)
      .def_ro("blocks_per_token", &AllReducePlan::blocks_per_token)
      .def_ro("pdl", &AllReducePlan::pdl)
      .def_ro("early_trigger", &AllReducePlan::early_trigger)
      .def_prop_ro("accepted", &AllReducePlan::accepted);

  nb::enum_<AllReduceSite>(m, "AllReduceSite").value("add", AllReduceSite::add).value("add2", AllReduceSite::add2);

  nb::class_<MoeFinalizeAllReduceArgs>(m, "MoeFinalizeAllReduceArgs")
      .def(nb::init<>())
      .def_rw("finalize", &MoeFinalizeAllReduceArgs::finalize)
      .def_rw("reduced", &MoeFinalizeAllReduceArgs::reduced)
      .def_rw("gathered", &MoeFinalizeAllReduceArgs::gathered)
      .def_rw("comm", &MoeFinalizeAllReduceArgs::comm);

  m.def("all_reduce_world_supported", &all_reduce_world_supported);
  m.def("all_reduce_validate", &validate_all_reduce, nb::arg("args"), nb::arg("require_output") = true,
        nb::arg("read_data") = true);
  // The registry of this process's communicators (attnres/comm_registry.py): the torch ops carry a handle, never
  // an address.
  m.def("all_reduce_register", &register_communicator, nb::arg("comm"), nb::arg("state"), nb::arg("region_bytes"));
  m.def("all_reduce_unregister", &unregister_communicator, nb::arg("handle"));
  m.def("all_reduce_registered", &registered_communicator, nb::arg("op"), nb::arg("handle"), nb::arg("state"),
        nb::arg("check_address") = true);
  m.def("moe_finalize_all_reduce_validate", &validate_moe_finalize_all_reduce, nb::arg("args"),
        nb::arg("require_output") = true, nb::arg("read_data") = true);
  m.def("all_reduce_plan_call", [](const AllReduceArgs& a, const AllReduceOptions& o) { return plan_all_reduce(a, o); });
  m.def("all_reduce_attn_res_add_rmsnorm_plan_call",
        [](const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn, const AllReduceOptions& o,
           const Options& ao) { return plan_all_reduce_attn_res_add_rmsnorm(ar, site, attn, o, ao); });
  m.def("moe_finalize_all_reduce_plan_call",
        [](const MoeFinalizeAllReduceArgs& a, const AllReduceOptions& o) { return plan_moe_finalize_all_reduce(a, o); });
  // The GIL is released: the CPU backend computes, the CUDA backend only enqueues.
  m.def("all_reduce", &all_reduce, nb::arg("args"), nb::arg("options"), nb::call_guard<nb::gil_scoped_release>());
  m.def("all_reduce_attn_res_add_rmsnorm", &all_reduce_attn_res_add_rmsnorm, nb::arg("ar"), nb::arg("site"),
        nb::arg("attn"), nb::arg("ar_options"), nb::arg("attn_options"), nb::call_guard<nb::gil_scoped_release>());
  m.def("moe_finalize_all_reduce", &moe_finalize_all_reduce, nb::arg("args"), nb::arg("options"),
        nb::call_guard<nb::gil_scoped_release>());
}
