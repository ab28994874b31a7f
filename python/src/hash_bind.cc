// The store's v1 block hash (kvcache/block_hash.h): the keys every process
// of a fleet computes alike from token ids.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bind.h"
#include "kvcache/block_hash.h"

namespace kvcache::python {
namespace {

nb::bytes Bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

std::string FromBytes(const nb::bytes& b) { return {b.c_str(), b.size()}; }

std::vector<uint32_t> Tokens(nb::handle tokens) {
  std::vector<uint32_t> out;
  out.reserve(nb::len(tokens));
  for (nb::handle t : tokens) {
    int64_t v = nb::cast<int64_t>(t);
    if (v < 0 || v > 0xFFFFFFFFll) {
      Throw(absl::InvalidArgumentError("token ids must be in [0, 2^32)"));
    }
    out.push_back(static_cast<uint32_t>(v));
  }
  return out;
}

}  // namespace

void BindHashing(nb::module_& m) {
  m.attr("BLOCK_HASH_VERSION") = kBlockHashVersion;
  m.attr("BLOCK_KEY_BYTES") = kBlockKeyBytes;
  m.def(
      "block_hash_root",
      [](uint64_t seed) { return Bytes(BlockHashRoot(seed)); },
      nb::arg("seed") = 0, "root(seed): the parent of a chain's first block.");
  m.def(
      "block_hash_next",
      [](const nb::bytes& parent, nb::handle tokens, const nb::bytes& extra) {
        std::vector<uint32_t> t = Tokens(tokens);
        return Bytes(BlockHashNext(FromBytes(parent), t, FromBytes(extra)));
      },
      nb::arg("parent"), nb::arg("tokens"), nb::arg("extra") = nb::bytes("", 0),
      "The key of a block from its parent key (or the root), its token ids "
      "and its extra key bytes.");
  m.def(
      "block_hash_chain",
      [](nb::handle tokens, uint32_t tokens_per_block, uint64_t seed,
         const nb::bytes& extra, uint32_t segment_blocks) {
        std::vector<uint32_t> t = Tokens(tokens);
        BlockHashConfig config{tokens_per_block, seed, FromBytes(extra),
                               segment_blocks};
        std::vector<std::string> keys = Value(BlockHashChain(config, t));
        nb::list out;
        for (const std::string& k : keys) out.append(Bytes(k));
        return out;
      },
      nb::arg("tokens"), nb::arg("tokens_per_block"), nb::kw_only(),
      nb::arg("seed") = 0, nb::arg("extra") = nb::bytes("", 0),
      nb::arg("segment_blocks") = 0,
      "Keys of the full blocks of a prompt (docs/client.md, 'Block "
      "hashing'); with segment_blocks > 0, prefixed with routing tags.");
  m.def(
      "encode_extra_keys",
      [](nb::handle parts) {
        std::vector<std::string> p = Keys(parts);
        return Bytes(EncodeExtraKeys(p));
      },
      nb::arg("parts"),
      "Several extra keys (LoRA name, cache salt, multimodal hashes) as one "
      "unambiguous byte string.");
  m.def(
      "hex_key", [](const nb::bytes& key) { return HexKey(FromBytes(key)); },
      nb::arg("key"));
}

}  // namespace kvcache::python
