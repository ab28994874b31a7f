#include "kvcache/block_hash.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "xxhash.h"

namespace kvcache {
namespace {

void AppendLe32(uint32_t v, std::string* out) {
  const char bytes[4] = {static_cast<char>(v), static_cast<char>(v >> 8),
                         static_cast<char>(v >> 16),
                         static_cast<char>(v >> 24)};
  out->append(bytes, 4);
}

std::string Canonical(const std::string& bytes) {
  XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, h);
  return std::string(reinterpret_cast<const char*>(canonical.digest),
                     sizeof(canonical.digest));
}

}  // namespace

std::string BlockHashRoot(uint64_t seed) {
  std::string bytes(kBlockHashTagV1);
  AppendLe32(static_cast<uint32_t>(seed), &bytes);
  AppendLe32(static_cast<uint32_t>(seed >> 32), &bytes);
  return Canonical(bytes);
}

std::string BlockHashNext(absl::string_view parent,
                          absl::Span<const uint32_t> tokens,
                          absl::string_view extra) {
  std::string bytes;
  bytes.reserve(parent.size() + 8 + 4 * tokens.size() + extra.size());
  bytes.append(parent.data(), parent.size());
  AppendLe32(static_cast<uint32_t>(tokens.size()), &bytes);
  for (uint32_t t : tokens) AppendLe32(t, &bytes);
  AppendLe32(static_cast<uint32_t>(extra.size()), &bytes);
  bytes.append(extra.data(), extra.size());
  return Canonical(bytes);
}

absl::StatusOr<std::vector<std::string>> BlockHashChain(
    const BlockHashConfig& config, absl::Span<const uint32_t> tokens) {
  if (config.tokens_per_block == 0) {
    return absl::InvalidArgumentError("tokens_per_block must be > 0");
  }
  const size_t n = config.tokens_per_block;
  const size_t s = config.segment_blocks;
  std::vector<std::string> keys;
  keys.reserve(tokens.size() / n);
  std::string parent = BlockHashRoot(config.seed);
  std::string tag;
  for (size_t i = 0; (i + 1) * n <= tokens.size(); ++i) {
    parent = BlockHashNext(parent, tokens.subspan(i * n, n), config.extra);
    if (s == 0) {
      keys.push_back(parent);
      continue;
    }
    if (i % s == 0) tag = parent.substr(0, kRoutingTagBytes);
    keys.push_back(tag + parent);
  }
  return keys;
}

std::string EncodeExtraKeys(absl::Span<const std::string> parts) {
  std::string out;
  AppendLe32(static_cast<uint32_t>(parts.size()), &out);
  for (const std::string& p : parts) {
    AppendLe32(static_cast<uint32_t>(p.size()), &out);
    out.append(p);
  }
  return out;
}

std::string HexKey(absl::string_view key) {
  return absl::BytesToHexString(key);
}

}  // namespace kvcache
