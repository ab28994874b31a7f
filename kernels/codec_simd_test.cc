// The SIMD path against the scalar reference, byte for byte, on every
// Highway target this CPU supports.
#include "kernels/codec_simd.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/codec_internal.h"
#include "kernels/codec_test_util.h"
#include "kernels/half.h"

namespace kvcache::kernels {
namespace {

using internal::ActiveSimdTarget;
using internal::ForceSimdTargetForTest;
using internal::SimdTargetName;
using internal::SimdTargets;
using testutil::AllData;
using testutil::Data;
using testutil::Describe;
using testutil::MakeData;
using testutil::Policies;
using testutil::ShapeCase;
using testutil::Shapes;

class SimdTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    ForceSimdTargetForTest(GetParam());
    ASSERT_EQ(ActiveSimdTarget(), SimdTargetName(GetParam()));
  }
  void TearDown() override { ForceSimdTargetForTest(0); }
};

// The reference result of each case is computed once and compared with the
// SIMD result on every target.
TEST(SimdAllTargetsTest, EncodeAndDecodeMatchReferenceBitForBit) {
  const std::vector<int64_t> targets = SimdTargets();
  ASSERT_FALSE(targets.empty());
  std::mt19937 rng(1234);
  size_t blocks = 0;
  for (const ShapeCase& sc : Shapes()) {
    for (const CodecPolicy& p : Policies(sc.shape, sc.group, rng)) {
      if (!ValidatePolicy(sc.shape, p).ok()) continue;
      for (Data kind : AllData()) {
        const std::vector<uint16_t> in =
            MakeData(sc.shape, kind, static_cast<uint32_t>(rng()));
        const size_t bytes = EncodedBlockBytes(sc.shape, p);
        std::vector<uint8_t> ref(bytes, 0x5A);
        ASSERT_TRUE(
            EncodeBlockReference(sc.shape, p, in, absl::MakeSpan(ref)).ok());
        std::vector<uint16_t> out_ref(in.size(), 1);
        ASSERT_TRUE(
            DecodeBlockReference(sc.shape, p, ref, absl::MakeSpan(out_ref))
                .ok());
        for (int64_t target : targets) {
          ForceSimdTargetForTest(target);
          ASSERT_EQ(ActiveSimdTarget(), SimdTargetName(target));
          std::vector<uint8_t> simd(bytes, 0xA5);
          ASSERT_TRUE(EncodeBlock(sc.shape, p, in, absl::MakeSpan(simd)).ok());
          for (size_t i = 0; i < bytes; ++i) {
            ASSERT_EQ(simd[i], ref[i])
                << SimdTargetName(target) << " encode byte " << i << " "
                << Describe(sc.shape, p) << " data " << static_cast<int>(kind);
          }
          std::vector<uint16_t> out_simd(in.size(), 2);
          ASSERT_TRUE(
              DecodeBlock(sc.shape, p, ref, absl::MakeSpan(out_simd)).ok());
          for (size_t i = 0; i < in.size(); ++i) {
            ASSERT_EQ(out_simd[i], out_ref[i])
                << SimdTargetName(target) << " decode value " << i << " "
                << Describe(sc.shape, p) << " data " << static_cast<int>(kind);
          }
        }
        ForceSimdTargetForTest(0);
        ++blocks;
      }
    }
  }
  EXPECT_GT(blocks, size_t{500});
}

