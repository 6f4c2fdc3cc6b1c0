// Preconditions of the attention-residual ops, checked in one place for every backend, before anything
// runs. Messages: "<op>: <argument> <rule>" (docs/ops/*.md lists each one with its test).
#include <array>
#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>

#include "attnres/attn_res.hpp"
#include "attnres/error.hpp"
#include "checks.hpp"
#include "layout.hpp"

namespace attnres {

namespace {

enum class Use { refused, optional, required };

struct OpTable {
  Use add, add2, norm_weight, updated, mixture, diagnostics, snapshot;
};

OpTable op_table(AttnResOp op) {
  switch (op) {
    case AttnResOp::attn_res:
      // updated is required exactly when the add is given (checked below).
      return {Use::optional, Use::optional, Use::refused, Use::optional, Use::refused, Use::optional,
              Use::optional};
    case AttnResOp::attn_res_rmsnorm:
      return {Use::refused, Use::refused, Use::required, Use::refused, Use::optional, Use::refused,
              Use::optional};
    case AttnResOp::attn_res_add_rmsnorm:
      return {Use::required, Use::optional, Use::required, Use::required, Use::optional, Use::refused,
              Use::optional};
    case AttnResOp::attn_res_add_rmsnorm_persistent:
      // updated is required exactly when the add is given (checked below).
      return {Use::optional, Use::refused, Use::required, Use::optional, Use::refused, Use::refused,
              Use::refused};
  }
  throw ArgumentError("attnres: unknown op " + std::to_string(static_cast<int>(op)));
}

// The attention-residual rules on top of the shared checks.
class Checker : public detail::Checker {
 public:
  explicit Checker(AttnResOp op) : detail::Checker(op_name(op)) {}

  void presence(const char* arg, const TensorRef& t, Use use, bool require_outputs = true) const {
    if (use == Use::refused && t.present()) fail(arg, "is not an argument of this op");
    if (use == Use::required && !t.present() && require_outputs) fail(arg, "is required");
  }

  // Rank and exact shape; `want` entries < 0 match anything.
  void shape(const char* arg, const TensorRef& t, std::initializer_list<int64_t> want, const char* pattern) const {
    if (t.ndim != static_cast<int>(want.size()))
      fail(arg, "must be a " + std::to_string(want.size()) + "-D " + pattern + " tensor, got " +
                    std::to_string(t.ndim) + " dimensions " + t.shape_string());
    int i = 0;
    for (const int64_t w : want) {
      if (w >= 0 && t.shape[i] != w)
        fail(arg, std::string("must have shape ") + pattern + " = " + expected(want) + ", got " + t.shape_string());
      ++i;
    }
  }

 private:
  static std::string expected(std::initializer_list<int64_t> want) {
    std::string s = "[";
    for (const int64_t w : want) s += (s.size() > 1 ? ", " : "") + (w < 0 ? std::string("*") : std::to_string(w));
    return s + "]";
  }
};

struct Named {
  const char* name;
  const TensorRef* ref;
};

int64_t round_up4(int64_t v) { return (v + 3) / 4 * 4; }

// Two references to the very same elements: one pointer, dtype, shape and strides.
bool same_view(const TensorRef& a, const TensorRef& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i] || a.strides[i] != b.strides[i]) return false;
  return true;
}

