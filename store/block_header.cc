#include "store/block_header.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include "xxhash.h"
// Runtime-dispatched XXH3 (AVX2/AVX-512 where present; same output): about
// twice the SSE2 baseline the shared library is built for.
#if defined(__x86_64__)
#include "xxh_x86dispatch.h"
#endif

namespace kvcache::store {
namespace {

uint64_t HeaderChecksum(const BlockHeader& header) {
  return XXH3_64bits(&header, offsetof(BlockHeader, header_checksum));
}

}  // namespace

uint64_t HashBytes(absl::Span<const uint8_t> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

uint64_t HashString(absl::string_view s) {
  return XXH3_64bits(s.data(), s.size());
}

std::vector<uint64_t> ChecksumLayerEnds(const kernels::BlockShape& shape,
                                        const kernels::CodecPolicy& policy,
                                        uint64_t payload_bytes) {
  if (kernels::ValidatePolicy(shape, policy).ok()) {
    const std::vector<size_t> offsets =
        kernels::EncodedLayerOffsets(shape, policy);
    if (offsets.back() == payload_bytes) {
      return std::vector<uint64_t>(offsets.begin() + 1, offsets.end());
    }
  }
  return {payload_bytes};
}

std::vector<uint64_t> LayerChecksums(absl::Span<const uint8_t> payload,
                                     absl::Span<const uint64_t> layer_ends) {
  std::vector<uint64_t> sums;
  sums.reserve(layer_ends.size());
  uint64_t start = 0;
  for (uint64_t end : layer_ends) {
    sums.push_back(XXH3_64bits(payload.data() + start, end - start));
    start = end;
  }
  return sums;
}

std::vector<uint64_t> LayerChecksums(
    absl::Span<const absl::Span<const uint8_t>> pieces,
    absl::Span<const uint64_t> layer_ends) {
  std::vector<uint64_t> sums;
  sums.reserve(layer_ends.size());
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  uint64_t at = 0;  // payload offset of the next byte hashed
  auto layer = layer_ends.begin();
  for (absl::Span<const uint8_t> piece : pieces) {
    size_t used = 0;
    while (used < piece.size() && layer != layer_ends.end()) {
      const size_t n = std::min<uint64_t>(piece.size() - used, *layer - at);
      XXH3_64bits_update(&state, piece.data() + used, n);
      used += n;
      at += n;
      if (at == *layer) {
        sums.push_back(XXH3_64bits_digest(&state));
        XXH3_64bits_reset(&state);
        ++layer;
      }
    }
  }
  // Pieces shorter than the layers: the missing layers hash what they got,
  // which the header's length check rejects anyway.
  for (; layer != layer_ends.end(); ++layer) {
    sums.push_back(XXH3_64bits_digest(&state));
    XXH3_64bits_reset(&state);
  }
  return sums;
}

uint64_t CombineLayerChecksums(absl::Span<const uint64_t> layer_checksums) {
  // Little-endian on every target this builds for (x86-64, aarch64).
  return XXH3_64bits(layer_checksums.data(),
                     layer_checksums.size() * sizeof(uint64_t));
}

uint64_t PayloadChecksum(const kernels::BlockShape& shape,
                         const kernels::CodecPolicy& policy,
                         absl::Span<const uint8_t> payload) {
  return CombineLayerChecksums(LayerChecksums(
      payload, ChecksumLayerEnds(shape, policy, payload.size())));
}

BlockHeader MakeBlockHeader(const kernels::BlockShape& shape,
                            const kernels::CodecPolicy& policy,
                            uint64_t namespace_fingerprint,
                            absl::string_view key,
                            absl::Span<const uint8_t> payload) {
  return MakeBlockHeader(shape, policy, namespace_fingerprint, key,
                         payload.size(),
                         PayloadChecksum(shape, policy, payload));
}

BlockHeader MakeBlockHeader(const kernels::BlockShape& shape,
                            const kernels::CodecPolicy& policy,
                            uint64_t namespace_fingerprint,
                            absl::string_view key, uint64_t payload_bytes,
                            uint64_t payload_checksum) {
  BlockHeader header;
  std::memset(&header, 0, sizeof(header));
  header.magic = kBlockMagic;
  header.version = kBlockFormatVersion;
  header.codec = static_cast<uint8_t>(policy.codec);
  header.scale_mode = static_cast<uint8_t>(policy.scale_mode);
  header.namespace_fingerprint = namespace_fingerprint;
  header.num_layers = shape.num_layers;
  header.num_kv_heads = shape.num_kv_heads;
  header.head_dim = shape.head_dim;
  header.tokens = shape.tokens_per_block;
  header.kivi_group_size = policy.kivi_group_size;
  header.payload_bytes = payload_bytes;
  header.payload_checksum = payload_checksum;
  header.key_hash = HashString(key);
  header.header_checksum = HeaderChecksum(header);
  return header;
}

absl::Status VerifyBlock(const BlockHeader& header,
                         const kernels::BlockShape& shape,
                         const kernels::CodecPolicy& policy,
                         uint64_t namespace_fingerprint, absl::string_view key,
                         absl::Span<const uint8_t> payload) {
  return VerifyBlockMetadata(header, shape, policy, namespace_fingerprint, key,
                             payload.size(),
                             PayloadChecksum(shape, policy, payload));
}

absl::Status VerifyBlockMetadata(const BlockHeader& header,
                                 const kernels::BlockShape& shape,
                                 const kernels::CodecPolicy& policy,
                                 uint64_t namespace_fingerprint,
                                 absl::string_view key, uint64_t payload_bytes,
                                 uint64_t payload_checksum) {
  auto loss = [](absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat("stored block failed verification: ", what));
  };
  if (header.magic != kBlockMagic) return loss("bad magic");
  if (header.version != kBlockFormatVersion) return loss("unknown version");
  if (header.header_checksum != HeaderChecksum(header)) {
    return loss("header checksum mismatch");
  }
  if (header.namespace_fingerprint != namespace_fingerprint) {
    return loss("namespace fingerprint mismatch");
  }
  if (header.num_layers != shape.num_layers ||
      header.num_kv_heads != shape.num_kv_heads ||
      header.head_dim != shape.head_dim ||
      header.tokens != shape.tokens_per_block) {
    return loss("layout mismatch");
  }
  if (header.codec != static_cast<uint8_t>(policy.codec) ||
      header.scale_mode != static_cast<uint8_t>(policy.scale_mode) ||
      header.kivi_group_size != policy.kivi_group_size) {
    return loss("codec mismatch");
  }
  if (header.key_hash != HashString(key)) return loss("key mismatch");
  if (header.payload_bytes != payload_bytes) return loss("length mismatch");
  if (header.payload_checksum != payload_checksum) {
    return loss("payload checksum mismatch");
  }
  return absl::OkStatus();
}

}  // namespace kvcache::store
