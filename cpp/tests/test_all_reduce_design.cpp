// The fused all-reduce site's design choice (docs/ops/all_reduce.md "How the plan chooses"): the pure design
// step choose_all_reduce_design over synthetic plans of both halves (no GPU needed), and the CPU entry point,
// where both designs are one computation: the same bytes, bad designs and a second addend at site add rejected
// before anything is written.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attnres/all_reduce.hpp"
#include "attnres/error.hpp"
#include "plan_tuning.hpp"
#include "test_util.hpp"

namespace attnres_test {
namespace {

using namespace attnres;

AllReducePlan cuda_ar_plan() {
  AllReducePlan p;
  p.kernel = KernelKind::single_cta;  // the one-shot kernel's plan on a CUDA device
  p.threads = 128;
  p.blocks_per_token = 7;
  return p;
}

Plan attn_plan(KernelKind kernel, int32_t threads) {
  Plan p;
  p.kernel = kernel;
  p.threads = threads;
  p.cluster = kernel == KernelKind::split_k ? 7 : 1;
  p.max_candidates = 9;
  return p;
}

AllReducePlan choose(const AllReducePlan& ar, const Plan& attn, AllReduceDesign d, Fp8Scales fp8 = Fp8Scales::none) {
  return choose_all_reduce_design(ar, attn, fp8, d, 1, 9, 7168, 2);
}

TEST(AllReduceDesign, SplitKRunsEitherDesign) {
  const Plan split = attn_plan(KernelKind::split_k, 128);
  const AllReducePlan one = choose(cuda_ar_plan(), split, AllReduceDesign::one_kernel);
  ASSERT_TRUE(one.accepted()) << one.decline;
  EXPECT_EQ(one.design, AllReduceDesign::one_kernel);
  EXPECT_EQ(one.one_kernel_decline, "");
  const AllReducePlan two = choose(cuda_ar_plan(), split, AllReduceDesign::two_kernels);
  ASSERT_TRUE(two.accepted());
  EXPECT_EQ(two.design, AllReduceDesign::two_kernels);
  // The measured tuning (plan_tuning.hpp): automatic takes two kernels at every T measured (1..32), where one
  // kernel would be accepted.
  const AllReducePlan automatic = choose(cuda_ar_plan(), split, AllReduceDesign::automatic);
  ASSERT_TRUE(automatic.accepted());
  EXPECT_EQ(automatic.design, AllReduceDesign::two_kernels);
  EXPECT_EQ(automatic.one_kernel_decline, "");
  for (int64_t tokens : {1, 4, 8, 32, 33}) {
    EXPECT_EQ(choose_all_reduce_design(cuda_ar_plan(), split, Fp8Scales::none, AllReduceDesign::automatic, tokens, 9,
                                       7168, 2).design,
              tokens <= attnres::tuning::kAutomaticOneKernelMaxTokens ? AllReduceDesign::one_kernel
                                                                       : AllReduceDesign::two_kernels)
        << tokens;
  }
  EXPECT_EQ(choose_all_reduce_design(cuda_ar_plan(), split, Fp8Scales::none, AllReduceDesign::automatic, 1, 9, 7168, 2)
                .design,
            AllReduceDesign::two_kernels);
  // A one-block plan (split_k at H <= 1024, or a small single_cta block) has a one-kernel instance too.
  EXPECT_TRUE(choose(cuda_ar_plan(), attn_plan(KernelKind::single_cta, 128), AllReduceDesign::one_kernel).accepted());
}

TEST(AllReduceDesign, ExplicitOneKernelDeclinesNamingWhy) {
  const struct {
    Plan attn;
    Fp8Scales fp8;
    std::string why;
  } cases[] = {
      {attn_plan(KernelKind::persistent, 256), Fp8Scales::none,
       "design one_kernel: the one-kernel design exists for the per-token kernels (split_k, single_cta); the plan "
       "chose persistent"},
      {attn_plan(KernelKind::split_k, 128), Fp8Scales::per_token,
       "design one_kernel: the one-kernel design has no FP8 output (fp8 per_token)"},
      {attn_plan(KernelKind::single_cta, 896), Fp8Scales::none,
       "design one_kernel: the one-kernel design's one-block instances take blocks of at most 256 threads; the "
       "plan's single_cta block has 896"},
  };
  for (const auto& c : cases) {
    const AllReducePlan explicit_one = choose(cuda_ar_plan(), c.attn, AllReduceDesign::one_kernel, c.fp8);
    EXPECT_FALSE(explicit_one.accepted());
    EXPECT_EQ(explicit_one.decline, c.why);
    EXPECT_EQ(explicit_one.design, AllReduceDesign::automatic);  // nothing runs
    // automatic and two_kernels run the two kernels; automatic records why one kernel could not.
    const AllReducePlan automatic = choose(cuda_ar_plan(), c.attn, AllReduceDesign::automatic, c.fp8);
    ASSERT_TRUE(automatic.accepted());
    EXPECT_EQ(automatic.design, AllReduceDesign::two_kernels);
    EXPECT_EQ("design one_kernel: " + automatic.one_kernel_decline, c.why);
    EXPECT_TRUE(choose(cuda_ar_plan(), c.attn, AllReduceDesign::two_kernels, c.fp8).accepted());
  }
}

TEST(AllReduceDesign, DeclinedHalvesDecline) {
  AllReducePlan ar_declined;
  ar_declined.decline = "world size 3 has no CUDA kernel instance (2, 4 or 8)";
  for (AllReduceDesign d : {AllReduceDesign::automatic, AllReduceDesign::one_kernel, AllReduceDesign::two_kernels}) {
    EXPECT_EQ(choose(ar_declined, attn_plan(KernelKind::split_k, 128), d).decline, ar_declined.decline);
    Plan attn_declined;
    attn_declined.decline = "no kernel";
    EXPECT_EQ(choose(cuda_ar_plan(), attn_declined, d).decline, "attn_res_add_rmsnorm: no kernel");
  }
}

TEST(AllReduceDesign, CpuAcceptsEveryDesign) {
  AllReducePlan cpu;
  cpu.kernel = KernelKind::cpu;
  const Plan attn = attn_plan(KernelKind::cpu, 0);
  for (AllReduceDesign d : {AllReduceDesign::one_kernel, AllReduceDesign::two_kernels}) {
    const AllReducePlan p = choose(cpu, attn, d, Fp8Scales::none);
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.design, d);
  }
}

// ---- the CPU entry point ----

constexpr int64_t kW = 2;

struct SiteCall {
  Case c;
  Buffer reduced;
  std::vector<uint16_t> gathered;
  AllReduceArgs ar;
  AllReduceSite site;

