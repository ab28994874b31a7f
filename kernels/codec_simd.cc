// Highway SIMD section codecs with runtime dispatch. Every operation
// produces the bits the scalar reference (codec_reference.cc) produces:
// IEEE fp32 add, subtract and multiply in the same order, never contracted
// (this file is compiled with -ffp-contract=off); divisions either as true
// divisions or, on targets with FMA, as a correctly rounded FMA sequence
// proven equal to IEEE division for every input the codecs give it (see
// DivideRn); fp32 -> fp16 and fp32 -> fp8 rounding to nearest even with
// integer operations, F16C or exact fp32 additions (see F32ToHalf and
// Fp8FromF32). On AVX-512 and AVX2, fp8 encoding reads most codes from
// per-head tables built from exact quotients (see "FP8 by table"). bf16
// sections have their own, simpler kernels (see "bf16 sources").
//
// Denormal arithmetic: conversions between formats read and make no fp32
// subnormal: they rebias exponents in the integers and take subnormal codes
// as an integer significand times a power of two. So results do not change
// where a thread runs with x86's flush-to-zero and denormals-are-zero on
// (PyTorch's set_flush_denormal, libraries built with -ffast-math; threads
// inherit them), and no vector pays the microcode assist an fp32 subnormal
// operand costs on Intel cores (about 10x slower fp8 decodes of blocks with
// many subnormal codes), for every scale that is a normal fp32 number (fp8
// scales of fp16 blocks always are) and every result that is not an fp32
// subnormal (fp16 results never are; bf16 results below 2^-126 are flushed).
// docs/codecs.md, "Arithmetic", lists the exceptions.
#include <algorithm>
#include <cstring>
#include <memory>
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
// (Highway compiles this file once per target: each pass sets the per-target
// switches anew.)
#undef KVCACHE_NATIVE_F16C
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
  const auto emi = hn::BitCast(di, em);
  const auto shifted = hn::ShiftLeft<13>(em);
  // No fp32 subnormal is read or made (see "Denormal arithmetic" above):
  // normal halves are rebiased in the integers, subnormal ones are their
  // integer significand times 2^-24, an exact product of normal floats.
  const auto normal =
      hn::BitCast(df, hn::Add(shifted, hn::Set(du, 112u << 23)));
  const auto subnormal = hn::Mul(hn::ConvertTo(df, emi), hn::Set(df, 0x1p-24f));
  const auto special =
      hn::BitCast(df, hn::Or(shifted, hn::Set(du, 0x7F800000u)));
  auto v = hn::IfThenElse(hn::RebindMask(df, hn::Lt(emi, hn::Set(di, 0x400))),
                          subnormal, normal);
  v = hn::IfThenElse(hn::RebindMask(df, hn::Gt(emi, hn::Set(di, 0x7BFF))),
                     special, v);
  return hn::Or(v, hn::BitCast(df, sign));
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
//  3. The code: for r in fp8's normal range, r's fp32 bits shifted right
//     by 23 - kManBits with the exponent rebiased in the integers; below
//     it, r over the subnormal step, an exact small integer (no fp32
//     subnormal is made: see "Denormal arithmetic" above).
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
  constexpr int32_t kMinNormalBits = (127 + 1 - kBias) << 23;
  // 1 / the subnormal step 2^(1 - kBias - kManBits).
  constexpr float kPerSubnormalStep = kBias == 7 ? 0x1p9f : 0x1p16f;
  static_assert(kBias == 7 || kBias == 15, "E4M3 or E5M2");

  const auto a = hn::Min(hn::Abs(q), hn::Set(df, max_finite));
  const auto exp = hn::And(hn::BitCast(di, a), hn::Set(di, 0x7F800000));
  const auto magic =
      hn::BitCast(df, hn::Max(hn::Add(exp, hn::Set(di, int32_t{kDrop} << 23)),
                              hn::Set(di, kSubMagicBits)));
  const auto r = hn::Sub(hn::Add(a, magic), magic);
  auto code = hn::Sub(hn::ShiftRight<kDrop>(hn::BitCast(du, r)),
                      hn::Set(du, uint32_t{127 - kBias} << kManBits));
  const auto below_normal =
      hn::Lt(hn::BitCast(di, r), hn::Set(di, kMinNormalBits));
  if (HWY_UNLIKELY(!hn::AllFalse(di, below_normal))) {
    code = hn::IfThenElse(
        hn::RebindMask(du, below_normal),
        hn::BitCast(
            du, hn::ConvertTo(di, hn::Mul(r, hn::Set(df, kPerSubnormalStep)))),
        code);
  }
  const auto sign =
      hn::And(hn::ShiftRight<24>(hn::BitCast(du, sign_of)), hn::Set(du, 0x80u));
  return hn::BitCast(di, hn::Or(code, sign));
}

// Mirrors Fp8E4M3ToFloat / Fp8E5M2ToFloat for codes in 32-bit lanes.
template <bool kE4M3, class DF>
HWY_INLINE hn::Vec<DF> Fp8ToF32(DF df, hn::Vec<hn::RebindToUnsigned<DF>> c) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  constexpr int kManBits = kE4M3 ? 3 : 2;
  constexpr uint32_t kBias = kE4M3 ? 7 : 15;
  // The value of the smallest subnormal code, 2^(1 - bias - mantissa bits).
  constexpr float kSubnormalUnit = kE4M3 ? 0x1p-9f : 0x1p-16f;
  const auto a = hn::And(c, hn::Set(du, 0x7Fu));
  const auto ai = hn::BitCast(di, a);
  const auto sign = hn::ShiftLeft<24>(hn::And(c, hn::Set(du, 0x80u)));
  // No fp32 subnormal is read or made (see "Denormal arithmetic" above):
  // normal codes are rebiased in the integers, subnormal codes (exponent
  // field 0, zero included) are their significand times the unit, an exact
  // product.
  auto v = hn::BitCast(df, hn::Add(hn::ShiftLeft<23 - kManBits>(a),
                                   hn::Set(du, (127u - kBias) << 23)));
  v = hn::IfThenElse(
      hn::RebindMask(df, hn::Lt(ai, hn::Set(di, 1 << kManBits))),
      hn::Mul(hn::ConvertTo(df, ai), hn::Set(df, kSubnormalUnit)), v);
  const auto nan = hn::BitCast(df, hn::Set(du, 0x7FC00000u));
  if constexpr (kE4M3) {
    v = hn::IfThenElse(hn::RebindMask(df, hn::Eq(a, hn::Set(du, 0x7Fu))), nan,
                       v);
  } else {
    v = hn::IfThenElse(hn::RebindMask(df, hn::Eq(ai, hn::Set(di, 0x7C))),
                       hn::BitCast(df, hn::Set(du, 0x7F800000u)), v);
    v = hn::IfThenElse(hn::RebindMask(df, hn::Gt(ai, hn::Set(di, 0x7C))), nan,
                       v);
  }
  return hn::Or(v, hn::BitCast(df, sign));
}

// A head's fp8 scale, prepared for Fp8FoldedTimesScale. For a positive
// normal scale s whose product with 2^(127 - bias) is finite, `rebiased` is
// that product (exact) and `folds` is true.
struct Fp8Scale {
  float scale;
  float rebiased;
  bool folds;
};

template <bool kE4M3>
Fp8Scale PrepareFp8Scale(float scale) {
  const float rebiased = scale * (kE4M3 ? 0x1p120f : 0x1p112f);
  return {scale, rebiased, scale >= 0x1p-126f && rebiased <= 0x1.fffffep127f};
}

// Whether codes[0, n) hold a code Fp8FoldedTimesScale does not take: a
// subnormal code or zero (exponent field 0), NaN or infinity.
template <bool kE4M3>
HWY_INLINE bool Fp8RowHasRareCode(const uint8_t* codes, size_t n) {
  constexpr int8_t kMinNormal = kE4M3 ? 8 : 4;
  constexpr int8_t kMaxFinite = kE4M3 ? 0x7E : 0x7B;
  const hn::ScalableTag<int8_t> d8;
  const hn::RebindToUnsigned<decltype(d8)> du8;
  const size_t N = hn::Lanes(d8);
  size_t j = 0;
  for (; j + N <= n; j += N) {
    const auto a =
        hn::And(hn::BitCast(d8, hn::LoadU(du8, codes + j)), hn::Set(d8, 0x7F));
    if (!hn::AllFalse(d8, hn::Or(hn::Lt(a, hn::Set(d8, kMinNormal)),
                                 hn::Gt(a, hn::Set(d8, kMaxFinite))))) {
      return true;
    }
  }
  for (; j < n; ++j) {
    const int a = codes[j] & 0x7F;
    if (a < kMinNormal || a > kMaxFinite) return true;
  }
  return false;
}

// RN(value(code) * scale) for codes in 32-bit lanes, none of them rare
// (Fp8RowHasRareCode) and s.folds: the code's bits shifted into an fp32
// exponent and significand read as its value times 2^-(127 - bias), a normal
// float, and one multiplication by `rebiased` scales and rounds it, as
// Fp8ScalarToFloat(code) * scale does.
template <bool kE4M3, class DF>
HWY_INLINE hn::Vec<DF> Fp8FoldedTimesScale(DF df,
                                           hn::Vec<hn::RebindToUnsigned<DF>> c,
                                           hn::Vec<DF> rebiased) {
  const hn::RebindToUnsigned<DF> du;
  constexpr int kManBits = kE4M3 ? 3 : 2;
  const auto magnitude =
      hn::ShiftLeft<23 - kManBits>(hn::And(c, hn::Set(du, 0x7Fu)));
  const auto sign = hn::ShiftLeft<24>(hn::And(c, hn::Set(du, 0x80u)));
  return hn::Mul(hn::BitCast(df, hn::Or(magnitude, sign)), rebiased);
}

// The first n - n % Lanes(df) codes of a row of a head with scale `scale`,
// as RN(value(code) * scale), handed to emit(j, values) a vector at a time:
// by Fp8FoldedTimesScale where the scale folds and the row holds no rare
// code, else by Fp8ToF32 and a multiplication. Returns how many it did; the
// caller converts the rest one by one.
template <bool kE4M3, class DF, class Emit>
HWY_INLINE size_t DecodeFp8RowVectors(DF df, const uint8_t* codes, size_t n,
                                      float scale, const Emit& emit) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t N = hn::Lanes(df);
  const Fp8Scale prepared = PrepareFp8Scale<kE4M3>(scale);
  size_t j = 0;
  if (prepared.folds && !Fp8RowHasRareCode<kE4M3>(codes, n)) {
    const auto rebiased = hn::Set(df, prepared.rebiased);
    for (; j + N <= n; j += N) {
      const auto c = hn::PromoteTo(du, hn::LoadU(d8, codes + j));
      emit(j, Fp8FoldedTimesScale<kE4M3>(df, c, rebiased));
    }
  } else {
    const auto vsc = hn::Set(df, scale);
    for (; j + N <= n; j += N) {
      const auto c = hn::PromoteTo(du, hn::LoadU(d8, codes + j));
      emit(j, hn::Mul(Fp8ToF32<kE4M3>(df, c), vsc));
    }
  }
  return j;
}

