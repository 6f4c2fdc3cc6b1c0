// The plan table: attnres::plan(PlanQuery, DeviceInfo, Options) is a pure function, so it is tested with
// hand-built devices (a CPU, an H200, an A100, a CUDA device without the backend) on any machine.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "plan_test_util.hpp"

namespace attnres_test {
namespace {

// The CPU backend is chosen for CPU tensors whatever the build.
DeviceInfo cpu_device() { return described_cpu(/*cuda_backend=*/true); }

DeviceInfo h200() { return described_h200(); }

DeviceInfo a100() {
  DeviceInfo d = h200();
  d.cc_major = 8;
  d.cc_minor = 0;
  d.sm_count = 108;
  d.name = "NVIDIA A100-SXM4-80GB";
  return d;
}

DeviceInfo h200_without_backend() {
  DeviceInfo d = h200();
  d.cuda_backend = false;
  return d;
}

PlanQuery query(AttnResOp op, int64_t T, int64_t N, int64_t H) {
  return plan_query_of(op, T, N, H, /*add=*/op == AttnResOp::attn_res_add_rmsnorm,
                       /*diagnostics=*/op == AttnResOp::attn_res);
}

const AttnResOp kPerTokenOps[] = {AttnResOp::attn_res, AttnResOp::attn_res_rmsnorm, AttnResOp::attn_res_add_rmsnorm};
const int64_t kHidden[] = {8, 64, 72, 1024, 2304, 4096, 7168, 8192, 8200, 12288, 16384};

// The automatic per-token choice the table should make on the H200 (the devices of these tests): single_cta where
// one block holds the token's rows AND the H200 measurement (tuning::prefer_single_cta, the same with or without
// the addend there) favours it, split_k otherwise.
KernelKind automatic_kernel(int64_t T, int64_t N, int64_t H) {
  const bool fits = H / 8 <= tuning::kSingleCtaMaxThreads && N <= tuning::kSingleCtaMaxCandidates;
  const bool streams = tuning::prefer_single_cta(T, N, H, /*add=*/true, tuning::TopologyGrid::h200);
  EXPECT_EQ(streams, tuning::prefer_single_cta(T, N, H, /*add=*/false, tuning::TopologyGrid::h200));
  return fits && streams ? KernelKind::single_cta : KernelKind::split_k;
}

bool same_plan(const Plan& a, const Plan& b) {
  return a.kernel == b.kernel && a.decline == b.decline && a.cluster == b.cluster && a.threads == b.threads &&
         a.vectors == b.vectors && a.max_candidates == b.max_candidates && a.pdl == b.pdl;
}

TEST(PlanCpu, EveryOpRunsOnTheCpuBackend) {
  for (AttnResOp op : kPerTokenOps) {
    const Plan p = attnres::plan(query(op, 5, 3, 7168), cpu_device());
    EXPECT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.kernel, KernelKind::cpu);
  }
  PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm_persistent, 1000, 13, 7168);
  q.add = true;
  EXPECT_EQ(attnres::plan(q, cpu_device()).kernel, KernelKind::cpu);
}

TEST(PlanCpu, ForcingACudaKernelOnCpuTensorsDeclines) {
  for (KernelKind k : {KernelKind::single_cta, KernelKind::split_k, KernelKind::persistent}) {
    Options o;
    o.kernel = k;
    const Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 2, 3, 64), cpu_device(), o);
    EXPECT_FALSE(p.accepted());
    EXPECT_EQ(p.kernel, KernelKind::automatic);
    EXPECT_TRUE(contains(p.decline, std::string("kernel ") + attnres::kernel_name(k) + " runs on CUDA devices"));
  }
  Options o;
  o.kernel = KernelKind::cpu;
  EXPECT_EQ(attnres::plan(query(AttnResOp::attn_res_rmsnorm, 2, 3, 64), cpu_device(), o).kernel, KernelKind::cpu);
}

TEST(PlanCuda, OlderThanHopperDeclinesWithTheReason) {
  const Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 3, 7168), a100());
  EXPECT_FALSE(p.accepted());
  EXPECT_EQ(p.kernel, KernelKind::automatic);
  EXPECT_EQ(p.decline,
            "cuda:0 (NVIDIA A100-SXM4-80GB) has compute capability 8.0; the CUDA kernels need 9.0 (Hopper) or newer");
}

