// The per-token kernel's instances of attn_res with addends (modes mix_add and mix_add2: the mixture of the
// updated prefix, bf16, no trailing norm, the fp32 diagnostics optional), for split_k clusters and one-block
// launches. A translation unit of their own so that they compile in parallel with attn_res_launch.cu's.
#include "cuda/attn_res_per_token.cuh"

namespace attnres::detail {

PerTokenKernel mix_add_instance(Mode mode, bool cluster, int max_candidates) {
  switch (mode) {
    case Mode::mix_add:
      return cluster ? per_token_instance<Mode::mix_add, true, Fp8Mode::none>(max_candidates)
                     : per_token_instance<Mode::mix_add, false, Fp8Mode::none>(max_candidates);
    case Mode::mix_add2:
      return cluster ? per_token_instance<Mode::mix_add2, true, Fp8Mode::none>(max_candidates)
                     : per_token_instance<Mode::mix_add2, false, Fp8Mode::none>(max_candidates);
    default: return nullptr;
  }
}

}  // namespace attnres::detail