// Reads an fp8 section's per-head scales into scale[0, H) (stored after
// the codes' header, or the policy's static ones); returns its codes.
inline const uint8_t* Fp8SectionScales(const Section& s, const uint8_t* in,
                                       float* scale) {
  if (s.static_scales != nullptr) {
    std::copy(s.static_scales, s.static_scales + s.heads, scale);
    return in;
  }
  for (size_t h = 0; h < s.heads; ++h) {
    scale[h] = FloatFromBits(LoadLe32(in + 4 * h));
  }
  return in + 4 * s.heads;
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

// FindRejectedReference: the first value with (bits & 0x7FFF) >= bound.
size_t FindRejectedImpl(const uint16_t* in, size_t n, uint16_t bound) {
  const hn::ScalableTag<uint16_t> du;
  const hn::RebindToSigned<decltype(du)> d;
  const size_t N = hn::Lanes(d);
  const auto mag = hn::Set(du, 0x7FFFu);
  const auto below = hn::Set(d, static_cast<int16_t>(bound - 1));
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const auto a =
        hn::Gt(hn::BitCast(d, hn::And(hn::LoadU(du, in + i), mag)), below);
    const auto b =
        hn::Gt(hn::BitCast(d, hn::And(hn::LoadU(du, in + i + N), mag)), below);
    if (!hn::AllFalse(d, hn::Or(a, b))) break;
  }
  return i + FindRejectedReference(in + i, n - i, bound);
}

// For encoders asked to check their input (Section::non_finite): true, with
// the flag set, when in[0, n) holds rejected input (RejectBound(s.dtype)).
inline bool RejectNonFinite(const Section& s, const uint16_t* in, size_t n) {
  if (s.non_finite == nullptr ||
      FindRejectedImpl(in, n, RejectBound(s.dtype)) == n) {
    return false;
  }
  *s.non_finite = true;
  return true;
}

// ---- fp16 sections -------------------------------------------------------

void CopyFp16(const Section& s, const uint16_t* in, uint8_t* out) {
  std::memcpy(out, in, 2 * s.elements());  // little-endian host
}

void CopyFp16Back(const Section& s, const uint8_t* in, uint16_t* out) {
  std::memcpy(out, in, 2 * s.elements());
}

// ---- prefetch ------------------------------------------------------------

// Spreads the next section's cache misses (Section::next_input) over this
// section's arithmetic: an encoder calls Step() once per row of its `rows`
// and each call prefetches the next 1/rows of the next section's input.
class NextSectionPrefetcher {
 public:
  NextSectionPrefetcher(const Section& s, size_t rows)
      : base_(reinterpret_cast<const char*>(s.next_input)),
        bytes_(s.next_input == nullptr ? 0 : s.next_elements * 2),
        step_(rows == 0 ? bytes_ : (bytes_ + rows - 1) / rows) {}

  void Step() {
    const size_t end = std::min(bytes_, done_ + step_);
    for (; cursor_ < end; cursor_ += 64) {
      // GCC deletes a loop of __builtin_prefetch alone as having no effect.
#if defined(__x86_64__)
      asm volatile("prefetcht0 (%0)" ::"r"(base_ + cursor_));
#else
      __builtin_prefetch(base_ + cursor_, 0, 3);
#endif
    }
    done_ = end;
  }

 private:
  const char* base_;
  size_t bytes_;
  size_t step_;
  size_t done_ = 0;
  size_t cursor_ = 0;  // next line to prefetch (a multiple of 64)
};

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

// Per kv head of a section: the largest fp16 bit pattern with the sign
// cleared, which for finite values is the largest |x| (and is >= 0x7C00 when
// the head holds an infinity or a NaN).
void SectionHeadAbsMax(const Section& s, const uint16_t* in,
                       uint16_t* head_max) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  const hn::ScalableTag<uint16_t> d16;
  const size_t N16 = hn::Lanes(d16);
  const size_t full = D / N16 * N16;
  const auto abs_mask = hn::Set(d16, 0x7FFFu);
  // The section is read in memory order, which hardware prefetchers follow;
  // per head, a vector of running maxima.
  static thread_local std::vector<uint16_t> running;
  if (running.size() < H * N16) running.resize(H * N16);
  std::fill(running.begin(), running.begin() + H * N16, uint16_t{0});
  std::fill(head_max, head_max + H, uint16_t{0});
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      const uint16_t* row = in + (t * H + h) * D;
      uint16_t* acc = running.data() + h * N16;
      auto m = hn::LoadU(d16, acc);
      for (size_t j = 0; j < full; j += N16) {
        m = hn::Max(m, hn::And(hn::LoadU(d16, row + j), abs_mask));
      }
      hn::StoreU(m, d16, acc);
      for (size_t j = full; j < D; ++j) {
        head_max[h] = std::max<uint16_t>(head_max[h], row[j] & 0x7FFFu);
      }
    }
  }
  for (size_t h = 0; h < H; ++h) {
    head_max[h] = std::max<uint16_t>(
        head_max[h], hn::GetLane(hn::MaxOfLanes(
                         d16, hn::LoadU(d16, running.data() + h * N16))));
  }
}

// Exact codes of n values of one head: DivideRn where the scale allows it,
// true division otherwise, scalar for the last n % lanes.
template <Codec kCodec>
HWY_INLINE void EncodeFp8Exact(const uint16_t* in, size_t n, float scale,
                               uint8_t* dst) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::RebindToUnsigned<decltype(df)> du;
  const size_t N = hn::Lanes(df);
  const auto vsc = hn::Set(df, scale);
  const auto vrcp = hn::Set(df, 1.0f / scale);
  size_t j = 0;
  if (scale >= kMinFmaDivisor && scale <= kMaxFmaDivisor) {
    for (; j + N <= n; j += N) {
      const auto x = HalfToF32(df, hn::LoadU(d16, in + j));
      const auto c = Fp8Encode<kCodec>(df, DivideRn(df, x, vsc, vrcp), x);
      hn::StoreU(hn::TruncateTo(d8, hn::BitCast(du, c)), d8, dst + j);
    }
  } else {
    for (; j + N <= n; j += N) {
      const auto x = HalfToF32(df, hn::LoadU(d16, in + j));
      const auto c = Fp8Encode<kCodec>(df, hn::Div(x, vsc), x);
      hn::StoreU(hn::TruncateTo(d8, hn::BitCast(du, c)), d8, dst + j);
    }
  }
  for (; j < n; ++j) dst[j] = Fp8Scalar<kCodec>(HalfToFloat(in[j]) / scale);
}

// ---- FP8 by table (AVX-512BW, AVX2) ----------------------------------------
//
// For a head whose scale s is a normal fp32 number, the code of a normal fp16
// x = 2^(e-15) * (1 + m/1024) (e = exponent field, m = mantissa field) whose
// quotient lands in fp8's normal range is
//     code(x) = K*e + G(m),   K = 2^kManBits,
// because RN(x / s) = 2^(e - 17 - e_s) * RN(4(1 + m/1024) / S) exactly
// (s = 2^e_s * S, S in [1, 2); power-of-two scaling commutes with rounding
// while everything is a normal number), and on fp8's normal grid scaling by
// 2^k adds K*k to the code, a mantissa carry included. Saturation is the
// same function clamped to the largest finite code. G is non-decreasing in m
// and rises by at most one across the 32 values of a bucket b = m >> 5
// (32/1024 of relative change against at least 1/16 between fp8 rounding
// boundaries), at m = threshold[b]. With offset[b] = 512 - threshold[b]
// (512 - 32b where the bucket does not rise; 16-bit wrap-around arithmetic),
// m + offset[b] stays in [481, 543] and crosses 512 exactly at the
// threshold, so
//     code(x) = ((|x| + offset[b]) >> (10 - kManBits)) + base[b]
// with no carry out of the mantissa field; base folds into the offset (see
// Fp8HeadTable): one 32-entry table of 16-bit lanes, one vpermw (on AVX2,
// four vpshufb on its bytes). The tables
// come from 64 reference quotients (true IEEE divisions) and a 5-step bisection
// per bucket; they depend on the scale's significand alone up to a constant,
// and are cached per thread.
//
// Lanes the identity does not cover: x = 0 gets code 0 (with its sign)
// directly; 0 < |x| < safe (fp16 subnormals, and every binade where
// K*e + G(0) < K, i.e. quotients that may round on fp8's subnormal grid) are
// recoded one by one with the reference arithmetic. A code >= K means a
// rounded quotient >= the smallest normal, so the true quotient is at least
// that minus a quarter of the subnormal step and rounds the same on both
// grids.
// A row with more than kMaxLaneRecodes such lanes (heads whose scale an
// outlier sets, so many values fall below `safe`) is recoded whole by the
// vector exact path instead, which costs about what four lanes one by one do.
// kernels/codec_simd_test.cc checks every finite fp16 value against the
// reference over a spread of scales.
#undef KVCACHE_FP8_TABLE
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define KVCACHE_FP8_TABLE 1

constexpr size_t kMaxLaneRecodes = 4;

// offset[b] + (base[b] << kShift), mod 2^16: adding a multiple of
// 2^kShift before the shift is adding base after it, so one table (one
// vpermw) serves, as long as the codes of the head fit in 16 - kShift bits
// (BuildFp8HeadTable checks the largest).
struct Fp8HeadTable {
  alignas(64) uint16_t folded[32];
  uint16_t safe = 0;  // smallest |x| bits (>= 0x400) the identity covers
#if HWY_TARGET == HWY_AVX2
  // AVX2 has no 16-bit lane permute: `folded` as four 16-entry byte tables
  // for vpshufb (low bytes of entries 0-15, of 16-31, high bytes of 0-15,
  // of 16-31), each in both 128-bit lanes.
  alignas(32) uint8_t shuffle[4][32];
#endif
};

// The format's constants the table path uses: K = 2^kManBits codes per
// binade, so |x| >> kShift is K*e plus the top mantissa bits.
template <Codec kCodec>
struct Fp8TableFormat {
  static constexpr int kManBits = kCodec == Codec::kFp8E4M3 ? 3 : 2;
  static constexpr int kShift = 10 - kManBits;
  static constexpr uint16_t kMaxCode = kCodec == Codec::kFp8E4M3 ? 0x7E : 0x7B;
};

// The code of one value by the table, or by the reference arithmetic where
// the table does not cover it (0 < |x| < safe): the scalar form of the row
// encoders below, for their last values and their recodes.
template <Codec kCodec>
uint8_t Fp8CodeByTable(uint16_t x, const Fp8HeadTable& table, float scale) {
  using F = Fp8TableFormat<kCodec>;
  const uint16_t a = x & 0x7FFFu;
  if (a != 0 && a < table.safe)
    return Fp8Scalar<kCodec>(HalfToFloat(x) / scale);
  // 16-bit wrap-around, as in the vector lanes.
  uint32_t code =
      static_cast<uint16_t>(a + table.folded[(a >> 5) & 31u]) >> F::kShift;
  code = a == 0 ? 0 : std::min<uint32_t>(code, F::kMaxCode);
  return static_cast<uint8_t>(code | ((x >> 8) & 0x80u));
}

