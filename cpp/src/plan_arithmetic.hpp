// The plan's pure arithmetic (plan.cpp): the kernel and its geometry from the call's shape, the device's
// properties and the options alone. attnres::plan (run.cpp) adds the occupancy calculator's answer on a queried
// GPU; everything else (tests of the table, described devices) sees the same function.
#pragma once

#include "attnres/attn_res.hpp"

namespace attnres::detail {

Plan plan_arithmetic(const PlanQuery& query, const DeviceInfo& device, const Options& options);

// A declined plan: no kernel, route none, the reason in words and as a code.
Plan declined_plan(DeclineCode code, std::string reason);

}  // namespace attnres::detail
