// Layout arithmetic on views no allocation could back (a DLPack producer may describe any shape and strides):
// element counts, byte extents and the non-overlap test are computed with overflow checks, and every op family
// refuses such a view by name instead of wrapping (a token stride of 2^62 once passed the overlap check and put
// every token's fp8 scale on one address). Validation only: no pointer is dereferenced.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "attnres/attnres.hpp"
#include "layout.hpp"

namespace attnres_test {
namespace {

using namespace attnres;

constexpr int64_t kHuge = int64_t{1} << 62;
void* at(uintptr_t a) { return reinterpret_cast<void*>(a); }

template <typename F>
std::string rejection(F&& call) {
  try {
    call();
  } catch (const ArgumentError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(LayoutOverflow, ArithmeticIsChecked) {
  int64_t bytes = 0;
  const TensorRef ok = make_ref(at(0x1000), DType::f32, Device{}, {4, 1}, {1, 1});
  EXPECT_TRUE(detail::byte_extent(ok, bytes));
  EXPECT_EQ(bytes, 16);
  // 3 * 2^62 elements: the element offset overflows int64.
  const TensorRef wide = make_ref(at(0x1000), DType::f32, Device{}, {4, 1}, {kHuge, 1});
  EXPECT_FALSE(detail::byte_extent(wide, bytes));
  EXPECT_FALSE(detail::non_overlapping(wide));  // its wrapped addresses coincide
  // 2^62 + 1 elements fit in int64, their 4-byte extent does not: token 1's scale would land on token 0's.
  const TensorRef two = make_ref(at(0x1000), DType::f32, Device{}, {2, 1}, {kHuge, 1});
  EXPECT_FALSE(detail::byte_extent(two, bytes));
  EXPECT_FALSE(detail::non_overlapping(two));
  // data + extent past the address space.
  const TensorRef top = make_ref(at(UINTPTR_MAX - 15), DType::bf16, Device{}, {16});
  EXPECT_FALSE(detail::byte_extent(top, bytes));
  // An element count beyond int64 is refused where it is counted; an empty view counts zero.
  const TensorRef many = make_ref(at(0x1000), DType::bf16, Device{}, {kHuge, 4}, {0, 0});
  EXPECT_THROW(many.numel(), ArgumentError);
  EXPECT_EQ(make_ref(at(0x1000), DType::bf16, Device{}, {0, kHuge, kHuge}).numel(), 0);
  uintptr_t lo = 0, hi = 0;
  EXPECT_THROW(wide.byte_range(lo, hi), ArgumentError);
}

// attn_res_rmsnorm with per-token FP8 scales whose token stride is 2^62.
TEST(LayoutOverflow, Fp8ScalesTokenStride) {
  constexpr int64_t T = 4, H = 128;
  AttnResArgs a;
  a.layer_residual = make_ref(at(0x100000), DType::bf16, Device{}, {T, H});
  a.block_residual = make_ref(at(0x200000), DType::bf16, Device{}, {1, T, H});
  for (TensorRef* w : {&a.res_weight, &a.rms_weight, &a.norm_weight})
    *w = make_ref(at(0x300000 + 0x1000 * (w - &a.res_weight)), DType::bf16, Device{}, {H});
  a.output = make_ref(at(0x400000), DType::bf16, Device{}, {T, H});
  a.fp8 = Fp8Scales::per_token;
  a.output_fp8 = make_ref(at(0x500000), DType::e4m3, Device{}, {T, H});
  a.fp8_scales = make_ref(at(0x600000), DType::f32, Device{}, {T, 1});
  EXPECT_EQ(rejection([&] { validate(AttnResOp::attn_res_rmsnorm, a); }), "accepted");
  a.fp8_scales.strides[0] = kHuge;
  EXPECT_EQ(rejection([&] { validate(AttnResOp::attn_res_rmsnorm, a); }),
            "attn_res_rmsnorm: fp8_scales has an overlapping layout (strides [4611686018427387904, 1])");
  a.fp8_scales.strides[0] = 1;
  a.output_fp8.strides[0] = kHuge;
  EXPECT_EQ(rejection([&] { validate(AttnResOp::attn_res_rmsnorm, a); }),
            "attn_res_rmsnorm: output_fp8 has a layout whose extent overflows 64-bit address arithmetic "
            "(shape [4, 128], strides [4611686018427387904, 1]): no allocation can back it");
  a.output_fp8.strides[0] = H;
  a.output.strides[0] = kHuge;
  EXPECT_EQ(rejection([&] { validate(AttnResOp::attn_res_rmsnorm, a); }),
            "attn_res_rmsnorm: output has a layout whose extent overflows 64-bit address arithmetic "
            "(shape [4, 128], strides [4611686018427387904, 1]): no allocation can back it");
}

TEST(LayoutOverflow, MoeFinalizeRows) {
  MoeFinalizeArgs f;
  f.rows = make_ref(at(0x100000), DType::bf16, Device{}, {4, 64}, {kHuge, 1});
  f.weights = make_ref(at(0x200000), DType::f32, Device{}, {2, 1});
  f.index = make_ref(at(0x300000), DType::i32, Device{}, {2, 1});
  f.output = make_ref(at(0x400000), DType::bf16, Device{}, {2, 64});
  EXPECT_EQ(rejection([&] { validate_moe_finalize(f, true, false); }),
            "moe_finalize: rows has a layout whose extent overflows 64-bit address arithmetic "
            "(shape [4, 64], strides [4611686018427387904, 1]): no allocation can back it");
  f.rows.strides[0] = 64;
  f.output.strides[0] = kHuge;
  EXPECT_EQ(rejection([&] { validate_moe_finalize(f, true, false); }),
            "moe_finalize: output has a layout whose extent overflows 64-bit address arithmetic "
            "(shape [2, 64], strides [4611686018427387904, 1]): no allocation can back it");
}

TEST(LayoutOverflow, AllReduceGathered) {
  AllReduceArgs a;
  a.comm.world_size = 2;
  a.comm.rank = 0;
  a.comm.capacity = 4;
  a.comm.width = 64;
  a.gathered = make_ref(at(0x100000), DType::bf16, Device{}, {2, 2, 64}, {kHuge, 64, 1});
  a.output = make_ref(at(0x200000), DType::bf16, Device{}, {2, 64});
  EXPECT_EQ(rejection([&] { validate_all_reduce(a, true, false); }),
            "all_reduce: gathered has a layout whose extent overflows 64-bit address arithmetic (shape [2, 2, 64], "
            "strides [4611686018427387904, 64, 1]): no allocation can back it");
}

}  // namespace
}  // namespace attnres_test
