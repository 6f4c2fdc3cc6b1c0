// The persistent kernel's attn_res instances (NORM = false: the mixture is the output, no FP8 epilogue), 0, 1 or 2
// addends, one and two blocks per SM. A translation unit of their own so that they compile in parallel with
// attn_res_persistent_launch.cu's normed instances.
#include "cuda/attn_res_persistent.cuh"

namespace attnres::detail {

namespace {

template <int BLOCKS_PER_SM>
PersistentKernel by_adds(int adds, int vectors) {
  switch (adds) {
    case 0: return persistent_instance<0, Fp8Mode::none, BLOCKS_PER_SM, false>(vectors);
    case 1: return persistent_instance<1, Fp8Mode::none, BLOCKS_PER_SM, false>(vectors);
    case 2: return persistent_instance<2, Fp8Mode::none, BLOCKS_PER_SM, false>(vectors);
    default: return nullptr;
  }
}

}  // namespace

PersistentKernel persistent_mix_instance(int adds, int vectors, int blocks_per_sm) {
  switch (blocks_per_sm) {
    case 1: return by_adds<1>(adds, vectors);
    case 2: return by_adds<2>(adds, vectors);
    default: return nullptr;
  }
}

}  // namespace attnres::detail
