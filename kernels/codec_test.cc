#include "kernels/codec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/fp8.h"
#include "kernels/half.h"

namespace kvcache::kernels {
namespace {

using ::testing::HasSubstr;

size_t SectionElems(const BlockShape& s) {
  return size_t{s.tokens_per_block} * s.num_kv_heads * s.head_dim;
}

std::vector<uint16_t> GaussianBlock(const BlockShape& shape, uint32_t seed,
                                    float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<uint16_t> v(Fp16BlockBytes(shape) / 2);
  for (auto& x : v) x = HalfFromFloat(dist(rng));
  return v;
}

struct Encoded {
  std::vector<uint8_t> bytes;
  std::vector<uint16_t> decoded;
};

// Encodes and decodes with both the reference and the fast path, checks that
// they agree byte for byte, and returns the result.
Encoded RoundTrip(const BlockShape& shape, const CodecPolicy& policy,
                  const std::vector<uint16_t>& in) {
  Encoded e;
  e.bytes.resize(EncodedBlockBytes(shape, policy));
  std::vector<uint8_t> fast(e.bytes.size());
  EXPECT_TRUE(
      EncodeBlockReference(shape, policy, in, absl::MakeSpan(e.bytes)).ok());
  EXPECT_TRUE(EncodeBlock(shape, policy, in, absl::MakeSpan(fast)).ok());
  EXPECT_TRUE(e.bytes == fast) << "fast encode differs from the reference";
  e.decoded.resize(in.size());
  std::vector<uint16_t> fast_out(in.size());
  EXPECT_TRUE(
      DecodeBlockReference(shape, policy, e.bytes, absl::MakeSpan(e.decoded))
          .ok());
  EXPECT_TRUE(
      DecodeBlock(shape, policy, e.bytes, absl::MakeSpan(fast_out)).ok());
  EXPECT_TRUE(e.decoded == fast_out) << "fast decode differs from reference";
  return e;
}

double RelativeRmse(const std::vector<uint16_t>& a,
                    const std::vector<uint16_t>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = HalfToFloat(a[i]), y = HalfToFloat(b[i]);
    num += (x - y) * (x - y);
    den += x * x;
  }
  return std::sqrt(num / den);
}

TEST(CodecNameTest, RoundTripsAndRejectsUnknown) {
  EXPECT_EQ(CodecName(Codec::kNone), "none");
  EXPECT_EQ(CodecName(Codec::kFp8E4M3), "fp8_e4m3");
  EXPECT_EQ(CodecName(Codec::kFp8E5M2), "fp8_e5m2");
  EXPECT_EQ(CodecName(Codec::kKivi2), "kivi2");
  EXPECT_EQ(CodecName(Codec::kKivi4), "kivi4");
  for (Codec c : kAllCodecs) EXPECT_EQ(CodecFromName(CodecName(c)), c);
  EXPECT_EQ(CodecFromName("fp8"), std::nullopt);
  EXPECT_EQ(CodecFromName("KIVI2"), std::nullopt);
  EXPECT_EQ(CodecFromName(""), std::nullopt);
}

TEST(ValidatePolicyTest, AcceptsGoodPolicies) {
  const BlockShape shape{4, 8, 128, 32};
  for (Codec c : kAllCodecs) {
    CodecPolicy p;
    p.codec = c;
    p.fp16_layers = {0, 3};
    EXPECT_TRUE(ValidatePolicy(shape, p).ok()) << CodecName(c);
  }
  CodecPolicy p;
  p.codec = Codec::kFp8E4M3;
  p.scale_mode = ScaleMode::kStaticPerLayer;
  p.static_k_scales = {1, 2, 3, 4};
  p.static_v_scales = {0.5f, 0.25f, 1e-6f, 1e6f};
  EXPECT_TRUE(ValidatePolicy(shape, p).ok());
  p.scale_mode = ScaleMode::kStaticPerLayerHead;
  p.static_k_scales.assign(32, 0.1f);
  p.static_v_scales.assign(32, 0.2f);
  EXPECT_TRUE(ValidatePolicy(shape, p).ok());
  CodecPolicy k;
  k.codec = Codec::kKivi4;
  k.kivi_group_size = 16;
  EXPECT_TRUE(ValidatePolicy(BlockShape{1, 1, 48, 16}, k).ok());
}

TEST(ValidatePolicyTest, RejectsBadPolicies) {
  const BlockShape shape{4, 8, 128, 32};
  struct Case {
    std::string name;
    BlockShape shape;
    CodecPolicy policy;
    std::string message;
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, BlockShape s, CodecPolicy p,
                 std::string msg) {
    cases.push_back({std::move(name), s, std::move(p), std::move(msg)});
  };
  CodecPolicy none;
  add("zero layers", {0, 8, 128, 32}, none, "zero dimension");
  add("zero heads", {4, 0, 128, 32}, none, "zero dimension");
  add("zero dim", {4, 8, 0, 32}, none, "zero dimension");
  add("zero tokens", {4, 8, 128, 0}, none, "zero dimension");
  add("huge", {1u << 20, 1u << 10, 1u << 10, 1u << 10}, none, "too large");
  add("too many layers", {4097, 1, 32, 32}, none, "too large");
  add("layers past 32 bits", {0xFFFFFFFFu, 1, 32, 32}, none, "too large");
  CodecPolicy p;
  p.codec = static_cast<Codec>(9);
  add("unknown codec", shape, p, "unknown codec");
  p = CodecPolicy{};
  p.codec = Codec::kFp8E4M3;
  p.fp16_layers = {1, 4};
  add("skip out of range", shape, p, "fp16 layer 4 is out of range");
  p = CodecPolicy{};
  p.codec = Codec::kKivi2;
  p.scale_mode = ScaleMode::kStaticPerLayer;
  p.static_k_scales.assign(4, 1.0f);
  p.static_v_scales.assign(4, 1.0f);
  add("static for kivi", shape, p, "fp8 codecs only");
  p.codec = Codec::kNone;
  add("static for none", shape, p, "fp8 codecs only");
  p = CodecPolicy{};
  p.codec = Codec::kFp8E4M3;
  p.static_k_scales = {1, 1, 1, 1};
  add("scales with dynamic", shape, p, "dynamic scale mode");
  p.scale_mode = ScaleMode::kStaticPerLayer;
  p.static_v_scales = {1, 1, 1};
  add("v scale count", shape, p, "static_v_scales has 3 entries");
  p.static_v_scales = {1, 1, 1, 1};
  p.static_k_scales = {1, 1, 0, 1};
  add("zero scale", shape, p, "static_k_scales[2]");
  p.static_k_scales = {1, -1, 1, 1};
  add("negative scale", shape, p, "static_k_scales[1]");
  p.static_k_scales = {1, 1, 1, NAN};
  add("nan scale", shape, p, "static_k_scales[3]");
  p.static_k_scales = {INFINITY, 1, 1, 1};
  add("inf scale", shape, p, "static_k_scales[0]");
  p.scale_mode = ScaleMode::kStaticPerLayerHead;
  p.static_k_scales = {1, 1, 1, 1};
  add("per-head count", shape, p, "needs 32");
  p.scale_mode = static_cast<ScaleMode>(7);
  add("unknown scale mode", shape, p, "scale mode");
  p = CodecPolicy{};
  p.codec = Codec::kKivi2;
  p.kivi_group_size = 0;
  add("group 0", shape, p, "group size must be > 0");
  p.kivi_group_size = 64;
  add("group > tokens", shape, p, "must divide tokens_per_block");
  p.kivi_group_size = 32;
  add("dim % G", {4, 8, 80, 32}, p, "must divide");
  p.codec = Codec::kKivi4;
  add("tokens % G", {4, 8, 128, 48}, p, "must divide");
  for (const Case& c : cases) {
    const absl::Status st = ValidatePolicy(c.shape, c.policy);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.message)) << c.name;
  }
}

