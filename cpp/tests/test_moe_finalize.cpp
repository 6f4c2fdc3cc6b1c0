// moe_finalize through the C++ API: the CPU backend against a float64 oracle and a bit-exact fp32
// emulation, every precondition (exact message, nothing written), the plan, and a GPU case that compares the
// CUDA kernel with the CPU backend (skipped without a device).
//
// Self-contained (gtest + the public attnres headers): its own bf16 helpers and oracle, so the library's
// internals are what is under test.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnres/attnres.hpp"

#if ATTNRES_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using attnres::ArgumentError;
using attnres::Device;
using attnres::DeviceInfo;
using attnres::DeviceType;
using attnres::DType;
using attnres::KernelKind;
using attnres::MoeFinalizeArgs;
using attnres::MoeFinalizeOptions;
using attnres::MoeFinalizePlan;
using attnres::MoeFinalizeQuery;
using attnres::TensorRef;
using attnres::UnsupportedError;

float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// float64 -> bf16 with one rounding (a tie created by the float step is broken by the side x lies on).
uint16_t f64_to_bf16(double x) {
  const float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) <= 0x7f800000u && (u & 0xffffu) == 0x8000u && static_cast<double>(f) != x)
    return static_cast<uint16_t>((u >> 16) + (std::fabs(x) > std::fabs(static_cast<double>(f)) ? 1u : 0u));
  return f32_to_bf16(f);
}

constexpr uint16_t kPoison = 0x7fa5;  // a NaN no op produces: unwritten elements fail every comparison

bool contains(const std::string& text, const std::string& fragment) { return text.find(fragment) != std::string::npos; }

// One call's storage: rows [R, D] (row stride D + pad; NaN wherever no route points), weights, index,
// shared, norm_weight, and a poisoned output (row stride D + pad).
struct Problem {
  int64_t T, k, D, R, pad;
  bool bf16_weights, has_shared, has_norm;
  double eps, scale;
  std::vector<uint16_t> rows, shared, norm_weight, output, weights_bf16;
  std::vector<float> weights_f32;
  std::vector<int32_t> index;

