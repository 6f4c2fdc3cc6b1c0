// The one-shot all-reduce of tensor-parallel decode and the epilogues fused with it (docs/ops/all_reduce.md).
//
//   all_reduce                        reduced = bf16( sum_{r = 0..W-1} f32(partial_r) )   fp32, rank order, one rounding
//   all_reduce_attn_res_add_rmsnorm   all_reduce into the addend (site add) or the second addend (site add2) of
//                                     attn_res_add_rmsnorm, then that op: two kernels joined by PDL
//   moe_finalize_all_reduce           the local-route combine of moe_finalize (no shared, no norm), the all_reduce
//                                     of that partial, then moe_finalize's two-rounding RMSNorm: one kernel
//
// A real -0.0 element of a partial is read as +0.0 (the exchange uses -0.0 as its "not yet written" marker).
//
// The communicator (CommRef) is a view of memory the caller allocated and exchanged once (attnres.comm.Communicator):
// per rank a buffer region of 3 slots x W sources x (`capacity` + 1) rows x `width` bf16 elements, initialised to
// -0.0, reachable from every rank (peers' regions mapped through CUDA IPC or in one process), and this rank's
// small state (generation, error word, arrival counter, tokens per slot, the error's details). Row `capacity` of
// each (slot, source) is the source's header: its T and width, so a reader detects a peer called with another T. Nothing is passed per call: the
// generation advances inside the kernel, so CUDA-graph replays rotate the slots correctly.
//
// Backends: CUDA runs the exchange itself. The CPU backend cannot reach other processes' memory: it takes every
// rank's partial already gathered ([W, T, D], torch.distributed gathers them) and reduces them in rank order.
#pragma once

#include <cstdint>
#include <string>

#include "attnres/attn_res.hpp"
#include "attnres/device.hpp"
#include "attnres/moe_finalize.hpp"
#include "attnres/tensor.hpp"

