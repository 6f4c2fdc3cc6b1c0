// Preconditions of all_reduce and of the ops fused with it, checked for every backend before anything runs.
// Messages: "<op>: <argument> <rule>".
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "attnres/all_reduce.hpp"
#include "attnres/error.hpp"
#include "backend.hpp"
#include "checks.hpp"
#include "layout.hpp"

namespace attnres {

namespace {

std::string num(int64_t v) { return std::to_string(v); }

void check_comm_fields(const detail::Checker& c, const CommRef& m) {
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

// ------------------------------------------------------------------------------------------- the registry
struct Registered {
  CommRef comm;
  TensorRef state;
};

std::mutex registry_mutex;
std::map<int64_t, Registered> registry;  // guarded by registry_mutex
int64_t next_handle = 1;                 // guarded by registry_mutex; never reused

bool same_comm(const CommRef& a, const CommRef& b) {
  if (a.world_size != b.world_size || a.rank != b.rank || a.capacity != b.capacity || a.width != b.width ||
      a.device != b.device || a.state != b.state || a.timeout_ns != b.timeout_ns)
    return false;
  for (int r = 0; r < kAllReduceMaxWorld; ++r)
    if (a.buffers[r] != b.buffers[r]) return false;
  return true;
}

bool registered(const CommRef& m) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  for (const auto& [handle, rec] : registry)
    if (same_comm(rec.comm, m)) return true;
  return false;
}

// Every rule, the registry's included: on CUDA the kernels dereference the buffers and the state.
void check_comm(const detail::Checker& c, const CommRef& m) {
  check_comm_fields(c, m);
  if (m.device.type == DeviceType::cuda && !registered(m))
    c.fail("comm", "is not a registered communicator (register_communicator; attnres.comm.Communicator): the "
                   "kernels write only buffers and state the library has recorded");
}

void check_state(const detail::Checker& c, const TensorRef& s, Device device) {
  if (!s.present()) c.fail("state", "is required (the communicator's state tensor)");
  c.dtype("state", s, DType::i32);
  if (s.ndim != 1 || s.shape[0] != kAllReduceStateWords || s.strides[0] != 1)
    c.fail("state", "must be the communicator's int32 [" + num(kAllReduceStateWords) +
                        "] state tensor (stride 1), got shape " + s.shape_string() + " strides " + s.strides_string());
  c.device("state", s, device, "the communicator");
  if (s.data == nullptr) c.fail("state", "has a null data pointer");
}

// CPU, read_data: the sum must be of what this rank passed, so its own entry of `gathered` is `partial`'s bits.
void check_own_partial(const detail::Checker& c, const char* arg, const TensorRef& partial, const TensorRef& g,
                       int32_t rank) {
  const int64_t T = g.shape[1], D = g.shape[2];
  const auto* own = static_cast<const uint16_t*>(g.data) + rank * g.strides[0];
  const auto* mine = static_cast<const uint16_t*>(partial.data);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d)
      if (own[t * g.strides[1] + d * g.strides[2]] != mine[t * partial.strides[0] + d * partial.strides[1]])
        c.fail("gathered", "[rank = " + num(rank) + "] differs from " + arg + " at [" + num(t) + ", " + num(d) +
                               "]: a rank's own entry of the gathered partials must be the " + arg + " it passes");
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

int64_t register_communicator(const CommRef& m, const TensorRef& state, int64_t region_bytes) {
  const detail::Checker c("register_communicator");
  check_comm_fields(c, m);
  check_state(c, state, m.device);
  if (reinterpret_cast<uintptr_t>(state.data) != m.state)
    c.fail("state", "is not at comm.state (the CommRef must name its own state tensor)");
  if (m.device.type == DeviceType::cuda) {
    int64_t expected = int64_t{kAllReduceSlots} * m.world_size * 2, rows = 0;  // bytes per (capacity + 1) x width
    if (__builtin_add_overflow(m.capacity, kAllReduceHeaderRows, &rows) ||
        __builtin_mul_overflow(expected, rows, &expected) || __builtin_mul_overflow(expected, m.width, &expected))
      c.fail("comm.capacity", "makes a region larger than int64 bytes, got " + num(m.capacity));
    if (region_bytes != expected)
      c.fail("region_bytes", "must be 3 x W x (capacity + 1) x width x 2 = " + num(expected) + ", got " +
                                 num(region_bytes));
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;
    spans.emplace_back(m.state, m.state + kAllReduceStateWords * 4);
    for (int r = 0; r < m.world_size; ++r) {
      uintptr_t end = 0;
      if (__builtin_add_overflow(m.buffers[r], static_cast<uintptr_t>(region_bytes), &end))
        c.fail("comm.buffers", "region of rank " + num(r) + " wraps the address space");
      spans.emplace_back(m.buffers[r], end);
    }
    for (size_t i = 0; i < spans.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (spans[i].first < spans[j].second && spans[j].first < spans[i].second)
          c.fail("comm.buffers", "regions overlap each other or the state");
  } else {
    for (int r = 0; r < kAllReduceMaxWorld; ++r)
      if (m.buffers[r] != 0) c.fail("comm.buffers", "must be empty on the CPU (it exchanges no regions)");
    if (region_bytes != 0) c.fail("region_bytes", "must be 0 on the CPU, got " + num(region_bytes));
  }
  const std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t handle = next_handle++;
  registry[handle] = Registered{m, state};
  return handle;
}

void unregister_communicator(int64_t handle) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(handle);
}

CommRef registered_communicator(const std::string& op, int64_t handle, const TensorRef& state, bool check_address) {
  const detail::Checker c(op);
  Registered rec;
  {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    const auto it = registry.find(handle);
    if (it == registry.end())
      c.fail("comm", "handle " + num(handle) + " names no open communicator of this process (never created, or "
                     "closed)");
    rec = it->second;
  }
  check_state(c, state, rec.comm.device);
  // On CUDA the kernels keep the protocol's generation in the state: it must be the communicator's own. The CPU
  // backend never touches it, so there a tensor of the state's shape serves (torch.library.opcheck clones it).
  if (check_address && rec.comm.device.type == DeviceType::cuda && state.data != rec.state.data)
    c.fail("state", "is not the state tensor of the communicator with handle " + num(handle));
  return rec.comm;
}

void validate_all_reduce(const AllReduceArgs& a, bool require_output, bool read_data) {
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
  if (read_data && !cuda && a.input.present()) check_own_partial(c, "input", a.input, a.gathered, a.comm.rank);
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
  if (read_data && a.comm.device.type == DeviceType::cpu) {
    // This rank's partial, as the CPU backend's caller computed it: the finalize without shared and norm.
    std::vector<uint16_t> partial(static_cast<size_t>(T * a.comm.width));
    MoeFinalizeArgs local = f;
    local.norm_weight = TensorRef{};
    local.output = make_ref(partial.data(), DType::bf16, Device{}, {T, a.comm.width});
    detail::cpu_moe_finalize(local);
    check_own_partial(c, "this rank's local-route partial", local.output, a.gathered, a.comm.rank);
  }
}

}  // namespace attnres
