// The persistent kernel's plan: routing (topology, ceiling, forced kernel), the geometry it hands the launcher
// (consumer warps and vector bucket from H alone, the ring from the device's shared memory, one or two passes,
// two blocks per SM where that geometry exists and one otherwise) and its declines. A pure function, so it runs on hand-built devices on any machine.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "persistent_layout.hpp"
#include "plan_test_util.hpp"

namespace attnres_test {
namespace {

namespace layout = attnres::persistent;

constexpr int32_t kH200Smem = kH200SmemOptin;

DeviceInfo h200(int32_t smem = kH200Smem, int32_t sms = 132) { return described_h200(smem, sms); }

PlanQuery query(AttnResOp op, int64_t T, int64_t N, int64_t H, bool add) { return plan_query_of(op, T, N, H, add); }

Options persistent_topology(bool pdl = true) {
  Options o;
  o.topology = Topology::persistent;
  o.pdl = pdl;
  return o;
}

Options one_block() {
  Options o;
  o.persistent_blocks_per_sm = 1;
  return o;
}

// The automatic blocks per SM on a device with `smem` bytes of opt-in shared memory, derived from the rule's
// parts: an instance (no FP8, <= 256 threads) and at least two slots in half the SM's shared memory.
int32_t expected_blocks_per_sm(int64_t H, int32_t smem = kH200Smem, bool fp8 = false) {
  const bool instance = !fp8 && layout::consumer_threads(H) + layout::kProducerThreads <= layout::kTwoBlocksMaxThreads;
  return instance && layout::max_slots(layout::block_budget(smem, 2), layout::kMaxCandidates, H) >= tuning::kPersistentMinSlots ? 2 : 1;
}

const int64_t kHidden[] = {8, 16, 64, 72, 1024, 2048, 2056, 2304, 4096, 4104, 7168, 8192, 8200, 12288, 16384};

// Every supported shape is accepted, with a geometry the kernel can run and that covers the row exactly as
// persistent_layout.hpp says.
TEST(PlanPersistent, EveryShapeIsServedWithAConsistentGeometry) {
  for (int64_t H : kHidden)
    for (int64_t N = 1; N <= 16; ++N)
      for (bool add : {false, true})
        for (bool pdl : {true, false}) {
          SCOPED_TRACE("H=" + std::to_string(H) + " N=" + std::to_string(N) + " add=" + std::to_string(add));
          const AttnResOp op = add ? AttnResOp::attn_res_add_rmsnorm_persistent : AttnResOp::attn_res_rmsnorm;
          const Plan p = attnres::plan(query(op, 5000, N, H, add), h200(), persistent_topology(pdl));
          ASSERT_TRUE(p.accepted()) << p.decline;
          EXPECT_EQ(p.kernel, KernelKind::persistent);
          EXPECT_EQ(p.pdl, pdl);
          EXPECT_EQ(p.cluster, 1);
          const int32_t consumers = p.threads - layout::kProducerThreads;
          EXPECT_EQ(consumers % 32, 0);
          EXPECT_GE(consumers, 32);
          EXPECT_LE(consumers, layout::kMaxConsumerWarps * 32);
          EXPECT_TRUE(p.vectors == 1 || p.vectors == 2 || p.vectors == 4 || p.vectors == 8) << p.vectors;
          EXPECT_GE(int64_t{consumers} * p.vectors * 8, H) << "the consumers cover the row";
          EXPECT_EQ(consumers, layout::consumer_threads(H));
          EXPECT_EQ(p.vectors, layout::vectors_per_thread(H));
          EXPECT_EQ(p.max_candidates, 16);
          EXPECT_GE(p.slots, tuning::kPersistentMinSlots);
          EXPECT_LE(p.slots, layout::kMaxSlots);
          EXPECT_EQ(p.smem_bytes, layout::smem_bytes(p.slots, N, H));
          EXPECT_EQ(p.blocks_per_sm, expected_blocks_per_sm(H));
          const int64_t budget = layout::block_budget(kH200Smem, p.blocks_per_sm);
          EXPECT_LE(p.smem_bytes, budget);
          if (p.blocks_per_sm == 2) { EXPECT_LE(p.threads, layout::kTwoBlocksMaxThreads); }
          // The ring is as deep as the block's budget allows (or the slot cap).
          if (p.slots < layout::kMaxSlots) { EXPECT_GT(layout::smem_bytes(p.slots + 1, N, H), budget); }
          const int64_t rows = N + (add ? 1 : 0);
          EXPECT_EQ(p.passes, p.slots >= rows + tuning::persistent_one_pass_spare_slots(p.blocks_per_sm) ? 1 : 2);
          EXPECT_EQ(p.blocks, 132 * p.blocks_per_sm);
        }
}

// The shapes the kernel is specialised for, pinned on one block per SM: Kimi K3 (7168), Kimi Linear (2304),
// 4096, 8192, and the largest row.
TEST(PlanPersistent, FastPathGeometry) {
  struct Pin {
    int64_t H;
    int32_t vectors, threads, slots;
  };
  // threads = one consumer warp per split_k rank chunk (each holding its chunk's 3-8 warps as vectors), or
  // one per split_k warp when those fit 8 warps (H <= 2048), + the producer warp; slots = the most 2H-byte
  // (128-aligned) slots that fit 227 KB after the header (persistent_layout.hpp: the partials of N = 9 candidates
  // per consumer warp, the mixture squares, 16 bytes of mbarriers per slot) and, for H > 8192, the norm weight.
  for (const Pin& pin : {Pin{7168, 4, 256, 16}, Pin{2304, 4, 128, 50}, Pin{4096, 4, 160, 28}, Pin{8192, 4, 288, 14},
                         Pin{16384, 8, 288, 6}, Pin{2056, 4, 128, 54}, Pin{2048, 1, 288, 56}, Pin{1024, 1, 160, 64},
                         Pin{8, 1, 64, 64}}) {
    SCOPED_TRACE("H=" + std::to_string(pin.H));
    const Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, pin.H, true), h200(),
                                 one_block());
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.vectors, pin.vectors);
    EXPECT_EQ(p.threads, pin.threads);
    EXPECT_EQ(p.slots, pin.slots);
  }
  // The bandwidth target's shape (T >= 4096, N = 9, add, H = 7168; docs/performance.md) on one block: one pass,
  // 10 rows per token in a 16-slot ring.
  Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, 7168, true), h200(), one_block());
  EXPECT_EQ(p.passes, 1);
  EXPECT_EQ(p.smem_bytes, 896 + 16 * 14336);  // header: 9 * 7 * 8 -> 512, + 64, + 16 * 16, to 128
  // H = 7168: one pass up to 15 rows per token, two beyond.
  p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 14, 7168, true), h200(), one_block());
  EXPECT_EQ(p.passes, 1);
  p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 15, 7168, true), h200(), one_block());
  EXPECT_EQ(p.passes, 2);
  Options one_block_topology = persistent_topology();
  one_block_topology.persistent_blocks_per_sm = 1;
  p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 4096, 15, 7168, false), h200(), one_block_topology);
  EXPECT_EQ(p.passes, 1);
  p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 4096, 16, 7168, false), h200(), one_block_topology);
  EXPECT_EQ(p.passes, 2);
  // H = 16384, N = 16 with an addend (17 rows of 32 KB): served in two passes over a 6-slot ring.
  p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 16, 16384, true), h200(), one_block());
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.passes, 2);
  EXPECT_EQ(p.slots, 6);
}

