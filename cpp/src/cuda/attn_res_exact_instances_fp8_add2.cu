// split_k's cluster instances with the FP8 epilogue (per_token, block128) for every exact N
// (tuning::split_k_exact) of attn_res_add_rmsnorm with two addends.
// One translation unit per mode, so the exact instances compile in parallel.
#include "cuda/attn_res_per_token.cuh"

namespace attnres::detail {

template PerTokenKernel exact_instance<Mode::add2, Fp8Mode::per_token>(int);
template PerTokenKernel exact_instance<Mode::add2, Fp8Mode::block128>(int);

}  // namespace attnres::detail
