// Preconditions of moe_finalize, checked for every backend before anything runs, in the order
// docs/ops/moe_finalize.md lists them. Messages: "moe_finalize: <argument> <rule>".
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attnres/error.hpp"
#include "attnres/moe_finalize.hpp"
#include "checks.hpp"
#include "layout.hpp"

namespace attnres {

namespace {

const detail::Checker check("moe_finalize");

[[noreturn]] void fail(const std::string& arg, const std::string& rule) { check.fail(arg, rule); }

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

void validate_moe_finalize(const MoeFinalizeArgs& a, bool require_output, bool read_data) {
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
  check.dtype("index", a.index, DType::i32);

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
  check.dtype("rows", a.rows, DType::bf16);

  // 5. Optional inputs and the output.
  if (a.shared.present()) {
    shape2("shared", a.shared, T, D, "[T, D]");
    check.dtype("shared", a.shared, DType::bf16);
  }
  if (a.norm_weight.present()) {
    rank("norm_weight", a.norm_weight, 1, "[D]");
    if (a.norm_weight.shape[0] != D)
      fail("norm_weight", "must have shape [D] = [" + num(D) + "], got " + a.norm_weight.shape_string());
    check.dtype("norm_weight", a.norm_weight, DType::bf16);
  }
  if (a.output.present()) {
    shape2("output", a.output, T, D, "[T, D]");
    check.dtype("output", a.output, DType::bf16);
  }

  const std::vector<Named> inputs = {{"rows", &a.rows}, {"weights", &a.weights}, {"index", &a.index},
                                     {"shared", &a.shared}, {"norm_weight", &a.norm_weight}};

  // 6. One device for everything.
  const Device dev = a.rows.device;
  std::vector<Named> all = inputs;
  all.push_back({"output", &a.output});
  for (const Named& t : all)
    if (t.ref->present()) check.device(t.name, *t.ref, dev, "rows");

  // 7. Layouts.
  check.layout("rows", a.rows);
  if (R > 1 && a.rows.strides[0] % kMoeFinalizeHiddenMultiple != 0)
    fail("rows", "row stride " + num(a.rows.strides[0]) + " must be a multiple of 8 elements (16 bytes)");
  dense("weights", a.weights);
  dense("index", a.index);
  for (const Named& t : {Named{"shared", &a.shared}, Named{"norm_weight", &a.norm_weight}, Named{"output", &a.output}})
    if (t.ref->present()) check.layout(t.name, *t.ref);
  for (const Named& t : all)
    if (t.ref->present()) naturally_aligned(t.name, *t.ref);

  // 8. Scalars.
  check.eps("eps", a.eps);
  check.finite("scale", a.scale);

  // 9. The output aliases no input.
  if (a.output.present())
    for (const Named& in : inputs)
      if (in.ref->present() && detail::overlaps(a.output, *in.ref))
        fail("output", std::string("overlaps ") + in.name + " (the output must not alias an input)");

  // 10. Device-specific rules: 16-byte vectors on CUDA; the index scan where the data is host-readable.
  if (dev.type == DeviceType::cuda) {
    for (const Named& t : {Named{"rows", &a.rows}, Named{"shared", &a.shared}, Named{"norm_weight", &a.norm_weight},
                           Named{"output", &a.output}})
      check.aligned16(t.name, *t.ref);
  } else if (read_data) {
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