TEST(PlanCuda, BuildWithoutCudaBackendDeclines) {
  const Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm, 1, 3, 7168), h200_without_backend());
  EXPECT_FALSE(p.accepted());
  EXPECT_EQ(p.decline, "attnres was built without the CUDA backend");
}

TEST(PlanCuda, ForcingTheCpuKernelOnCudaTensorsDeclines) {
  Options o;
  o.kernel = KernelKind::cpu;
  const Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 3, 7168), h200(), o);
  EXPECT_EQ(p.decline, "kernel cpu runs on CPU tensors; the tensors are on cuda:0");
}

TEST(PlanCuda, TokensBeyondOneLaunchDecline) {
  const Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, (int64_t{1} << 26) + 1, 3, 7168), h200());
  EXPECT_FALSE(p.accepted());
  EXPECT_TRUE(contains(p.decline, "exceeds the per-launch limit of 67108864 tokens"));
  EXPECT_TRUE(attnres::plan(query(AttnResOp::attn_res_rmsnorm, int64_t{1} << 26, 3, 7168), h200()).accepted());
}

// Kimi K3 (H = 7168): split_k from N = 5 always (single_cta cannot hold more rows: the reference stacks'
// N <= 4 / N >= 5 boundary); at N <= 4 the H200 measurement in plan_tuning.hpp decides, for every op alike.
TEST(PlanCuda, SplitKFromFiveCandidatesMeasuredChoiceBelow) {
  for (AttnResOp op : kPerTokenOps)
    for (int64_t N = 1; N <= 16; ++N)
      for (int64_t T : {1, 8, 32}) {
        const Plan p = attnres::plan(query(op, T, N, 7168), h200());
        ASSERT_TRUE(p.accepted()) << p.decline;
        if (N >= 5) {
          EXPECT_EQ(p.kernel, KernelKind::split_k) << attnres::op_name(op) << " N=" << N << " T=" << T;
        }
        EXPECT_EQ(p.kernel, automatic_kernel(T, N, 7168)) << attnres::op_name(op) << " N=" << N << " T=" << T;
      }
}

// split_k on a cluster runs the instance built for N itself from N = 3, with or without the FP8 epilogue; a
// cluster of one block (H <= 1024) runs the one-block instance of N's bucket.
TEST(PlanCuda, ExactInstancesForClusters) {
  for (int64_t N = 1; N <= 16; ++N) {
    const int32_t want = N >= 3 ? static_cast<int32_t>(N) : tuning::candidate_bucket(N);
    PlanQuery q = query(AttnResOp::attn_res_rmsnorm, 2, N, 7168);
    Options o;
    o.kernel = KernelKind::split_k;
    for (Fp8Scales f : {Fp8Scales::none, Fp8Scales::per_token, Fp8Scales::block128}) {
      q.fp8 = f;
      const Plan p = attnres::plan(q, h200(), o);
      ASSERT_TRUE(p.accepted()) << p.decline;
      EXPECT_GT(p.cluster, 1);
      EXPECT_EQ(p.max_candidates, want) << "N=" << N << " fp8 " << static_cast<int>(f);
    }
    const Plan one_block = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 2, N, 1024), h200(), o);
    ASSERT_TRUE(one_block.accepted()) << one_block.decline;
    EXPECT_EQ(one_block.cluster, 1);
    EXPECT_EQ(one_block.max_candidates, tuning::candidate_bucket(N)) << "N=" << N;
  }
}

// The automatic choice over every supported shape class: the persistent kernel exactly where its rule
// (tuning::automatic_prefers_persistent, on the plan's geometry) takes it, the per-token choice elsewhere.
TEST(PlanCuda, AutomaticChoiceFollowsTheTuningRule) {
  for (int64_t H : kHidden)
    for (int64_t N = 1; N <= 16; ++N)
      for (int64_t T : {1, 2, 8, 32, 1000, 5000}) {
        const Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, T, N, H), h200());
        ASSERT_TRUE(p.accepted()) << "H=" << H << " N=" << N << ": " << p.decline;
        const bool persistent = p.kernel == KernelKind::persistent;
        EXPECT_EQ(persistent, tuning::automatic_prefers_persistent(T, N, H, false, p.blocks_per_sm == 2) &&
                                  automatic_kernel(T, N, H) != KernelKind::single_cta)
            << "H=" << H << " N=" << N << " T=" << T;
        if (!persistent) EXPECT_EQ(p.kernel, automatic_kernel(T, N, H)) << "H=" << H << " N=" << N << " T=" << T;
      }
}

