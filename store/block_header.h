// BlockHeader: the self-description stored in front of every block's payload
// and checked on every read (BRIEF section 3).
//
// A stored block is `BlockHeader` (72 bytes, little-endian fields) followed by
// `payload_bytes` of encoded KV. Verify() accepts a header only when its
// magic, version, header checksum, namespace fingerprint, layout, codec and
// key hash all match what the index expects, and the payload's checksum
// matches `payload_checksum`. Anything else is data loss.
//
// The payload checksum (format version 2) is the xxh3-64 of the list of its
// layers' xxh3-64 checksums (little-endian u64s, layer order), so that one
// layer can be checked alone, in the same pass that copies it, against a
// list whose own digest the header vouches for. The layers are those of
// kernels::EncodedLayerOffsets (ChecksumLayerEnds).
#ifndef KVCACHE_STORE_BLOCK_HEADER_H_
#define KVCACHE_STORE_BLOCK_HEADER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace kvcache::store {

inline constexpr uint32_t kBlockMagic = 0x3142564B;  // "KVB1"
inline constexpr uint16_t kBlockFormatVersion = 2;

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
  uint64_t payload_checksum;  // CombineLayerChecksums of its layers
  uint64_t key_hash;          // xxh3-64 of the block key
  uint64_t header_checksum;   // xxh3-64 of the 64 bytes above
};
static_assert(sizeof(BlockHeader) == 72, "BlockHeader layout is on-arena ABI");

uint64_t HashBytes(absl::Span<const uint8_t> bytes);
uint64_t HashString(absl::string_view s);

// Where the layers that are checksummed one by one end in a payload of
// `payload_bytes`: EncodedLayerOffsets' ends where the policy is valid for
// the shape and they cover exactly the payload; otherwise the payload is
// one piece (a payload of the wrong size fails verification anyway).
std::vector<uint64_t> ChecksumLayerEnds(const kernels::BlockShape& shape,
                                        const kernels::CodecPolicy& policy,
                                        uint64_t payload_bytes);

// Each layer's xxh3-64; `layer_ends` ascending, its last == payload.size().
std::vector<uint64_t> LayerChecksums(absl::Span<const uint8_t> payload,
                                     absl::Span<const uint64_t> layer_ends);

// The same over a payload laid out in pieces, end to end.
std::vector<uint64_t> LayerChecksums(
    absl::Span<const absl::Span<const uint8_t>> pieces,
    absl::Span<const uint64_t> layer_ends);

// The payload checksum of a block whose layers have these checksums.
uint64_t CombineLayerChecksums(absl::Span<const uint64_t> layer_checksums);

// CombineLayerChecksums(LayerChecksums(payload, ChecksumLayerEnds(...))).
uint64_t PayloadChecksum(const kernels::BlockShape& shape,
                         const kernels::CodecPolicy& policy,
                         absl::Span<const uint8_t> payload);

// Fills every field; `payload_checksum` as PayloadChecksum computes it.
BlockHeader MakeBlockHeader(const kernels::BlockShape& shape,
                            const kernels::CodecPolicy& policy,
                            uint64_t namespace_fingerprint,
                            absl::string_view key, uint64_t payload_bytes,
                            uint64_t payload_checksum);

// Fills every field, including both checksums.
BlockHeader MakeBlockHeader(const kernels::BlockShape& shape,
                            const kernels::CodecPolicy& policy,
                            uint64_t namespace_fingerprint,
                            absl::string_view key,
                            absl::Span<const uint8_t> payload);

// DATA_LOSS naming the first mismatch, or OK. `payload_checksum` is what
// the caller computed over the payload as stored (PayloadChecksum, or
// CombineLayerChecksums of layer checksums it computed or holds).
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
