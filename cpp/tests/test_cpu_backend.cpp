// The CPU backend against the float64 oracle of test_util.hpp, and the contract's bitwise properties:
// N = 1 exactness, the add2 fold, subnormals kept (also when the caller set FTZ/DAZ), determinism, and
// per-token independence.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.hpp"

#if defined(__x86_64__) || defined(_M_X64) || defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace attnres_test {
namespace {


Case run_cpu(const Case& c, const attnres::Options& options = {}) {
  Case out = c;
  attnres::run(c.cfg.op, out.args(), options);
  return out;
}

// Every output of the call against the oracle: `updated` and the snapshot row bit for bit, bf16 outputs and
// fp32 diagnostics within the contract's tolerance; nothing else written.
void expect_matches_reference(const Case& before, const Case& after) {
  const Expected e = reference(before);
  const AttnResArgs a = before.args();
  EXPECT_TRUE(bf16_close(after.output.values(), widen(e.output), "output"));
  if (a.updated.present()) { EXPECT_TRUE(bits_equal(after.updated.bits(), e.updated, "updated")); }
  if (a.mixture.present()) { EXPECT_TRUE(bf16_close(after.mixture.values(), widen(e.mixture), "mixture")); }
  if (a.rsigma.present()) { EXPECT_TRUE(diag_close(after.rsigma.values(), e.rsigma, "rsigma")); }
  if (a.probs.present()) { EXPECT_TRUE(diag_close(after.probs.values(), e.probs, "probs")); }
  if (a.logits.present()) { EXPECT_TRUE(diag_close(after.logits.values(), e.logits, "logits")); }
  if (a.snapshot_slot >= 0) { EXPECT_TRUE(bits_equal(bank_row(after, a.snapshot_slot), e.updated, "snapshot row")); }
  EXPECT_TRUE(only_outputs_written(before, after));
}

struct Shape {
  const char* name;
  Config cfg;
};
void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }

std::vector<Shape> shapes() {
  using BL = BankLayout;
  return {
      {"AttnResTiny", make_config(R, 1, 0, 8)},
      {"AttnResWeightRow", make_config(R, 3, 4, 64, [](Config& c) { c.res_weight_2d = true; })},
      {"AttnResTokenMajorPadded", make_config(R, 5, 6, 200, [](Config& c) { c.bank_layout = BL::token_major; c.bank_rows = 9; c.pad = 8; })},
      {"RmsnormKimiLinear", make_config(N, 2, 2, 2304, [](Config& c) { c.tap = true; })},
      {"RmsnormTokenMajorPadded", make_config(N, 4, 7, 136, [](Config& c) { c.tap = true; c.bank_layout = BL::token_major; c.bank_rows = 9; c.pad = 8; })},
      {"AddKimiK3", make_config(A, 3, 3, 7168)},
      {"Add2TapSnapshot", make_config(A, 5, 11, 512, [](Config& c) {
         c.add2 = c.tap = true; c.snapshot_slot = 12; c.bank_rows = 14; c.rms_eps = 1e-3; c.norm_eps = 1e-6; })},
      {"Add2MaxShape", make_config(A, 2, 15, 16384, [](Config& c) { c.add2 = true; })},
      {"Add2H8192", make_config(A, 1, 12, 8192, [](Config& c) { c.add2 = c.tap = true; })},
      {"Add2TokenMajorSnapshot", make_config(A, 3, 5, 1024, [](Config& c) {
         c.add2 = c.tap = true; c.bank_layout = BL::token_major; c.bank_rows = 12; c.snapshot_slot = 7; c.pad = 24; })},
      {"Add2EmptyBankSnapshot", make_config(A, 7, 0, 96, [](Config& c) { c.add2 = c.tap = true; c.snapshot_slot = 0; })},
      {"UnalignedOddStrides", make_config(A, 3, 3, 64, [](Config& c) {
         c.add2 = c.tap = true; c.pad = 3; c.offset = 1; c.snapshot_slot = 3; })},
      {"SmallRows", make_config(A, 4, 8, 4096, [](Config& c) { c.add2 = true; c.magnitude = 1e-3; c.rms_eps = 1e-6; c.norm_eps = 1e-7; })},
      {"PersistentAdd", make_config(P, 40, 4, 256)},
      {"PersistentNoAdd", make_config(P, 9, 2, 64, [](Config& c) { c.add = false; })},
  };
}