// Launch geometry of every accepted per-token plan: the blocks of a token cover its H (8 elements per
// thread-vector), blocks are whole warps, and within the kernels' compiled limits.
TEST(PlanCuda, GeometryCoversHiddenWithinLimits) {
  for (KernelKind forced : {KernelKind::automatic, KernelKind::single_cta, KernelKind::split_k})
    for (int64_t H : kHidden)
      for (int64_t N = 1; N <= 16; ++N)
        for (bool pdl : {true, false}) {
          Options o;
          o.kernel = forced;
          o.pdl = pdl;
          const Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm, 4, N, H), h200(), o);
          if (!p.accepted()) {
            // Only single_cta may decline, and only outside what one block's registers hold.
            EXPECT_EQ(forced, KernelKind::single_cta) << "H=" << H << " N=" << N << ": " << p.decline;
            EXPECT_TRUE(H > tuning::kSingleCtaMaxThreads * 8 || N > tuning::kSingleCtaMaxCandidates)
                << "H=" << H << " N=" << N << ": " << p.decline;
            continue;
          }
          SCOPED_TRACE("H=" + std::to_string(H) + " N=" + std::to_string(N) + " kernel " + attnres::kernel_name(p.kernel));
          ASSERT_TRUE(p.kernel == KernelKind::single_cta || p.kernel == KernelKind::split_k);
          if (forced != KernelKind::automatic) { EXPECT_EQ(p.kernel, forced); }
          EXPECT_GE(int64_t{p.cluster} * p.threads * p.vectors * 8, H);
          EXPECT_GT(p.threads, 0);
          EXPECT_EQ(p.threads % 32, 0);
          EXPECT_GE(p.vectors, 1);
          // split_k on a cluster from N = 3: the instance built for N itself; otherwise the smallest compiled
          // bucket that holds N (registers per thread scale with the bucket).
          int32_t bucket = 0;
          for (int32_t b : tuning::kCandidateBuckets)
            if (bucket == 0 && b >= N) bucket = b;
          EXPECT_EQ(p.max_candidates, p.kernel == KernelKind::split_k && p.cluster > 1 && N >= 3 ? N : bucket);
          EXPECT_EQ(p.pdl, pdl);
          if (p.kernel == KernelKind::single_cta) {
            EXPECT_EQ(p.cluster, 1);
            EXPECT_LE(p.threads, 1024);  // the block limit
            EXPECT_LE(p.threads, tuning::kSingleCtaMaxThreads);
            EXPECT_LE(N, tuning::kSingleCtaMaxCandidates);
          } else {
            EXPECT_GE(p.cluster, 1);
            EXPECT_LE(p.cluster, tuning::kMaxCluster);
            EXPECT_LE(tuning::kMaxCluster, 16);  // Hopper's non-portable cluster limit
            EXPECT_LE(p.threads, 256);
            EXPECT_LE(p.threads, tuning::kSplitKMaxThreads);
            // Every block of the cluster owns at least one vector of the row.
            EXPECT_LE(p.cluster, H / 8);
          }
        }
}

TEST(PlanCuda, SingleCtaDeclinesBeyondOneBlock) {
  Options o;
  o.kernel = KernelKind::single_cta;
  const int64_t max_h = tuning::kSingleCtaMaxThreads * 8, max_n = tuning::kSingleCtaMaxCandidates;
  const std::string why = "single_cta holds a token's rows in one block's registers: it needs H <= " +
                          std::to_string(max_h) + " and N <= " + std::to_string(max_n) + " (use split_k)";
  EXPECT_EQ(attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, max_n + 1, 7168), h200(), o).decline, why);
  EXPECT_EQ(attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 2, max_h + 8), h200(), o).decline, why);
  EXPECT_TRUE(attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, max_n, max_h), h200(), o).accepted());
  // The kernels' hard limits: one block of at most 1024 threads, the 16-candidate bucket.
  EXPECT_LE(max_h, 8192);
  EXPECT_LE(max_n, 16);
}

