// The scalar reference codecs: docs/codecs.md written out for clarity. The
// source values are fp16 or bf16 (Section::dtype): x = float(source) is exact
// either way, and every result stored or returned as a 16-bit value is
// rounded to nearest even into the source dtype.
// Compiled with -ffp-contract=off: every multiply, add and divide below is a
// separately rounded IEEE fp32 operation (round to nearest even).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/codec_internal.h"
#include "kernels/fp8.h"
#include "kernels/half.h"

namespace kvcache::kernels::internal {
namespace {

size_t KiviCodeBytes(const Section& s) {
  return (s.elements() * KiviBits(s.codec) + 7) / 8;
}

size_t KiviGroups(const Section& s) { return s.elements() / s.group; }

uint8_t Fp8FromFloat(Codec c, float f) {
  return c == Codec::kFp8E4M3 ? Fp8E4M3FromFloat(f) : Fp8E5M2FromFloat(f);
}

float Fp8ToFloat(Codec c, uint8_t code) {
  return c == Codec::kFp8E4M3 ? Fp8E4M3ToFloat(code) : Fp8E5M2ToFloat(code);
}

// Metadata index of the KIVI group holding element (t, h, d).
size_t KiviGroupIndex(const Section& s, size_t t, size_t h, size_t d) {
  if (s.is_key) return ((t / s.group) * s.heads + h) * s.dim + d;
  return (t * s.heads + h) * (s.dim / s.group) + d / s.group;
}

// ---- kept as written (fp16 or bf16) ------------------------------------

void EncodeFp16(const Section& s, const uint16_t* in, uint8_t* out) {
  for (size_t i = 0; i < s.elements(); ++i) StoreLe16(out + 2 * i, in[i]);
}

void DecodeFp16(const Section& s, const uint8_t* in, uint16_t* out) {
  for (size_t i = 0; i < s.elements(); ++i) out[i] = LoadLe16(in + 2 * i);
}

// ---- FP8 -----------------------------------------------------------------

void EncodeFp8(const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  std::vector<float> scale(H);
  uint8_t* codes = out;
  if (s.static_scales == nullptr) {
    // Dynamic: scale = amax / fp8_max over the head's T x D values, 1 where
    // amax is 0. Stored first, as H little-endian fp32 values.
    for (size_t h = 0; h < H; ++h) {
      float amax = 0.0f;
      for (size_t t = 0; t < T; ++t) {
        for (size_t d = 0; d < D; ++d) {
          amax = std::max(
              amax, std::fabs(SourceToFloat(s.dtype, in[(t * H + h) * D + d])));
        }
      }
      scale[h] = amax == 0.0f ? 1.0f : amax / Fp8Max(s.codec);
      StoreLe32(out + 4 * h, FloatBits(scale[h]));
    }
    codes = out + 4 * H;
  } else {
    for (size_t h = 0; h < H; ++h) scale[h] = s.static_scales[h];
  }
  // code = fp8_rne_satfinite(float(x) / scale)
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      for (size_t d = 0; d < D; ++d) {
        const size_t i = (t * H + h) * D + d;
        codes[i] =
            Fp8FromFloat(s.codec, SourceToFloat(s.dtype, in[i]) / scale[h]);
      }
    }
  }
}

void DecodeFp8(const Section& s, const uint8_t* in, uint16_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  std::vector<float> scale(H);
  const uint8_t* codes = in;
  if (s.static_scales == nullptr) {
    for (size_t h = 0; h < H; ++h) {
      scale[h] = FloatFromBits(LoadLe32(in + 4 * h));
    }
    codes = in + 4 * H;
  } else {
    for (size_t h = 0; h < H; ++h) scale[h] = s.static_scales[h];
  }
  // x' = src_rne(float(code) * scale)
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      for (size_t d = 0; d < D; ++d) {
        const size_t i = (t * H + h) * D + d;
        out[i] =
            SourceFromFloat(s.dtype, Fp8ToFloat(s.codec, codes[i]) * scale[h]);
      }
    }
  }
}

// ---- KIVI ----------------------------------------------------------------

