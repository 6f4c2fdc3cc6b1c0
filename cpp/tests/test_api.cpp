// The C++ API surface: tensor views (make_ref and the TensorRef helpers), names, the error hierarchy and the
// shape of error messages, device queries and the build's version header.
#include <gtest/gtest.h>

#include <type_traits>

#include "test_util.hpp"

namespace attnres_test {
namespace {

TEST(MakeRef, DefaultStridesAreRowMajor) {
  uint16_t storage[2 * 3 * 4];
  const TensorRef t = attnres::make_ref(storage, DType::bf16, Device{}, {2, 3, 4});
  EXPECT_EQ(t.data, storage);
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.shape[0], 2);
  EXPECT_EQ(t.shape[1], 3);
  EXPECT_EQ(t.shape[2], 4);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_TRUE(t.present());
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.shape_string(), "[2, 3, 4]");
  EXPECT_EQ(t.strides_string(), "[12, 4, 1]");
}

TEST(MakeRef, ExplicitStridesAndDeviceAreKept) {
  uint16_t storage[64];
  const Device dev{DeviceType::cuda, 3};
  const TensorRef t = attnres::make_ref(storage, DType::f32, dev, {2, 5}, {16, 1});
  EXPECT_EQ(t.strides[0], 16);
  EXPECT_EQ(t.strides[1], 1);
  EXPECT_EQ(t.dtype, DType::f32);
  EXPECT_EQ(t.device, dev);
  EXPECT_EQ(t.strides_string(), "[16, 1]");
}

TEST(MakeRef, ScalarAndEmptyViews) {
  float x = 1.0f;
  const TensorRef scalar = attnres::make_ref(&x, DType::f32, Device{}, {});
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_TRUE(scalar.present());
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.shape_string(), "[]");

  const TensorRef empty = attnres::make_ref(nullptr, DType::bf16, Device{}, {0, 8});
  EXPECT_EQ(empty.numel(), 0);
  uintptr_t lo = 1, hi = 1;
  empty.byte_range(lo, hi);
  EXPECT_EQ(lo, 0u);
  EXPECT_EQ(hi, 0u);
}

TEST(MakeRef, RejectsRankAboveFour) {
  uint16_t storage[32];
  const std::string msg = error_of<attnres::ArgumentError>(
      [&] { attnres::make_ref(storage, DType::bf16, Device{}, {1, 1, 1, 1, 2}); });
  EXPECT_EQ(msg, "make_ref: rank 5 exceeds the maximum of 4");
}

TEST(MakeRef, RejectsStrideCountMismatch) {
  uint16_t storage[32];
  const std::string msg = error_of<attnres::ArgumentError>(
      [&] { attnres::make_ref(storage, DType::bf16, Device{}, {2, 4}, {4}); });
  EXPECT_EQ(msg, "make_ref: 1 strides given for rank 2");
}

TEST(TensorRef, AbsentByDefault) {
  const TensorRef t;
  EXPECT_FALSE(t.present());
  EXPECT_EQ(t.ndim, -1);
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.shape_string(), "[]");
  uintptr_t lo = 1, hi = 1;
  t.byte_range(lo, hi);
  EXPECT_EQ(lo, hi);
}

TEST(TensorRef, ByteRangeCoversExactlyTheViewsSpan) {
  uint16_t storage[256];
  // [3, 5] rows of a 16-wide buffer, starting at element 2: last element at 2 + 2*16 + 4.
  const TensorRef t = attnres::make_ref(storage + 2, DType::bf16, Device{}, {3, 5}, {16, 1});
  uintptr_t lo = 0, hi = 0;
  t.byte_range(lo, hi);
  EXPECT_EQ(lo, reinterpret_cast<uintptr_t>(storage + 2));
  EXPECT_EQ(hi, reinterpret_cast<uintptr_t>(storage + 2 + 2 * 16 + 4 + 1));

  float f[40];
  const TensorRef g = attnres::make_ref(f, DType::f32, Device{}, {4, 10});
  g.byte_range(lo, hi);
  EXPECT_EQ(hi - lo, 40u * sizeof(float));
}

