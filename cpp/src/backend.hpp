// The backends behind run(): the CPU reference backend (always built) and the CUDA kernels (built when
// CUDA is found). Only run.cpp and device.cpp call these.
#pragma once

#include "attnres/all_reduce.hpp"
#include "attnres/attn_res.hpp"
#include "attnres/device.hpp"
#include "attnres/moe_finalize.hpp"
#include "attnres/version.hpp"

namespace attnres::detail {

// CPU backend: the whole contract, fp32 arithmetic with the contract's rounding boundaries.
void cpu_attn_res(AttnResOp op, const AttnResArgs& args);
void cpu_moe_finalize(const MoeFinalizeArgs& args);
// Both reduce `gathered` (every rank's partial) in rank order (cpu/all_reduce_cpu.cpp).
void cpu_all_reduce(const AllReduceArgs& args);
void cpu_moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& args);

#if ATTNRES_WITH_CUDA
int cuda_device_count();
DeviceInfo cuda_query_device(int index);
// Launches the per-token kernel `plan` chose on args.stream. Throws CudaError on a failed launch.
void cuda_attn_res(AttnResOp op, const AttnResArgs& args, const Plan& plan);
// Launches the persistent kernel with the plan's geometry on args.stream (cuda/attn_res_persistent_launch.cu).
void cuda_attn_res_persistent(AttnResOp op, const AttnResArgs& args, const Plan& plan);
// The blocks per SM of the plan's persistent instance that the occupancy calculator finds resident (after the
// instance's shared-memory opt-in); 0 when no instance matches the plan. Host-side, legal during a capture.
int cuda_attn_res_persistent_resident(AttnResOp op, const AttnResArgs& args, const Plan& plan);
void cuda_moe_finalize(const MoeFinalizeArgs& args, const MoeFinalizePlan& plan);
// The one-shot exchange (cuda/all_reduce_kernel.cu) and the fused finalize (cuda/moe_finalize_all_reduce_kernel.cu).
void cuda_all_reduce(const AllReduceArgs& args, const AllReducePlan& plan);
void cuda_moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& args, const MoeFinalizePlan& finalize_plan,
                                  const AllReducePlan& plan);
#endif

}  // namespace attnres::detail