  Problem(int64_t T_, int64_t k_, int64_t D_, uint64_t seed, bool bf16_w = false, bool shared_ = false,
          bool norm = false, double scale_ = 1.0, double remote = 0.2, int64_t pad_ = 0, double eps_ = 1e-5)
      : T(T_), k(k_), D(D_), R(T_ * k_ + 8), pad(pad_), bf16_weights(bf16_w), has_shared(shared_),
        has_norm(norm), eps(eps_), scale(scale_) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    auto nonzero = [&](double s) {
      uint16_t b = 0;
      while ((b & 0x7fffu) == 0) b = f64_to_bf16(s * normal(rng));
      return b;
    };
    rows.assign(size_t(R * (D + pad)), 0x7fc0);  // NaN: padding rows and columns must never be read
    std::vector<int32_t> perm(static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) perm[size_t(i)] = int32_t(i);
    std::shuffle(perm.begin(), perm.end(), rng);
    index.resize(size_t(T * k));
    for (int64_t i = 0; i < T * k; ++i) {
      index[size_t(i)] = uniform(rng) < remote ? -1 : perm[size_t(i)];
      if (index[size_t(i)] < 0) continue;
      const double mag = std::exp(std::log(0.05) + uniform(rng) * std::log(400.0));
      for (int64_t d = 0; d < D; ++d) rows[size_t(index[size_t(i)] * (D + pad) + d)] = nonzero(mag);
    }
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0;
      std::vector<double> e(static_cast<size_t>(k));
      for (auto& v : e) sum += (v = std::exp(normal(rng)));
      for (int64_t j = 0; j < k; ++j) {
        const float w = static_cast<float>(e[size_t(j)] / sum);
        weights_f32.push_back(w);
        weights_bf16.push_back(f32_to_bf16(w));
      }
    }
    if (has_shared)
      for (int64_t i = 0; i < T * D; ++i) shared.push_back(nonzero(0.5));
    if (has_norm)
      for (int64_t d = 0; d < D; ++d) norm_weight.push_back(f64_to_bf16(1.0 + 0.1 * normal(rng)));
    output.assign(size_t(T * (D + pad)), kPoison);
  }

  float weight(int64_t t, int64_t j) const {
    return bf16_weights ? bf16_to_f32(weights_bf16[size_t(t * k + j)]) : weights_f32[size_t(t * k + j)];
  }
  uint16_t row(int64_t r, int64_t d) const { return rows[size_t(r * (D + pad) + d)]; }
  uint16_t out(int64_t t, int64_t d) const { return output[size_t(t * (D + pad) + d)]; }

  MoeFinalizeArgs args() {
    MoeFinalizeArgs a;
    const Device cpu{};
    a.rows = attnres::make_ref(rows.data(), DType::bf16, cpu, {R, D}, {D + pad, 1});
    if (bf16_weights)
      a.weights = attnres::make_ref(weights_bf16.data(), DType::bf16, cpu, {T, k});
    else
      a.weights = attnres::make_ref(weights_f32.data(), DType::f32, cpu, {T, k});
    a.index = attnres::make_ref(index.data(), DType::i32, cpu, {T, k});
    if (has_shared) a.shared = attnres::make_ref(shared.data(), DType::bf16, cpu, {T, D});
    if (has_norm) a.norm_weight = attnres::make_ref(norm_weight.data(), DType::bf16, cpu, {D});
    a.eps = eps;
    a.scale = scale;
    a.output = attnres::make_ref(output.data(), DType::bf16, cpu, {T, D}, {D + pad, 1});
    return a;
  }

  // Byte images of every buffer, for "nothing was written".
  std::vector<std::vector<char>> image() const {
    auto bytes = [](const auto& v) {
      const char* p = reinterpret_cast<const char*>(v.data());
      return std::vector<char>(p, p + v.size() * sizeof(v[0]));
    };
    return {bytes(rows), bytes(shared), bytes(norm_weight), bytes(output), bytes(weights_bf16), bytes(weights_f32),
            bytes(index)};
  }

  // The contract in float64: one rounding of the combine, one of the shared add, the norm's two.
  std::vector<double> oracle() const {
    std::vector<double> out;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<uint16_t> x(static_cast<size_t>(D));
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < k; ++j)
          if (index[size_t(t * k + j)] >= 0) acc += double(weight(t, j)) * double(bf16_to_f32(row(index[size_t(t * k + j)], d)));
        x[size_t(d)] = f64_to_bf16(acc * scale);
        if (has_shared) x[size_t(d)] = f64_to_bf16(double(bf16_to_f32(x[size_t(d)])) + double(bf16_to_f32(shared[size_t(t * D + d)])));
      }
      double ms = 0;
      for (uint16_t v : x) ms += double(bf16_to_f32(v)) * double(bf16_to_f32(v));
      const double r = 1.0 / std::sqrt(ms / double(D) + eps);
      for (int64_t d = 0; d < D; ++d) {
        if (!has_norm) {
          out.push_back(bf16_to_f32(x[size_t(d)]));
          continue;
        }
        const uint16_t normed = f64_to_bf16(double(bf16_to_f32(x[size_t(d)])) * r);
        out.push_back(bf16_to_f32(f64_to_bf16(double(bf16_to_f32(normed)) * double(bf16_to_f32(norm_weight[size_t(d)])))));
      }
    }
    return out;
  }

  // The pre-norm value bit for bit: fp32 product then sum per route, j ascending, one rounding, shared add.
  std::vector<uint16_t> emulate_pre_norm() const {
    std::vector<uint16_t> out;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          const int32_t r = index[size_t(t * k + j)];
          if (r < 0) continue;
          const float product = weight(t, j) * bf16_to_f32(row(r, d));
          acc = acc + product;
        }
        uint16_t x = f32_to_bf16(acc * static_cast<float>(scale));
        if (has_shared) x = f32_to_bf16(bf16_to_f32(x) + bf16_to_f32(shared[size_t(t * D + d)]));
        out.push_back(x);
      }
    return out;
  }

  std::vector<double> result() const {
    std::vector<double> v;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) v.push_back(bf16_to_f32(out(t, d)));
    return v;
  }
  std::vector<uint16_t> result_bits() const {
    std::vector<uint16_t> v;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) v.push_back(out(t, d));
    return v;
  }
};

