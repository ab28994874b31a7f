// BlockHeader: the self-description stored in front of every block's payload
// and checked on every read (BRIEF section 3).
//
// A stored block is `BlockHeader` (72 bytes, little-endian fields) followed by
// `payload_bytes` of encoded KV. Verify() accepts a header only when its
// magic, version, header checksum, namespace fingerprint, layout, codec and
// key hash all match what the index expects, and the payload's xxh3-64
// checksum matches `payload_checksum`. Anything else is data loss.
#ifndef KVCACHE_STORE_BLOCK_HEADER_H_
#define KVCACHE_STORE_BLOCK_HEADER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace kvcache::store {

inline constexpr uint32_t kBlockMagic = 0x3142564B;  // "KVB1"
inline constexpr uint16_t kBlockFormatVersion = 1;

struct BlockHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t codec;       // kernels::Codec actually used for this block
  uint8_t scale_mode;  // kernels::ScaleMode
  uint64_t namespace_fingerprint;
  uint32_t num_layers;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t tokens;
  uint32_t kivi_group_size;
  uint32_t reserved;
  uint64_t payload_bytes;
  uint64_t payload_checksum;  // xxh3-64 of the payload
  uint64_t key_hash;          // xxh3-64 of the block key
  uint64_t header_checksum;   // xxh3-64 of the 64 bytes above
};
static_assert(sizeof(BlockHeader) == 72, "BlockHeader layout is on-arena ABI");

uint64_t HashBytes(absl::Span<const uint8_t> bytes);
uint64_t HashString(absl::string_view s);

// Fills every field, including both checksums.
BlockHeader MakeBlockHeader(const kernels::BlockShape& shape,
                            const kernels::CodecPolicy& policy,
                            uint64_t namespace_fingerprint,
                            absl::string_view key,
                            absl::Span<const uint8_t> payload);

// DATA_LOSS naming the first mismatch, or OK. `payload_checksum` is the
// xxh3-64 the caller computed over the payload as stored (for a payload
// that is not contiguous, by streaming XXH3 over its pieces in order).
absl::Status VerifyBlockMetadata(const BlockHeader& header,
                                 const kernels::BlockShape& shape,
                                 const kernels::CodecPolicy& policy,
                                 uint64_t namespace_fingerprint,
                                 absl::string_view key, uint64_t payload_bytes,
                                 uint64_t payload_checksum);

// VerifyBlockMetadata over a contiguous payload.
absl::Status VerifyBlock(const BlockHeader& header,
                         const kernels::BlockShape& shape,
                         const kernels::CodecPolicy& policy,
                         uint64_t namespace_fingerprint, absl::string_view key,
                         absl::Span<const uint8_t> payload);

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_BLOCK_HEADER_H_
