// Highway SIMD section codecs with runtime dispatch. Every operation mirrors
// the scalar reference (codec_reference.cc) so that the output is
// bit-identical: IEEE fp32 add, subtract, multiply and divide (never a
// reciprocal, never a fused multiply-add: this file is compiled with
// -ffp-contract=off and uses no MulAdd), fp32 -> fp16 and fp32 -> fp8 rounding
// to nearest even done with integer operations (or F16C, which rounds the
// same way), and the same order of operations.
#include "kernels/codec_simd.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/codec_internal.h"
#include "kernels/fp8.h"
#include "kernels/half.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/codec_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kvcache::kernels::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR

// x86 targets from AVX2 up have F16C, whose conversions round to nearest even
// and handle subnormals, infinities and NaN like HalfFromFloat/HalfToFloat.
// Highway's emulation on older targets truncates, so those use ours.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define KVCACHE_NATIVE_F16C 1
#else
#define KVCACHE_NATIVE_F16C 0
#endif

// ---- fp16 <-> fp32 -------------------------------------------------------

template <class DF>
HWY_INLINE hn::Vec<DF> HalfToF32(DF df, hn::Vec<hn::Rebind<uint16_t, DF>> h) {
#if KVCACHE_NATIVE_F16C
  return hn::PromoteTo(df, hn::BitCast(hn::Rebind<hwy::float16_t, DF>(), h));
#else
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto b = hn::PromoteTo(du, h);
  const auto sign = hn::ShiftLeft<16>(hn::And(b, hn::Set(du, 0x8000u)));
  const auto em = hn::And(b, hn::Set(du, 0x7FFFu));
  const auto shifted = hn::ShiftLeft<13>(em);
  // Normal and subnormal: the bits shifted into place read as a float that
  // is 2^-112 times the value (a float subnormal for a half subnormal).
  const auto finite = hn::Mul(hn::BitCast(df, shifted), hn::Set(df, 0x1p112f));
  const auto special =
      hn::BitCast(df, hn::Or(shifted, hn::Set(du, 0x7F800000u)));
  const auto is_special =
      hn::RebindMask(df, hn::Gt(hn::BitCast(di, em), hn::Set(di, 0x7BFF)));
  return hn::Or(hn::IfThenElse(is_special, special, finite),
                hn::BitCast(df, sign));
#endif
}

template <class DF>
HWY_INLINE hn::Vec<hn::Rebind<uint16_t, DF>> F32ToHalf(DF df, hn::Vec<DF> v) {
  const hn::Rebind<uint16_t, DF> d16;
#if KVCACHE_NATIVE_F16C
  return hn::BitCast(d16, hn::DemoteTo(hn::Rebind<hwy::float16_t, DF>(), v));
#else
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, v);
  const auto ax = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  const auto axi = hn::BitCast(di, ax);
  const auto sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 0x8000u));
  // Normal: round the 13 dropped bits to nearest even; a carry into the
  // exponent is the right answer.
  const auto odd = hn::And(hn::ShiftRight<13>(ax), hn::Set(du, 1u));
  const auto normal = hn::Sub(
      hn::ShiftRight<13>(hn::Add(hn::Add(ax, hn::Set(du, 0x0FFFu)), odd)),
      hn::Set(du, 112u << 10));
  // Subnormal: adding 0.5 makes the fp32 unit in the last place 2^-24, so
  // the fp32 addition rounds |v| to a multiple of 2^-24, to nearest even.
  const auto sub =
      hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, ax), hn::Set(df, 0.5f))),
              hn::Set(du, 0x3F000000u));
  auto r = hn::IfThenElse(
      hn::RebindMask(du, hn::Gt(axi, hn::Set(di, 0x38800000 - 1))), normal,
      sub);
  r = hn::IfThenElse(
      hn::RebindMask(du, hn::Gt(axi, hn::Set(di, 0x477FF000 - 1))),
      hn::Set(du, 0x7C00u), r);
  const auto nan = hn::Or(hn::Set(du, 0x7E00u),
                          hn::And(hn::ShiftRight<13>(ax), hn::Set(du, 0x3FFu)));
  r = hn::IfThenElse(hn::RebindMask(du, hn::Gt(axi, hn::Set(di, 0x7F800000))),
                     nan, r);
  return hn::DemoteTo(d16, hn::BitCast(di, hn::Or(r, sign)));
#endif
}

// ---- fp32 <-> fp8 --------------------------------------------------------

