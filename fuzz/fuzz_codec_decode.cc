// fuzz_codec_decode: kernels::DecodeBlock (the SIMD path) and
// DecodeBlockReference (the specification in code) on arbitrary encoded
// bytes: what a client decodes after a raw read is a peer's bytes. The
// shape (small dims), codec and policy come from the input (the layout is
// at Check below); a policy that
// ValidatePolicy refuses must be refused by both decoders with
// INVALID_ARGUMENT, and so must an encoding of the wrong size. Otherwise
// both must succeed, write every output value, and agree bit for bit
// (scales, zero points and codes are arbitrary here: NaNs, infinities and
// subnormals included).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "fuzz/fuzz_input.h"
#include "kernels/codec.h"

namespace kvcache::kernels {
namespace {

[[noreturn]] void Fail(const char* what, const BlockShape& shape,
                       const CodecPolicy& policy) {
  std::fprintf(stderr,
               "fuzz_codec_decode: %s (shape L=%u H=%u D=%u T=%u, codec %d, "
               "scale mode %d, kivi group %u)\n",
               what, shape.num_layers, shape.num_kv_heads, shape.head_dim,
               shape.tokens_per_block, static_cast<int>(policy.codec),
               static_cast<int>(policy.scale_mode), policy.kivi_group_size);
  std::abort();
}

float FloatFromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Scales: a count (u8: 0 is the count the scale mode needs, else n - 1),
// then per scale a u8: below 0x80 the value (u8 + 1) / 16, else the raw
// bits of a u32 that follows (any float: NaN, negative, subnormal...).
std::vector<float> ReadScales(fuzz::Input* in, size_t want) {
  const uint8_t count = in->U8();
  std::vector<float> v(count == 0 ? want : count - 1u);
  for (float& f : v) {
    const uint8_t kind = in->U8();
    f = kind < 0x80 ? (kind + 1) / 16.0f : FloatFromBits(in->U32());
  }
  return v;
}

// Layout (fuzz/fuzz_input.h): L - 1 (u8, mod 3), H - 1 (mod 4), D - 1
// (mod 64), T - 1 (mod 32), codec (u8, mod 6: 5 is none), scale mode (u8,
// mod 4: 3 is none), fp16 layer count (u8, mod 4) and each layer (u8, mod
// L + 1), flags (u8: 1 static scales even with a dynamic mode, 2 the
// encoding as it comes rather than cut or padded to its size), the K and V
// static scales when there are any (ReadScales), the KIVI group size (u8
// indexing kGroups), then the encoded bytes.
void Check(fuzz::Input* in) {
  BlockShape shape;
  shape.num_layers = 1 + in->U8() % 3;
  shape.num_kv_heads = 1 + in->U8() % 4;
  shape.head_dim = 1 + in->U8() % 64;
  shape.tokens_per_block = 1 + in->U8() % 32;
  CodecPolicy policy;
  policy.codec = static_cast<Codec>(in->U8() % 6);
  policy.scale_mode = static_cast<ScaleMode>(in->U8() % 4);
  const uint32_t layers = in->U8() % 4;
  for (uint32_t i = 0; i < layers; ++i) {
    policy.fp16_layers.push_back(in->U8() % (shape.num_layers + 1));
  }
  const uint8_t flags = in->U8();
  if (policy.scale_mode != ScaleMode::kDynamic || (flags & 1) != 0) {
    const size_t want = policy.scale_mode == ScaleMode::kStaticPerLayerHead
                            ? shape.num_layers * shape.num_kv_heads
                            : shape.num_layers;
    policy.static_k_scales = ReadScales(in, want);
    policy.static_v_scales = ReadScales(in, want);
  }
  static constexpr uint32_t kGroups[] = {1, 2, 4, 8, 16, 32, 3, 0};
  policy.kivi_group_size = kGroups[in->U8() % std::size(kGroups)];
  const bool exact_size = (flags & 2) == 0;

  const absl::Status valid = ValidatePolicy(shape, policy);
  const size_t want_bytes = valid.ok() ? EncodedBlockBytes(shape, policy) : 0;
  const std::string rest = in->Rest();
  std::vector<uint8_t> encoded(rest.begin(), rest.end());
  if (exact_size) encoded.resize(want_bytes);
  const size_t values = Fp16BlockBytes(shape) / 2;
  std::vector<uint16_t> fast(values, 0xAAAA);
  std::vector<uint16_t> reference(values, 0x5555);
  const absl::Status a =
      DecodeBlock(shape, policy, encoded, absl::MakeSpan(fast));
  const absl::Status b =
      DecodeBlockReference(shape, policy, encoded, absl::MakeSpan(reference));
  const bool should_decode = valid.ok() && encoded.size() == want_bytes;
  if (a.ok() != should_decode || b.ok() != should_decode) {
    Fail(should_decode ? "a decoder refused a valid block"
                       : "a decoder accepted an invalid policy or size",
         shape, policy);
  }
  if (!should_decode) {
    if (a.code() != absl::StatusCode::kInvalidArgument ||
        b.code() != absl::StatusCode::kInvalidArgument) {
      Fail("a refusal that is not INVALID_ARGUMENT", shape, policy);
    }
    return;
  }
  for (size_t i = 0; i < values; ++i) {
    if (fast[i] != reference[i]) {
      std::fprintf(stderr,
                   "fuzz_codec_decode: value %zu: DecodeBlock 0x%04x, "
                   "reference 0x%04x\n",
                   i, fast[i], reference[i]);
      Fail("DecodeBlock and DecodeBlockReference disagree", shape, policy);
    }
  }
}

}  // namespace
}  // namespace kvcache::kernels

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcache::fuzz::Input in(data, size);
  kvcache::kernels::Check(&in);
  return 0;
}
