// The token-block single_cta's FP8 instances (cuda/attn_res_blocks.cuh): the modes with a trailing norm, both scale
// kinds, every instance N the bf16 instances have. A translation unit of their own, compiled alongside the
// launcher's.
#include "cuda/attn_res_blocks.cuh"

namespace attnres::detail {

namespace {

template <Fp8Mode F>
auto by_mode(Mode mode, int max_candidates) -> void (*)(PerTokenParams) {
  switch (mode) {
    case Mode::norm: return blocks_instance<Mode::norm, F>(max_candidates);
    case Mode::add: return blocks_instance<Mode::add, F>(max_candidates);
    case Mode::add2: return blocks_instance<Mode::add2, F>(max_candidates);
    default: return nullptr;  // attn_res has no normed output (validated)
  }
}

}  // namespace

auto blocks_fp8_instance(Mode mode, Fp8Scales fp8, int max_candidates) -> void (*)(PerTokenParams) {
  switch (fp8) {
    case Fp8Scales::per_token: return by_mode<Fp8Mode::per_token>(mode, max_candidates);
    case Fp8Scales::block128: return by_mode<Fp8Mode::block128>(mode, max_candidates);
    default: return nullptr;
  }
}

}  // namespace attnres::detail