class CpuMatchesReference : public ::testing::TestWithParam<Shape> {};

TEST_P(CpuMatchesReference, AllOutputs) {
  Config cfg = GetParam().cfg;
  cfg.seed = test_seed();
  const Case before(cfg);
  expect_matches_reference(before, run_cpu(before));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuMatchesReference, ::testing::ValuesIn(shapes()),
                         [](const ::testing::TestParamInfo<Shape>& info) { return std::string(info.param.name); });

// With one candidate the softmax weight is exactly 1: the mixture is the prefix itself, bit for bit.
TEST(CpuExactness, OneCandidateMixtureIsThePrefix) {
  for (int64_t H : {8, 64, 7168}) {
    Config cfg = make_config(R, 3, 0, H);
    cfg.seed = test_seed(uint64_t(H));
    const Case r = run_cpu(Case(cfg));
    EXPECT_TRUE(bits_equal(r.output.bits(), r.layer_residual.bits(), "attn_res mixture"));
    for (double p : r.probs.values()) EXPECT_EQ(p, 1.0);

    cfg = make_config(N, 3, 0, H, [](Config& c) { c.tap = true; });
    const Case n = run_cpu(Case(cfg));
    EXPECT_TRUE(bits_equal(n.mixture.bits(), n.layer_residual.bits(), "attn_res_rmsnorm tap"));

    cfg = make_config(A, 3, 0, H, [](Config& c) { c.add2 = c.tap = true; });
    const Case a = run_cpu(Case(cfg));
    EXPECT_TRUE(bits_equal(a.mixture.bits(), a.updated.bits(), "attn_res_add_rmsnorm tap"));
    EXPECT_TRUE(bits_equal(a.updated.bits(), reference(a).updated, "updated"));
  }
}

// The two-addend call equals, bit for bit, the one-addend call on the bf16 sum add + add2 and the no-add call
// on the materialized prefix: the addends change only the last candidate's value (what makes the model
// layer's fold invisible).
TEST(CpuBitwise, Add2EqualsPresummedAddEqualsMaterializedPrefix) {
  for (int64_t H : {64, 2304, 7168}) {
    Config cfg = make_config(A, 4, 5, H, [](Config& c) { c.add2 = c.tap = true; c.snapshot_slot = 6; c.bank_rows = 7; });
    cfg.seed = test_seed(uint64_t(H));
    const Case two = run_cpu(Case(cfg));

    Config one_cfg = cfg;
    one_cfg.add2 = false;
    Case one(one_cfg);
    one.layer_residual = two.layer_residual;
    one.bank = Case(cfg).bank;
    one.res_weight = two.res_weight;
    one.rms_weight = two.rms_weight;
    one.norm_weight = two.norm_weight;
    for (int64_t t = 0; t < cfg.T; ++t)
      for (int64_t h = 0; h < H; ++h) one.add.at(t, h) = bf16_add(two.add.at(t, h), two.add2.at(t, h));
    one = run_cpu(one);

    Config none_cfg = cfg;
    none_cfg.op = N;
    none_cfg.snapshot_slot = -1;
    Case none(none_cfg);
    none.bank = Case(cfg).bank;
    none.res_weight = two.res_weight;
    none.rms_weight = two.rms_weight;
    none.norm_weight = two.norm_weight;
    for (int64_t t = 0; t < cfg.T; ++t)
      for (int64_t h = 0; h < H; ++h) none.layer_residual.at(t, h) = two.updated.at(t, h);
    none = run_cpu(none);

    EXPECT_TRUE(bits_equal(two.updated.bits(), reference(Case(cfg)).updated, "updated vs prefix + (add + add2)"));
    EXPECT_TRUE(bits_equal(one.updated.bits(), two.updated.bits(), "updated (presummed add)"));
    EXPECT_TRUE(bits_equal(one.output.bits(), two.output.bits(), "output (presummed add)"));
    EXPECT_TRUE(bits_equal(one.mixture.bits(), two.mixture.bits(), "mixture (presummed add)"));
    EXPECT_TRUE(bits_equal(bank_row(one, 6), bank_row(two, 6), "snapshot row (presummed add)"));
    EXPECT_TRUE(bits_equal(none.output.bits(), two.output.bits(), "output (materialized prefix)"));
    EXPECT_TRUE(bits_equal(none.mixture.bits(), two.mixture.bits(), "mixture (materialized prefix)"));

    // The persistent op (one addend) computes the same bits as the per-token op on the CPU.
    Config p_cfg = one_cfg;
    p_cfg.op = P;
    p_cfg.tap = false;
    p_cfg.snapshot_slot = -1;
    Case p(p_cfg);
    p.layer_residual = one.layer_residual;
    p.add = one.add;
    p.bank = none.bank;
    p.res_weight = two.res_weight;
    p.rms_weight = two.rms_weight;
    p.norm_weight = two.norm_weight;
    p = run_cpu(p);
    EXPECT_TRUE(bits_equal(p.output.bits(), two.output.bits(), "persistent output"));
    EXPECT_TRUE(bits_equal(p.updated.bits(), two.updated.bits(), "persistent updated"));
  }
}

