// The plan names what runs: its route (per_token, stream, persistent, cpu; none when declined) and, when it
// declines, a decline code beside the sentence; in-place calls (updated is layer_residual) never take the
// persistent kernel's two-pass geometry; and run() records the plan it launched (detail::last_launch), which is
// the plan plan(op, args) returns for the call. Hand-built devices and the CPU backend: any machine.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "plan_arithmetic.hpp"
#include "plan_test_util.hpp"

namespace attnres {
inline void PrintTo(Route r, std::ostream* os) { *os << route_name(r); }
inline void PrintTo(DeclineCode c, std::ostream* os) { *os << decline_code_name(c); }
}  // namespace attnres

namespace attnres_test {
namespace {

using attnres::DeclineCode;
using attnres::Route;

DeviceInfo cpu_device() { return described_cpu(/*cuda_backend=*/true); }

DeviceInfo h200() { return described_h200(); }

PlanQuery query(AttnResOp op, int64_t T, int64_t N, int64_t H, bool add = false) {
  return plan_query_of(op, T, N, H, add, /*diagnostics=*/op == AttnResOp::attn_res);
}

Options kernel(KernelKind k) {
  Options o;
  o.kernel = k;
  return o;
}

Options topology(Topology t) {
  Options o;
  o.topology = t;
  return o;
}

constexpr auto kAdd = AttnResOp::attn_res_add_rmsnorm;
constexpr auto kPersistentOp = AttnResOp::attn_res_add_rmsnorm_persistent;

void expect_accepted(const Plan& p, KernelKind k, Route r) {
  EXPECT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.kernel, k);
  EXPECT_EQ(p.route, r);
  EXPECT_EQ(p.decline_code, DeclineCode::none);
}

void expect_declined(const Plan& p, DeclineCode code, const std::string& fragment = "") {
  EXPECT_FALSE(p.accepted());
  EXPECT_EQ(p.kernel, KernelKind::automatic);
  EXPECT_EQ(p.route, Route::none);
  EXPECT_EQ(p.decline_code, code) << p.decline;
  EXPECT_TRUE(contains(p.decline, fragment));
}

TEST(PlanRoute, EveryAcceptedPlanNamesItsRoute) {
  expect_accepted(attnres::plan(query(kAdd, 5, 3, 7168, true), cpu_device()), KernelKind::cpu, Route::cpu);
  // split_k, and single_cta one token per block: the per-token route.
  expect_accepted(attnres::plan(query(kAdd, 1, 9, 7168, true), h200()), KernelKind::split_k, Route::per_token);
  const Plan one_block = attnres::plan(query(kAdd, 8, 2, 7168, true), h200(), kernel(KernelKind::single_cta));
  expect_accepted(one_block, KernelKind::single_cta, Route::per_token);
  EXPECT_EQ(one_block.smem_bytes, 0);
  // single_cta streaming past one token per SM: the stream route (the same KernelKind, forced or automatic).
  const Plan streaming = attnres::plan(query(kAdd, 4096, 2, 7168, true), h200());
  expect_accepted(streaming, KernelKind::single_cta, Route::stream);
  EXPECT_GT(streaming.smem_bytes, 0);
  expect_accepted(attnres::plan(query(kAdd, 4096, 2, 7168, true), h200(), kernel(KernelKind::single_cta)),
                  KernelKind::single_cta, Route::stream);
  // The persistent kernel, automatic and forced.
  expect_accepted(attnres::plan(query(kAdd, 4096, 9, 7168, true), h200()), KernelKind::persistent,
                  Route::persistent);
  expect_accepted(attnres::plan(query(kPersistentOp, 1, 9, 7168, true), h200()), KernelKind::persistent,
                  Route::persistent);
  // FP8: single_cta streams it too, block128 only where its 128-column groups align with split_k's chunks
  // (H = 7168: 128 vectors; H = 4608: 116).
  PlanQuery fp8 = query(kAdd, 4096, 2, 7168, true);
  for (Fp8Scales mode : {Fp8Scales::per_token, Fp8Scales::block128}) {
    fp8.fp8 = mode;
    expect_accepted(attnres::plan(fp8, h200(), kernel(KernelKind::single_cta)), KernelKind::single_cta,
                    Route::stream);
  }
  fp8.hidden = 4608;
  expect_accepted(attnres::plan(fp8, h200(), kernel(KernelKind::single_cta)), KernelKind::single_cta,
                  Route::per_token);
  fp8.fp8 = Fp8Scales::per_token;
  expect_accepted(attnres::plan(fp8, h200(), kernel(KernelKind::single_cta)), KernelKind::single_cta,
                  Route::stream);
}

TEST(PlanRoute, RouteFollowsTheGeometryEverywhere) {
  for (AttnResOp op : {AttnResOp::attn_res, AttnResOp::attn_res_rmsnorm, kAdd, kPersistentOp})
    for (int64_t T : {1, 64, 133, 4096})
      for (int64_t N : {1, 2, 5, 9, 16})
        for (int64_t H : {8, 1024, 7168, 16384})
          for (KernelKind k : {KernelKind::automatic, KernelKind::single_cta, KernelKind::split_k}) {
            const Plan p = attnres::plan(query(op, T, N, H, op == kAdd || op == kPersistentOp), h200(), kernel(k));
            SCOPED_TRACE(std::string(attnres::op_name(op)) + " T=" + std::to_string(T) + " N=" +
                         std::to_string(N) + " H=" + std::to_string(H));
            if (!p.accepted()) {
              EXPECT_EQ(p.route, Route::none);
              EXPECT_NE(p.decline_code, DeclineCode::none);
              continue;
            }
            EXPECT_EQ(p.decline_code, DeclineCode::none);
            const Route want = p.kernel == KernelKind::persistent ? Route::persistent
                               : p.kernel == KernelKind::single_cta && p.smem_bytes > 0 ? Route::stream
                                                                                        : Route::per_token;
            EXPECT_EQ(p.route, want);
          }
}

TEST(PlanRoute, NamesAreDistinct) {
  std::vector<std::string> names;
  for (int c = 0; c <= static_cast<int>(DeclineCode::split_k_threads); ++c)
    names.push_back(attnres::decline_code_name(static_cast<DeclineCode>(c)));
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_NE(names[i], "unknown_decline_code");
    for (size_t j = 0; j < i; ++j) EXPECT_NE(names[i], names[j]);
  }
  EXPECT_STREQ(attnres::route_name(Route::stream), "stream");
  EXPECT_STREQ(attnres::route_name(Route::none), "none");
}

