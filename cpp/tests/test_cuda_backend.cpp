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
#include <cuda_runtime.h>
#endif

namespace attnres_test {
namespace {

using attnres::KernelKind;
using attnres::Options;

constexpr AttnResOp R = AttnResOp::attn_res;
constexpr AttnResOp N = AttnResOp::attn_res_rmsnorm;
constexpr AttnResOp A = AttnResOp::attn_res_add_rmsnorm;
constexpr AttnResOp P = AttnResOp::attn_res_add_rmsnorm_persistent;
const Device kCuda0{DeviceType::cuda, 0};

Config make(AttnResOp op, int64_t T, int64_t K, int64_t H, std::function<void(Config&)> more = nullptr) {
  Config c;
  c.op = op;
  c.T = T;
  c.K = K;
  c.H = H;
  c.add = op == A || op == P;
  c.diagnostics = op == R;
  if (more) more(c);
  return c;
}

// No usable device: a call on CUDA tensors is refused before anything runs (here the "device" pointers are
// host memory, so a write would show up in the storage compare). Runs on every CPU-only machine.
TEST(CudaUnavailable, CallOnCudaTensorsIsRefusedCleanly) {
  if (attnres::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is visible: the GPU suites below cover it";
  Config cfg = make(A, 2, 2, 64, [](Config& c) { c.add2 = c.tap = true; });
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

// Why the GPU suites cannot run here ("" when they can).
std::string gpu_skip_reason() {
  if (attnres::cuda_device_count() == 0) return "no CUDA device visible";
  const attnres::DeviceInfo info = attnres::query_device(kCuda0);
  if (info.cc_major < 9)
    return info.name + " has compute capability " + std::to_string(info.cc_major) + "." +
           std::to_string(info.cc_minor) + " < 9.0";
  return "";
}

#define REQUIRE_HOPPER()                                      \
  do {                                                        \
    const std::string why_not = gpu_skip_reason();            \
    if (!why_not.empty()) GTEST_SKIP() << why_not;            \
  } while (0)

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

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

std::vector<GpuShape> gpu_shapes() {
  using BL = BankLayout;
  return {
      {"AttnResOneCandidate", make(R, 1, 0, 7168)},
      {"AttnResKimiK3", make(R, 4, 3, 7168)},
      {"AttnResTokenMajor", make(R, 3, 9, 2304, [](Config& c) { c.bank_layout = BL::token_major; c.bank_rows = 12; })},
      {"RmsnormH4096", make(N, 2, 4, 4096, [](Config& c) { c.tap = true; })},
      {"RmsnormH8192", make(N, 5, 7, 8192, [](Config& c) { c.tap = true; })},
      {"AddDecodeT1", make(A, 1, 3, 7168)},
      {"Add2TapSnapshot", make(A, 8, 5, 7168, [](Config& c) { c.add2 = c.tap = true; c.snapshot_slot = 6; c.bank_rows = 8; })},
      {"Add2TokenMajorT32", make(A, 32, 11, 7168, [](Config& c) {
         c.add2 = c.tap = true; c.bank_layout = BL::token_major; c.bank_rows = 12; c.snapshot_slot = 11; })},
      {"Add2SixteenCandidatesH16384", make(A, 3, 15, 16384, [](Config& c) { c.add2 = true; })},
      {"Add2SmallPadded", make(A, 7, 2, 64, [](Config& c) { c.add2 = c.tap = true; c.pad = 8; })},
      {"Add2H72", make(A, 2, 6, 72, [](Config& c) { c.add2 = true; c.snapshot_slot = 6; })},
      {"AddKimiLinearPadded", make(A, 17, 7, 2304, [](Config& c) { c.pad = 16; c.offset = 8; })},
      {"SmallRows", make(A, 4, 8, 4096, [](Config& c) { c.add2 = true; c.magnitude = 1e-3; c.rms_eps = 1e-6; c.norm_eps = 1e-7; })},
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
  Config cfg = make(A, 8, 3, 7168, [](Config& c) { c.add2 = c.tap = true; c.snapshot_slot = 3; });
  cfg.seed = test_seed(static_cast<uint64_t>(GetParam()));
  const Case before(cfg);
  const Case first = run_gpu(before, forced(GetParam(), true));
  EXPECT_TRUE(storage_unchanged(first, run_gpu(before, forced(GetParam(), true)))) << "second run";
  EXPECT_TRUE(storage_unchanged(first, run_gpu(before, forced(GetParam(), false)))) << "PDL off";

  for (bool pdl : {true, false}) {
    Stream stream;
    DeviceMirror mirror(before);
    const AttnResArgs a = mirror.args(stream.get());
    const Options o = forced(GetParam(), pdl);
    attnres::plan(cfg.op, a, o);  // device query outside the capture
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    attnres::run(cfg.op, a, o);
    cuda_ok(cudaStreamEndCapture(stream.get(), &graph), "cudaStreamEndCapture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    for (int replay = 0; replay < 2; ++replay) cuda_ok(cudaGraphLaunch(exec, stream.get()), "cudaGraphLaunch");
    stream.sync();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    EXPECT_TRUE(storage_unchanged(first, mirror.download())) << "graph replay, PDL " << pdl;
  }
}

// A token's result depends on neither T nor its position in the call.
TEST_P(GpuKernel, TokenResultIndependentOfBatch) {
  REQUIRE_HOPPER();
  Config cfg = make(A, 9, 3, 7168, [](Config& c) { c.add2 = c.tap = true; });  // N = 4: single_cta's range
  cfg.seed = test_seed(static_cast<uint64_t>(GetParam()));
  const Case batch = run_gpu(Case(cfg), forced(GetParam()));
  for (int64_t t : {int64_t{0}, int64_t{4}, int64_t{8}}) {
    Config one_cfg = cfg;
    one_cfg.T = 1;
    Case one(one_cfg);
    for (int64_t h = 0; h < cfg.H; ++h) {
      one.layer_residual.at(0, h) = batch.layer_residual.at(t, h);
      one.add.at(0, h) = batch.add.at(t, h);
      one.add2.at(0, h) = batch.add2.at(t, h);
      for (int64_t k = 0; k < cfg.K; ++k) one.bank.at(k, 0, h) = batch.bank.at(k, t, h);
    }
    one.res_weight = batch.res_weight;
    one.rms_weight = batch.rms_weight;
    one.norm_weight = batch.norm_weight;
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
  Config cfg = make(A, 6, 3, 7168, [](Config& c) { c.add2 = c.tap = true; });  // N = 4: single_cta's range
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
  Config cfg = make(A, 2, 2, 64, [](Config& c) { c.add2 = true; c.pad = 16; });
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

INSTANTIATE_TEST_SUITE_P(Kernels, GpuKernel, ::testing::Values(KernelKind::single_cta, KernelKind::split_k),
                         [](const ::testing::TestParamInfo<KernelKind>& info) {
                           return std::string(attnres::kernel_name(info.param));
                         });

// The persistent op, once its kernel is in the build (until then the plan says so and the call is refused).
TEST(GpuPersistent, MatchesCpuOrDeclinesCleanly) {
  REQUIRE_HOPPER();
  for (bool with_add : {true, false}) {
    Config cfg = make(P, 300, 7, 7168, [&](Config& c) { c.add = with_add; });
    cfg.seed = test_seed(with_add);
    const Case before(cfg);
    const attnres::Plan p = plan_on_gpu(before, Options{});
    if (!p.accepted()) {
      Stream stream;
      DeviceMirror mirror(before);
      EXPECT_THROW(attnres::run(P, mirror.args(stream.get())), attnres::UnsupportedError);
      stream.sync();
      EXPECT_TRUE(storage_unchanged(before, mirror.download()));
      GTEST_SKIP() << "persistent kernel declined: " << p.decline;
    }
    EXPECT_EQ(p.kernel, KernelKind::persistent);
    expect_gpu_matches_cpu(before, run_gpu(before, Options{}));
  }
}

#endif  // ATTNRES_WITH_CUDA

}  // namespace
}  // namespace attnres_test
