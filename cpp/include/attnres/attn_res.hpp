// The attention-residual ops (the shared contract: docs/ops/common.md; each op: docs/ops/<op>.md).
//
//   attn_res                         mixture + optional fp32 rsigma/probs/logits; optional add (+ add2): then
//                                    updated = prefix + add (+ add2) and the mixture is of the updated prefix
//   attn_res_rmsnorm                 output = RMSNorm(mixture), optional pre-norm tap
//   attn_res_add_rmsnorm             updated = prefix + add (+ add2); output; optional tap and snapshot write
//   attn_res_add_rmsnorm_persistent  same with an optional add and no add2, on the persistent kernel
// `updated` may be layer_residual itself (the same view): the in-place prefix update, bitwise the out-of-place one.
//
// Flow: validate (ArgumentError) -> plan (pure: picks the kernel or declines) -> run on the caller's stream.
#pragma once

#include <cstdint>
#include <string>

#include "attnres/device.hpp"
#include "attnres/limits.hpp"
#include "attnres/tensor.hpp"

namespace attnres {

enum class AttnResOp : int32_t {
  attn_res = 0,
  attn_res_rmsnorm = 1,
  attn_res_add_rmsnorm = 2,
  attn_res_add_rmsnorm_persistent = 3,
};
const char* op_name(AttnResOp op);

// FP8 (e4m3) output of the normed ops, quantized from the op's own bf16 `output` in the same launch
// (docs/ops/attn_res_rmsnorm.md, "FP8 output"): one fp32 scale per token, or per 128 columns of a token.
enum class Fp8Scales : int32_t { none = 0, per_token = 1, block128 = 2 };
const char* fp8_scales_name(Fp8Scales mode);
constexpr int64_t kFp8GroupSize = 128;  // columns per scale of Fp8Scales::block128

// Every argument of every op; each op names which it requires, accepts or refuses (docs/ops/<op>.md).
struct AttnResArgs {
  // inputs (bf16)
  TensorRef layer_residual;       // [T, H] the prefix sum; innermost stride 1, any token stride
  TensorRef layer_residual_add;   // [T, H] optional addend
  TensorRef layer_residual_add2;  // [T, H] optional second addend; requires layer_residual_add
  TensorRef block_residual;       // [K, T, H] snapshot bank view; snapshot and token strides are free
  TensorRef res_weight;           // [H] or [1, H] pseudo-query (weight of the scoring Linear(H, 1))
  TensorRef rms_weight;           // [H] gain of the scoring RMSNorm
  TensorRef norm_weight;          // [H] gain of the trailing RMSNorm (the norm ops)
  double rms_eps = 1e-5;
  double norm_eps = 1e-5;
  // outputs (caller-allocated)
  TensorRef output;   // [T, H] bf16: the normed output (norm ops) or the mixture (attn_res); absent in the
                      // norm ops' FP8-only call (fp8 != none): then only output_fp8 and fp8_scales are written
  TensorRef updated;  // [T, H] bf16: the updated prefix; required exactly when an addend is given
  TensorRef mixture;  // [T, H] bf16: optional pre-norm tap (norm ops)
  TensorRef rsigma, probs, logits;  // [N, T] fp32 diagnostics (attn_res; optional)
  // Snapshot write: P is stored into bank row `snapshot_slot` (the row at block_residual.data +
  // snapshot_slot * snapshot stride). Must be >= K: the row is not a candidate of the same call. -1: none.
  int64_t snapshot_slot = -1;
  // FP8 output (norm ops): with fp8 != none, output_fp8 [T, H] e4m3 (contiguous last dimension) and
  // fp8_scales fp32 are written from the bf16 `output` (stored or not): per_token: [T, 1] (any token stride);
  // block128: [T, H / 128] in DeepGEMM's Hopper layout, column-major over tokens: strides {1, round_up(T, 4)}.
  // fp8_pow2_scales rounds every scale up to a power of two (UE8M0-valued).
  Fp8Scales fp8 = Fp8Scales::none;
  bool fp8_pow2_scales = false;
  TensorRef output_fp8;
  TensorRef fp8_scales;
  void* stream = nullptr;  // cudaStream_t of the caller; ignored on the CPU backend
};

enum class Topology : int32_t { per_token = 0, persistent = 1, split = 2, automatic = 3 };
enum class KernelKind : int32_t { automatic = 0, cpu = 1, single_cta = 2, split_k = 3, persistent = 4 };
const char* kernel_name(KernelKind kernel);
const char* topology_name(Topology topology);

// Options come in as arguments; the library reads no environment variable.
struct Options {
  // automatic (default): where they were measured faster, the streaming single_cta (plan_tuning.hpp
  // prefer_single_cta: N <= 2, or N <= 4 without an addend on the H100, T >= 256, H > 4096, bf16) and the persistent
  // kernel (automatic_prefers_persistent: T at least automatic_persistent_min_tokens(N, H, addends, grid) from the
  // GPU's grid — on the H200 128..4096 by N, never for N > 10 with one addend, N > 13 without, never with two; on
  // the H100 N = 5..7, and 8 without an addend, 5, 6 with two, only —
  // and the persistent plan for the call on two blocks per SM, where it
  // supports the call: no tap or fp32 diagnostics), else split_k at any T. Every CUDA kernel gives the same bits
  // (docs/ops/common.md section 8), so the choice never changes a result. per_token / persistent force one
  // family; split: per-token up to split_max_tokens, persistent above (declining what it cannot do).
  Topology topology = Topology::automatic;
  // topology split: per-token kernels up to this T, persistent above.
  int64_t split_max_tokens = 64;
  bool pdl = true;                // programmatic dependent launch on the CUDA kernels
  KernelKind kernel = KernelKind::automatic;  // force a kernel (tests, benchmarks); still validated
  int32_t cluster = 0;            // split_k cluster size override (0: the measured default)
  // Tuning knobs of the persistent kernel's geometry, for benchmarks (python -m bench persistent
  // --variants; Python reaches them only through attnres._persistent_tuning). None changes a result: which
  // thread owns an element and every reduction order depend on H alone. 0 keeps the plan's choice (blocks per
  // SM: two where that geometry exists and honours the other knobs, else one; docs/ops/attn_res_add_rmsnorm_persistent.md).
  // An explicit value is kept as given: a geometry that does not fit is declined, and an explicit 2 whose blocks
  // the occupancy calculator does not find resident is declined by the plan on that GPU (UnsupportedError).
  int32_t persistent_blocks_per_sm = 0;  // 1 or 2 blocks per SM (2: each gets half the SM's shared memory)
  int32_t persistent_slots = 0;          // exactly this many ring slots (declined when they do not fit)
  int32_t persistent_passes = 0;         // 1 or 2 passes per row (1 declined when a token's rows do not fit)
  // Benchmark-only (Python: attnres.Options has no such field; `_stream_min_tokens` of the binding): single_cta
  // streams (min(T, resident) blocks loop over the tokens, prefetching the next one's rows; the same bits) from
  // this T on, where its shared memory fits and the output is bf16. 0: the plan's bound (more tokens than SMs).
  int64_t stream_min_tokens = 0;
  // Benchmark-only (`_stream_buffers` of the binding): the streaming single_cta's token buffers (the token being
  // reduced and the ones in flight; the same bits). 0: the plan's count (plan_tuning.hpp stream_buffers), else
  // 2..4 where the call's N bucket is built with it (ArgumentError otherwise).
  int32_t stream_buffers = 0;
  // Benchmark-only (`_token_blocks_min_tokens` of the binding): single_cta runs the token-block kernel (one block
  // per token, several per SM; the same bits) from this T on, FP8 calls included (block128 where split_k's chunks
  // are multiples of 16 vectors). 0: the plan's bound (plan_tuning.hpp automatic_token_blocks_min_tokens; bf16
  // calls only).
  int64_t token_blocks_min_tokens = 0;
  // Benchmark-only (`_token_blocks_exact_n` of the binding): at N = 3 the token-block kernel runs an instance built
  // for exactly three candidates, three blocks per SM, instead of the bucket's (N = 4, two); elsewhere no effect.
  // The same bits.
  bool token_blocks_exact_n = false;
};

// What the plan needs to know of a call: a pure function of these, the device and the options.
struct PlanQuery {
  AttnResOp op = AttnResOp::attn_res;
  int64_t tokens = 0;      // T
  int64_t candidates = 0;  // N = K + 1
  int64_t hidden = 0;      // H
  bool add = false, add2 = false, tap = false, snapshot = false, diagnostics = false;
  Fp8Scales fp8 = Fp8Scales::none;  // the FP8 epilogue (a compile-time variant of every kernel)
  bool fp8_pow2_scales = false;
};

// Which kernel family runs a call: the per-token kernels (split_k, or single_cta one token per block), the
// streaming single_cta (its blocks loop over the tokens), the token-block single_cta (one block per token, several
// per SM), the persistent kernel, or the CPU backend; none when
// declined.
enum class Route : int32_t { none = 0, per_token = 1, stream = 2, persistent = 3, cpu = 4, token_blocks = 5 };
const char* route_name(Route route);

// Why a plan declines (one value per reason; the sentence in Plan::decline says it for the caller).
enum class DeclineCode : int32_t {
  none = 0,                           // accepted
  bad_shape = 1,                      // T < 1, N outside [1, kMaxCandidates], or H not a multiple of 8 in range
  bad_fp8_mode = 2,                   // fp8 is not an Fp8Scales value
  fp8_pow2_without_fp8 = 3,           // fp8_pow2_scales without an FP8 mode
  fp8_without_norm = 4,               // FP8 output asked of attn_res (it has no normed output)
  fp8_block128_hidden = 5,            // block128 with H not a multiple of 128
  persistent_unsupported_feature = 6, // the persistent route with diagnostics, add2, tap or a snapshot write
  cuda_kernel_on_cpu = 7,             // a CUDA kernel forced for CPU tensors
  no_cuda_backend = 8,                // CUDA tensors, build without the CUDA backend
  compute_capability = 9,             // a CUDA device older than sm_90
  cpu_kernel_on_cuda = 10,            // kernel cpu forced for CUDA tensors
  too_many_tokens = 11,               // T above the per-launch limit
  persistent_two_blocks_threads = 12, // two blocks per SM with more threads than their instance is built for
  persistent_shared_memory = 13,      // not even the smallest ring fits a block's shared memory
  persistent_slots = 14,              // the slot knob outside what fits
  persistent_one_pass = 15,           // one pass forced where a token's rows do not fit the ring
  persistent_not_resident = 16,       // two blocks per SM forced where the occupancy calculator finds fewer
  single_cta_too_large = 17,          // single_cta forced where a token's rows do not fit one block
  split_k_threads = 18,               // split_k with a cluster too small for H
};
const char* decline_code_name(DeclineCode code);

// What a call launches: run() launches exactly the plan that plan() returns for the call (detail::last_launch
// records it), and plan(query, device, options) for the call's shape on its queried device is that plan too.
struct Plan {
  KernelKind kernel = KernelKind::automatic;  // the kernel that runs; automatic when declined
  Route route = Route::none;                  // the kernel family (single_cta: per_token, stream or token_blocks)
  std::string decline;                        // why the call cannot run as asked; empty when accepted
  DeclineCode decline_code = DeclineCode::none;
  // CUDA launch geometry (per-token kernels): one cluster of `cluster` blocks of `threads` threads per
  // token; each thread owns `vectors` 16-byte (8 x bf16) slices of every candidate row.
  int32_t cluster = 1;
  int32_t threads = 0;
  int32_t vectors = 1;
  // The N the kernel instance is built for: N itself for split_k on a cluster from N = 3, else N's bucket
  // (kCandidateBuckets); 16 for the persistent kernel (N a runtime value).
  int32_t max_candidates = 0;
  bool pdl = false;
  // persistent: `blocks` blocks (at most `blocks_per_sm` per SM, never more than T) of `threads` threads
  // (consumer warps + one producer warp; each consumer thread owns `vectors` 16-byte slices of every row), a
  // ring of `slots` row slots in `smem_bytes` bytes of dynamic shared memory, each row streamed `passes` times
  // (1: a token's rows stay resident from scoring to mixing; 2: they do not fit, and are streamed again to mix).
  int32_t blocks = 0;
  int32_t blocks_per_sm = 0;  // blocks resident per SM the ring is sized for (1 or 2)
  int32_t slots = 0;  // streaming single_cta: its token buffers (the token being reduced and those in flight)
  int32_t passes = 0;
  // persistent: the ring. single_cta: > 0 when it streams (the tokens' prefetch buffers; the launcher runs as many
  // blocks as are resident, never more than T, each looping over the tokens blockIdx.x, + gridDim.x, ..., and each
  // thread owns `vectors` slices).
  int32_t smem_bytes = 0;