// Codes (7 bits, positive) of RN(4(1 + m/1024) / sm) for 32 values of m.
template <Codec kCodec, class DU>
HWY_INLINE hn::Vec<DU> ReferenceQuotientCodes(
    DU du, hn::Vec<DU> m, hn::Vec<hn::RebindToFloat<DU>> sm) {
  const hn::RebindToFloat<DU> df;
  const auto x =
      hn::BitCast(df, hn::Or(hn::Set(du, 0x40800000u), hn::ShiftLeft<13>(m)));
  return hn::BitCast(du, Fp8Encode<kCodec>(df, hn::Div(x, sm), x));
}

// The tables for a scale with significand sm in [1, 2) and exponent 0; a
// scale 2^e_s * sm has the same offsets and base - K*(17 + e_s) instead of
// base - 17K. `usable` is false (never seen; checked all the same) when a
// bucket's codes rise by more than one.
struct Fp8SignificandTable {
  alignas(64) uint16_t offset[32];
  alignas(64) uint16_t base[32];
  uint32_t key = 0;  // significand bits | 1 << 31 once built
  bool usable = false;
};

template <Codec kCodec>
void BuildFp8SignificandTable(uint32_t significand,
                              Fp8SignificandTable& table) {
  constexpr uint32_t kShift = Fp8TableFormat<kCodec>::kShift;
  constexpr uint32_t K = 1u << Fp8TableFormat<kCodec>::kManBits;
  const hn::ScalableTag<uint32_t> du;  // 16 lanes on AVX-512, 8 on AVX2
  const hn::RebindToFloat<decltype(du)> df;
  const hn::Rebind<uint16_t, decltype(du)> d16;
  const uint32_t N = static_cast<uint32_t>(hn::Lanes(du));
  const auto sm = hn::Set(df, FloatFromBits(significand | 0x3F800000u));
  table.key = significand | 0x80000000u;
  table.usable = true;
  for (uint32_t bucket = 0; bucket < 32; bucket += N) {
    const auto first =
        hn::ShiftLeft<5>(hn::Add(hn::Iota(du, 0), hn::Set(du, bucket)));
    auto lo = first;
    auto hi = hn::Add(first, hn::Set(du, 31));
    const auto c_lo = ReferenceQuotientCodes<kCodec>(du, lo, sm);
    const auto c_hi = ReferenceQuotientCodes<kCodec>(du, hi, sm);
    if (!hn::AllFalse(du, hn::Gt(c_hi, hn::Add(c_lo, hn::Set(du, 1))))) {
      table.usable = false;
      return;
    }
    const auto rises = hn::Lt(c_lo, c_hi);
    // Invariant: code(lo) == c_lo, and where the bucket rises code(hi) > c_lo.
    for (int step = 0; step < 5; ++step) {
      const auto mid = hn::ShiftRight<1>(hn::Add(lo, hi));
      const auto up = hn::Gt(ReferenceQuotientCodes<kCodec>(du, mid, sm), c_lo);
      hi = hn::IfThenElse(up, mid, hi);
      lo = hn::IfThenElse(up, lo, mid);
    }
    // (m + offset) >> kShift is 511 >> kShift below the threshold and
    // 512 >> kShift from it on (and across a bucket that does not rise).
    const auto offset =
        hn::Sub(hn::Set(du, 512), hn::IfThenElse(rises, hi, first));
    const auto below = hn::IfThenElse(rises, hn::Set(du, 511u >> kShift),
                                      hn::Set(du, 512u >> kShift));
    // 16-bit wrap-around arithmetic; codes are in [0, 127].
    const auto base = hn::Sub(hn::Sub(c_lo, hn::Set(du, 17 * K)), below);
    hn::StoreU(hn::TruncateTo(d16, offset), d16, table.offset + bucket);
    hn::StoreU(hn::TruncateTo(d16, base), d16, table.base + bucket);
  }
}

// A per-thread cache of significand tables: with dynamic scales
// (amax / fp8 max, amax an fp16 value) there are at most 1024 significands
// per codec, and static scales repeat block after block.
template <Codec kCodec>
const Fp8SignificandTable& CachedFp8SignificandTable(uint32_t significand) {
  constexpr size_t kSlots = 2048;
  static thread_local std::unique_ptr<Fp8SignificandTable[]> cache;
  if (cache == nullptr) cache = std::make_unique<Fp8SignificandTable[]>(kSlots);
  Fp8SignificandTable& slot =
      cache[(significand * 0x9E3779B1u) >> 21 & (kSlots - 1)];
  if (slot.key != (significand | 0x80000000u)) {
    BuildFp8SignificandTable<kCodec>(significand, slot);
  }
  return slot;
}

// False when the scale is not a normal number, when no fp16 binade maps into
// fp8's normal range, or when the significand table is not usable: the head
// then takes the exact path.
template <Codec kCodec>
bool BuildFp8HeadTable(float scale, Fp8HeadTable& table) {
  constexpr int32_t K = 1 << Fp8TableFormat<kCodec>::kManBits;
  const uint32_t bits = FloatBits(scale);
  const uint32_t exp_field = bits >> 23;
  if (exp_field == 0 || exp_field >= 255) return false;
  const int32_t e_s = static_cast<int32_t>(exp_field) - 127;
  const Fp8SignificandTable& sig =
      CachedFp8SignificandTable<kCodec>(bits & 0x7FFFFFu);
  if (!sig.usable) return false;
  constexpr int kShift = Fp8TableFormat<kCodec>::kShift;
  const hn::ScalableTag<uint16_t> d16;
  const auto adjust = hn::Set(d16, static_cast<uint16_t>(K * e_s));
  alignas(64) uint16_t base[32];
  for (size_t i = 0; i < 32; i += hn::Lanes(d16)) {
    const auto b = hn::Sub(hn::Load(d16, sig.base + i), adjust);
    hn::Store(b, d16, base + i);
    hn::Store(hn::Add(hn::Load(d16, sig.offset + i), hn::ShiftLeft<kShift>(b)),
              d16, table.folded + i);
  }
  // The largest code, of the largest finite |x| (0x7BFF, bucket 31), must
  // fit the fold; it does unless the scale is below about 2^-40.
  const int32_t largest =
      (static_cast<uint16_t>(0x7BFFu + sig.offset[31]) >> kShift) +
      static_cast<int16_t>(base[31]);
  if (largest > (0xFFFF >> kShift)) return false;
  // Smallest exponent field e >= 1 with K*e + G(0) >= K, G(0) being the
  // identity's code for e = 0, m = 0.
  const int32_t g0 = static_cast<int16_t>(base[0]) + (sig.offset[0] >> kShift);
  int32_t e_min = 1;
  while (e_min <= 30 && K * e_min + g0 < K) ++e_min;
  if (e_min > 30) return false;
  table.safe = static_cast<uint16_t>(e_min << 10);
#if HWY_TARGET == HWY_AVX2
  for (int k = 0; k < 16; ++k) {
    for (int lane = 0; lane < 2; ++lane) {
      table.shuffle[0][16 * lane + k] = table.folded[k] & 0xFF;
      table.shuffle[1][16 * lane + k] = table.folded[16 + k] & 0xFF;
      table.shuffle[2][16 * lane + k] = table.folded[k] >> 8;
      table.shuffle[3][16 * lane + k] = table.folded[16 + k] >> 8;
    }
  }
#endif
  return true;
}

