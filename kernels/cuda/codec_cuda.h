// The CUDA codecs: the same formats and bytes as kernels/codec.h, computed on
// the GPU from and into device memory. Built only when KVCACHE_HAVE_CUDA
// (target kvcache_kernels_cuda); this header needs no CUDA headers.
//
// Every call is synchronous with respect to `stream` (a cudaStream_t, nullptr
// for the default stream): it returns once the work it queued has finished,
// so the status is final. Pointers are device pointers (or managed memory).
#ifndef KVCACHE_KERNELS_CUDA_CODEC_CUDA_H_
#define KVCACHE_KERNELS_CUDA_CODEC_CUDA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace kvcache::kernels::cuda {

// Number of CUDA devices the runtime sees; 0 when there is no driver, no
// device, or the runtime fails to initialize (never an error).
int CudaDeviceCount();
inline bool CudaAvailable() { return CudaDeviceCount() > 0; }
// "name, compute capability, memory" of the current device, for reports.
std::string CudaDeviceDescription();

// Encodes num blocks of the same shape and policy: fp16_in[i] holds
// Fp16BlockBytes(shape) bytes, encoded_out[i] EncodedBlockBytes(shape, policy)
// bytes. The spans hold device pointers (the arrays themselves are host
// memory). INVALID_ARGUMENT for an invalid policy, mismatched span lengths
// or null pointers, and for non-finite input: the message names the block in
// the batch, layer, K|V, head, token and channel of the first one (the
// outputs are then unspecified; check before committing them). INTERNAL for
// CUDA errors. Bit-identical to EncodeBlockReference.
absl::Status EncodeBlocksCuda(const BlockShape& shape,
                              const CodecPolicy& policy,
                              absl::Span<const uint16_t* const> fp16_in,
                              absl::Span<uint8_t* const> encoded_out,
                              void* stream = nullptr);
absl::Status DecodeBlocksCuda(const BlockShape& shape,
                              const CodecPolicy& policy,
                              absl::Span<const uint8_t* const> encoded_in,
                              absl::Span<uint16_t* const> fp16_out,
                              void* stream = nullptr);

// A batch prepared once and launched many times (kvcache_gpu_bench times the
// kernels alone with it): its plan and pointer arrays live in device memory
// the object owns. Launch queues the batch's kernels on `stream` and returns
// without waiting; once the stream has run them the outputs are those of
// EncodeBlocksCuda / DecodeBlocksCuda, except that rejected input is not
// reported. The pointers must stay valid while the object lives.
class CudaCodecBatch {
 public:
  static absl::StatusOr<std::unique_ptr<CudaCodecBatch>> Encode(
      const BlockShape& shape, const CodecPolicy& policy,
      absl::Span<const uint16_t* const> fp16_in,
      absl::Span<uint8_t* const> encoded_out);
  static absl::StatusOr<std::unique_ptr<CudaCodecBatch>> Decode(
      const BlockShape& shape, const CodecPolicy& policy,
      absl::Span<const uint8_t* const> encoded_in,
      absl::Span<uint16_t* const> fp16_out);
  ~CudaCodecBatch();
  CudaCodecBatch(const CudaCodecBatch&) = delete;
  CudaCodecBatch& operator=(const CudaCodecBatch&) = delete;

  // INTERNAL when a launch fails.
  absl::Status Launch(void* stream = nullptr) const;

  struct Impl;  // opaque: defined in codec_cuda.cc

 private:
  explicit CudaCodecBatch(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcache::kernels::cuda

#endif  // KVCACHE_KERNELS_CUDA_CODEC_CUDA_H_
