// The one place the kernel is chosen: the plan's arithmetic, a pure function of the call's shape, the device's
// properties and the options (plan_arithmetic.hpp; run.cpp adds the occupancy calculator's answer on a real GPU).
// The numbers below come from measurements on the H200 (docs/performance.md); tests pin the table.
#include <algorithm>
#include <string>

#include "attnres/attn_res.hpp"
#include "attnres/error.hpp"
#include "persistent_layout.hpp"
#include "plan_arithmetic.hpp"
#include "plan_tuning.hpp"

namespace attnres {

const char* op_name(AttnResOp op) {
  switch (op) {
    case AttnResOp::attn_res: return "attn_res";
    case AttnResOp::attn_res_rmsnorm: return "attn_res_rmsnorm";
    case AttnResOp::attn_res_add_rmsnorm: return "attn_res_add_rmsnorm";
    case AttnResOp::attn_res_add_rmsnorm_persistent: return "attn_res_add_rmsnorm_persistent";
  }
  return "unknown_op";
}

const char* fp8_scales_name(Fp8Scales mode) {
  switch (mode) {
    case Fp8Scales::none: return "none";
    case Fp8Scales::per_token: return "per_token";
    case Fp8Scales::block128: return "block128";
  }
  return "unknown_fp8_mode";
}

const char* kernel_name(KernelKind kernel) {
  switch (kernel) {
    case KernelKind::automatic: return "auto";
    case KernelKind::cpu: return "cpu";
    case KernelKind::single_cta: return "single_cta";
    case KernelKind::split_k: return "split_k";
    case KernelKind::persistent: return "persistent";
  }
  return "unknown_kernel";
}

const char* topology_name(Topology topology) {
  switch (topology) {
    case Topology::per_token: return "per_token";
    case Topology::persistent: return "persistent";
    case Topology::split: return "split";
    case Topology::automatic: return "auto";
  }
  return "unknown_topology";
}

const char* route_name(Route route) {
  switch (route) {
    case Route::none: return "none";
    case Route::per_token: return "per_token";
    case Route::stream: return "stream";
    case Route::persistent: return "persistent";
    case Route::cpu: return "cpu";
    case Route::token_blocks: return "token_blocks";
  }
  return "unknown_route";
}

const char* decline_code_name(DeclineCode code) {
  switch (code) {
    case DeclineCode::none: return "none";
    case DeclineCode::bad_shape: return "bad_shape";
    case DeclineCode::bad_fp8_mode: return "bad_fp8_mode";
    case DeclineCode::fp8_pow2_without_fp8: return "fp8_pow2_without_fp8";
    case DeclineCode::fp8_without_norm: return "fp8_without_norm";
    case DeclineCode::fp8_block128_hidden: return "fp8_block128_hidden";
    case DeclineCode::persistent_unsupported_feature: return "persistent_unsupported_feature";
    case DeclineCode::cuda_kernel_on_cpu: return "cuda_kernel_on_cpu";
    case DeclineCode::no_cuda_backend: return "no_cuda_backend";
    case DeclineCode::compute_capability: return "compute_capability";
    case DeclineCode::cpu_kernel_on_cuda: return "cpu_kernel_on_cuda";
    case DeclineCode::too_many_tokens: return "too_many_tokens";
    case DeclineCode::persistent_two_blocks_threads: return "persistent_two_blocks_threads";
    case DeclineCode::persistent_shared_memory: return "persistent_shared_memory";
    case DeclineCode::persistent_slots: return "persistent_slots";
    case DeclineCode::persistent_one_pass: return "persistent_one_pass";
    case DeclineCode::persistent_not_resident: return "persistent_not_resident";
    case DeclineCode::single_cta_too_large: return "single_cta_too_large";
    case DeclineCode::split_k_threads: return "split_k_threads";
  }
  return "unknown_decline_code";
}

Plan detail::declined_plan(DeclineCode code, std::string reason) {
  Plan p;
  p.decline = std::move(reason);
  p.decline_code = code;
  return p;
}

namespace {

Plan declined(DeclineCode code, std::string reason) { return detail::declined_plan(code, std::move(reason)); }

int32_t round_up(int64_t v, int64_t m) { return static_cast<int32_t>((v + m - 1) / m * m); }

// A one-block launch of the per-token kernel (single_cta, or split_k with a cluster of one) reproduces split_k's
// reduction order inside the block: it lays out split_k_cluster(H) chunks of split_k_chunk(H) vectors, each on
// its own kSplitKBlockVectors threads (only the last chunk's block part is trimmed to whole warps), and sums
// the warps chunk by chunk (cuda/attn_res_per_token.cuh).
int32_t one_block_threads(int64_t hidden) {
  const int64_t chunks = tuning::split_k_cluster(hidden);
  return static_cast<int32_t>((chunks - 1) * tuning::kSplitKBlockVectors) + round_up(tuning::split_k_chunk(hidden), 32);
}

std::string persistent_decline(const PlanQuery& q);

// The streaming single_cta's block: the one-block layout's threads, tuning::kStreamVectors of them per thread.
int32_t stream_threads(int64_t hidden) {
  return round_up(one_block_threads(hidden), 32 * tuning::kStreamVectors) / tuning::kStreamVectors;
}

// The streaming single_cta's token buffers: the knob's, else the tuned count for the call.
int32_t stream_buffers(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  return o.stream_buffers > 0 ? o.stream_buffers
                              : tuning::stream_buffers(q.candidates, q.add, q.add2, tuning::topology_grid(dev.name));
}

// single_cta streams (cuda/attn_res_stream.cuh) from the knob's T on, by default once there are more tokens than
// SMs (one block of a few hundred threads and up to 64 registers each fills an SM's registers, so without
// streaming each SM runs its tokens one after the other, every one a full DRAM round trip), only where the
// prefetch buffers fit the block's shared memory, and with block128 FP8 scales only where the 128-column groups
// align with split_k's chunks (the streaming epilogue reduces a group within half a warp). Its shared memory, 0
// when it does not stream.
int32_t stream_smem_bytes(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  const int64_t from = o.stream_min_tokens > 0 ? o.stream_min_tokens : int64_t{dev.sm_count} + 1;
  if (q.tokens < from) return 0;
  if (q.fp8 == Fp8Scales::block128 && tuning::split_k_chunk(q.hidden) % 16 != 0) return 0;
  const int64_t bytes = tuning::stream_smem_bytes(tuning::candidate_bucket(q.candidates), q.add, q.add2,
                                                  stream_threads(q.hidden), stream_buffers(q, dev, o));
  if (bytes + tuning::kStreamStaticSharedBytes > dev.shared_memory_per_block_optin) return 0;
  return static_cast<int32_t>(bytes);
}

// single_cta holds a token's rows in one block's registers: one 16-byte vector per thread, N <= 4.
bool single_cta_fits(const PlanQuery& q) {
  return q.hidden / 8 <= tuning::kSingleCtaMaxThreads && q.candidates <= tuning::kSingleCtaMaxCandidates;
}

// single_cta runs the token-block kernel (cuda/attn_res_blocks.cuh) from the knob's T on, by default from the
// GPU's measured table's (tuning::automatic_token_blocks_min_tokens), with bf16 output. Its FP8 instances are not
// measured yet: an FP8 call takes them only through the knob, block128 where the chunks are multiples of 16
// vectors (a group is then 16 aligned lanes, as in the streaming kernel).
bool token_blocks(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  if (!single_cta_fits(q)) return false;
  if (q.fp8 != Fp8Scales::none &&
      (o.token_blocks_min_tokens == 0 ||
       (q.fp8 == Fp8Scales::block128 && tuning::split_k_chunk(q.hidden) % 16 != 0)))
    return false;
  const bool norm = q.op != AttnResOp::attn_res;
  const int64_t from = o.token_blocks_min_tokens > 0
                           ? o.token_blocks_min_tokens
                           : tuning::automatic_token_blocks_min_tokens(q.candidates, q.hidden,
                                                                       (q.add ? 1 : 0) + (q.add2 ? 1 : 0), norm,
                                                                       tuning::topology_grid(dev.name));
  return q.tokens >= from;
}

// The token-block kernel's block: ceil(C / kTokenBlocksVectors) groups of kSplitKBlockVectors threads.
int32_t token_blocks_threads(int64_t hidden) {
  const int64_t chunks = tuning::split_k_cluster(hidden);
  return static_cast<int32_t>((chunks + tuning::kTokenBlocksVectors - 1) / tuning::kTokenBlocksVectors *
                              tuning::kSplitKBlockVectors);
}

// The automatic per-token choice: single_cta where the GPU's measurement favours it (the token-block kernel's
// table, or tuning::prefer_single_cta where it streams); split_k otherwise.
bool automatic_single_cta(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  return single_cta_fits(q) &&
         (token_blocks(q, dev, o) ||
          (tuning::prefer_single_cta(q.tokens, q.candidates, q.hidden, q.add, tuning::topology_grid(dev.name)) &&
           stream_smem_bytes(q, dev, o) > 0));
}

// The rows the persistent kernel streams per token: K bank rows, the prefix, the addends.
int64_t persistent_rows(const PlanQuery& q) { return q.candidates + (q.add ? 1 : 0) + (q.add2 ? 1 : 0); }

// The blocks per SM of the persistent plan for the call: the knob when set, else two wherever that geometry
// exists (persistent::two_blocks_fit) and also honours the other knobs (a slot count that fits half the SM, one
// pass when forced), else one. A function of H, the device and the knobs (and N only for a forced single
// pass), never of T.
int32_t persistent_blocks_per_sm(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  if (o.persistent_blocks_per_sm > 0) return o.persistent_blocks_per_sm;
  const int64_t optin = dev.shared_memory_per_block_optin;
  if (!persistent::two_blocks_fit(q.hidden, optin)) return 1;
  const int32_t fit = persistent::max_slots(persistent::block_budget(optin, 2), q.candidates, q.hidden);
  if (o.persistent_slots > fit) return 1;
  const int32_t slots = o.persistent_slots > 0 ? o.persistent_slots : fit;
  if (o.persistent_passes == 1 && slots < persistent_rows(q)) return 1;
  return 2;
}

bool routes_to_persistent(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  if (q.op == AttnResOp::attn_res_add_rmsnorm_persistent) return true;
  if (o.kernel == KernelKind::persistent) return true;  // forced: declined below for the diagnostics
  // Only the per-token kernels emit attn_res's fp32 diagnostics: such a call keeps to them under any topology.
  if (q.op == AttnResOp::attn_res && q.diagnostics) return false;
  if (o.kernel == KernelKind::single_cta || o.kernel == KernelKind::split_k) return false;
  if (o.topology == Topology::persistent) return true;
  if (o.topology == Topology::split) return q.tokens > o.split_max_tokens;
  if (o.topology == Topology::automatic)
    return !automatic_single_cta(q, dev, o) &&
           tuning::automatic_prefers_persistent(q.tokens, q.candidates, q.hidden, (q.add ? 1 : 0) + (q.add2 ? 1 : 0),
                                                 persistent_blocks_per_sm(q, dev, o) == 2,
                                                 tuning::topology_grid(dev.name)) &&
           persistent_decline(q).empty();
  return false;
}

// The persistent kernel streams rows for whole tokens and writes updated, output and the snapshot row only.
std::string persistent_decline(const PlanQuery& q) {
  if (q.op == AttnResOp::attn_res && q.diagnostics)
    return "the persistent kernel does not emit the fp32 diagnostics: attn_res with diagnostics runs on the "
           "per-token kernels";
  if (q.tap) return "the persistent kernel does not emit the pre-norm mixture tap";
  return {};
}

// The persistent kernel's geometry (cuda/attn_res_persistent.cuh): consumer warps and the vector bucket from H
// alone (they fix every reduction order), the ring as deep as the device's shared memory allows, one pass when
// a token's rows and the geometry's spare slots fit the ring (tuning::persistent_one_pass_spare_slots), two
// passes otherwise; two blocks per SM where that geometry exists, one otherwise (persistent_blocks_per_sm). The
// tuning knobs (Options::persistent_*) change only the ring, the passes and the blocks per SM, never a bit.
Plan persistent_plan(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  const int64_t H = q.hidden;
  const int64_t rows = persistent_rows(q);
  const int32_t threads = persistent::consumer_threads(H) + persistent::kProducerThreads;
  const int32_t per_sm = persistent_blocks_per_sm(q, dev, o);
  if (per_sm > 1 && threads > persistent::kTwoBlocksMaxThreads)
    return declined(DeclineCode::persistent_two_blocks_threads,
                    "persistent_blocks_per_sm = " + std::to_string(per_sm) + " needs <= " +
                    std::to_string(persistent::kTwoBlocksMaxThreads) + " threads per block; H = " +
                    std::to_string(H) + " takes " + std::to_string(threads));
  const int64_t budget = persistent::block_budget(dev.shared_memory_per_block_optin, per_sm);
  const int32_t fit = persistent::max_slots(budget, q.candidates, H);
  const int32_t least = tuning::persistent_min_slots(q.add2);
  if (fit < least)
    return declined(DeclineCode::persistent_shared_memory, "the persistent kernel needs " +
                    std::to_string(persistent::smem_bytes(least, q.candidates, H)) +
                    " bytes of shared memory per block for H = " + std::to_string(H) + " (" +
                    std::to_string(least) + " row slots); " + device_name(dev.device) +
                    " offers " + std::to_string(budget) +
                    (per_sm > 1 ? " per block at " + std::to_string(per_sm) + " blocks per SM" : std::string()));
  if (o.persistent_slots > 0 && (o.persistent_slots < least || o.persistent_slots > fit))
    return declined(DeclineCode::persistent_slots,
                    "persistent_slots = " + std::to_string(o.persistent_slots) + ": H = " + std::to_string(H) +
                    " fits " + std::to_string(least) + " to " + std::to_string(fit) +
                    " row slots in " + std::to_string(budget) + " bytes per block");
  const int32_t slots = o.persistent_slots > 0 ? o.persistent_slots : fit;
  // One pass needs a slot per row of a token; the automatic choice also wants the spare slots of the geometry.
  if (o.persistent_passes == 1 && slots < rows)
    return declined(DeclineCode::persistent_one_pass,
                    "persistent_passes = 1 needs a row slot for each of a token's " + std::to_string(rows) +
                    " rows; the ring has " + std::to_string(slots));
  const int64_t spare = tuning::persistent_one_pass_spare_slots(per_sm);
  const bool one_pass = slots >= rows + spare;
  const int32_t passes = o.persistent_passes > 0 ? o.persistent_passes : one_pass ? 1 : 2;
  Plan p;
  p.kernel = KernelKind::persistent;
  p.route = Route::persistent;
  p.pdl = o.pdl;
  p.cluster = 1;
  p.vectors = persistent::vectors_per_thread(H);
  p.threads = threads;
  p.max_candidates = static_cast<int32_t>(kMaxCandidates);  // N is a runtime value of every instance
  p.blocks_per_sm = per_sm;
  p.slots = slots;
  p.passes = passes;
  p.smem_bytes = static_cast<int32_t>(persistent::smem_bytes(slots, q.candidates, H));
  const int64_t resident = static_cast<int64_t>(std::max(dev.sm_count, 1)) * per_sm;
  p.blocks = static_cast<int32_t>(std::min<int64_t>(q.tokens, resident));
  return p;
}

}  // namespace

Plan detail::plan_arithmetic(const PlanQuery& q, const DeviceInfo& dev, const Options& o) {
  if (o.split_max_tokens < 0)
    throw ArgumentError(std::string(op_name(q.op)) + ": options.split_max_tokens must be >= 0");
  if (o.cluster < 0 || o.cluster > tuning::kMaxCluster)
    throw ArgumentError(std::string(op_name(q.op)) + ": options.cluster must be in [0, " +
                        std::to_string(tuning::kMaxCluster) + "], got " + std::to_string(o.cluster));
  const auto knob = [&](const char* name, int32_t value, int32_t max) {
    if (value < 0 || value > max)
      throw ArgumentError(std::string(op_name(q.op)) + ": options." + name + " must be in [0, " +
                          std::to_string(max) + "] (0: the plan's choice), got " + std::to_string(value));
  };
  knob("persistent_blocks_per_sm", o.persistent_blocks_per_sm, persistent::kMaxBlocksPerSm);
  knob("persistent_slots", o.persistent_slots, persistent::kMaxSlots);
  knob("persistent_passes", o.persistent_passes, 2);
  // single_cta's T bounds: streaming, token blocks.
  for (const auto& [name, value] : {std::pair{"stream_min_tokens", o.stream_min_tokens},
                                    std::pair{"token_blocks_min_tokens", o.token_blocks_min_tokens}})
    if (value < 0)
      throw ArgumentError(std::string(op_name(q.op)) + ": options." + name +
                          " must be >= 0 (0: the plan's bound), got " + std::to_string(value));
  if (o.stream_buffers != 0 && (o.stream_buffers < 2 || o.stream_buffers > tuning::kStreamMaxBuffers))
    throw ArgumentError(std::string(op_name(q.op)) + ": options.stream_buffers must be 0 (the plan's choice) or in [2, " +
                        std::to_string(tuning::kStreamMaxBuffers) + "], got " + std::to_string(o.stream_buffers));

  // A shape-only query (attnres.plan) never accepts what the ops would reject.
  if (q.tokens < 1) return declined(DeclineCode::bad_shape,
                  "T = " + std::to_string(q.tokens) + " tokens: T must be >= 1");
  if (q.candidates < 1 || q.candidates > kMaxCandidates)
    return declined(DeclineCode::bad_shape, "N = " + std::to_string(q.candidates) + " candidates: N must be in [1, " +
                    std::to_string(kMaxCandidates) + "]");
  if (q.hidden < kHiddenMultiple || q.hidden > kMaxHidden || q.hidden % kHiddenMultiple != 0)
    return declined(DeclineCode::bad_shape,
                    "H = " + std::to_string(q.hidden) + ": H must be a multiple of 8 in [8, " +
                    std::to_string(kMaxHidden) + "]");

  const int fp8_mode = static_cast<int>(q.fp8);
  if (fp8_mode < 0 || fp8_mode > 2) return declined(DeclineCode::bad_fp8_mode,
                  "fp8 = " + std::to_string(fp8_mode) + ": not an FP8 mode");
  if (q.fp8 == Fp8Scales::none && q.fp8_pow2_scales) return declined(DeclineCode::fp8_pow2_without_fp8,
                  "fp8_pow2_scales requires an FP8 mode");
  if (q.fp8 != Fp8Scales::none && q.op == AttnResOp::attn_res)
    return declined(DeclineCode::fp8_without_norm,
                    "attn_res has no normed output to quantize to FP8 (use attn_res_rmsnorm)");
  if (q.fp8 == Fp8Scales::block128 && q.hidden % kFp8GroupSize != 0)
    return declined(DeclineCode::fp8_block128_hidden,
                    "fp8 = block128 needs H a multiple of 128, got H = " + std::to_string(q.hidden));

  const bool persistent = routes_to_persistent(q, dev, o);
  // The persistent kernel's declines (the tap, the fp32 diagnostics) are a property of the topology, on every
  // backend, so the caller's materialize-first path is the same (and testable) on the CPU.
  if (persistent) {
    std::string why = persistent_decline(q);
    if (!why.empty()) return declined(DeclineCode::persistent_unsupported_feature, why);
  }

  if (dev.device.type == DeviceType::cpu) {
    if (o.kernel != KernelKind::automatic && o.kernel != KernelKind::cpu)
      return declined(DeclineCode::cuda_kernel_on_cpu,
                      std::string("kernel ") + kernel_name(o.kernel) +
                          " runs on CUDA devices; the tensors are on cpu");
    Plan p;
    p.kernel = KernelKind::cpu;
    p.route = Route::cpu;
    return p;
  }

  if (!dev.cuda_backend) return declined(DeclineCode::no_cuda_backend, "attnres was built without the CUDA backend");
  if (dev.cc_major < 9)
    return declined(DeclineCode::compute_capability,
                    device_name(dev.device) + " (" + dev.name + ") has compute capability " +
                    std::to_string(dev.cc_major) + "." + std::to_string(dev.cc_minor) +
                    "; the CUDA kernels need 9.0 (Hopper) or newer");
  if (o.kernel == KernelKind::cpu) return declined(DeclineCode::cpu_kernel_on_cuda,
                  "kernel cpu runs on CPU tensors; the tensors are on " +
                                                   device_name(dev.device));
  if (q.tokens > tuning::kMaxTokensPerLaunch)
    return declined(DeclineCode::too_many_tokens,
                    "T = " + std::to_string(q.tokens) + " exceeds the per-launch limit of " +
                    std::to_string(tuning::kMaxTokensPerLaunch) + " tokens");

  if (persistent) {
    Plan p = persistent_plan(q, dev, o);
    // The automatic topology takes the persistent kernel only where it runs; elsewhere the per-token kernels.
    if (p.accepted() || o.topology != Topology::automatic || o.kernel == KernelKind::persistent ||
        q.op == AttnResOp::attn_res_add_rmsnorm_persistent)
      return p;
  }

  const int64_t vecs = q.hidden / 8;  // 16-byte vectors per row
  KernelKind kernel = o.kernel;
  if (kernel == KernelKind::automatic)
    kernel = automatic_single_cta(q, dev, o) ? KernelKind::single_cta : KernelKind::split_k;
  if (kernel == KernelKind::single_cta && !single_cta_fits(q))
    return declined(DeclineCode::single_cta_too_large,
                    "single_cta holds a token's rows in one block's registers: it needs H <= " +
                    std::to_string(tuning::kSingleCtaMaxThreads * 8) + " and N <= " +
                    std::to_string(tuning::kSingleCtaMaxCandidates) + " (use split_k)");

  if (o.stream_buffers > 0 && q.candidates <= tuning::kSingleCtaMaxCandidates &&
      !tuning::stream_buffers_built(tuning::candidate_bucket(q.candidates), o.stream_buffers))
    throw ArgumentError(std::string(op_name(q.op)) + ": options.stream_buffers = " +
                        std::to_string(o.stream_buffers) + ": not built for N bucket " +
                        std::to_string(tuning::candidate_bucket(q.candidates)));

  Plan p;
  p.kernel = kernel;
  p.route = Route::per_token;
  p.pdl = o.pdl;
  p.vectors = 1;
  p.max_candidates = tuning::candidate_bucket(q.candidates);
  if (kernel == KernelKind::single_cta && token_blocks(q, dev, o)) {
    p.cluster = 1;
    p.route = Route::token_blocks;
    p.threads = token_blocks_threads(q.hidden);
    p.vectors = tuning::kTokenBlocksVectors;
    if (o.token_blocks_exact_n && q.candidates == tuning::kTokenBlocksExactCandidates)
      p.max_candidates = tuning::kTokenBlocksExactCandidates;
    p.blocks_per_sm = tuning::token_blocks_per_sm(p.max_candidates);
  } else if (kernel == KernelKind::single_cta) {
    p.cluster = 1;
    p.smem_bytes = stream_smem_bytes(q, dev, o);
    p.threads = p.smem_bytes > 0 ? stream_threads(q.hidden) : one_block_threads(q.hidden);
    p.vectors = p.smem_bytes > 0 ? tuning::kStreamVectors : 1;
    if (p.smem_bytes > 0) {
      p.route = Route::stream;
      p.slots = stream_buffers(q, dev, o);
    }
  } else {
    int32_t cluster = o.cluster > 0 ? o.cluster : tuning::split_k_cluster(q.hidden);
    // No more blocks than vectors; with ceil-divided chunks a trailing block may still own none (the kernel
    // predicates its loads and stores off, and it takes part in the exchanges with zeros).
    cluster = static_cast<int32_t>(std::min<int64_t>(cluster, vecs));
    p.cluster = std::max(cluster, 1);
    p.threads = p.cluster == 1 ? one_block_threads(q.hidden) : round_up((vecs + p.cluster - 1) / p.cluster, 32);
    if (p.threads > tuning::kSplitKMaxThreads)
      return declined(DeclineCode::split_k_threads,
                      "split_k with a cluster of " + std::to_string(p.cluster) + " needs " +
                      std::to_string(p.threads) + " threads per block for H = " + std::to_string(q.hidden) +
                      " (the kernel is built for <= " + std::to_string(tuning::kSplitKMaxThreads) +
                      "): use a larger cluster");
    if (tuning::split_k_exact(p.cluster > 1, q.candidates))
      p.max_candidates = static_cast<int32_t>(q.candidates);
  }
  return p;
}

}  // namespace attnres