// Everything that fixes a token's arithmetic (consumer threads, vector bucket) depends on H only; T and the
// SM count change the grid, the shared-memory budget the ring depth and passes — none of which changes bits.
TEST(PlanPersistent, ArithmeticGeometryDependsOnHiddenOnly) {
  for (int64_t H : kHidden) {
    const Plan base = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 1, 9, H, true), h200(), Options{});
    ASSERT_TRUE(base.accepted()) << base.decline;
    EXPECT_EQ(base.blocks, 1);
    for (int64_t T : {int64_t{2}, int64_t{33}, int64_t{131}, int64_t{132}, int64_t{133}, int64_t{4096}, int64_t{1} << 26})
      for (int32_t sms : {1, 78, 114, 132})
        for (int32_t smem : {kH200Smem, 101376, 65536}) {
          for (int64_t N : {int64_t{1}, int64_t{9}, int64_t{16}}) {
            const Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, T, N, H, true),
                                         h200(smem, sms), Options{});
            if (!p.accepted()) {
              EXPECT_LT(smem, kH200Smem) << p.decline;
              continue;
            }
            EXPECT_EQ(p.threads, base.threads) << "H=" << H << " T=" << T;
            EXPECT_EQ(p.vectors, base.vectors) << "H=" << H << " T=" << T;
            EXPECT_EQ(p.blocks, std::min<int64_t>(T, int64_t{sms} * p.blocks_per_sm));
          }
        }
  }
}

// A device with little shared memory gets a shallower ring; below two slots the plan declines with the
// numbers (never a launch that would fail or a ring that would deadlock).
TEST(PlanPersistent, SmallSharedMemoryShrinksTheRingOrDeclines) {
  const DeviceInfo small = h200(101376);  // a 99 KB part
  Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, 7168, true), small, one_block());
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.slots, 7);
  EXPECT_EQ(p.passes, 2);
  EXPECT_LE(p.smem_bytes, 101376);

  const int64_t need = layout::smem_bytes(2, 9, 16384);
  const DeviceInfo tiny = h200(static_cast<int32_t>(need - 1));
  p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, 16384, true), tiny, Options{});
  EXPECT_FALSE(p.accepted());
  EXPECT_EQ(p.decline, "the persistent kernel needs " + std::to_string(need) +
                           " bytes of shared memory per block for H = 16384 (2 row slots); cuda:0 offers " +
                           std::to_string(need - 1));
  EXPECT_TRUE(attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, 16384, true),
                            h200(static_cast<int32_t>(need)), Options{})
                  .accepted());
  // A device description without the shared-memory figure is declined, not guessed.
  p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, 64, true), h200(0), Options{});
  EXPECT_FALSE(p.accepted());
  EXPECT_TRUE(contains(p.decline, "offers 0"));
}