::testing::AssertionResult close(const std::vector<double>& a, const std::vector<double>& e) {
  double dot = 0, na = 0, ne = 0, diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return ::testing::AssertionFailure() << "non-finite value at " << i;
    dot += a[i] * e[i];
    na += a[i] * a[i];
    ne += e[i] * e[i];
    diff += (a[i] - e[i]) * (a[i] - e[i]);
  }
  const double cosine = dot / std::sqrt(na * ne), rel = std::sqrt(diff / ne);
  if (cosine > 0.9999 && rel < 5e-3) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "cosine " << cosine << ", rel L2 " << rel;
}

// ------------------------------------------------------------------------------------------- the CPU backend
struct Shape {
  int64_t T, k, D;
  bool bf16_weights, shared, norm;
  double scale, remote;
  int64_t pad;
};

// Readable test names and ctest labels (gtest prints a struct without PrintTo as raw bytes).
std::string shape_name(const Shape& s) {
  return "T" + std::to_string(s.T) + "_k" + std::to_string(s.k) + "_D" + std::to_string(s.D) +
         (s.bf16_weights ? "_wbf16" : "_wf32") + (s.shared ? "_shared" : "") + (s.norm ? "_norm" : "");
}
void PrintTo(const Shape& s, std::ostream* os) { *os << shape_name(s); }

class CpuBackend : public ::testing::TestWithParam<Shape> {};

TEST_P(CpuBackend, MatchesOracleAndEmulation) {
  const Shape s = GetParam();
  Problem p(s.T, s.k, s.D, 1000 + s.T * 7 + s.k * 13 + s.D, s.bf16_weights, s.shared, s.norm, s.scale, s.remote, s.pad);
  const auto before = p.image();
  attnres::moe_finalize(p.args());
  EXPECT_TRUE(close(p.result(), p.oracle()));
  if (!s.norm) {
    EXPECT_EQ(p.result_bits(), p.emulate_pre_norm());
  }
  // Inputs and the output's padding are untouched.
  const auto after = p.image();
  for (size_t i = 0; i < before.size(); ++i)
    if (i != 3) {
      EXPECT_EQ(before[i], after[i]) << "input buffer " << i << " was modified";
    }
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t d = s.D; d < s.D + s.pad; ++d) EXPECT_EQ(p.output[size_t(t * (s.D + s.pad) + d)], kPoison);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuBackend,
    ::testing::Values(Shape{1, 1, 8, false, false, false, 1.0, 0.0, 0}, Shape{1, 16, 3584, true, true, true, 2.827, 0.25, 0},
                      Shape{2, 8, 200, false, true, false, 0.5, 0.3, 8}, Shape{4, 32, 64, true, false, true, -1.5, 0.5, 0},
                      Shape{8, 16, 7168, false, true, true, 1.0, 0.1, 16}, Shape{33, 8, 200, true, true, false, 3.0, 0.2, 0},
                      Shape{3, 4, 16384, false, false, true, 1.0, 0.1, 0}),
    [](const ::testing::TestParamInfo<Shape>& info) { return shape_name(info.param); });

TEST(MoeFinalizeCpu, DeterministicAndIndependentOfTheBatch) {
  Problem p(6, 16, 512, 77, false, true, true, 1.25);
  attnres::moe_finalize(p.args());
  const auto first = p.result_bits();
  std::fill(p.output.begin(), p.output.end(), kPoison);
  attnres::moe_finalize(p.args());
  EXPECT_EQ(p.result_bits(), first);
  // Token 4 alone: its views start at row 4 of weights, index, shared and the output.
  MoeFinalizeArgs a = p.args();
  std::vector<uint16_t> alone(512, kPoison);
  a.weights = attnres::make_ref(p.weights_f32.data() + 4 * 16, DType::f32, Device{}, {1, 16});
  a.index = attnres::make_ref(p.index.data() + 4 * 16, DType::i32, Device{}, {1, 16});
  a.shared = attnres::make_ref(p.shared.data() + 4 * 512, DType::bf16, Device{}, {1, 512});
  a.output = attnres::make_ref(alone.data(), DType::bf16, Device{}, {1, 512});
  attnres::moe_finalize(a);
  EXPECT_EQ(alone, std::vector<uint16_t>(first.begin() + 4 * 512, first.begin() + 5 * 512));
}