// Decoding arbitrary bytes (every fp8 code including NaN and infinity codes,
// every KIVI code) must agree too. KIVI metadata is kept finite: the payload
// of a NaN made from two NaN operands is not fixed by the source code.
TEST_P(SimdTest, DecodeOfArbitraryBytesMatchesReference) {
  std::mt19937 rng(99);
  for (const ShapeCase& sc : Shapes()) {
    for (const CodecPolicy& p : Policies(sc.shape, sc.group, rng)) {
      if (!ValidatePolicy(sc.shape, p).ok()) continue;
      std::vector<uint8_t> enc(EncodedBlockBytes(sc.shape, p));
      for (auto& b : enc) b = static_cast<uint8_t>(rng());
      const bool kivi = p.codec == Codec::kKivi2 || p.codec == Codec::kKivi4;
      const bool fp8 = p.codec == Codec::kFp8E4M3 || p.codec == Codec::kFp8E5M2;
      // Walk the sections to make metadata sensible.
      size_t off = 0;
      const size_t n = size_t{sc.shape.tokens_per_block} *
                       sc.shape.num_kv_heads * sc.shape.head_dim;
      for (uint32_t l = 0; l < sc.shape.num_layers; ++l) {
        const bool skip = !p.fp16_layers.empty() && p.fp16_layers[0] == l;
        for (int t = 0; t < 2; ++t) {
          if (skip || p.codec == Codec::kNone) {
            off += 2 * n;
            continue;
          }
          if (fp8) {
            if (p.scale_mode == ScaleMode::kDynamic) {
              for (uint32_t h = 0; h < sc.shape.num_kv_heads; ++h) {
                const float s = std::ldexp(1.0f + (rng() % 1000) / 1000.0f,
                                           static_cast<int>(rng() % 60) - 40);
                internal::StoreLe32(&enc[off + 4 * h], FloatBits(s));
              }
              off += 4 * sc.shape.num_kv_heads;
            }
            off += n;
          } else if (kivi) {
            const size_t groups = n / p.kivi_group_size;
            for (size_t g = 0; g < 2 * groups; ++g) {
              uint16_t h;
              do {
                h = static_cast<uint16_t>(rng());
              } while (HalfIsNonFinite(h));
              internal::StoreLe16(&enc[off + 2 * g], h);
            }
            const uint32_t b = p.codec == Codec::kKivi2 ? 2 : 4;
            off += 4 * groups + (n * b + 7) / 8;
          }
        }
      }
      ASSERT_EQ(off, enc.size());
      std::vector<uint16_t> out_ref(Fp16BlockBytes(sc.shape) / 2, 1);
      std::vector<uint16_t> out_simd(out_ref.size(), 2);
      ASSERT_TRUE(
          DecodeBlockReference(sc.shape, p, enc, absl::MakeSpan(out_ref)).ok());
      ASSERT_TRUE(DecodeBlock(sc.shape, p, enc, absl::MakeSpan(out_simd)).ok());
      for (size_t i = 0; i < out_ref.size(); ++i) {
        ASSERT_EQ(out_simd[i], out_ref[i])
            << "value " << i << " " << Describe(sc.shape, p);
      }
    }
  }
}

// A process may run with denormal arithmetic switched off: PyTorch's
// set_flush_denormal(True), or a library built with -ffast-math, sets the
// x86 MXCSR's flush-to-zero and denormals-are-zero bits, and threads
// inherit them from the thread that created them. The codecs must give the
// same bits there (they are exact conversions), so no step may take or
// make an fp32 subnormal. Both encoded data and arbitrary codes (every fp8
// subnormal code) are decoded, from fp16 and bf16 sources.
#if defined(__SSE__) || defined(__x86_64__)
// testutil::Policies (each codec; a layer kept at fp16; fp8 static scales
// per layer and per head, 1e-30 to 1e30), and fp8 with static scales around
// the bounds where the decoder folds a scale into its conversion (2^8 for
// E4M3, 2^16 for E5M2) and down to 2^-100 (products of the smallest codes
// stay fp32 normal, for bf16 results).
std::vector<CodecPolicy> DenormalTestPolicies(const BlockShape& shape,
                                              std::mt19937& rng) {
  std::vector<CodecPolicy> policies = Policies(shape, /*group=*/32, rng);
  for (Codec c : {Codec::kFp8E4M3, Codec::kFp8E5M2}) {
    std::vector<float> scales = {0x1p-100f,      0x1.fffffep7f, 256.0f,
                                 0x1.fffffep15f, 65536.0f,      1.0f,
                                 3.0f,           1.0f / 448};
    const size_t per_tensor = size_t{shape.num_layers} * shape.num_kv_heads;
    while (scales.size() < 2 * per_tensor) {
      scales.push_back(std::ldexp(1.0f + (rng() >> 9) * 0x1p-23f,
                                  static_cast<int>(rng() % 41) - 20));
    }
    CodecPolicy p;
    p.codec = c;
    p.scale_mode = ScaleMode::kStaticPerLayerHead;
    p.static_k_scales.assign(scales.begin(), scales.begin() + per_tensor);
    p.static_v_scales.assign(scales.begin() + per_tensor, scales.end());
    policies.push_back(p);
  }
  for (const CodecPolicy& p : policies) {
    const absl::Status valid = ValidatePolicy(shape, p);
    if (!valid.ok()) ADD_FAILURE() << valid << " " << Describe(shape, p);
  }
  return policies;
}

