// Downstream use of attnres through its public C++ API only: one fused decode epilogue on the CPU backend.
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

  for (int64_t i = 0; i < T * H; ++i) {
    const uint16_t want = to_bf16(to_f32(prefix[i]) + to_f32(add[i]));
    if (updated[i] != want) {
      std::fprintf(stderr, "updated[%lld] = 0x%04x, expected 0x%04x\n", static_cast<long long>(i), updated[i], want);
      return 1;
    }
    if (!std::isfinite(to_f32(output[i]))) {
      std::fprintf(stderr, "output[%lld] is not finite\n", static_cast<long long>(i));
      return 1;
    }
  }
  std::printf("ok: updated == layer_residual + layer_residual_add for %lld elements\n", static_cast<long long>(T * H));
  return 0;
}
