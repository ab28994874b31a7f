#include "kernels/half.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kvcache::kernels {
namespace {

// Independent decode of an fp16 bit pattern from the IEEE 754 definition.
double RefHalfValue(uint16_t h) {
  const int sign = h >> 15;
  const int exp = (h >> 10) & 0x1F;
  const int man = h & 0x3FF;
  double v;
  if (exp == 0x1F) {
    v = man == 0 ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(man), -24);
  } else {
    v = std::ldexp(1.0 + man / 1024.0, exp - 15);
  }
  return sign ? -v : v;
}

// Independent fp32 -> fp16: the nearest finite half (ties to the even code),
// infinity at or beyond 65520 (the midpoint between 65504 and 2^16).
uint16_t RefHalfFromFloat(float f) {
  static const std::vector<double> kPositive = [] {
    std::vector<double> v;
    for (uint32_t c = 0; c <= 0x7BFF; ++c) v.push_back(RefHalfValue(c));
    return v;
  }();
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7C00;
  const auto it = std::lower_bound(kPositive.begin(), kPositive.end(), a);
  if (it == kPositive.end()) return sign | 0x7BFF;  // (65504, 65520)
  uint32_t hi = static_cast<uint32_t>(it - kPositive.begin());
  if (kPositive[hi] == a) return static_cast<uint16_t>(sign | hi);
  const uint32_t lo = hi - 1;
  const double dlo = a - kPositive[lo], dhi = kPositive[hi] - a;
  uint32_t pick = dlo < dhi ? lo : (dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi));
  return static_cast<uint16_t>(sign | pick);
}

TEST(HalfTest, ToFloatIsExactForEveryPattern) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    const double want = RefHalfValue(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      EXPECT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
    } else {
      EXPECT_EQ(static_cast<double>(f), want) << std::hex << h;
      EXPECT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
    }
  }
}

TEST(HalfTest, RoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t back = HalfFromFloat(HalfToFloat(static_cast<uint16_t>(h)));
    if (HalfIsNonFinite(static_cast<uint16_t>(h)) && (h & 0x3FF) != 0) {
      // NaN stays NaN, made quiet, sign and payload kept.
      EXPECT_EQ(back, h | 0x200) << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(HalfTest, FromFloatBoundaries) {
  EXPECT_EQ(HalfFromFloat(0.0f), 0x0000);
  EXPECT_EQ(HalfFromFloat(-0.0f), 0x8000);
  EXPECT_EQ(HalfFromFloat(65504.0f), 0x7BFF);
  EXPECT_EQ(HalfFromFloat(65519.99f), 0x7BFF);
  EXPECT_EQ(HalfFromFloat(65520.0f), 0x7C00);  // tie rounds to even: inf
  EXPECT_EQ(HalfFromFloat(-1e10f), 0xFC00);
  EXPECT_EQ(HalfFromFloat(INFINITY), 0x7C00);
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.0f, -25)), 0x0000);  // tie to even
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(HalfFromFloat(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp -> 2
  EXPECT_EQ(HalfFromFloat(std::ldexp(5.0f, -25)), 0x0002);  // 2.5 ulp -> 2
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(HalfFromFloat(std::ldexp(2047.0f, -25)), 0x0400);      // carries up
  EXPECT_EQ(HalfFromFloat(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie
  EXPECT_EQ(HalfFromFloat(1.0f + std::ldexp(3.0f, -11)), 0x3C02);  // tie
  EXPECT_EQ(HalfFromFloat(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(HalfFromFloat(-std::numeric_limits<float>::denorm_min()), 0x8000);
}

TEST(HalfTest, FromFloatMatchesNearestHalfOnSampledFloats) {
  // Every 251st fp32 bit pattern (about 17M values) plus the neighbours of
  // every half value and of every midpoint between adjacent halves.
  std::vector<uint32_t> bits;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 251) {
    bits.push_back(static_cast<uint32_t>(u));
  }
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    const float v = static_cast<float>(RefHalfValue(h));
    const float mid =
        static_cast<float>((RefHalfValue(h) + RefHalfValue(h + 1)) / 2);
    for (float f : {v, mid}) {
      const uint32_t b = FloatBits(f);
      for (uint32_t d = 0; d < 3; ++d) {
        bits.push_back(b + d);
        if (b >= d) bits.push_back(b - d);
      }
    }
  }
  size_t checked = 0;
  for (uint32_t b : bits) {
    for (uint32_t s : {0u, 0x80000000u}) {
      const float f = FloatFromBits(b ^ s);
      if (std::isnan(f)) continue;
      ASSERT_EQ(HalfFromFloat(f), RefHalfFromFloat(f))
          << std::hexfloat << f << " bits " << std::hex << (b ^ s);
      ++checked;
    }
  }
  EXPECT_GT(checked, size_t{30000000});
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) uint16_t HardwareHalf(float f) {
  return static_cast<uint16_t>(
      _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

TEST(HalfTest, FromFloatMatchesF16cIncludingNaN) {
  // CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports has no "f16c").
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || (ecx & (1u << 29)) == 0) {
    GTEST_SKIP() << "no F16C on this CPU";
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 61) {
    const float f = FloatFromBits(static_cast<uint32_t>(u));
    ASSERT_EQ(HalfFromFloat(f), HardwareHalf(f)) << std::hex << u;
  }
}
#endif

}  // namespace
}  // namespace kvcache::kernels