class DenormalsOffScope {
 public:
  DenormalsOffScope() : saved_(_mm_getcsr()) {
    _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero);
  }
  ~DenormalsOffScope() { _mm_setcsr(saved_); }
  DenormalsOffScope(const DenormalsOffScope&) = delete;
  DenormalsOffScope& operator=(const DenormalsOffScope&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  const unsigned saved_;
};

TEST_P(SimdTest, SameBitsWithDenormalArithmeticOff) {
  std::mt19937 rng(1907);
  for (const SourceDtype dtype : {SourceDtype::kFp16, SourceDtype::kBf16}) {
    BlockShape shape{2, 8, 128, 32};
    shape.source_dtype = dtype;
    for (const CodecPolicy& p : DenormalTestPolicies(shape, rng)) {
      const Codec c = p.codec;
      const size_t bytes = EncodedBlockBytes(shape, p);
      for (Data kind : {Data::kTiny, Data::kSpecials, Data::kRandomBits,
                        Data::kGaussian, Data::kSparse}) {
        std::vector<uint16_t> in = MakeData(shape, kind, rng());
        if (dtype == SourceDtype::kBf16) {
          // The same values as bf16. Values below 2^-126, fp32 subnormals
          // themselves (and the scales of heads made of them), read as zero
          // where denormals are off whatever the code does; KV has none.
          for (uint16_t& v : in) v = Bf16FromFloat(HalfToFloat(v));
        }
        std::vector<uint8_t> codes(bytes);
        if (!EncodeBlockReference(shape, p, in, absl::MakeSpan(codes)).ok()) {
          continue;  // KIVI rejects what it cannot hold; fp8 saturates
        }
        // Arbitrary fp8 codes after each head's scale: every subnormal code
        // in odd rows, only normal codes (the decoder's other path) in even
        // ones.
        std::vector<uint8_t> arbitrary = codes;
        if ((c == Codec::kFp8E4M3 || c == Codec::kFp8E5M2) &&
            p.fp16_layers.empty()) {
          const size_t n = size_t{shape.tokens_per_block} * shape.num_kv_heads *
                           shape.head_dim;
          const size_t head =
              p.scale_mode == ScaleMode::kDynamic ? 4 * shape.num_kv_heads : 0;
          const uint32_t min_normal = c == Codec::kFp8E4M3 ? 8 : 4;
          const uint32_t max_finite = c == Codec::kFp8E4M3 ? 0x7E : 0x7B;
          for (size_t off = 0; off < bytes; off += head + n) {
            for (size_t i = 0; i < n; ++i) {
              uint32_t code = rng() & 0xFF;
              if ((i / shape.head_dim) % 2 == 0) {
                code = (code & 0x80) |
                       (min_normal + code % (max_finite - min_normal + 1));
              }
              arbitrary[off + head + i] = static_cast<uint8_t>(code);
            }
          }
        }
        for (const std::vector<uint8_t>* enc : {&codes, &arbitrary}) {
          std::vector<uint16_t> out_ref(in.size(), 1);
          ASSERT_TRUE(
              DecodeBlockReference(shape, p, *enc, absl::MakeSpan(out_ref))
                  .ok());
          std::vector<uint8_t> simd(bytes, 0xA5);
          std::vector<uint16_t> out_simd(in.size(), 2);
          {
            DenormalsOffScope denormals_off;
            ASSERT_TRUE(EncodeBlock(shape, p, in, absl::MakeSpan(simd)).ok());
            ASSERT_TRUE(
                DecodeBlock(shape, p, *enc, absl::MakeSpan(out_simd)).ok());
          }
          ASSERT_TRUE(simd == codes)
              << CodecName(c) << " encode, data " << static_cast<int>(kind);
          size_t wrong = 0, first = 0;
          for (size_t i = 0; i < in.size(); ++i) {
            if (out_simd[i] != out_ref[i] && wrong++ == 0) first = i;
          }
          ASSERT_EQ(wrong, 0u)
              << CodecName(c) << " decode, data " << static_cast<int>(kind)
              << (enc == &codes ? "" : ", arbitrary codes") << ": first "
              << first << " is " << out_simd[first] << ", reference "
              << out_ref[first] << ", " << SourceDtypeName(dtype);
        }
      }
    }
  }
}
#endif  // x86