TEST(MoeFinalizeCpu, AllRemoteTokenIsTheSharedRow) {
  Problem p(2, 4, 64, 5, false, true, false, 1.0, 0.0);
  for (int j = 0; j < 4; ++j) p.index[size_t(4 + j)] = -1;
  attnres::moe_finalize(p.args());
  for (int64_t d = 0; d < 64; ++d) EXPECT_EQ(p.out(1, d), p.shared[size_t(64 + d)]);
}

// --------------------------------------------------------------------------------------------- rejections
struct Rejection {
  const char* name;
  std::function<void(MoeFinalizeArgs&, Problem&)> mutate;
  std::string message;  // the message starts with this
};

void PrintTo(const Rejection& r, std::ostream* os) { *os << r.name; }

class Rejections : public ::testing::TestWithParam<Rejection> {};

TEST_P(Rejections, NamedMessageAndNothingWritten) {
  Problem p(3, 4, 64, 9, false, true, true, 1.0, 0.2, 0);
  p.index[5] = 2;  // at least one local route in token 1 (the out-of-range rules overwrite [1, 2])
  MoeFinalizeArgs a = p.args();
  GetParam().mutate(a, p);
  const auto before = p.image();
  std::string message;
  try {
    attnres::moe_finalize(a);
  } catch (const ArgumentError& e) {
    message = e.what();
  }
  EXPECT_EQ(message.rfind(GetParam().message, 0), 0u) << "got: \"" << message << "\"";
  EXPECT_EQ(p.image(), before) << "a rejected call wrote something";
}

TensorRef on_cuda(TensorRef t) {
  t.device = Device{DeviceType::cuda, 0};
  return t;
}

