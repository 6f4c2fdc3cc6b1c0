// The persistent kernel's plan: routing (topology, ceiling, forced kernel), the geometry it hands the launcher
// (consumer warps and vector bucket from H alone, the ring from the device's shared memory, one or two passes,
// one block per SM) and its declines. A pure function, so it runs on hand-built devices on any machine.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "persistent_layout.hpp"
#include "plan_tuning.hpp"
#include "test_util.hpp"

namespace attnres_test {
namespace {

namespace tuning = attnres::tuning;
namespace layout = attnres::persistent;
using attnres::DeviceInfo;
using attnres::KernelKind;
using attnres::Options;
using attnres::Plan;
using attnres::PlanQuery;
using attnres::Topology;

constexpr int32_t kH200Smem = 232448;  // cudaDeviceProp::sharedMemPerBlockOptin of sm_90 (227 KB)

DeviceInfo h200(int32_t smem = kH200Smem, int32_t sms = 132) {
  DeviceInfo d;
  d.device = Device{DeviceType::cuda, 0};
  d.cuda_backend = true;
  d.cc_major = 9;
  d.cc_minor = 0;
  d.sm_count = sms;
  d.shared_memory_per_block_optin = smem;
  d.name = "NVIDIA H200";
  return d;
}

PlanQuery query(AttnResOp op, int64_t T, int64_t N, int64_t H, bool add) {
  PlanQuery q;
  q.op = op;
  q.tokens = T;
  q.candidates = N;
  q.hidden = H;
  q.add = add;
  return q;
}

Options persistent_topology(bool pdl = true) {
  Options o;
  o.topology = Topology::persistent;
  o.pdl = pdl;
  return o;
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
          EXPECT_EQ(p.smem_bytes, layout::smem_bytes(p.slots, H));
          EXPECT_LE(p.smem_bytes, kH200Smem);
          // The ring is as deep as the budget allows (or the slot cap).
          if (p.slots < layout::kMaxSlots) { EXPECT_GT(layout::smem_bytes(p.slots + 1, H), kH200Smem); }
          const int64_t rows = N + (add ? 1 : 0);
          EXPECT_EQ(p.passes, p.slots >= rows + tuning::kPersistentOnePassSpareSlots ? 1 : 2);
          EXPECT_EQ(p.blocks, 132);
        }
}

// The shapes the kernel is specialised for, pinned: Kimi K3 (7168), Kimi Linear (2304), 4096, 8192, and the
// largest row.
TEST(PlanPersistent, FastPathGeometry) {
  struct Pin {
    int64_t H;
    int32_t vectors, threads, slots;
  };
  // threads = one consumer warp per split_k rank chunk (each holding its chunk's 3-8 warps as vectors), or
  // one per split_k warp when those fit 8 warps (H <= 2048), + the producer warp; slots = the most 2H-byte
  // (128-aligned) slots that fit 227 KB after the 1088-byte header, 16 bytes of mbarriers per slot and, for
  // H > 8192, the norm weight.
  for (const Pin& pin : {Pin{7168, 4, 256, 16}, Pin{2304, 4, 128, 50}, Pin{4096, 4, 160, 28}, Pin{8192, 4, 288, 14},
                         Pin{16384, 8, 288, 6}, Pin{2056, 4, 128, 54}, Pin{2048, 1, 288, 56}, Pin{1024, 1, 160, 64},
                         Pin{8, 1, 64, 64}}) {
    SCOPED_TRACE("H=" + std::to_string(pin.H));
    const Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, pin.H, true), h200(),
                                 Options{});
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.vectors, pin.vectors);
    EXPECT_EQ(p.threads, pin.threads);
    EXPECT_EQ(p.slots, pin.slots);
  }
  // The bandwidth target's shape (T >= 4096, N = 9, add, H = 7168; docs/performance.md): one pass, 10 rows per token in a 16-slot ring.
  Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, 7168, true), h200(), Options{});
  EXPECT_EQ(p.passes, 1);
  EXPECT_EQ(p.smem_bytes, 1408 + 16 * 14336);
  // H = 7168: one pass up to 15 rows per token, two beyond.
  p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 14, 7168, true), h200(), Options{});
  EXPECT_EQ(p.passes, 1);
  p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 15, 7168, true), h200(), Options{});
  EXPECT_EQ(p.passes, 2);
  p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 4096, 15, 7168, false), h200(), persistent_topology());
  EXPECT_EQ(p.passes, 1);
  p = attnres::plan(query(AttnResOp::attn_res_rmsnorm, 4096, 16, 7168, false), h200(), persistent_topology());
  EXPECT_EQ(p.passes, 2);
  // H = 16384, N = 16 with an addend (17 rows of 32 KB): served in two passes over a 6-slot ring.
  p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 16, 16384, true), h200(), Options{});
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
            EXPECT_EQ(p.blocks, std::min<int64_t>(T, sms));
          }
        }
  }
}

// A device with little shared memory gets a shallower ring; below two slots the plan declines with the
// numbers (never a launch that would fail or a ring that would deadlock).
TEST(PlanPersistent, SmallSharedMemoryShrinksTheRingOrDeclines) {
  const DeviceInfo small = h200(101376);  // a 99 KB part
  Plan p = attnres::plan(query(AttnResOp::attn_res_add_rmsnorm_persistent, 4096, 9, 7168, true), small, Options{});
  ASSERT_TRUE(p.accepted()) << p.decline;
  EXPECT_EQ(p.slots, 6);
  EXPECT_EQ(p.passes, 2);
  EXPECT_LE(p.smem_bytes, 101376);

  const int64_t need = layout::smem_bytes(2, 16384);
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
    EXPECT_EQ(attnres::plan(query(op, 5000, 9, 7168, a), h200(), Options{}).kernel, KernelKind::split_k);
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

// The persistent route declines add2, the tap and the snapshot write before looking at the device (the
// caller's materialize-first path is the same everywhere); and the device checks still apply after.
TEST(PlanPersistent, DeclinesBeforeTheDeviceAndDeviceRulesAfter) {
  PlanQuery q = query(AttnResOp::attn_res_add_rmsnorm, 5000, 9, 7168, true);
  q.add2 = true;
  EXPECT_TRUE(contains(attnres::plan(q, h200(), persistent_topology()).decline, "declines layer_residual_add2"));
  q.add2 = false;
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

TEST(PlanPersistent, LayoutArithmetic) {
  // The header (partials, mixture squares) precedes the mbarriers; slots are 128-byte aligned.
  EXPECT_EQ(layout::kPartialsBytes, 16 * 8 * 2 * 4);
  EXPECT_EQ(layout::kBarriersOffset, 1088);
  for (int64_t H : kHidden)
    for (int32_t s = 1; s <= layout::kMaxSlots; ++s) {
      EXPECT_EQ(layout::ring_offset(s, H) % 128, 0);
      EXPECT_GE(layout::norm_weight_offset(s), layout::kBarriersOffset + 16 * s);
      EXPECT_EQ(layout::slot_bytes(H) % 128, 0);
      EXPECT_GE(layout::slot_bytes(H), 2 * H);
      EXPECT_EQ(layout::ring_offset(s, H) - layout::norm_weight_offset(s),
                layout::norm_weight_in_shared(layout::vectors_per_thread(H)) ? layout::slot_bytes(H) : 0);
    }
  EXPECT_EQ(layout::max_slots(0, 64), 0);
  EXPECT_EQ(layout::max_slots(1 << 30, 64), layout::kMaxSlots);
}

}  // namespace
}  // namespace attnres_test
