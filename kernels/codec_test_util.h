// Test data shared by the codec tests (CPU SIMD and CUDA): shapes, policies
// and input generators (fp16 and bf16) that reach the edge cases of
// docs/codecs.md.
#ifndef KVCACHE_KERNELS_CODEC_TEST_UTIL_H_
#define KVCACHE_KERNELS_CODEC_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/codec.h"
#include "kernels/half.h"

namespace kvcache::kernels::testutil {

struct ShapeCase {
  BlockShape shape;
  uint32_t group;
};

// Typical shapes, shapes whose rows leave vector tails, and shapes no vector
// width fits (the SIMD path must fall back, still bit-exact).
inline const std::vector<ShapeCase>& Shapes() {
  static const std::vector<ShapeCase> kShapes = {
      {{2, 8, 128, 32}, 32},  {{1, 1, 64, 32}, 32}, {{2, 3, 96, 64}, 32},
      {{1, 2, 20, 8}, 4},     {{1, 1, 6, 6}, 2},    {{1, 5, 48, 16}, 16},
      {{3, 2, 256, 128}, 64}, {{1, 1, 3, 3}, 1},    {{1, 4, 128, 256}, 128},
      {{1, 3, 24, 8}, 8},
  };
  return kShapes;
}

enum class Data {
  kGaussian,
  kTiny,        // subnormal-heavy
  kHuge,        // near the fp16 maximum
  kSpecials,    // zeros, subnormals, limits, fp8 limits
  kRandomBits,  // every finite fp16 bit pattern is possible
  kConstant,    // constant groups with a few outliers
  kSparse,      // mostly signed zeros, single outliers
};
inline std::vector<Data> AllData() {
  return {Data::kGaussian,   Data::kTiny,     Data::kHuge,  Data::kSpecials,
          Data::kRandomBits, Data::kConstant, Data::kSparse};
}

inline std::vector<uint16_t> MakeData(const BlockShape& shape, Data kind,
                                      uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> v(Fp16BlockBytes(shape) / 2);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFF);
  static const uint16_t kSpecialValues[] = {
      0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x8400,
      0x7BFF, 0xFBFF, 0x5F00, 0xDF00, 0x5F01, 0xDF01, 0x7B00, 0xFB00,
      0x7B01, 0x3C00, 0xBC00, 0x3555, 0x1400, 0x0200, 0x7A00, 0xFA00};
  const float constant = gauss(rng);
  for (auto& x : v) {
    switch (kind) {
      case Data::kGaussian:
        x = HalfFromFloat(gauss(rng));
        break;
      case Data::kTiny:
        x = HalfFromFloat(gauss(rng) * 1e-6f);
        break;
      case Data::kHuge:
        x = HalfFromFloat(
            std::clamp(gauss(rng) * 30000.0f, -65504.0f, 65504.0f));
        break;
      case Data::kSpecials:
        x = kSpecialValues[bits(rng) % (sizeof(kSpecialValues) / 2)];
        break;
      case Data::kRandomBits:
        do {
          x = static_cast<uint16_t>(bits(rng));
        } while (HalfIsNonFinite(x));
        break;
      case Data::kConstant:
        x = HalfFromFloat(bits(rng) % 97 == 0 ? gauss(rng) * 50 : constant);
        break;
      case Data::kSparse:
        x = bits(rng) % 61 == 0 ? HalfFromFloat(gauss(rng) * 1000)
                                : static_cast<uint16_t>((bits(rng) & 1) << 15);
        break;
    }
  }
  return v;
}

// The bf16 counterpart of Data, for blocks with source_dtype bf16.
enum class Bf16Data {
  kGaussian,
  kTiny,        // bf16 subnormals and the smallest normals
  kHuge,        // up to just below 2^126, both signs in a group
  kSpecials,    // zeros, subnormals, limits, fp8 limits
  kRandomBits,  // every accepted bf16 pattern is possible
  kConstant,    // constant groups with a few outliers
  kSparse,      // mostly signed zeros, single outliers
};

