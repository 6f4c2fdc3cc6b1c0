// One test per precondition of cpp/src/all_reduce_validate.cpp that C++ sees (the communicator's world, rank,
// capacity, width, timeout, buffers and state; every tensor's T, D, dtype, rank and overlap; the CPU backend's
// gathered partials): the exact message, and nothing written. A closed communicator is the Python object's
// state; C++ sees its equivalent, a CommRef without buffers or state. Cases start from a valid CPU call with a
// poisoned output, break one rule, and compare the output's bytes afterwards. The CUDA-communicator cases
// (buffers, state, gathered refused) are validation only: no pointer is dereferenced, no GPU is needed.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "attnres/all_reduce.hpp"
#include "attnres/error.hpp"

namespace attnres_test {
namespace {

using namespace attnres;

constexpr int64_t kT = 2, kD = 64, kW = 2, kCapacity = 4;
constexpr uint16_t kPoison = 0x7fc1;  // a NaN no reduction of the inputs can produce

// The communicator of every case: kW ranks, this process rank 0, kCapacity tokens of width kD, on the CPU.
CommRef base_comm() {
  CommRef m;
  m.world_size = kW;
  m.rank = 0;
  m.capacity = kCapacity;
  m.width = kD;
  return m;
}

// `call` throws ArgumentError with exactly `message`.
void expect_argument_error(const std::function<void()>& call, const std::string& message) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected: " << message;
  } catch (const ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

struct Call {
  std::vector<uint16_t> gathered = std::vector<uint16_t>(kW * kT * kD, 0x3f80);  // 1.0
  std::vector<uint16_t> output = std::vector<uint16_t>(4 * kT * kD, kPoison);    // room for larger views
  std::vector<float> gathered_f32 = std::vector<float>(kW * kT * kD, 1.0f);
  AllReduceArgs args;

  Call() {
    args.comm = base_comm();
    args.gathered = make_ref(gathered.data(), DType::bf16, Device{}, {kW, kT, kD});
    args.output = make_ref(output.data(), DType::bf16, Device{}, {kT, kD});
  }
  bool output_untouched() const {
    for (uint16_t v : output)
      if (v != kPoison) return false;
    return true;
  }
};

void expect_rejected(const std::function<void(Call&)>& mutate, const std::string& message) {
  Call call;
  mutate(call);
  expect_argument_error([&] { all_reduce(call.args); }, message);
  EXPECT_TRUE(call.output_untouched()) << message;
}

TEST(AllReduceRejections, ValidCallRuns) {
  Call call;
  all_reduce(call.args);
  for (int64_t i = 0; i < kT * kD; ++i) ASSERT_EQ(call.output[i], 0x4000) << i;  // 1 + 1 = 2.0
  for (int64_t i = kT * kD; i < 4 * kT * kD; ++i) ASSERT_EQ(call.output[i], kPoison) << i;
}

TEST(AllReduceRejections, WorldSize) {
  expect_rejected([](Call& c) { c.args.comm.world_size = 0; }, "all_reduce: comm.world_size must be in [1, 8], got 0");
  expect_rejected([](Call& c) { c.args.comm.world_size = 9; }, "all_reduce: comm.world_size must be in [1, 8], got 9");
}

TEST(AllReduceRejections, Rank) {
  expect_rejected([](Call& c) { c.args.comm.rank = 2; }, "all_reduce: comm.rank must be in [0, world_size = 2), got 2");
  expect_rejected([](Call& c) { c.args.comm.rank = -1; }, "all_reduce: comm.rank must be in [0, world_size = 2), got -1");
}

TEST(AllReduceRejections, CapacityAndTokens) {
  expect_rejected([](Call& c) { c.args.comm.capacity = 0; }, "all_reduce: comm.capacity must be >= 1 token, got 0");
  expect_rejected([](Call& c) { c.args.comm.capacity = 1; },
                  "all_reduce: gathered holds T = 2 tokens, above the communicator's capacity of 1 (allocate it "
                  "with a larger capacity)");
  expect_rejected([](Call& c) { c.args.gathered = make_ref(c.gathered.data(), DType::bf16, Device{}, {kW, 0, kD}); },
                  "all_reduce: gathered holds T = 0 tokens: T must be >= 1");
}

TEST(AllReduceRejections, Width) {
  for (int64_t w : {0, 12, 16392})
    expect_rejected([w](Call& c) { c.args.comm.width = w; },
                    "all_reduce: comm.width must be a multiple of 8 in [8, 16384], got " + std::to_string(w));
}

TEST(AllReduceRejections, Timeout) {
  expect_rejected([](Call& c) { c.args.comm.timeout_ns = 0; }, "all_reduce: comm.timeout_ns must be >= 1, got 0");
}

TEST(AllReduceRejections, Gathered) {
  expect_rejected([](Call& c) { c.args.gathered = TensorRef{}; },
                  "all_reduce: gathered is required on the CPU (every rank's partial, gathered)");
  expect_rejected([](Call& c) { c.args.gathered = make_ref(c.gathered.data(), DType::bf16, Device{}, {1, kT, kD}); },
                  "all_reduce: gathered holds 1 partials but the world has 2 ranks");
  expect_rejected([](Call& c) { c.args.gathered = make_ref(c.gathered.data(), DType::bf16, Device{}, {kW, kT, 32}); },
                  "all_reduce: gathered must have shape [W, T, D] = [2, 2, 64], got [2, 2, 32]");
  expect_rejected([](Call& c) { c.args.gathered = make_ref(c.gathered.data(), DType::bf16, Device{}, {kW * kT, kD}); },
                  "all_reduce: gathered must be a 3-D [W, T, D] tensor, got 2 dimensions");
  expect_rejected(
      [](Call& c) { c.args.gathered = make_ref(c.gathered_f32.data(), DType::f32, Device{}, {kW, kT, kD}); },
      "all_reduce: gathered must be bfloat16, got float32");
}

TEST(AllReduceRejections, Output) {
  expect_rejected([](Call& c) { c.args.output = TensorRef{}; }, "all_reduce: output is required");
  expect_rejected([](Call& c) { c.args.output = make_ref(c.output.data(), DType::bf16, Device{}, {3, kD}); },
                  "all_reduce: output must have T = 2 rows, got [3, 64]");
  expect_rejected([](Call& c) { c.args.output = make_ref(c.output.data(), DType::bf16, Device{}, {kT, 32}); },
                  "all_reduce: output has D = 32 but the communicator's width is 64");
  expect_rejected([](Call& c) { c.args.output = make_ref(c.output.data(), DType::bf16, Device{}, {kT * kD}); },
                  "all_reduce: output must be a 2-D [T, D] tensor, got 1 dimensions [128]");
  expect_rejected([](Call& c) { c.args.output = make_ref(c.gathered.data(), DType::bf16, Device{}, {kT, kD}); },
                  "all_reduce: output overlaps gathered");
  expect_rejected(
      [](Call& c) {
        c.args.input = make_ref(c.output.data() + kT * kD, DType::bf16, Device{}, {kT, kD});
        c.args.output = make_ref(c.output.data() + kT * kD, DType::bf16, Device{}, {kT, kD});
      },
      "all_reduce: output overlaps input");
}

// A CUDA communicator (validation only: the addresses are never dereferenced), registered as
// attnres.comm.Communicator registers its own: the library launches only on registered communicators.
constexpr int64_t kRegionBytes = 3 * kW * (kCapacity + 1) * kD * 2;

TensorRef cuda_state() {
  return make_ref(reinterpret_cast<void*>(0x30000), DType::i32, Device{DeviceType::cuda, 0}, {kAllReduceStateWords});
}

CommRef registered_cuda_comm() {
  CommRef m = base_comm();
  m.device = Device{DeviceType::cuda, 0};
  m.buffers[0] = 0x100000;
  m.buffers[1] = 0x200000;
  m.state = 0x30000;
  static const int64_t handle = register_communicator(m, cuda_state(), kRegionBytes);
  (void)handle;
  return m;
}

void cuda_comm(Call& c) {
  c.args.comm = registered_cuda_comm();
  c.args.gathered = TensorRef{};
  c.args.input = make_ref(reinterpret_cast<void*>(0x40000), DType::bf16, c.args.comm.device, {kT, kD});
  c.args.output = make_ref(reinterpret_cast<void*>(0x50000), DType::bf16, c.args.comm.device, {kT, kD});
}

void expect_cuda_rejected(const std::function<void(Call&)>& mutate, const std::string& message) {
  Call call;
  cuda_comm(call);
  mutate(call);
  expect_argument_error([&] { validate_all_reduce(call.args); }, message);
}

TEST(AllReduceRejections, CudaCommunicatorBuffersAndState) {
  {
    Call call;
    cuda_comm(call);
    EXPECT_NO_THROW(validate_all_reduce(call.args));  // the base case is valid
  }
  // A closed communicator's equivalent in C++: no buffers, no state.
  expect_cuda_rejected([](Call& c) { c.args.comm.buffers[1] = 0; }, "all_reduce: comm.buffers has no buffer for rank 1");
  expect_cuda_rejected([](Call& c) { c.args.comm.buffers[0] = 0x100008; },
                       "all_reduce: comm.buffers buffer of rank 0 is not 16-byte aligned");
  expect_cuda_rejected([](Call& c) { c.args.comm.state = 0; }, "all_reduce: comm.state is required on CUDA");
  expect_cuda_rejected([](Call& c) { c.args.comm.state = 0x30004; }, "all_reduce: comm.state must be 16-byte aligned");
}

TEST(AllReduceRejections, CudaInputs) {
  expect_cuda_rejected([](Call& c) { c.args.input = TensorRef{}; }, "all_reduce: input is required");
  expect_cuda_rejected(
      [](Call& c) {
        c.args.gathered = make_ref(reinterpret_cast<void*>(0x60000), DType::bf16, c.args.comm.device, {kW, kT, kD});
      },
      "all_reduce: gathered is an input of the CPU backend only (CUDA exchanges the partials)");
  expect_cuda_rejected(
      [](Call& c) {
        c.args.input = make_ref(reinterpret_cast<void*>(0x40000), DType::bf16, c.args.comm.device, {5, kD});
      },
      "all_reduce: input holds T = 5 tokens, above the communicator's capacity of 4 (allocate it with a larger "
      "capacity)");
  expect_cuda_rejected(
      [](Call& c) {
        c.args.input = make_ref(reinterpret_cast<void*>(0x40000), DType::bf16, c.args.comm.device, {kT, 32});
      },
      "all_reduce: input has D = 32 but the communicator's width is 64");
}

// The shared layout and device rules (checks.hpp) as the CPU backend's gathered partials meet them.
TEST(AllReduceRejections, GatheredLayoutAndDevice) {
  expect_rejected(
      [](Call& c) {
        c.args.gathered = make_ref(c.gathered.data() + kD, DType::bf16, Device{}, {kW, kT, kD}, {kT * kD, -kD, 1});
      },
      "all_reduce: gathered has a negative stride [128, -64, 1]");
  expect_rejected(
      [](Call& c) {
        c.gathered.resize(2 * kW * kT * kD, 0x3f80);
        c.args.gathered = make_ref(c.gathered.data(), DType::bf16, Device{}, {kW, kT, kD}, {2 * kT * kD, 2 * kD, 2});
      },
      "all_reduce: gathered must have a contiguous last dimension (stride 1), got strides [256, 128, 2]");
  expect_rejected(
      [](Call& c) {
        c.args.gathered = make_ref(c.gathered.data(), DType::bf16, Device{}, {kW, kT, kD}, {0, kD, 1});
      },
      "all_reduce: gathered has an overlapping layout (shape [2, 2, 64], strides [0, 64, 1]): every element must "
      "have its own address");
  expect_rejected([](Call& c) { c.args.gathered = make_ref(nullptr, DType::bf16, Device{}, {kW, kT, kD}); },
                  "all_reduce: gathered has a null data pointer");
  expect_rejected(
      [](Call& c) {
        c.args.gathered =
            make_ref(reinterpret_cast<void*>(0x60000), DType::bf16, Device{DeviceType::cuda, 0}, {kW, kT, kD});
      },
      "all_reduce: gathered is on cuda:0 but the communicator is on cpu (all tensors must be on one device)");
}

// moe_finalize_all_reduce's own rules (the finalize triple's are moe_finalize's, tested in test_moe_finalize.cpp):
// a valid CPU call over kW ranks with k = 2 routes per token, then one rule broken at a time.
struct MoeCall {
  static constexpr int64_t kRows = 4, kK = 2;
  std::vector<uint16_t> rows = std::vector<uint16_t>(kRows * kD, 0x3f80);
  std::vector<float> weights = std::vector<float>(kT * kK, 0.5f);
  std::vector<int32_t> index = {0, 1, 2, 3};
  std::vector<uint16_t> norm_weight = std::vector<uint16_t>(kD, 0x3f80);
  std::vector<uint16_t> gathered = std::vector<uint16_t>(kW * kT * kD, 0x3f80);
  std::vector<uint16_t> output = std::vector<uint16_t>(kT * kD, kPoison);
  std::vector<uint16_t> reduced = std::vector<uint16_t>(kT * kD, kPoison);
  MoeFinalizeAllReduceArgs args;

  MoeCall() {
    args.comm = base_comm();
    MoeFinalizeArgs& f = args.finalize;
    f.rows = make_ref(rows.data(), DType::bf16, Device{}, {kRows, kD});
    f.weights = make_ref(weights.data(), DType::f32, Device{}, {kT, kK});
    f.index = make_ref(index.data(), DType::i32, Device{}, {kT, kK});
    f.norm_weight = make_ref(norm_weight.data(), DType::bf16, Device{}, {kD});
    f.output = make_ref(output.data(), DType::bf16, Device{}, {kT, kD});
    args.gathered = make_ref(gathered.data(), DType::bf16, Device{}, {kW, kT, kD});
    args.reduced = make_ref(reduced.data(), DType::bf16, Device{}, {kT, kD});
  }
};

void expect_moe_rejected(const std::function<void(MoeCall&)>& mutate, const std::string& message) {
  MoeCall call;
  mutate(call);
  expect_argument_error([&] { moe_finalize_all_reduce(call.args); }, message);
  for (uint16_t v : call.output) ASSERT_EQ(v, kPoison) << message;
}

TEST(AllReduceRejections, MoeFinalizeAllReduceArguments) {
  {
    MoeCall call;
    EXPECT_NO_THROW(moe_finalize_all_reduce(call.args));  // the base case is valid
  }
  std::vector<uint16_t> shared(kT * kD, 0x3f80);
  expect_moe_rejected(
      [&](MoeCall& c) { c.args.finalize.shared = make_ref(shared.data(), DType::bf16, Device{}, {kT, kD}); },
      "moe_finalize_all_reduce: shared is not an argument of this op (add it after the all-reduce)");
  expect_moe_rejected([](MoeCall& c) { c.args.finalize.norm_weight = TensorRef{}; },
                      "moe_finalize_all_reduce: norm_weight is required (the latent RMSNorm follows the all-reduce)");
  expect_moe_rejected([](MoeCall& c) { c.args.comm.width = 2 * kD; },
                      "moe_finalize_all_reduce: rows have D = 64 but the communicator's width is 128");
  expect_moe_rejected([](MoeCall& c) { c.args.reduced = c.args.finalize.output; },
                      "moe_finalize_all_reduce: reduced overlaps another argument");
  expect_moe_rejected(
      [](MoeCall& c) {  // a valid, registered CUDA communicator (validation stops before any address is used)
        c.args.comm = registered_cuda_comm();
      },
                      "moe_finalize_all_reduce: rows is on cpu but the communicator is on cuda:0 (all tensors must "
                      "be on one device)");
}

// Forged addresses: a CommRef that differs from every registered one in any address or field is refused.
TEST(AllReduceRejections, UnregisteredCudaCommunicator) {
  const std::string msg = "all_reduce: comm is not a registered communicator (register_communicator; "
                          "attnres.comm.Communicator): the kernels write only buffers and state the library has recorded";
  expect_cuda_rejected([](Call& c) { c.args.comm.buffers[1] = 0x300000; }, msg);
  expect_cuda_rejected([](Call& c) { c.args.comm.state = 0x40010; }, msg);
  expect_cuda_rejected([](Call& c) { c.args.comm.capacity = 3; }, msg);
  expect_cuda_rejected([](Call& c) { c.args.comm.rank = 1; }, msg);
}

// Another CUDA communicator's record (regions and state apart from registered_cuda_comm's, not registered yet)
// and its state tensor.
std::pair<CommRef, TensorRef> second_cuda_comm() {
  CommRef m = registered_cuda_comm();
  m.buffers[0] = 0x1000000;
  m.buffers[1] = 0x2000000;
  m.state = 0x50000;
  const TensorRef state =
      make_ref(reinterpret_cast<void*>(0x50000), DType::i32, Device{DeviceType::cuda, 0}, {kAllReduceStateWords});
  return {m, state};
}

TEST(AllReduceRejections, RegistryLookup) {
  const auto [m, state] = second_cuda_comm();
  const int64_t h = register_communicator(m, state, kRegionBytes);
  EXPECT_EQ(registered_communicator("op", h, state).state, m.state);
  auto rejected = [&](int64_t handle, const TensorRef& s, const std::string& message) {
    expect_argument_error([&] { registered_communicator("op", handle, s); }, message);
  };
  rejected(h + 1000, state, "op: comm handle " + std::to_string(h + 1000) +
                                " names no open communicator of this process (never created, or closed)");
  TensorRef one = state;
  one.shape[0] = 1;  // the one-element state that let the kernel write 12 words out of bounds
  rejected(h, one, "op: state must be the communicator's int32 [12] state tensor (stride 1), got shape [1] strides [1]");
  expect_argument_error([&] { registered_communicator("all_reduce", h, TensorRef{}); },
                        "all_reduce: state is required (the communicator's state tensor)");
  TensorRef f32 = state;
  f32.dtype = DType::f32;
  rejected(h, f32, "op: state must be int32, got float32");
  TensorRef cpu = state;
  cpu.device = Device{};
  rejected(h, cpu, "op: state is on cpu but the communicator is on cuda:0 (all tensors must be on one device)");
  TensorRef other = state;
  other.data = reinterpret_cast<void*>(0x60000);
  rejected(h, other, "op: state is not the state tensor of the communicator with handle " + std::to_string(h));
  unregister_communicator(h);
  rejected(h, state, "op: comm handle " + std::to_string(h) +
                         " names no open communicator of this process (never created, or closed)");
}

// Registration checks what it can without reading memory: the regions' size, that they are disjoint and do not
// wrap, the state tensor named by the CommRef, empty regions on the CPU.
TEST(AllReduceRejections, RegistrationRules) {
  const auto [m, state] = second_cuda_comm();
  auto rejected = [&](const CommRef& comm, const TensorRef& s, int64_t bytes, const std::string& message) {
    expect_argument_error([&] { register_communicator(comm, s, bytes); }, message);
  };
  rejected(m, state, kRegionBytes + 2,
           "register_communicator: region_bytes must be 3 x W x (capacity + 1) x width x 2 = " +
               std::to_string(kRegionBytes) + ", got " + std::to_string(kRegionBytes + 2));
  CommRef overlapping = m;
  overlapping.buffers[1] = m.buffers[0] + 16;
  rejected(overlapping, state, kRegionBytes, "register_communicator: comm.buffers regions overlap each other or the state");
  CommRef on_state = m;
  on_state.buffers[1] = 0x50000 - 16;
  rejected(on_state, state, kRegionBytes, "register_communicator: comm.buffers regions overlap each other or the state");
  CommRef wrapping = m;
  wrapping.buffers[1] = UINTPTR_MAX - 0xff;
  rejected(wrapping, state, kRegionBytes, "register_communicator: comm.buffers region of rank 1 wraps the address space");
  CommRef huge = m;
  huge.capacity = int64_t{1} << 60;
  rejected(huge, state, kRegionBytes,
           "register_communicator: comm.capacity makes a region larger than int64 bytes, got 1152921504606846976");
  CommRef elsewhere = m;
  elsewhere.state = 0x70000;
  rejected(elsewhere, state, kRegionBytes,
           "register_communicator: state is not at comm.state (the CommRef must name its own state tensor)");
  TensorRef one = state;
  one.shape[0] = 1;
  rejected(m, one, kRegionBytes,
           "register_communicator: state must be the communicator's int32 [12] state tensor (stride 1), got shape [1] "
           "strides [1]");
  CommRef unaligned = m;
  unaligned.buffers[0] += 8;
  rejected(unaligned, state, kRegionBytes, "register_communicator: comm.buffers buffer of rank 0 is not 16-byte aligned");
  CommRef cpu = m;
  cpu.device = Device{};
  TensorRef cpu_state = state;
  cpu_state.device = Device{};
  rejected(cpu, cpu_state, 0, "register_communicator: comm.buffers must be empty on the CPU (it exchanges no regions)");
  for (int r = 0; r < kAllReduceMaxWorld; ++r) cpu.buffers[r] = 0;
  rejected(cpu, cpu_state, 64, "register_communicator: region_bytes must be 0 on the CPU, got 64");
  TensorRef null_state = cpu_state;
  null_state.data = nullptr;
  cpu.state = 0;
  rejected(cpu, null_state, 0, "register_communicator: state has a null data pointer");
  cpu.state = 0x50000;  // a valid CPU record (no regions) registers
  const int64_t h = register_communicator(cpu, cpu_state, 0);
  EXPECT_GE(h, 1);
  unregister_communicator(h);
}

}  // namespace
}  // namespace attnres_test
