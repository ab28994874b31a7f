// GPU bandwidth of every codec, encode and decode, against a device-to-device
// cudaMemcpy on the same card. Prints a table (scripts/gpu-check.sh).
//
//   kvcache_gpu_bench [--blocks N] [--layers L] [--heads H] [--dim D]
//                     [--tokens T] [--reps R]
//   kvcache_gpu_bench --probe      # exit 0 when CUDA reaches a device, else
//                                  # 3 with CUDA's reason
//
// Bandwidth counts the bytes a kernel must move: what it reads plus what it
// writes (fp16 in + encoded out for encode, the reverse for decode); the copy
// moves 2x its size. "of copy" is the codec's median bandwidth over the
// copy's median. Times are the median and the range of --reps runs of the
// kernels alone (CudaCodecBatch: the plan uploaded once), timed with events.
// Every codec's outputs are checked after timing: the batch is encoded and
// decoded once more into poisoned buffers, and the first, middle and last
// blocks must equal the CPU codec's bytes; a mismatch exits 1.
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
  bool probe = false;
};

Options Parse(int argc, char** argv) {
  Options o;
  if (argc == 2 && std::string(argv[1]) == "--probe") {
    o.probe = true;
    return o;
  }
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

struct Timing {
  double median_s = 0, min_s = 0, max_s = 0;
};

// Median and range in seconds of `reps` runs of fn after one warm-up, each
// timed with events on stream 0.
template <typename Fn>
Timing TimeRuns(int reps, Fn fn) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  fn();  // warm up
  std::vector<double> s;
  for (int r = 0; r < std::max(reps, 1); ++r) {
    CHECK_CUDA(cudaEventRecord(start, nullptr));
    fn();
    CHECK_CUDA(cudaEventRecord(stop, nullptr));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    s.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(s.begin(), s.end());
  return {s[s.size() / 2], s.front(), s.back()};
}

// CUDA's own answer to "is there a device", with the reason when not: a GPU
// that nvidia-smi lists but the runtime cannot reach is a failure to report.
int Probe() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    std::printf("CUDA: %s (%s)\n", cudaGetErrorName(err),
                cudaGetErrorString(err));
    return 3;
  }
  if (count == 0) {
    std::printf("CUDA: no device\n");
    return 3;
  }
  std::printf("CUDA: %d device(s); %s\n", count,
              CudaDeviceDescription().c_str());
  return 0;
}

// Copies device block `b` of `bytes` bytes at `base` to the host.
std::vector<uint8_t> Fetch(const void* base, size_t bytes, uint32_t b) {
  std::vector<uint8_t> host(bytes);
  CHECK_CUDA(cudaMemcpy(host.data(),
                        static_cast<const uint8_t*>(base) + size_t{b} * bytes,
                        bytes, cudaMemcpyDeviceToHost));
  return host;
}

// Poisons the outputs, encodes and decodes the batch once more, and compares
// the first, middle and last blocks with the CPU codec (bit-identical to the
// reference): true when every byte matches.
bool CheckOutputs(const BlockShape& shape, const CodecPolicy& p,
                  uint32_t blocks, size_t in_bytes, size_t enc_bytes,
                  const std::vector<std::vector<uint16_t>>& host,
                  const std::vector<const uint16_t*>& ins,
                  const std::vector<uint8_t*>& encs,
                  const std::vector<const uint8_t*>& encs_const,
                  const std::vector<uint16_t*>& outs, uint8_t* d_enc,
                  uint16_t* d_out16) {
  CHECK_CUDA(cudaMemset(d_enc, 0xA5, enc_bytes * blocks));
  CHECK_CUDA(cudaMemset(d_out16, 0xA5, in_bytes * blocks));
  if (!EncodeBlocksCuda(shape, p, ins, encs).ok() ||
      !DecodeBlocksCuda(shape, p, encs_const, outs).ok()) {
    return false;
  }
  for (uint32_t b : {0u, blocks / 2, blocks - 1}) {
    const std::vector<uint16_t>& src = host[b % host.size()];
    std::vector<uint8_t> want_enc(enc_bytes);
    std::vector<uint16_t> want_dec(in_bytes / 2);
    if (!EncodeBlock(shape, p, src, absl::MakeSpan(want_enc)).ok() ||
        !DecodeBlock(shape, p, want_enc, absl::MakeSpan(want_dec)).ok()) {
      return false;
    }
    const std::vector<uint8_t> got_enc = Fetch(d_enc, enc_bytes, b);
    const std::vector<uint8_t> got_dec = Fetch(d_out16, in_bytes, b);
    if (got_enc != want_enc ||
        std::memcmp(got_dec.data(), want_dec.data(), in_bytes) != 0) {
      std::printf("%s: block %u differs from the CPU codec\n",
                  std::string(CodecName(p.codec)).c_str(), b);
      return false;
    }
  }
  return true;
}

