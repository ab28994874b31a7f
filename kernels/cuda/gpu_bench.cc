// GPU bandwidth of every codec, encode and decode, against a device-to-device
// cudaMemcpy on the same card. Prints a table (scripts/gpu-check.sh).
//
//   kvcache_gpu_bench [--blocks N] [--layers L] [--heads H] [--dim D]
//                     [--tokens T] [--reps R]
//
// Bandwidth counts the bytes a kernel must move: what it reads plus what it
// writes (fp16 in + encoded out for encode, the reverse for decode); the copy
// moves 2x its size. "of copy" is the codec's bandwidth over the copy's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/cuda/codec_cuda.h"
#include "kernels/half.h"

namespace kvcache::kernels::cuda {
namespace {

#define CHECK_CUDA(expr)                             \
  do {                                               \
    const cudaError_t err_ = (expr);                 \
    if (err_ != cudaSuccess) {                       \
      std::fprintf(stderr, "%s failed: %s\n", #expr, \
                   cudaGetErrorString(err_));        \
      std::exit(1);                                  \
    }                                                \
  } while (0)

struct Options {
  uint32_t blocks = 512, layers = 32, heads = 8, dim = 128, tokens = 32;
  int reps = 10;
};

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const long v = std::strtol(argv[i + 1], nullptr, 10);
    if (flag == "--blocks")
      o.blocks = static_cast<uint32_t>(v);
    else if (flag == "--layers")
      o.layers = static_cast<uint32_t>(v);
    else if (flag == "--heads")
      o.heads = static_cast<uint32_t>(v);
    else if (flag == "--dim")
      o.dim = static_cast<uint32_t>(v);
    else if (flag == "--tokens")
      o.tokens = static_cast<uint32_t>(v);
    else if (flag == "--reps")
      o.reps = static_cast<int>(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return o;
}

// Best time in seconds of `reps` runs of fn, timed with events on stream 0.
template <typename Fn>
double BestSeconds(int reps, Fn fn) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  fn();  // warm up
  float best = 1e30f;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(start, nullptr));
    fn();
    CHECK_CUDA(cudaEventRecord(stop, nullptr));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best / 1e3;
}

int Main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  if (!CudaAvailable()) {
    std::printf("no CUDA device: nothing to measure\n");
    return 0;
  }
  const BlockShape shape{o.layers, o.heads, o.dim, o.tokens};
  const size_t in_bytes = Fp16BlockBytes(shape);
  std::printf("device: %s\n", CudaDeviceDescription().c_str());
  std::printf(
      "block: L=%u H=%u D=%u T=%u (%.2f MiB fp16), batch %u blocks "
      "(%.2f GiB fp16)\n",
      o.layers, o.heads, o.dim, o.tokens, in_bytes / 1048576.0, o.blocks,
      in_bytes * double(o.blocks) / (1u << 30));

  // One contiguous fp16 batch with N(0,1) data.
  std::vector<uint16_t> host(in_bytes / 2);
  std::mt19937 rng(1);
  std::normal_distribution<float> gauss;
  for (auto& x : host) x = HalfFromFloat(gauss(rng));
  uint16_t* d_in = nullptr;
  uint16_t* d_out16 = nullptr;
  CHECK_CUDA(cudaMalloc(&d_in, in_bytes * o.blocks));
  CHECK_CUDA(cudaMalloc(&d_out16, in_bytes * o.blocks));
  for (uint32_t b = 0; b < o.blocks; ++b) {
    CHECK_CUDA(cudaMemcpy(reinterpret_cast<uint8_t*>(d_in) + b * in_bytes,
                          host.data(), in_bytes, cudaMemcpyHostToDevice));
  }

  const double copy_s = BestSeconds(o.reps, [&] {
    CHECK_CUDA(cudaMemcpyAsync(d_out16, d_in, in_bytes * o.blocks,
                               cudaMemcpyDeviceToDevice, nullptr));
  });
  const double copy_bw = 2.0 * in_bytes * o.blocks / copy_s;
  std::printf(
      "\ndevice-to-device cudaMemcpy: %.3f ms, %.1f GB/s "
      "(read + write)\n\n",
      copy_s * 1e3, copy_bw / 1e9);
  std::printf(
      "| codec    | op     | time ms | GB/s moved | of copy | fp16 "
      "GB/s |\n");
  std::printf(
      "|----------|--------|---------|------------|---------|------"
      "-----|\n");
  for (Codec c : kAllCodecs) {
    CodecPolicy p;
    p.codec = c;
    const size_t enc_bytes = EncodedBlockBytes(shape, p);
    uint8_t* d_enc = nullptr;
    CHECK_CUDA(cudaMalloc(&d_enc, enc_bytes * o.blocks));
    std::vector<const uint16_t*> ins;
    std::vector<uint16_t*> outs16;
    std::vector<uint8_t*> encs;
    std::vector<const uint8_t*> encs_const;
    for (uint32_t b = 0; b < o.blocks; ++b) {
      ins.push_back(d_in + b * (in_bytes / 2));
      outs16.push_back(d_out16 + b * (in_bytes / 2));
      encs.push_back(d_enc + b * enc_bytes);
      encs_const.push_back(d_enc + b * enc_bytes);
    }
    bool ok = true;
    const double enc_s = BestSeconds(
        o.reps, [&] { ok = ok && EncodeBlocksCuda(shape, p, ins, encs).ok(); });
    const double dec_s = BestSeconds(o.reps, [&] {
      ok = ok && DecodeBlocksCuda(shape, p, encs_const, outs16).ok();
    });
    if (!ok) {
      std::printf("%s: codec call failed\n", std::string(CodecName(c)).c_str());
      return 1;
    }
    const double moved = double(in_bytes + enc_bytes) * o.blocks;
    for (int op = 0; op < 2; ++op) {
      const double s = op == 0 ? enc_s : dec_s;
      std::printf("| %-8s | %-6s | %7.3f | %10.1f | %6.1f%% | %9.1f |\n",
                  std::string(CodecName(c)).c_str(),
                  op == 0 ? "encode" : "decode", s * 1e3, moved / s / 1e9,
                  100.0 * (moved / s) / copy_bw,
                  double(in_bytes) * o.blocks / s / 1e9);
    }
    cudaFree(d_enc);
  }
  cudaFree(d_in);
  cudaFree(d_out16);
  return 0;
}

}  // namespace
}  // namespace kvcache::kernels::cuda

int main(int argc, char** argv) {
  return kvcache::kernels::cuda::Main(argc, argv);
}