// Which calls reach the persistent kernel: the persistent op always; attn_res_rmsnorm and attn_res_add_rmsnorm
// under the persistent topology, above the split ceiling, or when the kernel is forced; never attn_res.
TEST(PlanPersistent, Routing) {
  const AttnResOp norm = AttnResOp::attn_res_rmsnorm, add = AttnResOp::attn_res_add_rmsnorm;
  Options split;
  split.topology = Topology::split;
  split.split_max_tokens = 32;
  Options forced;
  forced.kernel = KernelKind::persistent;
  for (AttnResOp op : {norm, add}) {
    const bool a = op == add;
    EXPECT_EQ(attnres::plan(query(op, 5, 9, 7168, a), h200(), persistent_topology()).kernel, KernelKind::persistent);
    EXPECT_EQ(attnres::plan(query(op, 33, 9, 7168, a), h200(), split).kernel, KernelKind::persistent);
    EXPECT_EQ(attnres::plan(query(op, 32, 9, 7168, a), h200(), split).kernel, KernelKind::split_k);
    EXPECT_EQ(attnres::plan(query(op, 1, 9, 7168, a), h200(), forced).kernel, KernelKind::persistent);
    // Automatic: persistent with or without the addend at T >= 4096 (H = 7168 has the two-blocks geometry).
    EXPECT_EQ(attnres::plan(query(op, 5000, 9, 7168, a), h200(), Options{}).kernel, KernelKind::persistent);
  }
  Options per_token_forced = persistent_topology();
  per_token_forced.kernel = KernelKind::split_k;
  EXPECT_EQ(attnres::plan(query(add, 5000, 9, 7168, true), h200(), per_token_forced).kernel, KernelKind::split_k);
  // The persistent op ignores the topology option.
  EXPECT_EQ(attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 3, 2, 64, false), h200(), Options{}).kernel,
            KernelKind::persistent);
  // attn_res stays per-token; forcing the persistent kernel on it declines.
  PlanQuery diag = query(AttnResOp::attn_res, 5000, 9, 7168, false);
  diag.diagnostics = true;
  EXPECT_EQ(attnres::plan(diag, h200(), persistent_topology()).kernel, KernelKind::split_k);
  EXPECT_FALSE(attnres::plan(diag, h200(), forced).accepted());
}

// The persistent route declines the tap before looking at the device (the same everywhere); and the device
// checks still apply after.
TEST(PlanPersistent, DeclinesBeforeTheDeviceAndDeviceRulesAfter) {
  PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm, 5000, 9, 7168, true);
  q.tap = true;
  EXPECT_TRUE(contains(attnres::plan(q, h200(), persistent_topology()).decline, "pre-norm mixture tap"));
  q.tap = false;
  DeviceInfo old = h200();
  old.cc_major = 8;
  EXPECT_TRUE(contains(attnres::plan(q, old, persistent_topology()).decline, "need 9.0 (Hopper) or newer"));
  DeviceInfo no_backend = h200();
  no_backend.cuda_backend = false;
  EXPECT_EQ(attnres::plan(q, no_backend, persistent_topology()).decline, "attnres was built without the CUDA backend");
  q.tokens = (int64_t{1} << 26) + 1;
  EXPECT_TRUE(contains(attnres::plan(q, h200(), persistent_topology()).decline, "exceeds the per-launch limit"));
}

// The consumers own split_k's vectors lane for lane (owned_vector): consumer warp w's vector j, lane l is lane l
// of split_k warp (w % warps_per_chunk) * V + j of rank chunk w / warps_per_chunk, every vector of the row is
// owned exactly once, and a chunk's warps are held by consecutive consumer warps in order, so the butterfly
// per j, the in-order sum over j and the chunked sum over consumer warps are split_k's reduction tree.
TEST(PlanPersistent, ConsumersOwnSplitKVectorsLaneForLane) {
  for (int64_t H = 8; H <= attnres::kMaxHidden; H += 8) {
    SCOPED_TRACE("H=" + std::to_string(H));
    const int32_t vecs = static_cast<int32_t>(H / 8), chunks = tuning::split_k_cluster(H),
                  chunk = tuning::split_k_chunk(H), chunk_warps = tuning::split_k_chunk_warps(H);
    const int32_t V = layout::vectors_per_thread(H), G = layout::warps_per_chunk(H),
                  warps = layout::consumer_threads(H) / 32;
    ASSERT_EQ(layout::consumer_threads(H) % 32, 0);
    ASSERT_LE(warps, layout::kMaxConsumerWarps);
    ASSERT_EQ(warps, chunks * G);
    ASSERT_TRUE(V == 1 || V == 2 || V == 4 || V == 8);
    ASSERT_GE(G * V, chunk_warps) << "each chunk's warps are all held";
    ASSERT_TRUE(G == 1 || V == 1);
    // split_k's own geometry for H (plan.cpp): chunk vectors per block, blocks of whole warps.
    const Plan sk = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 1, 9, H, false), h200(), Options{});
    ASSERT_TRUE(sk.accepted()) << sk.decline;
    ASSERT_EQ(sk.kernel, KernelKind::split_k);
    ASSERT_EQ(sk.cluster, chunks);
    if (chunks > 1) { ASSERT_EQ(sk.threads, chunk_warps * 32); }
    std::vector<int> owner(vecs, 0);
    for (int32_t w = 0; w < warps; ++w)
      for (int32_t j = 0; j < V; ++j)
        for (int32_t lane = 0; lane < 32; ++lane) {
          const int32_t v = layout::owned_vector(w, lane, j, V, G, chunk, vecs);
          const int32_t rank = w / G, split_warp = (w % G) * V + j, split_tid = split_warp * 32 + lane;
          // split_k: block `rank`, thread split_tid owns rank * chunk + split_tid when it is < chunk and in the row.
          const int32_t expected = split_tid < chunk && rank * chunk + split_tid < vecs ? rank * chunk + split_tid : -1;
          ASSERT_EQ(v, expected) << "w=" << w << " j=" << j << " lane=" << lane;
          if (v >= 0) ++owner[v];
        }
    for (int32_t v = 0; v < vecs; ++v) ASSERT_EQ(owner[v], 1) << "vector " << v;
  }
}