std::vector<Rejection> rejections() {
  using A = MoeFinalizeArgs;
  using P = Problem;
  const std::string op = "moe_finalize: ";
  return {
      {"rows_missing", [](A& a, P&) { a.rows = TensorRef{}; }, op + "rows is required"},
      {"weights_missing", [](A& a, P&) { a.weights = TensorRef{}; }, op + "weights is required"},
      {"index_missing", [](A& a, P&) { a.index = TensorRef{}; }, op + "index is required"},
      {"output_missing", [](A& a, P&) { a.output = TensorRef{}; }, op + "output is required"},
      {"flat_index", [](A& a, P& p) { a.index = attnres::make_ref(p.index.data(), DType::i32, Device{}, {12}); },
       op + "index must be a 2-D [T, k] tensor, got a flat map of shape [12] (reshape it to [T, k])"},
      {"index_rank3", [](A& a, P& p) { a.index = attnres::make_ref(p.index.data(), DType::i32, Device{}, {3, 2, 2}); },
       op + "index must be a 2-D [T, k] tensor, got 3 dimensions [3, 2, 2]"},
      {"index_no_tokens", [](A& a, P&) { a.index.shape[0] = 0; }, op + "index holds T = 0 tokens: T must be in [1, 16384]"},
      {"index_k_33", [](A& a, P&) { a.index.shape[1] = 33; a.index.strides[0] = 33; },
       op + "index holds k = 33 routes per token: k must be in [1, 32]"},
      {"index_i64", [](A& a, P&) { a.index.dtype = DType::i64; }, op + "index must be int32, got int64"},
      {"weights_shape", [](A& a, P&) { a.weights.shape[1] = 3; }, op + "weights must have the shape of index [T, k] = [3, 4], got [3, 3]"},
      {"weights_flat", [](A& a, P& p) { a.weights = attnres::make_ref(p.weights_f32.data(), DType::f32, Device{}, {12}); },
       op + "weights must have the shape of index [T, k] = [3, 4], got [12]"},
      {"weights_f16", [](A& a, P&) { a.weights.dtype = DType::f16; }, op + "weights must be float32 or bfloat16, got float16"},
      {"weights_padded", [](A& a, P&) { a.weights.strides[0] = 5; }, op + "weights must be dense [T, k] (strides [k, 1] = [4, 1]), got strides [5, 1]"},
      {"index_strided", [](A& a, P&) { a.index.strides[1] = 2; a.index.strides[0] = 8; },
       op + "index must be dense [T, k] (strides [k, 1] = [4, 1]), got strides [8, 2]"},
      {"rows_rank1", [](A& a, P& p) { a.rows = attnres::make_ref(p.rows.data(), DType::bf16, Device{}, {64}); },
       op + "rows must be a 2-D [R, D] tensor, got 1 dimensions [64]"},
      {"rows_D_12", [](A& a, P&) { a.rows.shape[1] = 12; }, op + "rows hidden size D = 12 must be a multiple of 8 in [8, 16384]"},
      {"rows_D_16392", [](A& a, P&) { a.rows.shape[1] = 16392; }, op + "rows hidden size D = 16392 must be a multiple of 8 in [8, 16384]"},
      {"rows_f32", [](A& a, P&) { a.rows.dtype = DType::f32; }, op + "rows must be bfloat16, got float32"},
      {"shared_shape", [](A& a, P&) { a.shared.shape[0] = 2; }, op + "shared must have shape [T, D] = [3, 64], got [2, 64]"},
      {"shared_dtype", [](A& a, P&) { a.shared.dtype = DType::f16; }, op + "shared must be bfloat16, got float16"},
      {"norm_weight_shape", [](A& a, P&) { a.norm_weight.shape[0] = 72; }, op + "norm_weight must have shape [D] = [64], got [72]"},
      {"norm_weight_rank2", [](A& a, P& p) { a.norm_weight = attnres::make_ref(p.norm_weight.data(), DType::bf16, Device{}, {1, 64}); },
       op + "norm_weight must be a 1-D [D] tensor, got 2 dimensions [1, 64]"},
      {"output_shape", [](A& a, P&) { a.output.shape[0] = 2; }, op + "output must have shape [T, D] = [3, 64], got [2, 64]"},
      {"output_dtype", [](A& a, P&) { a.output.dtype = DType::f32; }, op + "output must be bfloat16, got float32"},
      {"device_mixed", [](A& a, P&) { a.index.device = Device{DeviceType::cuda, 0}; },
       op + "index is on cuda:0 but rows is on cpu (all tensors must be on one device)"},
      {"rows_negative_stride", [](A& a, P&) { a.rows.strides[0] = -64; }, op + "rows has a negative stride [-64, 1]"},
      {"rows_inner_stride", [](A& a, P&) { a.rows.shape[1] = 32; a.rows.strides[1] = 2; a.norm_weight = TensorRef{}; a.shared = TensorRef{};
                                            a.output.shape[1] = 32; },
       op + "rows must have a contiguous last dimension (stride 1), got strides [64, 2]"},
      {"rows_overlapping", [](A& a, P&) { a.rows.strides[0] = 32; }, op + "rows has an overlapping layout"},
      {"rows_D_60", [](A& a, P&) { a.rows.shape[1] = 60; a.rows.strides[0] = 60; a.shared = TensorRef{};
                                    a.norm_weight = TensorRef{}; a.output.shape[1] = 60; },
       op + "rows hidden size D = 60 must be a multiple of 8 in [8, 16384]"},
      {"rows_padded_stride_68", [](A& a, P& p) { a.rows.shape[0] = p.R - 2; a.rows.strides[0] = 68; },
       op + "rows row stride 68 must be a multiple of 8 elements (16 bytes)"},
      {"rows_null", [](A& a, P&) { a.rows.data = nullptr; }, op + "rows has a null data pointer"},
      {"weights_misaligned", [](A& a, P&) { a.weights.data = static_cast<char*>(a.weights.data) + 2; },
       op + "weights data pointer is not aligned to its element size (4 bytes)"},
      {"output_strided", [](A& a, P&) { a.output.strides[1] = 2; a.output.shape[1] = 64; a.output.strides[0] = 128; },
       op + "output must have a contiguous last dimension (stride 1)"},
      {"eps_nan", [](A& a, P&) { a.eps = std::nan(""); }, op + "eps must be finite and >= 0, got nan"},
      {"eps_negative", [](A& a, P&) { a.eps = -1.0; }, op + "eps must be finite and >= 0, got -1"},
      {"scale_inf", [](A& a, P&) { a.scale = std::numeric_limits<double>::infinity(); }, op + "scale must be finite, got inf"},
      {"scale_inf_as_float32", [](A& a, P&) { a.scale = -1e39; }, op + "scale must be finite, got -1e+39 (infinite as float32"},
      {"eps_inf_as_float32", [](A& a, P&) { a.eps = 1e39; }, op + "eps must be finite and >= 0, got 1e+39 (infinite as float32"},
      {"output_aliases_rows", [](A& a, P&) { a.output.data = a.rows.data; }, op + "output overlaps rows (the output must not alias an input)"},
      {"output_aliases_shared", [](A& a, P&) { a.output.data = a.shared.data; }, op + "output overlaps shared"},
      {"output_aliases_norm_weight", [](A& a, P& p) {
         p.norm_weight.resize(3 * 64, 0x3f80);  // room for an output laid over it
         a.norm_weight.data = p.norm_weight.data();
         a.output.data = p.norm_weight.data(); },
       op + "output overlaps norm_weight (the output must not alias an input)"},
      {"index_equal_R", [](A& a, P& p) { p.index[6] = int32_t(p.R); (void)a; },
       op + "index value 20 at [1, 2] is out of range: must be -1 (remote expert) or a row of rows in [0, R = 20)"},
      {"index_minus_2", [](A& a, P& p) { p.index[6] = -2; (void)a; }, op + "index value -2 at [1, 2] is out of range"},
      {"cuda_rows_offset_by_one", [](A& a, P&) {
         a.rows = on_cuda(a.rows); a.rows.data = static_cast<char*>(a.rows.data) + 2; a.rows.shape[0] -= 1;
         a.weights = on_cuda(a.weights); a.index = on_cuda(a.index); a.shared = on_cuda(a.shared);
         a.norm_weight = on_cuda(a.norm_weight); a.output = on_cuda(a.output); },
       op + "rows must be 16-byte aligned for the CUDA kernel"},
      {"cuda_output_row_stride", [](A& a, P&) {
         a.rows = on_cuda(a.rows); a.weights = on_cuda(a.weights); a.index = on_cuda(a.index); a.shared = on_cuda(a.shared);
         a.norm_weight = on_cuda(a.norm_weight); a.output = on_cuda(a.output); a.output.strides[0] = 60; a.output.shape[1] = 56;
         a.rows.shape[1] = 56; a.shared.shape[1] = 56; a.shared.strides[0] = 56; a.norm_weight.shape[0] = 56; a.output.shape[0] = 3; },
       op + "output must be 16-byte aligned for the CUDA kernel"},
  };
}

