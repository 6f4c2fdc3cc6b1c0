// One test per precondition of cpp/src/validate.cpp (and per plan decline): the exact message, and nothing
// written. Every case starts from a valid call with poisoned outputs, breaks one rule, and compares the
// storage of every buffer (inputs, outputs, bank rows past K, padding) byte for byte afterwards.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "plan_tuning.hpp"
#include "test_util.hpp"

namespace attnres_test {
namespace {

using attnres::Fp8Scales;
using attnres::Topology;

// T = 2, K = 2 (N = 3), H = 64 for every op, with every optional output the op takes.
Config base_config(AttnResOp op) {
  Config cfg;
  cfg.op = op;
  cfg.T = 2;
  cfg.K = 2;
  cfg.H = 64;
  cfg.add = op == A || op == P;
  cfg.add2 = op == A;
  cfg.tap = op == N || op == A;
  cfg.diagnostics = op == R;
  cfg.bank_rows = 3;  // room for the snapshot row
  cfg.snapshot_slot = op == A ? 2 : -1;
  return cfg;
}

using Mutation = std::function<void(AttnResArgs&, Case&)>;

struct Rejection {
  const char* name;
  AttnResOp op;
  Mutation mutate;
  std::string message;  // the message starts with this (op, argument, rule)
};

void PrintTo(const Rejection& r, std::ostream* os) { *os << r.name; }

// The bf16/fp32 tensor arguments of a call, by the names the messages use (the FP8 output's are not here).
std::vector<std::pair<std::string, TensorRef*>> named_refs(AttnResArgs& a) {
  return {{"layer_residual", &a.layer_residual}, {"layer_residual_add", &a.layer_residual_add},
          {"layer_residual_add2", &a.layer_residual_add2}, {"block_residual", &a.block_residual},
          {"res_weight", &a.res_weight}, {"rms_weight", &a.rms_weight}, {"norm_weight", &a.norm_weight},
          {"output", &a.output}, {"updated", &a.updated}, {"mixture", &a.mixture}, {"rsigma", &a.rsigma},
          {"probs", &a.probs}, {"logits", &a.logits}};
}

TensorRef* ref_named(AttnResArgs& a, const std::string& name) {
  for (const auto& [n, t] : named_refs(a))
    if (n == name) return t;
  throw std::logic_error("no argument " + name);
}

char* bytes(const TensorRef& t) { return static_cast<char*>(t.data); }

std::string op_prefix(AttnResOp op) { return std::string(attnres::op_name(op)) + ": "; }

// Builders for the table: each returns a Rejection whose message is "<op>: <text>".
Rejection reject(const char* name, AttnResOp op, Mutation m, const std::string& text) {
  return {name, op, std::move(m), op_prefix(op) + text};
}
Rejection set_shape(const char* name, AttnResOp op, const std::string& arg, std::vector<int64_t> shape,
                    const std::string& text) {
  return reject(name, op, [arg, shape](AttnResArgs& a, Case&) {
    TensorRef* t = ref_named(a, arg);
    t->ndim = static_cast<int32_t>(shape.size());
    int64_t stride = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {  // a dense view of the new shape
      t->shape[d] = shape[size_t(d)];
      t->strides[d] = stride;
      stride *= shape[size_t(d)];
    }
  }, arg + " " + text);
}
Rejection set_dtype(const char* name, AttnResOp op, const std::string& arg, DType dtype, const std::string& text) {
  return reject(name, op, [arg, dtype](AttnResArgs& a, Case&) { ref_named(a, arg)->dtype = dtype; }, arg + " " + text);
}
Rejection set_device(const char* name, AttnResOp op, const std::string& arg, Device dev, const std::string& text) {
  return reject(name, op, [arg, dev](AttnResArgs& a, Case&) { ref_named(a, arg)->device = dev; }, arg + " " + text);
}
Rejection set_strides(const char* name, AttnResOp op, const std::string& arg, std::vector<int64_t> strides,
                      const std::string& text) {
  return reject(name, op, [arg, strides](AttnResArgs& a, Case&) {
    TensorRef* t = ref_named(a, arg);
    for (size_t d = 0; d < strides.size(); ++d) t->strides[d] = strides[d];
  }, arg + " " + text);
}
Rejection add_arg(const char* name, AttnResOp op, const std::string& arg, const std::string& text) {
  return reject(name, op, [arg](AttnResArgs& a, Case& c) {
    Buffer* b = arg == "layer_residual_add" ? &c.add : arg == "layer_residual_add2" ? &c.add2
              : arg == "norm_weight" ? &c.norm_weight : arg == "updated" ? &c.updated
              : arg == "mixture" ? &c.mixture : arg == "rsigma" ? &c.rsigma : arg == "probs" ? &c.probs : &c.logits;
    *ref_named(a, arg) = b->ref();
  }, arg + " " + text);
}
Rejection drop_arg(const char* name, AttnResOp op, const std::string& arg, const std::string& text) {
  return reject(name, op, [arg](AttnResArgs& a, Case&) { *ref_named(a, arg) = TensorRef{}; }, text);
}
// `arg` points at `offset_elements` into `target`'s storage (same shape and strides as before).
Rejection alias(const char* name, AttnResOp op, const std::string& arg, const std::string& target,
                int64_t offset_elements, const std::string& text) {
  return reject(name, op, [arg, target, offset_elements](AttnResArgs& a, Case&) {
    TensorRef* t = ref_named(a, arg);
    const TensorRef* into = ref_named(a, target);
    t->data = bytes(*into) + offset_elements * attnres::dtype_size(into->dtype);
  }, arg + " " + text);
}

const Device kCuda1{DeviceType::cuda, 1};
const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

std::vector<Rejection> argument_rejections() {
  const std::string not_arg = "is not an argument of this op";
  const std::string one_device = "(all tensors must be on one device)";
  return {
      // 1. Which arguments each op takes.
      drop_arg("Add2WithoutAdd", A, "layer_residual_add", "layer_residual_add2 requires layer_residual_add"),
      add_arg("AddRefusedByRmsnorm", N, "layer_residual_add", not_arg),
      add_arg("Add2RefusedByPersistent", P, "layer_residual_add2", not_arg),
      add_arg("NormWeightRefusedByAttnRes", R, "norm_weight", not_arg),
      add_arg("UpdatedRefusedByRmsnorm", N, "updated", not_arg),
      add_arg("MixtureRefusedByAttnRes", R, "mixture", not_arg),
      add_arg("MixtureRefusedByPersistent", P, "mixture", not_arg),
      add_arg("RsigmaRefusedByRmsnorm", N, "rsigma", not_arg),
      add_arg("ProbsRefusedByAddRmsnorm", A, "probs", not_arg),
      add_arg("LogitsRefusedByPersistent", P, "logits", not_arg),
      drop_arg("LayerResidualRequired", R, "layer_residual", "layer_residual is required"),
      drop_arg("BlockResidualRequired", N, "block_residual", "block_residual is required"),
      drop_arg("ResWeightRequired", A, "res_weight", "res_weight is required"),
      drop_arg("RmsWeightRequired", P, "rms_weight", "rms_weight is required"),
      drop_arg("NormWeightRequired", N, "norm_weight", "norm_weight is required"),
      drop_arg("OutputRequired", R, "output", "output is required"),
      drop_arg("OutputRequiredWithoutFp8", N, "output", "output is required (only an FP8 call may leave it out"),
      drop_arg("UpdatedRequired", A, "updated", "updated is required"),
      drop_arg("UpdatedRequiredWithPersistentAdd", P, "updated", "updated is required"),
      reject("AddRequired", A, [](AttnResArgs& a, Case&) { a.layer_residual_add = a.layer_residual_add2 = TensorRef{}; },
             "layer_residual_add is required"),
      drop_arg("UpdatedOnlyWithPersistentAdd", P, "layer_residual_add", "updated is only produced with layer_residual_add"),
      // attn_res and attn_res_rmsnorm take snapshot_slot (the row written is layer_residual), with the add op's rules.
      reject("SnapshotSlotIsACandidateRmsnorm", N, [](AttnResArgs& a, Case&) { a.snapshot_slot = 1; },
             "snapshot_slot 1 is a candidate of this call (must be >= K = 2)"),
      reject("SnapshotSlotBelowMinusOneAttnRes", R, [](AttnResArgs& a, Case&) { a.snapshot_slot = -2; },
             "snapshot_slot must be -1 (no snapshot) or a row index >= K, got -2"),
      reject("SnapshotRefusedByPersistent", P, [](AttnResArgs& a, Case&) { a.snapshot_slot = 2; }, "snapshot_slot " + not_arg),

      // 2. Ranks and sizes.
      set_shape("LayerResidualRank", N, "layer_residual", {2, 64, 1}, "must be a 2-D [T, H] tensor, got 3 dimensions [2, 64, 1]"),
      set_shape("ZeroTokens", A, "layer_residual", {0, 64}, "must hold T >= 1 tokens, got shape [0, 64]"),
      set_shape("HiddenNotMultipleOf8", N, "layer_residual", {2, 60}, "hidden size H = 60 must be a multiple of 8 in [8, 16384]"),
      set_shape("HiddenZero", R, "layer_residual", {2, 0}, "hidden size H = 0 must be a multiple of 8 in [8, 16384]"),
      set_shape("HiddenTooLarge", P, "layer_residual", {1, 16392}, "hidden size H = 16392 must be a multiple of 8 in [8, 16384]"),
      set_shape("BankRank", R, "block_residual", {2, 128}, "must be a 3-D [K, T, H] tensor, got 2 dimensions [2, 128]"),
      set_shape("BankTokens", R, "block_residual", {2, 1, 64}, "must have shape [K, T, H] = [*, 2, 64], got [2, 1, 64]"),
      set_shape("BankHidden", N, "block_residual", {2, 2, 56}, "must have shape [K, T, H] = [*, 2, 64], got [2, 2, 56]"),
      set_shape("TooManyCandidates", A, "block_residual", {16, 2, 64}, "holds K = 16 snapshots: N = K + 1 must be in [1, 16]"),
      set_shape("AddShape", A, "layer_residual_add", {1, 64}, "must have shape [T, H] = [2, 64], got [1, 64]"),
      set_shape("Add2Shape", A, "layer_residual_add2", {2, 56}, "must have shape [T, H] = [2, 64], got [2, 56]"),
      set_shape("AddRank", P, "layer_residual_add", {128}, "must be a 2-D [T, H] tensor, got 1 dimensions [128]"),
      set_shape("ResWeightLength", R, "res_weight", {32}, "must have shape [H] = [64], got [32]"),
      set_shape("ResWeightRowLength", R, "res_weight", {1, 32}, "must have shape [1, H] = [1, 64], got [1, 32]"),
      set_shape("ResWeightMatrix", N, "res_weight", {2, 32}, "must be a 1-D [H] tensor, got 2 dimensions [2, 32]"),
      set_shape("RmsWeightLength", A, "rms_weight", {56}, "must have shape [H] = [64], got [56]"),
      set_shape("NormWeightLength", P, "norm_weight", {72}, "must have shape [H] = [64], got [72]"),
      set_shape("OutputShape", N, "output", {2, 56}, "must have shape [T, H] = [2, 64], got [2, 56]"),
      set_shape("UpdatedShape", A, "updated", {1, 64}, "must have shape [T, H] = [2, 64], got [1, 64]"),
      set_shape("MixtureShape", A, "mixture", {2, 32}, "must have shape [T, H] = [2, 64], got [2, 32]"),
      set_shape("RsigmaShape", R, "rsigma", {2, 2}, "must have shape [N, T] = [3, 2], got [2, 2]"),
      set_shape("ProbsShape", R, "probs", {3, 1}, "must have shape [N, T] = [3, 2], got [3, 1]"),
      set_shape("LogitsTransposed", R, "logits", {2, 3}, "must have shape [N, T] = [3, 2], got [2, 3]"),

      // 3. Dtypes.
      set_dtype("LayerResidualDtype", N, "layer_residual", DType::f32, "must be bfloat16, got float32"),
      set_dtype("AddDtype", A, "layer_residual_add", DType::f16, "must be bfloat16, got float16"),
      set_dtype("Add2Dtype", A, "layer_residual_add2", DType::f32, "must be bfloat16, got float32"),
      set_dtype("BankDtype", R, "block_residual", DType::f32, "must be bfloat16, got float32"),
      set_dtype("ResWeightDtype", R, "res_weight", DType::f32, "must be bfloat16, got float32"),
      set_dtype("RmsWeightDtype", P, "rms_weight", DType::f16, "must be bfloat16, got float16"),
      set_dtype("NormWeightDtype", N, "norm_weight", DType::i32, "must be bfloat16, got int32"),
      set_dtype("OutputDtype", A, "output", DType::f32, "must be bfloat16, got float32"),
      set_dtype("UpdatedDtype", P, "updated", DType::f16, "must be bfloat16, got float16"),
      set_dtype("MixtureDtype", N, "mixture", DType::u8, "must be bfloat16, got uint8"),
      set_dtype("RsigmaDtype", R, "rsigma", DType::bf16, "must be float32, got bfloat16"),
      set_dtype("ProbsDtype", R, "probs", DType::f64, "must be float32, got float64"),
      set_dtype("LogitsDtype", R, "logits", DType::other, "must be float32, got an unsupported dtype"),

      // 4. One device.
      set_device("BankOnCuda", R, "block_residual", kCuda0, "is on cuda:0 but layer_residual is on cpu " + one_device),
      set_device("NormWeightOnCuda", N, "norm_weight", kCuda0, "is on cuda:0 but layer_residual is on cpu " + one_device),
      set_device("OutputOnCuda", A, "output", kCuda0, "is on cuda:0 but layer_residual is on cpu " + one_device),
      set_device("RsigmaOnCuda", R, "rsigma", kCuda0, "is on cuda:0 but layer_residual is on cpu " + one_device),
      reject("LayerResidualOnCuda", A, [](AttnResArgs& a, Case&) { a.layer_residual.device = kCuda0; },
             "layer_residual_add is on cpu but layer_residual is on cuda:0 " + one_device),
      reject("TwoCudaDevices", P, [](AttnResArgs& a, Case&) {
        for (TensorRef* t : {&a.layer_residual, &a.layer_residual_add, &a.block_residual, &a.res_weight, &a.rms_weight,
                             &a.norm_weight, &a.output, &a.updated})
          t->device = kCuda0;
        a.updated.device = kCuda1;
      }, "updated is on cuda:1 but layer_residual is on cuda:0 " + one_device),

      // 5. Layouts.
      set_strides("LayerResidualNegativeStride", N, "layer_residual", {-64, 1}, "has a negative stride [-64, 1]"),
      set_strides("BankNegativeStride", A, "block_residual", {128, -64, 1}, "has a negative stride [128, -64, 1]"),
      set_strides("AddLastDimStrided", A, "layer_residual_add", {64, 2},
                  "must have a contiguous last dimension (stride 1), got strides [64, 2]"),
      set_strides("OutputLastDimStrided", R, "output", {128, 2},
                  "must have a contiguous last dimension (stride 1), got strides [128, 2]"),
      set_strides("LayerResidualOverlapping", N, "layer_residual", {0, 1},
                  "has an overlapping layout (shape [2, 64], strides [0, 1]): every element must have its own address"),
      set_strides("BankOverlapping", A, "block_residual", {64, 64, 1},
                  "has an overlapping layout (shape [2, 2, 64], strides [64, 64, 1])"),
      set_strides("OutputOverlapping", R, "output", {32, 1}, "has an overlapping layout (shape [2, 64], strides [32, 1])"),
      set_strides("RsigmaOverlapping", R, "rsigma", {1, 1}, "has an overlapping layout (shape [3, 2], strides [1, 1])"),
      reject("LayerResidualNull", N, [](AttnResArgs& a, Case&) { a.layer_residual.data = nullptr; },
             "layer_residual has a null data pointer"),
      reject("OutputNull", A, [](AttnResArgs& a, Case&) { a.output.data = nullptr; }, "output has a null data pointer"),

      // 6. Scalars.
      reject("RmsEpsNaN", R, [](AttnResArgs& a, Case&) { a.rms_eps = kNaN; }, "rms_eps must be finite and >= 0, got nan"),
      reject("RmsEpsInf", A, [](AttnResArgs& a, Case&) { a.rms_eps = kInf; }, "rms_eps must be finite and >= 0, got inf"),
      reject("RmsEpsNegative", N, [](AttnResArgs& a, Case&) { a.rms_eps = -1e-6; }, "rms_eps must be finite and >= 0, got -1e-06"),
      reject("NormEpsNaN", N, [](AttnResArgs& a, Case&) { a.norm_eps = kNaN; }, "norm_eps must be finite and >= 0, got nan"),
      reject("NormEpsNegative", P, [](AttnResArgs& a, Case&) { a.norm_eps = -1.0; }, "norm_eps must be finite and >= 0, got -1"),
      reject("RmsEpsInfAsFloat32", A, [](AttnResArgs& a, Case&) { a.rms_eps = 1e39; },
             "rms_eps must be finite and >= 0, got 1e+39 (infinite as float32"),
      reject("NormEpsInfAsFloat32", N, [](AttnResArgs& a, Case&) { a.norm_eps = 3.5e38; },
             "norm_eps must be finite and >= 0, got 3.5e+38 (infinite as float32"),

      // 7. The snapshot row.
      reject("SnapshotSlotBelowMinusOne", A, [](AttnResArgs& a, Case&) { a.snapshot_slot = -2; },
             "snapshot_slot must be -1 (no snapshot) or a row index >= K, got -2"),
      reject("SnapshotSlotIsACandidate", A, [](AttnResArgs& a, Case&) { a.snapshot_slot = 1; },
             "snapshot_slot 1 is a candidate of this call (must be >= K = 2)"),
      reject("SnapshotSlotOutOfRange", A, [](AttnResArgs& a, Case&) { a.snapshot_slot = (int64_t{1} << 30) + 1; },
             "snapshot_slot is out of range"),
      reject("SnapshotWithoutBankData", A, [](AttnResArgs& a, Case&) {
        a.block_residual.shape[0] = 0;  // K = 0: an empty bank may have no storage, but then there is no row to write
        a.block_residual.data = nullptr;
        a.snapshot_slot = 0;
      }, "snapshot_slot needs a block_residual data pointer"),
      reject("SnapshotOverlapsCandidates", A, [](AttnResArgs& a, Case&) {
        // Token-major bank [T, 3, H] viewed as [K = 2, T, H]: row 3 is token 1's row 0, a candidate.
        a.block_residual.strides[0] = 64;
        a.block_residual.strides[1] = 192;
        a.snapshot_slot = 3;
      }, "snapshot_slot 3 would overlap the candidate rows of block_residual (strides [64, 192, 1])"),

      // 8. Aliasing: outputs vs inputs, outputs vs each other, the snapshot row vs both.
      alias("OutputAliasesLayerResidual", N, "output", "layer_residual", 0, "overlaps layer_residual (outputs must not alias inputs)"),
      alias("UpdatedAliasesAdd", A, "updated", "layer_residual_add", 0, "overlaps layer_residual_add (outputs must not alias inputs)"),
      alias("MixturePartlyInBank", A, "mixture", "block_residual", 64, "overlaps block_residual (outputs must not alias inputs)"),
      alias("RsigmaAliasesResWeight", R, "rsigma", "res_weight", 0, "overlaps res_weight (outputs must not alias inputs)"),
      alias("UpdatedAliasesOutput", A, "updated", "output", 0, "overlaps output (outputs must not alias each other)"),
      alias("ProbsAliasesRsigma", R, "probs", "rsigma", 0, "overlaps rsigma (outputs must not alias each other)"),
      reject("SnapshotRowAliasesLayerResidual", A, [](AttnResArgs& a, Case&) {
        a.layer_residual.data = bytes(a.block_residual) + 2 * 128 * 2;  // bank row 2 (the slot) as the prefix
      }, "snapshot row overlaps layer_residual (outputs must not alias inputs)"),
      reject("SnapshotRowAliasesOutput", A, [](AttnResArgs& a, Case&) {
        a.output.data = bytes(a.block_residual) + 2 * 128 * 2;
      }, "snapshot row overlaps output (outputs must not alias each other)"),
  };
}

class Rejects : public ::testing::TestWithParam<Rejection> {};

TEST_P(Rejects, WithItsMessageAndWritesNothing) {
  const Rejection& r = GetParam();
  Config cfg = base_config(r.op);
  cfg.seed = test_seed();
  Case c(cfg);
  AttnResArgs a = c.args();
  r.mutate(a, c);
  const Case before = c;
  const std::string msg = error_of<attnres::ArgumentError>([&] { attnres::run(r.op, a); });
  EXPECT_EQ(msg.rfind(r.message, 0), 0u) << "message: \"" << msg << "\"\nexpected to start with: \"" << r.message << "\"";
  EXPECT_TRUE(storage_unchanged(before, c));
  // plan() validates the same way (outputs may be absent there; present ones are checked).
  const bool missing_output = r.message.find("output is required") != std::string::npos ||
                              r.message.find("updated is required") != std::string::npos;
  if (!missing_output) { EXPECT_THROW(attnres::plan(r.op, a), attnres::ArgumentError); }
}

INSTANTIATE_TEST_SUITE_P(Preconditions, Rejects, ::testing::ValuesIn(argument_rejections()),
                         [](const ::testing::TestParamInfo<Rejection>& info) { return std::string(info.param.name); });

// The unmodified base call of every op is valid: each rejection above is caused by its one change.
TEST(Rejects, BaseCallsAreValid) {
  for (AttnResOp op : {R, N, A, P}) {
    Config cfg = base_config(op);
    cfg.seed = test_seed(static_cast<uint64_t>(op));
    Case c(cfg);
    EXPECT_NO_THROW(attnres::run(op, c.args())) << attnres::op_name(op);
  }
}

// ---------------------------------------------------------------------------------------------------------
// 9. 16-byte alignment, checked for CUDA tensors only (the CPU backend reads any alignment). The views are
// labelled cuda:0 over host memory: validation never dereferences, and these tests call validate() itself so
// that nothing is launched even where a GPU is present.

struct Misalignment {
  const char* name;
  AttnResOp op;
  Mutation mutate;
  std::string message;
};
void PrintTo(const Misalignment& m, std::ostream* os) { *os << m.name; }

void all_on_cuda(AttnResArgs& a) {
  for (const auto& [name, t] : named_refs(a))
    if (t->present()) t->device = kCuda0;
}

std::vector<Misalignment> misalignments() {
  const std::string rule = "must be 16-byte aligned for the CUDA kernels (base pointer and outer strides a multiple of 16 bytes)";
  auto shift = [](const char* arg, int64_t elements) {
    return [arg, elements](AttnResArgs& a, Case&) {
      TensorRef* t = ref_named(a, arg);
      t->data = bytes(*t) + elements * 2;
    };
  };
  return {
      {"LayerResidualBase", A, shift("layer_residual", 1), "layer_residual " + rule + ", got strides [80, 1]"},
      {"AddBase", A, shift("layer_residual_add", 4), "layer_residual_add " + rule},
      {"BankBase", N, shift("block_residual", 2), "block_residual " + rule},
      {"ResWeightBase", R, shift("res_weight", 1), "res_weight " + rule + ", got strides [1]"},
      {"NormWeightBase", N, shift("norm_weight", 3), "norm_weight " + rule},
      {"OutputBase", N, shift("output", 4), "output " + rule},
      {"MixtureBase", A, shift("mixture", 1), "mixture " + rule},
      {"LayerResidualTokenStride", N, [](AttnResArgs& a, Case&) { a.layer_residual.strides[0] = 68; },
       "layer_residual " + rule + ", got strides [68, 1]"},
      {"BankTokenStride", N, [](AttnResArgs& a, Case&) {
         a.block_residual.strides[0] = 2 * 68;
         a.block_residual.strides[1] = 68;
       }, "block_residual " + rule + ", got strides [136, 68, 1]"},
      {"UpdatedTokenStride", P, [](AttnResArgs& a, Case&) { a.updated.strides[0] = 76; }, "updated " + rule},
  };
}

class RejectsMisaligned : public ::testing::TestWithParam<Misalignment> {};

TEST_P(RejectsMisaligned, OnCudaTensors) {
  const Misalignment& m = GetParam();
  Config cfg = base_config(m.op);
  cfg.pad = 16;  // rows 160 bytes apart (aligned): room for the shifted and re-strided views inside the storage
  cfg.seed = test_seed();
  Case c(cfg);
  AttnResArgs a = c.args();
  m.mutate(a, c);
  // On the CPU the same view is fine: alignment is a rule of the CUDA kernels only.
  EXPECT_NO_THROW(attnres::validate(m.op, a));
  all_on_cuda(a);
  const Case before = c;
  const std::string msg = error_of<attnres::ArgumentError>([&] { attnres::validate(m.op, a); });
  EXPECT_EQ(msg.rfind(op_prefix(m.op) + m.message, 0), 0u) << "message: \"" << msg << "\"";
  EXPECT_TRUE(storage_unchanged(before, c));
}

INSTANTIATE_TEST_SUITE_P(Alignment, RejectsMisaligned, ::testing::ValuesIn(misalignments()),
                         [](const ::testing::TestParamInfo<Misalignment>& info) { return std::string(info.param.name); });

TEST(RejectsMisaligned, AlignedCudaViewsPassValidation) {
  for (AttnResOp op : {R, N, A, P}) {
    Config cfg = base_config(op);
    Case c(cfg);
    AttnResArgs a = c.args();
    all_on_cuda(a);
    EXPECT_NO_THROW(attnres::validate(op, a)) << attnres::op_name(op);
  }
}

// ---------------------------------------------------------------------------------------------------------
// The FP8 output's preconditions that Python cannot reach (the wrappers and torch.ops build the mode, the
// tensors and their layout themselves): attn_res_rmsnorm, T = 2, H = 128, with poisoned output_fp8 and scales.

struct Fp8Rejection {
  const char* name;
  Fp8Scales mode;  // set before the mutation
  std::function<void(AttnResArgs&)> mutate;
  bool on_cuda;  // validate() with every tensor labelled cuda:0 (nothing is launched)
  std::string message;
};
void PrintTo(const Fp8Rejection& r, std::ostream* os) { *os << r.name; }

std::vector<Fp8Rejection> fp8_rejections() {
  const auto none = Fp8Scales::none;
  const auto per_token = Fp8Scales::per_token;
  return {
      {"InvalidModeInteger", per_token, [](AttnResArgs& a) { a.fp8 = static_cast<Fp8Scales>(7); }, false,
       "fp8 must be none (0), per_token (1) or block128 (2), got 7"},
      {"Pow2WithoutFp8", none, [](AttnResArgs& a) {
         a.fp8_pow2_scales = true;
         a.output_fp8 = TensorRef{};
         a.fp8_scales = TensorRef{};
       }, false, "fp8_pow2_scales requires fp8 = per_token or block128"},
      {"ScalesWithoutFp8", none, [](AttnResArgs& a) { a.output_fp8 = TensorRef{}; }, false,
       "fp8_scales requires fp8 = per_token or block128"},
      {"OverlappingScales", per_token, [](AttnResArgs& a) { a.fp8_scales.strides[0] = 0; }, false,
       "fp8_scales has an overlapping layout (strides [0, 1])"},
      {"ScalesNot4ByteAligned", per_token, [](AttnResArgs& a) {
         a.fp8_scales.data = static_cast<char*>(a.fp8_scales.data) + 2;
       }, false, "fp8_scales must be 4-byte aligned"},
      {"OutputFp8Not8ByteAlignedOnCuda", per_token, [](AttnResArgs& a) {
         a.output_fp8.data = static_cast<char*>(a.output_fp8.data) + 4;
       }, true, "output_fp8 must be 8-byte aligned for the CUDA kernels (base pointer and token stride a multiple of 8 bytes), got strides [128, 1]"},
  };
}

class RejectsFp8 : public ::testing::TestWithParam<Fp8Rejection> {};

TEST_P(RejectsFp8, WithItsMessageAndWritesNothing) {
  const Fp8Rejection& r = GetParam();
  Config cfg = base_config(N);
  cfg.H = 128;
  cfg.seed = test_seed();
  Case c(cfg);
  const int64_t T = cfg.T, H = cfg.H;
  // Storage with room past the views (the shifted pointers stay inside), poisoned.
  std::vector<uint8_t> codes(static_cast<size_t>(T * H + 16), 0xA5);
  std::vector<float> scales(static_cast<size_t>(T + 4), -7.0f);
  AttnResArgs a = c.args();
  a.fp8 = r.mode;
  a.output_fp8 = attnres::make_ref(codes.data(), DType::e4m3, a.output.device, {T, H});
  a.fp8_scales = attnres::make_ref(scales.data(), DType::f32, a.output.device, {T, 1});
  {
    AttnResArgs valid = a;
    valid.fp8 = Fp8Scales::per_token;
    EXPECT_NO_THROW(attnres::validate(N, valid));  // the base call is valid: the mutation causes the rejection
  }
  r.mutate(a);
  if (r.on_cuda) {
    // On the CPU the same view is fine: alignment is a rule of the CUDA kernels only.
    EXPECT_NO_THROW(attnres::validate(N, a));
    all_on_cuda(a);
    a.output_fp8.device = kCuda0;
    a.fp8_scales.device = kCuda0;
  }
  const Case before = c;
  const std::vector<uint8_t> codes_before = codes;
  const std::vector<float> scales_before = scales;
  const std::string msg = error_of<attnres::ArgumentError>([&] {
    if (r.on_cuda) {
      attnres::validate(N, a);
    } else {
      attnres::run(N, a);
    }
  });
  EXPECT_EQ(msg.rfind(op_prefix(N) + r.message, 0), 0u) << "message: \"" << msg << "\"";
  EXPECT_TRUE(storage_unchanged(before, c));
  EXPECT_EQ(codes, codes_before);
  EXPECT_EQ(std::memcmp(scales.data(), scales_before.data(), scales.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Fp8, RejectsFp8, ::testing::ValuesIn(fp8_rejections()),
                         [](const ::testing::TestParamInfo<Fp8Rejection>& info) { return std::string(info.param.name); });

// The FP8-only call (no output tensor) writes the codes, scales and updated prefix of the call that also writes
// the bf16 output, bit for bit, and nothing else; without an FP8 mode the absent output is refused (above).
TEST(Fp8Only, WritesTheFullCallsCodesAndScales) {
  for (const Fp8Scales mode : {Fp8Scales::per_token, Fp8Scales::block128}) {
    for (const AttnResOp op : {N, A}) {
      Config cfg = base_config(op);
      cfg.T = 3;
      cfg.H = 256;
      cfg.seed = test_seed(static_cast<uint64_t>(op) + 10 * static_cast<uint64_t>(mode));
      const int64_t T = cfg.T, H = cfg.H, groups = mode == Fp8Scales::per_token ? 1 : H / 128;
      const int64_t padded = (T + 3) / 4 * 4;  // block128: column-major, token stride padded to 4
      auto call = [&](Case& c, bool with_output, std::vector<uint8_t>& codes, std::vector<float>& scales) {
        AttnResArgs a = c.args();
        if (!with_output) a.output = TensorRef{};
        a.fp8 = mode;
        a.output_fp8 = attnres::make_ref(codes.data(), DType::e4m3, a.layer_residual.device, {T, H});
        a.fp8_scales = attnres::make_ref(scales.data(), DType::f32, a.layer_residual.device, {T, groups}, {1, padded});
        attnres::run(op, a);
      };
      Case full(cfg), only(cfg);
      const Case before = only;
      std::vector<uint8_t> codes_full(static_cast<size_t>(T * H), 0xA5), codes_only = codes_full;
      std::vector<float> scales_full(static_cast<size_t>(padded * groups), -7.0f), scales_only = scales_full;
      call(full, true, codes_full, scales_full);
      call(only, false, codes_only, scales_only);
      EXPECT_EQ(codes_only, codes_full);
      EXPECT_EQ(std::memcmp(scales_only.data(), scales_full.data(), scales_full.size() * sizeof(float)), 0);
      EXPECT_NE(codes_only, std::vector<uint8_t>(codes_only.size(), 0xA5));
      if (op == A) { EXPECT_TRUE(bits_equal(only.updated.bits(), full.updated.bits(), "updated")); }
      EXPECT_TRUE(same_storage(only.output, before.output)) << "the FP8-only call wrote the output's storage";
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Valid calls the plan declines (UnsupportedError) and invalid options (ArgumentError): nothing written.

struct Decline {
  const char* name;
  AttnResOp op;
  Options options;
  std::function<void(Config&)> configure;
  bool unsupported;  // UnsupportedError (a declined plan) rather than ArgumentError
  std::string message;
};
void PrintTo(const Decline& d, std::ostream* os) { *os << d.name; }

Options with(std::function<void(Options&)> f) {
  Options o;
  f(o);
  return o;
}

std::vector<Decline> declines() {
  auto same = [](Config&) {};
  const std::string max_cluster = std::to_string(attnres::tuning::kMaxCluster);
  return {
      {"ForcedSingleCtaOnCpu", A, with([](Options& o) { o.kernel = KernelKind::single_cta; }), same, true,
       "kernel single_cta runs on CUDA devices; the tensors are on cpu"},
      {"ForcedSplitKOnCpu", R, with([](Options& o) { o.kernel = KernelKind::split_k; }), same, true,
       "kernel split_k runs on CUDA devices; the tensors are on cpu"},
      {"PersistentTopologyTap", N, with([](Options& o) { o.topology = Topology::persistent; }), same, true,
       "the persistent kernel does not emit the pre-norm mixture tap"},
      {"SplitTopologyAboveCeilingTap", N,
       with([](Options& o) { o.topology = Topology::split; o.split_max_tokens = 1; }), same, true,
       "the persistent kernel does not emit the pre-norm mixture tap"},
      {"NegativeTokenCeiling", N, with([](Options& o) { o.split_max_tokens = -1; }), same, false,
       "options.split_max_tokens must be >= 0"},
      {"ClusterTooLarge", A, with([](Options& o) { o.cluster = attnres::tuning::kMaxCluster + 1; }), same, false,
       "options.cluster must be in [0, " + max_cluster + "], got " + std::to_string(attnres::tuning::kMaxCluster + 1)},
      {"ClusterNegative", R, with([](Options& o) { o.cluster = -1; }), same, false,
       "options.cluster must be in [0, " + max_cluster + "], got -1"},
  };
}

class Declines : public ::testing::TestWithParam<Decline> {};

TEST_P(Declines, BeforeWritingAnything) {
  const Decline& d = GetParam();
  Config cfg = base_config(d.op);
  d.configure(cfg);
  cfg.seed = test_seed();
  Case c(cfg);
  const Case before = c;
  const std::string expected = op_prefix(d.op) + d.message;
  const std::string msg =
      d.unsupported ? error_of<attnres::UnsupportedError>([&] { attnres::run(d.op, c.args(), d.options); })
                    : error_of<attnres::ArgumentError>([&] { attnres::run(d.op, c.args(), d.options); });
  EXPECT_EQ(msg.rfind(expected, 0), 0u) << "message: \"" << msg << "\"\nexpected to start with: \"" << expected << "\"";
  EXPECT_TRUE(storage_unchanged(before, c));
  // The same call with default options runs: the decline is the options' doing.
  EXPECT_NO_THROW(attnres::run(d.op, c.args()));
}

INSTANTIATE_TEST_SUITE_P(Plan, Declines, ::testing::ValuesIn(declines()),
                         [](const ::testing::TestParamInfo<Decline>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace attnres_test
