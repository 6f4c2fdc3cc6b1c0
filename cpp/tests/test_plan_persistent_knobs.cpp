// The persistent kernel's tuning knobs (Options::persistent_blocks_per_sm / persistent_slots /
// persistent_passes): the geometry each gives, that none changes what fixes a token's arithmetic (consumer
// threads and vector bucket: H alone), the declines of geometries that do not fit, and the ArgumentError of
// values out of range on every op and device.
#include <gtest/gtest.h>

#include <string>

#include "persistent_layout.hpp"
#include "plan_test_util.hpp"

namespace attnres_test {
namespace {

namespace layout = attnres::persistent;

constexpr int32_t kH200Smem = kH200SmemOptin;
constexpr int32_t kH200SmPerSm = 233472;  // sharedMemPerMultiprocessor of sm_90 (228 KB)

DeviceInfo h200() { return described_h200(); }

DeviceInfo cpu() { return described_cpu(/*cuda_backend=*/false); }

PlanQuery query(int64_t T, int64_t N, int64_t H, bool add, AttnResOp op = AttnResOp::attn_res_add_rmsnorm_persistent) {
  return plan_query_of(op, T, N, H, add);
}

Options knobs(int32_t blocks_per_sm, int32_t slots, int32_t passes) {
  Options o;
  o.persistent_blocks_per_sm = blocks_per_sm;
  o.persistent_slots = slots;
  o.persistent_passes = passes;
  return o;
}

// H = 7168 (Kimi K3), the benchmark's variants.
TEST(PlanPersistentKnobs, VariantGeometryAtKimiK3) {
  const Plan base = attnres::plan(query(16384, 9, 7168, true), h200(), knobs(1, 0, 0));
  ASSERT_TRUE(base.accepted()) << base.decline;
  EXPECT_EQ(base.blocks_per_sm, 1);
  EXPECT_EQ(base.slots, 16);
  EXPECT_EQ(base.passes, 1);
  EXPECT_EQ(base.blocks, 132);

  // Two blocks per SM: each block gets (227 KB + 1 KB) / 2 - 1 KB = 115712 bytes: 8 slots after a header for N = 9
  // and 7 consumer warps (768 bytes); a header for N = 16 (1280 bytes) leaves room for 7.
  EXPECT_EQ(layout::block_budget(kH200Smem, 2), 115712);
  Plan two = attnres::plan(query(16384, 9, 7168, true), h200(), knobs(2, 0, 0));
  ASSERT_TRUE(two.accepted()) << two.decline;
  EXPECT_EQ(two.blocks_per_sm, 2);
  EXPECT_EQ(two.slots, 8);
  EXPECT_EQ(two.smem_bytes, 768 + 8 * 14336);
  EXPECT_LE(2 * (two.smem_bytes + layout::kReservedSharedPerBlock), kH200SmPerSm);
  EXPECT_GT(layout::smem_bytes(9, 9, 7168), layout::block_budget(kH200Smem, 2));
  EXPECT_EQ(layout::max_slots(layout::block_budget(kH200Smem, 2), 16, 7168), 7);
  EXPECT_EQ(two.passes, 2);  // 10 rows per token do not fit 8 slots
  EXPECT_EQ(two.blocks, 264);
  EXPECT_EQ(two.threads, base.threads);
  EXPECT_EQ(two.vectors, base.vectors);
  two = attnres::plan(query(4096, 2, 7168, true), h200(), knobs(2, 0, 0));
  ASSERT_TRUE(two.accepted()) << two.decline;
  EXPECT_EQ(two.passes, 1);  // 3 rows fit 8 slots
  EXPECT_EQ(attnres::plan(query(100, 2, 7168, true), h200(), knobs(2, 0, 0)).blocks, 100);
  // The automatic geometry is the two-blocks one here.
  const Plan automatic = attnres::plan(query(16384, 9, 7168, true), h200(), Options{});
  EXPECT_EQ(automatic.blocks_per_sm, 2);
  EXPECT_EQ(automatic.slots, 8);
  EXPECT_EQ(automatic.passes, 2);
  EXPECT_EQ(automatic.blocks, 264);

  // A shallower ring (one block per SM: 11 slots do not fit half the SM): one pass while a token's rows and a
  // spare slot fit, two passes below.
  Plan p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(0, 11, 0));
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.slots, 11);
  EXPECT_EQ(p.passes, 1);
  EXPECT_EQ(p.smem_bytes, layout::smem_bytes(11, 9, 7168));
  EXPECT_EQ(attnres::plan(query(4096, 9, 7168, true), h200(), knobs(0, 10, 0)).passes, 2);
  // Two passes forced over the full ring.
  p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(1, 0, 2));
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.slots, 16);
  EXPECT_EQ(p.passes, 2);
  // The one-block geometry spelled out knob by knob is the one-block plan; the two-blocks one is the default.
  p = attnres::plan(query(16384, 9, 7168, true), h200(), knobs(1, 16, 1));
  EXPECT_EQ(p.slots, base.slots);
  EXPECT_EQ(p.passes, base.passes);
  EXPECT_EQ(p.blocks, base.blocks);
  EXPECT_EQ(p.smem_bytes, base.smem_bytes);
  p = attnres::plan(query(16384, 9, 7168, true), h200(), knobs(2, 8, 2));
  EXPECT_EQ(p.blocks_per_sm, automatic.blocks_per_sm);
  EXPECT_EQ(p.slots, automatic.slots);
  EXPECT_EQ(p.passes, automatic.passes);
  EXPECT_EQ(p.smem_bytes, automatic.smem_bytes);
  // Knobs the two-blocks geometry cannot honour leave the automatic choice at one block, not a decline: 11 slots
  // (more than half the SM holds), or one pass for a token of 10 rows (8 slots).
  p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(0, 11, 0));
  EXPECT_EQ(p.blocks_per_sm, 1);
  p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(0, 0, 1));
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.blocks_per_sm, 1);
  EXPECT_EQ(p.slots, 16);
  p = attnres::plan(query(4096, 2, 7168, true), h200(), knobs(0, 0, 1));  // 3 rows fit 8 slots
  EXPECT_EQ(p.blocks_per_sm, 2);
  EXPECT_EQ(p.passes, 1);
}

