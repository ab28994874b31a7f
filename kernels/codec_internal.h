// Internal to kernels/: one (layer, tensor) section of a block, and the
// per-section encoders of each implementation. See codec.h for the layouts.
#ifndef KVCACHE_KERNELS_CODEC_INTERNAL_H_
#define KVCACHE_KERNELS_CODEC_INTERNAL_H_

#include <cstddef>
#include <cstdint>

#include "kernels/codec.h"
#include "kernels/half.h"

namespace kvcache::kernels::internal {

struct Section {
  Codec codec = Codec::kNone;  // kNone: the section is kept as written
  SourceDtype dtype = SourceDtype::kFp16;  // of the input / decoded output
  bool is_key = true;                      // K (true) or V (false)
  uint32_t tokens = 0;                     // T
  uint32_t heads = 0;                      // H
  uint32_t dim = 0;                        // D
  uint32_t group = 32;                     // KIVI group size G
  // fp8: nullptr for dynamic scales (stored in the section), otherwise
  // `heads` static scales, one per kv head.
  const float* static_scales = nullptr;
  // fp8 dynamic scales, optional (SIMD path): per head, the largest
  // (bits & 0x7FFF) of the section's values, already computed by the caller.
  // The reference ignores it.
  const uint16_t* head_abs_max = nullptr;
  // Optional (SIMD path): the input of the section encoded next, which the
  // encoder prefetches while it computes, so that the next section's first
  // pass reads from cache instead of waiting on memory.
  const uint16_t* next_input = nullptr;
  size_t next_elements = 0;
  // KIVI only, optional (SIMD path): when set, the encoder looks for inf and
  // NaN itself (the AVX-512 path as part of finding group extremes) and sets
  // *non_finite to true if the section holds any; the output is then not a
  // valid encoding. When null, the caller has checked the input.
  bool* non_finite = nullptr;
  // Decode only, optional (SIMD path): store the output with non-temporal
  // stores where it is aligned to full vectors (DecodeStores::kStreaming);
  // the caller fences. The reference ignores it.
  bool stream_output = false;

  size_t elements() const { return static_cast<size_t>(tokens) * heads * dim; }
};

inline bool IsFp8(Codec c) {
  return c == Codec::kFp8E4M3 || c == Codec::kFp8E5M2;
}
inline bool IsKivi(Codec c) { return c == Codec::kKivi2 || c == Codec::kKivi4; }
inline uint32_t KiviBits(Codec c) { return c == Codec::kKivi2 ? 2 : 4; }
inline float Fp8Max(Codec c) {
  return c == Codec::kFp8E4M3 ? 448.0f : 57344.0f;
}

// Encoded size of one section.
size_t SectionBytes(const Section& s);

// Scalar reference. `in` holds s.elements() fp16 values, `out` holds
// SectionBytes(s) bytes. The input is finite (checked by the caller).
void EncodeSectionReference(const Section& s, const uint16_t* in, uint8_t* out);
void DecodeSectionReference(const Section& s, const uint8_t* in, uint16_t* out);

inline bool IsBf16(const Section& s) { return s.dtype == SourceDtype::kBf16; }

// Exact source value -> fp32, and fp32 -> source rounded to nearest even.
inline float SourceToFloat(SourceDtype d, uint16_t v) {
  return d == SourceDtype::kBf16 ? Bf16ToFloat(v) : HalfToFloat(v);
}
inline uint16_t SourceFromFloat(SourceDtype d, float f) {
  return d == SourceDtype::kBf16 ? Bf16FromFloat(f) : HalfFromFloat(f);
}

// The input a codec rejects, as a bound on (bits & 0x7FFF): a value is
// rejected when its magnitude bits are >= the bound. fp16: inf and NaN
// (0x7C00). bf16: inf, NaN and finite values of magnitude >= 2^126 (0x7E80),
// which keep KIVI's range (mx - mn) and its decode finite (docs/codecs.md).
inline uint16_t RejectBound(SourceDtype d) {
  return d == SourceDtype::kBf16 ? 0x7E80u : 0x7C00u;
}

// Index of the first value in in[0, n) with (bits & 0x7FFF) >= bound, n when
// none is.
inline size_t FindRejectedReference(const uint16_t* in, size_t n,
                                    uint16_t bound) {
  for (size_t i = 0; i < n; ++i) {
    if ((in[i] & 0x7FFFu) >= bound) return i;
  }
  return n;
}

// Index of the first non-finite fp16 value in in[0, n), n when none is.
inline size_t FindNonFiniteHalfReference(const uint16_t* in, size_t n) {
  return FindRejectedReference(in, n, 0x7C00u);
}

// Little-endian loads and stores of metadata.
inline void StoreLe16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
inline uint16_t LoadLe16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
inline void StoreLe32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline uint32_t LoadLe32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

}  // namespace kvcache::kernels::internal

#endif  // KVCACHE_KERNELS_CODEC_INTERNAL_H_
