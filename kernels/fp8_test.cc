#include "kernels/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/half.h"

namespace kvcache::kernels {
namespace {

// An independent model of the two OCP FP8 formats, written from the OCP 8-bit
// floating point specification (v1.0): decode every code from its fields,
// encode by choosing the nearest representable value.
struct OcpFormat {
  int exp_bits;
  int man_bits;
  int bias;
  bool e4m3;  // E4M3: no infinities, only S.1111.111 is NaN

  bool IsNaN(int code) const {
    const int e = (code >> man_bits) & ((1 << exp_bits) - 1);
    const int m = code & ((1 << man_bits) - 1);
    if (e4m3) return e == 15 && m == 7;
    return e == 31 && m != 0;
  }
  bool IsInf(int code) const {
    if (e4m3) return false;
    return ((code >> 2) & 31) == 31 && (code & 3) == 0;
  }
  double Value(int code) const {
    const double sign = (code & 0x80) ? -1.0 : 1.0;
    if (IsNaN(code)) return std::numeric_limits<double>::quiet_NaN();
    if (IsInf(code)) return sign * std::numeric_limits<double>::infinity();
    const int e = (code >> man_bits) & ((1 << exp_bits) - 1);
    const int m = code & ((1 << man_bits) - 1);
    const double frac = m / static_cast<double>(1 << man_bits);
    if (e == 0) return sign * std::ldexp(frac, 1 - bias);
    return sign * std::ldexp(1.0 + frac, e - bias);
  }
  // Positive finite codes in increasing order of value, with their values.
  std::vector<std::pair<double, int>> PositiveFinite() const {
    std::vector<std::pair<double, int>> v;
    for (int c = 0; c < 0x80; ++c) {
      if (!IsNaN(c) && !IsInf(c)) v.push_back({Value(c), c});
    }
    std::sort(v.begin(), v.end());
    return v;
  }
  const std::vector<std::pair<double, int>>& Table() const {
    if (e4m3) {
      static const auto* e4m3_table =
          new std::vector<std::pair<double, int>>(PositiveFinite());
      return *e4m3_table;
    }
    static const auto* e5m2_table =
        new std::vector<std::pair<double, int>>(PositiveFinite());
    return *e5m2_table;
  }
  // Round to nearest, ties to the code with an even mantissa (the even code),
  // saturating to the largest finite value (satfinite), NaN -> S.1111111.
  uint8_t Encode(double x) const {
    const int sign = std::signbit(x) ? 0x80 : 0;
    if (std::isnan(x)) return static_cast<uint8_t>(sign | 0x7F);
    const auto& table = Table();
    const double a = std::fabs(x);
    if (a >= table.back().first)
      return static_cast<uint8_t>(sign | table.back().second);
    int best = -1;
    double best_d = 0;
    for (const auto& [value, code] : table) {
      const double d = std::fabs(value - a);
      if (best < 0 || d < best_d || (d == best_d && code % 2 == 0)) {
        best = code;
        best_d = d;
      }
    }
    return static_cast<uint8_t>(sign | best);
  }
};

constexpr OcpFormat kE4M3{4, 3, 7, true};
constexpr OcpFormat kE5M2{5, 2, 15, false};

double HalfValue(uint16_t h) {  // independent of kernels/half.h
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1F) {
    return m ? std::numeric_limits<double>::quiet_NaN()
             : s * std::numeric_limits<double>::infinity();
  }
  if (e == 0) return s * std::ldexp(m, -24);
  return s * std::ldexp(1.0 + m / 1024.0, e - 15);
}

TEST(Fp8Test, FormatModelSanity) {
  EXPECT_EQ(kE4M3.Value(0x7E), 448.0);
  EXPECT_EQ(kE4M3.Value(0x01), std::ldexp(1.0, -9));
  EXPECT_TRUE(kE4M3.IsNaN(0x7F));
  EXPECT_TRUE(kE4M3.IsNaN(0xFF));
  EXPECT_EQ(kE4M3.PositiveFinite().size(), 127u);
  EXPECT_EQ(kE5M2.Value(0x7B), 57344.0);
  EXPECT_EQ(kE5M2.Value(0x01), std::ldexp(1.0, -16));
  EXPECT_TRUE(kE5M2.IsInf(0x7C));
  EXPECT_EQ(kE5M2.PositiveFinite().size(), 124u);
}

TEST(Fp8Test, DecodeEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    for (const auto& [fmt, got] : {std::pair{kE4M3, Fp8E4M3ToFloat(code)},
                                   std::pair{kE5M2, Fp8E5M2ToFloat(code)}}) {
      const double want = fmt.Value(c);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << c;
      } else {
        EXPECT_EQ(static_cast<double>(got), want) << c;
        EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << c;
      }
    }
  }
}

