// The CPU backend of all_reduce and moe_finalize_all_reduce: the contract computed from every rank's partial
// (gathered by the caller): per element the fp32 sum of the W bf16 values in rank order 0..W-1, each -0.0
// read as +0.0, rounded once to bf16. The latent norm reuses moe_finalize's CPU norm (an identity routing:
// one route of weight 1 per token, scale 1, reproduces x exactly before the norm).
#include <cstdint>
#include <vector>

#include "attnres/all_reduce.hpp"
#include "backend.hpp"
#include "cpu/bf16.hpp"

namespace attnres::detail {

namespace {

using bf16 = uint16_t;

const bf16* element(const TensorRef& t, int64_t w, int64_t i, int64_t d) {
  return reinterpret_cast<const bf16*>(t.data) + w * t.strides[0] + i * t.strides[1] + d * t.strides[2];
}

// Reduces gathered [W, T, D] into `out` ([T, D] with row stride out_stride elements).
void reduce(const TensorRef& g, bf16* out, int64_t out_stride) {
  KeepSubnormals keep_subnormals;
  const int64_t W = g.shape[0], T = g.shape[1], D = g.shape[2];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t w = 0; w < W; ++w) {
        const bf16 v = *element(g, w, t, d);
        acc += bf16_to_f32(v == 0x8000u ? bf16{0} : v);
      }
      out[t * out_stride + d] = f32_to_bf16(acc);
    }
}

}  // namespace

void cpu_all_reduce(const AllReduceArgs& a) {
  reduce(a.gathered, static_cast<bf16*>(a.output.data), a.output.strides[0]);
}

void cpu_moe_finalize_all_reduce(const MoeFinalizeAllReduceArgs& a) {
  const int64_t T = a.gathered.shape[1], D = a.gathered.shape[2];
  std::vector<bf16> latent(static_cast<size_t>(T * D));
  reduce(a.gathered, latent.data(), D);
  if (a.reduced.present())
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d)
        static_cast<bf16*>(a.reduced.data)[t * a.reduced.strides[0] + d] = latent[t * D + d];
  std::vector<int32_t> index(static_cast<size_t>(T));
  std::vector<float> ones(static_cast<size_t>(T), 1.0f);
  for (int64_t t = 0; t < T; ++t) index[t] = static_cast<int32_t>(t);
  MoeFinalizeArgs norm;
  norm.rows = make_ref(latent.data(), DType::bf16, Device{}, {T, D});
  norm.weights = make_ref(ones.data(), DType::f32, Device{}, {T, 1});
  norm.index = make_ref(index.data(), DType::i32, Device{}, {T, 1});
  norm.norm_weight = a.finalize.norm_weight;
  norm.eps = a.finalize.eps;
  norm.scale = 1.0;
  norm.output = a.finalize.output;
  cpu_moe_finalize(norm);
}

}  // namespace attnres::detail