// fp8_rne_satfinite of a non-NaN q whose sign is that of `sign_of` (the
// quotient's dividend: the divisor is > 0, and this way a zero quotient keeps
// the dividend's sign whatever the division sequence gives). Returns the code
// in the low byte of each 32-bit lane; the same codes as
// fp8_internal::FromFloat for every non-NaN input.
//  1. a = min(|q|, max finite): saturation (infinity included).
//  2. Round a to the fp8 grid in fp32: adding 2^(e + 23 - kManBits), where
//     2^e <= a, makes the fp32 unit in the last place the fp8 spacing of a's
//     binade (at least the subnormal step 2^(1 - kBias - kManBits)), so the
//     fp32 addition rounds to nearest even on the fp8 grid; subtracting it
//     back is exact.
//  3. r * 2^-(127 - kBias) re-biases the exponent: its fp32 bits shifted
//     right by 23 - kManBits are the fp8 code (an fp32 subnormal for an fp8
//     subnormal; denormals are not flushed on these paths).
template <int kManBits, int kBias, uint32_t kMaxCode, class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> Fp8FromF32(DF df, hn::Vec<DF> q,
                                                      hn::Vec<DF> sign_of) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  constexpr uint32_t kDrop = 23 - kManBits;
  const float max_finite =
      FloatFromBits(((kMaxCode >> kManBits) + 127 - kBias) << 23 |
                    (kMaxCode & ((1u << kManBits) - 1u)) << kDrop);
  constexpr int32_t kSubMagicBits = (127 + 1 - kBias - kManBits + 23) << 23;
  constexpr float kRebias = kBias == 7 ? 0x1p-120f : 0x1p-112f;
  static_assert(kBias == 7 || kBias == 15, "E4M3 or E5M2");

  const auto a = hn::Min(hn::Abs(q), hn::Set(df, max_finite));
  const auto exp = hn::And(hn::BitCast(di, a), hn::Set(di, 0x7F800000));
  const auto magic =
      hn::BitCast(df, hn::Max(hn::Add(exp, hn::Set(di, int32_t{kDrop} << 23)),
                              hn::Set(di, kSubMagicBits)));
  const auto r = hn::Sub(hn::Add(a, magic), magic);
  const auto code =
      hn::ShiftRight<kDrop>(hn::BitCast(du, hn::Mul(r, hn::Set(df, kRebias))));
  const auto sign =
      hn::And(hn::ShiftRight<24>(hn::BitCast(du, sign_of)), hn::Set(du, 0x80u));
  return hn::BitCast(di, hn::Or(code, sign));
}

// Mirrors Fp8E4M3ToFloat / Fp8E5M2ToFloat for codes in 32-bit lanes.
template <bool kE4M3, class DF>
HWY_INLINE hn::Vec<DF> Fp8ToF32(DF df, hn::Vec<hn::RebindToUnsigned<DF>> c) {
  const hn::RebindToUnsigned<DF> du;
  constexpr int kManBits = kE4M3 ? 3 : 2;
  constexpr float kRebias = kE4M3 ? 0x1p120f : 0x1p112f;
  const auto a = hn::And(c, hn::Set(du, 0x7Fu));
  const auto sign = hn::ShiftLeft<24>(hn::And(c, hn::Set(du, 0x80u)));
  auto v = hn::Mul(hn::BitCast(df, hn::ShiftLeft<23 - kManBits>(a)),
                   hn::Set(df, kRebias));
  const auto nan = hn::BitCast(df, hn::Set(du, 0x7FC00000u));
  if constexpr (kE4M3) {
    v = hn::IfThenElse(hn::RebindMask(df, hn::Eq(a, hn::Set(du, 0x7Fu))), nan,
                       v);
  } else {
    const hn::RebindToSigned<DF> di;
    const auto ai = hn::BitCast(di, a);
    v = hn::IfThenElse(hn::RebindMask(df, hn::Eq(ai, hn::Set(di, 0x7C))),
                       hn::BitCast(df, hn::Set(du, 0x7F800000u)), v);
    v = hn::IfThenElse(hn::RebindMask(df, hn::Gt(ai, hn::Set(di, 0x7C))), nan,
                       v);
  }
  return hn::Or(v, hn::BitCast(df, sign));
}

// ---- division -------------------------------------------------------------