// The automatic geometry on a described H200: two blocks per SM of half the SM's shared memory wherever an
// instance exists (no FP8, <= 256 threads) and the half holds two slots; one block of the whole 227 KB otherwise.
TEST(PlanPersistent, AutomaticGeometryIsTwoBlocksWhereTheyFit) {
  const auto plan = [](int64_t T, int64_t N, int64_t H, Fp8Scales fp8 = Fp8Scales::none,
                       const DeviceInfo& dev = h200()) {
    PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm_persistent, T, N, H, true);
    q.fp8 = fp8;
    return attnres::plan(q, dev, Options{});
  };
  // Kimi K3: 8 slots of 14336 bytes in (227 KB + 1 KB) / 2 - 1 KB = 115712 bytes; one pass up to 8 rows a token
  // (two blocks per SM want no spare slot).
  Plan p = plan(16384, 9, 7168);
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.blocks_per_sm, 2);
  EXPECT_EQ(p.slots, 8);
  EXPECT_EQ(p.passes, 2);
  EXPECT_EQ(p.blocks, 264);
  EXPECT_EQ(p.threads, 256);
  EXPECT_EQ(p.smem_bytes, 768 + 8 * 14336);
  EXPECT_EQ(plan(4096, 2, 7168).passes, 1);
  EXPECT_EQ(plan(4096, 7, 7168).passes, 1);  // 8 rows, 8 slots
  EXPECT_EQ(plan(4096, 8, 7168).passes, 2);
  EXPECT_EQ(plan(100, 9, 7168).blocks, 100);
  EXPECT_EQ(plan(200, 9, 7168).blocks, 200);
  // Kimi Linear and H = 4096: two blocks too.
  EXPECT_EQ(plan(4096, 9, 2304).blocks_per_sm, 2);
  EXPECT_EQ(plan(4096, 9, 4096).blocks_per_sm, 2);
  // No two-blocks instance: more than 256 threads (H = 8192: 288; H = 2048: 8 consumer warps + the producer;
  // H = 16384): one block, the whole ring.
  for (int64_t H : {int64_t{2048}, int64_t{8192}, int64_t{16384}}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    p = plan(4096, 9, H);
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.blocks_per_sm, 1);
    EXPECT_GT(p.threads, layout::kTwoBlocksMaxThreads);
    EXPECT_EQ(p.slots, layout::max_slots(kH200Smem, 9, H));
    EXPECT_FALSE(layout::two_blocks_fit(H, kH200Smem));
  }
  // The FP8 epilogue takes the bf16 op's geometry: its two-blocks instances fit the same registers.
  for (Fp8Scales fp8 : {Fp8Scales::per_token, Fp8Scales::block128}) {
    p = plan(4096, 9, 7168, fp8);
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.blocks_per_sm, 2);
    EXPECT_EQ(p.slots, plan(4096, 9, 7168).slots);
  }
  EXPECT_TRUE(layout::two_blocks_fit(7168, kH200Smem));
  // Fall-back to one block where half the SM holds fewer than two slots: at H = 7168 two slots need
  // smem_bytes(2) per block, i.e. an opt-in of 2 * (that + 1 KB) - 1 KB.
  const int64_t need2 = 2 * (layout::smem_bytes(2, layout::kMaxCandidates, 7168) + layout::kReservedSharedPerBlock) -
                        layout::kReservedSharedPerBlock;
  EXPECT_EQ(layout::max_slots(layout::block_budget(need2, 2), layout::kMaxCandidates, 7168), 2);
  EXPECT_EQ(layout::max_slots(layout::block_budget(need2 - 1, 2), layout::kMaxCandidates, 7168), 1);
  p = plan(4096, 2, 7168, Fp8Scales::none, h200(static_cast<int32_t>(need2)));
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.blocks_per_sm, 2);
  EXPECT_EQ(p.slots, 2);
  p = plan(4096, 2, 7168, Fp8Scales::none, h200(static_cast<int32_t>(need2 - 1)));
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.blocks_per_sm, 1);
  EXPECT_EQ(p.slots, layout::max_slots(need2 - 1, 2, 7168));
  // The 99 KB part keeps two blocks of 3 slots at H = 7168.
  p = plan(4096, 9, 7168, Fp8Scales::none, h200(101376));
  EXPECT_EQ(p.blocks_per_sm, 2);
  EXPECT_EQ(p.slots, 3);
}

