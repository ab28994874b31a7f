#include "kernels/cuda/codec_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/codec_internal.h"
#include "kernels/cuda/codec_cuda_kernels.h"
#include "kernels/half.h"

namespace kvcache::kernels::cuda {
namespace {

static_assert(static_cast<int>(Codec::kFp8E4M3) == 1 &&
                  static_cast<int>(Codec::kFp8E5M2) == 2 &&
                  static_cast<int>(Codec::kKivi2) == 3 &&
                  static_cast<int>(Codec::kKivi4) == 4,
              "codec_cuda_kernels.cu hard-codes these values");

constexpr size_t kMaxBlocksPerLaunch = 65535;  // gridDim.z

absl::Status CudaError(cudaError_t err, const char* what) {
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ",
                                          cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

// Host-side layout of one call; uploaded in one copy.
struct HostPlan {
  internal::DevicePlan plan;
  std::vector<uint32_t> codec_sections, fp16_sections;
  std::vector<uint64_t> out_offsets;
  std::vector<float> static_scales;  // empty for dynamic scales
  size_t encoded_bytes = 0;
};

HostPlan MakePlan(const BlockShape& shape, const CodecPolicy& policy) {
  HostPlan hp;
  const uint32_t L = shape.num_layers, H = shape.num_kv_heads;
  std::vector<bool> fp16_layer(L, false);
  for (uint32_t l : policy.fp16_layers) fp16_layer[l] = true;
  const bool fp8 = kernels::internal::IsFp8(policy.codec);
  const bool is_static = fp8 && policy.scale_mode != ScaleMode::kDynamic;
  const bool per_layer = policy.scale_mode == ScaleMode::kStaticPerLayer;
  if (is_static) hp.static_scales.assign(size_t{2} * L * H, 1.0f);
  uint64_t offset = 0;
  for (uint32_t l = 0; l < L; ++l) {
    for (uint32_t t = 0; t < 2; ++t) {
      const uint32_t sec = 2 * l + t;
      kernels::internal::Section s;
      s.codec = fp16_layer[l] ? Codec::kNone : policy.codec;
      s.is_key = t == 0;
      s.tokens = shape.tokens_per_block;
      s.heads = H;
      s.dim = shape.head_dim;
      s.group = policy.kivi_group_size;
      if (is_static && s.codec != Codec::kNone) {
        const std::vector<float>& src =
            t == 0 ? policy.static_k_scales : policy.static_v_scales;
        for (uint32_t h = 0; h < H; ++h) {
          hp.static_scales[size_t{sec} * H + h] =
              per_layer ? src[l] : src[size_t{l} * H + h];
        }
        s.static_scales = &hp.static_scales[size_t{sec} * H];
      }
      (s.codec == Codec::kNone ? hp.fp16_sections : hp.codec_sections)
          .push_back(sec);
      hp.out_offsets.push_back(offset);
      offset += kernels::internal::SectionBytes(s);
    }
  }
  hp.encoded_bytes = offset;
  internal::DevicePlan& p = hp.plan;
  p.tokens = shape.tokens_per_block;
  p.heads = H;
  p.dim = shape.head_dim;
  p.group = policy.kivi_group_size;
  p.codec = static_cast<uint32_t>(policy.codec);
  p.bf16 = shape.source_dtype == SourceDtype::kBf16 ? 1 : 0;
  p.section_elems = uint64_t{shape.tokens_per_block} * H * shape.head_dim;
  p.num_codec_sections = static_cast<uint32_t>(hp.codec_sections.size());
  p.num_fp16_sections = static_cast<uint32_t>(hp.fp16_sections.size());
  return hp;
}

// Appends `bytes` bytes of `src` to `blob` at an 8-byte aligned offset;
// returns that offset.
size_t Append(std::vector<uint8_t>& blob, const void* src, size_t bytes) {
  const size_t at = (blob.size() + 7) & ~size_t{7};
  blob.resize(at + bytes);
  if (bytes > 0) std::memcpy(blob.data() + at, src, bytes);
  return at;
}

// Uploads the plan and the pointer arrays, runs `launch`, waits, and returns
// the first non-finite key (~0 when none) for encodes.
template <typename Launch>
absl::Status Run(HostPlan& hp, const std::vector<uint16_t*>& fp16,
                 const std::vector<uint8_t*>& encoded, cudaStream_t stream,
                 Launch launch, unsigned long long* first_bad_out) {
  std::vector<uint8_t> blob;
  const unsigned long long none = ~0ull;
  const size_t bad_at = Append(blob, &none, sizeof(none));
  const size_t codec_at = Append(blob, hp.codec_sections.data(),
                                 hp.codec_sections.size() * sizeof(uint32_t));
  const size_t fp16s_at = Append(blob, hp.fp16_sections.data(),
                                 hp.fp16_sections.size() * sizeof(uint32_t));
  const size_t off_at = Append(blob, hp.out_offsets.data(),
                               hp.out_offsets.size() * sizeof(uint64_t));
  const size_t scales_at = Append(blob, hp.static_scales.data(),
                                  hp.static_scales.size() * sizeof(float));
  const size_t in_at =
      Append(blob, fp16.data(), fp16.size() * sizeof(uint16_t*));
  const size_t out_at =
      Append(blob, encoded.data(), encoded.size() * sizeof(uint8_t*));

  void* dev = nullptr;
  cudaError_t err = cudaMallocAsync(&dev, blob.size(), stream);
  if (err != cudaSuccess) return CudaError(err, "cudaMallocAsync");
  auto* base = static_cast<uint8_t*>(dev);
  err = cudaMemcpyAsync(dev, blob.data(), blob.size(), cudaMemcpyHostToDevice,
                        stream);
  absl::Status status = absl::OkStatus();
  if (err != cudaSuccess) status = CudaError(err, "cudaMemcpyAsync (plan)");
  internal::DevicePlan p = hp.plan;
  p.first_bad = reinterpret_cast<unsigned long long*>(base + bad_at);
  p.codec_sections = reinterpret_cast<const uint32_t*>(base + codec_at);
  p.fp16_sections = reinterpret_cast<const uint32_t*>(base + fp16s_at);
  p.out_offsets = reinterpret_cast<const uint64_t*>(base + off_at);
  p.static_scales = hp.static_scales.empty()
                        ? nullptr
                        : reinterpret_cast<const float*>(base + scales_at);
  uint16_t* const* in_ptrs = reinterpret_cast<uint16_t* const*>(base + in_at);
  uint8_t* const* out_ptrs = reinterpret_cast<uint8_t* const*>(base + out_at);
  for (size_t b0 = 0; status.ok() && b0 < fp16.size();
       b0 += kMaxBlocksPerLaunch) {
    p.num_blocks =
        static_cast<uint32_t>(std::min(kMaxBlocksPerLaunch, fp16.size() - b0));
    p.fp16 = in_ptrs + b0;
    p.encoded = out_ptrs + b0;
    // Block indices in first_bad are relative to the launch: keep the first
    // launch that reports one by stopping there.
    err = launch(p, stream);
    if (err != cudaSuccess) {
      status = CudaError(err, "kernel launch");
      break;
    }
    if (first_bad_out != nullptr) {
      unsigned long long bad = ~0ull;
      err = cudaMemcpyAsync(&bad, p.first_bad, sizeof(bad),
                            cudaMemcpyDeviceToHost, stream);
      if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
      if (err != cudaSuccess) {
        status = CudaError(err, "reading the non-finite flag");
        break;
      }
      if (bad != ~0ull) {
        const uint64_t block = bad >> internal::kBlockIndexShift;
        *first_bad_out = ((b0 + block) << internal::kBlockIndexShift) |
                         (bad & ((1ull << internal::kBlockIndexShift) - 1));
        break;
      }
    }
  }
  err = cudaFreeAsync(dev, stream);
  if (err != cudaSuccess && status.ok())
    status = CudaError(err, "cudaFreeAsync");
  err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess && status.ok()) {
    status = CudaError(err, "cudaStreamSynchronize");
  }
  return status;
}

absl::Status CheckSpans(size_t a, size_t b) {
  if (a != b) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA codec: ", a, " input blocks but ", b, " output blocks"));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CheckNonNull(absl::Span<T* const> ptrs, const char* what) {
  for (size_t i = 0; i < ptrs.size(); ++i) {
    if (ptrs[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA codec: ", what, " pointer ", i, " is null"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls start clean
    return 0;
  }
  return count;
}

std::string CudaDeviceDescription() {
  int device = 0;
  cudaDeviceProp prop;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    return "no CUDA device";
  }
  return absl::StrFormat("%s, compute capability %d.%d, %.1f GiB", prop.name,
                         prop.major, prop.minor,
                         prop.totalGlobalMem / double(1 << 30));
}

absl::Status EncodeBlocksCuda(const BlockShape& shape,
                              const CodecPolicy& policy,
                              absl::Span<const uint16_t* const> fp16_in,
                              absl::Span<uint8_t* const> encoded_out,
                              void* stream) {
  if (absl::Status st = ValidatePolicy(shape, policy); !st.ok()) return st;
  if (absl::Status st = CheckSpans(fp16_in.size(), encoded_out.size());
      !st.ok()) {
    return st;
  }
  if (absl::Status st = CheckNonNull(fp16_in, "input"); !st.ok()) return st;
  if (absl::Status st = CheckNonNull(encoded_out, "output"); !st.ok()) {
    return st;
  }
  if (fp16_in.empty()) return absl::OkStatus();
  HostPlan hp = MakePlan(shape, policy);
  std::vector<uint16_t*> in(fp16_in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = const_cast<uint16_t*>(fp16_in[i]);  // read only by the kernels
  }
  std::vector<uint8_t*> out(encoded_out.begin(), encoded_out.end());
  unsigned long long bad = ~0ull;
  absl::Status st = Run(hp, in, out, static_cast<cudaStream_t>(stream),
                        &internal::LaunchEncode, &bad);
  if (!st.ok()) return st;
  if (bad == ~0ull) return absl::OkStatus();
  const uint64_t block = bad >> internal::kBlockIndexShift;
  const uint64_t element = bad & ((1ull << internal::kBlockIndexShift) - 1);
  const uint64_t n = hp.plan.section_elems;
  const uint64_t sec = element / n, i = element % n;
  const uint64_t H = shape.num_kv_heads, D = shape.head_dim;
  uint16_t value = 0;
  cudaMemcpy(&value, fp16_in[block] + element, sizeof(value),
             cudaMemcpyDeviceToHost);
  const float x = kernels::internal::SourceToFloat(shape.source_dtype, value);
  const bool finite = std::isfinite(x);
  return absl::InvalidArgumentError(absl::StrCat(
      finite ? "out-of-range " : "non-finite ",
      shape.source_dtype == SourceDtype::kBf16 ? "bf16 " : "", "input (", x,
      ") in block ", block, " of the batch at layer ", sec / 2, " ",
      sec % 2 == 0 ? "K" : "V", " head ", (i / D) % H, " (token ", i / (H * D),
      ", channel ", i % D, "); ",
      finite ? "bf16 sources must be below 2^126 in magnitude"
             : "a KV cache never holds inf or NaN"));
}

absl::Status DecodeBlocksCuda(const BlockShape& shape,
                              const CodecPolicy& policy,
                              absl::Span<const uint8_t* const> encoded_in,
                              absl::Span<uint16_t* const> fp16_out,
                              void* stream) {
  if (absl::Status st = ValidatePolicy(shape, policy); !st.ok()) return st;
  if (absl::Status st = CheckSpans(encoded_in.size(), fp16_out.size());
      !st.ok()) {
    return st;
  }
  if (absl::Status st = CheckNonNull(encoded_in, "input"); !st.ok()) return st;
  if (absl::Status st = CheckNonNull(fp16_out, "output"); !st.ok()) return st;
  if (encoded_in.empty()) return absl::OkStatus();
  HostPlan hp = MakePlan(shape, policy);
  std::vector<uint16_t*> out(fp16_out.begin(), fp16_out.end());
  std::vector<uint8_t*> in(encoded_in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = const_cast<uint8_t*>(encoded_in[i]);  // read only by the kernels
  }
  return Run(hp, out, in, static_cast<cudaStream_t>(stream),
             &internal::LaunchDecode, nullptr);
}

}  // namespace kvcache::kernels::cuda