// RN(a / b) for b > 0, given y = RN(1 / b) from a true division. With a
// native fused multiply-add this is Markstein's correction step: q0 = RN(a*y)
// is within 1.5 ulp of a / b, r = a - q0*b is exact, and RN(q0 + r*y) is the
// correctly rounded quotient (CUDA's __fdiv_rn and IA-64 divide the same
// way). The sequence is scale invariant while y, q0 and the result are normal
// numbers, so checking every pair of significands checks every input: see
// DivisionMismatches and kernels/codec_simd_test.cc, which do it for both
// uses here (an fp16 dividend over any fp32 divisor, and any fp32 dividend
// over an fp16 divisor). Callers keep inputs in those ranges. Without a
// native FMA it is a plain division. A zero dividend may give a zero of
// either sign: callers take the sign from the dividend.
constexpr float kMinFmaDivisor = 0x1p-64f;
constexpr float kMaxFmaDivisor = 0x1p64f;

template <class DF>
HWY_INLINE hn::Vec<DF> DivideRn(DF df, hn::Vec<DF> a, hn::Vec<DF> b,
                                hn::Vec<DF> y) {
#if HWY_NATIVE_FMA
  const auto q0 = hn::Mul(a, y);
  const auto r = hn::NegMulAdd(q0, b, a);
  return hn::MulAdd(r, y, q0);
#else
  (void)df;
  (void)y;
  return hn::Div(a, b);
#endif
}

// Number of (dividend, divisor) pairs whose DivideRn differs from the IEEE
// quotient in any bit.
uint64_t DivisionMismatchesImpl(const float* dividends, size_t na,
                                const float* divisors, size_t nb) {
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const size_t N = hn::Lanes(df);
  uint64_t bad = 0;
  for (size_t j = 0; j < nb; ++j) {
    const auto b = hn::Set(df, divisors[j]);
    const auto y = hn::Div(hn::Set(df, 1.0f), b);
    size_t i = 0;
    for (; i + N <= na; i += N) {
      const auto a = hn::LoadU(df, dividends + i);
      // Zero quotients compare equal whatever their signs (see DivideRn).
      const auto want = hn::BitCast(du, hn::Add(hn::Div(a, b), hn::Zero(df)));
      const auto got =
          hn::BitCast(du, hn::Add(DivideRn(df, a, b, y), hn::Zero(df)));
      bad += hn::CountTrue(du, hn::Ne(want, got));
    }
    for (; i < na; ++i) {
      const float a = dividends[i];
      const auto got = DivideRn(df, hn::Set(df, a), b, y);
      if (FloatBits(hn::GetLane(got) + 0.0f) !=
          FloatBits(a / divisors[j] + 0.0f)) {
        ++bad;
      }
    }
  }
  return bad;
}

// ---- scratch -------------------------------------------------------------

struct Scratch {
  std::vector<float> f0, f1, f2, f3, f4;
  std::vector<uint16_t> u16;
  std::vector<uint8_t> stage;
};

Scratch& GetScratch() {
  static thread_local Scratch scratch;
  return scratch;
}

template <typename T>
T* Sized(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// ---- non-finite scan -----------------------------------------------------

size_t FindNonFiniteImpl(const uint16_t* in, size_t n) {
  const hn::ScalableTag<uint16_t> d;
  const size_t N = hn::Lanes(d);
  const auto exp = hn::Set(d, 0x7C00u);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const auto a = hn::Eq(hn::And(hn::LoadU(d, in + i), exp), exp);
    const auto b = hn::Eq(hn::And(hn::LoadU(d, in + i + N), exp), exp);
    if (!hn::AllFalse(d, hn::Or(a, b))) break;
  }
  return i + FindNonFiniteHalfReference(in + i, n - i);
}

// ---- fp16 sections -------------------------------------------------------

void CopyFp16(const Section& s, const uint16_t* in, uint8_t* out) {
  std::memcpy(out, in, 2 * s.elements());  // little-endian host
}

void CopyFp16Back(const Section& s, const uint8_t* in, uint16_t* out) {
  std::memcpy(out, in, 2 * s.elements());
}

// ---- FP8 -----------------------------------------------------------------

template <Codec kCodec>
uint8_t Fp8Scalar(float f) {
  return kCodec == Codec::kFp8E4M3 ? Fp8E4M3FromFloat(f) : Fp8E5M2FromFloat(f);
}

template <Codec kCodec>
float Fp8ScalarToFloat(uint8_t c) {
  return kCodec == Codec::kFp8E4M3 ? Fp8E4M3ToFloat(c) : Fp8E5M2ToFloat(c);
}

template <Codec kCodec, class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> Fp8Encode(DF df, hn::Vec<DF> q,
                                                     hn::Vec<DF> x) {
  if constexpr (kCodec == Codec::kFp8E4M3) {
    return Fp8FromF32<3, 7, 0x7E>(df, q, x);
  } else {
    return Fp8FromF32<2, 15, 0x7B>(df, q, x);
  }
}

