// The persistent kernel's attn_res instances (NORM = false: the mixture is the output, no FP8 epilogue), one and
// two blocks per SM. A translation unit of their own so that they compile in parallel with
// attn_res_persistent_launch.cu's normed instances.
#include "cuda/attn_res_persistent.cuh"

namespace attnres::detail {

PersistentKernel persistent_mix_instance(bool add, int vectors, int blocks_per_sm) {
  switch (blocks_per_sm) {
    case 1: return add ? persistent_instance<true, Fp8Mode::none, 1, false>(vectors)
                       : persistent_instance<false, Fp8Mode::none, 1, false>(vectors);
    case 2: return add ? persistent_instance<true, Fp8Mode::none, 2, false>(vectors)
                       : persistent_instance<false, Fp8Mode::none, 2, false>(vectors);
    default: return nullptr;
  }
}

}  // namespace attnres::detail