// The FP8 output and its scales (docs/ops/attn_res_rmsnorm.md, "FP8 output"). Runs after the shape checks
// (T, H known); the shared device, aliasing and alignment checks include the two tensors.
void validate_fp8(const Checker& c, AttnResOp op, const AttnResArgs& a, int64_t T, int64_t H, bool require_outputs) {
  const int mode = static_cast<int>(a.fp8);
  if (mode < 0 || mode > 2)
    c.fail("fp8", "must be none (0), per_token (1) or block128 (2), got " + std::to_string(mode));
  (void)op;  // attn_res was refused before the shape checks
  if (a.fp8 == Fp8Scales::none) {
    if (a.fp8_pow2_scales) c.fail("fp8_pow2_scales", "requires fp8 = per_token or block128");
    if (a.output_fp8.present()) c.fail("output_fp8", "requires fp8 = per_token or block128");
    if (a.fp8_scales.present()) c.fail("fp8_scales", "requires fp8 = per_token or block128");
    return;
  }
  if (a.fp8 == Fp8Scales::block128 && H % kFp8GroupSize != 0)
    c.fail("fp8", "= block128 needs the hidden size H to be a multiple of 128, got H = " + std::to_string(H));
  if (!a.output_fp8.present() || !a.fp8_scales.present()) {
    if (!require_outputs) return;
    c.fail(a.output_fp8.present() ? "fp8_scales" : "output_fp8", std::string("is required with fp8 = ") +
                                                                     fp8_scales_name(a.fp8));
  }
  const TensorRef& q = a.output_fp8;
  c.shape("output_fp8", q, {T, H}, "[T, H]");
  c.dtype("output_fp8", q, DType::e4m3);
  c.layout("output_fp8", q);

  const TensorRef& s = a.fp8_scales;
  const int64_t groups = a.fp8 == Fp8Scales::per_token ? 1 : H / kFp8GroupSize;
  c.shape("fp8_scales", s, {T, groups}, a.fp8 == Fp8Scales::per_token ? "[T, 1]" : "[T, H / 128]");
  c.dtype("fp8_scales", s, DType::f32);
  for (int i = 0; i < 2; ++i)
    if (s.strides[i] < 0) c.fail("fp8_scales", "has a negative stride " + s.strides_string());
  if (a.fp8 == Fp8Scales::block128) {
    // DeepGEMM's Hopper FP8 GEMMs read the scales MN-major with a TMA-aligned (16-byte) column stride.
    const bool ok = (T == 1 || s.strides[0] == 1) && (groups == 1 || s.strides[1] == round_up4(T));
    if (!ok)
      c.fail("fp8_scales", "must be column-major over tokens with the token stride padded to a multiple of 4 "
                           "(strides [1, " + std::to_string(round_up4(T)) + "] for T = " + std::to_string(T) +
                           "), got strides " + s.strides_string());
  }
  if (!detail::non_overlapping(s))
    c.fail("fp8_scales", "has an overlapping layout (strides " + s.strides_string() + ")");
  if (s.data == nullptr) c.fail("fp8_scales", "has a null data pointer");
  if (reinterpret_cast<uintptr_t>(s.data) % 4 != 0) c.fail("fp8_scales", "must be 4-byte aligned");
}

}  // namespace

