#include "kernels/cuda/codec_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
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

// A call's plan and pointer arrays, laid out for one upload, and where each
// part lies in it.
struct Blob {
  std::vector<uint8_t> bytes;
  size_t bad_at = 0, codec_at = 0, fp16s_at = 0, off_at = 0, scales_at = 0,
         in_at = 0, out_at = 0;
};

Blob MakeBlob(const HostPlan& hp, const std::vector<uint16_t*>& fp16,
              const std::vector<uint8_t*>& encoded) {
  Blob b;
  const unsigned long long none = ~0ull;
  b.bad_at = Append(b.bytes, &none, sizeof(none));
  b.codec_at = Append(b.bytes, hp.codec_sections.data(),
                      hp.codec_sections.size() * sizeof(uint32_t));
  b.fp16s_at = Append(b.bytes, hp.fp16_sections.data(),
                      hp.fp16_sections.size() * sizeof(uint32_t));
  b.off_at = Append(b.bytes, hp.out_offsets.data(),
                    hp.out_offsets.size() * sizeof(uint64_t));
  b.scales_at = Append(b.bytes, hp.static_scales.data(),
                       hp.static_scales.size() * sizeof(float));
  b.in_at = Append(b.bytes, fp16.data(), fp16.size() * sizeof(uint16_t*));
  b.out_at = Append(b.bytes, encoded.data(), encoded.size() * sizeof(uint8_t*));
  return b;
}

// The plan as the kernels see it once the blob is at device address `base`.
internal::DevicePlan PlanAt(const HostPlan& hp, const Blob& b, uint8_t* base) {
  internal::DevicePlan p = hp.plan;
  p.first_bad = reinterpret_cast<unsigned long long*>(base + b.bad_at);
  p.codec_sections = reinterpret_cast<const uint32_t*>(base + b.codec_at);
  p.fp16_sections = reinterpret_cast<const uint32_t*>(base + b.fp16s_at);
  p.out_offsets = reinterpret_cast<const uint64_t*>(base + b.off_at);
  p.static_scales = hp.static_scales.empty()
                        ? nullptr
                        : reinterpret_cast<const float*>(base + b.scales_at);
  return p;
}

// Per thread and device: device memory for a call's blob and the pinned
// host memory it goes up from (and the non-finite flag comes back into),
// grown as needed and kept, so that a warm call allocates nothing. Safe to
// reuse call after call because Run waits for its stream before returning.
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() {
    // At thread exit; errors (a runtime already torn down) change nothing.
    if (dev_ != nullptr) cudaFree(dev_);
    if (host_ != nullptr) cudaFreeHost(host_);
  }
  // Room for `bytes` on both sides; INTERNAL when CUDA cannot allocate.
  absl::Status Reserve(size_t bytes) {
    if (bytes <= size_) return absl::OkStatus();
    const size_t want = std::max(bytes, 2 * size_);
    if (dev_ != nullptr) cudaFree(dev_);
    if (host_ != nullptr) cudaFreeHost(host_);
    dev_ = host_ = nullptr;
    size_ = 0;
    cudaError_t err = cudaMalloc(&dev_, want);
    if (err != cudaSuccess) return CudaError(err, "cudaMalloc (codec plan)");
    err = cudaMallocHost(&host_, want);
    if (err != cudaSuccess) {
      return CudaError(err, "cudaMallocHost (codec plan)");
    }
    size_ = want;
    return absl::OkStatus();
  }
  uint8_t* dev() const { return static_cast<uint8_t*>(dev_); }
  uint8_t* host() const { return static_cast<uint8_t*>(host_); }

  // This thread's workspace for the current device.
  static absl::StatusOr<Workspace*> ForThisThread() {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return CudaError(err, "cudaGetDevice");
    static thread_local std::map<int, std::unique_ptr<Workspace>> by_device;
    std::unique_ptr<Workspace>& ws = by_device[device];
    if (ws == nullptr) ws = std::make_unique<Workspace>();
    return ws.get();
  }

 private:
  void* dev_ = nullptr;
  void* host_ = nullptr;
  size_t size_ = 0;
};

// Uploads the plan and the pointer arrays (from pinned memory into the
// thread's workspace), runs `launch`, waits, and returns the first
// non-finite key (~0 when none) for encodes.
template <typename Launch>
absl::Status Run(HostPlan& hp, const std::vector<uint16_t*>& fp16,
                 const std::vector<uint8_t*>& encoded, cudaStream_t stream,
                 Launch launch, unsigned long long* first_bad_out) {
  const Blob blob = MakeBlob(hp, fp16, encoded);
  absl::StatusOr<Workspace*> ws = Workspace::ForThisThread();
  if (!ws.ok()) return ws.status();
  if (absl::Status s = (*ws)->Reserve(blob.bytes.size()); !s.ok()) return s;
  std::memcpy((*ws)->host(), blob.bytes.data(), blob.bytes.size());
  uint8_t* base = (*ws)->dev();
  cudaError_t err = cudaMemcpyAsync(base, (*ws)->host(), blob.bytes.size(),
                                    cudaMemcpyHostToDevice, stream);
  absl::Status status = absl::OkStatus();
  if (err != cudaSuccess) status = CudaError(err, "cudaMemcpyAsync (plan)");
  internal::DevicePlan p = PlanAt(hp, blob, base);
  uint16_t* const* in_ptrs =
      reinterpret_cast<uint16_t* const*>(base + blob.in_at);
  uint8_t* const* out_ptrs =
      reinterpret_cast<uint8_t* const*>(base + blob.out_at);
  // The flag comes back into the pinned copy of itself.
  auto* bad_host =
      reinterpret_cast<unsigned long long*>((*ws)->host() + blob.bad_at);
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
      err = cudaMemcpyAsync(bad_host, p.first_bad, sizeof(*bad_host),
                            cudaMemcpyDeviceToHost, stream);
      if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
      if (err != cudaSuccess) {
        status = CudaError(err, "reading the non-finite flag");
        break;
      }
      const unsigned long long bad = *bad_host;
      if (bad != ~0ull) {
        const uint64_t block = bad >> internal::kBlockIndexShift;
        *first_bad_out = ((b0 + block) << internal::kBlockIndexShift) |
                         (bad & ((1ull << internal::kBlockIndexShift) - 1));
        break;
      }
    }
  }
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