INSTANTIATE_TEST_SUITE_P(All, Rejections, ::testing::ValuesIn(rejections()),
                         [](const ::testing::TestParamInfo<Rejection>& info) { return std::string(info.param.name); });

TEST(MoeFinalizeRejections, CudaRefsValidateWhenAligned) {
  // Positive control of the CUDA layout rules: validation (no launch) accepts the same refs when aligned,
  // and skips the host scan of an index it must not dereference.
  Problem p(3, 4, 64, 9, false, true, true);
  MoeFinalizeArgs a = p.args();
  for (TensorRef* t : {&a.rows, &a.weights, &a.index, &a.shared, &a.norm_weight, &a.output}) *t = on_cuda(*t);
  p.index[0] = 1 << 30;
  EXPECT_NO_THROW(attnres::validate_moe_finalize(a));
}

// ---------------------------------------------------------------------------------------------------- plan
DeviceInfo hopper() {
  DeviceInfo d;
  d.device = Device{DeviceType::cuda, 0};
  d.cuda_backend = true;
  d.cc_major = 9;
  d.name = "H200";
  d.sm_count = 132;
  return d;
}

MoeFinalizeQuery query(int64_t T, int64_t k, int64_t D) {
  MoeFinalizeQuery q;
  q.tokens = T;
  q.routes = k;
  q.hidden = D;
  return q;
}