// The H100's own grid: the GPU is told by its name; split_k's exact-N instances beat the persistent kernel there at
// every measured N and T, so it is never taken, where the H200's thresholds take it at N = 3..10 (13 without the
// addend); without the addend N <= 4 stream there.
TEST(PlanPersistent, AutomaticTopologyHasTheH100sGrid) {
  using attnres::Route;
  using tuning::TopologyGrid;
  EXPECT_EQ(tuning::topology_grid("NVIDIA H100 80GB HBM3"), TopologyGrid::h100);
  EXPECT_EQ(tuning::topology_grid("NVIDIA H100 PCIe"), TopologyGrid::h100);
  EXPECT_EQ(tuning::topology_grid("NVIDIA H200"), TopologyGrid::h200);
  EXPECT_EQ(tuning::topology_grid("described device"), TopologyGrid::h200);
  EXPECT_EQ(tuning::topology_grid(""), TopologyGrid::h200);
  const int64_t never = tuning::kNeverPersistent;
  struct Case {
    int64_t n;
    bool add;
    int64_t h100, h200;
  };
  for (const Case c : {Case{1, true, never, 4096}, Case{3, true, never, 2048}, Case{4, true, never, 4096},
                       Case{5, true, never, 128}, Case{6, true, never, 256}, Case{7, true, never, 256},
                       Case{8, true, never, 256}, Case{9, true, never, 512}, Case{10, true, never, 256},
                       Case{11, true, never, never}, Case{3, false, never, 256}, Case{7, false, never, 256},
                       Case{8, false, never, 256}, Case{9, false, never, 512}, Case{12, false, never, 256}}) {
    SCOPED_TRACE(testing::Message() << "N = " << c.n << ", add = " << c.add);
    EXPECT_EQ(tuning::automatic_persistent_min_tokens(c.n, 7168, c.add, TopologyGrid::h100), c.h100);
    EXPECT_EQ(tuning::automatic_persistent_min_tokens(c.n, 7168, c.add, TopologyGrid::h200), c.h200);
    EXPECT_EQ(tuning::automatic_persistent_min_tokens(c.n, 7168, c.add), c.h200);  // the default grid
  }
  // The plan asks the device's name: T = 4096, N = 5 and 9 are persistent on the H200, split_k on the H100.
  for (const bool add : {true, false}) {
    const AttnResOp op = add ? AttnResOp::attn_res_add_rmsnorm : AttnResOp::attn_res_rmsnorm;
    EXPECT_EQ(attnres::plan(query(op, 4096, 9, 7168, add), attnres::described_device("h200"), Options{}).kernel,
              KernelKind::persistent);
    EXPECT_EQ(attnres::plan(query(op, 4096, 9, 7168, add), attnres::described_device("h100"), Options{}).kernel,
              KernelKind::split_k);
    EXPECT_EQ(attnres::plan(query(op, 4096, 5, 7168, add), attnres::described_device("h100"), Options{}).kernel,
              KernelKind::split_k);
    EXPECT_EQ(attnres::plan(query(op, 4096, 5, 7168, add), attnres::described_device("h200"), Options{}).kernel,
              KernelKind::persistent);
  }
  // The streaming single_cta: N <= 2 on both GPUs; N = 3, 4 without the addend on the H100 only, from T = 256.
  for (const int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{5}})
    for (const bool add : {true, false})
      for (const int64_t T : {int64_t{255}, int64_t{256}, int64_t{4096}}) {
        SCOPED_TRACE(testing::Message() << "N = " << n << ", add = " << add << ", T = " << T);
        const AttnResOp op = add ? AttnResOp::attn_res_add_rmsnorm : AttnResOp::attn_res_rmsnorm;
        const bool h200_streams = T >= 256 && n <= 2, h100_streams = T >= 256 && n <= (add ? 2 : 4);
        EXPECT_EQ(tuning::prefer_single_cta(T, n, 7168, add, TopologyGrid::h200), h200_streams);
        EXPECT_EQ(tuning::prefer_single_cta(T, n, 7168, add, TopologyGrid::h100), h100_streams);
        EXPECT_EQ(tuning::prefer_single_cta(T, n, 4096, add, TopologyGrid::h100), false);  // H <= 4096: split_k
        // From T = 4096 the H100 runs single_cta's token blocks instead where its table says so (with the addend
        // N <= 3; without it N = 2..4), the streaming kernel elsewhere.
        const bool h100_blocks = T >= 4096 && (add ? n <= 3 : n >= 2 && n <= 4);
        const Plan p = attnres::plan(query(op, T, n, 7168, add), attnres::described_device("h100"), Options{});
        ASSERT_TRUE(p.accepted()) << p.decline;
        if (h100_streams || h100_blocks) { EXPECT_EQ(p.kernel, KernelKind::single_cta); }
        else { EXPECT_NE(p.kernel, KernelKind::single_cta); }
        EXPECT_EQ(p.route == Route::token_blocks, h100_blocks);
        if (p.kernel != KernelKind::persistent) { EXPECT_EQ(p.smem_bytes > 0, h100_streams && !h100_blocks); }
      }
}

