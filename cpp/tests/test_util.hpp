// Shared helpers of the GoogleTest suites: host bf16 conversions (independent of the library's own), a
// random problem generator with strided and token-major layouts, a float64 oracle of the contract
// (docs/ops/common.md), the contract's accuracy metrics, and storage snapshots for "nothing was written".
//
// The tests use only the public API (attnres/attnres.hpp): the library's internal bf16 helpers are what is
// under test, so this file has its own.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attnres/attnres.hpp"

// gtest prints enums as raw bytes without these (they must live in the enums' namespace).
namespace attnres {
inline void PrintTo(KernelKind k, std::ostream* os) { *os << kernel_name(k); }
inline void PrintTo(AttnResOp op, std::ostream* os) { *os << op_name(op); }
}  // namespace attnres

namespace attnres_test {

using attnres::AttnResArgs;
using attnres::AttnResOp;
using attnres::Device;
using attnres::DeviceType;
using attnres::DType;
using attnres::KernelKind;
using attnres::Options;
using attnres::TensorRef;

// The ops by the letters the suites' tables use.
constexpr AttnResOp R = AttnResOp::attn_res;
constexpr AttnResOp N = AttnResOp::attn_res_rmsnorm;
constexpr AttnResOp A = AttnResOp::attn_res_add_rmsnorm;
constexpr AttnResOp P = AttnResOp::attn_res_add_rmsnorm_persistent;

const Device kCuda0{DeviceType::cuda, 0};

// ---------------------------------------------------------------------------------------------------------
// bf16 on the host: round to nearest even, subnormals kept, NaN stays NaN.

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// float64 -> bf16 with one rounding. Going through float can create a tie that x itself was not on (x just
// below or above a bf16 midpoint rounds onto it); break such ties by the side of the midpoint x lies on.
inline uint16_t f64_to_bf16(double x) {
  const float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) <= 0x7f800000u && (u & 0xffffu) == 0x8000u && static_cast<double>(f) != x) {
    const bool away = std::fabs(x) > std::fabs(static_cast<double>(f));
    return static_cast<uint16_t>((u >> 16) + (away ? 1u : 0u));
  }
  return f32_to_bf16(f);
}

// PyTorch's bf16 tensor add: fp32 add of the widened values, rounded to bf16 (contract step 1).
inline uint16_t bf16_add(uint16_t a, uint16_t b) { return f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b)); }

inline bool bf16_is_subnormal(uint16_t b) { return (b & 0x7f80u) == 0 && (b & 0x007fu) != 0; }

// Poison for outputs: a NaN no op produces (results are quiet NaNs with bit 6 set; this one has it clear),
// so an unwritten element fails every comparison and a stray write is visible in the storage compare.
constexpr uint16_t kPoisonBf16 = 0x7fa5;
constexpr uint32_t kPoisonF32 = 0x7fa5a5a5u;

// ---------------------------------------------------------------------------------------------------------
// A host buffer plus the strided view the op sees. The same buffer can be mirrored to a device: the view is
// then built on the mirror's base pointer with the same offset and strides.

struct Buffer {
  bool present = false;
  DType dtype = DType::bf16;
  std::vector<int64_t> shape, strides;  // the view, strides in elements
  int64_t offset = 0;                   // of the view's first element in the storage, in elements
  std::vector<uint16_t> bf;             // storage (bf16)
  std::vector<float> f32;               // storage (fp32 diagnostics)

  int64_t element_size() const { return dtype == DType::f32 ? 4 : 2; }
  int64_t storage_elements() const { return dtype == DType::f32 ? int64_t(f32.size()) : int64_t(bf.size()); }
  size_t nbytes() const { return size_t(storage_elements() * element_size()); }
  void* host() { return dtype == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(bf.data()); }
  const void* host() const { return const_cast<Buffer*>(this)->host(); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }

