// Reads decoded on the client (ClientOptions::decode_on_client): an fp16
// read of encoded blocks travels as their raw encoding, and the client
// turns it into fp16 with the same codec code the node would have run, so
// the bytes a caller gets are the same either way, bit for bit.
//
// "fp16" here is the namespace's source dtype (fp16 or bf16): both are two
// bytes per value, and the codecs decode into the dtype of the shape.
#ifndef KVCACHE_CLIENT_READ_DECODE_H_
#define KVCACHE_CLIENT_READ_DECODE_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "kvcache/client.h"

namespace kvcache::internal {

// The policy a block stored with `block_codec` was encoded with, in a
// namespace whose policy is `ns_policy`: that policy, or none for a block
// kept fp16 (KIVI's residual window). DATA_LOSS for any other codec.
absl::StatusOr<CodecPolicy> StoredPolicy(const CodecPolicy& ns_policy,
                                         Codec block_codec);

// Decodes layers [from, to) of one raw block (`raw`: its whole encoding
// with `policy`) into `fp16`, the block's whole fp16 bytes (layer l at
// l * fp16_bytes / num_layers). DATA_LOSS when `raw` is not the size of
// that encoding or does not decode; INVALID_ARGUMENT when `fp16` is not the
// block's fp16 size.
absl::Status DecodeRawLayers(const BlockShape& shape, const CodecPolicy& policy,
                             absl::Span<const uint8_t> raw, uint32_t from,
                             uint32_t to, absl::Span<uint8_t> fp16);

// A LayerDecoder whose blocks hold at least this many fp16 bytes writes
// them with stores that bypass the cache (kernels::DecodeStores::kStreaming,
// and StreamCopy for blocks stored fp16): more than a core's cache holds is
// written before the caller reads any of it, so each line is written
// without first being read from memory (docs/benchmarks.md, "Shared-memory
// reads with stores that bypass the cache").
inline constexpr uint64_t kStreamingDecodeBytes = uint64_t{4} << 20;

// The raw blocks of an answer to a read asked for in fp16, decoded in place
// of their bytes (blocks stored fp16 are already); every block's format is
// then kFp16. DATA_LOSS as DecodeRawLayers. Ordinary stores: each block's
// string is zero-filled first, which reads its lines already.
absl::Status DecodeResultToFp16(GetResult& result);

// The blocks of a GetInto that land raw in a scratch buffer and are
// decoded into the caller's memory as their layers are waited for
// (PendingRead::WaitLayer), streamed when the blocks' fp16 bytes together
// are at least kStreamingDecodeBytes. Thread-safe; the first error sticks.
class LayerDecoder {
 public:
  struct Block {
    absl::Span<const uint8_t> raw;  // the block's encoding as it lands
    CodecPolicy policy;             // StoredPolicy of the block
    absl::Span<uint8_t> fp16;       // its slot in the caller's memory
  };
  LayerDecoder(BlockShape shape, std::vector<Block> blocks);

  // Decodes layers below `layers` of every block that are not decoded yet.
  // The caller has seen those layers land.
  absl::Status DecodeThrough(uint32_t layers);

 private:
  const BlockShape shape_;
  const std::vector<Block> blocks_;
  const bool stream_;
  // EncodedLayerOffsets of each block, computed once, not at every wait.
  std::vector<std::vector<size_t>> offsets_;
  Mutex mu_;
  uint32_t decoded_ ABSL_GUARDED_BY(mu_) = 0;  // layers done, every block
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_READ_DECODE_H_