TEST(CodecSizeTest, ExactSizes) {
  const BlockShape shape{2, 2, 64, 32};  // 4096 elements per section
  EXPECT_EQ(Fp16BlockBytes(shape), 32768u);
  CodecPolicy p;
  EXPECT_EQ(EncodedBlockBytes(shape, p), 32768u);
  p.codec = Codec::kFp8E4M3;
  EXPECT_EQ(EncodedBlockBytes(shape, p), 4u * (8 + 4096));
  p.codec = Codec::kFp8E5M2;
  p.scale_mode = ScaleMode::kStaticPerLayer;
  p.static_k_scales = p.static_v_scales = {1, 1};
  EXPECT_EQ(EncodedBlockBytes(shape, p), 4u * 4096);
  p = CodecPolicy{};
  p.codec = Codec::kKivi2;  // 128 groups: 512 B metadata + 1024 B codes
  EXPECT_EQ(EncodedBlockBytes(shape, p), 4u * 1536);
  p.codec = Codec::kKivi4;  // 512 B metadata + 2048 B codes
  EXPECT_EQ(EncodedBlockBytes(shape, p), 4u * 2560);
  p.codec = Codec::kKivi2;
  p.fp16_layers = {1};
  EXPECT_EQ(EncodedBlockBytes(shape, p), 2u * 1536 + 2u * 8192);
  p.codec = Codec::kFp8E4M3;
  EXPECT_EQ(EncodedBlockBytes(shape, p), 2u * 4104 + 2u * 8192);
  // kivi2 at G = 32 is 3 bits per element.
  const BlockShape big{32, 8, 128, 32};
  CodecPolicy k;
  k.codec = Codec::kKivi2;
  EXPECT_EQ(EncodedBlockBytes(big, k) * 16, Fp16BlockBytes(big) * 3);
  // Odd element counts round the packed codes up to whole bytes.
  k.kivi_group_size = 1;
  EXPECT_EQ(EncodedBlockBytes(BlockShape{1, 1, 1, 3}, k), 2u * (12 + 1));
}

