// Block hashing for engine integration: the versioned, chained prefix hash
// that turns a prompt's token ids into store keys, so that every process of
// a fleet (prefill and decode workers, any language) computes the same keys
// for the same prefix.
//
// Scheme v1 (kBlockHashVersion), byte for byte. Notation: `||` concatenates
// byte strings; le32(x) / le64(x) are the 4 / 8 bytes of x little-endian;
// H(b) is XXH3-128 (xxHash 0.8, seed 0, default secret) of the bytes b,
// written in its 16-byte canonical form (high 64 bits big-endian, then low
// 64 bits big-endian; what XXH128_canonicalFromHash and Python's
// xxhash.xxh3_128(b).digest() produce).
//
//   root(seed) = H("kvcache-block-hash-v1" || le64(seed))   (21 ASCII bytes)
//   key_i      = H(parent_i || le32(n) || le32(t_0) || ... || le32(t_{n-1})
//                  || le32(len(extra_i)) || extra_i)
//   parent_0   = root(seed); parent_i = key_{i-1}
//
// where t_0..t_{n-1} are the n = tokens_per_block token ids of block i (the
// prompt's tokens [i*n, (i+1)*n)) and extra_i are the block's extra key
// bytes (empty for none). Every key is 16 bytes. Only full blocks have
// keys; the trailing partial block of a prompt has none. The root is not a
// block key and is never stored.
//
// `seed` separates fleets or models that must never share blocks (the
// namespace already separates models and layouts; the seed is for, e.g., a
// tenant). Extra keys change the KV a block represents: a LoRA adapter, a
// cache salt, multimodal input hashes. Encode several with EncodeExtraKeys
// so that the bytes are unambiguous.
//
// Routing tags (optional, segment_blocks = S > 0): the store key of block i
// is then tag_i || key_i (24 bytes), where tag_i is the first 8 bytes of
// key_{i - i mod S}, the key of the first block of its segment of S blocks.
// The chain itself is unchanged (parents are the 16-byte key_i). A
// ClusterClient with routing_prefix_bytes = 8 places a block by its tag, so
// the S blocks of a segment live on one node: their parent links are local,
// which prefix-aware eviction and KIVI's residual window (re-encoding a
// block when a descendant pushes it out of the fp16 window) rely on.
//
// Test vectors: docs/client.md.
#ifndef KVCACHE_CLIENT_BLOCK_HASH_H_
#define KVCACHE_CLIENT_BLOCK_HASH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcache {

inline constexpr int kBlockHashVersion = 1;
inline constexpr size_t kBlockKeyBytes = 16;
inline constexpr size_t kRoutingTagBytes = 8;
// The domain tag of the root, without a terminating NUL.
inline constexpr absl::string_view kBlockHashTagV1 = "kvcache-block-hash-v1";

struct BlockHashConfig {
  uint32_t tokens_per_block = 0;  // must equal the namespace's layout
  uint64_t seed = 0;
  // The same extra key bytes for every block of the prompt (empty: none).
  // For per-block extras, chain BlockHashNext yourself.
  std::string extra;
  // > 0: prefix every key with the routing tag of its segment of this many
  // blocks (see above); 0: plain 16-byte keys.
  uint32_t segment_blocks = 0;
};

// root(seed): the parent of a chain's first block.
std::string BlockHashRoot(uint64_t seed);

// key_i from its parent (16 bytes: the root or the previous key), the
// block's token ids and its extra key bytes.
std::string BlockHashNext(absl::string_view parent,
                          absl::Span<const uint32_t> tokens,
                          absl::string_view extra);

// Store keys of the floor(tokens.size() / tokens_per_block) full blocks of
// a prompt (with routing tags when segment_blocks > 0). INVALID_ARGUMENT
// when tokens_per_block is 0.
absl::StatusOr<std::vector<std::string>> BlockHashChain(
    const BlockHashConfig& config, absl::Span<const uint32_t> tokens);

// le32(parts.size()) || for each part: le32(len(part)) || part.
// E.g. EncodeExtraKeys({"lora:7", "salt:tenant-a"}).
std::string EncodeExtraKeys(absl::Span<const std::string> parts);

// Lower-case hex of bytes (for logs and test vectors).
std::string HexKey(absl::string_view key);

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_BLOCK_HASH_H_