TEST(MoeFinalizePlan, CpuTensorsRunOnTheCpuBackend) {
  const MoeFinalizePlan p = attnres::plan_moe_finalize(query(2, 16, 3584), attnres::query_device(Device{}));
  EXPECT_TRUE(p.accepted());
  EXPECT_EQ(p.kernel, KernelKind::cpu);
  MoeFinalizeOptions forced;
  forced.kernel = KernelKind::single_cta;
  EXPECT_TRUE(contains(attnres::plan_moe_finalize(query(2, 16, 3584), attnres::query_device(Device{}), forced).decline,
                       "runs on CUDA devices"));
  forced.kernel = KernelKind::split_k;
  EXPECT_TRUE(contains(attnres::plan_moe_finalize(query(2, 16, 3584), attnres::query_device(Device{}), forced).decline,
                       "does not implement moe_finalize"));
}

TEST(MoeFinalizePlan, HopperGeometry) {
  struct Row {
    int64_t D;
    int32_t threads, vectors, chunk;
  };
  for (const Row& r : {Row{8, 32, 1, 16}, Row{200, 32, 1, 16}, Row{3584, 448, 1, 16}, Row{4096, 512, 1, 16},
                       Row{4104, 288, 2, 8}, Row{7168, 448, 2, 8}, Row{8192, 512, 2, 8}, Row{8200, 288, 4, 2},
                       Row{16384, 512, 4, 2}}) {
    const MoeFinalizePlan p = attnres::plan_moe_finalize(query(1, 16, r.D), hopper());
    ASSERT_TRUE(p.accepted()) << p.decline;
    EXPECT_EQ(p.kernel, KernelKind::single_cta);
    EXPECT_EQ(p.threads, r.threads) << "D = " << r.D;
    EXPECT_EQ(p.vectors, r.vectors) << "D = " << r.D;
    EXPECT_EQ(p.route_chunk, r.chunk) << "D = " << r.D;
    EXPECT_GE(int64_t(p.threads) * p.vectors * 8, r.D);
    EXPECT_TRUE(p.pdl);
  }
  MoeFinalizeOptions no_pdl;
  no_pdl.pdl = false;
  EXPECT_FALSE(attnres::plan_moe_finalize(query(1, 16, 3584), hopper(), no_pdl).pdl);
}

TEST(MoeFinalizePlan, Declines) {
  DeviceInfo ampere = hopper();
  ampere.cc_major = 8;
  EXPECT_TRUE(contains(attnres::plan_moe_finalize(query(1, 16, 3584), ampere).decline, "compute capability 8.0"));
  DeviceInfo unbuilt = hopper();
  unbuilt.cuda_backend = false;
  EXPECT_TRUE(contains(attnres::plan_moe_finalize(query(1, 16, 3584), unbuilt).decline, "without the CUDA backend"));
  MoeFinalizeOptions cpu;
  cpu.kernel = KernelKind::cpu;
  EXPECT_TRUE(contains(attnres::plan_moe_finalize(query(1, 16, 3584), hopper(), cpu).decline, "kernel cpu runs on CPU tensors"));
  EXPECT_EQ(attnres::plan_moe_finalize(query(1, 16, 12), hopper()).decline, "D = 12 is not a multiple of 8 in [8, 16384]");
  EXPECT_EQ(attnres::plan_moe_finalize(query(1, 33, 64), hopper()).decline, "k = 33 is outside [1, 32]");
  EXPECT_EQ(attnres::plan_moe_finalize(query(0, 4, 64), hopper()).decline, "T = 0 is outside [1, 16384]");
  MoeFinalizeQuery f16 = query(1, 4, 64);
  f16.rows_dtype = DType::f16;
  EXPECT_EQ(attnres::plan_moe_finalize(f16, hopper()).decline, "rows are float16 (the kernel reads bfloat16)");
  MoeFinalizeQuery w16 = query(1, 4, 64);
  w16.weights_dtype = DType::f16;
  EXPECT_EQ(attnres::plan_moe_finalize(w16, hopper()).decline, "weights are float16 (the kernel reads float32 or bfloat16)");
}