int Main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  if (o.probe) return Probe();
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

  // One contiguous fp16 batch: four different N(0, s) blocks in turn, each
  // with its own scale, so no two neighbours are equal.
  constexpr uint32_t kPatterns = 4;
  std::vector<std::vector<uint16_t>> host(kPatterns,
                                          std::vector<uint16_t>(in_bytes / 2));
  std::mt19937 rng(1);
  for (uint32_t k = 0; k < kPatterns; ++k) {
    std::normal_distribution<float> gauss(0.0f, 0.5f + k);
    for (auto& x : host[k]) x = HalfFromFloat(gauss(rng));
  }
  uint16_t* d_in = nullptr;
  uint16_t* d_out16 = nullptr;
  CHECK_CUDA(cudaMalloc(&d_in, in_bytes * o.blocks));
  CHECK_CUDA(cudaMalloc(&d_out16, in_bytes * o.blocks));
  for (uint32_t b = 0; b < o.blocks; ++b) {
    CHECK_CUDA(cudaMemcpy(reinterpret_cast<uint8_t*>(d_in) + b * in_bytes,
                          host[b % kPatterns].data(), in_bytes,
                          cudaMemcpyHostToDevice));
  }

  const Timing copy = TimeRuns(o.reps, [&] {
    CHECK_CUDA(cudaMemcpyAsync(d_out16, d_in, in_bytes * o.blocks,
                               cudaMemcpyDeviceToDevice, nullptr));
  });
  const double copy_bw = 2.0 * in_bytes * o.blocks / copy.median_s;
  std::printf(
      "\ndevice-to-device cudaMemcpy: %.3f ms (%.3f-%.3f), %.1f GB/s "
      "(read + write)\n\n",
      copy.median_s * 1e3, copy.min_s * 1e3, copy.max_s * 1e3, copy_bw / 1e9);
  std::printf(
      "| codec    | op     | median ms (range)     | GB/s moved | of copy | "
      "fp16 GB/s | output |\n");
  std::printf(
      "|----------|--------|-----------------------|------------|---------|-"
      "----------|--------|\n");
  int failures = 0;
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
    // The kernels alone: each batch's plan is uploaded once.
    auto enc_batch = CudaCodecBatch::Encode(shape, p, ins, encs);
    auto dec_batch = CudaCodecBatch::Decode(shape, p, encs_const, outs16);
    if (!enc_batch.ok() || !dec_batch.ok()) {
      std::printf("%s: %s\n", std::string(CodecName(c)).c_str(),
                  (enc_batch.ok() ? dec_batch.status() : enc_batch.status())
                      .ToString()
                      .c_str());
      return 1;
    }
    bool ok = true;
    const Timing enc =
        TimeRuns(o.reps, [&] { ok = ok && (*enc_batch)->Launch().ok(); });
    const Timing dec =
        TimeRuns(o.reps, [&] { ok = ok && (*dec_batch)->Launch().ok(); });
    if (!ok) {
      std::printf("%s: a launch failed\n", std::string(CodecName(c)).c_str());
      return 1;
    }
    const bool right =
        CheckOutputs(shape, p, o.blocks, in_bytes, enc_bytes, host, ins, encs,
                     encs_const, outs16, d_enc, d_out16);
    failures += right ? 0 : 1;
    const double moved = double(in_bytes + enc_bytes) * o.blocks;
    for (int op = 0; op < 2; ++op) {
      const Timing& t = op == 0 ? enc : dec;
      std::printf(
          "| %-8s | %-6s | %7.3f (%.3f-%.3f) | %10.1f | %6.1f%% | %9.1f | "
          "%-6s |\n",
          std::string(CodecName(c)).c_str(), op == 0 ? "encode" : "decode",
          t.median_s * 1e3, t.min_s * 1e3, t.max_s * 1e3,
          moved / t.median_s / 1e9, 100.0 * (moved / t.median_s) / copy_bw,
          double(in_bytes) * o.blocks / t.median_s / 1e9,
          right ? "exact" : "WRONG");
    }
    cudaFree(d_enc);
  }
  cudaFree(d_in);
  cudaFree(d_out16);
  if (failures > 0) {
    std::printf("%d codec(s) gave outputs that differ from the CPU codec\n",
                failures);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvcache::kernels::cuda

int main(int argc, char** argv) {
  return kvcache::kernels::cuda::Main(argc, argv);
}