  TensorRef ref_at(void* base, Device device) const {
    TensorRef t;
    if (!present) return t;
    t.data = static_cast<char*>(base) + offset * element_size();
    t.dtype = dtype;
    t.device = device;
    t.ndim = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) {
      t.shape[i] = shape[i];
      t.strides[i] = strides[i];
    }
    return t;
  }
  TensorRef ref() const { return ref_at(const_cast<void*>(host()), Device{}); }

  // Storage index of every view element, in row-major logical order.
  std::vector<int64_t> indices() const {
    std::vector<int64_t> out;
    out.reserve(size_t(numel()));
    std::vector<int64_t> idx(shape.size(), 0);
    for (int64_t e = 0; e < numel(); ++e) {
      int64_t at = offset;
      for (size_t d = 0; d < shape.size(); ++d) at += idx[d] * strides[d];
      out.push_back(at);
      for (int d = int(shape.size()) - 1; d >= 0; --d) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
    return out;
  }
  std::vector<uint16_t> bits() const {  // bf16 view, logical order
    std::vector<uint16_t> out;
    for (int64_t i : indices()) out.push_back(bf[size_t(i)]);
    return out;
  }
  std::vector<double> values() const {  // any dtype, logical order
    std::vector<double> out;
    for (int64_t i : indices()) out.push_back(dtype == DType::f32 ? double(f32[size_t(i)]) : double(bf16_to_f32(bf[size_t(i)])));
    return out;
  }
  // Element (i, j) of a 2-D view / (k, t, h) of a 3-D view, bf16.
  uint16_t& at(int64_t i, int64_t j) { return bf[size_t(offset + i * strides[0] + j * strides[1])]; }
  uint16_t at(int64_t i, int64_t j) const { return bf[size_t(offset + i * strides[0] + j * strides[1])]; }
  uint16_t at(int64_t k, int64_t t, int64_t h) const {
    return bf[size_t(offset + k * strides[0] + t * strides[1] + h * strides[2])];
  }
  uint16_t& at(int64_t k, int64_t t, int64_t h) {
    return bf[size_t(offset + k * strides[0] + t * strides[1] + h * strides[2])];
  }
};

// A [rows, cols] view with `pad` unused elements after every row (a strided, non-dense view when pad > 0),
// starting `offset` elements into its storage (an unaligned base when offset is not a multiple of 8).
inline Buffer matrix(DType dtype, int64_t rows, int64_t cols, int64_t pad = 0, int64_t offset = 0) {
  Buffer b;
  b.present = true;
  b.dtype = dtype;
  b.shape = {rows, cols};
  b.strides = {cols + pad, 1};
  b.offset = offset;
  const size_t n = size_t(rows * (cols + pad) + offset);
  if (dtype == DType::f32) {
    b.f32.resize(n);
    const float poison = [] { float f; std::memcpy(&f, &kPoisonF32, 4); return f; }();
    std::fill(b.f32.begin(), b.f32.end(), poison);
  } else {
    b.bf.assign(n, kPoisonBf16);
  }
  return b;
}

// An [n] vector; the storage has 8 spare elements so tests can shift the view off its alignment in bounds.
inline Buffer vector1d(int64_t n) {
  Buffer b;
  b.present = true;
  b.shape = {n};
  b.strides = {1};
  b.bf.assign(size_t(n + 8), kPoisonBf16);
  return b;
}

// ---------------------------------------------------------------------------------------------------------
// A random problem: every buffer an op can take, filled with fresh random data (never zeros); outputs
// poisoned. Which of them a call passes depends on the op and the flags (args()).

enum class BankLayout { snapshot_major, token_major };

struct Config {
  AttnResOp op = AttnResOp::attn_res_add_rmsnorm;
  int64_t T = 2, K = 2, H = 64;
  bool add = true, add2 = false, tap = false, diagnostics = false;
  int64_t snapshot_slot = -1;
  BankLayout bank_layout = BankLayout::snapshot_major;
  int64_t bank_rows = 0;  // snapshot rows the bank storage holds (Kmax); at least K and slot + 1
  int64_t pad = 0;        // unused elements after every H-row of every [.., H] buffer (strided views)
  int64_t offset = 0;     // every [.., H] view starts this many elements into its storage
  bool res_weight_2d = false;  // res_weight as [1, H] (the scoring Linear's weight)
  double rms_eps = 1e-5, norm_eps = 1e-5;
  double magnitude = 0;  // > 0: every row at this scale; 0: rows at mixed scales 1e-2 .. 1e2
  uint64_t seed = 1;
};