// A one-block launch (single_cta; split_k at a cluster of one) lays split_k's rank chunks out one per 128
// threads, so it reduces in split_k's order: split_k_cluster(H) - 1 full 128-thread chunks and the last chunk
// in whole warps. The layout needs every chunk to fit 128 threads.
TEST(PlanCuda, OneBlockLaunchesLayOutSplitKChunks) {
  Options single;
  single.kernel = KernelKind::single_cta;
  Options one;
  one.kernel = KernelKind::split_k;
  one.cluster = 1;
  for (int64_t H = 8; H <= 8192; H += 8) {
    SCOPED_TRACE("H=" + std::to_string(H));
    const int32_t chunks = tuning::split_k_cluster(H), chunk = tuning::split_k_chunk(H);
    ASSERT_LE(chunk, tuning::kSplitKBlockVectors);
    const int32_t threads = (chunks - 1) * 128 + (chunk + 31) / 32 * 32;
    const Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 3, 4, H), h200(), single);
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.cluster, 1);
    EXPECT_EQ(p.threads, threads);
    const Plan q = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 3, 9, H), h200(), one);
    EXPECT_EQ(q.accepted(), threads <= 256) << q.decline;
    if (q.accepted()) { EXPECT_EQ(q.threads, threads); }
  }
  // H = 2048: two chunks of 128 vectors take 256 threads; H = 7176: eight chunks of 113 take 1024.
  EXPECT_EQ(tuning::split_k_chunk(2048), 128);
  EXPECT_EQ(attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 9, 2048), h200(), one).threads, 256);
  EXPECT_EQ(attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 2, 7176), h200(), single).threads, 1024);
}

TEST(PlanTuning, BucketsAscendAndCoverTheSupportedRange) {
  int32_t previous = 0;
  for (int32_t b : tuning::kCandidateBuckets) {
    EXPECT_GT(b, previous);
    previous = b;
  }
  EXPECT_EQ(previous, attnres::kMaxCandidates);
  EXPECT_EQ(sizeof tuning::kCandidateBuckets / sizeof tuning::kCandidateBuckets[0],
            static_cast<size_t>(tuning::kNumCandidateBuckets));
}

TEST(PlanCuda, AutomaticChoiceAvoidsSingleCtaWhereItCannotRun) {
  // Whatever the measurement prefers, H = 16384 does not fit one block: split_k.
  const Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 2, 16384), h200());
  EXPECT_EQ(p.kernel, KernelKind::split_k);
}

TEST(PlanCuda, ClusterOverride) {
  Options o;
  o.kernel = KernelKind::split_k;
  o.cluster = 4;
  Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 6, 4096), h200(), o);
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.cluster, 4);
  EXPECT_EQ(p.threads, 128);  // 512 vectors over 4 blocks

  // A cluster wider than the row's vectors shrinks to one vector per block.
  o.cluster = tuning::kMaxCluster;
  p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 6, 32), h200(), o);
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.cluster, 4);
  EXPECT_EQ(p.threads, 32);

  // Too small a cluster for the 256-thread split_k blocks declines and says what to do.
  o.cluster = 1;
  p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 6, 7168), h200(), o);
  EXPECT_FALSE(p.accepted());
  EXPECT_TRUE(contains(p.decline, "split_k with a cluster of 1 needs 896 threads per block for H = 7168"));
  EXPECT_TRUE(contains(p.decline, "use a larger cluster"));
}

TEST(PlanCuda, SplitKDefaultClusterScalesWithHidden) {
  Options o;
  o.kernel = KernelKind::split_k;
  for (int64_t H : kHidden) {
    const Plan p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 8, H), h200(), o);
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_LE(p.cluster, 8) << "H=" << H << ": the default stays within the portable cluster size";
  }
}