#if HWY_TARGET <= HWY_AVX3
// Codes of a head's row by the table. The values it does not cover
// (0 < |x| < safe, rare: quotients near fp8's subnormal range) are then
// recoded one by one with the scalar reference conversion, or the whole
// row by the vector exact path past kMaxLaneRecodes of them.
template <Codec kCodec>
HWY_INLINE void EncodeFp8RowByTable(const uint16_t* row, size_t n,
                                    const Fp8HeadTable& table, float scale,
                                    uint8_t* dst) {
  constexpr int kShift = Fp8TableFormat<kCodec>::kShift;
  const __m512i max_code = _mm512_set1_epi16(Fp8TableFormat<kCodec>::kMaxCode);
  const __m512i folded_table = _mm512_load_si512(table.folded);
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  const __m512i sign_bit = _mm512_set1_epi16(0x80);
  const __m512i minus_one = _mm512_set1_epi16(-1);
  const __m512i pack_order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
  // Smallest nonzero |x| of the row (as bits).
  __m512i least = minus_one;
  const auto codes = [&](__m512i x) {
    const __m512i a = _mm512_and_si512(x, magnitude);
    const __m512i bucket = _mm512_srli_epi16(a, 5);  // vpermw reads 5 bits
    __m512i code = _mm512_srli_epi16(
        _mm512_add_epi16(a, _mm512_permutexvar_epi16(bucket, folded_table)),
        kShift);
    const __mmask32 nonzero = _mm512_test_epi16_mask(a, a);
    code = _mm512_maskz_min_epu16(nonzero, code, max_code);
    least = _mm512_mask_min_epu16(least, nonzero, least, a);
    // code | (x >> 8 & 0x80): the sign.
    return _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(x, 8), sign_bit,
                                     0xF8);
  };
  size_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512i c0 = codes(_mm512_loadu_si512(row + j));
    const __m512i c1 = codes(_mm512_loadu_si512(row + j + 32));
    _mm512_storeu_si512(dst + j, _mm512_permutexvar_epi64(
                                     pack_order, _mm512_packus_epi16(c0, c1)));
  }
  for (; j + 32 <= n; j += 32) {
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(dst + j),
        _mm512_cvtepi16_epi8(codes(_mm512_loadu_si512(row + j))));
  }
  const size_t vector_end = j;
  for (; j < n; ++j) dst[j] = Fp8CodeByTable<kCodec>(row[j], table, scale);
  const __m512i safe = _mm512_set1_epi16(table.safe);
  if (_mm512_cmplt_epu16_mask(least, safe) == 0) return;
  size_t recoded = 0;
  for (j = 0; j < vector_end; j += 32) {
    const __m512i a = _mm512_and_si512(_mm512_loadu_si512(row + j), magnitude);
    uint32_t uncovered =
        _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(a, a), a, safe);
    while (uncovered != 0) {
      if (++recoded > kMaxLaneRecodes) {
        return EncodeFp8Exact<kCodec>(row, vector_end, scale, dst);
      }
      const size_t i = j + static_cast<size_t>(__builtin_ctz(uncovered));
      dst[i] = Fp8CodeByTable<kCodec>(row[i], table, scale);
      uncovered &= uncovered - 1;
    }
  }
}
#else   // AVX2
// As the AVX-512 version, 16 values per vector; the table lookup is four
// vpshufb (the low and high bytes of entries 0-15 and 16-31) and blends.
template <Codec kCodec>
HWY_INLINE void EncodeFp8RowByTable(const uint16_t* row, size_t n,
                                    const Fp8HeadTable& table, float scale,
                                    uint8_t* dst) {
  constexpr int kShift = Fp8TableFormat<kCodec>::kShift;
  constexpr uint16_t kMaxCode = Fp8TableFormat<kCodec>::kMaxCode;
  const auto load = [](const void* p) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  };
  const __m256i low0 = load(table.shuffle[0]), low1 = load(table.shuffle[1]);
  const __m256i high0 = load(table.shuffle[2]), high1 = load(table.shuffle[3]);
  const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
  const __m256i bucket_mask = _mm256_set1_epi16(31);
  const __m256i odd_bytes = _mm256_set1_epi16(static_cast<short>(0xFF00));
  const __m256i max_code = _mm256_set1_epi16(kMaxCode);
  const __m256i sign_bit = _mm256_set1_epi16(0x80);
  const __m256i zero = _mm256_setzero_si256();
  // Smallest nonzero |x| of the row (zeros count as 0xFFFF).
  __m256i least = _mm256_set1_epi16(-1);
  const auto codes = [&](__m256i x) {
    const __m256i a = _mm256_and_si256(x, magnitude);
    const __m256i bucket =
        _mm256_and_si256(_mm256_srli_epi16(a, 5), bucket_mask);
    // The bucket in both bytes of its lane; bit 4 (entries 16-31) moved to
    // bit 7 of each byte for the blends.
    const __m256i index = _mm256_or_si256(bucket, _mm256_slli_epi16(bucket, 8));
    const __m256i upper = _mm256_slli_epi16(index, 3);
    const __m256i low =
        _mm256_blendv_epi8(_mm256_shuffle_epi8(low0, index),
                           _mm256_shuffle_epi8(low1, index), upper);
    const __m256i high =
        _mm256_blendv_epi8(_mm256_shuffle_epi8(high0, index),
                           _mm256_shuffle_epi8(high1, index), upper);
    const __m256i folded = _mm256_blendv_epi8(low, high, odd_bytes);
    __m256i code = _mm256_srli_epi16(_mm256_add_epi16(a, folded), kShift);
    const __m256i is_zero = _mm256_cmpeq_epi16(a, zero);
    code = _mm256_andnot_si256(is_zero, _mm256_min_epu16(code, max_code));
    least = _mm256_min_epu16(least, _mm256_or_si256(a, is_zero));
    return _mm256_or_si256(code,
                           _mm256_and_si256(_mm256_srli_epi16(x, 8), sign_bit));
  };
  const auto load_row = [row](size_t j) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j));
  };
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    // packus interleaves 128-bit lanes: [c0 low, c1 low, c0 high, c1 high].
    const __m256i packed =
        _mm256_packus_epi16(codes(load_row(j)), codes(load_row(j + 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
  for (; j + 16 <= n; j += 16) {
    const __m256i c = codes(load_row(j));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(
                         _mm256_packus_epi16(c, c), 0xD8)));
  }
  const size_t vector_end = j;
  for (; j < n; ++j) dst[j] = Fp8CodeByTable<kCodec>(row[j], table, scale);
  // Lanes below `safe`: least <= safe - 1 (unsigned).
  const __m256i below = _mm256_set1_epi16(static_cast<short>(table.safe - 1));
  if (_mm256_movemask_epi8(
          _mm256_cmpeq_epi16(_mm256_min_epu16(least, below), least)) == 0) {
    return;
  }
  size_t recoded = 0;
  for (j = 0; j < vector_end; j += 16) {
    const __m256i a = _mm256_and_si256(load_row(j), magnitude);
    // 0 < |x| < safe; |x| <= 0x7BFF, so signed compares are right.
    const __m256i uncovered = _mm256_andnot_si256(
        _mm256_cmpeq_epi16(a, zero),
        _mm256_cmpgt_epi16(_mm256_set1_epi16(static_cast<short>(table.safe)),
                           a));
    uint32_t bits = static_cast<uint32_t>(_mm256_movemask_epi8(uncovered));
    while (bits != 0) {
      if (++recoded > kMaxLaneRecodes) {
        return EncodeFp8Exact<kCodec>(row, vector_end, scale, dst);
      }
      const size_t i = j + static_cast<size_t>(__builtin_ctz(bits)) / 2;
      dst[i] = Fp8CodeByTable<kCodec>(row[i], table, scale);
      bits &= bits - 1;
      bits &= bits - 1;  // both bytes of the lane
    }
  }
}
#endif  // AVX-512BW or AVX2
#else
#define KVCACHE_FP8_TABLE 0
#endif  // AVX2 and up

template <Codec kCodec>
void EncodeFp8(const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  Scratch& scratch = GetScratch();
  float* scale = Sized(scratch.f0, H);
  uint8_t* codes = out;
  if (s.static_scales == nullptr) {
    uint16_t* amax_bits = Sized(scratch.u16, H);
    if (s.head_abs_max != nullptr) {
      std::copy(s.head_abs_max, s.head_abs_max + H, amax_bits);
    } else {
      SectionHeadAbsMax(s, in, amax_bits);
    }
    for (size_t h = 0; h < H; ++h) {
      const float amax = HalfToFloat(amax_bits[h]);
      scale[h] = amax == 0.0f ? 1.0f : amax / Fp8Max(kCodec);
      StoreLe32(out + 4 * h, FloatBits(scale[h]));
    }
    codes = out + 4 * H;
  } else {
    for (size_t h = 0; h < H; ++h) scale[h] = s.static_scales[h];
  }
#if KVCACHE_FP8_TABLE
  // A head's table is a cache lookup, or about 14 vectors of exact
  // quotients when its significand is new; below a few hundred values per
  // head the exact path is about as fast.
  static thread_local std::vector<Fp8HeadTable> tables;
  static thread_local std::vector<uint8_t> by_table;
  if (tables.size() < H) tables.resize(H);
  if (by_table.size() < H) by_table.resize(H);
  const bool worth_tables = T * D >= 512;
  for (size_t h = 0; h < H; ++h) {
    by_table[h] =
        worth_tables && BuildFp8HeadTable<kCodec>(scale[h], tables[h]);
  }
#endif
  NextSectionPrefetcher prefetch(s, T * H);
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      prefetch.Step();
      const size_t base = (t * H + h) * D;
#if KVCACHE_FP8_TABLE
      if (by_table[h]) {
        EncodeFp8RowByTable<kCodec>(in + base, D, tables[h], scale[h],
                                    codes + base);
        continue;
      }
#endif
      EncodeFp8Exact<kCodec>(in + base, D, scale[h], codes + base);
    }
  }
}

// Whether a decoder may store vectors of d16 with hn::Stream at
// out + k * Lanes(d16) (rows of `run` values, each row whole vectors): the
// section asks for it (Section::stream_output), the vectors are full
// registers of 16 bytes or more (the stream of a narrower vector would
// write a whole register) and `out` is aligned to them.
template <class D16>
HWY_INLINE bool MayStream(const Section& s, D16 d16, const uint16_t* out,
                          size_t run) {
  const size_t lanes = hn::Lanes(d16);
  const size_t bytes = lanes * sizeof(uint16_t);
  return s.stream_output && bytes >= 16 && run % lanes == 0 &&
         reinterpret_cast<uintptr_t>(out) % bytes == 0;
}

// A decoder's output store (see MayStream).
template <class D16>
HWY_INLINE void StoreDecoded(hn::Vec<D16> v, D16 d16, bool stream,
                             uint16_t* HWY_RESTRICT dst) {
  if (stream) {
    hn::Stream(v, d16, dst);
  } else {
    hn::StoreU(v, d16, dst);
  }
}

template <Codec kCodec>
void DecodeFp8(const Section& s, const uint8_t* in, uint16_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  Scratch& scratch = GetScratch();
  float* scale = Sized(scratch.f0, H);
  const uint8_t* codes = Fp8SectionScales(s, in, scale);
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  constexpr bool kE4M3 = kCodec == Codec::kFp8E4M3;
  const bool stream = MayStream(s, d16, out, D);
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      const size_t base = (t * H + h) * D;
      const uint8_t* src = codes + base;
      uint16_t* dst = out + base;
      const float sc = scale[h];
      size_t j = DecodeFp8RowVectors<kE4M3>(
          df, src, D, sc, [&](size_t k, hn::Vec<decltype(df)> v) {
            StoreDecoded(F32ToHalf(df, v), d16, stream, dst + k);
          });
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

// n codes (n a multiple of 8 / kBits) from packed bytes, one per byte.
// 16 packed bytes at a time: split the fields with shifts and masks, then
// interleave them back into element order.
template <uint32_t kBits>
void UnpackCodes(const uint8_t* packed, size_t n, uint8_t* codes) {
  const hn::Full128<uint8_t> d8;
  const hn::Full128<uint16_t> d16;
  const size_t nbytes = n * kBits / 8;
  size_t k = 0;
  if constexpr (kBits == 2) {
    const auto m = hn::Set(d8, 3);
    for (; k + 16 <= nbytes; k += 16) {
      const auto v = hn::LoadU(d8, packed + k);
      const auto c0 = hn::And(v, m);
      const auto c1 = hn::And(hn::ShiftRight<2>(v), m);
      const auto c2 = hn::And(hn::ShiftRight<4>(v), m);
      const auto c3 = hn::ShiftRight<6>(v);
      // Byte j holds elements 4j..4j+3 = c0[j], c1[j], c2[j], c3[j].
      const auto lo01 = hn::BitCast(d16, hn::InterleaveLower(d8, c0, c1));
      const auto hi01 = hn::BitCast(d16, hn::InterleaveUpper(d8, c0, c1));
      const auto lo23 = hn::BitCast(d16, hn::InterleaveLower(d8, c2, c3));
      const auto hi23 = hn::BitCast(d16, hn::InterleaveUpper(d8, c2, c3));
      uint8_t* dst = codes + 4 * k;
      hn::StoreU(hn::BitCast(d8, hn::InterleaveLower(d16, lo01, lo23)), d8,
                 dst);
      hn::StoreU(hn::BitCast(d8, hn::InterleaveUpper(d16, lo01, lo23)), d8,
                 dst + 16);
      hn::StoreU(hn::BitCast(d8, hn::InterleaveLower(d16, hi01, hi23)), d8,
                 dst + 32);
      hn::StoreU(hn::BitCast(d8, hn::InterleaveUpper(d16, hi01, hi23)), d8,
                 dst + 48);
    }
    for (; k < nbytes; ++k) {
      const uint32_t b = packed[k];
      for (uint32_t u = 0; u < 4; ++u) codes[4 * k + u] = (b >> (2 * u)) & 3u;
    }
  } else {
    const auto m = hn::Set(d8, 15);
    for (; k + 16 <= nbytes; k += 16) {
      const auto v = hn::LoadU(d8, packed + k);
      const auto lo = hn::And(v, m);
      const auto hi = hn::ShiftRight<4>(v);
      hn::StoreU(hn::InterleaveLower(d8, lo, hi), d8, codes + 2 * k);
      hn::StoreU(hn::InterleaveUpper(d8, lo, hi), d8, codes + 2 * k + 16);
    }
    for (; k < nbytes; ++k) {
      codes[2 * k] = packed[k] & 15u;
      codes[2 * k + 1] = packed[k] >> 4;
    }
  }
}

// The divisor and reciprocal DivideRn uses for a group scale. With FMA, a
// zero scale (every code 0) becomes divisor 1 and reciprocal 0, which makes
// the quotient 0 for any finite x - zero: no per-element test. Without FMA
// the division is a true one and KiviCode tests for the zero scale.
template <class DF>
HWY_INLINE void KiviDivisor(DF df, hn::Vec<DF> scale, hn::Vec<DF>& divisor,
                            hn::Vec<DF>& rcp) {
#if HWY_NATIVE_FMA
  const auto zero_scale = hn::Eq(scale, hn::Zero(df));
  divisor = hn::IfThenElse(zero_scale, hn::Set(df, 1.0f), scale);
  rcp = hn::IfThenZeroElse(zero_scale, hn::Div(hn::Set(df, 1.0f), divisor));
#else
  divisor = scale;
  rcp = scale;  // unused
#endif
}

// clamp(rint((x - zero) / scale), 0, qmax), 0 where scale == 0, in the low
// byte of each 32-bit lane. x >= zero (zero is the group minimum), so the
// quotient is >= 0 (or -0), and rint(min(q, qmax)) == min(rint(q), qmax).
// Adding 2^23 to a q in [0, 2^22] rounds it to an integer, to nearest even,
// and leaves that integer in the low mantissa bits.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> KiviCode(DF df, hn::Vec<DF> x,
                                                      hn::Vec<DF> zero,
                                                      hn::Vec<DF> divisor,
                                                      hn::Vec<DF> rcp,
                                                      hn::Vec<DF> qmax) {
  auto q = hn::Min(DivideRn(df, hn::Sub(x, zero), divisor, rcp), qmax);
#if !HWY_NATIVE_FMA
  q = hn::IfThenZeroElse(hn::Eq(divisor, hn::Zero(df)), q);
#endif
  return hn::BitCast(hn::RebindToUnsigned<DF>(),
                     hn::Add(q, hn::Set(df, 0x1p23f)));
}