// A block's encoding is its layers' encodings back to back: each layer's
// slice (at EncodedLayerOffsets) encodes and decodes alone with LayerPolicy,
// to the same bytes.
TEST(LayerPolicyTest, EachLayerEncodesAndDecodesAlone) {
  const BlockShape shape{4, 2, 32, 32};
  std::vector<CodecPolicy> policies(5);
  policies[0].codec = Codec::kFp8E4M3;
  policies[1].codec = Codec::kKivi2;
  policies[1].fp16_layers = {1, 3};
  policies[2].codec = Codec::kFp8E5M2;
  policies[2].scale_mode = ScaleMode::kStaticPerLayer;
  policies[2].static_k_scales = {0.5f, 1.0f, 2.0f, 4.0f};
  policies[2].static_v_scales = {0.25f, 1.0f, 3.0f, 8.0f};
  policies[3].codec = Codec::kFp8E4M3;
  policies[3].scale_mode = ScaleMode::kStaticPerLayerHead;
  policies[3].fp16_layers = {2};
  for (int i = 0; i < 8; ++i) {
    policies[3].static_k_scales.push_back(0.01f * (i + 1));
    policies[3].static_v_scales.push_back(0.02f * (i + 1));
  }
  policies[4].codec = Codec::kKivi4;
  for (const CodecPolicy& policy : policies) {
    ASSERT_TRUE(ValidatePolicy(shape, policy).ok());
    const std::vector<uint16_t> in = GaussianBlock(shape, 11);
    const Encoded whole = RoundTrip(shape, policy, in);
    BlockShape one = shape;
    one.num_layers = 1;
    const size_t layer_elems = 2 * SectionElems(shape);
    const std::vector<size_t> offsets = EncodedLayerOffsets(shape, policy);
    ASSERT_EQ(offsets.size(), shape.num_layers + 1u);
    EXPECT_EQ(offsets.back(), EncodedBlockBytes(shape, policy));
    size_t offset = 0;
    for (uint32_t l = 0; l < shape.num_layers; ++l) {
      const CodecPolicy lp = LayerPolicy(shape, policy, l);
      ASSERT_TRUE(ValidatePolicy(one, lp).ok()) << "layer " << l;
      const size_t bytes = EncodedBlockBytes(one, lp);
      EXPECT_EQ(offsets[l], offset)
          << CodecName(policy.codec) << " layer " << l;
      ASSERT_LE(offset + bytes, whole.bytes.size());
      std::vector<uint16_t> slice(in.begin() + l * layer_elems,
                                  in.begin() + (l + 1) * layer_elems);
      std::vector<uint8_t> encoded(bytes);
      ASSERT_TRUE(EncodeBlock(one, lp, slice, absl::MakeSpan(encoded)).ok());
      EXPECT_EQ(0,
                std::memcmp(encoded.data(), whole.bytes.data() + offset, bytes))
          << CodecName(policy.codec) << " layer " << l;
      std::vector<uint16_t> decoded(layer_elems);
      ASSERT_TRUE(DecodeBlock(one, lp, encoded, absl::MakeSpan(decoded)).ok());
      EXPECT_TRUE(std::equal(decoded.begin(), decoded.end(),
                             whole.decoded.begin() + l * layer_elems))
          << CodecName(policy.codec) << " layer " << l;
      offset += bytes;
    }
    EXPECT_EQ(offset, whole.bytes.size()) << CodecName(policy.codec);
  }
}

// The largest layer count a layout may have is validated as cheaply as
// any other (per-layer plans are linear in it).
TEST(CodecApiTest, AcceptsUpTo4096Layers) {
  CodecPolicy kivi;
  kivi.codec = Codec::kKivi2;
  EXPECT_TRUE(ValidatePolicy({4096, 1, 32, 32}, kivi).ok());
  EXPECT_EQ(EncodedLayerOffsets({4096, 1, 32, 32}, kivi).size(), 4097u);
}