// The persistent topology streams whole tokens: it declines the tap on every device; it takes one addend or two
// (the second streamed as one more row) and writes the snapshot row.
TEST(PlanTopology, PersistentDeclinesTheTapOnEveryDevice) {
  Options o;
  o.topology = Topology::persistent;
  for (const DeviceInfo& dev : {cpu_device(), h200(), a100(), h200_without_backend()}) {
    SCOPED_TRACE(dev.name + (dev.cuda_backend ? "" : " (no backend)"));
    PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm, 64, 5, 7168);
    q.add2 = true;
    Plan p = attnres::plan(q, dev, o);
    EXPECT_NE(p.decline_code, attnres::DeclineCode::persistent_unsupported_feature) << p.decline;
    if (dev.cuda_backend && dev.cc_major >= 9) {
      EXPECT_EQ(p.kernel, KernelKind::persistent);
    }
    q.add2 = false;
    q.tap = true;
    EXPECT_EQ(attnres::plan(q, dev, o).decline, "the persistent kernel does not emit the pre-norm mixture tap");
    q.tap = false;
    q.snapshot = true;
    EXPECT_NE(attnres::plan(q, dev, o).decline_code, attnres::DeclineCode::persistent_unsupported_feature);
    if (dev.cuda_backend && dev.cc_major >= 9) {
      EXPECT_EQ(attnres::plan(q, dev, o).kernel, KernelKind::persistent);
    }

    // The persistent op is always on the persistent topology, whatever the options say.
    PlanQuery pq = query(AttnResOp::attn_res_add_rmsnorm_persistent, 8, 5, 7168);
    pq.add = true;
    pq.tap = true;
    EXPECT_EQ(attnres::plan(pq, dev, Options{}).decline, "the persistent kernel does not emit the pre-norm mixture tap");
    // Forcing the persistent kernel is the same route.
    Options forced;
    forced.kernel = KernelKind::persistent;
    q.snapshot = false;
    q.tap = true;
    EXPECT_TRUE(contains(attnres::plan(q, dev, forced).decline, "does not emit the pre-norm mixture tap"));
  }
}

// attn_res emits the fp32 diagnostics, which only the per-token kernels produce: topologies never route it to
// the persistent kernel, and forcing that kernel declines instead of reporting a kernel that will not run.
TEST(PlanTopology, AttnResStaysPerToken) {
  Options o;
  o.topology = Topology::persistent;
  Plan p = attnres::plan(query(AttnResOp::attn_res, 4096, 3, 7168), h200(), o);
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.kernel, automatic_kernel(4096, 3, 7168));
  o.topology = Topology::split;
  o.split_max_tokens = 0;
  EXPECT_EQ(attnres::plan(query(AttnResOp::attn_res, 4096, 7, 7168), h200(), o).kernel, KernelKind::split_k);

  Options forced;
  forced.kernel = KernelKind::persistent;
  p = attnres::plan(query(AttnResOp::attn_res, 4096, 3, 7168), h200(), forced);
  EXPECT_FALSE(p.accepted()) << "planned kernel " << attnres::kernel_name(p.kernel);
  EXPECT_NE(p.kernel, KernelKind::persistent);
}

// split: per-token kernels up to split_max_tokens tokens, the persistent route above (seen through its decline
// of the tap, which holds on every device).
TEST(PlanTopology, SplitRoutesByTokenCount) {
  for (int64_t ceiling : {0, 1, 32, 100}) {
    Options o;
    o.topology = Topology::split;
    o.split_max_tokens = ceiling;
    for (int64_t T : {int64_t{1}, ceiling, ceiling + 1, 4 * ceiling + 7}) {
      if (T < 1) continue;
      PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm, T, 3, 7168);
      q.tap = true;
      for (const DeviceInfo& dev : {h200(), cpu_device()}) {
        const Plan p = attnres::plan(q, dev, o);
        if (T <= ceiling) {
          ASSERT_TRUE(p.accepted()) << "T=" << T << " ceiling=" << ceiling << ": " << p.decline;
          EXPECT_EQ(p.kernel, dev.device.type == DeviceType::cpu ? KernelKind::cpu : automatic_kernel(T, 3, 7168));
        } else {
          EXPECT_TRUE(contains(p.decline, "does not emit the pre-norm mixture tap")) << "T=" << T << " ceiling="
                                                                                     << ceiling;
        }
      }
    }
  }
}

TEST(PlanTopology, PerTokenIgnoresTheCeiling) {
  Options o;
  o.topology = Topology::per_token;
  o.split_max_tokens = 1;
  PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm, 5000, 6, 7168);
  q.add2 = q.tap = q.snapshot = true;
  const Plan p = attnres::plan(q, h200(), o);
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.kernel, KernelKind::split_k);
}

