// The streaming single_cta's FP8 instances (cuda/attn_res_stream.cuh): the modes with a trailing norm, both
// scale kinds, every bucket and buffer count the bf16 instances have. A translation unit of their own, compiled
// alongside the launcher's.
#include "cuda/attn_res_stream.cuh"

namespace attnres::detail {

namespace {

template <Fp8Mode F>
auto by_mode(Mode mode, int max_candidates, int buffers) -> void (*)(PerTokenParams) {
  switch (mode) {
    case Mode::norm: return stream_instance<Mode::norm, F>(max_candidates, buffers);
    case Mode::add: return stream_instance<Mode::add, F>(max_candidates, buffers);
    case Mode::add2: return stream_instance<Mode::add2, F>(max_candidates, buffers);
    default: return nullptr;  // attn_res has no normed output (validated)
  }
}

}  // namespace

auto stream_fp8_instance(Mode mode, Fp8Scales fp8, int max_candidates, int buffers) -> void (*)(PerTokenParams) {
  switch (fp8) {
    case Fp8Scales::per_token: return by_mode<Fp8Mode::per_token>(mode, max_candidates, buffers);
    case Fp8Scales::block128: return by_mode<Fp8Mode::block128>(mode, max_candidates, buffers);
    default: return nullptr;
  }
}

}  // namespace attnres::detail
