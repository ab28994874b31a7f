// Block hash v1: published test vectors (computed independently with
// Python's xxhash package, see docs/client.md) and a second C++ path that
// builds the hashed bytes differently (XXH3 streaming state, explicit byte
// shifts, hand-written canonical form).
#include "kvcache/block_hash.h"

#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "xxhash.h"

namespace kvcache {
namespace {

// --- The independent path --------------------------------------------------

class Xxh3Stream {
 public:
  Xxh3Stream() : state_(XXH3_createState()) { XXH3_128bits_reset(state_); }
  ~Xxh3Stream() { XXH3_freeState(state_); }
  void Bytes(const void* p, size_t n) { XXH3_128bits_update(state_, p, n); }
  void U32(uint32_t v) {
    unsigned char b[4];
    for (int i = 0; i < 4; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    Bytes(b, 4);
  }
  void U64(uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    Bytes(b, 8);
  }
  std::string Digest() {
    XXH128_hash_t h = XXH3_128bits_digest(state_);
    std::string out(16, '\0');
    for (int i = 0; i < 8; ++i) {
      out[i] = static_cast<char>(h.high64 >> (56 - 8 * i));
      out[8 + i] = static_cast<char>(h.low64 >> (56 - 8 * i));
    }
    return out;
  }

 private:
  XXH3_state_t* state_;
};

std::string OtherRoot(uint64_t seed) {
  Xxh3Stream s;
  const char tag[] = "kvcache-block-hash-v1";
  s.Bytes(tag, sizeof(tag) - 1);
  s.U64(seed);
  return s.Digest();
}

std::vector<std::string> OtherChain(uint32_t n, uint64_t seed,
                                    const std::vector<uint32_t>& tokens,
                                    const std::string& extra) {
  std::vector<std::string> keys;
  std::string parent = OtherRoot(seed);
  for (size_t start = 0; start + n <= tokens.size(); start += n) {
    Xxh3Stream s;
    s.Bytes(parent.data(), parent.size());
    s.U32(n);
    for (size_t i = start; i < start + n; ++i) s.U32(tokens[i]);
    s.U32(static_cast<uint32_t>(extra.size()));
    s.Bytes(extra.data(), extra.size());
    parent = s.Digest();
    keys.push_back(parent);
  }
  return keys;
}

std::string Hex(const std::string& s) { return absl::BytesToHexString(s); }

// --- Published vectors (docs/client.md) ------------------------------------

struct Vector {
  uint32_t tokens_per_block;
  uint64_t seed;
  std::vector<uint32_t> tokens;
  std::vector<std::string> extra_parts;  // EncodeExtraKeys; empty: none
  std::string root;
  std::string extra_hex;
  std::vector<std::string> keys;
};

std::vector<Vector> Vectors() {
  std::vector<uint32_t> c;
  for (uint64_t i = 0; i < 32; ++i) {
    c.push_back(static_cast<uint32_t>((i * 2654435761ull) % (1ull << 32)));
  }
  return {
      {4,
       0,
       {1, 2, 3, 4, 5, 6, 7, 8, 9},
       {},
       "3c299bea12cf2c1cff84ad20ee5bd56c",
       "",
       {"e909e7a337742300b1c3da26a989a5cc",
        "c9702797e95401505ee94e0b977e952d"}},
      {4,
       42,
       {1, 2, 3, 4, 5, 6, 7, 8, 9},
       {"lora:7", "salt:tenant-a"},
       "6a0229e1992291fe5e425e6ac35dc53b",
       "02000000060000006c6f72613a370d00000073616c743a74656e616e742d61",
       {"9fa1881f3e7803d93617c1388f251f9d",
        "7ca3661ad4b5c5e50bdd6de1c7f5b947"}},
      {16,
       0xFFFFFFFFFFFFFFFFull,
       c,
       {},
       "b4c3ed4ccb67c4e15789fa77dc31cd7d",
       "",
       {"19ee68e286d0342a240e5b5a865e7998",
        "78b7fd88d4ce1ccd849feb58b8f1d175"}},
  };
}

TEST(BlockHashTest, PublishedVectors) {
  for (const Vector& v : Vectors()) {
    SCOPED_TRACE(::testing::Message() << "seed " << v.seed);
    const std::string extra =
        v.extra_parts.empty() ? "" : EncodeExtraKeys(v.extra_parts);
    EXPECT_EQ(Hex(extra), v.extra_hex);
    EXPECT_EQ(HexKey(BlockHashRoot(v.seed)), v.root);
    EXPECT_EQ(Hex(OtherRoot(v.seed)), v.root);
    BlockHashConfig config{v.tokens_per_block, v.seed, extra};
    auto keys = BlockHashChain(config, v.tokens);
    ASSERT_TRUE(keys.ok()) << keys.status();
    ASSERT_EQ(keys->size(), v.keys.size());
    std::vector<std::string> other =
        OtherChain(v.tokens_per_block, v.seed, v.tokens, extra);
    for (size_t i = 0; i < v.keys.size(); ++i) {
      EXPECT_EQ(HexKey((*keys)[i]), v.keys[i]) << "key " << i;
      EXPECT_EQ(Hex(other[i]), v.keys[i]) << "key " << i << " (other path)";
    }
  }
}

TEST(BlockHashTest, AgreesWithIndependentPathOnRandomPrompts) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const uint32_t n = 1 + rng() % 40;
    const uint64_t seed = rng();
    std::vector<uint32_t> tokens(rng() % 300);
    for (uint32_t& t : tokens) t = static_cast<uint32_t>(rng());
    std::string extra;
    if (trial % 3 == 0)
      extra = EncodeExtraKeys({"lora:" + std::to_string(trial)});
    auto keys = BlockHashChain({n, seed, extra}, tokens);
    ASSERT_TRUE(keys.ok());
    EXPECT_EQ(keys->size(), tokens.size() / n);
    std::vector<std::string> other = OtherChain(n, seed, tokens, extra);
    ASSERT_EQ(keys->size(), other.size());
    for (size_t i = 0; i < other.size(); ++i) {
      ASSERT_EQ((*keys)[i], other[i]) << "trial " << trial << " key " << i;
      ASSERT_EQ((*keys)[i].size(), kBlockKeyBytes);
    }
  }
}

TEST(BlockHashTest, ChainIsPrefixStableAndSensitive) {
  std::vector<uint32_t> tokens(100);
  for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i * 7 + 1;
  auto full = BlockHashChain({8, 1, ""}, tokens);
  auto part =
      BlockHashChain({8, 1, ""}, absl::MakeConstSpan(tokens).subspan(0, 50));
  ASSERT_TRUE(full.ok() && part.ok());
  ASSERT_EQ(full->size(), 12u);
  ASSERT_EQ(part->size(), 6u);
  for (size_t i = 0; i < part->size(); ++i) EXPECT_EQ((*part)[i], (*full)[i]);

  // Each input changes every key from its block on, and none before.
  std::vector<uint32_t> changed = tokens;
  changed[20] ^= 1;  // block 2 of 8-token blocks
  auto c = BlockHashChain({8, 1, ""}, changed);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)[0], (*full)[0]);
  EXPECT_EQ((*c)[1], (*full)[1]);
  for (size_t i = 2; i < c->size(); ++i) EXPECT_NE((*c)[i], (*full)[i]);

  auto seeded = BlockHashChain({8, 2, ""}, tokens);
  auto salted = BlockHashChain({8, 1, EncodeExtraKeys({"salt:x"})}, tokens);
  auto reblocked = BlockHashChain({4, 1, ""}, tokens);
  std::set<std::string> all;
  for (const auto* v : {&*full, &*seeded, &*salted, &*reblocked}) {
    all.insert(v->begin(), v->end());
  }
  all.insert(BlockHashRoot(1));
  EXPECT_EQ(all.size(), 12u * 3 + 25 + 1) << "no two keys collide";

  // Extra keys are length-prefixed: splitting bytes differently differs.
  EXPECT_NE(EncodeExtraKeys({"ab", "c"}), EncodeExtraKeys({"a", "bc"}));
}