// One code per reason the plan declines (the persistent_not_resident decline needs a GPU's occupancy
// calculator: tests/ops/test_plan_equals_launch.py).
TEST(PlanDeclineCode, EveryReasonHasItsCode) {
  expect_declined(attnres::plan(query(kAdd, 0, 3, 64, true), h200()), DeclineCode::bad_shape, "T must be >= 1");
  expect_declined(attnres::plan(query(kAdd, 1, 17, 64, true), h200()), DeclineCode::bad_shape, "N must be in");
  expect_declined(attnres::plan(query(kAdd, 1, 3, 65, true), h200()), DeclineCode::bad_shape, "multiple of 8");

  PlanQuery q = query(kAdd, 1, 3, 128, true);
  q.fp8 = static_cast<Fp8Scales>(7);
  expect_declined(attnres::plan(q, h200()), DeclineCode::bad_fp8_mode, "not an FP8 mode");
  q.fp8 = Fp8Scales::none;
  q.fp8_pow2_scales = true;
  expect_declined(attnres::plan(q, h200()), DeclineCode::fp8_pow2_without_fp8);
  PlanQuery a = query(AttnResOp::attn_res, 1, 3, 128);
  a.fp8 = Fp8Scales::per_token;
  expect_declined(attnres::plan(a, h200()), DeclineCode::fp8_without_norm);
  PlanQuery b = query(kAdd, 1, 3, 72, true);
  b.fp8 = Fp8Scales::block128;
  expect_declined(attnres::plan(b, h200()), DeclineCode::fp8_block128_hidden);

  PlanQuery tap = query(kAdd, 64, 5, 7168, true);
  tap.tap = true;
  for (const DeviceInfo& dev : {cpu_device(), h200()})
    expect_declined(attnres::plan(tap, dev, topology(Topology::persistent)),
                    DeclineCode::persistent_unsupported_feature, "pre-norm mixture tap");
  expect_declined(attnres::plan(query(AttnResOp::attn_res, 4, 3, 64), h200(), kernel(KernelKind::persistent)),
                  DeclineCode::persistent_unsupported_feature, "fp32 diagnostics");

  expect_declined(attnres::plan(query(kAdd, 4, 3, 64, true), cpu_device(), kernel(KernelKind::split_k)),
                  DeclineCode::cuda_kernel_on_cpu);
  DeviceInfo no_backend = h200();
  no_backend.cuda_backend = false;
  expect_declined(attnres::plan(query(kAdd, 4, 3, 64, true), no_backend), DeclineCode::no_cuda_backend);
  DeviceInfo ampere = h200();
  ampere.cc_major = 8;
  expect_declined(attnres::plan(query(kAdd, 4, 3, 64, true), ampere), DeclineCode::compute_capability);
  expect_declined(attnres::plan(query(kAdd, 4, 3, 64, true), h200(), kernel(KernelKind::cpu)),
                  DeclineCode::cpu_kernel_on_cuda);
  expect_declined(attnres::plan(query(kAdd, tuning::kMaxTokensPerLaunch + 1, 3, 64, true), h200()),
                  DeclineCode::too_many_tokens);

  Options two = topology(Topology::persistent);
  two.persistent_blocks_per_sm = 2;
  expect_declined(attnres::plan(query(kAdd, 64, 3, 16384, true), h200(), two),
                  DeclineCode::persistent_two_blocks_threads);
  expect_declined(attnres::plan(query(kAdd, 64, 3, 16384, true), described_h200(40000), topology(Topology::persistent)),
                  DeclineCode::persistent_shared_memory);
  Options slots = topology(Topology::persistent);
  slots.persistent_slots = 64;
  expect_declined(attnres::plan(query(kAdd, 64, 3, 7168, true), h200(), slots), DeclineCode::persistent_slots);
  Options one_pass = topology(Topology::persistent);
  one_pass.persistent_passes = 1;
  expect_declined(attnres::plan(query(kAdd, 64, 16, 16384, true), h200(), one_pass),
                  DeclineCode::persistent_one_pass);

  expect_declined(attnres::plan(query(kAdd, 4, 9, 7168, true), h200(), kernel(KernelKind::single_cta)),
                  DeclineCode::single_cta_too_large);
  Options small_cluster = kernel(KernelKind::split_k);
  small_cluster.cluster = 1;
  expect_declined(attnres::plan(query(kAdd, 4, 3, 16384, true), h200(), small_cluster),
                  DeclineCode::split_k_threads);
}

