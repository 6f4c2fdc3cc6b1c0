// The CPU backend of moe_finalize. The combine is a product then a sum per route, in j order, each rounded
// to fp32 (ISO C++ build: no FMA contraction), which is exactly what the CUDA kernel computes with its
// explicit mul.rn/add.rn, so `routed` (and `x` with the shared add) agree bit for bit across backends.
// The norm's sum of squares runs in 8 fixed lanes joined by a fixed tree (deterministic, T-independent).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attnres/moe_finalize.hpp"
#include "cpu/bf16.hpp"

namespace attnres::detail {

namespace {

using bf16 = uint16_t;

float weight_at(const TensorRef& w, int64_t i) {
  if (w.dtype == DType::f32) return static_cast<const float*>(w.data)[i];
  return bf16_to_f32(static_cast<const bf16*>(w.data)[i]);
}

const bf16* row_at(const TensorRef& t, int64_t i) {
  return reinterpret_cast<const bf16*>(static_cast<const char*>(t.data) + i * t.strides[0] * 2);
}

float sum_squares(const bf16* x, int64_t D) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < D; d += 8)
    for (int l = 0; l < 8; ++l) {
      const float v = bf16_to_f32(x[d + l]);
      lane[l] += v * v;
    }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace

void cpu_moe_finalize(const MoeFinalizeArgs& a) {
  KeepSubnormals keep_subnormals;  // the combine and the shared add must not flush

  const int64_t T = a.index.shape[0], k = a.index.shape[1], D = a.rows.shape[1];
  const int32_t* index = static_cast<const int32_t*>(a.index.data);
  const float scale = static_cast<float>(a.scale);
  const float eps = static_cast<float>(a.eps);
  const bool has_shared = a.shared.present(), has_norm = a.norm_weight.present();

  std::vector<float> norm_w(has_norm ? D : 0);
  for (int64_t d = 0; d < static_cast<int64_t>(norm_w.size()); ++d)
    norm_w[d] = bf16_to_f32(static_cast<const bf16*>(a.norm_weight.data)[d]);

  std::vector<float> acc(D);
  std::vector<bf16> x(D);
  for (int64_t t = 0; t < T; ++t) {
    // The validated index map holds only -1 (remote expert) or rows in [0, R).
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = index[t * k + j];
      if (r < 0) continue;
      const float w = weight_at(a.weights, t * k + j);
      const bf16* row = row_at(a.rows, r);
      for (int64_t d = 0; d < D; ++d) {
        const float product = w * bf16_to_f32(row[d]);
        acc[d] = acc[d] + product;
      }
    }
    // One rounding of the combine; then the shared add through one fp32 add and one rounding.
    for (int64_t d = 0; d < D; ++d) x[d] = f32_to_bf16(acc[d] * scale);
    if (has_shared) {
      const bf16* s = row_at(a.shared, t);
      for (int64_t d = 0; d < D; ++d) x[d] = f32_to_bf16(bf16_to_f32(x[d]) + bf16_to_f32(s[d]));
    }

    bf16* out = const_cast<bf16*>(row_at(a.output, t));
    if (has_norm) {
      // ops.md step 7: normed = bf16(x * r), output = bf16(normed * w).
      const float r = 1.0f / std::sqrt(sum_squares(x.data(), D) / static_cast<float>(D) + eps);
      for (int64_t d = 0; d < D; ++d) {
        const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[d]) * r));
        out[d] = f32_to_bf16(normed * norm_w[d]);
      }
    } else {
      for (int64_t d = 0; d < D; ++d) out[d] = x[d];
    }
  }
}

}  // namespace attnres::detail
