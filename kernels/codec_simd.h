// Internal to kernels/: the Highway SIMD section codecs (runtime dispatch to
// the best instruction set of the CPU: AVX-512, AVX2, SSE4, SSSE3 or the
// portable 128-bit emulation). Bit-identical to the scalar reference.
#ifndef KVCACHE_KERNELS_CODEC_SIMD_H_
#define KVCACHE_KERNELS_CODEC_SIMD_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/codec_internal.h"

namespace kvcache::kernels::internal {

void EncodeSectionSimd(const Section& s, const uint16_t* in, uint8_t* out);
void DecodeSectionSimd(const Section& s, const uint8_t* in, uint16_t* out);
// Index of the first non-finite fp16 value in in[0, n), n when none is.
size_t FindNonFiniteHalfSimd(const uint16_t* in, size_t n);
// Index of the first value in in[0, n) with (bits & 0x7FFF) >= bound, n when
// none is (FindRejectedReference).
size_t FindRejectedSimd(const uint16_t* in, size_t n, uint16_t bound);
// Per kv head of a section, max over its values of (bits & 0x7FFF): the
// |x| maximum as source bits (fp16 or bf16: the same integer maximum), >=
// RejectBound(s.dtype) when the head holds rejected input. One pass that
// serves as both the non-finite check and the fp8 dynamic amax.
void HeadAbsMaxSimd(const Section& s, const uint16_t* in, uint16_t* head_max);

// For tests: how many (dividend, divisor) pairs the SIMD division of the
// active target gets wrong, bit for bit, against IEEE fp32 division.
uint64_t DivisionMismatches(const float* dividends, size_t num_dividends,
                            const float* divisors, size_t num_divisors);

// For tests and benchmarks: the Highway targets compiled into this library
// that this CPU supports (best first), the name of a target, the target the
// dispatcher uses now, and a way to force one target (0 restores the
// default). Forcing is process-wide and not thread-safe.
std::vector<int64_t> SimdTargets();
std::string SimdTargetName(int64_t target);
std::string ActiveSimdTarget();
void ForceSimdTargetForTest(int64_t target);

}  // namespace kvcache::kernels::internal

#endif  // KVCACHE_KERNELS_CODEC_SIMD_H_