void validate(AttnResOp op, const AttnResArgs& a, bool require_outputs) {
  const OpTable use = op_table(op);
  const Checker c(op);

  // 1. Which arguments the op takes.
  if (a.layer_residual_add2.present() && !a.layer_residual_add.present())
    c.fail("layer_residual_add2", "requires layer_residual_add");
  c.presence("layer_residual", a.layer_residual, Use::required);
  c.presence("layer_residual_add", a.layer_residual_add, use.add);
  c.presence("layer_residual_add2", a.layer_residual_add2, use.add2);
  c.presence("block_residual", a.block_residual, Use::required);
  c.presence("res_weight", a.res_weight, Use::required);
  c.presence("rms_weight", a.rms_weight, Use::required);
  c.presence("norm_weight", a.norm_weight, use.norm_weight);
  // The normed ops' FP8-only call leaves `output` out: only the codes and scales are written.
  const bool fp8_only_allowed = op != AttnResOp::attn_res && a.fp8 != Fp8Scales::none;
  if (!a.output.present() && require_outputs && !fp8_only_allowed) {
    if (op == AttnResOp::attn_res) c.fail("output", "is required");
    c.fail("output", "is required (only an FP8 call may leave it out: fp8_only)");
  }
  const bool has_add = a.layer_residual_add.present();
  // Where the addend is optional, `updated` is required exactly with it.
  const bool add_optional = use.add == Use::optional;
  const Use updated_use = add_optional ? (has_add ? Use::required : Use::refused) : use.updated;
  if (add_optional && !has_add && a.updated.present()) c.fail("updated", "is only produced with layer_residual_add");
  c.presence("updated", a.updated, updated_use, require_outputs);
  c.presence("mixture", a.mixture, use.mixture);
  c.presence("rsigma", a.rsigma, use.diagnostics);
  c.presence("probs", a.probs, use.diagnostics);
  c.presence("logits", a.logits, use.diagnostics);
  if (a.snapshot_slot != -1 && use.snapshot == Use::refused)
    c.fail("snapshot_slot", "is not an argument of this op");
  if (op == AttnResOp::attn_res &&
      (a.fp8 != Fp8Scales::none || a.fp8_pow2_scales || a.output_fp8.present() || a.fp8_scales.present()))
    c.fail("fp8", "is not an argument of this op: attn_res has no normed output to quantize (use attn_res_rmsnorm)");

  // 2. Ranks and sizes: T and H come from layer_residual, K from block_residual.
  const TensorRef& lr = a.layer_residual;
  c.shape("layer_residual", lr, {-1, -1}, "[T, H]");
  const int64_t T = lr.shape[0], H = lr.shape[1];
  if (T < 1) c.fail("layer_residual", "must hold T >= 1 tokens, got shape " + lr.shape_string());
  if (H < kHiddenMultiple || H > kMaxHidden || H % kHiddenMultiple != 0)
    c.fail("layer_residual", "hidden size H = " + std::to_string(H) + " must be a multiple of 8 in [8, " +
                                 std::to_string(kMaxHidden) + "]");
  c.shape("block_residual", a.block_residual, {-1, T, H}, "[K, T, H]");
  const int64_t K = a.block_residual.shape[0];
  const int64_t N = K + 1;
  if (N > kMaxCandidates)
    c.fail("block_residual", "holds K = " + std::to_string(K) + " snapshots: N = K + 1 must be in [1, " +
                                 std::to_string(kMaxCandidates) + "]");

  const std::array<Named, 7> inputs = {{{"layer_residual", &a.layer_residual},
                               {"layer_residual_add", &a.layer_residual_add},
                               {"layer_residual_add2", &a.layer_residual_add2},
                               {"block_residual", &a.block_residual},
                               {"res_weight", &a.res_weight},
                               {"rms_weight", &a.rms_weight},
                               {"norm_weight", &a.norm_weight}}};
  const std::array<Named, 6> outputs = {{{"output", &a.output},   {"updated", &a.updated}, {"mixture", &a.mixture},
                                         {"rsigma", &a.rsigma},   {"probs", &a.probs},     {"logits", &a.logits}}};

  for (const Named& in : {inputs[1], inputs[2]})
    if (in.ref->present()) c.shape(in.name, *in.ref, {T, H}, "[T, H]");
  for (const Named& w : {inputs[4], inputs[5], inputs[6]}) {
    if (!w.ref->present()) continue;
    if (w.ref->ndim == 2 && w.ref->shape[0] == 1)
      c.shape(w.name, *w.ref, {1, H}, "[1, H]");
    else
      c.shape(w.name, *w.ref, {H}, "[H]");
  }
  for (int i = 0; i < 3; ++i)
    if (outputs[i].ref->present()) c.shape(outputs[i].name, *outputs[i].ref, {T, H}, "[T, H]");
  for (int i = 3; i < 6; ++i)
    if (outputs[i].ref->present()) c.shape(outputs[i].name, *outputs[i].ref, {N, T}, "[N, T]");

  validate_fp8(c, op, a, T, H, require_outputs);

  // 3. Dtypes.
  for (const Named& in : inputs)
    if (in.ref->present()) c.dtype(in.name, *in.ref, DType::bf16);
  for (int i = 0; i < 3; ++i)
    if (outputs[i].ref->present()) c.dtype(outputs[i].name, *outputs[i].ref, DType::bf16);
  for (int i = 3; i < 6; ++i)
    if (outputs[i].ref->present()) c.dtype(outputs[i].name, *outputs[i].ref, DType::f32);

  // 4. One device for everything.
  const Device dev = lr.device;
  for (const Named& t : {Named{"output_fp8", &a.output_fp8}, Named{"fp8_scales", &a.fp8_scales}})
    if (t.ref->present()) c.device(t.name, *t.ref, dev, "layer_residual");
  for (const Named& t : inputs)
    if (t.ref->present()) c.device(t.name, *t.ref, dev, "layer_residual");
  for (const Named& t : outputs)
    if (t.ref->present()) c.device(t.name, *t.ref, dev, "layer_residual");

  // 5. Layouts: innermost stride 1, non-negative strides, no element shared by two indices.
  for (const Named& t : inputs)
    if (t.ref->present()) c.layout(t.name, *t.ref);
  for (const Named& t : outputs)
    if (t.ref->present()) c.layout(t.name, *t.ref);

  // 6. Scalars.
  c.eps("rms_eps", a.rms_eps);
  if (use.norm_weight != Use::refused) c.eps("norm_eps", a.norm_eps);

  // 7. The snapshot row: outside the candidates, inside a non-overlapping bank layout.
  TensorRef snapshot_rows;
  if (a.snapshot_slot != -1) {
    if (a.snapshot_slot < 0)
      c.fail("snapshot_slot", "must be -1 (no snapshot) or a row index >= K, got " + std::to_string(a.snapshot_slot));
    if (a.snapshot_slot < K)
      c.fail("snapshot_slot", std::to_string(a.snapshot_slot) + " is a candidate of this call (must be >= K = " +
                                  std::to_string(K) + ")");
    if (a.snapshot_slot > (int64_t{1} << 30)) c.fail("snapshot_slot", "is out of range");
    if (a.block_residual.data == nullptr) c.fail("snapshot_slot", "needs a block_residual data pointer");
    TensorRef bank = a.block_residual;
    bank.shape[0] = a.snapshot_slot + 1;
    if (!detail::non_overlapping(bank))
      c.fail("snapshot_slot", std::to_string(a.snapshot_slot) +
                                  " would overlap the candidate rows of block_residual (strides " +
                                  a.block_residual.strides_string() + ")");
    snapshot_rows = detail::snapshot_rows(a.block_residual, a.snapshot_slot);
  }

  // 8. Outputs (and the snapshot row) alias neither inputs nor each other. One exception: `updated` may be
  // layer_residual itself (the same view: pointer, dtype, shape and strides), the in-place prefix update; every
  // kernel reads a token's prefix before it writes that token's updated row, and no other thread reads it.
  // Any partial overlap stays refused.
  const bool in_place = a.updated.present() && same_view(a.updated, a.layer_residual);
  // Each view's byte range once; the pairs below compare ranges (the rules and their order as in the messages).
  struct Span {
    const char* name;
    const TensorRef* ref;
    uintptr_t lo = 0, hi = 0;
  };
  std::array<Span, 9> written{};
  size_t num_written = 0;
  for (const Named& t : outputs) written[num_written++] = {t.name, t.ref};
  if (snapshot_rows.present()) written[num_written++] = {"snapshot row", &snapshot_rows};
  written[num_written++] = {"output_fp8", &a.output_fp8};
  written[num_written++] = {"fp8_scales", &a.fp8_scales};
  std::array<Span, 7> read{};
  for (size_t i = 0; i < inputs.size(); ++i) read[i] = {inputs[i].name, inputs[i].ref};
  for (size_t i = 0; i < num_written; ++i)
    if (written[i].ref->present()) written[i].ref->byte_range(written[i].lo, written[i].hi);
  for (Span& t : read)
    if (t.ref->present()) t.ref->byte_range(t.lo, t.hi);
  const auto overlap = [](const Span& x, const Span& y) { return detail::ranges_overlap(x.lo, x.hi, y.lo, y.hi); };
  for (size_t i = 0; i < num_written; ++i) {
    const Span& w = written[i];
    if (!w.ref->present()) continue;
    for (const Span& in : read) {
      if (!in.ref->present()) continue;
      if (w.ref == &snapshot_rows && in.ref == &a.block_residual) continue;  // checked in 7
      if (in_place && w.ref == &a.updated && in.ref == &a.layer_residual) continue;
      if (overlap(w, in)) c.fail(w.name, std::string("overlaps ") + in.name + " (outputs must not alias inputs)");
    }
    for (size_t j = 0; j < i; ++j)
      if (written[j].ref->present() && overlap(w, written[j]))
        c.fail(w.name, std::string("overlaps ") + written[j].name + " (outputs must not alias each other)");
  }

  // 9. Kernel layout rules on CUDA: every bf16 tensor is read or written in 16-byte vectors.
  if (dev.type == DeviceType::cuda) {
    for (const Named& in : inputs) c.aligned16(in.name, *in.ref);
    for (int i = 0; i < 3; ++i) c.aligned16(outputs[i].name, *outputs[i].ref);
    if (snapshot_rows.present()) c.aligned16("snapshot row", snapshot_rows);
    // Each thread stores its 8 codes as one 8-byte word.
    const TensorRef& q = a.output_fp8;
    if (q.present() && q.numel() > 0 &&
        (reinterpret_cast<uintptr_t>(q.data) % 8 != 0 || (q.shape[0] > 1 && q.strides[0] % 8 != 0)))
      c.fail("output_fp8", "must be 8-byte aligned for the CUDA kernels (base pointer and token stride a "
                           "multiple of 8 bytes), got strides " + q.strides_string());
  }
}

PlanQuery plan_query(AttnResOp op, const AttnResArgs& a) {
  PlanQuery q;
  q.op = op;
  q.tokens = a.layer_residual.shape[0];
  q.hidden = a.layer_residual.shape[1];
  q.candidates = a.block_residual.shape[0] + 1;
  q.add = a.layer_residual_add.present();
  q.add2 = a.layer_residual_add2.present();
  q.tap = a.mixture.present();
  q.snapshot = a.snapshot_slot != -1;
  q.diagnostics = a.rsigma.present() || a.probs.present() || a.logits.present();
  q.fp8 = a.fp8;
  q.fp8_pow2_scales = a.fp8_pow2_scales;
  return q;
}

}  // namespace attnres