template <Codec kCodec>
void EncodeFp8(const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim, HD = H * D;
  Scratch& scratch = GetScratch();
  float* scale = Sized(scratch.f0, H);
  uint8_t* codes = out;
  if (s.static_scales == nullptr) {
    // amax per head: the largest |x| of finite halves is the largest of the
    // bit patterns with the sign cleared.
    const hn::ScalableTag<uint16_t> d16;
    const size_t N16 = hn::Lanes(d16);
    uint16_t* colmax = Sized(scratch.u16, HD);
    std::fill(colmax, colmax + HD, uint16_t{0});
    const auto abs_mask = hn::Set(d16, 0x7FFFu);
    for (size_t t = 0; t < T; ++t) {
      const uint16_t* row = in + t * HD;
      size_t j = 0;
      for (; j + N16 <= HD; j += N16) {
        const auto v = hn::And(hn::LoadU(d16, row + j), abs_mask);
        hn::StoreU(hn::Max(hn::LoadU(d16, colmax + j), v), d16, colmax + j);
      }
      for (; j < HD; ++j) {
        colmax[j] = std::max<uint16_t>(colmax[j], row[j] & 0x7FFFu);
      }
    }
    for (size_t h = 0; h < H; ++h) {
      const uint16_t m = *std::max_element(colmax + h * D, colmax + h * D + D);
      const float amax = HalfToFloat(m);
      scale[h] = amax == 0.0f ? 1.0f : amax / Fp8Max(kCodec);
      StoreLe32(out + 4 * h, FloatBits(scale[h]));
    }
    codes = out + 4 * H;
  } else {
    for (size_t h = 0; h < H; ++h) scale[h] = s.static_scales[h];
  }

  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      const size_t base = (t * H + h) * D;
      const uint16_t* row = in + base;
      uint8_t* dst = codes + base;
      const float sc = scale[h];
      const auto vsc = hn::Set(df, sc);
      const auto vrcp = hn::Set(df, 1.0f / sc);
      size_t j = 0;
      if (sc >= kMinFmaDivisor && sc <= kMaxFmaDivisor) {
        for (; j + N <= D; j += N) {
          const auto x = HalfToF32(df, hn::LoadU(d16, row + j));
          const auto c = Fp8Encode<kCodec>(df, DivideRn(df, x, vsc, vrcp), x);
          hn::StoreU(hn::DemoteTo(d8, c), d8, dst + j);
        }
      } else {
        for (; j + N <= D; j += N) {
          const auto x = HalfToF32(df, hn::LoadU(d16, row + j));
          const auto c = Fp8Encode<kCodec>(df, hn::Div(x, vsc), x);
          hn::StoreU(hn::DemoteTo(d8, c), d8, dst + j);
        }
      }
      for (; j < D; ++j) dst[j] = Fp8Scalar<kCodec>(HalfToFloat(row[j]) / sc);
    }
  }
}

template <Codec kCodec>
void DecodeFp8(const Section& s, const uint8_t* in, uint16_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  Scratch& scratch = GetScratch();
  float* scale = Sized(scratch.f0, H);
  const uint8_t* codes = in;
  if (s.static_scales == nullptr) {
    for (size_t h = 0; h < H; ++h)
      scale[h] = FloatFromBits(LoadLe32(in + 4 * h));
    codes = in + 4 * H;
  } else {
    for (size_t h = 0; h < H; ++h) scale[h] = s.static_scales[h];
  }
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  constexpr bool kE4M3 = kCodec == Codec::kFp8E4M3;
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      const size_t base = (t * H + h) * D;
      const uint8_t* src = codes + base;
      uint16_t* dst = out + base;
      const float sc = scale[h];
      const auto vsc = hn::Set(df, sc);
      size_t j = 0;
      for (; j + N <= D; j += N) {
        const auto c = hn::PromoteTo(du, hn::LoadU(d8, src + j));
        const auto v = hn::Mul(Fp8ToF32<kE4M3>(df, c), vsc);
        hn::StoreU(F32ToHalf(df, v), d16, dst + j);
      }
      for (; j < D; ++j) {
        dst[j] = HalfFromFloat(Fp8ScalarToFloat<kCodec>(src[j]) * sc);
      }
    }
  }
}

// ---- KIVI ----------------------------------------------------------------