TEST(Names, DtypesDevicesOpsKernelsTopologies) {
  EXPECT_STREQ(attnres::dtype_name(DType::bf16), "bfloat16");
  EXPECT_STREQ(attnres::dtype_name(DType::f32), "float32");
  EXPECT_STREQ(attnres::dtype_name(DType::f16), "float16");
  EXPECT_STREQ(attnres::dtype_name(DType::other), "an unsupported dtype");
  EXPECT_STREQ(attnres::dtype_name(DType::boolean), "bool");
  EXPECT_STREQ(attnres::dtype_name(DType::i16), "int16");
  EXPECT_STREQ(attnres::dtype_name(DType::u32), "uint32");
  EXPECT_STREQ(attnres::dtype_name(DType::c64), "complex64");
  EXPECT_EQ(attnres::dtype_size(DType::c128), 16);
  EXPECT_EQ(attnres::dtype_size(DType::u16), 2);
  EXPECT_EQ(attnres::dtype_size(DType::bf16), 2);
  EXPECT_EQ(attnres::dtype_size(DType::f16), 2);
  EXPECT_EQ(attnres::dtype_size(DType::f32), 4);
  EXPECT_EQ(attnres::dtype_size(DType::i32), 4);
  EXPECT_EQ(attnres::dtype_size(DType::f64), 8);
  EXPECT_EQ(attnres::dtype_size(DType::i64), 8);
  EXPECT_EQ(attnres::dtype_size(DType::u8), 1);
  EXPECT_EQ(attnres::device_name(Device{}), "cpu");
  EXPECT_EQ(attnres::device_name(Device{DeviceType::cuda, 2}), "cuda:2");
  EXPECT_TRUE((Device{DeviceType::cuda, 1} != Device{DeviceType::cuda, 2}));
  EXPECT_TRUE((Device{DeviceType::cpu, 0} == Device{}));

  EXPECT_STREQ(attnres::op_name(AttnResOp::attn_res), "attn_res");
  EXPECT_STREQ(attnres::op_name(AttnResOp::attn_res_rmsnorm), "attn_res_rmsnorm");
  EXPECT_STREQ(attnres::op_name(AttnResOp::attn_res_add_rmsnorm), "attn_res_add_rmsnorm");
  EXPECT_STREQ(attnres::op_name(AttnResOp::attn_res_add_rmsnorm_persistent), "attn_res_add_rmsnorm_persistent");
  EXPECT_STREQ(attnres::kernel_name(attnres::KernelKind::automatic), "auto");
  EXPECT_STREQ(attnres::kernel_name(attnres::KernelKind::cpu), "cpu");
  EXPECT_STREQ(attnres::kernel_name(attnres::KernelKind::single_cta), "single_cta");
  EXPECT_STREQ(attnres::kernel_name(attnres::KernelKind::split_k), "split_k");
  EXPECT_STREQ(attnres::kernel_name(attnres::KernelKind::persistent), "persistent");
  EXPECT_STREQ(attnres::topology_name(attnres::Topology::per_token), "per_token");
  EXPECT_STREQ(attnres::topology_name(attnres::Topology::persistent), "persistent");
  EXPECT_STREQ(attnres::topology_name(attnres::Topology::split), "split");
}

TEST(Errors, HierarchyLetsCallersCatchOneBase) {
  static_assert(std::is_base_of<std::runtime_error, attnres::Error>::value, "Error is a runtime_error");
  static_assert(std::is_base_of<attnres::Error, attnres::ArgumentError>::value, "");
  static_assert(std::is_base_of<attnres::Error, attnres::UnsupportedError>::value, "");
  static_assert(std::is_base_of<attnres::Error, attnres::CudaError>::value, "");
  static_assert(!std::is_base_of<attnres::ArgumentError, attnres::UnsupportedError>::value,
                "a declined plan is not a caller error");
  // Through the base class, from a real call.
  Case c(Config{});
  AttnResArgs a = c.args();
  a.rms_eps = -1.0;
  EXPECT_THROW(attnres::attn_res_add_rmsnorm(a), attnres::Error);
  EXPECT_THROW(attnres::attn_res_add_rmsnorm(a), std::runtime_error);
}

// Every message is "<op>: <argument> <rule>": the op a user called, then the argument by its public name.
TEST(Errors, MessagesNameOpArgumentAndRule) {
  Config cfg;
  cfg.add2 = true;
  Case c(cfg);
  AttnResArgs a = c.args();
  a.layer_residual_add = TensorRef{};
  const std::string msg = error_of<attnres::ArgumentError>([&] { attnres::attn_res_add_rmsnorm(a); });
  EXPECT_EQ(msg, "attn_res_add_rmsnorm: layer_residual_add2 requires layer_residual_add");

  cfg.op = AttnResOp::attn_res;
  Case r(cfg);
  AttnResArgs b = r.args();
  b.output.dtype = DType::f16;
  EXPECT_EQ(error_of<attnres::ArgumentError>([&] { attnres::attn_res(b); }),
            "attn_res: output must be bfloat16, got float16");
}

// A declined plan is an UnsupportedError that carries the plan's reason after the op name.
TEST(Errors, DeclinedPlanIsUnsupportedWithReason) {
  Case c(Config{});
  attnres::Options o;
  o.kernel = attnres::KernelKind::split_k;
  const std::string msg =
      error_of<attnres::UnsupportedError>([&] { attnres::attn_res_add_rmsnorm(c.args(), o); });
  EXPECT_EQ(msg.rfind("attn_res_add_rmsnorm: ", 0), 0u) << msg;
  EXPECT_TRUE(contains(msg, "kernel split_k runs on CUDA devices; the tensors are on cpu"));
  const attnres::Plan p = attnres::plan(AttnResOp::attn_res_add_rmsnorm, c.args(), o);
  EXPECT_FALSE(p.accepted());
  EXPECT_EQ(msg, std::string("attn_res_add_rmsnorm: ") + p.decline);
}