// Over every shape: an accepted knob plan keeps the arithmetic geometry, fits its share of the SM and obeys the
// pass rule; the knobs change the ring, passes and grid only.
TEST(PlanPersistentKnobs, KnobsNeverChangeTheArithmeticGeometry) {
  const int64_t hidden[] = {8, 64, 200, 1024, 2048, 2056, 4096, 7168, 7176, 8192, 16384};
  for (int64_t H : hidden)
    for (int64_t N = 1; N <= 16; ++N)
      for (bool add : {false, true}) {
        const PlanQuery q = query(5000, N, H, add);
        const Plan base = attnres::plan(q, h200(), Options{});
        ASSERT_TRUE(base.accepted()) << base.decline;
        for (int32_t bps : {0, 1, 2})
          for (int32_t slots : {0, 2, 3, 7, 11, 16, 64})
            for (int32_t passes : {0, 1, 2}) {
              SCOPED_TRACE("H=" + std::to_string(H) + " N=" + std::to_string(N) + " add=" + std::to_string(add) +
                           " knobs=" + std::to_string(bps) + "/" + std::to_string(slots) + "/" +
                           std::to_string(passes));
              const Plan p = attnres::plan(q, h200(), knobs(bps, slots, passes));
              const int64_t rows = N + (add ? 1 : 0);
              // Automatic blocks per SM: two where that geometry exists and honours the other knobs.
              const int32_t fit2 = layout::max_slots(layout::block_budget(kH200Smem, 2), N, H);
              const bool two = layout::two_blocks_fit(H, kH200Smem) && slots <= fit2 &&
                               !(passes == 1 && (slots ? slots : fit2) < rows);
              const int32_t per_sm = bps == 0 ? (two ? 2 : 1) : bps;
              const int64_t budget = layout::block_budget(kH200Smem, per_sm);
              if (!p.accepted()) {
                const bool too_many_threads = per_sm == 2 && base.threads > layout::kTwoBlocksMaxThreads;
                const bool too_many_slots = slots > layout::max_slots(budget, N, H);
                const bool one_pass_short = passes == 1 && (slots ? slots : layout::max_slots(budget, N, H)) < rows;
                EXPECT_TRUE(too_many_threads || too_many_slots || one_pass_short) << p.decline;
                continue;
              }
              EXPECT_EQ(p.kernel, KernelKind::persistent);
              EXPECT_EQ(p.threads, base.threads);
              EXPECT_EQ(p.vectors, base.vectors);
              EXPECT_EQ(p.max_candidates, base.max_candidates);
              EXPECT_EQ(p.blocks_per_sm, per_sm);
              EXPECT_EQ(p.blocks, 132 * per_sm);
              EXPECT_EQ(p.slots, slots ? slots : layout::max_slots(budget, N, H));
              EXPECT_EQ(p.smem_bytes, layout::smem_bytes(p.slots, N, H));
              EXPECT_LE(p.smem_bytes, budget);
              EXPECT_LE(per_sm * (p.smem_bytes + layout::kReservedSharedPerBlock), kH200SmPerSm);
              if (per_sm == 2) { EXPECT_LE(p.threads, layout::kTwoBlocksMaxThreads); }
              // Automatic: one pass with the geometry's spare slots; forced: wherever a token's rows fit.
              const bool fits = p.slots >= rows + tuning::persistent_one_pass_spare_slots(per_sm);
              EXPECT_EQ(p.passes, passes ? passes : fits ? 1 : 2);
              if (p.passes == 1) { EXPECT_GE(p.slots, rows); }
            }
      }
}