  bool accepted() const { return decline.empty(); }
};

// Throws ArgumentError on any violated precondition; with require_outputs=false, absent outputs are
// allowed (plan-only queries), present ones are still checked.
void validate(AttnResOp op, const AttnResArgs& args, bool require_outputs = true);
PlanQuery plan_query(AttnResOp op, const AttnResArgs& args);

// The kernel (and its geometry) for a call, or the reason it is declined: the pure arithmetic of the shape,
// the device's properties and the options, plus, on a queried GPU (DeviceInfo::queried) of a build with the
// CUDA backend, the occupancy calculator's answer for the persistent kernel's two blocks per SM (host-side,
// legal during a graph capture): where they are not resident an automatic geometry is replanned with one block
// per SM and a forced one is declined. For a described device the arithmetic alone.
Plan plan(const PlanQuery& query, const DeviceInfo& device, const Options& options = {});
// Validates the call, queries its device, then plans: the plan run() launches for the call.
Plan plan(AttnResOp op, const AttnResArgs& args, const Options& options = {});

namespace detail {
// The plan the calling thread's latest successful run() of an attention-residual op launched (or computed, on
// the CPU backend), and how many such runs the thread has made; a default Plan and 0 before the first.
struct LaunchRecord {
  Plan plan;
  uint64_t launches = 0;
};
const LaunchRecord& last_launch();
}  // namespace detail

// Validate, plan, launch on args.stream (CUDA) or compute (CPU). Throws ArgumentError / UnsupportedError
// before anything is written, CudaError if a launch fails.
void run(AttnResOp op, const AttnResArgs& args, const Options& options = {});

inline void attn_res(const AttnResArgs& a, const Options& o = {}) { run(AttnResOp::attn_res, a, o); }
inline void attn_res_rmsnorm(const AttnResArgs& a, const Options& o = {}) {
  run(AttnResOp::attn_res_rmsnorm, a, o);
}
inline void attn_res_add_rmsnorm(const AttnResArgs& a, const Options& o = {}) {
  run(AttnResOp::attn_res_add_rmsnorm, a, o);
}
inline void attn_res_add_rmsnorm_persistent(const AttnResArgs& a, const Options& o = {}) {
  run(AttnResOp::attn_res_add_rmsnorm_persistent, a, o);
}

}  // namespace attnres
