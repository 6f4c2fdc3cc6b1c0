// Shared helpers of the plan suites (test_plan*.cpp): attnres::plan is a pure function of a PlanQuery, a
// DeviceInfo and Options, so these suites hand it described devices and hand-built queries on any machine.
#pragma once

#include <cstdint>

#include "plan_tuning.hpp"
#include "test_util.hpp"

namespace attnres_test {

namespace tuning = attnres::tuning;
using attnres::DeviceInfo;
using attnres::Fp8Scales;
using attnres::Plan;
using attnres::PlanQuery;
using attnres::Topology;

// A described H200 (sm_90, 132 SMs, 227 KB of opt-in shared memory per block, the CUDA backend built).
constexpr int32_t kH200SmemOptin = 232448;  // cudaDeviceProp::sharedMemPerBlockOptin of sm_90
inline DeviceInfo described_h200(int32_t smem = kH200SmemOptin, int32_t sms = 132) {
  DeviceInfo d;
  d.device = Device{DeviceType::cuda, 0};
  d.cuda_backend = true;
  d.cc_major = 9;
  d.cc_minor = 0;
  d.sm_count = sms;
  d.shared_memory_per_block_optin = smem;
  d.name = "NVIDIA H200";
  return d;
}

// The CPU, described; `cuda_backend`: whether the build it describes has the CUDA backend compiled in.
inline DeviceInfo described_cpu(bool cuda_backend) {
  DeviceInfo d;
  d.device = Device{DeviceType::cpu, 0};
  d.cuda_backend = cuda_backend;
  d.name = "cpu";
  return d;
}

// A call of `op` on T tokens of hidden size H with N candidates (K snapshots + the prefix); every other
// argument absent.
inline PlanQuery plan_query_of(AttnResOp op, int64_t T, int64_t N, int64_t H, bool add, bool diagnostics = false) {
  PlanQuery q;
  q.op = op;
  q.tokens = T;
  q.candidates = N;
  q.hidden = H;
  q.add = add;
  q.diagnostics = diagnostics;
  return q;
}

}  // namespace attnres_test