inline bool op_has_norm(AttnResOp op) { return op != AttnResOp::attn_res; }

// `op` on T tokens, K snapshots and hidden size H, with the addend where the op takes one and the diagnostics
// of attn_res; `more` adjusts the rest.
inline Config make_config(AttnResOp op, int64_t T, int64_t K, int64_t H, const std::function<void(Config&)>& more = nullptr) {
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

struct Case {
  Config cfg;
  Buffer layer_residual, add, add2, bank, res_weight, rms_weight, norm_weight;
  Buffer output, updated, mixture, rsigma, probs, logits;

  explicit Case(const Config& c) : cfg(c) {
    const int64_t T = c.T, K = c.K, H = c.H, N = K + 1, R = std::max({c.bank_rows, K, c.snapshot_slot + 1});
    std::mt19937_64 rng(c.seed * 0x9e3779b97f4a7c15ull + 12345);
    std::normal_distribution<double> normal(0.0, 1.0);
    const double scales[] = {1e-2, 0.3, 1.0, 4.0, 1e2};
    auto scale_of = [&](int64_t row) { return c.magnitude > 0 ? c.magnitude : scales[size_t(row) % 5]; };
    auto random_bf16 = [&](double scale) {
      uint16_t b = 0;
      while ((b & 0x7fffu) == 0) b = f64_to_bf16(scale * normal(rng));  // never zero
      return b;
    };
    auto fill_rows = [&](Buffer& b, int64_t first_scale_row) {
      for (int64_t i = 0; i < b.shape[0]; ++i)
        for (int64_t h = 0; h < H; ++h) b.at(i, h) = random_bf16(scale_of(first_scale_row + i));
    };

    layer_residual = matrix(DType::bf16, T, H, c.pad, c.offset);
    add = matrix(DType::bf16, T, H, c.pad, c.offset);
    add2 = matrix(DType::bf16, T, H, c.pad, c.offset);
    fill_rows(layer_residual, 2);
    fill_rows(add, 1);
    fill_rows(add2, 1);

    // The bank: snapshot-major [R, T, H] or token-major [T, R, H] storage; the view is its first K rows.
    bank.present = true;
    bank.shape = {K, T, H};
    const int64_t row = H + c.pad;
    bank.strides = c.bank_layout == BankLayout::snapshot_major ? std::vector<int64_t>{T * row, row, 1}
                                                               : std::vector<int64_t>{row, R * row, 1};
    bank.offset = c.offset;
    bank.bf.assign(size_t(std::max<int64_t>(R, 1) * T * row + c.offset), kPoisonBf16);
    for (int64_t k = 0; k < R; ++k)  // rows past K hold data too: a stray read of them changes results
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) bank.at(k, t, h) = random_bf16(scale_of(k));

    res_weight = vector1d(H);
    if (c.res_weight_2d) {
      res_weight.shape = {1, H};
      res_weight.strides = {H, 1};
    }
    rms_weight = vector1d(H);
    norm_weight = vector1d(H);
    for (int64_t h = 0; h < H; ++h) {
      res_weight.bf[size_t(h)] = random_bf16(0.02);
      rms_weight.bf[size_t(h)] = f64_to_bf16(1.0 + 0.1 * normal(rng));
      norm_weight.bf[size_t(h)] = f64_to_bf16(1.0 + 0.1 * normal(rng));
    }

    output = matrix(DType::bf16, T, H, c.pad, c.offset);
    updated = matrix(DType::bf16, T, H, c.pad, c.offset);
    mixture = matrix(DType::bf16, T, H, c.pad, c.offset);
    rsigma = matrix(DType::f32, N, T);
    probs = matrix(DType::f32, N, T);
    logits = matrix(DType::f32, N, T);
  }

  bool uses_add() const {
    return cfg.add && (cfg.op == AttnResOp::attn_res_add_rmsnorm || cfg.op == AttnResOp::attn_res_add_rmsnorm_persistent);
  }
  bool uses_add2() const { return cfg.add && cfg.add2 && cfg.op == AttnResOp::attn_res_add_rmsnorm; }
  bool uses_tap() const { return cfg.tap && (cfg.op == AttnResOp::attn_res_rmsnorm || cfg.op == AttnResOp::attn_res_add_rmsnorm); }
  bool uses_diagnostics() const { return cfg.diagnostics && cfg.op == AttnResOp::attn_res; }

  // The call's arguments, each view built on base(buffer) (host storage, or a device mirror of it).
  AttnResArgs args_on(const std::function<void*(const Buffer&)>& base, Device device) const {
    auto ref = [&](const Buffer& b) { return b.ref_at(base(b), device); };
    AttnResArgs a;
    a.layer_residual = ref(layer_residual);
    if (uses_add()) a.layer_residual_add = ref(add);
    if (uses_add2()) a.layer_residual_add2 = ref(add2);
    a.block_residual = ref(bank);
    a.res_weight = ref(res_weight);
    a.rms_weight = ref(rms_weight);
    if (op_has_norm(cfg.op)) a.norm_weight = ref(norm_weight);
    a.rms_eps = cfg.rms_eps;
    a.norm_eps = cfg.norm_eps;
    a.output = ref(output);
    if (uses_add()) a.updated = ref(updated);
    if (uses_tap()) a.mixture = ref(mixture);
    if (uses_diagnostics()) {
      a.rsigma = ref(rsigma);
      a.probs = ref(probs);
      a.logits = ref(logits);
    }
    a.snapshot_slot = cfg.snapshot_slot;
    return a;
  }
  AttnResArgs args() const {
    return args_on([](const Buffer& b) { return const_cast<void*>(b.host()); }, Device{});
  }

  std::vector<Buffer*> buffers() {
    return {&layer_residual, &add, &add2, &bank, &res_weight, &rms_weight, &norm_weight,
            &output, &updated, &mixture, &rsigma, &probs, &logits};
  }
  std::vector<const Buffer*> buffers() const {
    std::vector<const Buffer*> out;
    for (Buffer* b : const_cast<Case*>(this)->buffers()) out.push_back(b);
    return out;
  }
};