TEST(CpuSubnormals, PrefixUpdateKeepsSubnormals) {
  // The pattern table itself is PyTorch's arithmetic (fp32 add, bf16 round-to-nearest-even, no flush).
  for (const SubnormalSum& s : kSubnormalSums) EXPECT_EQ(bf16_add(s.prefix, bf16_add(s.add, s.add2)), s.expected);
  const Case before = subnormal_case(test_seed());
  const Case after = run_cpu(before);
  expect_subnormals_kept(before, after);
  EXPECT_TRUE(only_outputs_written(before, after));
}

#if defined(__x86_64__) || defined(_M_X64) || defined(__SSE__)
// MXCSR bit 15 flush-to-zero, bit 6 denormals-are-zero.
unsigned read_fp_mode() { return _mm_getcsr(); }
void write_fp_mode(unsigned mode) { _mm_setcsr(mode); }
constexpr unsigned kFlushModes = 0x8040u;
#elif defined(__aarch64__)
// FPCR bit 24 flush-to-zero.
unsigned read_fp_mode() {
  uint64_t v;
  __asm__ volatile("mrs %0, fpcr" : "=r"(v));
  return static_cast<unsigned>(v);
}
void write_fp_mode(unsigned mode) {
  const uint64_t v = mode;
  __asm__ volatile("msr fpcr, %0" : : "r"(v));
}
constexpr unsigned kFlushModes = 1u << 24;
#else
#error "test_cpu_backend: add the flush-to-zero control of this architecture"
#endif

// A host process may run with FTZ/DAZ on (some libraries set it): the add path still keeps subnormals, the
// whole result is the same as under the default mode, and the caller's mode is restored afterwards.
TEST(CpuSubnormals, CallerFlushToZeroModeIsOverriddenAndRestored) {
  const Case before = subnormal_case(test_seed());
  const Case default_mode = run_cpu(before);

  Case flushed = before;
  const unsigned saved = read_fp_mode();
  write_fp_mode(saved | kFlushModes);
  const unsigned caller_mode = read_fp_mode();
  attnres::run(flushed.cfg.op, flushed.args());
  const unsigned after_call = read_fp_mode();
  write_fp_mode(saved);

  ASSERT_EQ(caller_mode & kFlushModes, kFlushModes) << "the test could not set the flush modes";
  EXPECT_EQ(after_call, caller_mode) << "the caller's floating-point mode was not restored";
  expect_subnormals_kept(before, flushed);
  EXPECT_TRUE(bits_equal(flushed.output.bits(), default_mode.output.bits(), "output under FTZ/DAZ"));
  EXPECT_TRUE(bits_equal(flushed.mixture.bits(), default_mode.mixture.bits(), "mixture under FTZ/DAZ"));

  // The mode is restored even when the call throws.
  write_fp_mode(saved | kFlushModes);
  AttnResArgs bad = flushed.args();
  bad.rms_eps = -1;
  EXPECT_THROW(attnres::run(flushed.cfg.op, bad), attnres::ArgumentError);
  const unsigned after_throw = read_fp_mode();
  write_fp_mode(saved);
  EXPECT_EQ(after_throw, caller_mode);
}

