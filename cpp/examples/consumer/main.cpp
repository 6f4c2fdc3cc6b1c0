// Downstream use of attnres through its public C++ API only: one fused decode epilogue on the CPU backend and,
// when attnres was built with its CUDA backend, the same call on device pointers and a cudaStream_t
// (cuda_call.cpp; skipped with a message on a machine without a compute capability >= 9.0 GPU).
// Checks `updated` == layer_residual + layer_residual_add element by element (bf16 round to nearest even)
// and that `output` is finite; exits 0 on success.
#include <attnres/attnres.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

// bf16 is the upper half of an fp32; round to nearest even when narrowing (NaN is not produced here).
float to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

#ifdef ATTNRES_CONSUMER_CUDA
// cuda_call.cpp: copies the inputs to the GPU, runs the op on a stream, copies `updated` and `output` back.
// Returns 0 on success (or when no suitable GPU is present: it says so), 1 on a CUDA or attnres error.
int run_on_cuda(int64_t T, int64_t K, int64_t H, const std::vector<const std::vector<uint16_t>*>& inputs,
                std::vector<uint16_t>& updated, std::vector<uint16_t>& output, bool& ran);
#endif

namespace {

int check(const char* where, int64_t n, const std::vector<uint16_t>& prefix, const std::vector<uint16_t>& add,
          const std::vector<uint16_t>& updated, const std::vector<uint16_t>& output) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t want = to_bf16(to_f32(prefix[i]) + to_f32(add[i]));
    if (updated[i] != want) {
      std::fprintf(stderr, "%s: updated[%lld] = 0x%04x, expected 0x%04x\n", where, static_cast<long long>(i),
                   updated[i], want);
      return 1;
    }
    if (!std::isfinite(to_f32(output[i]))) {
      std::fprintf(stderr, "%s: output[%lld] is not finite\n", where, static_cast<long long>(i));
      return 1;
    }
  }
  std::printf("ok (%s): updated == layer_residual + layer_residual_add for %lld elements\n", where,
              static_cast<long long>(n));
  return 0;
}

}  // namespace

int main() {
  using namespace attnres;
  const int64_t T = 3, K = 2, H = 256;  // 3 tokens, 2 snapshots in the bank (N = 3 candidates)

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random_rows = [&](size_t n, float scale) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = to_bf16(scale * normal(rng));
    return v;
  };
  std::vector<uint16_t> prefix = random_rows(T * H, 1.0f), add = random_rows(T * H, 0.5f),
                        bank = random_rows(K * T * H, 1.0f), res_weight = random_rows(H, 0.02f),
                        rms_weight = random_rows(H, 0.1f), norm_weight = random_rows(H, 0.1f);
  for (auto* w : {&rms_weight, &norm_weight})
    for (auto& x : *w) x = to_bf16(1.0f + to_f32(x));
  std::vector<uint16_t> updated(T * H), output(T * H);

  const Device cpu{DeviceType::cpu, 0};
  AttnResArgs args;
  args.layer_residual = make_ref(prefix.data(), DType::bf16, cpu, {T, H});
  args.layer_residual_add = make_ref(add.data(), DType::bf16, cpu, {T, H});
  args.block_residual = make_ref(bank.data(), DType::bf16, cpu, {K, T, H});
  args.res_weight = make_ref(res_weight.data(), DType::bf16, cpu, {H});
  args.rms_weight = make_ref(rms_weight.data(), DType::bf16, cpu, {H});
  args.norm_weight = make_ref(norm_weight.data(), DType::bf16, cpu, {H});
  args.updated = make_ref(updated.data(), DType::bf16, cpu, {T, H});
  args.output = make_ref(output.data(), DType::bf16, cpu, {T, H});

  try {
    const Plan plan = attnres::plan(AttnResOp::attn_res_add_rmsnorm, args);
    std::printf("attnres %s: kernel %s\n", ATTNRES_VERSION, kernel_name(plan.kernel));
    attn_res_add_rmsnorm(args);
  } catch (const Error& e) {
    std::fprintf(stderr, "attnres error: %s\n", e.what());
    return 1;
  }

  if (check("cpu", T * H, prefix, add, updated, output) != 0) return 1;

#ifdef ATTNRES_CONSUMER_CUDA
  std::vector<uint16_t> updated_gpu(T * H), output_gpu(T * H);
  bool ran = false;
  if (run_on_cuda(T, K, H, {&prefix, &add, &bank, &res_weight, &rms_weight, &norm_weight}, updated_gpu, output_gpu,
                  ran) != 0)
    return 1;
  if (ran && check("cuda", T * H, prefix, add, updated_gpu, output_gpu) != 0) return 1;
#else
  std::printf("attnres built without its CUDA backend: CPU call only\n");
#endif
  return 0;
}