// n codes (one per byte, n a multiple of 8 / kBits) -> packed little end
// first.
template <uint32_t kBits>
void PackCodes(const uint8_t* codes, size_t n, uint8_t* out) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t N8 = hn::Lanes(d8);
  size_t i = 0;
  if constexpr (kBits == 2) {
    const hn::Repartition<uint32_t, decltype(d8)> d32;
    const hn::Rebind<uint8_t, decltype(d32)> dq;
    for (; i + N8 <= n; i += N8) {
      const auto v = hn::BitCast(d32, hn::LoadU(d8, codes + i));
      const auto p =
          hn::Or(hn::Or(v, hn::ShiftRight<6>(v)),
                 hn::Or(hn::ShiftRight<12>(v), hn::ShiftRight<18>(v)));
      hn::StoreU(hn::U8FromU32(hn::And(p, hn::Set(d32, 0xFFu))), dq,
                 out + i / 4);
    }
    for (; i < n; i += 4) {
      out[i / 4] = static_cast<uint8_t>(codes[i] | codes[i + 1] << 2 |
                                        codes[i + 2] << 4 | codes[i + 3] << 6);
    }
  } else {
    const hn::Repartition<uint16_t, decltype(d8)> d16;
    const hn::RebindToSigned<decltype(d16)> di16;
    const hn::Rebind<uint8_t, decltype(d16)> dh;
    for (; i + N8 <= n; i += N8) {
      const auto v = hn::BitCast(d16, hn::LoadU(d8, codes + i));
      const auto p =
          hn::And(hn::Or(v, hn::ShiftRight<4>(v)), hn::Set(d16, 0xFFu));
      hn::StoreU(hn::DemoteTo(dh, hn::BitCast(di16, p)), dh, out + i / 2);
    }
    for (; i < n; i += 2) {
      out[i / 2] = static_cast<uint8_t>(codes[i] | codes[i + 1] << 4);
    }
  }
}

// Byte -> its codes, one per byte, little end first.
struct UnpackTables {
  uint32_t two[256];
  uint16_t four[256];
  UnpackTables() {
    for (uint32_t b = 0; b < 256; ++b) {
      two[b] = (b & 3u) | ((b >> 2) & 3u) << 8 | ((b >> 4) & 3u) << 16 |
               ((b >> 6) & 3u) << 24;
      four[b] = static_cast<uint16_t>((b & 15u) | ((b >> 4) & 15u) << 8);
    }
  }
};

const UnpackTables& Tables() {
  static const UnpackTables tables;
  return tables;
}

template <uint32_t kBits>
void UnpackCodes(const uint8_t* packed, size_t n, uint8_t* codes) {
  const UnpackTables& tab = Tables();
  if constexpr (kBits == 2) {
    for (size_t k = 0; k < n / 4; ++k) {
      std::memcpy(codes + 4 * k, &tab.two[packed[k]], 4);  // little-endian
    }
  } else {
    for (size_t k = 0; k < n / 2; ++k) {
      std::memcpy(codes + 2 * k, &tab.four[packed[k]], 2);
    }
  }
}

// clamp(rint((x - zero) / scale), 0, qmax), 0 where scale == 0. x >= zero
// (zero is the group minimum), so the quotient is >= 0 (or -0), and
// rint(min(q, qmax)) == min(rint(q), qmax); rint of a value in [0, 2^22]
// is (q + 2^23) - 2^23 in fp32 round to nearest even.
// The scale is an fp16 value and x - zero is 0 or at least 2^-24, so
// DivideRn's ranges hold; lanes where scale == 0 (rcp = inf) are discarded.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> KiviCode(DF df, hn::Vec<DF> x,
                                                    hn::Vec<DF> zero,
                                                    hn::Vec<DF> scale,
                                                    hn::Vec<DF> rcp,
                                                    hn::Vec<DF> qmax) {
  const auto q = hn::Min(DivideRn(df, hn::Sub(x, zero), scale, rcp), qmax);
  const auto magic = hn::Set(df, 0x1p23f);
  const auto r = hn::Sub(hn::Add(q, magic), magic);
  const auto code = hn::IfThenZeroElse(hn::Eq(scale, hn::Zero(df)), r);
  return hn::ConvertTo(hn::RebindToSigned<DF>(), code);
}

template <uint32_t kBits>
bool KiviFits(const Section& s, size_t N) {
  const size_t run = s.is_key ? size_t{s.heads} * s.dim : s.group;
  return run % N == 0 && (run * kBits) % 8 == 0;
}