template <uint32_t kBits>
bool KiviFits(const Section& s, size_t N) {
  const size_t run = s.is_key ? size_t{s.heads} * s.dim : s.group;
  return run % N == 0 && (run * kBits) % 8 == 0;
}

// ---- KIVI on AVX-512BW ------------------------------------------------------
//
// The same arithmetic as KiviCode (DivideRn, then round to nearest even) on
// 64 consecutive elements at a time, which are then narrowed to bytes with
// saturating packs, clamped to 2^b - 1 as bytes (rint(min(q, qmax)) ==
// min(rint(q), qmax), q >= 0) and packed to b bits with multiply-adds, with
// no staging buffer. Value groups of 32k channels get their extremes from a
// butterfly across 16 groups instead of one horizontal reduction per group.
#undef KVCACHE_KIVI_AVX512
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#define KVCACHE_KIVI_AVX512 1

// Rounded codes of 64 quotients (four vectors in element order), packed to
// kBits each at out (64 * kBits / 8 bytes).
template <uint32_t kBits>
HWY_INLINE void StoreKiviCodes64(__m512 q0, __m512 q1, __m512 q2, __m512 q3,
                                 uint8_t* out) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i w01 = _mm512_packus_epi32(_mm512_cvt_roundps_epi32(q0, kRne),
                                          _mm512_cvt_roundps_epi32(q1, kRne));
  const __m512i w23 = _mm512_packus_epi32(_mm512_cvt_roundps_epi32(q2, kRne),
                                          _mm512_cvt_roundps_epi32(q3, kRne));
  // Each 128-bit lane L now holds elements 16k + 4L .. 16k + 4L + 3 in its
  // dword k; move dword 4L + k to 4k + L for element order.
  const __m512i order =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bytes = _mm512_min_epu8(
      _mm512_permutexvar_epi32(order, _mm512_packus_epi16(w01, w23)),
      _mm512_set1_epi8(static_cast<char>((1u << kBits) - 1u)));
  if constexpr (kBits == 2) {
    // c0 + 4c1 per 16-bit pair, then (c0 + 4c1) + 16(c2 + 4c3) per dword.
    const __m512i pairs =
        _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x0401));
    const __m512i quads =
        _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x00100001));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm512_cvtepi32_epi8(quads));
  } else {
    const __m512i pairs =
        _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x1001));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm512_cvtepi16_epi8(pairs));
  }
}

// fp16 bits <-> order-preserving keys (as SortableKey / KeyToHalf).
HWY_INLINE __m512i HalfToKey512(__m512i h) {
  return _mm512_xor_si512(
      h, _mm512_or_si512(_mm512_srai_epi16(h, 15), _mm512_set1_epi16(-32768)));
}
HWY_INLINE __m512i KeyToHalf512(__m512i key) {
  // key ^ 0x8000 where bit 15 is set, key ^ 0xFFFF where it is clear.
  const __m512i s = _mm512_srai_epi16(key, 15);
  return _mm512_xor_si512(
      key, _mm512_or_si512(_mm512_andnot_si512(s, _mm512_set1_epi16(-1)),
                           _mm512_set1_epi16(-32768)));
}

template <bool kMax>
HWY_INLINE __m512i MinOrMax16(__m512i a, __m512i b) {
  return kMax ? _mm512_max_epu16(a, b) : _mm512_min_epu16(a, b);
}

// v[g] holds 32 keys of group g (g < 16): returns each group's minimum (or
// maximum), in group order. Each level halves the lanes per group while
// keeping vectors full: 512 -> 256 -> 128 -> 64 -> 32 -> 16 bits per group.
template <bool kMax>
HWY_INLINE __m256i ReduceSixteenGroups(const __m512i* v) {
  __m512i w[8], x[4], y[2];
  for (int p = 0; p < 8; ++p) {  // quarters [g2p, g2p, g2p+1, g2p+1]
    w[p] = MinOrMax16<kMax>(_mm512_shuffle_i64x2(v[2 * p], v[2 * p + 1], 0x44),
                            _mm512_shuffle_i64x2(v[2 * p], v[2 * p + 1], 0xEE));
  }
  for (int q = 0; q < 4; ++q) {  // quarters [g4q, g4q+1, g4q+2, g4q+3]
    x[q] = MinOrMax16<kMax>(_mm512_shuffle_i64x2(w[2 * q], w[2 * q + 1], 0x88),
                            _mm512_shuffle_i64x2(w[2 * q], w[2 * q + 1], 0xDD));
  }
  for (int r = 0; r < 2; ++r) {  // lane i: [g8r+i, g8r+4+i], 4 keys each
    y[r] = MinOrMax16<kMax>(_mm512_unpacklo_epi64(x[2 * r], x[2 * r + 1]),
                            _mm512_unpackhi_epi64(x[2 * r], x[2 * r + 1]));
  }
  // Lane i: dwords [gi, g4+i, g8+i, g12+i], 2 keys each.
  const __m512 y0 = _mm512_castsi512_ps(y[0]), y1 = _mm512_castsi512_ps(y[1]);
  __m512i z =
      MinOrMax16<kMax>(_mm512_castps_si512(_mm512_shuffle_ps(y0, y1, 0x88)),
                       _mm512_castps_si512(_mm512_shuffle_ps(y0, y1, 0xDD)));
  z = MinOrMax16<kMax>(z, _mm512_srli_epi32(z, 16));
  // Dword 4i + k holds group 4k + i.
  const __m512i order =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(order, z));
}

// Extremes (fp16 bits) of `count` groups of G values, G a multiple of 32,
// count a multiple of 16. True when a group holds inf or NaN: as keys, +inf
// and positive NaNs are >= 0xFC00 and -inf and negative NaNs <= 0x03FF.
HWY_INLINE bool GroupMinMax512(const uint16_t* in, size_t G, size_t count,
                               uint16_t* mn, uint16_t* mx) {
  __m512i lo[16], hi[16];
  __m256i least = _mm256_set1_epi16(-1), most = _mm256_setzero_si256();
  for (size_t k0 = 0; k0 < count; k0 += 16) {
    for (size_t g = 0; g < 16; ++g) {
      const uint16_t* src = in + (k0 + g) * G;
      lo[g] = hi[g] = HalfToKey512(_mm512_loadu_si512(src));
      for (size_t j = 32; j < G; j += 32) {
        const __m512i key = HalfToKey512(_mm512_loadu_si512(src + j));
        lo[g] = _mm512_min_epu16(lo[g], key);
        hi[g] = _mm512_max_epu16(hi[g], key);
      }
    }
    const __m256i group_lo = ReduceSixteenGroups<false>(lo);
    const __m256i group_hi = ReduceSixteenGroups<true>(hi);
    least = _mm256_min_epu16(least, group_lo);
    most = _mm256_max_epu16(most, group_hi);
    const __m512i both =
        _mm512_inserti64x4(_mm512_castsi256_si512(group_lo), group_hi, 1);
    const __m512i halves = KeyToHalf512(both);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(mn + k0),
                        _mm512_castsi512_si256(halves));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(mx + k0),
                        _mm512_extracti64x4_epi64(halves, 1));
  }
  return _mm256_cmpgt_epu16_mask(_mm256_set1_epi16(0x0400), least) != 0 ||
         _mm256_cmpgt_epu16_mask(
             most, _mm256_set1_epi16(static_cast<short>(0xFBFF))) != 0;
}

// Quotients (x - zero) / scale of 16 fp16 values.
HWY_INLINE __m512 KiviQuotient16(const uint16_t* x, __m512 zero, __m512 divisor,
                                 __m512 rcp) {
  const hn::ScalableTag<float> df;
  const hn::Vec<decltype(df)> v{
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)))};
  return DivideRn(df, hn::Sub(v, hn::Vec<decltype(df)>{zero}),
                  hn::Vec<decltype(df)>{divisor}, hn::Vec<decltype(df)>{rcp})
      .raw;
}
#else
#define KVCACHE_KIVI_AVX512 0
#endif  // AVX-512BW