TEST_P(SimdTest, FindsTheFirstNonFiniteValue) {
  std::mt19937 rng(5);
  for (size_t n : {0, 1, 7, 8, 31, 64, 65, 1000, 4099}) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = static_cast<uint16_t>(rng() % 0x7C00);
    EXPECT_EQ(internal::FindNonFiniteHalfSimd(v.data(), n), n);
    for (size_t trial = 0; trial < 20 && n > 0; ++trial) {
      std::vector<uint16_t> w = v;
      const size_t a = rng() % n, b = rng() % n;
      w[a] = (rng() & 1) ? 0x7C00 : 0xFE01;
      w[b] = 0xFC00;
      EXPECT_EQ(internal::FindNonFiniteHalfSimd(w.data(), n), std::min(a, b));
    }
  }
}

// Every (token group, channel) KIVI key group and every fp8 head of a large
// random block, across the finite fp16 range.
TEST_P(SimdTest, LargeRandomBlocks) {
  const BlockShape shape{4, 8, 128, 64};
  std::mt19937 rng(77);
  for (Data kind : {Data::kGaussian, Data::kRandomBits}) {
    const std::vector<uint16_t> in = MakeData(shape, kind, 31);
    for (Codec c : kAllCodecs) {
      CodecPolicy p;
      p.codec = c;
      const size_t bytes = EncodedBlockBytes(shape, p);
      std::vector<uint8_t> ref(bytes), simd(bytes);
      ASSERT_TRUE(EncodeBlockReference(shape, p, in, absl::MakeSpan(ref)).ok());
      ASSERT_TRUE(EncodeBlock(shape, p, in, absl::MakeSpan(simd)).ok());
      ASSERT_TRUE(ref == simd) << CodecName(c);
      std::vector<uint16_t> a(in.size()), b(in.size());
      ASSERT_TRUE(DecodeBlockReference(shape, p, ref, absl::MakeSpan(a)).ok());
      ASSERT_TRUE(DecodeBlock(shape, p, ref, absl::MakeSpan(b)).ok());
      ASSERT_TRUE(a == b) << CodecName(c);
    }
  }
}