// Byte-wise equality of every storage (views and padding alike).
inline bool same_storage(const Buffer& a, const Buffer& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.host(), b.host(), a.nbytes()) == 0;
}
inline ::testing::AssertionResult storage_unchanged(const Case& before, const Case& after) {
  const char* names[] = {"layer_residual", "layer_residual_add", "layer_residual_add2", "block_residual",
                         "res_weight", "rms_weight", "norm_weight", "output", "updated", "mixture", "rsigma",
                         "probs", "logits"};
  const auto a = before.buffers(), b = after.buffers();
  for (size_t i = 0; i < a.size(); ++i)
    if (!same_storage(*a[i], *b[i])) return ::testing::AssertionFailure() << names[i] << " storage was modified";
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------------------------
// The float64 oracle: the contract's formulas, steps 1, 6 and 7 rounded to bf16 exactly where it says.

struct Expected {
  std::vector<uint16_t> updated, mixture, output;  // [T, H] row-major
  std::vector<double> rsigma, probs, logits;       // [N, T] row-major
};

inline Expected reference(const Case& c, double rms_eps, double norm_eps) {
  const int64_t T = c.cfg.T, K = c.cfg.K, H = c.cfg.H, N = K + 1;
  const bool has_add = c.uses_add(), has_add2 = c.uses_add2(), has_norm = op_has_norm(c.cfg.op);
  Expected e;
  e.updated.resize(size_t(T * H));
  e.mixture.resize(size_t(T * H));
  e.output.resize(size_t(T * H));
  e.rsigma.resize(size_t(N * T));
  e.probs.resize(size_t(N * T));
  e.logits.resize(size_t(N * T));
  std::vector<double> q(static_cast<size_t>(H));
  for (int64_t h = 0; h < H; ++h)
    q[size_t(h)] = double(bf16_to_f32(c.rms_weight.bf[size_t(h)])) * double(bf16_to_f32(c.res_weight.bf[size_t(h)]));
  std::vector<uint16_t> P(static_cast<size_t>(H));
  std::vector<std::vector<double>> V(static_cast<size_t>(N), std::vector<double>(static_cast<size_t>(H)));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      uint16_t p = c.layer_residual.at(t, h);
      if (has_add) p = bf16_add(p, has_add2 ? bf16_add(c.add.at(t, h), c.add2.at(t, h)) : c.add.at(t, h));
      P[size_t(h)] = p;
      e.updated[size_t(t * H + h)] = p;
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        V[size_t(n)][size_t(h)] = bf16_to_f32(n < K ? c.bank.at(n, t, h) : P[size_t(h)]);
    double max_logit = -INFINITY;
    for (int64_t n = 0; n < N; ++n) {
      double ss = 0, dot = 0;
      for (int64_t h = 0; h < H; ++h) {
        ss += V[size_t(n)][size_t(h)] * V[size_t(n)][size_t(h)];
        dot += V[size_t(n)][size_t(h)] * q[size_t(h)];
      }
      const double rs = 1.0 / std::sqrt(ss / double(H) + rms_eps);
      e.rsigma[size_t(n * T + t)] = rs;
      e.logits[size_t(n * T + t)] = rs * dot;
      max_logit = std::max(max_logit, rs * dot);
    }
    double denom = 0;
    for (int64_t n = 0; n < N; ++n) denom += std::exp(e.logits[size_t(n * T + t)] - max_logit);
    for (int64_t n = 0; n < N; ++n) e.probs[size_t(n * T + t)] = std::exp(e.logits[size_t(n * T + t)] - max_logit) / denom;
    double ms = 0;
    for (int64_t h = 0; h < H; ++h) {
      double acc = 0;
      for (int64_t n = 0; n < N; ++n) acc += e.probs[size_t(n * T + t)] * V[size_t(n)][size_t(h)];
      const uint16_t m = f64_to_bf16(acc);
      e.mixture[size_t(t * H + h)] = m;
      ms += double(bf16_to_f32(m)) * double(bf16_to_f32(m));
    }
    const double r = 1.0 / std::sqrt(ms / double(H) + norm_eps);
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t m = e.mixture[size_t(t * H + h)];
      if (!has_norm) {
        e.output[size_t(t * H + h)] = m;
        continue;
      }
      const uint16_t normed = f64_to_bf16(double(bf16_to_f32(m)) * r);
      e.output[size_t(t * H + h)] =
          f64_to_bf16(double(bf16_to_f32(normed)) * double(bf16_to_f32(c.norm_weight.bf[size_t(h)])));
    }
  }
  return e;
}
inline Expected reference(const Case& c) { return reference(c, c.cfg.rms_eps, c.cfg.norm_eps); }

