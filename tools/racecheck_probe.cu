// Does this compute-sanitizer racecheck order a cp.async.bulk write into shared memory before the reads that
// follow the mbarrier wait it completes? (docs/reliability.md section 4: racecheck reports every read of the
// persistent kernel's ring slots against the bulk copy that filled them.)
//
// One block, a two-slot ring: thread 0 refills a slot with a 4 KB bulk copy once every warp has released it
// (empty mbarrier, one arrive per warp), every thread waits for the slot's full mbarrier (complete_tx) and reads
// its element — the persistent kernel's protocol, reduced, through the library's own PTX wrappers.
//   racecheck_probe ordered   the correct protocol: a report here is the tool not modelling the ordering
//   racecheck_probe racy      the reads skip the full-barrier wait: racecheck must report (the probe's teeth)
// Exit 0 when the copied data is right (ordered) or whatever it reads (racy); the verdict is the sanitizer's.
// Built and run by tools/sanitize.sh (racecheck): nvcc -arch=sm_90 -lineinfo -I cpp/src tools/racecheck_probe.cu
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/attn_res_persistent.cuh"

// The kernel is in attnres::detail (mangled _ZN7attnres6detail15racecheck_probe...) so that the kernel filter
// tools/sanitize.sh gives racecheck, kns=7attnres6detail, selects it: the racy probe's report is then also the
// proof that the filter selects the library's kernels.
namespace attnres::detail::racecheck_probe {

constexpr int kThreads = 256;  // one int4 (16 bytes) per thread per round: 4 KB slots
constexpr int kRounds = 64;

__global__ void ring_probe(const int4* src, int4* dst, bool wait_full) {
  __shared__ alignas(128) int4 slot_data[2][kThreads];
  __shared__ alignas(8) uint64_t full[2], empty[2];
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      mbarrier_init(shared_address(&full[s]), 1);
      mbarrier_init(shared_address(&empty[s]), kThreads / 32);
    }
    fence_mbarrier_init_cluster();
  }
  __syncthreads();
  for (int r = 0; r < kRounds; ++r) {
    const int s = r & 1;
    const uint32_t phase = (r >> 1) & 1;
    if (tid == 0) {
      wait_parity(shared_address(&empty[s]), phase ^ 1u);  // a fresh barrier passes parity 1
      mbarrier_expect_tx(shared_address(&full[s]), sizeof(slot_data[s]));
      bulk_copy_to_shared(shared_address(&slot_data[s][0]), src + r * kThreads, sizeof(slot_data[s]),
                          shared_address(&full[s]));
    }
    if (wait_full) wait_parity(shared_address(&full[s]), phase);
    dst[r * kThreads + tid] = slot_data[s][tid];
    if (!wait_full) wait_parity(shared_address(&full[s]), phase);  // keep the phases in step
    __syncwarp();
    if (lane == 0) mbarrier_arrive(shared_address(&empty[s]));
  }
}

}  // namespace attnres::detail::racecheck_probe

namespace {

using attnres::detail::racecheck_probe::kRounds;
using attnres::detail::racecheck_probe::kThreads;
using attnres::detail::racecheck_probe::ring_probe;

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

}  // namespace

int main(int argc, char** argv) {
  const bool racy = argc > 1 && std::strcmp(argv[1], "racy") == 0;
  if (argc < 2 || (!racy && std::strcmp(argv[1], "ordered") != 0)) {
    std::fprintf(stderr, "usage: racecheck_probe ordered|racy\n");
    return 2;
  }
  const size_t n = static_cast<size_t>(kRounds) * kThreads;
  std::vector<int4> host(n), back(n);
  for (size_t i = 0; i < n; ++i) host[i] = make_int4(static_cast<int>(i), 1, 2, 3);
  int4 *src = nullptr, *dst = nullptr;
  if (!ok(cudaMalloc(&src, n * sizeof(int4)), "cudaMalloc") || !ok(cudaMalloc(&dst, n * sizeof(int4)), "cudaMalloc"))
    return 1;
  if (!ok(cudaMemcpy(src, host.data(), n * sizeof(int4), cudaMemcpyHostToDevice), "copy in")) return 1;
  ring_probe<<<1, kThreads>>>(src, dst, !racy);
  if (!ok(cudaGetLastError(), "launch") || !ok(cudaDeviceSynchronize(), "kernel")) return 1;
  if (!ok(cudaMemcpy(back.data(), dst, n * sizeof(int4), cudaMemcpyDeviceToHost), "copy out")) return 1;
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += back[i].x != host[i].x;
  std::printf("racecheck_probe %s: %zu of %zu elements differ from the source\n", argv[1], wrong, n);
  cudaFree(src);
  cudaFree(dst);
  return racy || wrong == 0 ? 0 : 1;
}