  SiteCall(AllReduceSite s, uint64_t seed) : c(config(s, seed)), site(s) {
    const int64_t T = c.cfg.T, H = c.cfg.H;
    reduced = matrix(DType::bf16, T, H);
    gathered.resize(size_t(kW * T * H));
    for (size_t i = 0; i < gathered.size(); ++i) gathered[i] = f32_to_bf16(0.25f * float(int(i % 37) - 18));
    ar.comm.world_size = kW;
    ar.comm.rank = 0;
    ar.comm.capacity = 4;
    ar.comm.width = H;
    ar.gathered = make_ref(gathered.data(), DType::bf16, Device{}, {kW, T, H});
    ar.output = reduced.ref();
  }
  static Config config(AllReduceSite s, uint64_t seed) {
    Config cfg;
    cfg.T = 3;
    cfg.K = 4;
    cfg.H = 64;
    cfg.add = true;
    cfg.add2 = s == AllReduceSite::add2;
    cfg.tap = true;
    cfg.seed = seed;
    return cfg;
  }
  AttnResArgs attn() const {
    AttnResArgs a = c.args();
    if (site == AllReduceSite::add) a.layer_residual_add = ar.output;
    else a.layer_residual_add2 = ar.output;
    return a;
  }
  void run(AllReduceDesign d) {
    AllReduceOptions o;
    o.design = d;
    all_reduce_attn_res_add_rmsnorm(ar, site, attn(), o);
  }
};

TEST(AllReduceDesign, CpuDesignsAreOneComputation) {
  for (AllReduceSite site : {AllReduceSite::add, AllReduceSite::add2}) {
    SiteCall one(site, 7), two(site, 7), automatic(site, 7);
    one.run(AllReduceDesign::one_kernel);
    two.run(AllReduceDesign::two_kernels);
    automatic.run(AllReduceDesign::automatic);
    for (const SiteCall* x : {&one, &automatic}) {
      EXPECT_TRUE(same_storage(x->reduced, two.reduced));
      EXPECT_TRUE(same_storage(x->c.output, two.c.output));
      EXPECT_TRUE(same_storage(x->c.updated, two.c.updated));
      EXPECT_TRUE(same_storage(x->c.mixture, two.c.mixture));
    }
    SiteCall fresh(site, 7);
    EXPECT_FALSE(same_storage(fresh.c.output, two.c.output));  // the call wrote its outputs
  }
}

void expect_rejected_unwritten(SiteCall& call, const std::function<void()>& run, const std::string& message) {
  const Case before = call.c;
  const Buffer reduced_before = call.reduced;
  try {
    run();
    ADD_FAILURE() << "accepted; expected: " << message;
  } catch (const ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
  EXPECT_TRUE(storage_unchanged(before, call.c)) << message;
  EXPECT_TRUE(same_storage(reduced_before, call.reduced)) << message;
}

TEST(AllReduceDesign, BadDesignRejectedBeforeWriting) {
  SiteCall call(AllReduceSite::add, 3);
  AllReduceOptions o;
  o.design = static_cast<AllReduceDesign>(7);
  const std::string msg = "all_reduce_attn_res_add_rmsnorm: design must be automatic, one_kernel or two_kernels";
  expect_rejected_unwritten(call, [&] { all_reduce_attn_res_add_rmsnorm(call.ar, call.site, call.attn(), o); }, msg);
  expect_rejected_unwritten(
      call, [&] { plan_all_reduce_attn_res_add_rmsnorm(call.ar, call.site, call.attn(), o); }, msg);
}

TEST(AllReduceDesign, SiteAddRefusesASecondAddend) {
  SiteCall call(AllReduceSite::add, 4);
  AttnResArgs a = call.attn();
  a.layer_residual_add2 = call.c.add2.ref();
  for (AllReduceDesign d : {AllReduceDesign::one_kernel, AllReduceDesign::two_kernels}) {
    AllReduceOptions o;
    o.design = d;
    expect_rejected_unwritten(
        call, [&] { all_reduce_attn_res_add_rmsnorm(call.ar, call.site, a, o); },
        "all_reduce_attn_res_add_rmsnorm: site add takes one addend (layer_residual_add2 must be absent)");
  }
}

TEST(AllReduceDesign, BadSiteRejected) {
  SiteCall call(AllReduceSite::add, 5);
  expect_rejected_unwritten(
      call, [&] { all_reduce_attn_res_add_rmsnorm(call.ar, static_cast<AllReduceSite>(5), call.attn()); },
      "all_reduce_attn_res_add_rmsnorm: site must be add or add2");
}

TEST(AllReduceDesign, DesignNames) {
  EXPECT_STREQ(all_reduce_design_name(AllReduceDesign::automatic), "automatic");
  EXPECT_STREQ(all_reduce_design_name(AllReduceDesign::one_kernel), "one_kernel");
  EXPECT_STREQ(all_reduce_design_name(AllReduceDesign::two_kernels), "two_kernels");
}

}  // namespace
}  // namespace attnres_test