// Keys: groups of G tokens per channel. Metadata of token group g is the
// contiguous run [g*HD, g*HD + HD) (HD = H*D), like one token row.
template <uint32_t kBits, class DF>
void EncodeKiviKeys(DF df, const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t T = s.tokens, G = s.group, HD = size_t{s.heads} * s.dim;
  const size_t groups = s.elements() / G;
  uint8_t* zeros = out;
  uint8_t* scales = out + 2 * groups;
  uint8_t* codes = out + 4 * groups;
  const hn::Rebind<uint16_t, DF> d16;
  const hn::Repartition<uint8_t, decltype(d16)> d16b;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t N = hn::Lanes(df);
  const auto qmax = hn::Set(df, static_cast<float>((1u << kBits) - 1u));
  const auto pos_zero = hn::Zero(df);
  const auto one = hn::Set(df, 1.0f);
  Scratch& scratch = GetScratch();
  uint8_t* stage = Sized(scratch.stage, G * HD);  // codes of one token group
  for (size_t g = 0; g < T / G; ++g) {
    const uint16_t* slice = in + g * G * HD;
    for (size_t j = 0; j < HD; j += N) {
      // Per channel over the G tokens of the group.
      auto mn = HalfToF32(df, hn::LoadU(d16, slice + j));
      auto mx = mn;
      for (size_t t = 1; t < G; ++t) {
        const auto x = HalfToF32(df, hn::LoadU(d16, slice + t * HD + j));
        mn = hn::Min(mn, x);
        mx = hn::Max(mx, x);
      }
      // A zero min or max is +0.
      const auto lo = hn::Add(mn, pos_zero);
      const auto hi = hn::Add(mx, pos_zero);
      const auto zh = F32ToHalf(df, lo);
      const auto sh = F32ToHalf(df, hn::Div(hn::Sub(hi, lo), qmax));
      const size_t m = g * HD + j;
      hn::StoreU(hn::BitCast(d16b, zh), d16b, zeros + 2 * m);
      hn::StoreU(hn::BitCast(d16b, sh), d16b, scales + 2 * m);
      const auto zero = HalfToF32(df, zh);
      const auto scale = HalfToF32(df, sh);
      const auto rcp = hn::Div(one, scale);
      for (size_t t = 0; t < G; ++t) {
        const auto x = HalfToF32(df, hn::LoadU(d16, slice + t * HD + j));
        hn::StoreU(hn::DemoteTo(d8, KiviCode(df, x, zero, scale, rcp, qmax)),
                   d8, stage + t * HD + j);
      }
    }
    PackCodes<kBits>(stage, G * HD, codes + g * G * HD * kBits / 8);
  }
}

template <uint32_t kBits, class DF>
void DecodeKiviKeys(DF df, const Section& s, const uint8_t* in, uint16_t* out) {
  const size_t T = s.tokens, G = s.group, HD = size_t{s.heads} * s.dim;
  const size_t groups = s.elements() / G;
  const uint8_t* zeros = in;
  const uint8_t* scales = in + 2 * groups;
  const uint8_t* codes = in + 4 * groups;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  const hn::Repartition<uint8_t, decltype(d16)> d16b;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t N = hn::Lanes(df);
  Scratch& scratch = GetScratch();
  float* zf = Sized(scratch.f2, HD);
  float* sf = Sized(scratch.f3, HD);
  uint8_t* stage = Sized(scratch.stage, HD);
  for (size_t g = 0; g < T / G; ++g) {
    for (size_t j = 0; j < HD; j += N) {
      const size_t m = g * HD + j;
      hn::StoreU(
          HalfToF32(df, hn::BitCast(d16, hn::LoadU(d16b, zeros + 2 * m))), df,
          zf + j);
      hn::StoreU(
          HalfToF32(df, hn::BitCast(d16, hn::LoadU(d16b, scales + 2 * m))), df,
          sf + j);
    }
    for (size_t t = g * G; t < g * G + G; ++t) {
      UnpackCodes<kBits>(codes + t * HD * kBits / 8, HD, stage);
      uint16_t* dst = out + t * HD;
      for (size_t j = 0; j < HD; j += N) {
        const auto c =
            hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, stage + j)));
        // Multiply, round, add, round (no fused multiply-add).
        const auto p = hn::Mul(c, hn::LoadU(df, sf + j));
        const auto y = hn::Add(p, hn::LoadU(df, zf + j));
        hn::StoreU(F32ToHalf(df, y), d16, dst + j);
      }
    }
  }
}

