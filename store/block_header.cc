#include "store/block_header.h"

#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
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

BlockHeader MakeBlockHeader(const kernels::BlockShape& shape,
                            const kernels::CodecPolicy& policy,
                            uint64_t namespace_fingerprint,
                            absl::string_view key,
                            absl::Span<const uint8_t> payload) {
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
  header.payload_bytes = payload.size();
  header.payload_checksum = HashBytes(payload);
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
                             payload.size(), HashBytes(payload));
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