// Two addends (the MoE tail's fold): never on either GPU (the H100's exact-N split_k beat the persistent kernel at
// N = 5..8 and the bucket's at the other N; the H200's grid is not measured yet); forced, it is accepted. The
// streaming single_cta's buffers: four on the H100 where a token reads one row (N = 1 without an addend), two
// everywhere else.
TEST(PlanPersistent, TwoAddendsAndStreamBuffersByGrid) {
  using attnres::Route;
  using tuning::TopologyGrid;
  const int64_t never = tuning::kNeverPersistent;
  for (int64_t n = 1; n <= 16; ++n) {
    SCOPED_TRACE(testing::Message() << "N = " << n);
    EXPECT_EQ(tuning::automatic_persistent_min_tokens(n, 7168, 2, TopologyGrid::h100), never);
    EXPECT_EQ(tuning::automatic_persistent_min_tokens(n, 7168, 2, TopologyGrid::h200), never);
  }
  PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm, 4096, 5, 7168, true);
  q.add2 = true;
  EXPECT_EQ(attnres::plan(q, attnres::described_device("h100"), Options{}).kernel, KernelKind::split_k);
  EXPECT_EQ(attnres::plan(q, attnres::described_device("h200"), Options{}).kernel, KernelKind::split_k);
  Options forced;
  forced.kernel = KernelKind::persistent;
  EXPECT_EQ(attnres::plan(q, attnres::described_device("h100"), forced).kernel, KernelKind::persistent);

  for (const bool add : {false, true})
    for (int64_t n = 1; n <= 4; ++n) {
      SCOPED_TRACE(testing::Message() << "N = " << n << ", add = " << add);
      const int32_t h100 = !add && n == 1 ? 4 : 2;
      EXPECT_EQ(tuning::stream_buffers(n, add, false, TopologyGrid::h100), h100);
      EXPECT_EQ(tuning::stream_buffers(n, add, false, TopologyGrid::h200), 2);
      const AttnResOp op = add ? AttnResOp::attn_res_add_rmsnorm : AttnResOp::attn_res_rmsnorm;
      const Plan p = attnres::plan(query(op, 4096, n, 7168, add), attnres::described_device("h100"), Options{});
      if (p.route == Route::stream) {
        EXPECT_EQ(p.slots, h100);
        EXPECT_EQ(p.smem_bytes, tuning::stream_smem_bytes(tuning::candidate_bucket(n), add, false, p.threads, h100));
      }
    }
  const Plan one_row = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 4096, 1, 7168, false),
                                     attnres::described_device("h100"), Options{});
  EXPECT_EQ(one_row.route, Route::stream);
  EXPECT_EQ(one_row.slots, 4);
}

// The automatic topology's rule, a pure function: persistent on the two-blocks geometry from the measured T for
// the call's N, one table with the addend and one without (at H > 4096; T >= 4096 at smaller H).
TEST(PlanPersistent, AutomaticTopologyRuleIsPure) {
  EXPECT_EQ(tuning::kAutomaticPersistentMinTokens, 4096);
  static_assert(tuning::automatic_prefers_persistent(4096, 9, 7168, true, true), "the measured crossover");
  static_assert(tuning::automatic_prefers_persistent(512, 9, 7168, true, true), "N = 9 from T = 512");
  static_assert(!tuning::automatic_prefers_persistent(511, 9, 7168, true, true), "N = 9 below T = 512");
  static_assert(tuning::automatic_prefers_persistent(256, 11, 7168, false, true), "N = 11 without the addend");
  static_assert(!tuning::automatic_prefers_persistent(16384, 11, 7168, true, true), "N = 11 with it: never");
  struct Case {
    int64_t n, hidden;
    bool add;
    int64_t min_tokens;
  };
  const int64_t never = tuning::kNeverPersistent;
  for (const Case c : {Case{1, 7168, true, 4096}, Case{2, 7168, true, 4096}, Case{3, 7168, true, 2048},
                       Case{4, 7168, true, 4096}, Case{5, 7168, true, 128}, Case{6, 7168, true, 256},
                       Case{8, 7168, true, 256}, Case{9, 7168, true, 512}, Case{10, 7168, true, 256},
                       Case{11, 7168, true, never}, Case{12, 7168, true, never}, Case{16, 7168, true, never},
                       Case{5, 4104, true, 128}, Case{5, 4096, true, 4096}, Case{9, 2048, true, 4096},
                       Case{10, 1024, true, 4096}, Case{11, 2048, true, never}, Case{0, 7168, true, never},
                       Case{17, 7168, true, never}, Case{1, 7168, false, 4096}, Case{3, 7168, false, 256},
                       Case{4, 7168, false, 512}, Case{6, 7168, false, 128}, Case{9, 7168, false, 512},
                       Case{11, 7168, false, 256}, Case{13, 7168, false, 256}, Case{14, 7168, false, never},
                       Case{16, 7168, false, never}, Case{13, 4096, false, 4096}, Case{0, 7168, false, never}}) {
    SCOPED_TRACE(testing::Message() << "N = " << c.n << ", H = " << c.hidden << ", add = " << c.add);
    EXPECT_EQ(tuning::automatic_persistent_min_tokens(c.n, c.hidden, c.add), c.min_tokens);
    if (c.min_tokens != never) {
      EXPECT_TRUE(tuning::automatic_prefers_persistent(c.min_tokens, c.n, c.hidden, c.add, true));
      EXPECT_FALSE(tuning::automatic_prefers_persistent(c.min_tokens - 1, c.n, c.hidden, c.add, true));
      EXPECT_FALSE(tuning::automatic_prefers_persistent(c.min_tokens, c.n, c.hidden, c.add, false));
    }
    EXPECT_FALSE(tuning::automatic_prefers_persistent(tuning::kMaxTokensPerLaunch, c.n, c.hidden, c.add, false));
  }
  for (const int32_t addends : {-1, 3})  // no such op
    EXPECT_EQ(tuning::automatic_persistent_min_tokens(5, 7168, addends), never) << addends;
}