TEST(BlockHashTest, RoutingTagsPublishedVectorAndStructure) {
  std::vector<uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  BlockHashConfig config{2, 7, ""};
  config.segment_blocks = 2;
  auto tagged = BlockHashChain(config, tokens);
  ASSERT_TRUE(tagged.ok());
  const std::vector<std::string> want = {
      "2062425a7c57e8392062425a7c57e839a2e87635aa96b7dc",
      "2062425a7c57e83950c7d7c06537ae3b6468044d80a5ed3c",
      "c4b0ddcaad495a75c4b0ddcaad495a75f82abbdfb223584f",
      "c4b0ddcaad495a75e6db3fbc0d9a1b76e734acea9c29d76d",
      "309a9697463a1dda309a9697463a1dda761d4e6fd6ea27d3"};
  ASSERT_EQ(tagged->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_EQ(HexKey((*tagged)[i]), want[i]);

  // Tag || the plain chain's key; the tag is the segment head's first bytes.
  for (uint32_t s : {1u, 3u, 4u, 64u}) {
    config.segment_blocks = s;
    tagged = BlockHashChain(config, tokens);
    std::vector<std::string> plain = OtherChain(2, 7, tokens, "");
    ASSERT_TRUE(tagged.ok());
    ASSERT_EQ(tagged->size(), plain.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_EQ((*tagged)[i].size(), kRoutingTagBytes + kBlockKeyBytes);
      EXPECT_EQ((*tagged)[i].substr(kRoutingTagBytes), plain[i]);
      EXPECT_EQ((*tagged)[i].substr(0, kRoutingTagBytes),
                plain[i - i % s].substr(0, kRoutingTagBytes))
          << "segment " << s << " block " << i;
    }
  }
}

TEST(BlockHashTest, RejectsZeroBlockSizeAndIgnoresPartialTail) {
  std::vector<uint32_t> tokens = {1, 2, 3};
  EXPECT_EQ(BlockHashChain({0, 0, ""}, tokens).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto keys = BlockHashChain({4, 0, ""}, tokens);
  ASSERT_TRUE(keys.ok());
  EXPECT_TRUE(keys->empty());
}

}  // namespace
}  // namespace kvcache