// ---------------------------------------------------------------------------------------------------------
// The contract's accuracy rule: bf16 tensors cosine > 0.9999 and relative L2 < 5e-3; fp32 diagnostics
// relative L2 < 1e-4 (over the tensor: a logit near zero has no meaningful elementwise relative error).

constexpr double kCosineMin = 0.9999;
constexpr double kRelL2Max = 5e-3;
constexpr double kDiagRelMax = 1e-4;

inline std::vector<double> widen(const std::vector<uint16_t>& bits) {
  std::vector<double> out;
  for (uint16_t b : bits) out.push_back(bf16_to_f32(b));
  return out;
}

struct Closeness {
  double cosine = 0, rel_l2 = INFINITY;
  bool finite = true;
};
inline Closeness closeness(const std::vector<double>& actual, const std::vector<double>& expected) {
  Closeness c;
  double dot = 0, na = 0, ne = 0, diff = 0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) {
    if (!std::isfinite(actual[i])) c.finite = false;
    dot += actual[i] * expected[i];
    na += actual[i] * actual[i];
    ne += expected[i] * expected[i];
    diff += (actual[i] - expected[i]) * (actual[i] - expected[i]);
  }
  c.cosine = (na > 0 && ne > 0) ? dot / std::sqrt(na * ne) : (diff == 0 ? 1.0 : 0.0);
  c.rel_l2 = ne > 0 ? std::sqrt(diff / ne) : std::sqrt(diff);
  return c;
}

