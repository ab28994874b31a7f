// IEEE 754 binary16 ("half", fp16) <-> binary32 conversions, scalar.
//
// These are the reference conversions used by every codec (BRIEF section 4):
// float -> half rounds to nearest, ties to even, produces subnormals, and
// overflows to infinity; half -> float is exact. They are written with integer
// operations only, so they do not depend on the floating-point environment,
// and they agree bit for bit with the x86 F16C instruction VCVTPS2PH in
// round-to-nearest mode, including NaN payloads (a NaN keeps its sign and the
// top 10 bits of its payload and is made quiet).
#ifndef KVCACHE_KERNELS_HALF_H_
#define KVCACHE_KERNELS_HALF_H_

#include <cstdint>
#include <cstring>

// The conversions are also compiled into the CUDA kernels (nvcc), so that
// the GPU path runs the very same code.
#if defined(__CUDACC__)
#define KVCACHE_HD __host__ __device__
#else
#define KVCACHE_HD
#endif

namespace kvcache::kernels {

KVCACHE_HD inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVCACHE_HD inline float FloatFromBits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// True when the fp16 bit pattern is an infinity or a NaN.
KVCACHE_HD inline bool HalfIsNonFinite(uint16_t h) {
  return (h & 0x7C00u) == 0x7C00u;
}

// Exact conversion of an fp16 bit pattern to fp32.
KVCACHE_HD inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {  // inf / NaN: keep the payload.
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {  // normal
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {  // signed zero
    bits = sign;
  } else {             // subnormal: value = man * 2^-24; normalize.
    uint32_t e = 113;  // exponent field of 2^-14
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((man & 0x3FFu) << 13);
  }
  return FloatFromBits(bits);
}

// fp32 -> fp16, round to nearest even, subnormals, overflow to infinity.
KVCACHE_HD inline uint16_t HalfFromFloat(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) {  // NaN: quiet, top payload bits kept.
    return static_cast<uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
  }
  if (ax >= 0x477FF000u) {  // >= 65520 rounds to (or is) infinity.
    return static_cast<uint16_t>(sign | 0x7C00u);
  }
  if (ax >= 0x38800000u) {  // >= 2^-14: normal half.
    // Round the 13 dropped mantissa bits to nearest even; a carry into the
    // exponent field is the correct result.
    const uint32_t rounded = ax + 0x0FFFu + ((ax >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)));
  }
  if (ax <= 0x33000000u) {  // <= 2^-25: rounds to zero (2^-25 ties to 0).
    return static_cast<uint16_t>(sign);
  }
  // Subnormal half: the result is round(|f| / 2^-24). |f| = m * 2^(e - 150)
  // with the implicit bit in m, so |f| / 2^-24 = m >> (126 - e).
  const uint32_t e = ax >> 23;  // in [102, 112]
  const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // in [14, 24]
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u) != 0)) ++q;
  return static_cast<uint16_t>(sign | q);  // q == 0x400 is the smallest normal
}

// ---- bfloat16 ---------------------------------------------------------------
// bf16 is the top 16 bits of an fp32: sign, the same 8-bit exponent, 7
// mantissa bits (subnormals included). bf16 -> fp32 is exact; fp32 -> bf16
// rounds to nearest, ties to even (overflow to infinity, subnormals kept, no
// flush to zero), and a NaN stays a NaN: its sign and top 7 payload bits kept,
// made quiet (bit 6 set). Integer operations only, like HalfFromFloat; the
// CUDA kernels run this same code (the device's own conversion would return
// one canonical NaN).

// Exact conversion of a bf16 bit pattern to fp32.
KVCACHE_HD inline float Bf16ToFloat(uint16_t b) {
  return FloatFromBits(static_cast<uint32_t>(b) << 16);
}

// fp32 -> bf16, round to nearest even.
KVCACHE_HD inline uint16_t Bf16FromFloat(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN: quiet, payload top kept
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  }
  // Round the 16 dropped bits to nearest even; a carry into the exponent
  // (up to infinity) is the correct result.
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// True when the bf16 bit pattern is an infinity or a NaN.
KVCACHE_HD inline bool Bf16IsNonFinite(uint16_t b) {
  return (b & 0x7F80u) == 0x7F80u;
}

}  // namespace kvcache::kernels

#endif  // KVCACHE_KERNELS_HALF_H_
