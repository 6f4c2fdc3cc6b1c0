// Experiment hook of the token-block single_cta (cuda/attn_res_blocks.cuh): ATTNRES_X_BLOCKS=S:B[:all] (vectors
// per thread : blocks per SM) replaces the single_cta (with :all also split_k) launches of a bf16 call at H = 7168, N <= 4 with
// one block per token. Not a plan route: the A/B against the planned kernels decides whether it becomes one.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "backend.hpp"
#include "cuda/attn_res_blocks.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch_utils.hpp"

namespace attnres::detail {

namespace {

using KernelFn = void (*)(PerTokenParams);
constexpr int kC = 7;  // split_k_cluster(7168)

template <int NMAX, int S, int B>
KernelFn blocks_by_mode(Mode mode) {
  switch (mode) {
    case Mode::mix: return attn_res_blocks_kernel<NMAX, Mode::mix, kC, S, B>;
    case Mode::norm: return attn_res_blocks_kernel<NMAX, Mode::norm, kC, S, B>;
    case Mode::add: return attn_res_blocks_kernel<NMAX, Mode::add, kC, S, B>;
    case Mode::add2: return attn_res_blocks_kernel<NMAX, Mode::add2, kC, S, B>;
    case Mode::mix_add: return attn_res_blocks_kernel<NMAX, Mode::mix_add, kC, S, B>;
    case Mode::mix_add2: return attn_res_blocks_kernel<NMAX, Mode::mix_add2, kC, S, B>;
  }
  return nullptr;
}

KernelFn blocks_instance(int S, int B, int nmax, Mode mode) {
  if (nmax == 2) {
    if (S == 7 && B == 4) return blocks_by_mode<2, 7, 4>(mode);
    if (S == 7 && B == 3) return blocks_by_mode<2, 7, 3>(mode);
    if (S == 4 && B == 2) return blocks_by_mode<2, 4, 2>(mode);
    if (S == 4 && B == 3) return blocks_by_mode<2, 4, 3>(mode);
  }
  if (nmax == 4) {
    if (S == 4 && B == 2) return blocks_by_mode<4, 4, 2>(mode);
  }
  return nullptr;
}

}  // namespace

bool try_attn_res_blocks(AttnResOp op, const AttnResArgs& a, const Plan& plan) {
  const char* env = std::getenv("ATTNRES_X_BLOCKS");
  if (env == nullptr || *env == '\0' || a.fp8 != Fp8Scales::none) return false;
  const char* colon = std::strchr(env, ':');
  if (colon == nullptr) return false;
  const int S = std::atoi(env), B = std::atoi(colon + 1);
  // S:B replaces single_cta launches only (split_k stays the reference); S:B:all every per-token launch.
  const bool all = std::strstr(colon + 1, ":all") != nullptr;
  const int64_t H = a.layer_residual.shape[1];
  if (H != 7168 || plan.kernel == KernelKind::persistent || (!all && plan.kernel != KernelKind::single_cta))
    return false;
  PerTokenParams params = make_per_token_params(a, plan);
  params.chunk = tuning::split_k_chunk(H);
  const int N = params.snapshots + 1;
  if (N > 4) return false;
  const KernelFn kernel = blocks_instance(S, B, N <= 2 ? 2 : 4, mode_of(op, a));
  if (kernel == nullptr) return false;
  DeviceGuard guard(a.layer_residual.device.index);
  launch_kernel(kernel, params, dim3(static_cast<unsigned>(params.tokens)),
                dim3(static_cast<unsigned>(kChunkThreads * ((kC + S - 1) / S))), 0,
                static_cast<cudaStream_t>(a.stream), 1, plan.pdl, "attn_res token-block kernel launch");
  return true;
}

}  // namespace attnres::detail
