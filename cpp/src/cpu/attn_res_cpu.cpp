// The CPU reference backend: the whole contract of ops.md in fp32 with its rounding boundaries
// (1: the prefix update, 6: the mixture, 7: the two-rounding norm). Sums over H run in 8 fixed lanes joined
// by a fixed tree, so results are deterministic and independent of T and of the token's position.
#include <cmath>
#include <cstdint>
#include <vector>

#include "attnres/attn_res.hpp"
#include "backend.hpp"
#include "cpu/bf16.hpp"
#include "cpu/fp8.hpp"
#include "layout.hpp"

namespace attnres::detail {

namespace {

using bf16 = uint16_t;

// A [rows, H] view with a contiguous last dimension (validated).
struct Rows {
  const char* base = nullptr;
  int64_t stride_bytes = 0;
  const bf16* at(int64_t i) const { return reinterpret_cast<const bf16*>(base + i * stride_bytes); }
  bf16* mut(int64_t i) const { return const_cast<bf16*>(at(i)); }
};

Rows rows_of(const TensorRef& t) {
  if (!t.present()) return {};
  return {static_cast<const char*>(t.data), t.strides[0] * dtype_size(t.dtype)};
}

const bf16* vector_of(const TensorRef& t) { return static_cast<const bf16*>(t.data); }

struct Lanes {
  float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float total() const { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
};

// sum_h x^2 and sum_h x * q over one row.
void score_row(const bf16* x, const float* q, int64_t H, float& sumsq, float& dot) {
  Lanes ss, dt;
  for (int64_t h = 0; h < H; h += 8)
    for (int l = 0; l < 8; ++l) {
      const float v = bf16_to_f32(x[h + l]);
      ss.v[l] += v * v;
      dt.v[l] += v * q[h + l];
    }
  sumsq = ss.total();
  dot = dt.total();
}

float sum_squares(const bf16* x, int64_t H) {
  Lanes ss;
  for (int64_t h = 0; h < H; h += 8)
    for (int l = 0; l < 8; ++l) {
      const float v = bf16_to_f32(x[h + l]);
      ss.v[l] += v * v;
    }
  return ss.total();
}

void store_f32(const TensorRef& t, int64_t n, int64_t tok, float v) {
  if (!t.present()) return;
  static_cast<float*>(t.data)[n * t.strides[0] + tok * t.strides[1]] = v;
}

// The FP8 epilogue of one token from its bf16 output row (cpu/fp8.hpp has the formulas).
void quantize_row(const AttnResArgs& a, int64_t t, const bf16* out, int64_t H) {
  const int64_t group = a.fp8 == Fp8Scales::per_token ? H : kFp8GroupSize;
  uint8_t* codes = static_cast<uint8_t*>(a.output_fp8.data) + t * a.output_fp8.strides[0];
  float* scales = static_cast<float*>(a.fp8_scales.data);
  for (int64_t g = 0; g * group < H; ++g) {
    uint32_t amax = 0;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const uint32_t b = abs_bits(bf16_to_f32(out[h]));
      amax = b > amax ? b : amax;
    }
    const float s = fp8_scale(amax, a.fp8_pow2_scales);
    for (int64_t h = g * group; h < (g + 1) * group; ++h) codes[h] = fp8_code(bf16_to_f32(out[h]), s);
    scales[t * a.fp8_scales.strides[0] + g * a.fp8_scales.strides[1]] = s;
  }
}

}  // namespace

void cpu_attn_res(AttnResOp op, const AttnResArgs& a) {
  KeepSubnormals keep_subnormals;  // the add path must not flush (contract step 1)

  const int64_t T = a.layer_residual.shape[0];
  const int64_t H = a.layer_residual.shape[1];
  const int64_t K = a.block_residual.shape[0];
  const int64_t N = K + 1;
  const bool has_add = a.layer_residual_add.present();
  const bool has_add2 = a.layer_residual_add2.present();
  const bool has_norm = a.norm_weight.present();
  (void)op;

  const Rows lr = rows_of(a.layer_residual), add = rows_of(a.layer_residual_add),
             add2 = rows_of(a.layer_residual_add2), out = rows_of(a.output), upd = rows_of(a.updated),
             tap = rows_of(a.mixture);
  const char* bank = static_cast<const char*>(a.block_residual.data);
  const int64_t bank_k = a.block_residual.strides[0] * 2, bank_t = a.block_residual.strides[1] * 2;
  const Rows snap = a.snapshot_slot >= 0 ? rows_of(snapshot_rows(a.block_residual, a.snapshot_slot)) : Rows{};

  // Step 3: q = rms_weight * res_weight in fp32, never rounded to bf16.
  std::vector<float> q(H), norm_w(has_norm ? H : 0);
  for (int64_t h = 0; h < H; ++h)
    q[h] = bf16_to_f32(vector_of(a.rms_weight)[h]) * bf16_to_f32(vector_of(a.res_weight)[h]);
  for (int64_t h = 0; h < static_cast<int64_t>(norm_w.size()); ++h) norm_w[h] = bf16_to_f32(vector_of(a.norm_weight)[h]);

  const float rms_eps = static_cast<float>(a.rms_eps), norm_eps = static_cast<float>(a.norm_eps);
  const float h_count = static_cast<float>(H);
  // The FP8-only call has no output tensor: the bf16 output row the codes are taken from is kept here.
  std::vector<bf16> prefix(H), mixed(H), output_row(out.base ? 0 : H);
  std::vector<const bf16*> cand(N);
  std::vector<float> logit(N), rsigma(N), prob(N);

  for (int64_t t = 0; t < T; ++t) {
    // Step 1: the prefix update, two bf16 roundings with two addends (PyTorch's prefix + (add + add2)).
    const bf16* p_in = lr.at(t);
    if (has_add) {
      const bf16* x = add.at(t);
      const bf16* y = has_add2 ? add2.at(t) : nullptr;
      for (int64_t h = 0; h < H; ++h) {
        const bf16 s = y ? f32_to_bf16(bf16_to_f32(x[h]) + bf16_to_f32(y[h])) : x[h];
        prefix[h] = f32_to_bf16(bf16_to_f32(p_in[h]) + bf16_to_f32(s));
      }
    } else {
      for (int64_t h = 0; h < H; ++h) prefix[h] = p_in[h];
    }
    if (upd.base)
      for (int64_t h = 0; h < H; ++h) upd.mut(t)[h] = prefix[h];
    if (snap.base)
      for (int64_t h = 0; h < H; ++h) snap.mut(t)[h] = prefix[h];

    // Step 2: candidates, bank rows then the prefix.
    for (int64_t k = 0; k < K; ++k) cand[k] = reinterpret_cast<const bf16*>(bank + k * bank_k + t * bank_t);
    cand[K] = prefix.data();

    // Steps 4-5: scores and softmax.
    float max_logit = -INFINITY;
    for (int64_t n = 0; n < N; ++n) {
      float ss, dot;
      score_row(cand[n], q.data(), H, ss, dot);
      rsigma[n] = 1.0f / std::sqrt(ss / h_count + rms_eps);
      logit[n] = rsigma[n] * dot;
      max_logit = std::fmax(max_logit, logit[n]);
    }
    float denom = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      prob[n] = std::exp(logit[n] - max_logit);
      denom += prob[n];
    }
    for (int64_t n = 0; n < N; ++n) prob[n] /= denom;
    // ops.md step 6: with N = 1 the mixture is P itself, also when its logit is not finite (rms_eps = 0 and a
    // zero or subnormal-squares row give rsigma = inf, logit = inf * 0 = NaN, and softmax would be NaN).
    if (N == 1) prob[0] = 1.0f;

    // Step 6: the mixture, rounded to bf16 once.
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.0f;
      for (int64_t n = 0; n < N; ++n) acc += prob[n] * bf16_to_f32(cand[n][h]);
      mixed[h] = f32_to_bf16(acc);
    }
    for (int64_t n = 0; n < N; ++n) {
      store_f32(a.rsigma, n, t, rsigma[n]);
      store_f32(a.probs, n, t, prob[n]);
      store_f32(a.logits, n, t, logit[n]);
    }
    if (tap.base)
      for (int64_t h = 0; h < H; ++h) tap.mut(t)[h] = mixed[h];

    // Step 7: the trailing norm in Kimi's two-rounding order.
    bf16* o = out.base ? out.mut(t) : output_row.data();
    if (has_norm) {
      const float r = 1.0f / std::sqrt(sum_squares(mixed.data(), H) / h_count + norm_eps);
      for (int64_t h = 0; h < H; ++h) {
        const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(mixed[h]) * r));
        o[h] = f32_to_bf16(normed * norm_w[h]);
      }
    } else {
      for (int64_t h = 0; h < H; ++h) o[h] = mixed[h];
    }
    if (a.fp8 != Fp8Scales::none) quantize_row(a, t, o, H);
  }
}

}  // namespace attnres::detail
