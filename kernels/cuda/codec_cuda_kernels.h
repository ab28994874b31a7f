// Internal to kernels/cuda: the interface between the host code
// (codec_cuda.cc, C++ with Abseil) and the kernels (codec_cuda_kernels.cu).
#ifndef KVCACHE_KERNELS_CUDA_CODEC_CUDA_KERNELS_H_
#define KVCACHE_KERNELS_CUDA_CODEC_CUDA_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace kvcache::kernels::cuda::internal {

// Everything a launch needs; the pointers are device memory.
struct DevicePlan {
  uint32_t tokens = 0;         // T
  uint32_t heads = 0;          // H
  uint32_t dim = 0;            // D
  uint32_t group = 0;          // KIVI G
  uint32_t codec = 0;          // kvcache::kernels::Codec
  uint32_t bf16 = 0;           // 1: bf16 sources, 0: fp16
  uint64_t section_elems = 0;  // T*H*D
  uint32_t num_codec_sections = 0;
  uint32_t num_fp16_sections = 0;
  uint32_t num_blocks = 0;                   // at most 65535 per launch
  const uint32_t* codec_sections = nullptr;  // section indices (2*layer + t)
  const uint32_t* fp16_sections = nullptr;
  const uint64_t* out_offsets = nullptr;  // byte offset of each section
  // fp8 static scales, [section][head]; nullptr for dynamic scales.
  const float* static_scales = nullptr;
  uint16_t* const* fp16 = nullptr;    // per block: encode input, decode output
  uint8_t* const* encoded = nullptr;  // per block: encode output, decode input
  // Encode: min over rejected inputs (non-finite; bf16: also |x| >= 2^126)
  // of (block << 43 | element in block); stays ~0 when none is.
  unsigned long long* first_bad = nullptr;
};

inline constexpr int kBlockIndexShift = 43;

cudaError_t LaunchEncode(const DevicePlan& plan, cudaStream_t stream);
cudaError_t LaunchDecode(const DevicePlan& plan, cudaStream_t stream);

}  // namespace kvcache::kernels::cuda::internal

#endif  // KVCACHE_KERNELS_CUDA_CODEC_CUDA_KERNELS_H_