struct CudaCodecBatch::Impl {
  bool encode = true;
  HostPlan hp;
  size_t blocks = 0;
  uint8_t* dev = nullptr;  // the blob: cudaMalloc, freed by ~Impl
  Blob blob;
  ~Impl() {
    if (dev != nullptr) cudaFree(dev);
  }
};

namespace {

absl::StatusOr<std::unique_ptr<CudaCodecBatch::Impl>> Prepare(
    bool encode, const BlockShape& shape, const CodecPolicy& policy,
    const std::vector<uint16_t*>& fp16, const std::vector<uint8_t*>& coded) {
  if (absl::Status st = ValidatePolicy(shape, policy); !st.ok()) return st;
  if (absl::Status st = CheckSpans(fp16.size(), coded.size()); !st.ok()) {
    return st;
  }
  auto impl = std::make_unique<CudaCodecBatch::Impl>();
  impl->encode = encode;
  impl->hp = MakePlan(shape, policy);
  impl->blocks = fp16.size();
  impl->blob = MakeBlob(impl->hp, fp16, coded);
  void* dev = nullptr;
  cudaError_t err = cudaMalloc(&dev, impl->blob.bytes.size());
  if (err != cudaSuccess) return CudaError(err, "cudaMalloc (codec batch)");
  impl->dev = static_cast<uint8_t*>(dev);
  err = cudaMemcpy(dev, impl->blob.bytes.data(), impl->blob.bytes.size(),
                   cudaMemcpyHostToDevice);
  if (err != cudaSuccess) return CudaError(err, "cudaMemcpy (codec batch)");
  return impl;
}

}  // namespace

CudaCodecBatch::CudaCodecBatch(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
CudaCodecBatch::~CudaCodecBatch() = default;

absl::StatusOr<std::unique_ptr<CudaCodecBatch>> CudaCodecBatch::Encode(
    const BlockShape& shape, const CodecPolicy& policy,
    absl::Span<const uint16_t* const> fp16_in,
    absl::Span<uint8_t* const> encoded_out) {
  std::vector<uint16_t*> in(fp16_in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = const_cast<uint16_t*>(fp16_in[i]);  // read only by the kernels
  }
  std::vector<uint8_t*> out(encoded_out.begin(), encoded_out.end());
  absl::StatusOr<std::unique_ptr<Impl>> impl =
      Prepare(true, shape, policy, in, out);
  if (!impl.ok()) return impl.status();
  return std::unique_ptr<CudaCodecBatch>(new CudaCodecBatch(*std::move(impl)));
}

absl::StatusOr<std::unique_ptr<CudaCodecBatch>> CudaCodecBatch::Decode(
    const BlockShape& shape, const CodecPolicy& policy,
    absl::Span<const uint8_t* const> encoded_in,
    absl::Span<uint16_t* const> fp16_out) {
  std::vector<uint16_t*> out(fp16_out.begin(), fp16_out.end());
  std::vector<uint8_t*> in(encoded_in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = const_cast<uint8_t*>(encoded_in[i]);  // read only by the kernels
  }
  absl::StatusOr<std::unique_ptr<Impl>> impl =
      Prepare(false, shape, policy, out, in);
  if (!impl.ok()) return impl.status();
  return std::unique_ptr<CudaCodecBatch>(new CudaCodecBatch(*std::move(impl)));
}

absl::Status CudaCodecBatch::Launch(void* stream) const {
  internal::DevicePlan p = PlanAt(impl_->hp, impl_->blob, impl_->dev);
  uint16_t* const* in_ptrs =
      reinterpret_cast<uint16_t* const*>(impl_->dev + impl_->blob.in_at);
  uint8_t* const* out_ptrs =
      reinterpret_cast<uint8_t* const*>(impl_->dev + impl_->blob.out_at);
  auto s = static_cast<cudaStream_t>(stream);
  for (size_t b0 = 0; b0 < impl_->blocks; b0 += kMaxBlocksPerLaunch) {
    p.num_blocks = static_cast<uint32_t>(
        std::min(kMaxBlocksPerLaunch, impl_->blocks - b0));
    p.fp16 = in_ptrs + b0;
    p.encoded = out_ptrs + b0;
    const cudaError_t err = impl_->encode ? internal::LaunchEncode(p, s)
                                          : internal::LaunchDecode(p, s);
    if (err != cudaSuccess) return CudaError(err, "kernel launch");
  }
  return absl::OkStatus();
}

}  // namespace kvcache::kernels::cuda