// Values: groups of G consecutive channels; group k is elements
// [k*G, k*G + G) of the section.
template <uint32_t kBits, class DF>
void EncodeKiviValues(DF df, const Section& s, const uint16_t* in,
                      uint8_t* out) {
  const size_t G = s.group;
  const size_t groups = s.elements() / G;
  uint8_t* zeros = out;
  uint8_t* scales = out + 2 * groups;
  uint8_t* codes = out + 4 * groups;
  const hn::Rebind<uint16_t, DF> d16;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t N = hn::Lanes(df);
  const float qmax_f = static_cast<float>((1u << kBits) - 1u);
  const auto qmax = hn::Set(df, qmax_f);
  const size_t batch = std::max<size_t>(1, 4096 / G);  // groups per stage
  Scratch& scratch = GetScratch();
  uint8_t* stage = Sized(scratch.stage, batch * G);
  for (size_t k0 = 0; k0 < groups; k0 += batch) {
    const size_t k1 = std::min(groups, k0 + batch);
    for (size_t k = k0; k < k1; ++k) {
      const uint16_t* src = in + k * G;
      auto vmn = HalfToF32(df, hn::LoadU(d16, src));
      auto vmx = vmn;
      for (size_t j = N; j < G; j += N) {
        const auto x = HalfToF32(df, hn::LoadU(d16, src + j));
        vmn = hn::Min(vmn, x);
        vmx = hn::Max(vmx, x);
      }
      // A zero min or max is +0.
      const float lo = hn::GetLane(hn::MinOfLanes(df, vmn)) + 0.0f;
      const float hi = hn::GetLane(hn::MaxOfLanes(df, vmx)) + 0.0f;
      const uint16_t zh = HalfFromFloat(lo);
      const uint16_t sh = HalfFromFloat((hi - lo) / qmax_f);
      StoreLe16(zeros + 2 * k, zh);
      StoreLe16(scales + 2 * k, sh);
      const auto zero = hn::Set(df, HalfToFloat(zh));
      const float scale_f = HalfToFloat(sh);
      const auto scale = hn::Set(df, scale_f);
      const auto rcp = hn::Set(df, 1.0f / scale_f);
      uint8_t* dst = stage + (k - k0) * G;
      for (size_t j = 0; j < G; j += N) {
        const auto x = HalfToF32(df, hn::LoadU(d16, src + j));
        hn::StoreU(hn::DemoteTo(d8, KiviCode(df, x, zero, scale, rcp, qmax)),
                   d8, dst + j);
      }
    }
    PackCodes<kBits>(stage, (k1 - k0) * G, codes + k0 * G * kBits / 8);
  }
}

template <uint32_t kBits, class DF>
void DecodeKiviValues(DF df, const Section& s, const uint8_t* in,
                      uint16_t* out) {
  const size_t G = s.group;
  const size_t groups = s.elements() / G;
  const uint8_t* zeros = in;
  const uint8_t* scales = in + 2 * groups;
  const uint8_t* codes = in + 4 * groups;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t N = hn::Lanes(df);
  const size_t batch = std::max<size_t>(1, 4096 / G);
  Scratch& scratch = GetScratch();
  uint8_t* stage = Sized(scratch.stage, batch * G);
  for (size_t k0 = 0; k0 < groups; k0 += batch) {
    const size_t k1 = std::min(groups, k0 + batch);
    UnpackCodes<kBits>(codes + k0 * G * kBits / 8, (k1 - k0) * G, stage);
    for (size_t k = k0; k < k1; ++k) {
      const auto zero = hn::Set(df, HalfToFloat(LoadLe16(zeros + 2 * k)));
      const auto scale = hn::Set(df, HalfToFloat(LoadLe16(scales + 2 * k)));
      const uint8_t* src = stage + (k - k0) * G;
      uint16_t* dst = out + k * G;
      for (size_t j = 0; j < G; j += N) {
        const auto c =
            hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, src + j)));
        const auto p = hn::Mul(c, scale);
        const auto y = hn::Add(p, zero);
        hn::StoreU(F32ToHalf(df, y), d16, dst + j);
      }
    }
  }
}

// Picks the widest vector whose lane count divides the runs the section is
// processed in; the reference handles shapes no vector fits (e.g. G < 4).
template <uint32_t kBits>
void EncodeKivi(const Section& s, const uint16_t* in, uint8_t* out) {
  const hn::ScalableTag<float> d_full;
  const hn::CappedTag<float, 8> d8;
  const hn::CappedTag<float, 4> d4;
  auto run = [&](auto df) {
    if (s.is_key) {
      EncodeKiviKeys<kBits>(df, s, in, out);
    } else {
      EncodeKiviValues<kBits>(df, s, in, out);
    }
  };
  if (KiviFits<kBits>(s, hn::Lanes(d_full))) return run(d_full);
  if (KiviFits<kBits>(s, hn::Lanes(d8))) return run(d8);
  if (KiviFits<kBits>(s, hn::Lanes(d4))) return run(d4);
  EncodeSectionReference(s, in, out);
}