// DecodeStores::kStreaming writes the bytes the cached decode writes and
// nothing around them, wherever the output lies: vector-aligned (streamed)
// or 2, 16 and 32 bytes past an alignment (streamed only where the vectors
// still line up), for every codec, both source dtypes and the shapes whose
// rows leave vector tails or fit no vector.
TEST_P(SimdTest, StreamingDecodeWritesTheSameBytesAndNothingElse) {
  constexpr size_t kGuard = 64;  // uint16_t values each side
  constexpr uint16_t kGuardValue = 0xCDCD;
  std::mt19937 rng(4242);
  size_t cases = 0;
  for (const ShapeCase& sc : Shapes()) {
    for (SourceDtype dtype : {SourceDtype::kFp16, SourceDtype::kBf16}) {
      BlockShape shape = sc.shape;
      shape.source_dtype = dtype;
      const std::vector<uint16_t> in =
          testutil::MakeSourceData(shape, 0, static_cast<uint32_t>(rng()));
      for (const CodecPolicy& p : Policies(shape, sc.group, rng)) {
        if (!ValidatePolicy(shape, p).ok()) continue;
        std::vector<uint8_t> enc(EncodedBlockBytes(shape, p));
        ASSERT_TRUE(EncodeBlock(shape, p, in, absl::MakeSpan(enc)).ok())
            << Describe(shape, p);
        std::vector<uint16_t> cached(in.size());
        ASSERT_TRUE(DecodeBlock(shape, p, enc, absl::MakeSpan(cached)).ok());
        for (size_t skew : {0, 1, 8, 16}) {  // in uint16_t values
          std::vector<uint16_t> buf(in.size() + 2 * kGuard + 64, kGuardValue);
          // The first value at a 64-byte boundary of buf, past the guard.
          const size_t misalign =
              (reinterpret_cast<uintptr_t>(buf.data() + kGuard) % 64) / 2;
          const size_t at = kGuard + (32 - misalign) % 32 + skew;
          ASSERT_TRUE(DecodeBlock(shape, p, enc,
                                  absl::MakeSpan(buf.data() + at, in.size()),
                                  DecodeStores::kStreaming)
                          .ok());
          for (size_t i = 0; i < buf.size(); ++i) {
            const bool inside = i >= at && i < at + in.size();
            ASSERT_EQ(buf[i], inside ? cached[i - at] : kGuardValue)
                << (inside ? "value " : "guard ") << i << " skew " << skew
                << " " << Describe(shape, p)
                << (dtype == SourceDtype::kBf16 ? " bf16" : " fp16");
          }
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, size_t{300});
}

// The fp8 encoder's table path (codec_simd.cc) against the reference on
// every finite fp16 value, over scales across the fp32 range: powers of two,
// all-ones significands, the smallest normal and a subnormal (which take the
// exact path), and random ones. Each head's 496 x 128 values are every finite
// bit pattern in order from a per-head start, so rows of small values (the
// exact path) and rows of larger ones (the table) both occur.
TEST_P(SimdTest, Fp8EveryFiniteHalfOverManyScales) {
  const BlockShape shape{1, 8, 128, 496};
  std::vector<uint16_t> finite;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7C00u) != 0x7C00u) finite.push_back(static_cast<uint16_t>(b));
  }
  ASSERT_EQ(finite.size(), size_t{496} * 128);
  std::vector<uint16_t> in(Fp16BlockBytes(shape) / 2);
  const size_t per_head = finite.size();
  for (size_t tensor = 0; tensor < 2; ++tensor) {
    for (size_t h = 0; h < 8; ++h) {
      for (size_t i = 0; i < per_head; ++i) {
        // [T][H][D] within each of the K and V sections.
        const size_t t = i / 128, d = i % 128;
        in[tensor * per_head * 8 + (t * 8 + h) * 128 + d] =
            finite[(i + h * 7919 + tensor * 104729) % per_head];
      }
    }
  }
  std::vector<float> scales = {1.0f,
                               0.5f,
                               2.0f,
                               3.0f,
                               1.0f / 448,
                               65504.0f / 448,
                               65504.0f / 57344,
                               1e-3f,
                               0x1p-126f,
                               1e-40f,
                               3e38f,
                               FloatFromBits(0x3FFFFFFFu),
                               FloatFromBits(0x3F800001u),
                               0x1p-24f / 448};
  for (int e = -40; e <= 40; e += 5) scales.push_back(std::ldexp(1.0f, e));
  for (int e = -30; e <= 30; e += 10) {
    scales.push_back(std::ldexp(FloatFromBits(0x3FFFFFFFu), e));
  }
  std::mt19937 rng(2026);
  while (scales.size() % 16 != 0 || scales.size() < 64) {
    scales.push_back(std::ldexp(1.0f + (rng() >> 9) * 0x1p-23f,
                                static_cast<int>(rng() % 61) - 30));
  }
  for (Codec c : {Codec::kFp8E4M3, Codec::kFp8E5M2}) {
    for (size_t first = 0; first <= scales.size(); first += 16) {
      CodecPolicy p;
      p.codec = c;
      if (first < scales.size()) {
        p.scale_mode = ScaleMode::kStaticPerLayerHead;
        p.static_k_scales.assign(scales.begin() + first,
                                 scales.begin() + first + 8);
        p.static_v_scales.assign(scales.begin() + first + 8,
                                 scales.begin() + first + 16);
      }  // else dynamic scales
      ASSERT_TRUE(ValidatePolicy(shape, p).ok());
      const size_t bytes = EncodedBlockBytes(shape, p);
      std::vector<uint8_t> ref(bytes), simd(bytes);
      ASSERT_TRUE(EncodeBlockReference(shape, p, in, absl::MakeSpan(ref)).ok());
      ASSERT_TRUE(EncodeBlock(shape, p, in, absl::MakeSpan(simd)).ok());
      for (size_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(simd[i], ref[i])
            << CodecName(c) << " byte " << i << " scales from " << first;
      }
    }
  }
}

