// The fused all-reduce site on the CPU entry point (docs/ops/all_reduce.md): all_reduce into the site's addend,
// then attn_res_add_rmsnorm, the same bytes as the two calls made one after the other; a declined attention half
// declines the site naming it; a second addend at site add and a bad site rejected before anything is written.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attnres/all_reduce.hpp"
#include "attnres/error.hpp"
#include "test_util.hpp"

namespace attnres_test {
namespace {

using namespace attnres;

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
};

TEST(AllReduceSite, CpuEqualsAllReduceThenThePlainOp) {
  for (AllReduceSite site : {AllReduceSite::add, AllReduceSite::add2}) {
    SiteCall fused(site, 7), unfused(site, 7);
    all_reduce_attn_res_add_rmsnorm(fused.ar, site, fused.attn());
    all_reduce(unfused.ar);
    attn_res_add_rmsnorm(unfused.attn());
    EXPECT_TRUE(same_storage(fused.reduced, unfused.reduced));
    EXPECT_TRUE(same_storage(fused.c.output, unfused.c.output));
    EXPECT_TRUE(same_storage(fused.c.updated, unfused.c.updated));
    EXPECT_TRUE(same_storage(fused.c.mixture, unfused.c.mixture));
    SiteCall fresh(site, 7);
    EXPECT_FALSE(same_storage(fresh.c.output, fused.c.output));  // the call wrote its outputs
  }
}

TEST(AllReduceSite, DeclinedAttentionHalfDeclinesNamingIt) {
  SiteCall call(AllReduceSite::add, 2);
  Options o;
  o.kernel = KernelKind::split_k;  // a CUDA kernel on CPU tensors
  const std::string attn_decline = plan(AttnResOp::attn_res_add_rmsnorm, call.attn(), o).decline;
  ASSERT_FALSE(attn_decline.empty());
  const AllReducePlan p = plan_all_reduce_attn_res_add_rmsnorm(call.ar, call.site, call.attn(), {}, o);
  EXPECT_EQ(p.decline, "attn_res_add_rmsnorm: " + attn_decline);
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

TEST(AllReduceSite, SiteAddRefusesASecondAddend) {
  SiteCall call(AllReduceSite::add, 4);
  AttnResArgs a = call.attn();
  a.layer_residual_add2 = call.c.add2.ref();
  expect_rejected_unwritten(
      call, [&] { all_reduce_attn_res_add_rmsnorm(call.ar, call.site, a); },
      "all_reduce_attn_res_add_rmsnorm: site add takes one addend (layer_residual_add2 must be absent)");
}

TEST(AllReduceSite, BadSiteRejected) {
  SiteCall call(AllReduceSite::add, 5);
  expect_rejected_unwritten(
      call, [&] { all_reduce_attn_res_add_rmsnorm(call.ar, static_cast<AllReduceSite>(5), call.attn()); },
      "all_reduce_attn_res_add_rmsnorm: site must be add or add2");
}

}  // namespace
}  // namespace attnres_test
