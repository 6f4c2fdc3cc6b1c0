// split_k's bf16 cluster instances for every exact N (tuning::split_k_exact) of the modes
// without an addend (attn_res, attn_res_rmsnorm).
// One translation unit per pair of modes, so the exact instances compile in parallel.
#include "cuda/attn_res_per_token.cuh"

namespace attnres::detail {

template PerTokenKernel exact_instance<Mode::mix, Fp8Mode::none>(int);
template PerTokenKernel exact_instance<Mode::norm, Fp8Mode::none>(int);

}  // namespace attnres::detail
