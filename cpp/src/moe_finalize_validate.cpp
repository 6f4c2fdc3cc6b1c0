// Preconditions of moe_finalize, checked for every backend before anything runs, in the order
// docs/ops/moe_finalize.md lists them. Messages: "moe_finalize: <argument> <rule>".
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attnres/error.hpp"
#include "attnres/moe_finalize.hpp"
#include "layout.hpp"

namespace attnres {

namespace {

[[noreturn]] void fail(const std::string& arg, const std::string& rule) {
  throw ArgumentError("moe_finalize: " + arg + " " + rule);
}

std::string num(int64_t v) { return std::to_string(v); }

void rank(const char* arg, const TensorRef& t, int want, const char* pattern) {
  if (t.ndim != want)
    fail(arg, "must be a " + num(want) + "-D " + pattern + " tensor, got " + num(t.ndim) + " dimensions " +
                  t.shape_string());
}

void shape2(const char* arg, const TensorRef& t, int64_t d0, int64_t d1, const char* pattern) {
  rank(arg, t, 2, pattern);
  if (t.shape[0] != d0 || t.shape[1] != d1)
    fail(arg, std::string("must have shape ") + pattern + " = [" + num(d0) + ", " + num(d1) + "], got " +
                  t.shape_string());
}

void dtype(const char* arg, const TensorRef& t, DType want) {
  if (t.dtype != want) fail(arg, std::string("must be ") + dtype_name(want) + ", got " + dtype_name(t.dtype));
}

// Strides non-negative, innermost stride 1, no element reachable through two indices, a data pointer.
void strided_rows(const char* arg, const TensorRef& t) {
  for (int i = 0; i < t.ndim; ++i)
    if (t.strides[i] < 0) fail(arg, "has a negative stride " + t.strides_string());
  if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1)
    fail(arg, "must have a contiguous last dimension (stride 1), got strides " + t.strides_string());
  if (!detail::non_overlapping(t))
    fail(arg, "has an overlapping layout (shape " + t.shape_string() + ", strides " + t.strides_string() +
                  "): every element must have its own address");
  if (t.numel() > 0 && t.data == nullptr) fail(arg, "has a null data pointer");
}

// The kernel addresses weights and index as t * k + j: a padded or sliced [T, k] view would be misread.
void dense(const char* arg, const TensorRef& t) {
  const bool ok = (t.shape[1] <= 1 || t.strides[1] == 1) && (t.shape[0] <= 1 || t.strides[0] == t.shape[1]);
  if (!ok)
    fail(arg, "must be dense [T, k] (strides [k, 1] = [" + num(t.shape[1]) + ", 1]), got strides " +
                  t.strides_string() + ": pass .contiguous() (the kernel reads it as t * k + j)");
  if (t.numel() > 0 && t.data == nullptr) fail(arg, "has a null data pointer");
}

void naturally_aligned(const char* arg, const TensorRef& t) {
  if (t.numel() > 0 && reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    fail(arg, "data pointer is not aligned to its element size (" + num(dtype_size(t.dtype)) + " bytes)");
}

// CUDA: rows, shared, norm_weight and output are read or written in 16-byte vectors (8 x bf16).
void aligned16(const char* arg, const TensorRef& t) {
  if (!t.present() || t.numel() == 0) return;
  bool ok = reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.shape[i] > 1 && (t.strides[i] * dtype_size(t.dtype)) % 16 != 0) ok = false;
  if (!ok)
    fail(arg, "must be 16-byte aligned for the CUDA kernel (base pointer and row stride a multiple of 16 "
              "bytes), got strides " + t.strides_string());
}

void scan_index(const TensorRef& index, int64_t rows) {
  const int64_t T = index.shape[0], k = index.shape[1];
  const int32_t* idx = static_cast<const int32_t*>(index.data);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t v = idx[t * k + j];
      if (v < -1 || v >= rows)
        fail("index", "value " + num(v) + " at [" + num(t) + ", " + num(j) + "] is out of range: must be -1 "
                      "(remote expert) or a row of rows in [0, R = " + num(rows) + ")");
    }
}

struct Named {
  const char* name;
  const TensorRef* ref;
};

}  // namespace