inline ::testing::AssertionResult bf16_close(const std::vector<double>& actual, const std::vector<double>& expected,
                                             const std::string& what) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << what << ": " << actual.size() << " elements, expected " << expected.size();
  const Closeness c = closeness(actual, expected);
  if (c.finite && c.cosine > kCosineMin && c.rel_l2 < kRelL2Max) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": cosine " << c.cosine << " (need > " << kCosineMin << "), rel L2 "
                                       << c.rel_l2 << " (need < " << kRelL2Max << ")" << (c.finite ? "" : ", non-finite values");
}

inline ::testing::AssertionResult diag_close(const std::vector<double>& actual, const std::vector<double>& expected,
                                             const std::string& what) {
  const Closeness c = closeness(actual, expected);
  if (actual.size() == expected.size() && c.finite && c.rel_l2 < kDiagRelMax) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": relative L2 error " << c.rel_l2 << " (need < " << kDiagRelMax << ")";
}

// First index where two bf16 bit patterns differ, for readable failures of bitwise checks.
inline ::testing::AssertionResult bits_equal(const std::vector<uint16_t>& actual, const std::vector<uint16_t>& expected,
                                             const std::string& what) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << what << ": " << actual.size() << " elements, expected " << expected.size();
  for (size_t i = 0; i < actual.size(); ++i)
    if (actual[i] != expected[i])
      return ::testing::AssertionFailure() << what << ": element " << i << " is 0x" << std::hex << actual[i]
                                           << ", expected 0x" << expected[i];
  return ::testing::AssertionSuccess();
}

// A one-token case holding token t of `batch`'s inputs (prefix, addends, bank rows) and its weights: the
// input of the "a token's result does not depend on T or its position" tests.
inline Case token_case(const Case& batch, int64_t t) {
  Config one_cfg = batch.cfg;
  one_cfg.T = 1;
  Case one(one_cfg);
  for (int64_t h = 0; h < batch.cfg.H; ++h) {
    one.layer_residual.at(0, h) = batch.layer_residual.at(t, h);
    if (batch.add.present) one.add.at(0, h) = batch.add.at(t, h);
    if (batch.add2.present) one.add2.at(0, h) = batch.add2.at(t, h);
    for (int64_t k = 0; k < batch.cfg.K; ++k) one.bank.at(k, 0, h) = batch.bank.at(k, t, h);
  }
  one.res_weight = batch.res_weight;
  one.rms_weight = batch.rms_weight;
  one.norm_weight = batch.norm_weight;
  return one;
}

// The [T, H] rows a snapshot write targets: bank row `slot` of every token.
inline Buffer bank_row_view(const Case& c, int64_t slot) {
  Buffer v = c.bank;
  v.shape = {c.cfg.T, c.cfg.H};
  v.strides = {c.bank.strides[1], c.bank.strides[2]};
  v.offset = c.bank.offset + slot * c.bank.strides[0];
  return v;
}
inline std::vector<uint16_t> bank_row(const Case& c, int64_t slot) { return bank_row_view(c, slot).bits(); }

// After a call: every byte outside the views the call may write (its outputs and the snapshot row) is as it
// was before, i.e. inputs, unused outputs, padding and bank rows other than the slot.
inline ::testing::AssertionResult only_outputs_written(const Case& before, const Case& after) {
  Case restored = after;
  auto restore = [](Buffer& dst, const Buffer& src_view, const Buffer& src) {
    for (int64_t i : src_view.indices()) {
      if (src.dtype == DType::f32) dst.f32[size_t(i)] = src.f32[size_t(i)];
      else dst.bf[size_t(i)] = src.bf[size_t(i)];
    }
  };
  const AttnResArgs a = before.args();
  if (a.output.present()) restore(restored.output, before.output, before.output);
  if (a.updated.present()) restore(restored.updated, before.updated, before.updated);
  if (a.mixture.present()) restore(restored.mixture, before.mixture, before.mixture);
  if (a.rsigma.present()) restore(restored.rsigma, before.rsigma, before.rsigma);
  if (a.probs.present()) restore(restored.probs, before.probs, before.probs);
  if (a.logits.present()) restore(restored.logits, before.logits, before.logits);
  if (a.snapshot_slot >= 0) restore(restored.bank, bank_row_view(before, a.snapshot_slot), before.bank);
  return storage_unchanged(before, restored);
}

