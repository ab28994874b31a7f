// KV-block codecs: none (fp16), FP8 E4M3 / E5M2, KIVI 2 / 4 bit.
//
// BRIEF section 4 is the contract; every path (scalar reference, SIMD, CUDA)
// produces the same bytes.
//
// fp16 input layout of a block: for layer l in [0, L), for tensor t in
// {K = 0, V = 1}: a contiguous [T][H][D] array of IEEE fp16 bit patterns
// (T = tokens_per_block, H = num_kv_heads, D = head_dim). Each (layer, tensor)
// pair is a "section".
//
// Encoded layout: the sections in the same order, back to back, no padding
// between them. Each section is, by codec of its layer:
//   fp16 (codec none, or a layer listed in fp16_layers):
//       T*H*D fp16 values, a raw copy of the input (2*T*H*D bytes, in the
//       host's byte order, the same as the input array).
//   fp8 dynamic scales:
//       H fp32 scales, little-endian (4*H bytes), scale[h] for kv head h; then
//       T*H*D codes, one byte each, in [t][h][d] order.
//   fp8 static scales:
//       T*H*D codes, one byte each, in [t][h][d] order (the scales are in the
//       policy, not in the block).
//   kivi (b = 2 or 4 bits, group size G), with NG = T*H*D/G groups:
//       NG fp16 zero points (2*NG bytes), then NG fp16 scales (2*NG bytes),
//       both little-endian, then the T*H*D codes in [t][h][d] order packed
//       little end first: element i of the section sits at bits [b*i, b*i+b)
//       of the code bytes, ceil(T*H*D*b/8) bytes (unused high bits are 0).
//       Keys (tensor K): group (g, h, d) = channel d of head h over tokens
//       [g*G, g*G+G); its metadata index is (g*H + h)*D + d.
//       Values (tensor V): group (t, h, c) = token t of head h over channels
//       [c*G, c*G+G); its metadata index is (t*H + h)*(D/G) + c.
//       A zero min or max is taken as +0 (the sign of a zero is not data).
#ifndef KVCACHE_KERNELS_CODEC_H_
#define KVCACHE_KERNELS_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcache::kernels {

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

struct BlockShape {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t tokens_per_block = 0;
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

// INVALID_ARGUMENT with a message naming the problem: zero or oversized
// dimensions, an unknown codec, an fp16 layer out of range, static scales for
// a non-fp8 codec or a dynamic scale mode, static scales of the wrong count or
// not finite and > 0, a KIVI group size of 0 or not dividing
// tokens_per_block and head_dim.
absl::Status ValidatePolicy(const BlockShape& shape, const CodecPolicy& policy);

// num_layers * 2 * T * H * D * 2.
size_t Fp16BlockBytes(const BlockShape& shape);
// Exact encoded size; the policy must be valid.
size_t EncodedBlockBytes(const BlockShape& shape, const CodecPolicy& policy);

// The policy of layer `layer` alone, for `shape` with num_layers = 1: a
// block's encoding is its layers' encodings back to back, and encoding or
// decoding one layer's slice with this policy gives the same bytes as the
// whole block does for that layer. A layer kept at fp16 (codec none, or in
// fp16_layers) gets codec none; static scales are cut to that layer's. The
// policy must be valid for `shape`.
CodecPolicy LayerPolicy(const BlockShape& shape, const CodecPolicy& policy,
                        uint32_t layer);

// Fast path (SIMD on the CPU). INVALID_ARGUMENT for an invalid policy, spans
// of the wrong size, or non-finite input: the message names layer, K|V,
// head, token and channel of the first one, and the output then holds no
// encoding (bytes the call wrote are zeroed; the rest are untouched).
absl::Status EncodeBlock(const BlockShape& shape, const CodecPolicy& policy,
                         absl::Span<const uint16_t> fp16_in,
                         absl::Span<uint8_t> encoded_out);
// INVALID_ARGUMENT for an invalid policy or spans of the wrong size.
absl::Status DecodeBlock(const BlockShape& shape, const CodecPolicy& policy,
                         absl::Span<const uint8_t> encoded_in,
                         absl::Span<uint16_t> fp16_out);

// The scalar reference (the specification in code); same contract and the
// same output bytes as EncodeBlock / DecodeBlock (on non-finite input it
// writes nothing at all).
absl::Status EncodeBlockReference(const BlockShape& shape,
                                  const CodecPolicy& policy,
                                  absl::Span<const uint16_t> fp16_in,
                                  absl::Span<uint8_t> encoded_out);
absl::Status DecodeBlockReference(const BlockShape& shape,
                                  const CodecPolicy& policy,
                                  absl::Span<const uint8_t> encoded_in,
                                  absl::Span<uint16_t> fp16_out);

}  // namespace kvcache::kernels

#endif  // KVCACHE_KERNELS_CODEC_H_
