// OCP 8-bit floating point (OFP8) conversions, scalar reference.
//
// E4M3 (OCP variant, "fn"): bias 7, 3 mantissa bits, no infinities, NaN is
//   S.1111.111 (0x7F / 0xFF), largest finite 448 (S.1111.110), smallest
//   subnormal 2^-9.
// E5M2: bias 15, 2 mantissa bits, IEEE-like: S.11111.00 is infinity,
//   S.11111.{01,10,11} are NaN, largest finite 57344 (S.11110.11), smallest
//   subnormal 2^-16.
//
// float -> fp8 is round to nearest, ties to even, "satfinite": every finite
// value or infinity whose magnitude reaches the largest finite value becomes
// that value with its sign; zeros keep their sign; a NaN becomes S.1111111
// (0x7F with the input's sign bit). fp8 -> float is exact.
#ifndef KVCACHE_KERNELS_FP8_H_
#define KVCACHE_KERNELS_FP8_H_

#include <cstdint>

#include "kernels/half.h"

namespace kvcache::kernels {
namespace fp8_internal {

// kManBits mantissa bits, exponent bias kBias; kMaxCode is the code of the
// largest finite magnitude (sign bit clear).
template <int kManBits, int kBias, uint32_t kMaxCode>
KVCACHE_HD inline uint8_t FromFloat(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);  // NaN
  constexpr uint32_t kDrop = 23 - kManBits;  // fp32 mantissa bits dropped
  // Largest finite fp8 magnitude as fp32 bits: its code shifted into place.
  constexpr uint32_t kMaxBits = ((kMaxCode >> kManBits) + 127 - kBias) << 23 |
                                (kMaxCode & ((1u << kManBits) - 1u)) << kDrop;
  if (ax >= kMaxBits) return static_cast<uint8_t>(sign | kMaxCode);  // sat
  constexpr uint32_t kMinNormalExp = 127 + 1 - kBias;  // fp32 exp field
  if ((ax >> 23) >= kMinNormalExp) {
    const uint32_t rounded =
        ax + ((1u << (kDrop - 1)) - 1u) + ((ax >> kDrop) & 1u);
    // Cannot exceed kMaxCode: ax < kMaxBits, so it rounds to at most max.
    return static_cast<uint8_t>(
        sign | ((rounded >> kDrop) - ((127u - kBias) << kManBits)));
  }
  // Subnormal range: result = round(|f| / 2^(1 - kBias - kManBits)).
  // Half the smallest subnormal (and below) rounds to zero.
  constexpr uint32_t kHalfUlpExp = 127 + 1 - kBias - kManBits - 1;
  if (ax <= (kHalfUlpExp << 23)) return static_cast<uint8_t>(sign);
  const uint32_t e = ax >> 23;  // > kHalfUlpExp, < kMinNormalExp
  const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
  // |f| = m * 2^(e - 150); divided by 2^(1 - kBias - kManBits) that is
  // m >> (150 + 1 - kBias - kManBits - e).
  constexpr uint32_t kShiftBase = 150 + 1 - kBias - kManBits;
  const uint32_t shift = kShiftBase - e;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u) != 0)) ++q;
  return static_cast<uint8_t>(sign | q);  // q == 1 << kManBits: min normal
}

template <int kManBits, int kBias>
KVCACHE_HD inline float ToFloatFinite(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> kManBits) & (0x7Fu >> kManBits);
  uint32_t man = code & ((1u << kManBits) - 1u);
  if (exp != 0) {
    return FloatFromBits(sign | ((exp + 127u - kBias) << 23) |
                         (man << (23 - kManBits)));
  }
  if (man == 0) return FloatFromBits(sign);
  uint32_t e = 127u + 1u - kBias;  // exponent field of the min normal
  while ((man & (1u << kManBits)) == 0) {
    man <<= 1;
    --e;
  }
  return FloatFromBits(sign | (e << 23) |
                       ((man & ((1u << kManBits) - 1u)) << (23 - kManBits)));
}

}  // namespace fp8_internal

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;

KVCACHE_HD inline uint8_t Fp8E4M3FromFloat(float f) {
  return fp8_internal::FromFloat<3, 7, 0x7E>(f);
}

KVCACHE_HD inline float Fp8E4M3ToFloat(uint8_t code) {
  if ((code & 0x7Fu) == 0x7Fu) {  // NaN, sign kept
    return FloatFromBits(static_cast<uint32_t>(code & 0x80u) << 24 |
                         0x7FC00000u);
  }
  return fp8_internal::ToFloatFinite<3, 7>(code);
}

KVCACHE_HD inline uint8_t Fp8E5M2FromFloat(float f) {
  return fp8_internal::FromFloat<2, 15, 0x7B>(f);
}

KVCACHE_HD inline float Fp8E5M2ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  if ((code & 0x7Fu) == 0x7Cu) return FloatFromBits(sign | 0x7F800000u);
  if ((code & 0x7Fu) > 0x7Cu) return FloatFromBits(sign | 0x7FC00000u);
  return fp8_internal::ToFloatFinite<2, 15>(code);
}

}  // namespace kvcache::kernels

#endif  // KVCACHE_KERNELS_FP8_H_
