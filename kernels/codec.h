// KV-block codecs: none (as written), FP8 E4M3 / E5M2, KIVI 2 / 4 bit, from
// and to fp16 or bf16 sources (BlockShape::source_dtype).
//
// docs/codecs.md is the contract (the numerics, exactly); every path (scalar
// reference, SIMD, CUDA) produces the same bytes.
//
// Source layout of a block: for layer l in [0, L), for tensor t in
// {K = 0, V = 1}: a contiguous [T][H][D] array of 16-bit source values, IEEE
// fp16 or bf16 bit patterns by the shape's source_dtype (T = tokens_per_block,
// H = num_kv_heads, D = head_dim). Each (layer, tensor) pair is a "section".
// Below, "fp16" stands for the source dtype: a bf16 block stores bf16 where
// an fp16 block stores fp16 (the sizes are the same).
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
#include "kvcache/codec.h"

namespace kvcache::kernels {

// The public codec types (kvcache/codec.h), under the names the kernels use.
using ::kvcache::BlockShape;
using ::kvcache::Codec;
using ::kvcache::CodecFromName;
using ::kvcache::CodecName;
using ::kvcache::CodecPolicy;
using ::kvcache::kAllCodecs;
using ::kvcache::ScaleMode;
using ::kvcache::SourceDtype;
using ::kvcache::SourceDtypeFromName;
using ::kvcache::SourceDtypeName;

// INVALID_ARGUMENT with a message naming the problem: zero or oversized
// dimensions (more than 4096 layers, 2^31 elements per section or 2^44
// bytes per block), an unknown source dtype or codec, an fp16 layer out of
// range, static scales for a non-fp8 codec or a dynamic scale mode, static
// scales of the wrong count or not finite and > 0, a KIVI group size of 0 or
// not dividing tokens_per_block and head_dim.
absl::Status ValidatePolicy(const BlockShape& shape, const CodecPolicy& policy);

// num_layers * 2 * T * H * D * 2: the source block's size (fp16 or bf16).
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

// Where each layer's encoding starts in an encoded block, then the block's
// size: num_layers + 1 offsets, offsets[0] == 0, layer l is the bytes
// [offsets[l], offsets[l + 1]) (its encoding with LayerPolicy), and
// offsets[num_layers] == EncodedBlockBytes(shape, policy). The policy must
// be valid for `shape`. With codec none these are the fp16 layer bounds.
std::vector<size_t> EncodedLayerOffsets(const BlockShape& shape,
                                        const CodecPolicy& policy);

// Fast path (SIMD on the CPU). INVALID_ARGUMENT for an invalid policy, spans
// of the wrong size, or rejected input (non-finite; for bf16 also a magnitude
// >= 2^126, see docs/codecs.md): the message names layer, K|V, head, token
// and channel of the first one, and the output then holds no
// encoding (bytes the call wrote are zeroed; the rest are untouched).
absl::Status EncodeBlock(const BlockShape& shape, const CodecPolicy& policy,
                         absl::Span<const uint16_t> fp16_in,
                         absl::Span<uint8_t> encoded_out);
// What EncodeBlock answers for `fp16_in` with codec none, without writing
// anything: OK, or INVALID_ARGUMENT for a span of the wrong size or
// rejected input (the same message). For bytes that are already where
// codec none would copy them (received into a block's pages).
absl::Status CheckEncodable(const BlockShape& shape,
                            absl::Span<const uint16_t> fp16_in);
// How DecodeBlock stores its output. kStreaming: the fp8 and KIVI sections,
// where the output is aligned to full vectors of 16 bytes or more (AVX2:
// 16-byte, AVX-512: 32-byte alignment; SSE4 and narrower never stream),
// with stores that bypass the cache (x86 non-temporal), fenced before
// DecodeBlock returns; codec-none sections are copied as usual. For a caller
// that decodes more than the caches hold before anything reads it (a batch of
// blocks decoded on a client), so that each output line is written without
// first being read from memory. The bytes are the same either way.
enum class DecodeStores { kCached, kStreaming };
// INVALID_ARGUMENT for an invalid policy or spans of the wrong size.
absl::Status DecodeBlock(const BlockShape& shape, const CodecPolicy& policy,
                         absl::Span<const uint8_t> encoded_in,
                         absl::Span<uint16_t> fp16_out,
                         DecodeStores stores = DecodeStores::kCached);

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