TEST(MoeFinalizePlan, DeclinedRunThrowsUnsupportedAndWritesNothing) {
  Problem p(2, 4, 64, 3);
  const auto before = p.image();
  MoeFinalizeOptions forced;
  forced.kernel = KernelKind::single_cta;
  std::string message;
  try {
    attnres::moe_finalize(p.args(), forced);
  } catch (const UnsupportedError& e) {
    message = e.what();
  }
  EXPECT_TRUE(contains(message, "moe_finalize: kernel single_cta runs on CUDA devices")) << message;
  EXPECT_EQ(p.image(), before);
}

// ---------------------------------------------------------------------------------------------------- GPU
#if ATTNRES_WITH_CUDA
template <class T>
T* to_device(const std::vector<T>& host) {
  void* d = nullptr;
  if (host.empty()) return nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(d);
}

template <class T>
void rebase(TensorRef& ref, const std::vector<T>& host, T* device) {
  ref.data = reinterpret_cast<char*>(device) + (static_cast<const char*>(ref.data) - reinterpret_cast<const char*>(host.data()));
  ref.device = Device{DeviceType::cuda, 0};
}
#endif

TEST(MoeFinalizeGpu, KernelMatchesTheCpuBackend) {
#if ATTNRES_WITH_CUDA
  if (attnres::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (attnres::query_device(Device{DeviceType::cuda, 0}).cc_major < 9) GTEST_SKIP() << "needs compute capability 9.0";
  for (const Shape& s : {Shape{1, 16, 3584, false, true, false, 2.827, 0.25, 0}, Shape{5, 32, 7168, true, true, false, 1.0, 0.1, 8},
                         Shape{2, 8, 16384, false, false, false, 0.5, 0.2, 0}, Shape{3, 16, 3584, false, true, true, 1.0, 0.2, 0}}) {
    Problem p(s.T, s.k, s.D, 4242 + s.D, s.bf16_weights, s.shared, s.norm, s.scale, s.remote, s.pad);
    attnres::moe_finalize(p.args());
    const std::vector<uint16_t> cpu = p.result_bits();
    const std::vector<double> cpu_values = p.result();

    uint16_t* rows = to_device(p.rows);
    float* wf = to_device(p.weights_f32);
    uint16_t* wb = to_device(p.weights_bf16);
    int32_t* idx = to_device(p.index);
    uint16_t* sh = to_device(p.shared);
    uint16_t* nw = to_device(p.norm_weight);
    std::vector<uint16_t> poisoned(p.output.size(), kPoison);
    uint16_t* out = to_device(poisoned);
    MoeFinalizeArgs a = p.args();
    rebase(a.rows, p.rows, rows);
    if (s.bf16_weights) rebase(a.weights, p.weights_bf16, wb); else rebase(a.weights, p.weights_f32, wf);
    rebase(a.index, p.index, idx);
    if (s.shared) rebase(a.shared, p.shared, sh);
    if (s.norm) rebase(a.norm_weight, p.norm_weight, nw);
    rebase(a.output, p.output, out);
    attnres::moe_finalize(a);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(p.output.data(), out, p.output.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    if (s.norm) {
      EXPECT_TRUE(close(p.result(), cpu_values));
    } else {
      EXPECT_EQ(p.result_bits(), cpu);
    }
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t d = s.D; d < s.D + s.pad; ++d) EXPECT_EQ(p.output[size_t(t * (s.D + s.pad) + d)], kPoison);
    for (void* ptr : {static_cast<void*>(rows), static_cast<void*>(wf), static_cast<void*>(wb), static_cast<void*>(idx),
                      static_cast<void*>(sh), static_cast<void*>(nw), static_cast<void*>(out)})
      if (ptr) cudaFree(ptr);
  }
#else
  GTEST_SKIP() << "built without the CUDA backend";
#endif
}

}  // namespace