// ------------------------------------------------------------------------------------- plan = launch (CPU)
// A described device is planned by the arithmetic alone (no occupancy calculator: no GPU needed).
TEST(PlanEqualsLaunch, DescribedDevicesArePlannedByTheArithmetic) {
  const DeviceInfo described = attnres::described_device("h200");
  EXPECT_FALSE(described.queried);
  for (int64_t T : {1, 256, 4096})
    for (int64_t N : {2, 5, 9})
      for (int32_t per_sm : {0, 1, 2}) {
        Options o;
        o.persistent_blocks_per_sm = per_sm;
        const PlanQuery q = query(kAdd, T, N, 7168, true);
        const Plan p = attnres::plan(q, described, o);
        const Plan arithmetic = attnres::detail::plan_arithmetic(q, described, o);
        EXPECT_EQ(p.kernel, arithmetic.kernel);
        EXPECT_EQ(p.route, arithmetic.route);
        EXPECT_EQ(p.blocks_per_sm, arithmetic.blocks_per_sm);
        EXPECT_EQ(p.slots, arithmetic.slots);
        EXPECT_EQ(p.decline, arithmetic.decline);
      }
  EXPECT_FALSE(attnres::query_device(Device{DeviceType::cpu, 0}).queried);
}

TEST(PlanEqualsLaunch, RunRecordsTheCpuPlan) {
  Config cfg;
  cfg.T = 3;
  cfg.K = 4;
  cfg.H = 64;
  Case c(cfg);
  const AttnResArgs a = c.args();
  const uint64_t before = attnres::detail::last_launch().launches;
  attnres::run(kAdd, a, Options{});
  const attnres::detail::LaunchRecord& r = attnres::detail::last_launch();
  EXPECT_EQ(r.launches, before + 1);
  EXPECT_EQ(r.plan.kernel, KernelKind::cpu);
  EXPECT_EQ(r.plan.route, Route::cpu);
  EXPECT_TRUE(r.plan.accepted());
  const Plan planned = attnres::plan(kAdd, a, Options{});
  EXPECT_EQ(planned.route, r.plan.route);
  EXPECT_EQ(planned.kernel, r.plan.kernel);

  // A declined call and a rejected one launch nothing and leave the record as it was.
  EXPECT_FALSE(
      error_of<attnres::UnsupportedError>([&] { attnres::run(kAdd, a, kernel(KernelKind::split_k)); }).empty());
  AttnResArgs bad = a;
  bad.rms_eps = -1;
  EXPECT_FALSE(error_of<attnres::ArgumentError>([&] { attnres::run(kAdd, bad, Options{}); }).empty());
  EXPECT_EQ(attnres::detail::last_launch().launches, before + 1);
  EXPECT_EQ(attnres::detail::last_launch().plan.route, Route::cpu);
}

}  // namespace
}  // namespace attnres_test