// Through the plan on a described H200: N = 9 at the crossover (T = 512 at H > 4096, 4096 below), with and
// without the addend, with and without the two-blocks geometry; FP8 (no
// two-blocks instance) and add2 stay per-token; explicit one block keeps the per-token kernels too.
TEST(PlanPersistent, AutomaticTopologyFollowsTheGeometry) {
  const AttnResOp add = AttnResOp::attn_res_add_rmsnorm;
  const auto kernel = [&](int64_t T, int64_t H, Fp8Scales fp8 = Fp8Scales::none, const Options& o = Options{},
                          const DeviceInfo& dev = h200()) {
    PlanQuery q = query(add, T, 9, H, true);
    q.fp8 = fp8;
    const Plan p = attnres::plan(q, dev, o);
    EXPECT_TRUE(p.accepted()) << p.decline;
    return p.kernel;
  };
  for (int64_t H : {int64_t{7168}, int64_t{2304}, int64_t{4096}}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    const int64_t from = H > 4096 ? 512 : 4096;
    EXPECT_EQ(kernel(from, H), KernelKind::persistent);
    EXPECT_EQ(kernel(16384, H), KernelKind::persistent);
    EXPECT_EQ(kernel(from - 1, H), KernelKind::split_k);
    EXPECT_EQ(kernel(1, H), KernelKind::split_k);
  }
  const Plan p = attnres::plan(query(add, 4096, 9, 7168, true), h200(), Options{});
  EXPECT_EQ(p.blocks_per_sm, 2);
  // Without the two-blocks geometry (more than 256 threads, too little shared memory) the persistent kernel
  // would run on one block: per-token at every T.
  for (int64_t H : {int64_t{2048}, int64_t{8192}, int64_t{16384}}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    EXPECT_EQ(kernel(4096, H), KernelKind::split_k);
    EXPECT_EQ(kernel(16384, H), KernelKind::split_k);
  }
  // The FP8 epilogue keeps the bf16 op's choice (its two-blocks instances exist).
  for (Fp8Scales fp8 : {Fp8Scales::per_token, Fp8Scales::block128}) {
    EXPECT_EQ(kernel(511, 7168, fp8), KernelKind::split_k);
    EXPECT_EQ(kernel(512, 7168, fp8), KernelKind::persistent);
    EXPECT_EQ(kernel(16384, 7168, fp8), KernelKind::persistent);
    EXPECT_EQ(kernel(4096, 8192, fp8), KernelKind::split_k);
  }
  const int32_t short_smem = static_cast<int32_t>(2 * (layout::smem_bytes(2, layout::kMaxCandidates, 7168) + layout::kReservedSharedPerBlock) -
                                                  layout::kReservedSharedPerBlock - 1);
  EXPECT_EQ(kernel(16384, 7168, Fp8Scales::none, Options{}, h200(short_smem)), KernelKind::split_k);
  // Forcing one block per SM takes the geometry away from the automatic topology; forcing two keeps it.
  EXPECT_EQ(kernel(16384, 7168, Fp8Scales::none, one_block()), KernelKind::split_k);
  Options two;
  two.persistent_blocks_per_sm = 2;
  EXPECT_EQ(kernel(512, 7168, Fp8Scales::none, two), KernelKind::persistent);
  EXPECT_EQ(kernel(511, 7168, Fp8Scales::none, two), KernelKind::split_k);
  // add2 stays per-token (the persistent kernel declines it), never a decline.
  PlanQuery q = query(add, 16384, 9, 7168, true);
  q.add2 = true;
  const Plan a2 = attnres::plan(q, h200(), Options{});
  ASSERT_TRUE(a2.accepted()) << a2.decline;
  EXPECT_EQ(a2.kernel, KernelKind::split_k);
  // Without the addend: the same crossover, with or without a snapshot write.
  const auto bare = [&](int64_t T, bool snapshot = false) {
    PlanQuery b = query(AttnResOp::attn_res_rmsnorm, T, 9, 7168, false);
    b.snapshot = snapshot;
    const Plan p = attnres::plan(b, h200(), Options{});
    EXPECT_TRUE(p.accepted()) << p.decline;
    return p.kernel;
  };
  EXPECT_EQ(bare(16384), KernelKind::persistent);
  EXPECT_EQ(bare(512), KernelKind::persistent);
  EXPECT_EQ(bare(511), KernelKind::split_k);
  EXPECT_EQ(bare(16384, true), KernelKind::persistent);
  EXPECT_EQ(bare(511, true), KernelKind::split_k);
}

