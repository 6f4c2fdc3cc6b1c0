// The persistent kernel's attn_res instances (NORM = false: the mixture is the output, no FP8 epilogue), one and
// two blocks per SM. A translation unit of their own so that they compile in parallel with
// attn_res_persistent_launch.cu's normed instances.
#include "cuda/attn_res_persistent.cuh"

namespace attnres::detail {

namespace {

template <bool ADD>
PersistentKernel mix_by_vectors(int vectors, int blocks_per_sm) {
  if (blocks_per_sm == 1) {
    switch (vectors) {
      case 1: return attn_res_persistent_kernel<1, ADD, Fp8Mode::none, 1, false>;
      case 2: return attn_res_persistent_kernel<2, ADD, Fp8Mode::none, 1, false>;
      case 4: return attn_res_persistent_kernel<4, ADD, Fp8Mode::none, 1, false>;
      case 8: return attn_res_persistent_kernel<8, ADD, Fp8Mode::none, 1, false>;
      default: return nullptr;
    }
  }
  if (blocks_per_sm == 2) {  // no 8-vector bucket: H > 8192 takes more than kTwoBlocksMaxThreads threads
    switch (vectors) {
      case 1: return attn_res_persistent_kernel<1, ADD, Fp8Mode::none, 2, false>;
      case 2: return attn_res_persistent_kernel<2, ADD, Fp8Mode::none, 2, false>;
      case 4: return attn_res_persistent_kernel<4, ADD, Fp8Mode::none, 2, false>;
      default: return nullptr;
    }
  }
  return nullptr;
}

}  // namespace

PersistentKernel persistent_mix_instance(bool add, int vectors, int blocks_per_sm) {
  return add ? mix_by_vectors<true>(vectors, blocks_per_sm) : mix_by_vectors<false>(vectors, blocks_per_sm);
}

}  // namespace attnres::detail