namespace attnres {

constexpr int32_t kAllReduceMaxWorld = 8;
constexpr int32_t kAllReduceSlots = 3;
// uint32: [0] generation, [1] error, [2] arrivals, [3..5] tokens per slot, [6] the peer the error names (late or
// mismatched), [7] that peer's T (or width), [8] this rank's T (or width) in the failed call, [9..11] unused.
constexpr int32_t kAllReduceStateWords = 12;
constexpr int64_t kAllReduceHeaderRows = 1;  // per (slot, source), after the `capacity` data rows
constexpr int64_t kAllReduceMaxWidth = 16384;
constexpr int64_t kAllReduceWidthMultiple = 8;

// Error word values (state[1]); 0 = healthy. Once set, every later call on the communicator exits at once.
constexpr uint32_t kAllReduceErrorTimeout = 1;        // a peer's rows did not arrive within comm.timeout_ns
constexpr uint32_t kAllReduceErrorTokenMismatch = 2;  // a peer was called with another T (nothing was written)
constexpr uint32_t kAllReduceErrorWidthMismatch = 3;  // a peer's communicator has another width

struct CommRef {
  int32_t world_size = 0;
  int32_t rank = -1;
  int64_t capacity = 0;  // T_max: tokens per slot
  int64_t width = 0;     // D: elements per token
  Device device{};
  // buffers[r]: base of rank r's region, bf16 [3][W][capacity + kAllReduceHeaderRows][width], as this process
  // addresses it.
  uintptr_t buffers[kAllReduceMaxWorld] = {};
  uintptr_t state = 0;  // this rank's uint32 [kAllReduceStateWords], on `device`
  int64_t timeout_ns = 10'000'000'000;  // bounded wait per call; must allow for time slicing between processes
};

struct AllReduceArgs {
  TensorRef input;     // [T, D] bf16, this rank's partial (CUDA); innermost stride 1, 16-byte aligned rows
  TensorRef gathered;  // [W, T, D] bf16, every rank's partial in rank order (CPU backend only)
  TensorRef output;    // [T, D] bf16, caller-allocated; may not alias the input
  CommRef comm;
  void* stream = nullptr;
};

struct AllReduceOptions {
  bool pdl = true;  // launch with PDL; the kernel waits on the grid dependency before reading the partial
  // Release dependents at the start of the kernel (their griddepcontrol.wait still waits for this kernel to
  // finish): a PDL consumer then issues its independent loads while the exchange runs.
  bool early_trigger = true;
  KernelKind kernel = KernelKind::automatic;  // cpu or single_cta (tests); still validated
};

struct AllReducePlan {
  KernelKind kernel = KernelKind::automatic;  // cpu or single_cta (the one-shot kernel); automatic when declined
  std::string decline;
  int32_t threads = 0;  // per block; each thread owns one 16-byte vector of a token
  int32_t blocks_per_token = 0;
  bool pdl = false, early_trigger = false;
  bool accepted() const { return decline.empty(); }
};

struct AllReduceQuery {
  int32_t world_size = 0;
  int64_t tokens = 0, width = 0;
  Device device{};
};

// The communicators this process created. A CommRef carries raw addresses (every rank's region, the state), so
// the library launches a kernel only on a CUDA CommRef equal to a registered one: a forged or stale address
// never reaches a kernel, whichever entry point the call came through. attnres.comm.Communicator registers at
// creation and unregisters at close (or when collected). Registration checks what it can without reading
// memory: the CommRef's own rules, `state` an int32 [kAllReduceStateWords] tensor at comm.state on comm.device,
// `region_bytes` the size of one rank's region (3 x W x (capacity + 1) x width bf16; 0 on the CPU, which has no
// regions), the regions 16-byte aligned and disjoint from each other and from the state. Handles start at 1 and
// are never reused, so a closed communicator's handle stays invalid.
int64_t register_communicator(const CommRef& comm, const TensorRef& state, int64_t region_bytes);
void unregister_communicator(int64_t handle);  // unknown handles are ignored (close is idempotent)
// The registered CommRef of `handle`; ArgumentError ("<op>: comm ..." / "<op>: state ...") unless the handle
// is registered and `state` is its state tensor: int32 [kAllReduceStateWords], stride 1, on its device, and on
// CUDA (check_address) at its address (the kernels keep the generation there; the CPU backend never reads it). check_address = false is for shape-only callers (torch's fake tensors).
CommRef registered_communicator(const std::string& op, int64_t handle, const TensorRef& state,
                                bool check_address = true);

// ArgumentError ("all_reduce: <arg> <rule>") on any violated precondition; nothing is written. read_data: also
// the rules that read the tensors (CPU only: `gathered[comm.rank]` must hold `input`, bit for bit, so the sum is
// of what this rank passed); false for callers whose refs point at nothing (torch's fake tensors, plans).
void validate_all_reduce(const AllReduceArgs& args, bool require_output = true, bool read_data = true);
AllReducePlan plan_all_reduce(const AllReduceQuery& query, const DeviceInfo& device, const AllReduceOptions& options = {});
AllReducePlan plan_all_reduce(const AllReduceArgs& args, const AllReduceOptions& options = {});
void all_reduce(const AllReduceArgs& args, const AllReduceOptions& options = {});

// The fused site: `ar.output` must be exactly the addend the site reduces (site add: attn.layer_residual_add; site
// add2: attn.layer_residual_add2). Both calls are validated and planned before anything is launched.
enum class AllReduceSite : int32_t { add = 0, add2 = 1 };
// The fused site's plan: the all-reduce's and the attention op's plans must accept (a declined half declines the
// call, naming it).
AllReducePlan plan_all_reduce_attn_res_add_rmsnorm(const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn,
                                                   const AllReduceOptions& ar_options = {},
                                                   const Options& attn_options = {});
void all_reduce_attn_res_add_rmsnorm(const AllReduceArgs& ar, AllReduceSite site, const AttnResArgs& attn,
                                     const AllReduceOptions& ar_options = {}, const Options& attn_options = {});

// MoE finalize + all-reduce + latent RMSNorm. finalize.norm_weight is required, finalize.shared refused;
// finalize.output receives the normed latent, `reduced` (optional) the all-reduced latent before the norm.
struct MoeFinalizeAllReduceArgs {
  MoeFinalizeArgs finalize;
  TensorRef reduced;   // [T, D] bf16, optional
  TensorRef gathered;  // [W, T, D] bf16: every rank's local-route partial (CPU backend only)
  CommRef comm;
};
// read_data = false skips the data-dependent rules (the index range, and on the CPU that `gathered[comm.rank]`
// is this rank's local-route partial bit for bit), as validate_moe_finalize's flag does: the fake
// implementation validates synthetic refs whose addresses hold nothing.
void validate_moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& args, bool require_output = true,
                                      bool read_data = true);
// The plan of the fused kernel: declines world sizes without a kernel instance (2, 4, 8 on CUDA), the finalize's
// own declines, and a D other than the communicator's width.
AllReducePlan plan_moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& args, const AllReduceOptions& options = {});
void moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& args, const AllReduceOptions& options = {});

// The world sizes the CUDA kernels are instantiated for.
bool all_reduce_world_supported(int32_t world_size);

}  // namespace attnres
