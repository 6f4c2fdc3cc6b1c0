// The CUDA half of the consumer (built only when attnres was built with its CUDA backend: attnres_WITH_CUDA):
// the same attn_res_add_rmsnorm call as main.cpp, on device pointers, enqueued on the caller's cudaStream_t.
// The library never allocates, copies or synchronises: the caller owns the buffers and the stream.
#include <attnres/attnres.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

}  // namespace

int run_on_cuda(int64_t T, int64_t K, int64_t H, const std::vector<const std::vector<uint16_t>*>& inputs,
                std::vector<uint16_t>& updated, std::vector<uint16_t>& output, bool& ran) {
  using namespace attnres;
  ran = false;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device: the CUDA call is skipped\n");
    return 0;
  }
  cudaDeviceProp prop{};
  if (!ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties")) return 1;
  if (prop.major < 9) {
    std::printf("CUDA device 0 has compute capability %d.%d < 9.0: the CUDA call is skipped\n", prop.major,
                prop.minor);
    return 0;
  }
  if (!ok(cudaSetDevice(0), "cudaSetDevice")) return 1;

  // Device copies of prefix, add, bank, res_weight, rms_weight, norm_weight; then updated and output.
  std::vector<void*> buffers;
  auto alloc = [&](size_t elements) -> uint16_t* {
    void* p = nullptr;
    if (!ok(cudaMalloc(&p, elements * sizeof(uint16_t)), "cudaMalloc")) return nullptr;
    buffers.push_back(p);
    return static_cast<uint16_t*>(p);
  };
  auto release = [&] {
    for (void* p : buffers) cudaFree(p);
  };
  cudaStream_t stream = nullptr;
  if (!ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate")) return 1;

  int rc = 1;
  std::vector<uint16_t*> d_in;
  for (const auto* v : inputs) {
    uint16_t* d = alloc(v->size());
    if (d == nullptr ||
        !ok(cudaMemcpyAsync(d, v->data(), v->size() * sizeof(uint16_t), cudaMemcpyHostToDevice, stream), "copy in"))
      goto done;
    d_in.push_back(d);
  }
  {
    uint16_t* d_updated = alloc(T * H);
    uint16_t* d_output = alloc(T * H);
    if (d_updated == nullptr || d_output == nullptr) goto done;

    const Device gpu{DeviceType::cuda, 0};
    AttnResArgs args;
    args.layer_residual = make_ref(d_in[0], DType::bf16, gpu, {T, H});
    args.layer_residual_add = make_ref(d_in[1], DType::bf16, gpu, {T, H});
    args.block_residual = make_ref(d_in[2], DType::bf16, gpu, {K, T, H});
    args.res_weight = make_ref(d_in[3], DType::bf16, gpu, {H});
    args.rms_weight = make_ref(d_in[4], DType::bf16, gpu, {H});
    args.norm_weight = make_ref(d_in[5], DType::bf16, gpu, {H});
    args.updated = make_ref(d_updated, DType::bf16, gpu, {T, H});
    args.output = make_ref(d_output, DType::bf16, gpu, {T, H});
    args.stream = stream;  // the caller's cudaStream_t: the kernel is enqueued there, nothing synchronises
    try {
      const Plan plan = attnres::plan(AttnResOp::attn_res_add_rmsnorm, args);
      std::printf("attnres on %s: kernel %s\n", prop.name, kernel_name(plan.kernel));
      attn_res_add_rmsnorm(args);
    } catch (const Error& e) {
      std::fprintf(stderr, "attnres error (cuda): %s\n", e.what());
      goto done;
    }
    if (!ok(cudaMemcpyAsync(updated.data(), d_updated, T * H * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream),
            "copy out") ||
        !ok(cudaMemcpyAsync(output.data(), d_output, T * H * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream),
            "copy out") ||
        !ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize"))
      goto done;
    ran = true;
    rc = 0;
  }
done:
  release();
  cudaStreamDestroy(stream);
  return rc;
}