TEST(CodecApiTest, RejectsWrongSizes) {
  const BlockShape shape{2, 2, 64, 32};
  for (Codec c : kAllCodecs) {
    CodecPolicy p;
    p.codec = c;
    const size_t n = Fp16BlockBytes(shape) / 2;
    const size_t m = EncodedBlockBytes(shape, p);
    std::vector<uint16_t> in(n + 1, 0), out16(n + 1, 0);
    std::vector<uint8_t> enc(m + 1, 0);
    auto in_ok = absl::MakeConstSpan(in).first(n);
    auto enc_ok = absl::MakeSpan(enc).first(m);
    EXPECT_EQ(EncodeBlock(shape, p, absl::MakeConstSpan(in), enc_ok).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(EncodeBlock(shape, p, in_ok, absl::MakeSpan(enc)).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(EncodeBlock(shape, p, in_ok.first(n - 1), enc_ok).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(
        std::string(EncodeBlockReference(shape, p, in_ok, absl::MakeSpan(enc))
                        .message()),
        HasSubstr("output holds"));
    EXPECT_EQ(DecodeBlock(shape, p, absl::MakeConstSpan(enc),
                          absl::MakeSpan(out16).first(n))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(DecodeBlock(shape, p, enc_ok, absl::MakeSpan(out16)).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        DecodeBlockReference(shape, p, enc_ok, absl::MakeSpan(out16)).code(),
        absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(EncodeBlock(shape, p, in_ok, enc_ok).ok());
    EXPECT_TRUE(
        DecodeBlock(shape, p, enc_ok, absl::MakeSpan(out16).first(n)).ok());
  }
  CodecPolicy bad;
  bad.codec = Codec::kKivi2;
  bad.kivi_group_size = 0;
  std::vector<uint16_t> in(Fp16BlockBytes(shape) / 2);
  std::vector<uint8_t> enc(1);
  EXPECT_EQ(EncodeBlock(shape, bad, in, absl::MakeSpan(enc)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeBlock(shape, bad, enc, absl::MakeSpan(in)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CodecApiTest, RejectsNonFiniteNamingLayerAndHead) {
  const BlockShape shape{3, 4, 16, 8};
  const size_t sec = SectionElems(shape);
  struct Bad {
    uint16_t value;
    size_t layer, tensor, token, head, channel;
    std::string where;
  };
  const Bad bads[] = {
      {0x7C00, 2, 1, 5, 3, 7, "layer 2 V head 3 (token 5, channel 7)"},
      {0xFC00, 0, 0, 0, 0, 0, "layer 0 K head 0 (token 0, channel 0)"},
      {0x7E00, 1, 0, 7, 2, 15, "layer 1 K head 2 (token 7, channel 15)"},
      {0xFD01, 2, 1, 7, 3, 15, "layer 2 V head 3 (token 7, channel 15)"},
  };
  for (Codec c : kAllCodecs) {
    for (const Bad& b : bads) {
      for (bool skip : {false, true}) {
        CodecPolicy p;
        p.codec = c;
        p.kivi_group_size = 8;
        if (skip) p.fp16_layers = {static_cast<uint32_t>(b.layer)};
        std::vector<uint16_t> in = GaussianBlock(shape, 7);
        const size_t i =
            (2 * b.layer + b.tensor) * sec +
            (b.token * shape.num_kv_heads + b.head) * shape.head_dim +
            b.channel;
        in[i] = b.value;
        for (auto* fn : {&EncodeBlock, &EncodeBlockReference}) {
          std::vector<uint8_t> out(EncodedBlockBytes(shape, p), 0xAB);
          const absl::Status st = fn(shape, p, in, absl::MakeSpan(out));
          EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
          EXPECT_THAT(std::string(st.message()), HasSubstr(b.where))
              << CodecName(c);
          // No encoding is left behind: the reference writes nothing, the
          // fast path zeroes what it wrote before it met the bad section.
          for (uint8_t byte : out) {
            if (fn == &EncodeBlockReference) {
              ASSERT_EQ(byte, 0xAB) << "output written";
            } else {
              ASSERT_TRUE(byte == 0xAB || byte == 0) << "output written";
            }
          }
        }
      }
    }
  }
}

TEST(CodecApiTest, CheckEncodableAnswersAsCodecNoneEncodes) {
  const BlockShape shape{3, 4, 16, 8};
  CodecPolicy none;
  std::vector<uint16_t> in = GaussianBlock(shape, 3);
  EXPECT_TRUE(CheckEncodable(shape, in).ok());
  for (size_t i : {size_t{0}, in.size() / 2 + 5, in.size() - 1}) {
    for (uint16_t bad : {uint16_t{0x7C00}, uint16_t{0xFE01}}) {
      std::vector<uint16_t> b = in;
      b[i] = bad;
      std::vector<uint8_t> out(EncodedBlockBytes(shape, none));
      const absl::Status encoded =
          EncodeBlock(shape, none, b, absl::MakeSpan(out));
      const absl::Status checked = CheckEncodable(shape, b);
      EXPECT_EQ(checked.code(), absl::StatusCode::kInvalidArgument) << i;
      EXPECT_EQ(checked, encoded) << i;
    }
  }
  EXPECT_EQ(CheckEncodable(shape, absl::MakeConstSpan(in).subspan(1)).code(),
            absl::StatusCode::kInvalidArgument);
  // bf16 sources: a finite magnitude >= 2^126 is refused as well.
  BlockShape bf16 = shape;
  bf16.source_dtype = SourceDtype::kBf16;
  std::vector<uint16_t> big(in.size(), 0x3F80);  // 1.0
  EXPECT_TRUE(CheckEncodable(bf16, big).ok());
  big[17] = 0x7E80;  // 2^126
  EXPECT_EQ(CheckEncodable(bf16, big).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CodecRoundTripTest, NoneIsExact) {
  const BlockShape shape{3, 2, 64, 16};
  std::vector<uint16_t> in = GaussianBlock(shape, 1, 100.0f);
  in[0] = 0x8000;  // -0
  in[1] = 0x0001;  // smallest subnormal
  in[2] = 0x7BFF;  // 65504
  in[3] = 0xFBFF;  // -65504
  CodecPolicy p;
  Encoded e = RoundTrip(shape, p, in);
  EXPECT_EQ(e.decoded, in);
  ASSERT_EQ(e.bytes.size(), in.size() * 2);
  EXPECT_EQ(std::memcmp(e.bytes.data(), in.data(), e.bytes.size()), 0);
}

TEST(CodecRoundTripTest, Fp16LayersAreExactAndOthersQuantized) {
  const BlockShape shape{4, 2, 64, 32};
  const size_t sec = SectionElems(shape);
  const std::vector<uint16_t> in = GaussianBlock(shape, 2);
  for (Codec c :
       {Codec::kFp8E4M3, Codec::kFp8E5M2, Codec::kKivi2, Codec::kKivi4}) {
    CodecPolicy p;
    p.codec = c;
    p.fp16_layers = {0, 2};
    Encoded e = RoundTrip(shape, p, in);
    for (size_t l = 0; l < 4; ++l) {
      const bool fp16 = l == 0 || l == 2;
      std::vector<uint16_t> a(in.begin() + 2 * l * sec,
                              in.begin() + 2 * (l + 1) * sec);
      std::vector<uint16_t> b(e.decoded.begin() + 2 * l * sec,
                              e.decoded.begin() + 2 * (l + 1) * sec);
      EXPECT_EQ(a == b, fp16) << CodecName(c) << " layer " << l;
    }
    // The fp16 layer 0 is stored first, raw.
    EXPECT_EQ(std::memcmp(e.bytes.data(), in.data(), 4 * sec), 0);
  }
}

// FP8 dynamic layout: H little-endian fp32 scales, then the codes.
TEST(CodecFp8Test, DynamicLayoutAndFormula) {
  const BlockShape shape{1, 2, 4, 2};  // 8 elements per head
  std::vector<uint16_t> in(2 * 16);
  // K: head 0 holds {1, -2, 0.5, -0, ...}, head 1 all zeros (scale 1).
  const float k_head0[8] = {1.0f, -2.0f, 0.5f, -0.0f, 0.25f, 1.5f, -1.0f, 0};
  for (size_t t = 0; t < 2; ++t) {
    for (size_t d = 0; d < 4; ++d) {
      in[(t * 2 + 0) * 4 + d] = HalfFromFloat(k_head0[t * 4 + d]);
      in[(t * 2 + 1) * 4 + d] = (d % 2) ? 0x8000 : 0x0000;
    }
  }
  // V: a value at the e4m3 limit and one far beyond it in the same head.
  for (size_t i = 0; i < 16; ++i) in[16 + i] = HalfFromFloat(0.001f * i);
  in[16 + 3] = HalfFromFloat(60000.0f);
  CodecPolicy p;
  p.codec = Codec::kFp8E4M3;
  Encoded e = RoundTrip(shape, p, in);
  ASSERT_EQ(e.bytes.size(), 2u * (8 + 16));
  auto scale_at = [&](size_t off) {
    uint32_t u = e.bytes[off] | e.bytes[off + 1] << 8 | e.bytes[off + 2] << 16 |
                 static_cast<uint32_t>(e.bytes[off + 3]) << 24;
    return FloatFromBits(u);
  };
  const float s0 = 2.0f / 448.0f;
  EXPECT_EQ(scale_at(0), s0);
  EXPECT_EQ(scale_at(4), 1.0f);  // amax == 0
  const uint8_t* codes = e.bytes.data() + 8;
  for (size_t t = 0; t < 2; ++t) {
    for (size_t d = 0; d < 4; ++d) {
      const float x = k_head0[t * 4 + d];
      EXPECT_EQ(codes[(t * 2 + 0) * 4 + d], Fp8E4M3FromFloat(x / s0));
      EXPECT_EQ(codes[(t * 2 + 1) * 4 + d], (d % 2) ? 0x80 : 0x00);
      // Zeros keep their sign through the round trip.
      EXPECT_EQ(e.decoded[(t * 2 + 1) * 4 + d], (d % 2) ? 0x8000 : 0x0000);
    }
  }
  EXPECT_EQ(codes[1], 0xFE);  // -2 is the amax: -448
  EXPECT_EQ(codes[3], 0x80);  // -0 keeps its sign
  EXPECT_EQ(e.decoded[3], 0x8000);
  EXPECT_EQ(e.decoded[1], HalfFromFloat(-448.0f * s0));
  // V head 0 holds 60000 (amax), head 1 at most 0.015.
  const uint8_t* v = e.bytes.data() + 8 + 16;
  const float sv[2] = {HalfToFloat(HalfFromFloat(60000.0f)) / 448.0f,
                       HalfToFloat(HalfFromFloat(0.015f)) / 448.0f};
  EXPECT_EQ(scale_at(8 + 16), sv[0]);
  EXPECT_EQ(scale_at(8 + 16 + 4), sv[1]);
  EXPECT_EQ(v[8 + 3], 0x7E);
  for (size_t i = 0; i < 16; ++i) {
    const size_t h = (i / 4) % 2;
    const float x = HalfToFloat(in[16 + i]);
    EXPECT_EQ(v[8 + i], Fp8E4M3FromFloat(x / sv[h])) << i;
    EXPECT_EQ(e.decoded[16 + i],
              HalfFromFloat(Fp8E4M3ToFloat(v[8 + i]) * sv[h]));
  }
}

TEST(CodecFp8Test, StaticScalesSaturateAndKeepSignedZeros) {
  const BlockShape shape{2, 2, 8, 4};
  const size_t sec = SectionElems(shape);
  std::vector<uint16_t> in(4 * sec);
  const uint16_t specials[] = {0x0000,         0x8000, 0x0001, 0x8001,
                               0x03FF,         0x7BFF, 0xFBFF, 0x5E00 /*384*/,
                               0x5F80 /*480*/, 0x6400 /*1024*/};
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = specials[i % (sizeof(specials) / sizeof(specials[0]))];
  }
  for (Codec c : {Codec::kFp8E4M3, Codec::kFp8E5M2}) {
    const float max = c == Codec::kFp8E4M3 ? 448.0f : 57344.0f;
    CodecPolicy p;
    p.codec = c;
    p.scale_mode = ScaleMode::kStaticPerLayer;
    p.static_k_scales = {1.0f, 0.5f};
    p.static_v_scales = {2.0f, 1e-30f};  // 1e-30: everything saturates
    Encoded e = RoundTrip(shape, p, in);
    ASSERT_EQ(e.bytes.size(), 4 * sec);  // codes only
    for (size_t s = 0; s < 4; ++s) {
      const float scale =
          (s % 2 == 0 ? p.static_k_scales : p.static_v_scales)[s / 2];
      for (size_t i = 0; i < sec; ++i) {
        const uint16_t h = in[s * sec + i];
        const float x = HalfToFloat(h);
        const float q = x / scale;
        const uint8_t code = e.bytes[s * sec + i];
        EXPECT_EQ(code, c == Codec::kFp8E4M3 ? Fp8E4M3FromFloat(q)
                                             : Fp8E5M2FromFloat(q));
        if (std::fabs(q) >= max) {
          EXPECT_EQ(code & 0x7F, c == Codec::kFp8E4M3 ? 0x7E : 0x7B);
        }
        if (x == 0.0f) {
          EXPECT_EQ(code, h == 0x8000 ? 0x80 : 0x00);
          EXPECT_EQ(e.decoded[s * sec + i], h);
        }
      }
    }
    // Layer 0 K, scale 1: 65504 saturates to the fp8 max.
    EXPECT_EQ(HalfToFloat(e.decoded[5]), max);
    EXPECT_EQ(HalfToFloat(e.decoded[6]), -max);
  }
}

TEST(CodecFp8Test, StaticPerLayerHeadScales) {
  const BlockShape shape{2, 3, 8, 4};
  const size_t sec = SectionElems(shape);
  const std::vector<uint16_t> in = GaussianBlock(shape, 5, 3.0f);
  CodecPolicy p;
  p.codec = Codec::kFp8E5M2;
  p.scale_mode = ScaleMode::kStaticPerLayerHead;
  p.static_k_scales = {0.01f, 0.02f, 0.03f, 0.04f, 0.05f, 0.06f};
  p.static_v_scales = {0.5f, 1.0f, 2.0f, 4.0f, 8.0f, 16.0f};
  p.fp16_layers = {1};
  Encoded e = RoundTrip(shape, p, in);
  ASSERT_EQ(e.bytes.size(), 2 * sec + 2 * 2 * sec);
  for (size_t tensor = 0; tensor < 2; ++tensor) {
    const auto& sc = tensor == 0 ? p.static_k_scales : p.static_v_scales;
    for (size_t t = 0; t < 4; ++t) {
      for (size_t h = 0; h < 3; ++h) {
        for (size_t d = 0; d < 8; ++d) {
          const size_t i = (t * 3 + h) * 8 + d;
          const uint8_t code = e.bytes[tensor * sec + i];
          EXPECT_EQ(code, Fp8E5M2FromFloat(HalfToFloat(in[tensor * sec + i]) /
                                           sc[h]));
          EXPECT_EQ(e.decoded[tensor * sec + i],
                    HalfFromFloat(Fp8E5M2ToFloat(code) * sc[h]));
        }
      }
    }
  }
}

// Tiny KIVI layouts worked out by hand.
TEST(CodecKiviTest, HandWorkedLayout) {
  const BlockShape shape{1, 1, 4, 4};  // T = 4, H = 1, D = 4, G = 4
  std::vector<uint16_t> in(32);
  for (size_t t = 0; t < 4; ++t) {
    for (size_t d = 0; d < 4; ++d) {
      const uint16_t x = HalfFromFloat(static_cast<float>(t * (d + 1)));
      in[t * 4 + d] = x;       // K
      in[16 + t * 4 + d] = x;  // V
    }
  }
  CodecPolicy p;
  p.codec = Codec::kKivi2;
  p.kivi_group_size = 4;
  Encoded e = RoundTrip(shape, p, in);
  ASSERT_EQ(e.bytes.size(), 2u * (4 * 4 + 4));
  auto half_at = [&](size_t off) {
    return static_cast<uint16_t>(e.bytes[off] | e.bytes[off + 1] << 8);
  };
  // K: channel d holds t*(d+1) for t = 0..3: zero 0, scale d+1, code t.
  for (size_t d = 0; d < 4; ++d) {
    EXPECT_EQ(half_at(2 * d), 0x0000);
    EXPECT_EQ(half_at(8 + 2 * d), HalfFromFloat(d + 1.0f));
  }
  EXPECT_EQ(e.bytes[16], 0x00);
  EXPECT_EQ(e.bytes[17], 0x55);
  EXPECT_EQ(e.bytes[18], 0xAA);
  EXPECT_EQ(e.bytes[19], 0xFF);
  // V: token t holds t*(1..4): zero t, scale t, codes 0,1,2,3 (t > 0);
  // token 0 is a constant group: scale 0, codes 0.
  for (size_t t = 0; t < 4; ++t) {
    EXPECT_EQ(half_at(20 + 2 * t), HalfFromFloat(static_cast<float>(t)));
    EXPECT_EQ(half_at(28 + 2 * t), HalfFromFloat(static_cast<float>(t)));
  }
  EXPECT_EQ(e.bytes[36], 0x00);
  EXPECT_EQ(e.bytes[37], 0xE4);
  EXPECT_EQ(e.bytes[38], 0xE4);
  EXPECT_EQ(e.bytes[39], 0xE4);
  EXPECT_EQ(e.decoded, in);  // every value is on the grid

  p.codec = Codec::kKivi4;
  Encoded e4 = RoundTrip(shape, p, in);
  ASSERT_EQ(e4.bytes.size(), 2u * (16 + 8));
  // K: scale half((d+1)/5), so channel d of token t has code 5t: two codes
  // per byte, low nibble first.
  EXPECT_EQ(e4.bytes[16 + 0], 0x00);
  EXPECT_EQ(e4.bytes[16 + 2], 0x55);
  EXPECT_EQ(e4.bytes[16 + 5], 0xAA);
  EXPECT_EQ(e4.bytes[16 + 7], 0xFF);
  // V (from byte 24), token 1: zero 1, scale half(3/15), codes of 1..4.
  const uint8_t* v = e4.bytes.data() + 24;
  const float sv = HalfToFloat(HalfFromFloat(3.0f / 15.0f));
  EXPECT_EQ(HalfToFloat(static_cast<uint16_t>(v[2] | v[3] << 8)), 1.0f);
  EXPECT_EQ(HalfToFloat(static_cast<uint16_t>(v[8 + 2] | v[8 + 3] << 8)), sv);
  uint8_t want[2] = {0, 0};
  for (int d = 0; d < 4; ++d) {
    const int code = static_cast<int>(std::nearbyint(d / sv));
    want[d / 2] |= static_cast<uint8_t>(std::min(code, 15) << (4 * (d % 2)));
  }
  EXPECT_EQ(v[16 + 2], want[0]);
  EXPECT_EQ(v[16 + 3], want[1]);
  EXPECT_EQ(want[1] >> 4, 15);  // 3 / 0.19995 rounds to 15
}

TEST(CodecKiviTest, ConstantGroupsAndOutliers) {
  const BlockShape shape{1, 2, 32, 32};
  const size_t sec = SectionElems(shape);
  for (Codec c : {Codec::kKivi2, Codec::kKivi4}) {
    const float qmax = c == Codec::kKivi2 ? 3.0f : 15.0f;
    std::vector<uint16_t> in(2 * sec, HalfFromFloat(3.14159f));
    // One outlier in K channel 5 of head 1, and in V token 9 of head 0.
    in[(7 * 2 + 1) * 32 + 5] = HalfFromFloat(100.0f);
    in[sec + (9 * 2 + 0) * 32 + 17] = HalfFromFloat(-250.0f);
    // A group of mixed-sign zeros (K channel 0 of head 0).
    for (size_t t = 0; t < 32; ++t) in[(t * 2) * 32] = (t % 3) ? 0x8000 : 0;
    CodecPolicy p;
    p.codec = c;
    Encoded e = RoundTrip(shape, p, in);
    const size_t k_outlier = (7 * 2 + 1) * 32 + 5;
    const size_t v_outlier = sec + (9 * 2 + 0) * 32 + 17;
    for (size_t i = 0; i < 2 * sec; ++i) {
      const bool v_outlier_group =
          i >= sec + (9 * 2) * 32 && i < v_outlier + 15;
      if (i == k_outlier) {
        // The outlier is its group's max: qmax * scale + zero.
        EXPECT_NEAR(HalfToFloat(e.decoded[i]), 100.0f, 0.1f);
      } else if (i == v_outlier) {
        EXPECT_EQ(e.decoded[i], in[i]);  // the min is the zero point: exact
      } else if (HalfToFloat(in[i]) == 0.0f) {
        EXPECT_EQ(e.decoded[i], 0x0000) << i;  // a zero group is +0
      } else if (!v_outlier_group) {
        // Constant groups (scale 0) and the min of the K outlier group are
        // the zero point: exact.
        EXPECT_EQ(e.decoded[i], in[i]) << CodecName(c) << " " << i;
      }
    }
    // The V group with the outlier: the others sit near the top of a range
    // of 253.14 with (2^b - 1) steps: error at most half a step.
    const float step = HalfToFloat(HalfFromFloat((3.14159f + 250.0f) / qmax));
    for (size_t d = 0; d < 32; ++d) {
      const size_t i = sec + (9 * 2) * 32 + d;
      EXPECT_LE(std::fabs(HalfToFloat(e.decoded[i]) - HalfToFloat(in[i])),
                step / 2 + 0.5f)
          << d;
    }
  }
}

// Per-element error bounds on random data at several magnitudes.
TEST(CodecRoundTripTest, ErrorWithinBoundsEveryCodec) {
  const BlockShape shape{2, 4, 64, 32};
  const size_t sec = SectionElems(shape);
  for (float sigma : {1e-6f, 1e-3f, 1.0f, 1000.0f}) {
    const std::vector<uint16_t> in = GaussianBlock(shape, 11, sigma);
    for (Codec c : kAllCodecs) {
      CodecPolicy p;
      p.codec = c;
      Encoded e = RoundTrip(shape, p, in);
      for (size_t s = 0; s < 4; ++s) {
        // Largest magnitude per head bounds the absolute error.
        std::vector<float> amax(4, 0);
        for (size_t i = 0; i < sec; ++i) {
          const size_t h = (i / 64) % 4;
          amax[h] = std::max(amax[h], std::fabs(HalfToFloat(in[s * sec + i])));
        }
        for (size_t i = 0; i < sec; ++i) {
          const size_t h = (i / 64) % 4;
          const float x = HalfToFloat(in[s * sec + i]);
          const float y = HalfToFloat(e.decoded[s * sec + i]);
          const float err = std::fabs(x - y);
          const float half_ulp = std::fabs(x) * 0x1p-10f + 0x1p-24f;
          float bound = 0;
          switch (c) {
            case Codec::kNone:
              bound = 0;
              break;
            case Codec::kFp8E4M3:  // 3 mantissa bits, subnormal step 2^-9
              bound =
                  std::fabs(x) * 0x1p-4f + amax[h] / 448 * 0x1p-10f + half_ulp;
              break;
            case Codec::kFp8E5M2:  // 2 mantissa bits, subnormal step 2^-16
              bound = std::fabs(x) * 0x1p-3f + amax[h] / 57344 * 0x1p-17f +
                      half_ulp;
              break;
            case Codec::kKivi2:  // half a step of a range of at most 2 amax
            case Codec::kKivi4:
              bound = 2 * amax[h] / (c == Codec::kKivi2 ? 3 : 15) * 0.51f +
                      2 * half_ulp + 0x1p-23f;
              break;
          }
          ASSERT_LE(err, bound * 1.0001f)
              << CodecName(c) << " sigma " << sigma << " x " << x << " y " << y;
        }
      }
    }
  }
}

// The reference figures of BRIEF section 4 on N(0, 1) data.
TEST(CodecRoundTripTest, RelativeRmseOnGaussianData) {
  const BlockShape shape{4, 8, 128, 32};
  const std::vector<uint16_t> in = GaussianBlock(shape, 42);
  struct Want {
    Codec codec;
    double rmse;
  };
  for (const Want& w :
       {Want{Codec::kNone, 0.0}, Want{Codec::kFp8E4M3, 0.0265},
        Want{Codec::kFp8E5M2, 0.053}, Want{Codec::kKivi2, 0.395},
        Want{Codec::kKivi4, 0.078}}) {
    CodecPolicy p;
    p.codec = w.codec;
    Encoded e = RoundTrip(shape, p, in);
    const double r = RelativeRmse(in, e.decoded);
    EXPECT_NEAR(r, w.rmse, w.rmse * 0.05) << CodecName(w.codec);
    RecordProperty(std::string(CodecName(w.codec)) + "_relative_rmse",
                   std::to_string(r));
  }
}

}  // namespace
}  // namespace kvcache::kernels
