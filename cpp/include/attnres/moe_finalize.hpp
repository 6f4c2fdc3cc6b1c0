// The MoE finalize epilogue (the contract: docs/ops/moe_finalize.md): the consumer side of a
// deferred finalize. A MoE runner called with do_finalize=False hands over its expert output rows in permuted
// order, the per-route weights and the route -> row map; this op combines them per token, adds the shared
// expert's output and applies the latent RMSNorm, in one pass.
//
//   acc    = scale * sum_j f32(weights[t, j]) * f32(rows[index[t, j]])   fp32, j ascending, valid routes only
//   routed = bf16(acc)                                                  the one rounding of the combine
//   x      = shared ? bf16(f32(routed) + f32(shared[t])) : routed       non-flushing fp32 add
//   out    = norm_weight ? two-rounding RMSNorm(x) (ops.md step 7) : x
//
// Flow, as for the attention-residual ops: validate (ArgumentError) -> plan (pure: picks the backend or
// declines) -> run on the caller's stream.
#pragma once

#include <cstdint>
#include <string>

#include "attnres/attn_res.hpp"  // KernelKind (the finalize reuses its names: cpu, single_cta)
#include "attnres/device.hpp"
#include "attnres/tensor.hpp"

namespace attnres {

struct MoeFinalizeArgs {
  // inputs
  TensorRef rows;         // [R, D] bf16 expert outputs in permuted order; innermost stride 1, row stride a
                          // multiple of 8 elements; only rows named by `index` are read (padding never is)
  TensorRef weights;      // [T, k] fp32 or bf16, dense: the buffer the routing used
  TensorRef index;        // [T, k] int32, dense: row of route (t, j) in [0, R), or -1 (remote expert: skipped)
  TensorRef shared;       // [T, D] bf16, optional: the shared experts' output
  TensorRef norm_weight;  // [D] bf16, optional: gain of the trailing (latent) RMSNorm
  double eps = 1e-5;      // RMSNorm epsilon (validated finite and >= 0 on every call)
  double scale = 1.0;     // routed scaling factor, applied once to the fp32 sum
  // output (caller-allocated)
  TensorRef output;       // [T, D] bf16
  void* stream = nullptr; // cudaStream_t of the caller; ignored on the CPU backend
};

struct MoeFinalizeOptions {
  bool pdl = true;  // launch with programmatic dependent launch (the kernel waits before its first read)
  KernelKind kernel = KernelKind::automatic;  // force cpu or single_cta (tests); still validated
};

// What the plan needs to know of a call (a pure function of these, the device and the options).
struct MoeFinalizeQuery {
  int64_t tokens = 0;  // T
  int64_t routes = 0;  // k
  int64_t hidden = 0;  // D
  DType rows_dtype = DType::bf16;
  DType weights_dtype = DType::f32;
  bool shared = false, norm = false;
};

struct MoeFinalizePlan {
  KernelKind kernel = KernelKind::automatic;  // cpu or single_cta; automatic when declined
  std::string decline;                        // why the call cannot run; empty when accepted
  // CUDA geometry: one block of `threads` threads per token; each thread owns `vectors` 16-byte (8 x bf16)
  // slices of the row and loads `route_chunk` routes' slices before using any (one DRAM round trip per
  // chunk: k <= route_chunk costs one).
  int32_t threads = 0;
  int32_t vectors = 0;
  int32_t route_chunk = 0;
  bool pdl = false;

  bool accepted() const { return decline.empty(); }
};

// Throws ArgumentError ("moe_finalize: <arg> <rule>") on any violated precondition. For CPU tensors this
// includes a scan of `index` (every value -1 or in [0, R)); for CUDA tensors the scan would need a device
// round trip, so the kernel checks instead and writes NaN rows for a token with an out-of-range route
// (docs/ops/moe_finalize.md, "Out-of-range routes"). With require_output=false an absent output is allowed.
void validate_moe_finalize(const MoeFinalizeArgs& args, bool require_output = true);
MoeFinalizeQuery moe_finalize_query(const MoeFinalizeArgs& args);

// Pure: the backend (and its geometry) for a call, or why it is declined.
MoeFinalizePlan plan_moe_finalize(const MoeFinalizeQuery& query, const DeviceInfo& device,
                                  const MoeFinalizeOptions& options = {});
// Validates the call (output may be absent), queries its device, then plans.
MoeFinalizePlan plan_moe_finalize(const MoeFinalizeArgs& args, const MoeFinalizeOptions& options = {});

// Validate, plan, launch on args.stream (CUDA: no allocation, no synchronisation) or compute (CPU). Throws
// ArgumentError / UnsupportedError before anything is written, CudaError if the launch fails.
void moe_finalize(const MoeFinalizeArgs& args, const MoeFinalizeOptions& options = {});

// Supported range: outside it every call is rejected (validate) and every query declined (plan).
constexpr int64_t kMoeFinalizeMaxRoutes = 32;     // k
constexpr int64_t kMoeFinalizeMaxTokens = 16384;  // T
constexpr int64_t kMoeFinalizeMaxHidden = 16384;  // D
constexpr int64_t kMoeFinalizeHiddenMultiple = 8;

}  // namespace attnres