#if KVCACHE_KIVI_AVX512
// EncodeKiviKeys for 16 fp32 lanes and H*D a multiple of 64: per token group
// and run of 64 channels, extremes as 16-bit keys, then codes packed straight
// from registers.
template <uint32_t kBits>
void EncodeKiviKeys512(const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t T = s.tokens, G = s.group, HD = size_t{s.heads} * s.dim;
  const size_t groups = s.elements() / G;
  uint8_t* zeros = out;
  uint8_t* scales = out + 2 * groups;
  uint8_t* codes = out + 4 * groups;
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Repartition<uint8_t, decltype(d16)> d16b;
  const auto qmax = hn::Set(df, static_cast<float>((1u << kBits) - 1u));
  const auto pos_zero = hn::Zero(df);
  NextSectionPrefetcher prefetch(s, T / G * (HD / 64));
  alignas(64) uint16_t mn[64], mx[64];
  __m512i least = _mm512_set1_epi16(-1), most = _mm512_setzero_si512();
  for (size_t g = 0; g < T / G; ++g) {
    const uint16_t* slice = in + g * G * HD;
    for (size_t j = 0; j < HD; j += 64) {
      prefetch.Step();
      __m512i lo0 = HalfToKey512(_mm512_loadu_si512(slice + j));
      __m512i lo1 = HalfToKey512(_mm512_loadu_si512(slice + j + 32));
      __m512i hi0 = lo0, hi1 = lo1;
      for (size_t t = 1; t < G; ++t) {
        const __m512i k0 = HalfToKey512(_mm512_loadu_si512(slice + t * HD + j));
        const __m512i k1 =
            HalfToKey512(_mm512_loadu_si512(slice + t * HD + j + 32));
        lo0 = _mm512_min_epu16(lo0, k0);
        hi0 = _mm512_max_epu16(hi0, k0);
        lo1 = _mm512_min_epu16(lo1, k1);
        hi1 = _mm512_max_epu16(hi1, k1);
      }
      least = _mm512_min_epu16(least, _mm512_min_epu16(lo0, lo1));
      most = _mm512_max_epu16(most, _mm512_max_epu16(hi0, hi1));
      _mm512_store_si512(mn, KeyToHalf512(lo0));
      _mm512_store_si512(mn + 32, KeyToHalf512(lo1));
      _mm512_store_si512(mx, KeyToHalf512(hi0));
      _mm512_store_si512(mx + 32, KeyToHalf512(hi1));
      __m512 zero[4], divisor[4], rcp[4];
      for (size_t c = 0; c < 4; ++c) {
        // As EncodeKiviKeys: a zero min or max is +0.
        const auto lo =
            hn::Add(HalfToF32(df, hn::Load(d16, mn + 16 * c)), pos_zero);
        const auto hi =
            hn::Add(HalfToF32(df, hn::Load(d16, mx + 16 * c)), pos_zero);
        const auto zh = F32ToHalf(df, lo);
        const auto sh = F32ToHalf(df, hn::Div(hn::Sub(hi, lo), qmax));
        const size_t m = g * HD + j + 16 * c;
        hn::StoreU(hn::BitCast(d16b, zh), d16b, zeros + 2 * m);
        hn::StoreU(hn::BitCast(d16b, sh), d16b, scales + 2 * m);
        hn::Vec<decltype(df)> dv, rc;
        KiviDivisor(df, HalfToF32(df, sh), dv, rc);
        zero[c] = HalfToF32(df, zh).raw;
        divisor[c] = dv.raw;
        rcp[c] = rc.raw;
      }
      for (size_t t = 0; t < G; ++t) {
        const uint16_t* x = slice + t * HD + j;
        StoreKiviCodes64<kBits>(
            KiviQuotient16(x, zero[0], divisor[0], rcp[0]),
            KiviQuotient16(x + 16, zero[1], divisor[1], rcp[1]),
            KiviQuotient16(x + 32, zero[2], divisor[2], rcp[2]),
            KiviQuotient16(x + 48, zero[3], divisor[3], rcp[3]),
            codes + ((g * G + t) * HD + j) * kBits / 8);
      }
    }
  }
  // Keys of inf and NaN: see GroupMinMax512.
  if (s.non_finite != nullptr &&
      (_mm512_cmpgt_epu16_mask(_mm512_set1_epi16(0x0400), least) != 0 ||
       _mm512_cmpgt_epu16_mask(
           most, _mm512_set1_epi16(static_cast<short>(0xFBFF))) != 0)) {
    *s.non_finite = true;
  }
}
#endif  // KVCACHE_KIVI_AVX512

// Keys: groups of G tokens per channel. Metadata of token group g is the
// contiguous run [g*HD, g*HD + HD) (HD = H*D), like one token row.
template <uint32_t kBits, class DF>
void EncodeKiviKeys(DF df, const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t T = s.tokens, G = s.group, HD = size_t{s.heads} * s.dim;
#if KVCACHE_KIVI_AVX512
  if (hn::Lanes(df) == 16 && HD % 64 == 0) {
    return EncodeKiviKeys512<kBits>(s, in, out);
  }
#endif
  if (RejectNonFinite(s, in, s.elements())) return;
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
  Scratch& scratch = GetScratch();
  uint8_t* stage = Sized(scratch.stage, G * HD);  // codes of one token group
  NextSectionPrefetcher prefetch(s, T / G * (HD / N));
  for (size_t g = 0; g < T / G; ++g) {
    const uint16_t* slice = in + g * G * HD;
    for (size_t j = 0; j < HD; j += N) {
      prefetch.Step();
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
      hn::Vec<DF> divisor, rcp;
      KiviDivisor(df, HalfToF32(df, sh), divisor, rcp);
      for (size_t t = 0; t < G; ++t) {
        const auto x = HalfToF32(df, hn::LoadU(d16, slice + t * HD + j));
        hn::StoreU(
            hn::TruncateTo(d8, KiviCode(df, x, zero, divisor, rcp, qmax)), d8,
            stage + t * HD + j);
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
  const bool stream = MayStream(s, d16, out, HD);
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
        StoreDecoded(F32ToHalf(df, y), d16, stream, dst + j);
      }
    }
  }
}

// fp16 bits -> u16 keys ordered like the values (-0 just below +0).
template <class D16>
HWY_INLINE hn::Vec<D16> SortableKey(D16 d16, hn::Vec<D16> h) {
  const hn::RebindToSigned<D16> di16;
  const auto neg = hn::BitCast(d16, hn::ShiftRight<15>(hn::BitCast(di16, h)));
  return hn::Xor(h, hn::Or(neg, hn::Set(d16, 0x8000u)));
}
inline uint16_t KeyToHalf(uint16_t key) {
  return static_cast<uint16_t>((key & 0x8000u) ? key ^ 0x8000u : key ^ 0xFFFFu);
}
inline uint16_t HalfToKey(uint16_t h) {
  return static_cast<uint16_t>((h & 0x8000u) ? h ^ 0xFFFFu : h ^ 0x8000u);
}