inline std::vector<uint16_t> MakeBf16Data(const BlockShape& shape,
                                          Bf16Data kind, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> v(Fp16BlockBytes(shape) / 2);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFF);
  static const uint16_t kSpecialValues[] = {
      0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080,
      0x7E7F, 0xFE7F, 0x43E0, 0xC3E0, 0x43E1, 0x4760, 0xC760, 0x4761,
      0x3F80, 0xBF80, 0x3EAB, 0x0040, 0x7E00, 0xFE00, 0x3C00, 0x477F};
  const float constant = gauss(rng);
  for (auto& x : v) {
    switch (kind) {
      case Bf16Data::kGaussian:
        x = Bf16FromFloat(gauss(rng));
        break;
      case Bf16Data::kTiny:
        x = Bf16FromFloat(gauss(rng) * 1e-38f);
        break;
      case Bf16Data::kHuge:
        x = Bf16FromFloat(std::clamp(gauss(rng) * 4e37f, -8.4e37f, 8.4e37f));
        break;
      case Bf16Data::kSpecials:
        x = kSpecialValues[bits(rng) % (sizeof(kSpecialValues) / 2)];
        break;
      case Bf16Data::kRandomBits:
        do {
          x = static_cast<uint16_t>(bits(rng));
        } while ((x & 0x7FFFu) >= 0x7E80u);
        break;
      case Bf16Data::kConstant:
        x = Bf16FromFloat(bits(rng) % 97 == 0 ? gauss(rng) * 50 : constant);
        break;
      case Bf16Data::kSparse:
        x = bits(rng) % 61 == 0 ? Bf16FromFloat(gauss(rng) * 1e30f)
                                : static_cast<uint16_t>((bits(rng) & 1) << 15);
        break;
    }
  }
  return v;
}

// Source data of either dtype: kind indexes Data (fp16) or Bf16Data (bf16),
// both of which have kNumDataKinds kinds.
inline constexpr int kNumDataKinds = 7;
inline std::vector<uint16_t> MakeSourceData(const BlockShape& shape, int kind,
                                            uint32_t seed) {
  if (shape.source_dtype == SourceDtype::kBf16) {
    return MakeBf16Data(shape, static_cast<Bf16Data>(kind), seed);
  }
  return MakeData(shape, static_cast<Data>(kind), seed);
}

inline std::vector<CodecPolicy> Policies(const BlockShape& shape,
                                         uint32_t group, std::mt19937& rng) {
  std::vector<CodecPolicy> out;
  std::uniform_real_distribution<float> log_scale(-4.0f, 4.0f);
  for (Codec c : kAllCodecs) {
    CodecPolicy p;
    p.codec = c;
    p.kivi_group_size = group;
    out.push_back(p);
    if (shape.num_layers > 1) {
      p.fp16_layers = {shape.num_layers - 1};
      out.push_back(p);
      p.fp16_layers.clear();
    }
    if (c == Codec::kFp8E4M3 || c == Codec::kFp8E5M2) {
      p.scale_mode = ScaleMode::kStaticPerLayer;
      p.static_k_scales.clear();
      p.static_v_scales.clear();
      for (uint32_t l = 0; l < shape.num_layers; ++l) {
        p.static_k_scales.push_back(std::pow(10.0f, log_scale(rng)));
        p.static_v_scales.push_back(l == 0 ? 1.0f : 1e-30f);
      }
      out.push_back(p);
      p.scale_mode = ScaleMode::kStaticPerLayerHead;
      p.static_k_scales.clear();
      p.static_v_scales.clear();
      for (uint32_t i = 0; i < shape.num_layers * shape.num_kv_heads; ++i) {
        p.static_k_scales.push_back(std::pow(10.0f, log_scale(rng)));
        p.static_v_scales.push_back(i % 3 == 0 ? 1e30f : 0.5f);
      }
      out.push_back(p);
    }
  }
  return out;
}

inline std::string Describe(const BlockShape& s, const CodecPolicy& p) {
  return absl::StrCat(
      CodecName(p.codec), " L", s.num_layers, " H", s.num_kv_heads, " D",
      s.head_dim, " T", s.tokens_per_block, " G", p.kivi_group_size, " mode ",
      static_cast<int>(p.scale_mode), " skip ", p.fp16_layers.size());
}

}  // namespace kvcache::kernels::testutil

#endif  // KVCACHE_KERNELS_CODEC_TEST_UTIL_H_