// The four entry points are the one run() with their op.
TEST(EntryPoints, EachRunsItsOp) {
  for (AttnResOp op : {AttnResOp::attn_res, AttnResOp::attn_res_rmsnorm, AttnResOp::attn_res_add_rmsnorm,
                       AttnResOp::attn_res_add_rmsnorm_persistent}) {
    Config cfg;
    cfg.op = op;
    cfg.seed = test_seed(static_cast<uint64_t>(op));
    Case via_name(cfg), via_run(cfg);
    switch (op) {
      case AttnResOp::attn_res: attnres::attn_res(via_name.args()); break;
      case AttnResOp::attn_res_rmsnorm: attnres::attn_res_rmsnorm(via_name.args()); break;
      case AttnResOp::attn_res_add_rmsnorm: attnres::attn_res_add_rmsnorm(via_name.args()); break;
      case AttnResOp::attn_res_add_rmsnorm_persistent: attnres::attn_res_add_rmsnorm_persistent(via_name.args()); break;
    }
    attnres::run(op, via_run.args());
    EXPECT_TRUE(bits_equal(via_name.output.bits(), via_run.output.bits(), attnres::op_name(op)));
    EXPECT_TRUE(bf16_close(via_name.output.values(), widen(reference(via_name).output), attnres::op_name(op)));
  }
}

// attn_res has no trailing norm: its norm_eps is not an argument and is not checked.
TEST(EntryPoints, AttnResIgnoresNormEps) {
  Config cfg;
  cfg.op = AttnResOp::attn_res;
  Case c(cfg);
  AttnResArgs a = c.args();
  a.norm_eps = std::nan("");
  EXPECT_NO_THROW(attnres::attn_res(a));
}

TEST(Devices, CpuQuery) {
  const attnres::DeviceInfo info = attnres::query_device(Device{});
  EXPECT_EQ(info.device, Device{});
  EXPECT_EQ(info.name, "cpu");
  EXPECT_EQ(info.cuda_backend, attnres::cuda_backend_built());
}

TEST(Devices, BuildFlagMatchesVersionHeader) {
  EXPECT_EQ(attnres::cuda_backend_built(), ATTNRES_WITH_CUDA != 0);
  EXPECT_GE(attnres::cuda_device_count(), 0);
  if (!attnres::cuda_backend_built()) { EXPECT_EQ(attnres::cuda_device_count(), 0); }
  EXPECT_STREQ(ATTNRES_VERSION, "0.1.0");
}

TEST(Devices, MissingCudaDevice) {
  const Device missing{DeviceType::cuda, 1000};
  if (attnres::cuda_backend_built()) {
    const std::string msg = error_of<attnres::ArgumentError>([&] { attnres::query_device(missing); });
    EXPECT_TRUE(contains(msg, "cuda:1000 does not exist"));
  } else {
    // Without the backend the query answers (so plan() can report why) and the plan declines.
    const attnres::DeviceInfo info = attnres::query_device(missing);
    EXPECT_FALSE(info.cuda_backend);
    attnres::PlanQuery q;
    q.op = AttnResOp::attn_res_rmsnorm;
    q.tokens = 1;
    q.candidates = 2;
    q.hidden = 64;
    EXPECT_EQ(attnres::plan(q, info).decline, "attnres was built without the CUDA backend");
  }
}

TEST(Limits, SupportedRangeConstants) {
  EXPECT_EQ(attnres::kMaxCandidates, 16);
  EXPECT_EQ(attnres::kMaxHidden, 16384);
  EXPECT_EQ(attnres::kHiddenMultiple, 8);
}

}  // namespace
}  // namespace attnres_test

// Error messages print doubles exactly (shortest round-trip text), never with a fixed 6 decimals.
TEST(Names, NumbersPrintExactly) {
  EXPECT_EQ(attnres::number_string(-1e-7), "-1e-07");
  EXPECT_EQ(attnres::number_string(1e39), "1e+39");
  EXPECT_EQ(attnres::number_string(0.1), "0.1");
  EXPECT_EQ(attnres::number_string(-1.0), "-1");
}

// A described GPU answers the plan without the GPU, with the properties the library would query on it.
TEST(DescribedDevice, H100AndH200) {
  for (const char* name : {"h100", "h200"}) {
    const attnres::DeviceInfo d = attnres::described_device(name);
    EXPECT_EQ(d.cc_major, 9);
    EXPECT_EQ(d.sm_count, 132);
    EXPECT_TRUE(d.cuda_backend);
    EXPECT_EQ(d.device.type, attnres::DeviceType::cuda);
  }
  EXPECT_THROW(attnres::described_device("a100"), attnres::ArgumentError);
}