void EncodeKivi(const Section& s, const uint16_t* in, uint8_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  const uint32_t bits = KiviBits(s.codec);
  const float qmax = static_cast<float>((1u << bits) - 1u);
  const size_t groups = KiviGroups(s);
  uint8_t* zeros = out;
  uint8_t* scales = out + 2 * groups;
  uint8_t* codes = out + 4 * groups;

  // Per group: mn = min(x), mx = max(x).
  std::vector<float> mn(groups, INFINITY), mx(groups, -INFINITY);
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      for (size_t d = 0; d < D; ++d) {
        const size_t g = KiviGroupIndex(s, t, h, d);
        const float x = SourceToFloat(s.dtype, in[(t * H + h) * D + d]);
        mn[g] = std::min(mn[g], x);
        mx[g] = std::max(mx[g], x);
      }
    }
  }
  // zero = src(mn), scale = src((mx - mn) / (2^b - 1)), src the source dtype. A
  // zero min or max is +0 whatever the signs of the zeros in the group (x +
  // 0.0f maps -0 to +0 and leaves every other value alone).
  std::vector<uint16_t> zero_h(groups), scale_h(groups);
  for (size_t g = 0; g < groups; ++g) {
    const float lo = mn[g] + 0.0f;
    const float hi = mx[g] + 0.0f;
    zero_h[g] = SourceFromFloat(s.dtype, lo);
    scale_h[g] = SourceFromFloat(s.dtype, (hi - lo) / qmax);
    StoreLe16(zeros + 2 * g, zero_h[g]);
    StoreLe16(scales + 2 * g, scale_h[g]);
  }
  // code = clamp(rint((x - zero) / scale), 0, 2^b - 1) from the stored
  // zero and scale; 0 where scale == 0. Packed little end first.
  std::memset(codes, 0, KiviCodeBytes(s));
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      for (size_t d = 0; d < D; ++d) {
        const size_t i = (t * H + h) * D + d;
        const size_t g = KiviGroupIndex(s, t, h, d);
        const float zero = SourceToFloat(s.dtype, zero_h[g]);
        const float scale = SourceToFloat(s.dtype, scale_h[g]);
        uint32_t code = 0;
        if (scale != 0.0f) {
          const float q =
              std::nearbyint((SourceToFloat(s.dtype, in[i]) - zero) / scale);
          code = static_cast<uint32_t>(std::clamp(q, 0.0f, qmax));
        }
        const size_t bit = i * bits;
        codes[bit / 8] |= static_cast<uint8_t>(code << (bit % 8));
      }
    }
  }
}

void DecodeKivi(const Section& s, const uint8_t* in, uint16_t* out) {
  const size_t T = s.tokens, H = s.heads, D = s.dim;
  const uint32_t bits = KiviBits(s.codec);
  const uint32_t mask = (1u << bits) - 1u;
  const size_t groups = KiviGroups(s);
  const uint8_t* zeros = in;
  const uint8_t* scales = in + 2 * groups;
  const uint8_t* codes = in + 4 * groups;
  // x' = src_rne(float(code) * scale + zero): multiply, round, add, round.
  for (size_t t = 0; t < T; ++t) {
    for (size_t h = 0; h < H; ++h) {
      for (size_t d = 0; d < D; ++d) {
        const size_t i = (t * H + h) * D + d;
        const size_t g = KiviGroupIndex(s, t, h, d);
        const float zero = SourceToFloat(s.dtype, LoadLe16(zeros + 2 * g));
        const float scale = SourceToFloat(s.dtype, LoadLe16(scales + 2 * g));
        const size_t bit = i * bits;
        const uint32_t code = (codes[bit / 8] >> (bit % 8)) & mask;
        const float product = static_cast<float>(code) * scale;
        const float sum = product + zero;
        out[i] = SourceFromFloat(s.dtype, sum);
      }
    }
  }
}

}  // namespace

size_t SectionBytes(const Section& s) {
  const size_t n = s.elements();
  switch (s.codec) {
    case Codec::kNone:
      return 2 * n;
    case Codec::kFp8E4M3:
    case Codec::kFp8E5M2:
      return n + (s.static_scales == nullptr ? 4 * size_t{s.heads} : 0);
    case Codec::kKivi2:
    case Codec::kKivi4:
      return 4 * KiviGroups(s) + KiviCodeBytes(s);
  }
  return 0;  // unreachable for a validated codec
}

void EncodeSectionReference(const Section& s, const uint16_t* in,
                            uint8_t* out) {
  switch (s.codec) {
    case Codec::kNone:
      return EncodeFp16(s, in, out);
    case Codec::kFp8E4M3:
    case Codec::kFp8E5M2:
      return EncodeFp8(s, in, out);
    case Codec::kKivi2:
    case Codec::kKivi4:
      return EncodeKivi(s, in, out);
  }
}

void DecodeSectionReference(const Section& s, const uint8_t* in,
                            uint16_t* out) {
  switch (s.codec) {
    case Codec::kNone:
      return DecodeFp16(s, in, out);
    case Codec::kFp8E4M3:
    case Codec::kFp8E5M2:
      return DecodeFp8(s, in, out);
    case Codec::kKivi2:
    case Codec::kKivi4:
      return DecodeKivi(s, in, out);
  }
}

}  // namespace kvcache::kernels::internal