TEST(PlanPersistent, LayoutArithmetic) {
  // The header (partials sized for the call's N and consumer warps, or the FP8 group amax; the mixture squares)
  // precedes the mbarriers, 8-byte aligned; slots are 128-byte aligned.
  EXPECT_EQ(layout::consumer_threads(7168), 7 * 32);
  EXPECT_EQ(layout::partials_bytes(16, 7168), 16 * 7 * 2 * 4);
  EXPECT_EQ(layout::partials_bytes(1, 7168), 7168 / 128 * 4);  // the block128 group amax is the larger
  EXPECT_EQ(layout::barriers_offset(16, 7168), 16 * 7 * 2 * 4 + 64);
  // H = 7168 at two blocks per SM on sm_90 (227 KB opt-in): 8 slots for N <= 14, 7 above.
  const int64_t two = layout::block_budget(232448, 2);
  EXPECT_EQ(layout::max_slots(two, 7, 7168), 8);
  EXPECT_EQ(layout::max_slots(two, 14, 7168), 8);
  EXPECT_EQ(layout::max_slots(two, 15, 7168), 7);
  for (int64_t H : kHidden)
    for (int64_t N : {int64_t{1}, int64_t{2}, int64_t{9}, int64_t{16}}) {
      EXPECT_GE(layout::partials_bytes(N, H), N * layout::consumer_threads(H) / 32 * 2 * 4);
      EXPECT_GE(layout::partials_bytes(N, H), (H / 8 + 15) / 16 * 4);
      EXPECT_EQ(layout::barriers_offset(N, H) % 8, 0);
      for (int32_t s = 1; s <= layout::kMaxSlots; ++s) {
        EXPECT_EQ(layout::ring_offset(s, N, H) % 128, 0);
        EXPECT_GE(layout::norm_weight_offset(s, N, H), layout::barriers_offset(N, H) + 16 * s);
        EXPECT_EQ(layout::slot_bytes(H) % 128, 0);
        EXPECT_GE(layout::slot_bytes(H), 2 * H);
        EXPECT_EQ(layout::ring_offset(s, N, H) - layout::norm_weight_offset(s, N, H),
                  layout::norm_weight_in_shared(layout::vectors_per_thread(H)) ? layout::slot_bytes(H) : 0);
      }
    }
  EXPECT_EQ(layout::max_slots(0, 9, 64), 0);
  EXPECT_EQ(layout::max_slots(1 << 30, 9, 64), layout::kMaxSlots);
}

}  // namespace
}  // namespace attnres_test

// The automatic topology (the default): the persistent kernel only where it measured faster (one addend, T at or
// above the crossover) and only where it supports the call; the per-token kernels everywhere else, never a decline.
TEST(PlanPersistent, AutomaticTopologyRoutesByTheMeasuredCrossover) {
  const attnres::Options automatic{};
  ASSERT_EQ(automatic.topology, attnres::Topology::automatic);
  const int64_t big = attnres::tuning::kAutomaticPersistentMinTokens;
  const attnres::AttnResOp add = attnres::AttnResOp::attn_res_add_rmsnorm, norm = attnres::AttnResOp::attn_res_rmsnorm;
  EXPECT_EQ(attnres::plan(attnres_test::query(add, big, 9, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 511, 9, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 512, 9, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 256, 6, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 255, 6, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 127, 5, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 128, 5, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 2047, 3, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 2048, 3, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, big - 1, 4, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  EXPECT_EQ(attnres::plan(attnres_test::query(add, big, 4, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  // N > 10: split_k at every T (it measured faster from T = 128 to 16384 at N = 11, 12, 13, 16).
  EXPECT_EQ(attnres::plan(attnres_test::query(add, 16384, 12, 7168, true), attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  EXPECT_EQ(attnres::plan(attnres_test::query(norm, big, 9, 7168, false), attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  EXPECT_EQ(attnres::plan(attnres_test::query(norm, 511, 9, 7168, false), attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  attnres::PlanQuery q = attnres_test::query(add, big, 9, 7168, true);
  q.add2 = true;  // the persistent kernel declines add2: auto stays per-token instead of declining
  EXPECT_EQ(attnres::plan(q, attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  q.add2 = false;
  q.tap = true;
  EXPECT_EQ(attnres::plan(q, attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  q.tap = false;
  q.snapshot = true;  // the persistent kernel writes the snapshot row
  EXPECT_EQ(attnres::plan(q, attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  // attn_res without the fp32 diagnostics takes the crossover of its addend's table; with them, per-token.
  attnres::PlanQuery m = attnres_test::query(attnres::AttnResOp::attn_res, big, 9, 7168, false);
  EXPECT_EQ(attnres::plan(m, attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
  m.tokens = 511;
  EXPECT_EQ(attnres::plan(m, attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  m.tokens = big;
  m.diagnostics = true;
  EXPECT_EQ(attnres::plan(m, attnres_test::h200(), automatic).kernel, attnres::KernelKind::split_k);
  m = attnres_test::query(attnres::AttnResOp::attn_res, 2048, 3, 7168, true);
  m.snapshot = true;
  EXPECT_EQ(attnres::plan(m, attnres_test::h200(), automatic).kernel, attnres::KernelKind::persistent);
}