template <uint32_t kBits>
void DecodeKivi(const Section& s, const uint8_t* in, uint16_t* out) {
  const hn::ScalableTag<float> d_full;
  const hn::CappedTag<float, 8> d8;
  const hn::CappedTag<float, 4> d4;
  auto run = [&](auto df) {
    if (s.is_key) {
      DecodeKiviKeys<kBits>(df, s, in, out);
    } else {
      DecodeKiviValues<kBits>(df, s, in, out);
    }
  };
  if (KiviFits<kBits>(s, hn::Lanes(d_full))) return run(d_full);
  if (KiviFits<kBits>(s, hn::Lanes(d8))) return run(d8);
  if (KiviFits<kBits>(s, hn::Lanes(d4))) return run(d4);
  DecodeSectionReference(s, in, out);
}

#endif  // HWY_TARGET != HWY_SCALAR

// ---- entry points --------------------------------------------------------

void EncodeSectionImpl(const Section& s, const uint16_t* in, uint8_t* out) {
#if HWY_TARGET == HWY_SCALAR
  EncodeSectionReference(s, in, out);
#else
  switch (s.codec) {
    case Codec::kNone:
      return CopyFp16(s, in, out);
    case Codec::kFp8E4M3:
      return EncodeFp8<Codec::kFp8E4M3>(s, in, out);
    case Codec::kFp8E5M2:
      return EncodeFp8<Codec::kFp8E5M2>(s, in, out);
    case Codec::kKivi2:
      return EncodeKivi<2>(s, in, out);
    case Codec::kKivi4:
      return EncodeKivi<4>(s, in, out);
  }
#endif
}

void DecodeSectionImpl(const Section& s, const uint8_t* in, uint16_t* out) {
#if HWY_TARGET == HWY_SCALAR
  DecodeSectionReference(s, in, out);
#else
  switch (s.codec) {
    case Codec::kNone:
      return CopyFp16Back(s, in, out);
    case Codec::kFp8E4M3:
      return DecodeFp8<Codec::kFp8E4M3>(s, in, out);
    case Codec::kFp8E5M2:
      return DecodeFp8<Codec::kFp8E5M2>(s, in, out);
    case Codec::kKivi2:
      return DecodeKivi<2>(s, in, out);
    case Codec::kKivi4:
      return DecodeKivi<4>(s, in, out);
  }
#endif
}

size_t FindNonFiniteHalfImpl(const uint16_t* in, size_t n) {
#if HWY_TARGET == HWY_SCALAR
  return FindNonFiniteHalfReference(in, n);
#else
  return FindNonFiniteImpl(in, n);
#endif
}

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

#if HWY_TARGET == HWY_SCALAR
// This target runs the scalar reference, which divides with IEEE division.
uint64_t DivisionMismatchesImpl(const float*, size_t, const float*, size_t) {
  return 0;
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace kvcache::kernels::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvcache::kernels::internal {

HWY_EXPORT(EncodeSectionImpl);
HWY_EXPORT(DecodeSectionImpl);
HWY_EXPORT(FindNonFiniteHalfImpl);
HWY_EXPORT(TargetNameImpl);
HWY_EXPORT(DivisionMismatchesImpl);

uint64_t DivisionMismatches(const float* dividends, size_t num_dividends,
                            const float* divisors, size_t num_divisors) {
  return HWY_DYNAMIC_DISPATCH(DivisionMismatchesImpl)(dividends, num_dividends,
                                                      divisors, num_divisors);
}

void EncodeSectionSimd(const Section& s, const uint16_t* in, uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(EncodeSectionImpl)(s, in, out);
}

void DecodeSectionSimd(const Section& s, const uint8_t* in, uint16_t* out) {
  HWY_DYNAMIC_DISPATCH(DecodeSectionImpl)(s, in, out);
}

size_t FindNonFiniteHalfSimd(const uint16_t* in, size_t n) {
  return HWY_DYNAMIC_DISPATCH(FindNonFiniteHalfImpl)(in, n);
}

std::vector<int64_t> SimdTargets() {
  return hwy::SupportedAndGeneratedTargets();
}

std::string SimdTargetName(int64_t target) { return hwy::TargetName(target); }

std::string ActiveSimdTarget() {
  return HWY_DYNAMIC_DISPATCH(TargetNameImpl)();
}

void ForceSimdTargetForTest(int64_t target) {
  hwy::SetSupportedTargetsForTest(target);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

}  // namespace kvcache::kernels::internal
#endif  // HWY_ONCE