TEST(PlanTopology, ForcedPerTokenKernelOverridesTheTopology) {
  Options o;
  o.topology = Topology::persistent;
  o.kernel = KernelKind::split_k;
  PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm, 5000, 2, 7168);
  q.add2 = true;
  const Plan p = attnres::plan(q, h200(), o);
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.kernel, KernelKind::split_k);
}

TEST(PlanOptions, InvalidOptionsThrowArgumentError) {
  Options o;
  o.split_max_tokens = -1;
  for (const DeviceInfo& dev : {cpu_device(), h200()}) {
    EXPECT_EQ(error_of<attnres::ArgumentError>([&] { attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 2, 64), dev, o); }),
              "attn_res_rmsnorm: options.split_max_tokens must be >= 0");
  }
  for (int32_t cluster : {-1, tuning::kMaxCluster + 1, 1000}) {
    Options c;
    c.cluster = cluster;
    EXPECT_EQ(error_of<attnres::ArgumentError>([&] { attnres::plan(query(AttnResOp::attn_res, 1, 2, 64), cpu_device(), c); }),
              "attn_res: options.cluster must be in [0, " + std::to_string(tuning::kMaxCluster) + "], got " +
                  std::to_string(cluster));
  }
  Options max_cluster;
  max_cluster.cluster = tuning::kMaxCluster;
  EXPECT_NO_THROW(attnres::plan(query(AttnResOp::attn_res, 1, 2, 64), h200(), max_cluster));
}

TEST(PlanPurity, SameInputsSamePlan) {
  for (AttnResOp op : kPerTokenOps)
    for (int64_t H : kHidden)
      for (int64_t N : {1, 4, 5, 12, 16}) {
        const PlanQuery q = query(op, 3, N, H);
        EXPECT_TRUE(same_plan(attnres::plan(q, h200()), attnres::plan(q, h200())));
        // The name and SM count of a Hopper part do not change the per-token choice.
        DeviceInfo other = h200();
        other.sm_count = 114;
        other.name = "NVIDIA H100 PCIe";
        EXPECT_TRUE(same_plan(attnres::plan(q, h200()), attnres::plan(q, other)));
      }
}

// plan(op, args): validates first (every precondition, outputs optional), then plans on the args' device.
TEST(PlanFromArgs, ValidatesThenPlans) {
  Config cfg;
  cfg.add2 = true;
  cfg.tap = true;
  Case c(cfg);
  AttnResArgs a = c.args();
  EXPECT_EQ(attnres::plan(AttnResOp::attn_res_add_rmsnorm, a).kernel, KernelKind::cpu);

  // Outputs may be absent for a plan-only query...
  AttnResArgs no_outputs = a;
  no_outputs.output = no_outputs.updated = no_outputs.mixture = TensorRef{};
  EXPECT_EQ(attnres::plan(AttnResOp::attn_res_add_rmsnorm, no_outputs).kernel, KernelKind::cpu);
  // ...but run() needs them,
  EXPECT_EQ(error_of<attnres::ArgumentError>([&] { attnres::attn_res_add_rmsnorm(no_outputs); }),
            "attn_res_add_rmsnorm: output is required (only an FP8 call may leave it out: fp8_only)");
  // and present ones are still checked.
  AttnResArgs bad = no_outputs;
  bad.mixture = a.mixture;
  bad.mixture.shape[1] = 32;
  EXPECT_TRUE(contains(error_of<attnres::ArgumentError>([&] { attnres::plan(AttnResOp::attn_res_add_rmsnorm, bad); }),
                       "attn_res_add_rmsnorm: mixture must have shape [T, H] = [2, 64], got [2, 32]"));

  // The query the plan sees.
  a.snapshot_slot = -1;
  const PlanQuery q = attnres::plan_query(AttnResOp::attn_res_add_rmsnorm, a);
  EXPECT_EQ(q.tokens, 2);
  EXPECT_EQ(q.candidates, 3);
  EXPECT_EQ(q.hidden, 64);
  EXPECT_TRUE(q.add);
  EXPECT_TRUE(q.add2);
  EXPECT_TRUE(q.tap);
  EXPECT_FALSE(q.snapshot);
  EXPECT_FALSE(q.diagnostics);
}

}  // namespace
}  // namespace attnres_test