// bf16 subnormal patterns for (layer_residual, add, add2) and the prefix PyTorch computes for
// layer_residual + (add + add2): sums of subnormals, and normal values that cancel into subnormals.
struct SubnormalSum {
  uint16_t prefix, add, add2, expected;
};
inline constexpr SubnormalSum kSubnormalSums[] = {
    {0x0003, 0x0004, 0x0001, 0x0008},  // 3 + (4 + 1) ulps of 2^-133
    {0x0082, 0x8080, 0x8001, 0x0001},  // (2^-126 + 2 ulp) - (2^-126 + 1 ulp): a normal sum cancels to 1 ulp
    {0x8005, 0x0002, 0x8001, 0x8004},  // negative subnormals
    {0x0040, 0x0020, 0x0020, 0x0080},  // subnormals summing to the smallest normal
    {0x007f, 0x0001, 0x8001, 0x007f},  // add + add2 = +0, the largest subnormal stays
    {0x0081, 0x8001, 0x0001, 0x0081},  // smallest normal + 0 (kept exactly)
    {0x3f80, 0x0001, 0x0001, 0x3f80},  // subnormal sum absorbed by 1.0
    {0x0100, 0x8100, 0x0005, 0x0005},  // exact cancellation leaves add2's subnormal
};

// attn_res_add_rmsnorm, T = 4, K = 2, H = 128, two addends, tap, snapshot into row 2.
inline Case subnormal_case(uint64_t seed) {
  Config cfg;
  cfg.op = AttnResOp::attn_res_add_rmsnorm;
  cfg.T = 4;
  cfg.K = 2;
  cfg.H = 128;
  cfg.add = cfg.add2 = cfg.tap = true;
  cfg.snapshot_slot = 2;
  cfg.bank_rows = 3;
  cfg.seed = seed;
  Case c(cfg);
  // Every other element a pattern (the rest stays random so the rows are not degenerate).
  for (int64_t t = 0; t < cfg.T; ++t)
    for (int64_t h = 0; h < cfg.H; h += 2) {
      const SubnormalSum& s = kSubnormalSums[size_t((t * cfg.H + h) / 2) % (sizeof kSubnormalSums / sizeof kSubnormalSums[0])];
      c.layer_residual.at(t, h) = s.prefix;
      c.add.at(t, h) = s.add;
      c.add2.at(t, h) = s.add2;
    }
  return c;
}

inline void expect_subnormals_kept(const Case& before, const Case& after) {
  int subnormal_results = 0;
  for (int64_t t = 0; t < before.cfg.T; ++t)
    for (int64_t h = 0; h < before.cfg.H; h += 2) {
      const SubnormalSum& s = kSubnormalSums[size_t((t * before.cfg.H + h) / 2) % (sizeof kSubnormalSums / sizeof kSubnormalSums[0])];
      ASSERT_EQ(after.updated.at(t, h), s.expected) << "token " << t << " h " << h;
      subnormal_results += bf16_is_subnormal(after.updated.at(t, h));
    }
  EXPECT_GT(subnormal_results, 0);
  // The rest follows the same rule, and the snapshot row holds the same bits.
  EXPECT_TRUE(bits_equal(after.updated.bits(), reference(before).updated, "updated"));
  EXPECT_TRUE(bits_equal(bank_row(after, 2), after.updated.bits(), "snapshot row"));
}

// Seeds that differ per test (and per case inside a test): fresh data everywhere, reproducible runs.
inline uint64_t test_seed(uint64_t salt = 0) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  return std::hash<std::string>{}(name) ^ (salt * 0x9e3779b97f4a7c15ull);
}

// gtest without gmock (libgmock-dev is a separate Debian package): substring check with a readable failure.
inline ::testing::AssertionResult contains(const std::string& text, const std::string& fragment) {
  if (text.find(fragment) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << fragment << "\"";
}

// Runs `op` and returns the ArgumentError/UnsupportedError message ("" when it did not throw).
template <class Error>
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace attnres_test