// Identical inputs give identical bits, call after call.
TEST(CpuDeterminism, RepeatedCallsAreBitwiseIdentical) {
  for (AttnResOp op : {R, N, A, P}) {
    Config cfg = make_config(op, 6, 9, 7168, [](Config& c) { c.add2 = c.tap = true; });
    cfg.seed = test_seed(uint64_t(op));
    const Case before(cfg);
    const Case first = run_cpu(before);
    for (int i = 0; i < 2; ++i) {
      const Case again = run_cpu(before);
      EXPECT_TRUE(storage_unchanged(first, again)) << attnres::op_name(op) << " run " << i + 2;
    }
  }
}

// A token's result depends on neither T nor its position in the call.
TEST(CpuDeterminism, TokenResultIndependentOfBatch) {
  Config cfg = make_config(A, 6, 3, 512, [](Config& c) { c.add2 = c.tap = true; });
  cfg.seed = test_seed();
  const Case batch = run_cpu(Case(cfg));
  for (int64_t t = 0; t < cfg.T; ++t) {
    Case one = token_case(batch, t);
    one = run_cpu(one);
    auto row = [&](const Buffer& b, int64_t i) {
      std::vector<uint16_t> out;
      for (int64_t h = 0; h < cfg.H; ++h) out.push_back(b.at(i, h));
      return out;
    };
    EXPECT_TRUE(bits_equal(row(one.output, 0), row(batch.output, t), "output of token " + std::to_string(t)));
    EXPECT_TRUE(bits_equal(row(one.mixture, 0), row(batch.mixture, t), "mixture of token " + std::to_string(t)));
    EXPECT_TRUE(bits_equal(row(one.updated, 0), row(batch.updated, t), "updated of token " + std::to_string(t)));
  }
}

// rms_eps feeds the scoring norm and norm_eps the trailing one: with rows small enough that both matter, the
// result matches the oracle and not the oracle with the two swapped.
TEST(CpuEps, EachEpsFeedsItsOwnNorm) {
  Config cfg = make_config(A, 3, 4, 1024, [](Config& c) {
    c.tap = true;
    c.magnitude = 0.03;
    c.rms_eps = 1e-2;
    c.norm_eps = 3e-3;
  });
  cfg.seed = test_seed();
  const Case before(cfg);
  const Case after = run_cpu(before);
  const Expected right = reference(before);
  const Expected swapped = reference(before, cfg.norm_eps, cfg.rms_eps);
  EXPECT_TRUE(bf16_close(after.output.values(), widen(right.output), "output"));
  EXPECT_FALSE(bf16_close(after.output.values(), widen(swapped.output), "output with swapped eps"));
  EXPECT_TRUE(bf16_close(after.mixture.values(), widen(right.mixture), "mixture"));

  Config r_cfg = make_config(R, 3, 4, 1024, [](Config& c) { c.magnitude = 0.03; c.rms_eps = 1e-2; });
  r_cfg.seed = test_seed(1);
  const Case r_before(r_cfg);
  const Case r_after = run_cpu(r_before);
  EXPECT_TRUE(diag_close(r_after.rsigma.values(), reference(r_before).rsigma, "rsigma"));
  EXPECT_FALSE(diag_close(r_after.rsigma.values(), reference(r_before, 0.0, 0.0).rsigma, "rsigma without eps"));
}

}  // namespace
}  // namespace attnres_test