// Smallest lane, folding to 128 bits first (where x86 has PHMINPOSUW).
template <class D16>
HWY_INLINE uint16_t MinLane(D16 d16, hn::Vec<D16> v) {
  if constexpr (hn::MaxLanes(D16()) > 8) {
    const hn::Half<D16> dh;
    return MinLane(dh, hn::Min(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  } else {
    return hn::GetLane(hn::MinOfLanes(d16, v));
  }
}

// Min and max fp16 of each of `count` groups of G consecutive values, as
// fp16 bits (exact: the extremes are input values). Integer compares on
// 16-bit keys: twice the lanes of fp32 and a one-instruction horizontal min.
template <class D16>
void GroupMinMax(D16 d16, const uint16_t* in, size_t G, size_t count,
                 uint16_t* mn, uint16_t* mx) {
  const size_t N16 = hn::Lanes(d16);
  for (size_t k = 0; k < count; ++k) {
    const uint16_t* src = in + k * G;
    auto lo = SortableKey(d16, hn::LoadU(d16, src));
    auto hi = lo;
    for (size_t j = N16; j < G; j += N16) {
      const auto key = SortableKey(d16, hn::LoadU(d16, src + j));
      lo = hn::Min(lo, key);
      hi = hn::Max(hi, key);
    }
    mn[k] = KeyToHalf(MinLane(d16, lo));
    mx[k] = KeyToHalf(static_cast<uint16_t>(~MinLane(d16, hn::Not(hi))));
  }
}

inline void GroupMinMaxScalar(const uint16_t* in, size_t G, size_t count,
                              uint16_t* mn, uint16_t* mx) {
  for (size_t k = 0; k < count; ++k) {
    uint16_t lo = 0xFFFF, hi = 0;
    for (size_t j = 0; j < G; ++j) {
      const uint16_t key = HalfToKey(in[k * G + j]);
      lo = std::min(lo, key);
      hi = std::max(hi, key);
    }
    mn[k] = KeyToHalf(lo);
    mx[k] = KeyToHalf(hi);
  }
}

// Values: groups of G consecutive channels; group k is elements
// [k*G, k*G + G) of the section. Per batch of groups: extremes, then zero
// points and scales vectorized across groups, then the codes.
template <uint32_t kBits, class DF>
void EncodeKiviValues(DF df, const Section& s, const uint16_t* in,
                      uint8_t* out) {
  const size_t G = s.group;
  const size_t groups = s.elements() / G;
  uint8_t* zeros = out;
  uint8_t* scales = out + 2 * groups;
  uint8_t* codes = out + 4 * groups;
  const hn::Rebind<uint16_t, DF> d16;
  const hn::Repartition<uint8_t, decltype(d16)> d16b;
  const hn::Rebind<uint8_t, DF> d8;
  const size_t N = hn::Lanes(df);
  const float qmax_f = static_cast<float>((1u << kBits) - 1u);
  const auto qmax = hn::Set(df, qmax_f);
  const auto pos_zero = hn::Zero(df);
  // Groups per batch: about 4096 values, a multiple of N groups.
  const size_t batch = std::max<size_t>(N, (4096 / G) / N * N);
  Scratch& scratch = GetScratch();
  uint8_t* stage = Sized(scratch.stage, batch * G);
  uint16_t* mn_h = Sized(scratch.u16, 2 * batch);
  uint16_t* mx_h = mn_h + batch;
  float* zf = Sized(scratch.f0, batch);
  float* sf = Sized(scratch.f1, batch);
  float* rf = Sized(scratch.f2, batch);
  const hn::ScalableTag<uint16_t> du16_full;
  const hn::CappedTag<uint16_t, 16> du16_16;
  const hn::CappedTag<uint16_t, 8> du16_8;
  NextSectionPrefetcher prefetch(s, groups);
  for (size_t k0 = 0; k0 < groups; k0 += batch) {
    const size_t count = std::min(groups - k0, batch);
    const uint16_t* src = in + k0 * G;
#if KVCACHE_KIVI_AVX512
    const bool direct = N == 16 && G % 32 == 0 && count % 16 == 0;
#else
    const bool direct = false;
#endif
    if (direct) {
#if KVCACHE_KIVI_AVX512
      if (GroupMinMax512(src, G, count, mn_h, mx_h) &&
          s.non_finite != nullptr) {
        *s.non_finite = true;
        return;
      }
#endif
    } else if (RejectNonFinite(s, src, count * G)) {
      return;
    } else if (G % hn::Lanes(du16_full) == 0) {
      GroupMinMax(du16_full, src, G, count, mn_h, mx_h);
    } else if (G % hn::Lanes(du16_16) == 0) {
      GroupMinMax(du16_16, src, G, count, mn_h, mx_h);
    } else if (G % hn::Lanes(du16_8) == 0) {
      GroupMinMax(du16_8, src, G, count, mn_h, mx_h);
    } else {
      GroupMinMaxScalar(src, G, count, mn_h, mx_h);
    }
    // zero = half(mn), scale = half((mx - mn) / (2^b - 1)); a zero min or
    // max is +0.
    size_t k = 0;
    for (; k + N <= count; k += N) {
      const auto lo =
          hn::Add(HalfToF32(df, hn::LoadU(d16, mn_h + k)), pos_zero);
      const auto hi =
          hn::Add(HalfToF32(df, hn::LoadU(d16, mx_h + k)), pos_zero);
      const auto zh = F32ToHalf(df, lo);
      const auto sh = F32ToHalf(df, hn::Div(hn::Sub(hi, lo), qmax));
      hn::StoreU(hn::BitCast(d16b, zh), d16b, zeros + 2 * (k0 + k));
      hn::StoreU(hn::BitCast(d16b, sh), d16b, scales + 2 * (k0 + k));
      hn::Vec<DF> divisor, rcp;
      KiviDivisor(df, HalfToF32(df, sh), divisor, rcp);
      hn::StoreU(HalfToF32(df, zh), df, zf + k);
      hn::StoreU(divisor, df, sf + k);
      hn::StoreU(rcp, df, rf + k);
    }
    // The last count % N groups: the same operations on one lane.
    const hn::CappedTag<float, 1> d1;
    const hn::Rebind<uint16_t, decltype(d1)> d1_16;
    for (; k < count; ++k) {
      const auto lo =
          hn::Add(HalfToF32(d1, hn::Set(d1_16, mn_h[k])), hn::Zero(d1));
      const auto hi =
          hn::Add(HalfToF32(d1, hn::Set(d1_16, mx_h[k])), hn::Zero(d1));
      const auto zh = F32ToHalf(d1, lo);
      const auto sh =
          F32ToHalf(d1, hn::Div(hn::Sub(hi, lo), hn::Set(d1, qmax_f)));
      StoreLe16(zeros + 2 * (k0 + k), hn::GetLane(zh));
      StoreLe16(scales + 2 * (k0 + k), hn::GetLane(sh));
      hn::Vec<decltype(d1)> divisor, rcp;
      KiviDivisor(d1, HalfToF32(d1, sh), divisor, rcp);
      zf[k] = hn::GetLane(HalfToF32(d1, zh));
      sf[k] = hn::GetLane(divisor);
      rf[k] = hn::GetLane(rcp);
    }
#if KVCACHE_KIVI_AVX512
    if (direct) {
      // 64 elements (four vectors, each inside one group as G % 16 == 0)
      // per step; group k covers [k*G, k*G + G).
      size_t group = 0, used = 0;
      __m512 q[4];
      for (size_t e = 0; e < count * G; e += 64) {
        for (size_t v = 0; v < 4; ++v) {
          q[v] = KiviQuotient16(src + e + 16 * v, _mm512_set1_ps(zf[group]),
                                _mm512_set1_ps(sf[group]),
                                _mm512_set1_ps(rf[group]));
          used += 16;
          if (used == G) {
            prefetch.Step();
            ++group;
            used = 0;
          }
        }
        StoreKiviCodes64<kBits>(q[0], q[1], q[2], q[3],
                                codes + (k0 * G + e) * kBits / 8);
      }
      continue;
    }
#endif
    for (k = 0; k < count; ++k) {
      prefetch.Step();
      const auto zero = hn::Set(df, zf[k]);
      const auto divisor = hn::Set(df, sf[k]);
      const auto rcp = hn::Set(df, rf[k]);
      const uint16_t* g = src + k * G;
      uint8_t* dst = stage + k * G;
      for (size_t j = 0; j < G; j += N) {
        const auto x = HalfToF32(df, hn::LoadU(d16, g + j));
        hn::StoreU(
            hn::TruncateTo(d8, KiviCode(df, x, zero, divisor, rcp, qmax)), d8,
            dst + j);
      }
    }
    PackCodes<kBits>(stage, count * G, codes + k0 * G * kBits / 8);
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
  const bool stream = MayStream(s, d16, out, G);
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
        StoreDecoded(F32ToHalf(df, y), d16, stream, dst + j);
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
  if (RejectNonFinite(s, in, s.elements())) return;
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

// ---- bf16 sources ----------------------------------------------------------

// bf16 sections (Section::dtype): x = float(bf16) is the bf16 bits shifted
// into the top half of an fp32 (exact); results round to bf16 with integer
// operations (Bf16FromFloat). Every division is a true IEEE division: bf16
// values span the whole fp32 range, subnormals included, outside the ranges
// DivideRn and the fp8 tables are proven for.

template <class DF>
HWY_INLINE hn::Vec<DF> Bf16ToF32(DF df, hn::Vec<hn::Rebind<uint16_t, DF>> b) {
  const hn::RebindToUnsigned<DF> du;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, b)));
}

// Bf16FromFloat for every lane, NaN included.
template <class DF>
HWY_INLINE hn::Vec<hn::Rebind<uint16_t, DF>> F32ToBf16(DF df, hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto x = hn::BitCast(du, v);
  const auto odd = hn::And(hn::ShiftRight<16>(x), hn::Set(du, 1u));
  const auto rounded =
      hn::ShiftRight<16>(hn::Add(hn::Add(x, hn::Set(du, 0x7FFFu)), odd));
  const auto quiet = hn::Or(hn::ShiftRight<16>(x), hn::Set(du, 0x40u));
  const auto ax = hn::BitCast(di, hn::And(x, hn::Set(du, 0x7FFFFFFFu)));
  const auto is_nan = hn::RebindMask(du, hn::Gt(ax, hn::Set(di, 0x7F800000)));
  return hn::TruncateTo(hn::Rebind<uint16_t, DF>(),
                        hn::IfThenElse(is_nan, quiet, rounded));
}

template <Codec kCodec>
void EncodeFp8Bf16(const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  Scratch& scratch = GetScratch();
  float* scale = Sized(scratch.f0, H);
  uint8_t* codes = out;
  if (s.static_scales == nullptr) {
    // The largest (bits & 0x7FFF) of finite bf16 values is the largest |x|.
    uint16_t* amax_bits = Sized(scratch.u16, H);
    if (s.head_abs_max != nullptr) {
      std::copy(s.head_abs_max, s.head_abs_max + H, amax_bits);
    } else {
      SectionHeadAbsMax(s, in, amax_bits);
    }
    for (size_t h = 0; h < H; ++h) {
      const float amax = Bf16ToFloat(amax_bits[h]);
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
  const hn::RebindToUnsigned<decltype(df)> du;
  const size_t N = hn::Lanes(df);
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      const size_t base = (t * H + h) * D;
      const auto vsc = hn::Set(df, scale[h]);
      size_t j = 0;
      for (; j + N <= D; j += N) {
        // code = fp8_rne_satfinite(x / scale); the quotient's sign is x's.
        const auto x = Bf16ToF32(df, hn::LoadU(d16, in + base + j));
        const auto c = Fp8Encode<kCodec>(df, hn::Div(x, vsc), x);
        hn::StoreU(hn::TruncateTo(d8, hn::BitCast(du, c)), d8,
                   codes + base + j);
      }
      for (; j < D; ++j) {
        codes[base + j] =
            Fp8Scalar<kCodec>(Bf16ToFloat(in[base + j]) / scale[h]);
      }
    }
  }
}

template <Codec kCodec>
void DecodeFp8Bf16(const Section& s, const uint8_t* in, uint16_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  Scratch& scratch = GetScratch();
  float* scale = Sized(scratch.f0, H);
  const uint8_t* codes = Fp8SectionScales(s, in, scale);
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  constexpr bool kE4M3 = kCodec == Codec::kFp8E4M3;
  const bool stream = MayStream(s, d16, out, D);
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      const size_t base = (t * H + h) * D;
      // x' = bf16_rne(float(code) * scale)
      size_t j = DecodeFp8RowVectors<kE4M3>(
          df, codes + base, D, scale[h],
          [&](size_t k, hn::Vec<decltype(df)> v) {
            StoreDecoded(F32ToBf16(df, v), d16, stream, out + base + k);
          });
      for (; j < D; ++j) {
        out[base + j] =
            Bf16FromFloat(Fp8ScalarToFloat<kCodec>(codes[base + j]) * scale[h]);
      }
    }
  }
}

// Per KIVI group of a bf16 section: mn and mx, in metadata order. Keys:
// group (g, hd) over tokens [g*G, g*G + G), vectors across hd. Values: G
// consecutive elements, vectors within the group when G is a multiple of
// the lane count.
void KiviBf16MinMax(const Section& s, const uint16_t* in, float* mn,
                    float* mx) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const size_t N = hn::Lanes(df);
  const size_t G = s.group, n = s.elements();
  if (s.is_key) {
    const size_t HD = size_t{s.heads} * s.dim;
    for (size_t g = 0; g < s.tokens / G; ++g) {
      const uint16_t* rows = in + g * G * HD;
      size_t j = 0;
      for (; j + N <= HD; j += N) {
        auto lo = Bf16ToF32(df, hn::LoadU(d16, rows + j));
        auto hi = lo;
        for (size_t t = 1; t < G; ++t) {
          const auto x = Bf16ToF32(df, hn::LoadU(d16, rows + t * HD + j));
          lo = hn::Min(lo, x);
          hi = hn::Max(hi, x);
        }
        hn::StoreU(lo, df, mn + g * HD + j);
        hn::StoreU(hi, df, mx + g * HD + j);
      }
      for (; j < HD; ++j) {
        float lo = INFINITY, hi = -INFINITY;
        for (size_t t = 0; t < G; ++t) {
          const float x = Bf16ToFloat(rows[t * HD + j]);
          lo = std::min(lo, x);
          hi = std::max(hi, x);
        }
        mn[g * HD + j] = lo;
        mx[g * HD + j] = hi;
      }
    }
    return;
  }
  for (size_t g = 0; g < n / G; ++g) {
    const uint16_t* x = in + g * G;
    if (G % N == 0) {
      auto lo = Bf16ToF32(df, hn::LoadU(d16, x));
      auto hi = lo;
      for (size_t j = N; j < G; j += N) {
        const auto v = Bf16ToF32(df, hn::LoadU(d16, x + j));
        lo = hn::Min(lo, v);
        hi = hn::Max(hi, v);
      }
      mn[g] = hn::GetLane(hn::MinOfLanes(df, lo));
      mx[g] = hn::GetLane(hn::MaxOfLanes(df, hi));
      continue;
    }
    float lo = INFINITY, hi = -INFINITY;
    for (size_t j = 0; j < G; ++j) {
      lo = std::min(lo, Bf16ToFloat(x[j]));
      hi = std::max(hi, Bf16ToFloat(x[j]));
    }
    mn[g] = lo;
    mx[g] = hi;
  }
}