// Every fp16 bit pattern, as a float at scale 1, through both encoders.
TEST(Fp8Test, EncodeEveryHalfExhaustively) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const double v = HalfValue(static_cast<uint16_t>(h));
    const float f = static_cast<float>(v);
    ASSERT_EQ(Fp8E4M3FromFloat(f), kE4M3.Encode(v)) << "half " << std::hex << h;
    ASSERT_EQ(Fp8E5M2FromFloat(f), kE5M2.Encode(v)) << "half " << std::hex << h;
  }
}

// fp32 inputs (what x / scale produces): every value next to each fp8 value
// and each midpoint, and a sample of all fp32 bit patterns.
TEST(Fp8Test, EncodeSampledFloats) {
  std::vector<uint32_t> bits;
  for (const OcpFormat& fmt : {kE4M3, kE5M2}) {
    const auto table = fmt.PositiveFinite();
    for (size_t i = 0; i < table.size(); ++i) {
      std::vector<double> points = {table[i].first};
      if (i + 1 < table.size()) {
        points.push_back((table[i].first + table[i + 1].first) / 2);
      }
      for (double p : points) {
        const uint32_t b = FloatBits(static_cast<float>(p));
        for (uint32_t d = 0; d < 4; ++d) {
          bits.push_back(b + d);
          if (b >= d) bits.push_back(b - d);
        }
      }
    }
  }
  for (uint64_t u = 0; u < 0x80000000u; u += 4093) {
    bits.push_back(static_cast<uint32_t>(u));
  }
  bits.push_back(0x7F800000u);  // inf saturates
  bits.push_back(0x00000001u);  // fp32 denormal
  for (uint32_t b : bits) {
    for (uint32_t s : {0u, 0x80000000u}) {
      const float f = FloatFromBits(b | s);
      ASSERT_EQ(Fp8E4M3FromFloat(f), kE4M3.Encode(f))
          << std::hexfloat << f << " bits " << std::hex << (b | s);
      ASSERT_EQ(Fp8E5M2FromFloat(f), kE5M2.Encode(f))
          << std::hexfloat << f << " bits " << std::hex << (b | s);
    }
  }
}

TEST(Fp8Test, NamedCases) {
  EXPECT_EQ(Fp8E4M3FromFloat(0.0f), 0x00);
  EXPECT_EQ(Fp8E4M3FromFloat(-0.0f), 0x80);
  EXPECT_EQ(Fp8E4M3FromFloat(448.0f), 0x7E);
  EXPECT_EQ(Fp8E4M3FromFloat(464.0f), 0x7E);  // would round to 480: sat
  EXPECT_EQ(Fp8E4M3FromFloat(-1e30f), 0xFE);
  EXPECT_EQ(Fp8E4M3FromFloat(INFINITY), 0x7E);
  EXPECT_EQ(Fp8E4M3FromFloat(-INFINITY), 0xFE);
  EXPECT_EQ(Fp8E4M3FromFloat(NAN), 0x7F);
  EXPECT_EQ(Fp8E4M3FromFloat(std::ldexp(1.0f, -10)), 0x00);   // tie to 0
  EXPECT_EQ(Fp8E4M3FromFloat(std::ldexp(3.0f, -10)), 0x02);   // tie to even
  EXPECT_EQ(Fp8E4M3FromFloat(std::ldexp(15.0f, -10)), 0x08);  // to normal
  EXPECT_EQ(Fp8E4M3FromFloat(1.0625f), 0x38);  // 1 + 1/16: tie to 1.0
  EXPECT_EQ(Fp8E4M3FromFloat(1.1875f), 0x3A);  // 1 + 3/16: tie to 1.25
  EXPECT_EQ(Fp8E5M2FromFloat(57344.0f), 0x7B);
  EXPECT_EQ(Fp8E5M2FromFloat(65504.0f), 0x7B);
  EXPECT_EQ(Fp8E5M2FromFloat(-INFINITY), 0xFB);
  EXPECT_EQ(Fp8E5M2FromFloat(-0.0f), 0x80);
  EXPECT_EQ(Fp8E5M2FromFloat(std::ldexp(1.0f, -17)), 0x00);
  EXPECT_EQ(Fp8E5M2FromFloat(std::ldexp(1.0001f, -17)), 0x01);
  EXPECT_EQ(Fp8E5M2FromFloat(1.125f), 0x3C);  // tie to 1.0
  EXPECT_EQ(Fp8E5M2FromFloat(1.375f), 0x3E);  // tie to 1.5
}

}  // namespace
}  // namespace kvcache::kernels
