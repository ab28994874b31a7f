// CUDA kernels of the codecs. They run the scalar reference's per-element
// code (kernels/half.h and kernels/fp8.h are compiled for the device too)
// with IEEE fp32 operations spelled out: __fdiv_rn, __fmul_rn, __fadd_rn,
// __fsub_rn, so nothing is contracted into a fused multiply-add or replaced
// by an approximate division (this file is also compiled with -fmad=false
// and --prec-div=true). fp32 -> fp16 uses the hardware conversion, which
// rounds to nearest even with subnormals and overflow to infinity exactly as
// HalfFromFloat does (NaN aside: see ToHalf). bf16 sources (DevicePlan::bf16)
// convert with the integer code of kernels/half.h.
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/codec_cuda_index.h"
#include "kernels/cuda/codec_cuda_kernels.h"
#include "kernels/fp8.h"
#include "kernels/half.h"

namespace kvcache::kernels::cuda::internal {
namespace {

// kvcache::kernels::Codec values (checked in codec_cuda.cc).
constexpr uint32_t kFp8E4M3 = 1;
constexpr uint32_t kFp8E5M2 = 2;
constexpr uint32_t kKivi2 = 3;
constexpr uint32_t kKivi4 = 4;

constexpr int kThreads = 256;
constexpr uint32_t kMaxGridX = 1u << 16;

__device__ inline void ReportBad(unsigned long long* first_bad, uint32_t block,
                                 uint64_t element) {
  atomicMin(
      first_bad,
      (static_cast<unsigned long long>(block) << kBlockIndexShift) | element);
}

__device__ inline void StoreLe16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
__device__ inline uint16_t LoadLe16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
__device__ inline void StoreLe32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
__device__ inline uint32_t LoadLe32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

// HalfFromFloat. The hardware conversion for numbers; NaN through the
// reference code (the hardware returns one canonical NaN).
__device__ inline uint16_t ToHalf(float f) {
  if (f != f) return HalfFromFloat(f);
  return __half_as_ushort(__float2half_rn(f));
}

// Exact for every fp16 input, NaN included.
__device__ inline float FromHalf(uint16_t h) {
  if (HalfIsNonFinite(h)) return HalfToFloat(h);
  return __half2float(__ushort_as_half(h));
}

// The source dtype of a plan (DevicePlan::bf16): x = float(source), exact,
// and results rounded to nearest even into it. bf16 uses the integer
// conversions of kernels/half.h, the CPU's very code.
__device__ inline float FromSource(uint32_t bf16, uint16_t v) {
  return bf16 ? Bf16ToFloat(v) : FromHalf(v);
}
__device__ inline uint16_t ToSource(uint32_t bf16, float f) {
  return bf16 ? Bf16FromFloat(f) : ToHalf(f);
}
// Input the codecs reject (internal::RejectBound on the CPU): non-finite,
// and for bf16 also a magnitude >= 2^126.
__device__ inline bool Rejected(uint32_t bf16, uint16_t v) {
  return (v & 0x7FFFu) >= (bf16 ? 0x7E80u : 0x7C00u);
}

template <uint32_t kCodec>
__device__ inline uint8_t Fp8Encode(float q) {
  return kCodec == kFp8E4M3 ? Fp8E4M3FromFloat(q) : Fp8E5M2FromFloat(q);
}

template <uint32_t kCodec>
__device__ inline uint16_t Fp8DecodeToSource(uint32_t bf16, uint8_t code,
                                             float scale) {
  const uint32_t a = code & 0x7Fu;
  const bool nan = kCodec == kFp8E4M3 ? a == 0x7Fu : a > 0x7Cu;
  // The CPU keeps the NaN's sign through the multiply and makes it quiet:
  // sign | 0x7E00 (fp16), sign | 0x7FC0 (bf16). The GPU would return its
  // canonical NaN.
  if (nan) {
    return static_cast<uint16_t>((code & 0x80u) << 8 |
                                 (bf16 ? 0x7FC0u : 0x7E00u));
  }
  const float v =
      kCodec == kFp8E4M3 ? Fp8E4M3ToFloat(code) : Fp8E5M2ToFloat(code);
  return ToSource(bf16, __fmul_rn(v, scale));
}

// Indices within a section are 32-bit (ValidatePolicy keeps T*H*D < 2^31;
// 64-bit division is slow on GPUs); offsets of sections are 64-bit. The grid
// is at most 2^16 x 256 threads wide.
__device__ inline uint32_t GridStart() {
  return blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ inline uint32_t GridStride() { return gridDim.x * blockDim.x; }

// ---- fp16 sections ---------------------------------------------------------

__global__ void EncodeFp16Kernel(DevicePlan p) {
  const uint32_t block = blockIdx.z;
  const uint32_t sec = p.fp16_sections[blockIdx.y];
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  const uint16_t* in = p.fp16[block] + uint64_t{sec} * n;
  uint8_t* out = p.encoded[block] + p.out_offsets[sec];
  for (uint32_t e = GridStart(); e < n; e += GridStride()) {
    const uint16_t h = in[e];
    if (Rejected(p.bf16, h))
      ReportBad(p.first_bad, block, uint64_t{sec} * n + e);
    StoreLe16(out + 2 * e, h);
  }
}

__global__ void DecodeFp16Kernel(DevicePlan p) {
  const uint32_t block = blockIdx.z;
  const uint32_t sec = p.fp16_sections[blockIdx.y];
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  const uint8_t* in = p.encoded[block] + p.out_offsets[sec];
  uint16_t* out = p.fp16[block] + uint64_t{sec} * n;
  for (uint32_t e = GridStart(); e < n; e += GridStride()) {
    out[e] = LoadLe16(in + 2 * e);
  }
}

// ---- FP8 -------------------------------------------------------------------

// One thread block per (block, section, kv head).
template <uint32_t kCodec>
__global__ void EncodeFp8Kernel(DevicePlan p) {
  const uint32_t block = blockIdx.z;
  const uint32_t sec = p.codec_sections[blockIdx.y];
  const uint32_t h = blockIdx.x;
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  const uint32_t H = p.heads, D = p.dim;
  const uint32_t per_head = p.tokens * D;
  const uint16_t* in = p.fp16[block] + uint64_t{sec} * n;
  uint8_t* out = p.encoded[block] + p.out_offsets[sec];
  float scale;
  uint8_t* codes;
  if (p.static_scales == nullptr) {
    // scale = amax / fp8_max, 1 where amax is 0. The largest |x| of finite
    // halves is the largest bit pattern with the sign cleared.
    __shared__ unsigned int amax_bits;
    if (threadIdx.x == 0) amax_bits = 0;
    __syncthreads();
    unsigned int m = 0;
    RowWalker w(threadIdx.x, blockDim.x, D);
    for (uint32_t k = threadIdx.x; k < per_head; k += blockDim.x, w.Next()) {
      const uint32_t e = (w.row * H + h) * D + w.col;
      const uint16_t x = in[e];
      if (Rejected(p.bf16, x)) {
        ReportBad(p.first_bad, block, uint64_t{sec} * n + e);
      }
      m = max(m, static_cast<unsigned int>(x & 0x7FFFu));
    }
    atomicMax(&amax_bits, m);
    __syncthreads();
    const float amax = p.bf16 ? Bf16ToFloat(static_cast<uint16_t>(amax_bits))
                              : HalfToFloat(static_cast<uint16_t>(amax_bits));
    const float fp8_max = kCodec == kFp8E4M3 ? 448.0f : 57344.0f;
    scale = amax == 0.0f ? 1.0f : __fdiv_rn(amax, fp8_max);
    if (threadIdx.x == 0) StoreLe32(out + 4 * h, FloatBits(scale));
    codes = out + 4 * H;
  } else {
    scale = p.static_scales[sec * H + h];
    codes = out;
  }
  // code = fp8_rne_satfinite(float(x) / scale)
  RowWalker w(threadIdx.x, blockDim.x, D);
  for (uint32_t k = threadIdx.x; k < per_head; k += blockDim.x, w.Next()) {
    const uint32_t e = (w.row * H + h) * D + w.col;
    const uint16_t x = in[e];
    if (p.static_scales != nullptr && Rejected(p.bf16, x)) {
      ReportBad(p.first_bad, block, uint64_t{sec} * n + e);
    }
    codes[e] = Fp8Encode<kCodec>(__fdiv_rn(FromSource(p.bf16, x), scale));
  }
}

// One thread block per (block, section, kv head).
template <uint32_t kCodec>
__global__ void DecodeFp8Kernel(DevicePlan p) {
  const uint32_t block = blockIdx.z;
  const uint32_t sec = p.codec_sections[blockIdx.y];
  const uint32_t h = blockIdx.x;
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  const uint32_t H = p.heads, D = p.dim;
  const uint32_t per_head = p.tokens * D;
  const uint8_t* in = p.encoded[block] + p.out_offsets[sec];
  const uint8_t* codes = p.static_scales == nullptr ? in + 4 * H : in;
  uint16_t* out = p.fp16[block] + uint64_t{sec} * n;
  const float scale = p.static_scales == nullptr
                          ? FloatFromBits(LoadLe32(in + 4 * h))
                          : p.static_scales[sec * H + h];
  RowWalker w(threadIdx.x, blockDim.x, D);
  for (uint32_t k = threadIdx.x; k < per_head; k += blockDim.x, w.Next()) {
    const uint32_t e = (w.row * H + h) * D + w.col;
    // x' = half_rne(float(code) * scale)
    out[e] = Fp8DecodeToSource<kCodec>(p.bf16, codes[e], scale);
  }
}

// ---- KIVI ------------------------------------------------------------------

// One thread per group: min, max, zero point and scale.
template <uint32_t kBits>
__global__ void KiviMetaKernel(DevicePlan p) {
  const uint32_t block = blockIdx.z;
  const uint32_t sec = p.codec_sections[blockIdx.y];
  const bool key = sec % 2 == 0;
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  const uint32_t G = p.group;
  const uint32_t HD = p.heads * p.dim;
  const uint32_t groups = n / G;
  const float qmax = static_cast<float>((1u << kBits) - 1u);
  const uint16_t* in = p.fp16[block] + uint64_t{sec} * n;
  uint8_t* zeros = p.encoded[block] + p.out_offsets[sec];
  uint8_t* scales = zeros + 2 * groups;
  for (uint32_t k = GridStart(); k < groups; k += GridStride()) {
    // Keys: group (g, channel c) over tokens [g*G, g*G + G), stride HD.
    // Values: G consecutive elements.
    const uint32_t base = key ? (k / HD) * G * HD + k % HD : k * G;
    const uint32_t stride = key ? HD : 1;
    float mn = INFINITY, mx = -INFINITY;
    for (uint32_t j = 0; j < G; ++j) {
      const uint32_t e = base + j * stride;
      const uint16_t x = in[e];
      if (Rejected(p.bf16, x)) {
        ReportBad(p.first_bad, block, uint64_t{sec} * n + e);
      }
      const float v = FromSource(p.bf16, x);
      mn = fminf(mn, v);
      mx = fmaxf(mx, v);
    }
    // A zero min or max is +0.
    const float lo = __fadd_rn(mn, 0.0f);
    const float hi = __fadd_rn(mx, 0.0f);
    StoreLe16(zeros + 2 * k, ToSource(p.bf16, lo));
    StoreLe16(scales + 2 * k,
              ToSource(p.bf16, __fdiv_rn(__fsub_rn(hi, lo), qmax)));
  }
}

// One thread per packed byte (8 / kBits codes), after KiviMetaKernel.
template <uint32_t kBits>
__global__ void KiviCodesKernel(DevicePlan p) {
  constexpr uint32_t kPerByte = 8 / kBits;
  const uint32_t block = blockIdx.z;
  const uint32_t sec = p.codec_sections[blockIdx.y];
  const bool key = sec % 2 == 0;
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  const uint32_t groups = n / p.group;
  const uint32_t bytes = static_cast<uint32_t>((uint64_t{n} * kBits + 7) / 8);
  const float qmax = static_cast<float>((1u << kBits) - 1u);
  const uint16_t* in = p.fp16[block] + uint64_t{sec} * n;
  const uint8_t* zeros = p.encoded[block] + p.out_offsets[sec];
  const uint8_t* scales = zeros + 2 * groups;
  uint8_t* codes = p.encoded[block] + p.out_offsets[sec] + 4 * groups;
  const uint32_t HD = p.heads * p.dim;
  for (uint32_t i = GridStart(); i < bytes; i += GridStride()) {
    uint32_t packed = 0;
    KiviGroupWalker w(key, HD, p.group, i * kPerByte);
    uint32_t last = ~0u;
    float zero = 0.0f, scale = 0.0f;
    for (uint32_t u = 0; u < kPerByte; ++u, w.Next()) {
      const uint64_t e64 = uint64_t{i} * kPerByte + u;
      if (e64 >= n) break;
      const uint32_t e = static_cast<uint32_t>(e64);
      const uint32_t g = w.group();
      if (g != last) {
        zero = FromSource(p.bf16, LoadLe16(zeros + 2 * g));
        scale = FromSource(p.bf16, LoadLe16(scales + 2 * g));
        last = g;
      }
      uint32_t code = 0;
      if (scale != 0.0f) {
        // clamp(rint((x - zero) / scale), 0, 2^b - 1)
        const float q =
            rintf(__fdiv_rn(__fsub_rn(FromSource(p.bf16, in[e]), zero), scale));
        code = static_cast<uint32_t>(fminf(fmaxf(q, 0.0f), qmax));
      }
      packed |= code << (u * kBits);
    }
    codes[i] = static_cast<uint8_t>(packed);
  }
}

// One thread per packed byte.
template <uint32_t kBits>
__global__ void KiviDecodeKernel(DevicePlan p) {
  constexpr uint32_t kPerByte = 8 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const uint32_t block = blockIdx.z;
  const uint32_t sec = p.codec_sections[blockIdx.y];
  const bool key = sec % 2 == 0;
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  const uint32_t groups = n / p.group;
  const uint32_t bytes = static_cast<uint32_t>((uint64_t{n} * kBits + 7) / 8);
  const uint8_t* zeros = p.encoded[block] + p.out_offsets[sec];
  const uint8_t* scales = zeros + 2 * groups;
  const uint8_t* codes = zeros + 4 * groups;
  uint16_t* out = p.fp16[block] + uint64_t{sec} * n;
  const uint32_t HD = p.heads * p.dim;
  for (uint32_t i = GridStart(); i < bytes; i += GridStride()) {
    const uint32_t packed = codes[i];
    KiviGroupWalker w(key, HD, p.group, i * kPerByte);
    uint32_t last = ~0u;
    float zero = 0.0f, scale = 0.0f;
    for (uint32_t u = 0; u < kPerByte; ++u, w.Next()) {
      const uint64_t e64 = uint64_t{i} * kPerByte + u;
      if (e64 >= n) break;
      const uint32_t e = static_cast<uint32_t>(e64);
      const uint32_t g = w.group();
      if (g != last) {
        zero = FromSource(p.bf16, LoadLe16(zeros + 2 * g));
        scale = FromSource(p.bf16, LoadLe16(scales + 2 * g));
        last = g;
      }
      const uint32_t code = (packed >> (u * kBits)) & kMask;
      // x' = half_rne(float(code) * scale + zero): multiply, round, add,
      // round.
      const float product = __fmul_rn(static_cast<float>(code), scale);
      out[e] = ToSource(p.bf16, __fadd_rn(product, zero));
    }
  }
}

dim3 Grid(uint64_t work, uint32_t sections, uint32_t blocks) {
  const uint64_t x = (work + kThreads - 1) / kThreads;
  return dim3(
      static_cast<uint32_t>(x < 1 ? 1 : (x > kMaxGridX ? kMaxGridX : x)),
      sections, blocks);
}

}  // namespace

cudaError_t LaunchEncode(const DevicePlan& p, cudaStream_t stream) {
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  if (p.num_fp16_sections > 0) {
    EncodeFp16Kernel<<<Grid(n, p.num_fp16_sections, p.num_blocks), kThreads, 0,
                       stream>>>(p);
  }
  if (p.num_codec_sections > 0) {
    const uint32_t s = p.num_codec_sections, b = p.num_blocks;
    const dim3 per_head(p.heads, s, b);
    const uint64_t groups = n / (p.group == 0 ? 1 : p.group);
    switch (p.codec) {
      case kFp8E4M3:
        EncodeFp8Kernel<kFp8E4M3><<<per_head, kThreads, 0, stream>>>(p);
        break;
      case kFp8E5M2:
        EncodeFp8Kernel<kFp8E5M2><<<per_head, kThreads, 0, stream>>>(p);
        break;
      case kKivi2:
        KiviMetaKernel<2><<<Grid(groups, s, b), kThreads, 0, stream>>>(p);
        KiviCodesKernel<2>
            <<<Grid((n * 2 + 7) / 8, s, b), kThreads, 0, stream>>>(p);
        break;
      case kKivi4:
        KiviMetaKernel<4><<<Grid(groups, s, b), kThreads, 0, stream>>>(p);
        KiviCodesKernel<4>
            <<<Grid((n * 4 + 7) / 8, s, b), kThreads, 0, stream>>>(p);
        break;
      default:
        return cudaErrorInvalidValue;
    }
  }
  return cudaGetLastError();
}

cudaError_t LaunchDecode(const DevicePlan& p, cudaStream_t stream) {
  const uint32_t n = static_cast<uint32_t>(p.section_elems);
  if (p.num_fp16_sections > 0) {
    DecodeFp16Kernel<<<Grid(n, p.num_fp16_sections, p.num_blocks), kThreads, 0,
                       stream>>>(p);
  }
  if (p.num_codec_sections > 0) {
    const uint32_t s = p.num_codec_sections, b = p.num_blocks;
    switch (p.codec) {
      case kFp8E4M3:
        DecodeFp8Kernel<kFp8E4M3>
            <<<dim3(p.heads, s, b), kThreads, 0, stream>>>(p);
        break;
      case kFp8E5M2:
        DecodeFp8Kernel<kFp8E5M2>
            <<<dim3(p.heads, s, b), kThreads, 0, stream>>>(p);
        break;
      case kKivi2:
        KiviDecodeKernel<2>
            <<<Grid((n * 2 + 7) / 8, s, b), kThreads, 0, stream>>>(p);
        break;
      case kKivi4:
        KiviDecodeKernel<4>
            <<<Grid((n * 4 + 7) / 8, s, b), kThreads, 0, stream>>>(p);
        break;
      default:
        return cudaErrorInvalidValue;
    }
  }
  return cudaGetLastError();
}

}  // namespace kvcache::kernels::cuda::internal