// KIVI encoders find inf and NaN while they find group extremes (no
// separate pass): every kind, in keys and values, at the start, middle and
// end of a section, on shapes that take the AVX-512 paths and on ones that
// do not.
TEST_P(SimdTest, KiviRejectsNonFiniteWhileEncoding) {
  for (const BlockShape& shape :
       {BlockShape{2, 8, 128, 64}, BlockShape{2, 3, 32, 32}}) {
    const size_t sec =
        size_t{shape.tokens_per_block} * shape.num_kv_heads * shape.head_dim;
    for (Codec c : {Codec::kKivi2, Codec::kKivi4}) {
      for (uint16_t bad : {0x7C00, 0xFC00, 0x7C01, 0x7FFF, 0xFC01, 0xFFFF}) {
        for (size_t where : {size_t{0}, sec / 2 + 17, sec - 1}) {
          for (size_t tensor : {0, 1}) {
            CodecPolicy p;
            p.codec = c;
            std::vector<uint16_t> in = MakeData(shape, Data::kGaussian, 3);
            in[(2 + tensor) * sec + where] = bad;  // layer 1
            std::vector<uint8_t> out(EncodedBlockBytes(shape, p), 0xAB);
            const absl::Status st =
                EncodeBlock(shape, p, in, absl::MakeSpan(out));
            ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument)
                << CodecName(c) << " " << bad << " at " << where;
            EXPECT_NE(std::string(st.message())
                          .find(tensor == 0 ? "layer 1 K" : "layer 1 V"),
                      std::string::npos)
                << st.message();
            for (uint8_t byte : out) ASSERT_TRUE(byte == 0xAB || byte == 0);
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTargets, SimdTest,
                         ::testing::ValuesIn(SimdTargets()),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return SimdTargetName(info.param);
                         });

TEST(SimdTargetsTest, DispatchUsesTheBestTarget) {
  const std::vector<int64_t> targets = SimdTargets();
  ASSERT_FALSE(targets.empty());
  EXPECT_EQ(ActiveSimdTarget(), SimdTargetName(targets.front()));
}

}  // namespace
}  // namespace kvcache::kernels

namespace kvcache::kernels {
namespace {

// Significands in [1, 2) of the fp16 values: 1 + k/1024.
std::vector<float> HalfSignificands() {
  std::vector<float> v;
  for (int k = 0; k < 1024; ++k) v.push_back(1.0f + k / 1024.0f);
  return v;
}

std::vector<float> RandomSignificands(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v = {1.0f, std::nextafter(2.0f, 1.0f),
                          std::nextafter(1.0f, 2.0f), 1.5f, 1.75f};
  while (v.size() < n) v.push_back(FloatFromBits(0x3F800000u | (rng() >> 9)));
  return v;
}

// The SIMD division (an FMA correction step on targets with FMA) against
// IEEE division for the two ways the codecs divide: an fp16 dividend by any
// fp32 scale (fp8), any fp32 dividend by an fp16 scale (KIVI). The sequence
// is scale invariant, so significand pairs are what matters; the exhaustive
// test below covers all of them.
TEST(SimdDivisionTest, SampledSignificandPairsAndRanges) {
  const std::vector<float> halves = HalfSignificands();
  const std::vector<float> floats = RandomSignificands(1 << 14, 3);
  std::vector<float> all_halves;  // every finite nonzero fp16 value
  for (uint32_t h = 1; h < 0x7C00; ++h) all_halves.push_back(HalfToFloat(h));
  std::mt19937 rng(8);
  std::vector<float> scales;  // across the range the fp8 path uses
  for (int i = 0; i < 300; ++i) {
    scales.push_back(std::ldexp(1.0f + (rng() >> 9) * 0x1p-23f,
                                static_cast<int>(rng() % 129) - 64));
  }
  for (int64_t target : SimdTargets()) {
    ForceSimdTargetForTest(target);
    EXPECT_EQ(internal::DivisionMismatches(halves.data(), halves.size(),
                                           floats.data(), floats.size()),
              0u)
        << SimdTargetName(target);
    EXPECT_EQ(internal::DivisionMismatches(floats.data(), floats.size(),
                                           halves.data(), halves.size()),
              0u)
        << SimdTargetName(target);
    EXPECT_EQ(internal::DivisionMismatches(all_halves.data(), all_halves.size(),
                                           scales.data(), scales.size()),
              0u)
        << SimdTargetName(target);
  }
  ForceSimdTargetForTest(0);
}

// Every pair: 2^23 fp32 significands x 2^10 fp16 significands, both ways
// (about 10 s): together with scale invariance, a proof that the SIMD
// division equals IEEE division for every input the codecs divide.
TEST(SimdDivisionTest, ExhaustiveSignificandPairs) {
  const std::vector<float> halves = HalfSignificands();
  std::vector<float> floats(1u << 23);
  for (uint32_t m = 0; m < (1u << 23); ++m) {
    floats[m] = FloatFromBits(0x3F800000u | m);
  }
  for (int64_t target : SimdTargets()) {
    ForceSimdTargetForTest(target);
    EXPECT_EQ(internal::DivisionMismatches(halves.data(), halves.size(),
                                           floats.data(), floats.size()),
              0u)
        << SimdTargetName(target);
    EXPECT_EQ(internal::DivisionMismatches(floats.data(), floats.size(),
                                           halves.data(), halves.size()),
              0u)
        << SimdTargetName(target);
  }
  ForceSimdTargetForTest(0);
}

}  // namespace
}  // namespace kvcache::kernels