void validate_moe_finalize(const MoeFinalizeArgs& a, bool require_output) {
  // 1. Required arguments.
  if (!a.rows.present()) fail("rows", "is required");
  if (!a.weights.present()) fail("weights", "is required");
  if (!a.index.present()) fail("index", "is required");
  if (require_output && !a.output.present()) fail("output", "is required");

  // 2. The index map fixes T and k. A flat [T * k] map is refused: it hides which routes belong to a token.
  if (a.index.ndim == 1)
    fail("index", "must be a 2-D [T, k] tensor, got a flat map of shape " + a.index.shape_string() +
                      " (reshape it to [T, k])");
  rank("index", a.index, 2, "[T, k]");
  const int64_t T = a.index.shape[0], k = a.index.shape[1];
  if (T < 1 || T > kMoeFinalizeMaxTokens)
    fail("index", "holds T = " + num(T) + " tokens: T must be in [1, " + num(kMoeFinalizeMaxTokens) + "]");
  if (k < 1 || k > kMoeFinalizeMaxRoutes)
    fail("index", "holds k = " + num(k) + " routes per token: k must be in [1, " + num(kMoeFinalizeMaxRoutes) + "]");
  dtype("index", a.index, DType::i32);

  // 3. The weights match the index map in shape; fp32 or bf16.
  if (a.weights.ndim != 2 || a.weights.shape[0] != T || a.weights.shape[1] != k)
    fail("weights", "must have the shape of index [T, k] = [" + num(T) + ", " + num(k) + "], got " +
                        a.weights.shape_string());
  if (a.weights.dtype != DType::f32 && a.weights.dtype != DType::bf16)
    fail("weights", std::string("must be float32 or bfloat16, got ") + dtype_name(a.weights.dtype));

  // 4. rows fixes D.
  rank("rows", a.rows, 2, "[R, D]");
  const int64_t R = a.rows.shape[0], D = a.rows.shape[1];
  if (D < kMoeFinalizeHiddenMultiple || D > kMoeFinalizeMaxHidden || D % kMoeFinalizeHiddenMultiple != 0)
    fail("rows", "hidden size D = " + num(D) + " must be a multiple of 8 in [8, " + num(kMoeFinalizeMaxHidden) + "]");
  dtype("rows", a.rows, DType::bf16);

  // 5. Optional inputs and the output.
  if (a.shared.present()) {
    shape2("shared", a.shared, T, D, "[T, D]");
    dtype("shared", a.shared, DType::bf16);
  }
  if (a.norm_weight.present()) {
    rank("norm_weight", a.norm_weight, 1, "[D]");
    if (a.norm_weight.shape[0] != D)
      fail("norm_weight", "must have shape [D] = [" + num(D) + "], got " + a.norm_weight.shape_string());
    dtype("norm_weight", a.norm_weight, DType::bf16);
  }
  if (a.output.present()) {
    shape2("output", a.output, T, D, "[T, D]");
    dtype("output", a.output, DType::bf16);
  }

  const std::vector<Named> inputs = {{"rows", &a.rows}, {"weights", &a.weights}, {"index", &a.index},
                                     {"shared", &a.shared}, {"norm_weight", &a.norm_weight}};

  // 6. One device for everything.
  const Device dev = a.rows.device;
  std::vector<Named> all = inputs;
  all.push_back({"output", &a.output});
  for (const Named& t : all)
    if (t.ref->present() && t.ref->device != dev)
      fail(t.name, "is on " + device_name(t.ref->device) + " but rows is on " + device_name(dev) +
                       " (all tensors must be on one device)");

  // 7. Layouts.
  strided_rows("rows", a.rows);
  if (R > 1 && a.rows.strides[0] % kMoeFinalizeHiddenMultiple != 0)
    fail("rows", "row stride " + num(a.rows.strides[0]) + " must be a multiple of 8 elements (16 bytes)");
  dense("weights", a.weights);
  dense("index", a.index);
  for (const Named& t : {Named{"shared", &a.shared}, Named{"norm_weight", &a.norm_weight}, Named{"output", &a.output}})
    if (t.ref->present()) strided_rows(t.name, *t.ref);
  for (const Named& t : all)
    if (t.ref->present()) naturally_aligned(t.name, *t.ref);

  // 8. Scalars.
  if (!std::isfinite(a.eps) || a.eps < 0) fail("eps", "must be finite and >= 0, got " + std::to_string(a.eps));
  if (!std::isfinite(a.scale)) fail("scale", "must be finite, got " + std::to_string(a.scale));

  // 9. The output aliases no input.
  if (a.output.present())
    for (const Named& in : inputs)
      if (in.ref->present() && detail::overlaps(a.output, *in.ref))
        fail("output", std::string("overlaps ") + in.name + " (the output must not alias an input)");

  // 10. Device-specific rules: 16-byte vectors on CUDA; the index scan where the data is host-readable.
  if (dev.type == DeviceType::cuda) {
    for (const Named& t : {Named{"rows", &a.rows}, Named{"shared", &a.shared}, Named{"norm_weight", &a.norm_weight},
                           Named{"output", &a.output}})
      aligned16(t.name, *t.ref);
  } else {
    scan_index(a.index, R);
  }
}

MoeFinalizeQuery moe_finalize_query(const MoeFinalizeArgs& a) {
  MoeFinalizeQuery q;
  q.tokens = a.index.shape[0];
  q.routes = a.index.shape[1];
  q.hidden = a.rows.shape[1];
  q.rows_dtype = a.rows.dtype;
  q.weights_dtype = a.weights.dtype;
  q.shared = a.shared.present();
  q.norm = a.norm_weight.present();
  return q;
}

}  // namespace attnres
