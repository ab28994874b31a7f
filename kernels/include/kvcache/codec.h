// The codec vocabulary of the public API: which codec a namespace stores,
// the block shape it is applied to and the policy that configures it.
// kernels/codec.h (the codecs themselves) and the client headers share these
// types; this header includes nothing of the project, so the client's
// public headers can be installed with it as they are.
//
// The byte layouts and the numerics of each codec are specified in
// kernels/codec.h and docs/codecs.md.
#ifndef KVCACHE_CODEC_H_
#define KVCACHE_CODEC_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvcache {

enum class Codec : uint8_t {
  kNone = 0,
  kFp8E4M3 = 1,
  kFp8E5M2 = 2,
  kKivi2 = 3,
  kKivi4 = 4,
};

// "none", "fp8_e4m3", "fp8_e5m2", "kivi2", "kivi4"; "unknown" otherwise.
absl::string_view CodecName(Codec c);
std::optional<Codec> CodecFromName(absl::string_view name);

inline constexpr Codec kAllCodecs[] = {Codec::kNone, Codec::kFp8E4M3,
                                       Codec::kFp8E5M2, Codec::kKivi2,
                                       Codec::kKivi4};

// The dtype of a block's source values (what EncodeBlock reads and
// DecodeBlock writes): 16-bit IEEE binary16 or bfloat16 bit patterns. The
// numerics of each are specified in docs/codecs.md.
enum class SourceDtype : uint8_t {
  kFp16 = 0,
  kBf16 = 1,
};

// "fp16", "bf16"; "unknown" otherwise.
absl::string_view SourceDtypeName(SourceDtype d);
std::optional<SourceDtype> SourceDtypeFromName(absl::string_view name);

struct BlockShape {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t tokens_per_block = 0;
  // Part of the layout: both dtypes are 2 bytes per value, so sizes do not
  // depend on it. fp16 unless set.
  SourceDtype source_dtype = SourceDtype::kFp16;
};

enum class ScaleMode : uint8_t {
  kDynamic = 0,             // one fp32 scale per (block, layer, K|V, head)
  kStaticPerLayer = 1,      // static_*_scales has num_layers entries
  kStaticPerLayerHead = 2,  // num_layers*num_kv_heads entries, layer-major
};

struct CodecPolicy {
  Codec codec = Codec::kNone;
  // Layers kept at fp16 whatever the codec (vLLM kv_cache_dtype_skip_layers).
  std::vector<uint32_t> fp16_layers;
  ScaleMode scale_mode = ScaleMode::kDynamic;  // fp8 only
  // fp8 static scales: [num_layers] or [num_layers*num_kv_heads]
  // (layer-major), finite and > 0. Entries of fp16 layers are ignored.
  std::vector<float> static_k_scales;
  std::vector<float> static_v_scales;
  uint32_t kivi_group_size = 32;  // kivi only
};

}  // namespace kvcache

#endif  // KVCACHE_CODEC_H_