TEST(PlanPersistentKnobs, GeometriesThatDoNotFitAreDeclined) {
  Plan p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(0, 17, 0));
  EXPECT_EQ(p.decline, "persistent_slots = 17: H = 7168 fits 2 to 16 row slots in 232448 bytes per block");
  p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(2, 9, 0));
  EXPECT_EQ(p.decline, "persistent_slots = 9: H = 7168 fits 2 to 8 row slots in 115712 bytes per block");
  // A slot count below the minimum is judged on the automatic geometry (two blocks at H = 7168) ...
  p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(0, 1, 0));
  EXPECT_EQ(p.decline, "persistent_slots = 1: H = 7168 fits 2 to 8 row slots in 115712 bytes per block");
  // ... and on one block when forced.
  p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(1, 1, 0));
  EXPECT_EQ(p.decline, "persistent_slots = 1: H = 7168 fits 2 to 16 row slots in 232448 bytes per block");
  p = attnres::plan(query(4096, 16, 7168, true), h200(), knobs(0, 0, 1));
  EXPECT_EQ(p.decline, "persistent_passes = 1 needs a row slot for each of a token's 17 rows; the ring has 16");
  EXPECT_TRUE(attnres::plan(query(4096, 15, 7168, true), h200(), knobs(0, 0, 1)).accepted());  // 16 rows, 16 slots
  p = attnres::plan(query(4096, 9, 7168, true), h200(), knobs(2, 0, 1));
  EXPECT_EQ(p.decline, "persistent_passes = 1 needs a row slot for each of a token's 10 rows; the ring has 8");
  p = attnres::plan(query(4096, 9, 8192, true), h200(), knobs(2, 0, 0));
  EXPECT_EQ(p.decline, "persistent_blocks_per_sm = 2 needs <= 256 threads per block; H = 8192 takes 288");
  PlanQuery fp8 = query(4096, 9, 7168, true);
  fp8.fp8 = Fp8Scales::block128;
  p = attnres::plan(fp8, h200(), knobs(2, 0, 0));  // FP8 has two-blocks instances too
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.blocks_per_sm, 2);
  EXPECT_TRUE(attnres::plan(fp8, h200(), knobs(1, 9, 2)).accepted());
  // H = 16384 (6 slots of 32 KB at one block per SM) has too little shared memory per block at two.
  p = attnres::plan(query(4096, 9, 16384, true, AttnResOp::attn_res_add_rmsnorm_persistent), h200(),
                    knobs(2, 0, 0));
  EXPECT_FALSE(p.accepted());
}

TEST(PlanPersistentKnobs, ValuesOutOfRangeThrowArgumentError) {
  struct Bad {
    const char* name;
    Options options;
    int32_t value, max;
  };
  const Bad bad[] = {{"persistent_blocks_per_sm", knobs(3, 0, 0), 3, 2},
                     {"persistent_blocks_per_sm", knobs(-1, 0, 0), -1, 2},
                     {"persistent_slots", knobs(0, 65, 0), 65, 64},
                     {"persistent_slots", knobs(0, -2, 0), -2, 64},
                     {"persistent_passes", knobs(0, 0, 3), 3, 2},
                     {"persistent_passes", knobs(0, 0, -1), -1, 2}};
  const AttnResOp ops[] = {AttnResOp::attn_res, AttnResOp::attn_res_rmsnorm, AttnResOp::attn_res_add_rmsnorm,
                           AttnResOp::attn_res_add_rmsnorm_persistent};
  for (const Bad& b : bad)
    for (AttnResOp op : ops)
      for (const DeviceInfo& dev : {cpu(), h200()}) {
        const std::string want = std::string(attnres::op_name(op)) + ": options." + b.name + " must be in [0, " +
                                 std::to_string(b.max) + "] (0: the plan's choice), got " + std::to_string(b.value);
        EXPECT_EQ(error_of<attnres::ArgumentError>([&] {
                    attnres::plan(query(64, 9, 7168, op != AttnResOp::attn_res && op != AttnResOp::attn_res_rmsnorm,
                                        op),
                                  dev, b.options);
                  }),
                  want);
      }
}

}  // namespace
}  // namespace attnres_test
