// attn_res with an addend (layer_residual_add, optionally layer_residual_add2, no trailing norm) and the in-place
// prefix update (`updated` = layer_residual itself) of every op that writes `updated`:
//
//   * attn_res with addends computes `updated` and the mixture of attn_res_add_rmsnorm bit for bit (its `mixture`
//     tap: the same kernels' reduction orders), and equals attn_res without an addend on the materialized prefix;
//   * in place is bitwise the out-of-place call (outputs, diagnostics, snapshot row), on the CPU backend and on
//     every forced CUDA kernel (single_cta, streaming single_cta, split_k, persistent);
//   * the preconditions: `updated` exactly with an addend, the one sanctioned alias and nothing else.
//
// The GPU suites skip (with the reason) without a CUDA device of compute capability >= 9.0.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.hpp"

#if ATTNRES_WITH_CUDA
#include "cuda_test_util.hpp"
#endif

namespace attnres_test {
namespace {

// One call on a Case's buffers: which optional arguments it passes, and whether `updated` is layer_residual.
struct Call {
  AttnResOp op = R;
  bool add = true, add2 = false, tap = false, diagnostics = true, in_place = false;
};

AttnResArgs call_args(const Case& c, const Call& k, const std::function<void*(const Buffer&)>& base, Device device) {
  auto ref = [&](const Buffer& b) { return b.ref_at(base(b), device); };
  AttnResArgs a;
  a.layer_residual = ref(c.layer_residual);
  if (k.add) a.layer_residual_add = ref(c.add);
  if (k.add2) a.layer_residual_add2 = ref(c.add2);
  a.block_residual = ref(c.bank);
  a.res_weight = ref(c.res_weight);
  a.rms_weight = ref(c.rms_weight);
  if (k.op != R) a.norm_weight = ref(c.norm_weight);
  a.rms_eps = c.cfg.rms_eps;
  a.norm_eps = c.cfg.norm_eps;
  a.output = ref(c.output);
  if (k.add) a.updated = k.in_place ? a.layer_residual : ref(c.updated);
  if (k.tap) a.mixture = ref(c.mixture);
  if (k.diagnostics && k.op == R) {
    a.rsigma = ref(c.rsigma);
    a.probs = ref(c.probs);
    a.logits = ref(c.logits);
  }
  a.snapshot_slot = c.cfg.snapshot_slot;
  return a;
}
AttnResArgs host_args(const Case& c, const Call& k) {
  return call_args(c, k, [](const Buffer& b) { return const_cast<void*>(b.host()); }, Device{});
}

Case make_case(int64_t T, int64_t K, int64_t H, int64_t snapshot_slot, uint64_t seed, int64_t pad = 0) {
  Config cfg;
  cfg.op = R;
  cfg.T = T;
  cfg.K = K;
  cfg.H = H;
  cfg.pad = pad;
  cfg.snapshot_slot = snapshot_slot;
  cfg.bank_rows = snapshot_slot + 1;
  cfg.seed = seed;
  return Case(cfg);
}

Case run_cpu(const Case& c, const Call& k) {
  Case out = c;
  attnres::run(k.op, host_args(out, k));
  return out;
}

// Everything an in-place call wrote equals the out-of-place call's, and it wrote nothing else.
void expect_in_place_equals_out_of_place(const Case& before, const Case& out, const Case& in, const Call& k) {
  const std::string what = std::string(attnres::op_name(k.op)) + (k.add2 ? " add2" : " add");
  EXPECT_TRUE(bits_equal(in.layer_residual.bits(), out.updated.bits(), what + ": updated in place"));
  EXPECT_TRUE(bits_equal(in.output.bits(), out.output.bits(), what + ": output"));
  if (k.tap) { EXPECT_TRUE(bits_equal(in.mixture.bits(), out.mixture.bits(), what + ": mixture")); }
  if (k.op == R && k.diagnostics) {
    EXPECT_EQ(in.rsigma.f32, out.rsigma.f32) << what << ": rsigma";
    EXPECT_EQ(in.probs.f32, out.probs.f32) << what << ": probs";
    EXPECT_EQ(in.logits.f32, out.logits.f32) << what << ": logits";
  }
  if (before.cfg.snapshot_slot >= 0) {
    EXPECT_TRUE(bits_equal(bank_row(in, before.cfg.snapshot_slot), out.updated.bits(), what + ": snapshot row"));
  }
  // The out-of-place call left layer_residual and its (unrequested) updated buffer's neighbours alone; in place
  // the updated buffer is not an argument at all.
  EXPECT_TRUE(same_storage(out.layer_residual, before.layer_residual)) << what;
  EXPECT_TRUE(same_storage(in.updated, before.updated)) << what;
  EXPECT_TRUE(same_storage(in.add, before.add)) << what;
}

// ---------------------------------------------------------------------------------------------------------
// CPU backend

class CpuAddend : public ::testing::TestWithParam<int64_t> {};  // N

TEST_P(CpuAddend, MixtureIsTheAddRmsnormTapBitwise) {
  const int64_t N = GetParam();
  for (bool add2 : {false, true}) {
    const Case c = make_case(3, N - 1, 128, N - 1 + 1, test_seed(add2), /*pad=*/8);
    const Case mixed = run_cpu(c, {R, true, add2, false, true, false});
    const Case normed = run_cpu(c, {A, true, add2, true, false, false});
    EXPECT_TRUE(bits_equal(mixed.output.bits(), normed.mixture.bits(), "attn_res output vs add_rmsnorm tap"));
    EXPECT_TRUE(bits_equal(mixed.updated.bits(), normed.updated.bits(), "updated"));
    EXPECT_TRUE(bits_equal(bank_row(mixed, N), normed.updated.bits(), "snapshot row"));
    EXPECT_TRUE(bits_equal(mixed.updated.bits(), reference([&] {
                                                   Case o = c;
                                                   o.cfg.op = A;
                                                   o.cfg.add = true;
                                                   o.cfg.add2 = add2;
                                                   return o;
                                                 }()).updated,
                           "updated vs oracle"));
  }
}

TEST_P(CpuAddend, EqualsAttnResOnTheMaterializedPrefix) {
  const int64_t N = GetParam();
  for (bool add2 : {false, true}) {
    const Case c = make_case(4, N - 1, 64, -1, test_seed(add2));
    const Case with_add = run_cpu(c, {R, true, add2, false, true, false});
    Case materialized = c;
    materialized.layer_residual = with_add.updated;
    const Case plain = run_cpu(materialized, {R, false, false, false, true, false});
    EXPECT_TRUE(bits_equal(with_add.output.bits(), plain.output.bits(), "output"));
    EXPECT_EQ(with_add.rsigma.f32, plain.rsigma.f32);
    EXPECT_EQ(with_add.probs.f32, plain.probs.f32);
    EXPECT_EQ(with_add.logits.f32, plain.logits.f32);
  }
}

TEST_P(CpuAddend, InPlaceEqualsOutOfPlace) {
  const int64_t N = GetParam();
  const std::vector<Call> calls = {{R, true, false, false, true}, {R, true, true, false, true},
                                   {R, true, true, false, false}, {A, true, false, true, false},
                                   {A, true, true, true, false},  {P, true, false, false, false}};
  for (size_t i = 0; i < calls.size(); ++i) {
    Call k = calls[i];
    // The persistent op takes no snapshot write.
    const Case c = make_case(5, N - 1, 64, k.op == P ? -1 : N, test_seed(i), /*pad=*/8);
    const Case out = run_cpu(c, k);
    k.in_place = true;
    const Case in = run_cpu(c, k);
    expect_in_place_equals_out_of_place(c, out, in, k);
  }
}

INSTANTIATE_TEST_SUITE_P(N, CpuAddend, ::testing::Values(1, 2, 5, 9, 16));

TEST(CpuAddend, DiagnosticsAbsentAreNotWritten) {
  const Case c = make_case(2, 2, 64, -1, test_seed());
  const Case out = run_cpu(c, {R, true, true, false, false, false});
  EXPECT_TRUE(same_storage(out.rsigma, c.rsigma));
  EXPECT_TRUE(same_storage(out.probs, c.probs));
  EXPECT_TRUE(same_storage(out.logits, c.logits));
  const Case with = run_cpu(c, {R, true, true, false, true, false});
  EXPECT_TRUE(bits_equal(out.output.bits(), with.output.bits(), "output with and without diagnostics"));
}

// ---------------------------------------------------------------------------------------------------------
// Preconditions (every backend: validation runs before anything)

std::string refusal(const Case& c, AttnResOp op, const AttnResArgs& a) {
  Case copy = c;
  const std::string message = error_of<attnres::ArgumentError>([&] { attnres::run(op, a); });
  EXPECT_TRUE(storage_unchanged(copy, c)) << message;
  return message;
}

TEST(AddendRejections, UpdatedExactlyWithAnAddend) {
  Case c = make_case(2, 2, 64, -1, test_seed());
  AttnResArgs a = host_args(c, {R, true, false, false, true, false});
  a.updated = TensorRef{};
  EXPECT_EQ(refusal(c, R, a), "attn_res: updated is required");
  a = host_args(c, {R, false, false, false, true, false});
  a.updated = c.updated.ref();
  EXPECT_EQ(refusal(c, R, a), "attn_res: updated is only produced with layer_residual_add");
  a = host_args(c, {R, true, true, false, true, false});
  a.layer_residual_add = TensorRef{};
  EXPECT_EQ(refusal(c, R, a), "attn_res: layer_residual_add2 requires layer_residual_add");
  // attn_res still takes neither a norm weight nor a tap.
  a = host_args(c, {R, true, false, false, true, false});
  a.mixture = c.mixture.ref();
  EXPECT_EQ(refusal(c, R, a), "attn_res: mixture is not an argument of this op");
}

TEST(AddendRejections, AddendShapeAndDtype) {
  Case c = make_case(2, 2, 64, -1, test_seed());
  Case wrong = make_case(3, 2, 64, -1, test_seed(1));
  AttnResArgs a = host_args(c, {R, true, true, false, true, false});
  a.layer_residual_add2 = wrong.add2.ref();
  EXPECT_TRUE(contains(refusal(c, R, a), "attn_res: layer_residual_add2 must have shape [T, H] = [2, 64]"));
  a = host_args(c, {R, true, false, false, true, false});
  a.updated.dtype = DType::f32;
  EXPECT_TRUE(contains(refusal(c, R, a), "attn_res: updated must be"));
}

// Only the very same view is the in-place update; every other overlap with an input is refused as before.
TEST(AddendRejections, OnlyTheSameViewIsInPlace) {
  for (AttnResOp op : {R, A, P}) {
    const std::string name = attnres::op_name(op);
    Case c = make_case(3, 2, 64, -1, test_seed(static_cast<uint64_t>(op)), /*pad=*/8);
    const Call k{op, true, false, false, op == R, true};
    AttnResArgs a = host_args(c, k);
    EXPECT_EQ(error_of<attnres::ArgumentError>([&] { attnres::validate(op, a); }), "") << name;

    // Same pointer, other strides (the padded rows read densely).
    AttnResArgs b = a;
    b.updated.strides[0] = 64;
    EXPECT_EQ(refusal(c, op, b), name + ": updated overlaps layer_residual (outputs must not alias inputs)");
    // Shifted by one row, and by one element (same strides).
    b = a;
    b.updated.data = static_cast<char*>(a.layer_residual.data) + a.layer_residual.strides[0] * 2;
    EXPECT_EQ(refusal(c, op, b), name + ": updated overlaps layer_residual (outputs must not alias inputs)");
    b = a;
    b.updated.data = static_cast<char*>(a.layer_residual.data) + 16;
    EXPECT_EQ(refusal(c, op, b), name + ": updated overlaps layer_residual (outputs must not alias inputs)");
    // Same pointer, fewer tokens (a leading part of the prefix).
    b = a;
    b.updated.shape[0] = 2;
    EXPECT_TRUE(contains(refusal(c, op, b), name + ": updated must have shape [T, H]"));
    // Other outputs never alias the prefix, in place or not.
    b = a;
    b.output = a.layer_residual;
    EXPECT_EQ(refusal(c, op, b), name + ": output overlaps layer_residual (outputs must not alias inputs)");
    // updated may be the prefix only, not an addend.
    b = a;
    b.updated = a.layer_residual_add;
    EXPECT_EQ(refusal(c, op, b), name + ": updated overlaps layer_residual_add (outputs must not alias inputs)");
  }
  // The tap of attn_res_add_rmsnorm stays refused on the prefix while updated is in place.
  Case c = make_case(2, 2, 64, -1, test_seed(9));
  AttnResArgs a = host_args(c, {A, true, false, true, false, true});
  a.mixture = a.layer_residual;
  EXPECT_EQ(refusal(c, A, a), "attn_res_add_rmsnorm: mixture overlaps layer_residual (outputs must not alias inputs)");
}

#if ATTNRES_WITH_CUDA

// ---------------------------------------------------------------------------------------------------------
// CUDA kernels

// Device copies of every buffer of a Case, freed on scope exit (also when a call throws).
struct DeviceBuffers {
  std::vector<void*> ptrs;
  cudaStream_t stream = nullptr;
  ~DeviceBuffers() {
    for (void* p : ptrs) cudaFree(p);
    if (stream) cudaStreamDestroy(stream);
  }
};

// Runs one call on device copies of every buffer of `c` and returns what the device buffers hold afterwards.
Case run_gpu(const Case& c, const Call& k, const Options& o) {
  DeviceBuffers d;
  const auto all = c.buffers();
  for (const Buffer* b : all) {
    void* p = nullptr;
    cuda_ok(cudaMalloc(&p, b->nbytes() ? b->nbytes() : 16), "cudaMalloc");
    d.ptrs.push_back(p);
    if (b->nbytes()) cuda_ok(cudaMemcpy(p, b->host(), b->nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  cuda_ok(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const auto base = [&](const Buffer& b) -> void* {
    for (size_t i = 0; i < all.size(); ++i)
      if (all[i] == &b) return d.ptrs[i];
    throw std::logic_error("buffer of another case");
  };
  AttnResArgs a = call_args(c, k, base, kCuda0);
  a.stream = d.stream;
  attnres::run(k.op, a, o);
  cuda_ok(cudaStreamSynchronize(d.stream), "cudaStreamSynchronize");
  cuda_ok(cudaGetLastError(), "kernel");
  Case out = c;
  const auto dst = out.buffers();
  for (size_t i = 0; i < dst.size(); ++i)
    if (dst[i]->nbytes())
      cuda_ok(cudaMemcpy(dst[i]->host(), d.ptrs[i], dst[i]->nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  return out;
}

attnres::Plan plan_on_gpu(const Case& c, const Call& k, const Options& o) {
  return attnres::plan(attnres::plan_query(k.op, host_args(c, k)), attnres::query_device(kCuda0), o);
}

Options forced(KernelKind kernel) {
  Options o;
  o.kernel = kernel;
  return o;
}

struct GpuKernelCase {
  const char* name;
  Options options;
  int64_t T, H;
  std::vector<int64_t> candidates;  // the N the kernel is planned for
  bool streams;                     // single_cta: the plan streams
};

std::vector<GpuKernelCase> gpu_kernel_cases() {
  Options stream = forced(KernelKind::single_cta);
  stream.stream_min_tokens = 1;
  Options one_pass = forced(KernelKind::persistent);
  one_pass.persistent_passes = 1;
  return {
      {"single_cta", forced(KernelKind::single_cta), 3, 2048, {1, 2, 4}, false},
      {"single_cta_streaming", stream, 300, 7168, {1, 2, 4}, true},
      {"split_k", forced(KernelKind::split_k), 5, 7168, {1, 2, 5, 9, 16}, false},
      {"split_k_one_block", forced(KernelKind::split_k), 5, 1024, {1, 2, 5, 9, 16}, false},
      {"persistent_one_pass", one_pass, 40, 2048, {1, 2, 5, 9, 16}, false},
  };
}

class GpuAddend : public ::testing::TestWithParam<GpuKernelCase> {};

// In place vs out of place, bitwise, for every op that writes `updated`, with a snapshot write where the op takes it.
TEST_P(GpuAddend, InPlaceEqualsOutOfPlace) {
  REQUIRE_HOPPER();
  const GpuKernelCase& g = GetParam();
  const bool persistent = g.options.kernel == KernelKind::persistent;
  // The persistent kernel runs neither attn_res, add2, a tap nor a snapshot write, and the persistent op runs on
  // it alone.
  const std::vector<Call> calls =
      persistent ? std::vector<Call>{{A, true, false, false, false}, {P, true, false, false, false}}
                 : std::vector<Call>{{R, true, false, false, true}, {R, true, true, false, true},
                                     {R, true, true, false, false}, {A, true, false, true, false},
                                     {A, true, true, true, false}};
  for (int64_t N : g.candidates)
    for (size_t i = 0; i < calls.size(); ++i) {
      Call k = calls[i];
      const bool snapshot = k.op != P && !persistent;
      const Case c = make_case(g.T, N - 1, g.H, snapshot ? N : -1, test_seed(static_cast<uint64_t>(N * 16 + i)));
      SCOPED_TRACE(std::string(g.name) + " " + attnres::op_name(k.op) + (k.add2 ? " add2" : "") + " N = " +
                   std::to_string(N));
      const attnres::Plan plan = plan_on_gpu(c, k, g.options);
      ASSERT_TRUE(plan.accepted()) << plan.decline;
      ASSERT_EQ(plan.kernel, g.options.kernel);
      if (g.options.kernel == KernelKind::single_cta) { ASSERT_EQ(plan.smem_bytes > 0, g.streams); }
      if (persistent) { ASSERT_EQ(plan.passes, 1); }
      const Case out = run_gpu(c, k, g.options);
      k.in_place = true;
      const Case in = run_gpu(c, k, g.options);
      expect_in_place_equals_out_of_place(c, out, in, k);
      // And the CPU backend's prefix.
      EXPECT_TRUE(bits_equal(out.updated.bits(), run_cpu(c, calls[i]).updated.bits(), "updated vs cpu"));
    }
}

// attn_res with addends gives attn_res_add_rmsnorm's tap and updated bits on the same kernel.
TEST_P(GpuAddend, MixtureIsTheAddRmsnormTapBitwise) {
  REQUIRE_HOPPER();
  const GpuKernelCase& g = GetParam();
  if (g.options.kernel == KernelKind::persistent) return;  // the persistent kernel does not run attn_res
  for (int64_t N : g.candidates)
    for (bool add2 : {false, true}) {
      const Case c = make_case(g.T, N - 1, g.H, N, test_seed(static_cast<uint64_t>(N * 2 + add2)));
      SCOPED_TRACE(std::string(g.name) + (add2 ? " add2" : " add") + " N = " + std::to_string(N));
      const Case mixed = run_gpu(c, {R, true, add2, false, true, false}, g.options);
      const Case normed = run_gpu(c, {A, true, add2, true, false, false}, g.options);
      EXPECT_TRUE(bits_equal(mixed.output.bits(), normed.mixture.bits(), "attn_res output vs add_rmsnorm tap"));
      EXPECT_TRUE(bits_equal(mixed.updated.bits(), normed.updated.bits(), "updated"));
      EXPECT_TRUE(bits_equal(bank_row(mixed, N), normed.updated.bits(), "snapshot row"));
      // Within the contract's tolerance of the CPU backend (the diagnostics too).
      const Case cpu = run_cpu(c, {R, true, add2, false, true, false});
      EXPECT_TRUE(bits_equal(mixed.updated.bits(), cpu.updated.bits(), "updated vs cpu"));
      EXPECT_TRUE(bf16_close(mixed.output.values(), cpu.output.values(), "output vs cpu"));
      EXPECT_TRUE(diag_close(mixed.probs.values(), cpu.probs.values(), "probs vs cpu"));
      EXPECT_TRUE(diag_close(mixed.rsigma.values(), cpu.rsigma.values(), "rsigma vs cpu"));
      // Without diagnostics: the same output, the diagnostics' buffers untouched.
      const Case bare = run_gpu(c, {R, true, add2, false, false, false}, g.options);
      EXPECT_TRUE(bits_equal(bare.output.bits(), mixed.output.bits(), "output without diagnostics"));
      EXPECT_TRUE(same_storage(bare.probs, c.probs));
    }
}

INSTANTIATE_TEST_SUITE_P(Kernels, GpuAddend, ::testing::ValuesIn(gpu_kernel_cases()),
                         [](const ::testing::TestParamInfo<GpuKernelCase>& info) { return info.param.name; });

// The persistent kernel's two-pass mode mixes from `updated` (streamed back after step 1 stored it), never from
// the prefix after it was written: in place it gives the out-of-place bits, one addend and two.
TEST(GpuAddendPersistent, TwoPassRunsInPlace) {
  REQUIRE_HOPPER();
  const Case c = make_case(40, 4, 2048, -1, test_seed());
  Options two_pass = forced(KernelKind::persistent);
  two_pass.persistent_passes = 2;
  for (const bool add2 : {false, true}) {
    SCOPED_TRACE(add2 ? "two addends" : "one addend");
    const Call out_of_place{A, true, add2, false, false, false}, in_place{A, true, add2, false, false, true};
    const attnres::Plan p = plan_on_gpu(c, in_place, two_pass);
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.passes, 2);
    const Case out = run_gpu(c, out_of_place, two_pass);
    const Case in = run_gpu(c, in_place, two_pass);
    expect_in_place_equals_out_of_place(c, out, in, in_place);
  }
}

#endif  // ATTNRES_WITH_CUDA

}  // namespace
}  // namespace attnres_test
