// Preconditions of all_reduce and of the ops fused with it, checked for every backend before anything runs.
// Messages: "<op>: <argument> <rule>".
#include <string>

#include "attnres/all_reduce.hpp"
#include "attnres/error.hpp"
#include "checks.hpp"
#include "layout.hpp"

namespace attnres {

namespace {

std::string num(int64_t v) { return std::to_string(v); }

void check_comm(const detail::Checker& c, const CommRef& m) {
  if (m.world_size < 1 || m.world_size > kAllReduceMaxWorld)
    c.fail("comm.world_size", "must be in [1, " + num(kAllReduceMaxWorld) + "], got " + num(m.world_size));
  if (m.rank < 0 || m.rank >= m.world_size)
    c.fail("comm.rank", "must be in [0, world_size = " + num(m.world_size) + "), got " + num(m.rank));
  if (m.capacity < 1) c.fail("comm.capacity", "must be >= 1 token, got " + num(m.capacity));
  if (m.width < kAllReduceWidthMultiple || m.width > kAllReduceMaxWidth || m.width % kAllReduceWidthMultiple != 0)
    c.fail("comm.width", "must be a multiple of 8 in [8, " + num(kAllReduceMaxWidth) + "], got " + num(m.width));
  if (m.timeout_ns < 1) c.fail("comm.timeout_ns", "must be >= 1, got " + num(m.timeout_ns));
  if (m.device.type == DeviceType::cuda) {
    for (int r = 0; r < m.world_size; ++r) {
      if (m.buffers[r] == 0) c.fail("comm.buffers", "has no buffer for rank " + num(r));
      if (m.buffers[r] % 16 != 0) c.fail("comm.buffers", "buffer of rank " + num(r) + " is not 16-byte aligned");
    }
    if (m.state == 0) c.fail("comm.state", "is required on CUDA");
    if (m.state % 16 != 0) c.fail("comm.state", "must be 16-byte aligned");
  }
}

// A [T, D] partial, reduced or output tensor; T and D checked against the communicator.
void check_rows(const detail::Checker& c, const char* arg, const TensorRef& t, const CommRef& m, int64_t T) {
  if (t.ndim != 2)
    c.fail(arg, "must be a 2-D [T, D] tensor, got " + num(t.ndim) + " dimensions " + t.shape_string());
  if (t.shape[1] != m.width)
    c.fail(arg, "has D = " + num(t.shape[1]) + " but the communicator's width is " + num(m.width));
  if (t.shape[0] != T) c.fail(arg, "must have T = " + num(T) + " rows, got " + t.shape_string());
  c.dtype(arg, t, DType::bf16);
  c.device(arg, t, m.device, "the communicator");
  c.layout(arg, t);
  if (m.device.type == DeviceType::cuda) c.aligned16(arg, t);
}

void check_tokens(const detail::Checker& c, const char* arg, int64_t T, const CommRef& m) {
  if (T < 1) c.fail(arg, "holds T = " + num(T) + " tokens: T must be >= 1");
  if (T > m.capacity)
    c.fail(arg, "holds T = " + num(T) + " tokens, above the communicator's capacity of " + num(m.capacity) +
                    " (allocate it with a larger capacity)");
}

// The CPU backend's input: every rank's partial, [W, T, D].
void check_gathered(const detail::Checker& c, const TensorRef& g, const CommRef& m, int64_t T) {
  if (g.ndim != 3) c.fail("gathered", "must be a 3-D [W, T, D] tensor, got " + num(g.ndim) + " dimensions");
  if (g.shape[0] != m.world_size)
    c.fail("gathered", "holds " + num(g.shape[0]) + " partials but the world has " + num(m.world_size) + " ranks");
  if (g.shape[1] != T || g.shape[2] != m.width)
    c.fail("gathered", "must have shape [W, T, D] = [" + num(m.world_size) + ", " + num(T) + ", " + num(m.width) +
                           "], got " + g.shape_string());
  c.dtype("gathered", g, DType::bf16);
  c.device("gathered", g, m.device, "the communicator");
  c.layout("gathered", g);
}

void check_exchange(const detail::Checker& c, const TensorRef& input, const TensorRef& gathered, const CommRef& m,
                    int64_t T) {
  if (m.device.type == DeviceType::cuda) {
    if (gathered.present()) c.fail("gathered", "is an input of the CPU backend only (CUDA exchanges the partials)");
  } else {
    if (!gathered.present()) c.fail("gathered", "is required on the CPU (every rank's partial, gathered)");
    check_gathered(c, gathered, m, T);
  }
  (void)input;
}

}  // namespace

void validate_all_reduce(const AllReduceArgs& a, bool require_output) {
  const detail::Checker c("all_reduce");
  check_comm(c, a.comm);
  const bool cuda = a.comm.device.type == DeviceType::cuda;
  const TensorRef& shape_source = cuda ? a.input : a.gathered;
  if (cuda && !a.input.present()) c.fail("input", "is required");
  if (!cuda && !a.gathered.present()) c.fail("gathered", "is required on the CPU (every rank's partial, gathered)");
  const int64_t T = shape_source.ndim >= 2 ? shape_source.shape[shape_source.ndim - 2] : 0;
  check_tokens(c, cuda ? "input" : "gathered", T, a.comm);
  if (a.input.present()) check_rows(c, "input", a.input, a.comm, T);
  check_exchange(c, a.input, a.gathered, a.comm, T);
  if (require_output && !a.output.present()) c.fail("output", "is required");
  if (a.output.present()) {
    check_rows(c, "output", a.output, a.comm, T);
    if (a.input.present() && detail::overlaps(a.output, a.input)) c.fail("output", "overlaps input");
    if (a.gathered.present() && detail::overlaps(a.output, a.gathered)) c.fail("output", "overlaps gathered");
  }
}

void validate_moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& a, bool require_output, bool read_data) {
  const detail::Checker c("moe_finalize_all_reduce");
  const MoeFinalizeArgs& f = a.finalize;
  if (f.shared.present()) c.fail("shared", "is not an argument of this op (add it after the all-reduce)");
  if (!f.norm_weight.present()) c.fail("norm_weight", "is required (the latent RMSNorm follows the all-reduce)");
  validate_moe_finalize(f, require_output, read_data);  // the finalize triple's own rules, "moe_finalize: ..." messages
  check_comm(c, a.comm);
  const int64_t T = f.index.shape[0];
  check_tokens(c, "index", T, a.comm);
  if (f.rows.shape[1] != a.comm.width)
    c.fail("rows", "have D = " + num(f.rows.shape[1]) + " but the communicator's width is " + num(a.comm.width));
  c.device("rows", f.rows, a.comm.device, "the communicator");
  check_exchange(c, f.rows, a.gathered, a.comm, T);
  if (a.reduced.present()) {
    check_rows(c, "reduced", a.reduced, a.comm, T);
    for (const TensorRef* in : {&f.rows, &f.weights, &f.index, &f.norm_weight, &f.output})
      if (in->present() && detail::overlaps(a.reduced, *in)) c.fail("reduced", "overlaps another argument");
  }
  if (a.gathered.present() && f.output.present() && detail::overlaps(f.output, a.gathered))
    c.fail("output", "overlaps gathered");
}

}  // namespace attnres
