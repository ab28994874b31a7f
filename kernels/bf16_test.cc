// bf16 sources (docs/codecs.md): the conversions, the codecs' reference and
// SIMD paths against each other on every Highway target, and FP8 on all
// 65,536 bf16 patterns against an independent model written in this file.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"
#include "kernels/codec_simd.h"
#include "kernels/codec_test_util.h"
#include "kernels/half.h"
#include "kernels/legal_states.h"

namespace kvcache::kernels {
namespace {

using internal::ActiveSimdTarget;
using internal::ForceSimdTargetForTest;
using internal::SimdTargetName;
using internal::SimdTargets;
using testutil::Bf16Data;
using testutil::Describe;
using testutil::MakeBf16Data;
using testutil::Policies;
using testutil::ShapeCase;
using testutil::Shapes;

// ---- an independent model ----------------------------------------------

// The value of a bf16 pattern from its fields (sign, 8-bit exponent with
// bias 127, 7 mantissa bits, subnormals), in double.
double Bf16Value(uint16_t b) {
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  const int e = (b >> 7) & 0xFF;
  const int m = b & 0x7F;
  if (e == 0xFF) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return sign * std::ldexp(m / 128.0, -126);
  return sign * std::ldexp(1.0 + m / 128.0, e - 127);
}

// Round a finite or infinite (non-NaN) double to bf16, nearest, ties to the
// even pattern: the two neighbours along the positive patterns, compared in
// double (exact: both differences are representable). 0x7F80 stands for
// 2^128 when it is a neighbour, which is how IEEE rounding overflows.
uint16_t Bf16Nearest(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (std::isinf(a)) return sign | 0x7F80;
  const auto value = [](uint16_t p) {
    return p == 0x7F80 ? std::ldexp(1.0, 128) : Bf16Value(p);
  };
  uint16_t lo = 0;  // the largest pattern with value <= a
  for (int step = 0x4000; step > 0; step >>= 1) {
    if (lo + step <= 0x7F80 && value(static_cast<uint16_t>(lo + step)) <= a) {
      lo = static_cast<uint16_t>(lo + step);
    }
  }
  if (value(lo) == a || lo == 0x7F80) return sign | lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double dlo = a - value(lo), dhi = value(hi) - a;
  const uint16_t r = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return sign | r;
}

// OCP FP8 as a table of positive finite values; nearest with ties to the
// even code, saturating at the largest finite value, zeros keep their sign.
struct Fp8Model {
  int man_bits, bias;
  bool e4m3;
  double Value(int code) const {
    const int e = (code >> man_bits) & (e4m3 ? 15 : 31);
    const int m = code & ((1 << man_bits) - 1);
    const double frac = m / static_cast<double>(1 << man_bits);
    return e == 0 ? std::ldexp(frac, 1 - bias)
                  : std::ldexp(1.0 + frac, e - bias);
  }
  int MaxCode() const { return e4m3 ? 0x7E : 0x7B; }
  uint8_t Encode(float q) const {
    const int sign = std::signbit(q) ? 0x80 : 0;
    const double a = std::fabs(static_cast<double>(q));
    if (a >= Value(MaxCode())) return static_cast<uint8_t>(sign | MaxCode());
    int lo = 0;
    while (lo + 1 <= MaxCode() && Value(lo + 1) <= a) ++lo;
    if (Value(lo) == a) return static_cast<uint8_t>(sign | lo);
    const double dlo = a - Value(lo), dhi = Value(lo + 1) - a;
    const int r = dlo < dhi   ? lo
                  : dhi < dlo ? lo + 1
                              : ((lo & 1) ? lo + 1 : lo);
    return static_cast<uint8_t>(sign | r);
  }
  float Decode(uint8_t code) const {
    const double v = Value(code & 0x7F);
    return static_cast<float>((code & 0x80) ? -v : v);
  }
};

Fp8Model ModelOf(Codec c) {
  return c == Codec::kFp8E4M3 ? Fp8Model{3, 7, true} : Fp8Model{2, 15, false};
}

BlockShape Bf16Shape(uint32_t L, uint32_t H, uint32_t D, uint32_t T) {
  BlockShape s{L, H, D, T};
  s.source_dtype = SourceDtype::kBf16;
  return s;
}

// Every bf16 pattern the codecs accept: (bits & 0x7FFF) < 0x7E80.
std::vector<uint16_t> AcceptedBf16() {
  std::vector<uint16_t> v;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7FFFu) < 0x7E80u) v.push_back(static_cast<uint16_t>(b));
  }
  return v;
}