// code = clamp(rint((x - zero) / scale), 0, qmax), 0 where scale == 0, in
// the low byte of each 32-bit lane (see KiviCode: x >= zero, so the quotient
// is >= 0 or -0; adding 2^23 rounds it to nearest even).
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> KiviCodeBf16(DF df, hn::Vec<DF> x,
                                                          hn::Vec<DF> zero,
                                                          hn::Vec<DF> scale,
                                                          hn::Vec<DF> qmax) {
  auto q = hn::Div(hn::Sub(x, zero), scale);
  q = hn::Min(hn::IfThenZeroElse(hn::Eq(scale, hn::Zero(df)), q), qmax);
  return hn::BitCast(hn::RebindToUnsigned<DF>(),
                     hn::Add(q, hn::Set(df, 0x1p23f)));
}

inline uint8_t KiviCodeBf16Scalar(float x, float zero, float scale,
                                  float qmax) {
  if (scale == 0.0f) return 0;
  const float q = std::nearbyint((x - zero) / scale);
  return static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
}

// Packs n codes (one per byte) little end first.
template <uint32_t kBits>
void PackAllCodes(const uint8_t* codes, size_t n, uint8_t* out) {
  constexpr size_t kPerByte = 8 / kBits;
  const size_t whole = n / kPerByte * kPerByte;
  PackCodes<kBits>(codes, whole, out);
  if (whole < n) {
    uint8_t last = 0;
    for (size_t i = whole; i < n; ++i) {
      last |= static_cast<uint8_t>(codes[i] << ((i - whole) * kBits));
    }
    out[whole / kPerByte] = last;
  }
}

// Codes of a bf16 section in element order, from the per-group zero and
// scale (as floats, exact bf16 values) in metadata order.
template <uint32_t kBits>
void KiviBf16Codes(const Section& s, const uint16_t* in, const float* zero,
                   const float* scale, uint8_t* codes) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  const size_t G = s.group, n = s.elements();
  const float qmax = static_cast<float>((1u << kBits) - 1u);
  const auto vqmax = hn::Set(df, qmax);
  if (s.is_key) {
    const size_t HD = size_t{s.heads} * s.dim;
    for (size_t t = 0; t < s.tokens; ++t) {
      const uint16_t* row = in + t * HD;
      const float* z = zero + (t / G) * HD;
      const float* sc = scale + (t / G) * HD;
      uint8_t* c = codes + t * HD;
      size_t j = 0;
      for (; j + N <= HD; j += N) {
        const auto code =
            KiviCodeBf16(df, Bf16ToF32(df, hn::LoadU(d16, row + j)),
                         hn::LoadU(df, z + j), hn::LoadU(df, sc + j), vqmax);
        hn::StoreU(hn::TruncateTo(d8, code), d8, c + j);
      }
      for (; j < HD; ++j) {
        c[j] = KiviCodeBf16Scalar(Bf16ToFloat(row[j]), z[j], sc[j], qmax);
      }
    }
    return;
  }
  for (size_t g = 0; g < n / G; ++g) {
    const size_t b = g * G;
    size_t j = 0;
    if (G % N == 0) {
      const auto z = hn::Set(df, zero[g]), sc = hn::Set(df, scale[g]);
      for (; j < G; j += N) {
        const auto x = Bf16ToF32(df, hn::LoadU(d16, in + b + j));
        hn::StoreU(hn::TruncateTo(d8, KiviCodeBf16(df, x, z, sc, vqmax)), d8,
                   codes + b + j);
      }
    }
    for (; j < G; ++j) {
      codes[b + j] =
          KiviCodeBf16Scalar(Bf16ToFloat(in[b + j]), zero[g], scale[g], qmax);
    }
  }
}

template <uint32_t kBits>
void EncodeKiviBf16(const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t n = s.elements();
  if (RejectNonFinite(s, in, n)) return;
  const size_t groups = n / s.group;
  Scratch& scratch = GetScratch();
  float* mn = Sized(scratch.f1, groups);
  float* mx = Sized(scratch.f2, groups);
  KiviBf16MinMax(s, in, mn, mx);
  // zero = bf16(mn), scale = bf16((mx - mn) / qmax); a zero min or max is +0
  // (x + 0 maps -0 to +0). mn and mx are overwritten with the stored values.
  const float qmax = static_cast<float>((1u << kBits) - 1u);
  for (size_t g = 0; g < groups; ++g) {
    const float lo = mn[g] + 0.0f, hi = mx[g] + 0.0f;
    const uint16_t z = Bf16FromFloat(lo);
    const uint16_t sc = Bf16FromFloat((hi - lo) / qmax);
    StoreLe16(out + 2 * g, z);
    StoreLe16(out + 2 * groups + 2 * g, sc);
    mn[g] = Bf16ToFloat(z);
    mx[g] = Bf16ToFloat(sc);
  }
  uint8_t* codes = Sized(scratch.stage, n);
  KiviBf16Codes<kBits>(s, in, mn, mx, codes);
  PackAllCodes<kBits>(codes, n, out + 4 * groups);
}

template <uint32_t kBits>
void DecodeKiviBf16(const Section& s, const uint8_t* in, uint16_t* out) {
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  const size_t n = s.elements(), G = s.group, groups = n / G;
  Scratch& scratch = GetScratch();
  float* zero = Sized(scratch.f1, groups);
  float* scale = Sized(scratch.f2, groups);
  for (size_t g = 0; g < groups; ++g) {
    zero[g] = Bf16ToFloat(LoadLe16(in + 2 * g));
    scale[g] = Bf16ToFloat(LoadLe16(in + 2 * groups + 2 * g));
  }
  uint8_t* codes = Sized(scratch.stage, n);
  const uint8_t* packed = in + 4 * groups;
  constexpr size_t kPerByte = 8 / kBits;
  const size_t whole = n / kPerByte * kPerByte;
  UnpackCodes<kBits>(packed, whole, codes);
  for (size_t i = whole; i < n; ++i) {
    codes[i] = (packed[i / kPerByte] >> ((i % kPerByte) * kBits)) &
               ((1u << kBits) - 1u);
  }
  // x' = bf16_rne(float(code) * scale + zero): multiply, round, add, round.
  const auto value = [&](const uint8_t* c, auto z, auto sc) {
    const auto code =
        hn::ConvertTo(df, hn::BitCast(di, hn::PromoteTo(du, hn::LoadU(d8, c))));
    return F32ToBf16(df, hn::Add(hn::Mul(code, sc), z));
  };
  const auto scalar = [](uint8_t c, float z, float sc) {
    return Bf16FromFloat(static_cast<float>(c) * sc + z);
  };
  if (s.is_key) {
    const size_t HD = size_t{s.heads} * s.dim;
    const bool stream = MayStream(s, d16, out, HD);
    for (size_t t = 0; t < s.tokens; ++t) {
      const size_t m = (t / G) * HD, b = t * HD;
      size_t j = 0;
      for (; j + N <= HD; j += N) {
        StoreDecoded(value(codes + b + j, hn::LoadU(df, zero + m + j),
                           hn::LoadU(df, scale + m + j)),
                     d16, stream, out + b + j);
      }
      for (; j < HD; ++j) {
        out[b + j] = scalar(codes[b + j], zero[m + j], scale[m + j]);
      }
    }
    return;
  }
  const bool stream = MayStream(s, d16, out, G);
  for (size_t g = 0; g < groups; ++g) {
    const size_t b = g * G;
    size_t j = 0;
    if (G % N == 0) {
      const auto z = hn::Set(df, zero[g]), sc = hn::Set(df, scale[g]);
      for (; j < G; j += N) {
        StoreDecoded(value(codes + b + j, z, sc), d16, stream, out + b + j);
      }
    }
    for (; j < G; ++j) out[b + j] = scalar(codes[b + j], zero[g], scale[g]);
  }
}

#endif  // HWY_TARGET != HWY_SCALAR

// ---- entry points --------------------------------------------------------

void EncodeSectionImpl(const Section& s, const uint16_t* in, uint8_t* out) {
#if HWY_TARGET == HWY_SCALAR
  if (s.non_finite != nullptr &&
      FindRejectedReference(in, s.elements(), RejectBound(s.dtype)) !=
          s.elements()) {
    *s.non_finite = true;
    return;
  }
  EncodeSectionReference(s, in, out);
#else
  if (IsBf16(s)) {
    switch (s.codec) {
      case Codec::kNone:
        return CopyFp16(s, in, out);
      case Codec::kFp8E4M3:
        return EncodeFp8Bf16<Codec::kFp8E4M3>(s, in, out);
      case Codec::kFp8E5M2:
        return EncodeFp8Bf16<Codec::kFp8E5M2>(s, in, out);
      case Codec::kKivi2:
        return EncodeKiviBf16<2>(s, in, out);
      case Codec::kKivi4:
        return EncodeKiviBf16<4>(s, in, out);
    }
  }
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
  if (IsBf16(s)) {
    switch (s.codec) {
      case Codec::kNone:
        return CopyFp16Back(s, in, out);
      case Codec::kFp8E4M3:
        return DecodeFp8Bf16<Codec::kFp8E4M3>(s, in, out);
      case Codec::kFp8E5M2:
        return DecodeFp8Bf16<Codec::kFp8E5M2>(s, in, out);
      case Codec::kKivi2:
        return DecodeKiviBf16<2>(s, in, out);
      case Codec::kKivi4:
        return DecodeKiviBf16<4>(s, in, out);
    }
  }
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

void HeadAbsMaxImpl(const Section& s, const uint16_t* in, uint16_t* head_max) {
#if HWY_TARGET == HWY_SCALAR
  for (size_t h = 0; h < s.heads; ++h) head_max[h] = 0;
  for (size_t i = 0; i < s.elements(); ++i) {
    const size_t h = (i / s.dim) % s.heads;
    head_max[h] = std::max<uint16_t>(head_max[h], in[i] & 0x7FFFu);
  }
#else
  SectionHeadAbsMax(s, in, head_max);
#endif
}

size_t FindRejectedSimdImpl(const uint16_t* in, size_t n, uint16_t bound) {
#if HWY_TARGET == HWY_SCALAR
  return FindRejectedReference(in, n, bound);
#else
  return FindRejectedImpl(in, n, bound);
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
HWY_EXPORT(FindRejectedSimdImpl);
HWY_EXPORT(HeadAbsMaxImpl);
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

size_t FindRejectedSimd(const uint16_t* in, size_t n, uint16_t bound) {
  return HWY_DYNAMIC_DISPATCH(FindRejectedSimdImpl)(in, n, bound);
}

size_t FindNonFiniteHalfSimd(const uint16_t* in, size_t n) {
  return FindRejectedSimd(in, n, 0x7C00u);
}

void HeadAbsMaxSimd(const Section& s, const uint16_t* in, uint16_t* head_max) {
  HWY_DYNAMIC_DISPATCH(HeadAbsMaxImpl)(s, in, head_max);
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
