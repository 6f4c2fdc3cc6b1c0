// The CUDA kernels against the CPU backend on the same inputs: `updated` and the snapshot row bit for bit,
// bf16 outputs within the contract's tolerance (cosine > 0.9999, relative L2 < 5e-3), fp32 diagnostics
// within 1e-4; for single_cta and split_k over several shapes and layouts. Plus the bitwise properties on the
// GPU (determinism with and without PDL, CUDA-graph replay, per-token independence, the add2 fold,
// subnormals) and what a CUDA call does on a machine without a usable device.
//
// The GPU suites skip (with the reason) without a CUDA device of compute capability >= 9.0.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.hpp"

#if ATTNRES_WITH_CUDA
#include "backend.hpp"            // the persistent launcher, run with other geometries than the plan's
#include "cuda_test_util.hpp"
#include "persistent_layout.hpp"
#endif

namespace attnres_test {
namespace {

// No usable device: a call on CUDA tensors is refused before anything runs (here the "device" pointers are
// host memory, so a write would show up in the storage compare). Runs on every CPU-only machine.
TEST(CudaUnavailable, CallOnCudaTensorsIsRefusedCleanly) {
  if (attnres::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is visible: the GPU suites below cover it";
  Config cfg = make_config(A, 2, 2, 64, [](Config& c) { c.add2 = c.tap = true; });
  cfg.seed = test_seed();
  Case c(cfg);
  const Case before = c;
  const AttnResArgs a = c.args_on([](const Buffer& b) { return const_cast<void*>(b.host()); }, kCuda0);
  if (attnres::cuda_backend_built()) {
    EXPECT_EQ(error_of<attnres::ArgumentError>([&] { attnres::run(A, a); }),
              "attnres: cuda:0 does not exist (0 CUDA devices visible)");
  } else {
    EXPECT_EQ(error_of<attnres::UnsupportedError>([&] { attnres::run(A, a); }),
              "attn_res_add_rmsnorm: attnres was built without the CUDA backend");
    EXPECT_EQ(attnres::plan(A, a).decline, "attnres was built without the CUDA backend");
  }
  EXPECT_TRUE(storage_unchanged(before, c));
}

#if ATTNRES_WITH_CUDA

// Device copies of every buffer of a Case (poisoned outputs and padding included), with the same views.
class DeviceMirror {
 public:
  explicit DeviceMirror(const Case& c) : owner_(&c) {
    for (const Buffer* b : c.buffers()) {
      void* p = nullptr;
      cuda_ok(cudaMalloc(&p, b->nbytes() ? b->nbytes() : 16), "cudaMalloc");
      ptrs_.push_back(p);
      if (b->nbytes()) cuda_ok(cudaMemcpy(p, b->host(), b->nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    }
    // A pageable-memory cudaMemcpy may return before its DMA lands, and the tests launch on non-blocking
    // streams that do not order after the legacy stream: wait for the uploads here.
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  ~DeviceMirror() {
    for (void* p : ptrs_) cudaFree(p);
  }
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;

  void* base(const Buffer& b) const {
    const auto all = owner_->buffers();
    for (size_t i = 0; i < all.size(); ++i)
      if (all[i] == &b) return ptrs_[i];
    throw std::logic_error("buffer of another case");
  }
  AttnResArgs args(cudaStream_t stream) const {
    AttnResArgs a = owner_->args_on([this](const Buffer& b) { return base(b); }, kCuda0);
    a.stream = stream;
    return a;
  }
  Case download() const {
    Case out = *owner_;
    const auto dst = out.buffers();
    for (size_t i = 0; i < dst.size(); ++i)
      if (dst[i]->nbytes()) cuda_ok(cudaMemcpy(dst[i]->host(), ptrs_[i], dst[i]->nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return out;
  }

 private:
  const Case* owner_;
  std::vector<void*> ptrs_;
};

class Stream {
 public:
  Stream() { cuda_ok(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s_); }
  cudaStream_t get() const { return s_; }
  void sync() const {
    cuda_ok(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
    cuda_ok(cudaGetLastError(), "kernel");
  }

 private:
  cudaStream_t s_ = nullptr;
};

Options forced(KernelKind kernel, bool pdl = true) {
  Options o;
  o.kernel = kernel;
  o.pdl = pdl;
  return o;
}

// The plan for the case's shape on cuda:0.
attnres::Plan plan_on_gpu(const Case& c, const Options& o) {
  return attnres::plan(attnres::plan_query(c.cfg.op, c.args()), attnres::query_device(kCuda0), o);
}

Case run_gpu(const Case& c, const Options& o) {
  Stream stream;
  DeviceMirror mirror(c);
  attnres::run(c.cfg.op, mirror.args(stream.get()), o);
  stream.sync();
  return mirror.download();
}

// The call captured once in a CUDA graph and replayed `replays` times on fresh device copies of the inputs;
// returns what the replays left (the plan runs first, so its device query stays outside the capture).
Case run_gpu_graph(const Case& c, const Options& o, int replays) {
  Stream stream;
  DeviceMirror mirror(c);
  const AttnResArgs a = mirror.args(stream.get());
  attnres::plan(c.cfg.op, a, o);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  attnres::run(c.cfg.op, a, o);
  cuda_ok(cudaStreamEndCapture(stream.get(), &graph), "cudaStreamEndCapture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  for (int replay = 0; replay < replays; ++replay) cuda_ok(cudaGraphLaunch(exec, stream.get()), "cudaGraphLaunch");
  stream.sync();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return mirror.download();
}

Case run_cpu(const Case& c) {
  Case out = c;
  attnres::run(c.cfg.op, out.args());
  return out;
}

// The GPU's outputs against the CPU backend's (and the oracle's) on the same inputs.
void expect_gpu_matches_cpu(const Case& before, const Case& gpu) {
  const Case cpu = run_cpu(before);
  const Expected e = reference(before);
  const AttnResArgs a = before.args();
  EXPECT_TRUE(bf16_close(gpu.output.values(), cpu.output.values(), "output vs cpu"));
  EXPECT_TRUE(bf16_close(gpu.output.values(), widen(e.output), "output vs oracle"));
  if (a.updated.present()) { EXPECT_TRUE(bits_equal(gpu.updated.bits(), cpu.updated.bits(), "updated")); }
  if (a.mixture.present()) { EXPECT_TRUE(bf16_close(gpu.mixture.values(), cpu.mixture.values(), "mixture vs cpu")); }
  if (a.rsigma.present()) { EXPECT_TRUE(diag_close(gpu.rsigma.values(), cpu.rsigma.values(), "rsigma vs cpu")); }
  if (a.probs.present()) { EXPECT_TRUE(diag_close(gpu.probs.values(), cpu.probs.values(), "probs vs cpu")); }
  if (a.logits.present()) { EXPECT_TRUE(diag_close(gpu.logits.values(), cpu.logits.values(), "logits vs cpu")); }
  if (a.snapshot_slot >= 0) {
    EXPECT_TRUE(bits_equal(bank_row(gpu, a.snapshot_slot), cpu.updated.bits(), "snapshot row"));
  }
  EXPECT_TRUE(only_outputs_written(before, gpu));
}

struct GpuShape {
  const char* name;
  Config cfg;
};
void PrintTo(const GpuShape& s, std::ostream* os) { *os << s.name; }

std::vector<GpuShape> gpu_shapes() {
  using BL = BankLayout;
  return {
      {"AttnResOneCandidate", make_config(R, 1, 0, 7168)},
      {"AttnResKimiK3", make_config(R, 4, 3, 7168)},
      {"AttnResTokenMajor", make_config(R, 3, 9, 2304, [](Config& c) { c.bank_layout = BL::token_major; c.bank_rows = 12; })},
      {"RmsnormH4096", make_config(N, 2, 4, 4096, [](Config& c) { c.tap = true; })},
      {"RmsnormH8192", make_config(N, 5, 7, 8192, [](Config& c) { c.tap = true; })},
      {"AddDecodeT1", make_config(A, 1, 3, 7168)},
      {"Add2TapSnapshot", make_config(A, 8, 5, 7168, [](Config& c) { c.add2 = c.tap = true; c.snapshot_slot = 6; c.bank_rows = 8; })},
      {"Add2TokenMajorT32", make_config(A, 32, 11, 7168, [](Config& c) {
         c.add2 = c.tap = true; c.bank_layout = BL::token_major; c.bank_rows = 12; c.snapshot_slot = 11; })},
      {"Add2SixteenCandidatesH16384", make_config(A, 3, 15, 16384, [](Config& c) { c.add2 = true; })},
      {"Add2SmallPadded", make_config(A, 7, 2, 64, [](Config& c) { c.add2 = c.tap = true; c.pad = 8; })},
      {"Add2H72", make_config(A, 2, 6, 72, [](Config& c) { c.add2 = true; c.snapshot_slot = 6; })},
      {"AddKimiLinearPadded", make_config(A, 17, 7, 2304, [](Config& c) { c.pad = 16; c.offset = 8; })},
      {"SmallRows", make_config(A, 4, 8, 4096, [](Config& c) { c.add2 = true; c.magnitude = 1e-3; c.rms_eps = 1e-6; c.norm_eps = 1e-7; })},
  };
}

struct GpuCase {
  GpuShape shape;
  KernelKind kernel;
};
void PrintTo(const GpuCase& g, std::ostream* os) { *os << g.shape.name << "/" << attnres::kernel_name(g.kernel); }

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> out;
  for (const GpuShape& s : gpu_shapes())
    for (KernelKind k : {KernelKind::single_cta, KernelKind::split_k}) out.push_back({s, k});
  return out;
}

class GpuMatchesCpu : public ::testing::TestWithParam<GpuCase> {};

TEST_P(GpuMatchesCpu, AllOutputs) {
  REQUIRE_HOPPER();
  const GpuCase& g = GetParam();
  Config cfg = g.shape.cfg;
  cfg.seed = test_seed();
  const Case before(cfg);
  const Options o = forced(g.kernel);
  const attnres::Plan p = plan_on_gpu(before, o);
  if (!p.accepted()) {
    // Only single_cta declines, outside one block; the call is then refused with nothing written.
    ASSERT_EQ(g.kernel, KernelKind::single_cta) << p.decline;
    EXPECT_TRUE(contains(p.decline, "single_cta holds a token's rows in one block's registers"));
    Stream stream;
    DeviceMirror mirror(before);
    EXPECT_THROW(attnres::run(cfg.op, mirror.args(stream.get()), o), attnres::UnsupportedError);
    stream.sync();
    EXPECT_TRUE(storage_unchanged(before, mirror.download()));
    return;
  }
  ASSERT_EQ(p.kernel, g.kernel);
  const Case gpu = run_gpu(before, o);
  expect_gpu_matches_cpu(before, gpu);

  // The automatic choice runs the same kernel as forcing it, with the same bits.
  if (plan_on_gpu(before, Options{}).kernel == g.kernel) {
    EXPECT_TRUE(storage_unchanged(gpu, run_gpu(before, Options{})));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuMatchesCpu, ::testing::ValuesIn(gpu_cases()),
                         [](const ::testing::TestParamInfo<GpuCase>& info) {
                           return std::string(info.param.shape.name) + "_" + attnres::kernel_name(info.param.kernel);
                         });

class GpuKernel : public ::testing::TestWithParam<KernelKind> {};

// Identical inputs give identical bits: repeated calls, PDL on and off, and a CUDA-graph replay.
TEST_P(GpuKernel, DeterministicWithAndWithoutPdlAndInAGraph) {
  REQUIRE_HOPPER();
  Config cfg = make_config(A, 8, 3, 7168, [](Config& c) { c.add2 = c.tap = true; c.snapshot_slot = 3; });
  cfg.seed = test_seed(static_cast<uint64_t>(GetParam()));
  const Case before(cfg);
  const Case first = run_gpu(before, forced(GetParam(), true));
  EXPECT_TRUE(storage_unchanged(first, run_gpu(before, forced(GetParam(), true)))) << "second run";
  EXPECT_TRUE(storage_unchanged(first, run_gpu(before, forced(GetParam(), false)))) << "PDL off";

  for (bool pdl : {true, false})
    EXPECT_TRUE(storage_unchanged(first, run_gpu_graph(before, forced(GetParam(), pdl), 2)))
        << "graph replay, PDL " << pdl;
}

// A token's result depends on neither T nor its position in the call.
TEST_P(GpuKernel, TokenResultIndependentOfBatch) {
  REQUIRE_HOPPER();
  Config cfg = make_config(A, 9, 3, 7168, [](Config& c) { c.add2 = c.tap = true; });  // N = 4: single_cta's range
  cfg.seed = test_seed(static_cast<uint64_t>(GetParam()));
  const Case batch = run_gpu(Case(cfg), forced(GetParam()));
  for (int64_t t : {int64_t{0}, int64_t{4}, int64_t{8}}) {
    const Case one = token_case(batch, t);
    const Case single = run_gpu(one, forced(GetParam()));
    for (int64_t h = 0; h < cfg.H; ++h) {
      ASSERT_EQ(single.output.at(0, h), batch.output.at(t, h)) << "output, token " << t << " h " << h;
      ASSERT_EQ(single.mixture.at(0, h), batch.mixture.at(t, h)) << "mixture, token " << t << " h " << h;
      ASSERT_EQ(single.updated.at(0, h), batch.updated.at(t, h)) << "updated, token " << t << " h " << h;
    }
  }
}

// add + add2 fused == the one-addend call on their bf16 sum == the no-add call on the materialized prefix.
TEST_P(GpuKernel, Add2EqualsPresummedAddEqualsMaterializedPrefix) {
  REQUIRE_HOPPER();
  Config cfg = make_config(A, 6, 3, 7168, [](Config& c) { c.add2 = c.tap = true; });  // N = 4: single_cta's range
  cfg.seed = test_seed(static_cast<uint64_t>(GetParam()));
  const Case two_in(cfg);
  const Case two = run_gpu(two_in, forced(GetParam()));

  Config one_cfg = cfg;
  one_cfg.add2 = false;
  Case one(one_cfg);  // same seed: same prefix, bank and weights
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t h = 0; h < cfg.H; ++h) one.add.at(t, h) = bf16_add(two_in.add.at(t, h), two_in.add2.at(t, h));
  one = run_gpu(one, forced(GetParam()));

  Config none_cfg = cfg;
  none_cfg.op = N;
  Case none(none_cfg);
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t h = 0; h < cfg.H; ++h) none.layer_residual.at(t, h) = two.updated.at(t, h);
  none = run_gpu(none, forced(GetParam()));

  EXPECT_TRUE(bits_equal(two.updated.bits(), reference(two_in).updated, "updated vs prefix + (add + add2)"));
  EXPECT_TRUE(bits_equal(one.updated.bits(), two.updated.bits(), "updated (presummed)"));
  EXPECT_TRUE(bits_equal(one.output.bits(), two.output.bits(), "output (presummed)"));
  EXPECT_TRUE(bits_equal(one.mixture.bits(), two.mixture.bits(), "mixture (presummed)"));
  EXPECT_TRUE(bits_equal(none.output.bits(), two.output.bits(), "output (materialized)"));
  EXPECT_TRUE(bits_equal(none.mixture.bits(), two.mixture.bits(), "mixture (materialized)"));
}

TEST_P(GpuKernel, SubnormalsKept) {
  REQUIRE_HOPPER();
  const Case before = subnormal_case(test_seed(static_cast<uint64_t>(GetParam())));
  const Case gpu = run_gpu(before, forced(GetParam()));
  expect_subnormals_kept(before, gpu);
  expect_gpu_matches_cpu(before, gpu);
}

// A real device pointer off its 16-byte alignment is refused before any launch; nothing written.
TEST_P(GpuKernel, MisalignedDevicePointerRefused) {
  REQUIRE_HOPPER();
  Config cfg = make_config(A, 2, 2, 64, [](Config& c) { c.add2 = true; c.pad = 16; });
  cfg.seed = test_seed(static_cast<uint64_t>(GetParam()));
  const Case before(cfg);
  Stream stream;
  DeviceMirror mirror(before);
  AttnResArgs a = mirror.args(stream.get());
  a.layer_residual_add.data = static_cast<char*>(a.layer_residual_add.data) + 2;
  const std::string msg = error_of<attnres::ArgumentError>([&] { attnres::run(cfg.op, a, forced(GetParam())); });
  EXPECT_EQ(msg.rfind("attn_res_add_rmsnorm: layer_residual_add must be 16-byte aligned for the CUDA kernels", 0), 0u) << msg;
  stream.sync();
  EXPECT_TRUE(storage_unchanged(before, mirror.download()));
}

// split_k at H <= 1024 runs a cluster of one block, which exchanges nothing (st.async into a one-block cluster is
// invalid: compute-sanitizer memcheck, 2026-11-30) and must give single_cta's bits: the same thread-to-vector
// map, warp reduction and warp order, and a rank sum of one value is that value. Every mode, N in one bucket.
TEST(GpuSplitK, OneBlockClusterGivesSingleCtaBits) {
  REQUIRE_HOPPER();
  for (const Config& base : {make_config(A, 5, 3, 1024, [](Config& c) { c.add2 = c.tap = true; c.snapshot_slot = 3; c.bank_rows = 4; }),
                             make_config(A, 3, 2, 64, [](Config& c) { c.pad = 8; }), make_config(N, 4, 1, 1000),
                             make_config(R, 2, 3, 512)}) {
    Config cfg = base;
    cfg.seed = test_seed(static_cast<uint64_t>(cfg.H));
    const Case before(cfg);
    ASSERT_EQ(plan_on_gpu(before, forced(KernelKind::split_k)).cluster, 1) << "H = " << cfg.H;
    const Case split = run_gpu(before, forced(KernelKind::split_k));
    EXPECT_TRUE(storage_unchanged(split, run_gpu(before, forced(KernelKind::single_cta)))) << "H = " << cfg.H;
    expect_gpu_matches_cpu(before, split);
  }
}

// single_cta lays split_k's rank chunks out inside its block (plan.cpp one_block_threads), so every output is
// split_k's bit for bit, also where split_k runs a cluster of several blocks: whole 128-vector chunks (2048,
// 8192), short last chunks and partial warps (7176: 8 chunks of 113, 4104: 5 of 103, 1032: 2 of 65), the tap,
// the fp32 diagnostics and the snapshot row included.
TEST(GpuSingleCta, GivesSplitKBitsAtEveryChunking) {
  REQUIRE_HOPPER();
  for (const Config& base : {make_config(A, 7, 3, 7176, [](Config& c) { c.add2 = c.tap = true; c.snapshot_slot = 3; c.bank_rows = 4; }),
                             make_config(A, 5, 1, 8192, [](Config& c) { c.tap = true; }), make_config(N, 3, 2, 4104),
                             make_config(R, 9, 3, 2048), make_config(R, 4, 0, 1032), make_config(N, 2, 3, 7168, [](Config& c) { c.tap = true; })}) {
    Config cfg = base;
    cfg.seed = test_seed(static_cast<uint64_t>(cfg.H));
    const Case before(cfg);
    const Case split = run_gpu(before, forced(KernelKind::split_k));
    ASSERT_EQ(plan_on_gpu(before, forced(KernelKind::split_k)).cluster, attnres::tuning::split_k_cluster(cfg.H));
    EXPECT_TRUE(storage_unchanged(split, run_gpu(before, forced(KernelKind::single_cta)))) << "H = " << cfg.H;
    expect_gpu_matches_cpu(before, split);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, GpuKernel, ::testing::Values(KernelKind::single_cta, KernelKind::split_k),
                         [](const ::testing::TestParamInfo<KernelKind>& info) {
                           return std::string(attnres::kernel_name(info.param));
                         });

// ---------------------------------------------------------------------------------------------------------
// The persistent kernel (cuda/attn_res_persistent.cuh): reached by the persistent op and, under the
// persistent topology, by attn_res_rmsnorm and attn_res_add_rmsnorm.

Options persistent_topology(bool pdl = true) {
  Options o;
  o.topology = attnres::Topology::persistent;
  o.pdl = pdl;
  return o;
}

std::vector<GpuShape> persistent_shapes() {
  using BL = BankLayout;
  return {
      {"KimiK3Add", make_config(P, 300, 8, 7168)},
      {"KimiK3NoAdd", make_config(P, 300, 8, 7168, [](Config& c) { c.add = false; })},
      {"TwoPassesH16384", make_config(P, 40, 15, 16384, [](Config& c) { c.bank_layout = BL::token_major; c.bank_rows = 16; })},
      {"TwoPassesH7168", make_config(P, 140, 15, 7168)},
      {"OddHiddenPaddedOffset", make_config(P, 150, 3, 2056, [](Config& c) { c.pad = 16; c.offset = 8; })},
      {"RmsnormTopology", make_config(N, 200, 5, 4096, [](Config& c) { c.bank_layout = BL::token_major; c.bank_rows = 7; })},
      {"AddRmsnormTopology", make_config(A, 133, 11, 8192, [](Config& c) { c.bank_layout = BL::token_major; c.bank_rows = 12; })},
      {"OneCandidateOneVector", make_config(P, 70, 0, 8)},
      {"KimiLinear", make_config(P, 500, 4, 2304, [](Config& c) { c.rms_eps = 1e-2; c.norm_eps = 1e-6; c.magnitude = 0.1; })},
  };
}

class GpuPersistentShapes : public ::testing::TestWithParam<GpuShape> {};

TEST_P(GpuPersistentShapes, MatchesCpuAndSplitK) {
  REQUIRE_HOPPER();
  Config cfg = GetParam().cfg;
  cfg.seed = test_seed();
  const Case before(cfg);
  const Options o = persistent_topology();
  const attnres::Plan p = plan_on_gpu(before, o);
  ASSERT_TRUE(p.accepted()) << p.decline;
  ASSERT_EQ(p.kernel, KernelKind::persistent);
  const Case gpu = run_gpu(before, o);
  expect_gpu_matches_cpu(before, gpu);
  // The per-token split_k kernel on the same inputs: updated and output bit for bit (the persistent kernel
  // reduces in split_k's order).
  if (cfg.op != P) {
    const Case sk = run_gpu(before, forced(KernelKind::split_k));
    EXPECT_TRUE(bits_equal(gpu.output.bits(), sk.output.bits(), "output vs split_k"));
    if (before.uses_add()) { EXPECT_TRUE(bits_equal(gpu.updated.bits(), sk.updated.bits(), "updated vs split_k")); }
  }
  // Run to run, and with PDL off: the same bits.
  EXPECT_TRUE(storage_unchanged(gpu, run_gpu(before, o))) << "second run";
  EXPECT_TRUE(storage_unchanged(gpu, run_gpu(before, persistent_topology(false)))) << "PDL off";
}

INSTANTIATE_TEST_SUITE_P(Persistent, GpuPersistentShapes, ::testing::ValuesIn(persistent_shapes()),
                         [](const ::testing::TestParamInfo<GpuShape>& info) { return std::string(info.param.name); });

// The launcher run directly with other ring depths, pass modes and grids than the plan's: a token's bits do
// not depend on any of them (the consumer count and vector bucket, which fix the arithmetic, stay the plan's).
// On the automatic geometry (two blocks per SM at H = 7168 and 2056) and on one block per SM.
TEST(GpuPersistent, RingDepthPassesAndGridDoNotChangeBits) {
  REQUIRE_HOPPER();
  for (int32_t per_sm : {0, 1})
  for (bool add : {true, false}) {
    Options geometry;
    geometry.persistent_blocks_per_sm = per_sm;
    for (int64_t H : {int64_t{7168}, int64_t{16384}, int64_t{2056}}) {
      // K = 3 at H = 16384 leaves a one-pass ring (6 slots) to compare with; K = 8 elsewhere.
      const int64_t K = H == 16384 ? 3 : 8;
      Config cfg = make_config(P, 300, K, H, [&](Config& c) {
        c.add = add;
        c.bank_layout = BankLayout::token_major;
        c.bank_rows = K + 1;
      });
      cfg.seed = test_seed(static_cast<uint64_t>(H) + add);
      const Case before(cfg);
      const attnres::Plan planned = plan_on_gpu(before, geometry);
      ASSERT_EQ(planned.kernel, KernelKind::persistent) << planned.decline;
      EXPECT_EQ(planned.blocks_per_sm, per_sm == 1 || H == 16384 ? 1 : 2);
      const Case baseline = run_gpu(before, Options{});
      const int32_t rows = static_cast<int32_t>(cfg.K + 1 + (add ? 1 : 0));
      struct Variant {
        int32_t slots, passes, blocks;
      };
      std::vector<Variant> variants = {{2, 2, 132}, {3, 2, 7}, {planned.slots, 2, 1}, {planned.slots, 2, 300}};
      if (planned.slots >= rows) {
        variants.push_back({rows, 1, 132});
        variants.push_back({planned.slots, 1, 5});
      }
      for (const Variant& v : variants) {
        SCOPED_TRACE("per_sm=" + std::to_string(planned.blocks_per_sm) + " H=" + std::to_string(H) +
                     " add=" + std::to_string(add) + " slots=" + std::to_string(v.slots) +
                     " passes=" + std::to_string(v.passes) + " blocks=" + std::to_string(v.blocks));
        attnres::Plan p = planned;
        p.slots = v.slots;
        p.passes = v.passes;
        p.blocks = v.blocks;
        p.smem_bytes = static_cast<int32_t>(attnres::persistent::smem_bytes(v.slots, cfg.K + 1, H));
        Stream stream;
        DeviceMirror mirror(before);
        attnres::detail::cuda_attn_res_persistent(P, mirror.args(stream.get()), p);
        stream.sync();
        EXPECT_TRUE(storage_unchanged(baseline, mirror.download()));
      }
    }
  }
}

// The plan's automatic two-blocks geometry and the occupancy calculator agree: wherever the pure plan picks two
// blocks per SM (persistent_layout.hpp two_blocks_fit), both are resident, so run() never has to replan it on
// one block; and the attnres::plan of the call's own tensors (the one run() takes) keeps the two blocks.
TEST(GpuPersistent, AutomaticTwoBlocksAreResident) {
  REQUIRE_HOPPER();
  int checked = 0;
  for (int64_t H : {int64_t{8}, int64_t{1024}, int64_t{1536}, int64_t{2056}, int64_t{2304}, int64_t{4096},
                    int64_t{7168}})
    for (bool add : {true, false}) {
      SCOPED_TRACE("H=" + std::to_string(H) + " add=" + std::to_string(add));
      Config cfg = make_config(P, 300, 8, H, [&](Config& c) { c.add = add; });
      const Case before(cfg);
      const attnres::Plan planned = plan_on_gpu(before, Options{});
      ASSERT_EQ(planned.kernel, KernelKind::persistent) << planned.decline;
      ASSERT_EQ(planned.blocks_per_sm, 2);
      Stream stream;
      DeviceMirror mirror(before);
      const AttnResArgs a = mirror.args(stream.get());
      EXPECT_GE(attnres::detail::cuda_attn_res_persistent_resident(P, a, planned), 2);
      EXPECT_EQ(attnres::plan(P, a, Options{}).blocks_per_sm, 2);
      ++checked;
    }
  EXPECT_EQ(checked, 14);
}

// A CUDA-graph replay of the call gives the eager bits, with and without PDL.
TEST(GpuPersistent, GraphReplayEqualsEager) {
  REQUIRE_HOPPER();
  Config cfg = make_config(A, 500, 8, 7168, [](Config& c) { c.bank_layout = BankLayout::token_major; c.bank_rows = 9; });
  cfg.seed = test_seed();
  const Case before(cfg);
  const Case eager = run_gpu(before, persistent_topology());
  for (bool pdl : {true, false})
    EXPECT_TRUE(storage_unchanged(eager, run_gpu_graph(before, persistent_topology(pdl), 3)))
        << "graph replay, PDL " << pdl;
}

// A token's result depends on neither T, nor its position, nor the block (and lap) that runs it.
TEST(GpuPersistent, TokenResultIndependentOfBatch) {
  REQUIRE_HOPPER();
  Config cfg = make_config(P, 400, 6, 7168);
  cfg.seed = test_seed();
  const Case batch = run_gpu(Case(cfg), Options{});
  for (int64_t t : {int64_t{0}, int64_t{131}, int64_t{132}, int64_t{265}, int64_t{399}}) {
    const Case one = token_case(batch, t);
    const Case single = run_gpu(one, Options{});
    for (int64_t h = 0; h < cfg.H; ++h) {
      ASSERT_EQ(single.output.at(0, h), batch.output.at(t, h)) << "output, token " << t << " h " << h;
      ASSERT_EQ(single.updated.at(0, h), batch.updated.at(t, h)) << "updated, token " << t << " h " << h;
    }
  }
}

// prefix + add with subnormal operands and sums: bit for bit PyTorch's bf16 add.
TEST(GpuPersistent, SubnormalsKept) {
  REQUIRE_HOPPER();
  Config cfg = make_config(P, 200, 2, 128);
  cfg.seed = test_seed();
  Case before(cfg);
  constexpr size_t kPatterns = sizeof kSubnormalSums / sizeof kSubnormalSums[0];
  int subnormal = 0;
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t h = 0; h < cfg.H; h += 2) {
      const SubnormalSum& s = kSubnormalSums[size_t((t * cfg.H + h) / 2) % kPatterns];
      before.layer_residual.at(t, h) = s.prefix;
      before.add.at(t, h) = bf16_add(s.add, s.add2);  // one addend holding the pattern's add + add2
    }
  const Case gpu = run_gpu(before, Options{});
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t h = 0; h < cfg.H; h += 2) {
      const SubnormalSum& s = kSubnormalSums[size_t((t * cfg.H + h) / 2) % kPatterns];
      ASSERT_EQ(gpu.updated.at(t, h), s.expected) << "token " << t << " h " << h;
      subnormal += bf16_is_subnormal(gpu.updated.at(t, h));
    }
  EXPECT_GT(subnormal, 0);
  expect_gpu_matches_cpu(before, gpu);
}

// add2 under the persistent topology: the persistent kernel runs it (the second addend one more ring row), in
// one pass and in two (the mixing pass from `updated`), with the CPU backend's bits and split_k's whole storage.
TEST(GpuPersistent, Add2RunsOnThePersistentKernel) {
  REQUIRE_HOPPER();
  Config cfg = make_config(A, 300, 8, 7168, [](Config& c) { c.add2 = true; });
  cfg.seed = test_seed();
  const Case before(cfg);
  const Case split_k = run_gpu(before, forced(KernelKind::split_k));
  for (const int32_t passes : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "passes = " << passes);
    Options o = persistent_topology();
    o.persistent_blocks_per_sm = 1;  // 16 slots: N = 8's ten rows fit one pass
    o.persistent_passes = passes;
    const attnres::Plan p = plan_on_gpu(before, o);
    ASSERT_TRUE(p.accepted()) << p.decline;
    ASSERT_EQ(p.kernel, KernelKind::persistent);
    EXPECT_EQ(p.passes, passes);
    const Case gpu = run_gpu(before, o);
    expect_gpu_matches_cpu(before, gpu);
    EXPECT_TRUE(storage_unchanged(gpu, split_k));
  }
}

#endif  // ATTNRES_WITH_CUDA

}  // namespace
}  // namespace attnres_test