// ---- conversions -----------------------------------------------------------

TEST(Bf16ConversionTest, ToFloatIsExactForEveryPattern) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    const double want = Bf16Value(static_cast<uint16_t>(b));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << b;
      ASSERT_EQ(FloatBits(f) >> 16, b) << b;  // payload and sign as written
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << b;
      ASSERT_EQ(std::signbit(f), (b & 0x8000u) != 0) << b;
    }
    EXPECT_EQ(Bf16IsNonFinite(static_cast<uint16_t>(b)), !std::isfinite(want))
        << b;
  }
}

// Every top half (all bf16 patterns) with the low halves that decide
// rounding: exact, just above, below, at and above the tie, and the top.
TEST(Bf16ConversionTest, FromFloatRoundsToNearestEven) {
  const uint32_t lows[] = {0x0000, 0x0001, 0x3FFF, 0x7FFF, 0x8000,
                           0x8001, 0xC000, 0xFFFE, 0xFFFF};
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (uint32_t lo : lows) {
      const float f = FloatFromBits(hi << 16 | lo);
      const uint16_t got = Bf16FromFloat(f);
      if (std::isnan(f)) {
        // NaN stays NaN: sign and top payload bits kept, made quiet.
        ASSERT_EQ(got, static_cast<uint16_t>(hi | 0x40u)) << hi << " " << lo;
        continue;
      }
      ASSERT_EQ(got, Bf16Nearest(static_cast<double>(f)))
          << std::hex << (hi << 16 | lo);
    }
  }
  EXPECT_EQ(Bf16FromFloat(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(Bf16FromFloat(-0.0f), 0x8000);
  EXPECT_EQ(Bf16FromFloat(FloatFromBits(0x00008000u)), 0x0000);  // tie: even
  EXPECT_EQ(Bf16FromFloat(FloatFromBits(0x00018000u)), 0x0002);  // tie: even
}

TEST(Bf16ConversionTest, RandomFloatsRoundLikeTheModel) {
  std::mt19937 rng(7);
  for (int i = 0; i < 1 << 20; ++i) {
    const float f = FloatFromBits(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    ASSERT_EQ(Bf16FromFloat(f), Bf16Nearest(f)) << FloatBits(f);
  }
}

// ---- codec vocabulary
// --------------------------------------------------------

TEST(Bf16CodecTest, NamesSizesAndValidation) {
  EXPECT_EQ(SourceDtypeName(SourceDtype::kFp16), "fp16");
  EXPECT_EQ(SourceDtypeName(SourceDtype::kBf16), "bf16");
  EXPECT_EQ(SourceDtypeFromName("bf16"), SourceDtype::kBf16);
  EXPECT_EQ(SourceDtypeFromName("fp32"), std::nullopt);
  EXPECT_EQ(BlockShape{}.source_dtype, SourceDtype::kFp16);
  std::mt19937 rng(5);
  for (const ShapeCase& sc : Shapes()) {
    BlockShape bf = sc.shape;
    bf.source_dtype = SourceDtype::kBf16;
    EXPECT_EQ(Fp16BlockBytes(bf), Fp16BlockBytes(sc.shape));
    for (const CodecPolicy& p : Policies(sc.shape, sc.group, rng)) {
      if (!ValidatePolicy(sc.shape, p).ok()) continue;
      ASSERT_TRUE(ValidatePolicy(bf, p).ok());
      EXPECT_EQ(EncodedBlockBytes(bf, p), EncodedBlockBytes(sc.shape, p));
    }
  }
  BlockShape bad{1, 1, 32, 32};
  bad.source_dtype = static_cast<SourceDtype>(7);
  EXPECT_EQ(ValidatePolicy(bad, CodecPolicy{}).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- FP8 on every bf16 pattern ---------------------------------------------

class Bf16SimdTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    ForceSimdTargetForTest(GetParam());
    ASSERT_EQ(ActiveSimdTarget(), SimdTargetName(GetParam()));
  }
  void TearDown() override { ForceSimdTargetForTest(0); }
};

// All 64,768 accepted bf16 patterns (the other 768 are rejected: see
// Bf16RejectsNonFiniteAndOutOfRange) in one head of 506 tokens x 128
// channels, as K and V: the reference, the SIMD path and the model of this
// file agree on every code and every decoded value, for dynamic scales and
// for static ones across the fp32 range.
TEST_P(Bf16SimdTest, Fp8EveryBf16PatternMatchesModel) {
  const std::vector<uint16_t> all = AcceptedBf16();
  ASSERT_EQ(all.size(), size_t{506} * 128);
  const BlockShape shape = Bf16Shape(1, 1, 128, 506);
  std::vector<uint16_t> in(all);
  std::reverse_copy(all.begin(), all.end(), std::back_inserter(in));
  // 1 + 2^-8 and 1 + 2^-7 + 2^-8 put products of small codes on bf16 ties
  // (even and odd).
  const std::vector<float> scales = {0.0f,  // dynamic
                                     1.0f,
                                     0.75f,
                                     3e-5f,
                                     1e-40f,
                                     3e38f,
                                     0x1p-126f,
                                     448.0f,
                                     1e-30f,
                                     FloatFromBits(0x3F808000u),
                                     FloatFromBits(0x3F818000u)};
  for (Codec c : {Codec::kFp8E4M3, Codec::kFp8E5M2}) {
    const Fp8Model model = ModelOf(c);
    for (float sc : scales) {
      CodecPolicy p;
      p.codec = c;
      if (sc != 0.0f) {
        p.scale_mode = ScaleMode::kStaticPerLayer;
        p.static_k_scales = {sc};
        p.static_v_scales = {sc};
      }
      const size_t bytes = EncodedBlockBytes(shape, p);
      std::vector<uint8_t> ref(bytes), simd(bytes);
      ASSERT_TRUE(EncodeBlockReference(shape, p, in, absl::MakeSpan(ref)).ok());
      ASSERT_TRUE(EncodeBlock(shape, p, in, absl::MakeSpan(simd)).ok());
      ASSERT_EQ(ref, simd) << CodecName(c) << " scale " << sc;
      std::vector<uint16_t> out_ref(in.size()), out_simd(in.size());
      ASSERT_TRUE(
          DecodeBlockReference(shape, p, ref, absl::MakeSpan(out_ref)).ok());
      ASSERT_TRUE(DecodeBlock(shape, p, ref, absl::MakeSpan(out_simd)).ok());
      ASSERT_EQ(out_ref, out_simd) << CodecName(c) << " scale " << sc;
      // The model: scale = amax / fp8_max (amax = the largest accepted
      // magnitude here), code = fp8(float(x) / scale), x' = bf16(code*scale).
      float scale = sc;
      size_t meta = 0;
      if (sc == 0.0f) {
        scale = static_cast<float>(Bf16Value(0x7E7F)) /
                static_cast<float>(model.Value(model.MaxCode()));
        meta = 4;
      }
      for (size_t i = 0; i < in.size(); ++i) {
        const size_t sec = i / all.size();  // K, then V
        const uint8_t code =
            ref[meta + sec * (meta + all.size()) + i % all.size()];
        const float x = static_cast<float>(Bf16Value(in[i]));
        ASSERT_EQ(code, model.Encode(x / scale))
            << CodecName(c) << " x " << in[i] << " scale " << scale;
        ASSERT_EQ(out_ref[i], Bf16Nearest(model.Decode(code) * scale))
            << CodecName(c) << " code " << int{code} << " scale " << scale;
      }
    }
  }
}

// ---- KIVI and everything else: reference vs SIMD ---------------------------

// Every shape and policy of the fp16 SIMD test (KIVI 2 and 4 bit, FP8 with
// dynamic and static scales, fp16-kept layers), every data kind: encode and
// decode bytes equal on every target; no decoded value is non-finite.
TEST(Bf16SimdAllTargetsTest, EncodeAndDecodeMatchReferenceBitForBit) {
  const std::vector<int64_t> targets = SimdTargets();
  ASSERT_FALSE(targets.empty());
  std::mt19937 rng(4242);
  size_t blocks = 0;
  for (const ShapeCase& sc : Shapes()) {
    BlockShape shape = sc.shape;
    shape.source_dtype = SourceDtype::kBf16;
    for (const CodecPolicy& p : Policies(shape, sc.group, rng)) {
      if (!ValidatePolicy(shape, p).ok()) continue;
      for (int k = 0; k <= static_cast<int>(Bf16Data::kSparse); ++k) {
        const std::vector<uint16_t> in = MakeBf16Data(
            shape, static_cast<Bf16Data>(k), static_cast<uint32_t>(rng()));
        const size_t bytes = EncodedBlockBytes(shape, p);
        std::vector<uint8_t> ref(bytes, 0x5A);
        ASSERT_TRUE(
            EncodeBlockReference(shape, p, in, absl::MakeSpan(ref)).ok());
        std::vector<uint16_t> out_ref(in.size(), 1);
        ASSERT_TRUE(
            DecodeBlockReference(shape, p, ref, absl::MakeSpan(out_ref)).ok());
        if (internal::IsKivi(p.codec) || p.codec == Codec::kNone) {
          EXPECT_EQ(CountNonFinite(out_ref, SourceDtype::kBf16), 0u)
              << Describe(shape, p) << " data " << k;
        }
        for (int64_t target : targets) {
          ForceSimdTargetForTest(target);
          std::vector<uint8_t> simd(bytes, 0xA5);
          ASSERT_TRUE(EncodeBlock(shape, p, in, absl::MakeSpan(simd)).ok());
          ASSERT_EQ(simd, ref) << SimdTargetName(target) << " encode "
                               << Describe(shape, p) << " data " << k;
          std::vector<uint16_t> out_simd(in.size(), 2);
          ASSERT_TRUE(
              DecodeBlock(shape, p, ref, absl::MakeSpan(out_simd)).ok());
          ASSERT_EQ(out_simd, out_ref) << SimdTargetName(target) << " decode "
                                       << Describe(shape, p) << " data " << k;
        }
        ForceSimdTargetForTest(0);
        ++blocks;
      }
    }
  }
  EXPECT_GT(blocks, size_t{500});
}

// The specification on small groups, by hand: kivi2 over a value group
// {-1, 0, 0.5, 2}: zero = bf16(-1), scale = bf16(3 / 3) = 1, codes
// rint(x + 1) = {0, 1, 2 (1.5 ties to even), 3}, decoded {-1, 0, 1, 2}. A
// constant group stores scale 0 and decodes to its constant exactly.
TEST(Bf16CodecTest, KiviByHand) {
  const BlockShape shape = Bf16Shape(1, 1, 4, 4);
  CodecPolicy p;
  p.codec = Codec::kKivi2;
  p.kivi_group_size = 4;
  std::vector<uint16_t> in(Fp16BlockBytes(shape) / 2, 0x4049);  // 3.140625
  const uint16_t v_row[] = {0xBF80, 0x0000, 0x3F00, 0x4000};
  std::copy(v_row, v_row + 4, in.begin() + 16);  // V token 0
  for (bool reference : {true, false}) {
    std::vector<uint8_t> enc(EncodedBlockBytes(shape, p));
    ASSERT_TRUE((reference
                     ? EncodeBlockReference(shape, p, in, absl::MakeSpan(enc))
                     : EncodeBlock(shape, p, in, absl::MakeSpan(enc)))
                    .ok());
    // V section: 4 groups; zeros at 0, scales at 8, codes at 16.
    const uint8_t* v = enc.data() + enc.size() / 2;
    EXPECT_EQ(internal::LoadLe16(v), 0xBF80);
    EXPECT_EQ(internal::LoadLe16(v + 8), 0x3F80);
    EXPECT_EQ(v[16], 0 | 1 << 2 | 2 << 4 | 3 << 6);
    EXPECT_EQ(internal::LoadLe16(v + 2), 0x4049);  // constant group
    EXPECT_EQ(internal::LoadLe16(v + 10), 0x0000);
    std::vector<uint16_t> out(in.size());
    ASSERT_TRUE(DecodeBlock(shape, p, enc, absl::MakeSpan(out)).ok());
    const uint16_t want[] = {0xBF80, 0x0000, 0x3F80, 0x4000};
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[16 + i], want[i]) << i;
    EXPECT_EQ(out[0], 0x4049);
  }
}

// Arbitrary codes decode the same on every target: fp8 codes of every kind
// (NaN and infinity codes included) and KIVI codes, with metadata from a
// real encoding (finite: a NaN from two NaN operands has no fixed payload).
TEST_P(Bf16SimdTest, DecodeOfArbitraryCodesMatchesReference) {
  std::mt19937 rng(31);
  for (const ShapeCase& sc : Shapes()) {
    BlockShape shape = sc.shape;
    shape.source_dtype = SourceDtype::kBf16;
    for (const CodecPolicy& p : Policies(shape, sc.group, rng)) {
      if (!ValidatePolicy(shape, p).ok() || p.codec == Codec::kNone) continue;
      const std::vector<uint16_t> in = MakeBf16Data(
          shape, Bf16Data::kGaussian, static_cast<uint32_t>(rng()));
      std::vector<uint8_t> enc(EncodedBlockBytes(shape, p));
      ASSERT_TRUE(EncodeBlockReference(shape, p, in, absl::MakeSpan(enc)).ok());
      const size_t n =
          size_t{shape.tokens_per_block} * shape.num_kv_heads * shape.head_dim;
      size_t off = 0;
      for (uint32_t l = 0; l < shape.num_layers; ++l) {
        const bool skip = !p.fp16_layers.empty() && p.fp16_layers[0] == l;
        for (int t = 0; t < 2; ++t) {
          internal::Section s;
          s.codec = skip ? Codec::kNone : p.codec;
          s.tokens = shape.tokens_per_block;
          s.heads = shape.num_kv_heads;
          s.dim = shape.head_dim;
          s.group = p.kivi_group_size;
          const float one = 1.0f;
          if (p.scale_mode != ScaleMode::kDynamic) s.static_scales = &one;
          const size_t size = internal::SectionBytes(s);
          size_t meta = 0;
          if (internal::IsFp8(s.codec) && s.static_scales == nullptr) {
            meta = 4 * s.heads;
          } else if (internal::IsKivi(s.codec)) {
            meta = 4 * (n / s.group);
          }
          if (s.codec != Codec::kNone) {
            for (size_t i = off + meta; i < off + size; ++i) {
              enc[i] = static_cast<uint8_t>(rng());
            }
          }
          off += size;
        }
      }
      ASSERT_EQ(off, enc.size());
      std::vector<uint16_t> want(in.size()), got(in.size());
      ASSERT_TRUE(
          DecodeBlockReference(shape, p, enc, absl::MakeSpan(want)).ok());
      ASSERT_TRUE(DecodeBlock(shape, p, enc, absl::MakeSpan(got)).ok());
      ASSERT_EQ(got, want) << Describe(shape, p);
    }
  }
}

// Rejected input: inf, NaN, and finite magnitudes >= 2^126 (0x7E80 up), in
// K and V, at the start, middle and end of a section, for every codec: both
// paths answer INVALID_ARGUMENT naming layer, K|V and head; the reference
// writes nothing, the SIMD path leaves only zeros or untouched bytes. The
// largest accepted magnitude (0x7E7F) encodes.
TEST_P(Bf16SimdTest, Bf16RejectsNonFiniteAndOutOfRange) {
  const BlockShape shape = Bf16Shape(2, 3, 32, 32);
  const size_t sec = size_t{32} * 3 * 32;
  std::mt19937 rng(8);
  for (const CodecPolicy& p : Policies(shape, 16, rng)) {
    for (uint16_t bad :
         {0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81, 0x7E80, 0xFE80, 0x7F7F}) {
      for (size_t where : {size_t{0}, sec / 2 + 17, sec - 1}) {
        for (size_t tensor : {0, 1}) {
          std::vector<uint16_t> in =
              MakeBf16Data(shape, Bf16Data::kGaussian, 3);
          in[(2 + tensor) * sec + where] = bad;  // layer 1
          const size_t h = (where / 32) % 3;
          const std::string want =
              absl::StrCat("layer 1 ", tensor == 0 ? "K" : "V", " head ", h);
          for (bool reference : {true, false}) {
            std::vector<uint8_t> out(EncodedBlockBytes(shape, p), 0xAB);
            const absl::Status st =
                reference
                    ? EncodeBlockReference(shape, p, in, absl::MakeSpan(out))
                    : EncodeBlock(shape, p, in, absl::MakeSpan(out));
            ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument)
                << Describe(shape, p) << " " << bad << " at " << where;
            EXPECT_NE(std::string(st.message()).find(want), std::string::npos)
                << st.message();
            EXPECT_NE(std::string(st.message()).find("bf16"), std::string::npos)
                << st.message();
            for (uint8_t byte : out) {
              ASSERT_TRUE(byte == 0xAB || (!reference && byte == 0));
            }
          }
          in[(2 + tensor) * sec + where] = bad & 0x8000 ? 0xFE7F : 0x7E7F;
          std::vector<uint8_t> out(EncodedBlockBytes(shape, p));
          ASSERT_TRUE(EncodeBlock(shape, p, in, absl::MakeSpan(out)).ok());
          std::vector<uint16_t> back(in.size());
          ASSERT_TRUE(DecodeBlock(shape, p, out, absl::MakeSpan(back)).ok());
          if (!internal::IsFp8(p.codec)) {
            EXPECT_EQ(CountNonFinite(back, SourceDtype::kBf16), 0u)
                << Describe(shape, p);
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTargets, Bf16SimdTest,
                         ::testing::ValuesIn(SimdTargets()),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return SimdTargetName(info.param);
                         });

// ---- legal states
// ------------------------------------------------------------

TEST(Bf16LegalStatesTest, SourceOrRoundTripInBf16) {
  const BlockShape shape = Bf16Shape(2, 2, 32, 32);
  const std::vector<uint16_t> src =
      MakeBf16Data(shape, Bf16Data::kGaussian, 11);
  for (Codec c : kAllCodecs) {
    CodecPolicy p;
    p.codec = c;
    absl::StatusOr<LegalStates> ls = LegalStates::Make(shape, p, src);
    ASSERT_TRUE(ls.ok()) << ls.status();
    // The round trip is computed in bf16: the reference decode of the
    // reference encode.
    std::vector<uint8_t> enc(EncodedBlockBytes(shape, p));
    ASSERT_TRUE(EncodeBlockReference(shape, p, src, absl::MakeSpan(enc)).ok());
    std::vector<uint16_t> rt(src.size());
    ASSERT_TRUE(DecodeBlockReference(shape, p, enc, absl::MakeSpan(rt)).ok());
    EXPECT_EQ(ls->round_trip(), rt) << CodecName(c);
    EXPECT_EQ(*ls->Match(rt), BlockState::kRoundTrip);
    if (c == Codec::kFp8E4M3 || c == Codec::kFp8E5M2) {
      EXPECT_EQ(ls->Match(src).status().code(), absl::StatusCode::kDataLoss);
    } else {
      EXPECT_TRUE(ls->Match(src).ok());
    }
    std::vector<uint16_t> wrong = rt;
    wrong[5] = 0x7FC0;  // a bf16 NaN (an fp16 finite value)
    const absl::StatusOr<BlockState> m = ls->Match(wrong);
    ASSERT_EQ(m.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(std::string(m.status().message()).find("not finite"),
              std::string::npos)
        << m.status();
  }
  std::vector<uint16_t> bad = src;
  bad[0] = 0x7F80;
  EXPECT_EQ(LegalStates::Make(shape, CodecPolicy{}, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CountNonFinite(std::vector<uint16_t>{0x7F80, 0x7C00, 0xFFC0},
                           SourceDtype::kBf16),
            2u);
}

}  // namespace
}  // namespace kvcache::kernels
