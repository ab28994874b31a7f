#include "kernels/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "base/stream_copy.h"
#include "kernels/codec_internal.h"
#include "kernels/codec_simd.h"
#include "kernels/half.h"

namespace kvcache::kernels {

#if !defined(ABSL_IS_LITTLE_ENDIAN)
#error "kernels/ assumes a little-endian host (fp16 sections are copied as is)"
#endif

namespace {

using internal::Section;
using EncodeSectionFn = void (*)(const Section&, const uint16_t*, uint8_t*);
using DecodeSectionFn = void (*)(const Section&, const uint8_t*, uint16_t*);
using FindRejectedFn = size_t (*)(const uint16_t*, size_t, uint16_t);

// Limits that keep every index computation far from overflow: indices within
// a section fit in 32 bits (the CUDA kernels rely on it).
constexpr uint64_t kMaxSectionElements = uint64_t{1} << 31;
constexpr uint64_t kMaxBlockBytes = uint64_t{1} << 44;
// Per-layer work (SectionPlan, layer offsets) is linear in num_layers: this
// bounds what validating one layout can cost (models have a few hundred).
constexpr uint64_t kMaxLayers = 4096;

bool ValidCodec(Codec c) {
  for (Codec k : kAllCodecs) {
    if (k == c) return true;
  }
  return false;
}

// The sections of a block in storage order, with the static scales of each
// expanded to one per kv head.
class SectionPlan {
 public:
  SectionPlan(const BlockShape& shape, const CodecPolicy& policy) {
    const uint32_t L = shape.num_layers, H = shape.num_kv_heads;
    std::vector<bool> fp16_layer(L, false);
    for (uint32_t l : policy.fp16_layers) fp16_layer[l] = true;
    const bool fp8 = internal::IsFp8(policy.codec);
    const bool per_layer = policy.scale_mode == ScaleMode::kStaticPerLayer;
    const bool is_static = fp8 && policy.scale_mode != ScaleMode::kDynamic;
    if (is_static) scales_.resize(size_t{2} * L * H);
    sections_.reserve(size_t{2} * L);
    for (uint32_t l = 0; l < L; ++l) {
      for (int tensor = 0; tensor < 2; ++tensor) {
        Section s;
        s.codec = fp16_layer[l] ? Codec::kNone : policy.codec;
        s.dtype = shape.source_dtype;
        s.is_key = tensor == 0;
        s.tokens = shape.tokens_per_block;
        s.heads = H;
        s.dim = shape.head_dim;
        s.group = policy.kivi_group_size;
        if (is_static && s.codec != Codec::kNone) {
          const std::vector<float>& src =
              tensor == 0 ? policy.static_k_scales : policy.static_v_scales;
          float* dst = &scales_[(size_t{2} * l + tensor) * H];
          for (uint32_t h = 0; h < H; ++h) {
            dst[h] = per_layer ? src[l] : src[size_t{l} * H + h];
          }
          s.static_scales = dst;
        }
        sections_.push_back(s);
      }
    }
  }

  const std::vector<Section>& sections() const { return sections_; }

  size_t EncodedBytes() const {
    size_t total = 0;
    for (const Section& s : sections_) total += internal::SectionBytes(s);
    return total;
  }

 private:
  std::vector<Section> sections_;
  std::vector<float> scales_;
};

// INVALID_ARGUMENT naming the first rejected input value: non-finite, or for
// bf16 of magnitude >= 2^126 (internal::RejectBound).
absl::Status CheckFinite(const BlockShape& shape, absl::Span<const uint16_t> in,
                         FindRejectedFn find) {
  const size_t T = shape.tokens_per_block, H = shape.num_kv_heads,
               D = shape.head_dim;
  const size_t section = T * H * D;
  const SourceDtype dtype = shape.source_dtype;
  const size_t bad = find(in.data(), in.size(), internal::RejectBound(dtype));
  if (bad == in.size()) return absl::OkStatus();
  const float value = internal::SourceToFloat(dtype, in[bad]);
  const size_t layer = bad / (2 * section);
  const bool key = (bad / section) % 2 == 0;
  const size_t i = bad % section;
  const size_t token = i / (H * D), head = (i / D) % H, channel = i % D;
  const bool finite = std::isfinite(value);
  return absl::InvalidArgumentError(
      absl::StrCat(finite ? "out-of-range " : "non-finite ",
                   dtype == SourceDtype::kBf16 ? "bf16 " : "", "input (", value,
                   ") at layer ", layer, " ", key ? "K" : "V", " head ", head,
                   " (token ", token, ", channel ", channel, "); ",
                   finite ? "bf16 sources must be below 2^126 in magnitude"
                          : "a KV cache never holds inf or NaN"));
}

absl::Status EncodeWith(const BlockShape& shape, const CodecPolicy& policy,
                        absl::Span<const uint16_t> in, absl::Span<uint8_t> out,
                        EncodeSectionFn encode, FindRejectedFn find,
                        bool fast) {
  if (absl::Status st = ValidatePolicy(shape, policy); !st.ok()) return st;
  const size_t in_elems = Fp16BlockBytes(shape) / 2;
  const SectionPlan plan(shape, policy);
  const size_t out_bytes = plan.EncodedBytes();
  if (in.size() != in_elems) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodeBlock: input holds ", in.size(),
                     " fp16 values, the block shape needs ", in_elems));
  }
  if (out.size() != out_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodeBlock: output holds ", out.size(),
                     " bytes, the encoded block needs ", out_bytes));
  }
  if (!fast) {
    // The reference checks the whole block before writing anything.
    if (absl::Status st = CheckFinite(shape, in, find); !st.ok()) return st;
    const uint16_t* src = in.data();
    uint8_t* dst = out.data();
    for (const Section& s : plan.sections()) {
      encode(s, src, dst);
      src += s.elements();
      dst += internal::SectionBytes(s);
    }
    return absl::OkStatus();
  }
  // The fast path checks each section just before encoding it, while the
  // section is in cache, so the block is read from memory once. When a
  // section holds a non-finite value, the output written so far is zeroed:
  // the caller never sees part of an encoding. With dynamic fp8 scales, the
  // per-head |x| maximum is the check (>= RejectBound: rejected input); KIVI
  // encoders check as they find group extremes (Section::non_finite).
  const bool fp8_dynamic =
      internal::IsFp8(policy.codec) && policy.scale_mode == ScaleMode::kDynamic;
  std::vector<uint16_t> head_max(fp8_dynamic ? shape.num_kv_heads : 0);
  const uint16_t bound = internal::RejectBound(shape.source_dtype);
  const uint16_t* src = in.data();
  uint8_t* dst = out.data();
  const std::vector<Section>& sections = plan.sections();
  for (size_t i = 0; i < sections.size(); ++i) {
    Section s = sections[i];
    const size_t n = s.elements();
    if (i + 1 < sections.size()) {
      s.next_input = src + n;
      s.next_elements = sections[i + 1].elements();
    }
    bool finite = true;
    bool non_finite = false;
    if (fp8_dynamic && s.codec != Codec::kNone) {
      internal::HeadAbsMaxSimd(s, src, head_max.data());
      finite = *std::max_element(head_max.begin(), head_max.end()) < bound;
      s.head_abs_max = head_max.data();
    } else if (internal::IsKivi(s.codec)) {
      s.non_finite = &non_finite;  // checked while finding group extremes
    } else {
      finite = find(src, n, bound) == n;
    }
    if (finite) encode(s, src, dst);
    if (!finite || non_finite) {
      std::memset(out.data(), 0,
                  static_cast<size_t>(dst - out.data()) +
                      (finite ? internal::SectionBytes(s) : 0));
      return CheckFinite(shape, in, find);
    }
    src += n;
    dst += internal::SectionBytes(s);
  }
  return absl::OkStatus();
}

absl::Status DecodeWith(const BlockShape& shape, const CodecPolicy& policy,
                        absl::Span<const uint8_t> in, absl::Span<uint16_t> out,
                        DecodeSectionFn decode, bool stream = false) {
  if (absl::Status st = ValidatePolicy(shape, policy); !st.ok()) return st;
  const size_t out_elems = Fp16BlockBytes(shape) / 2;
  const SectionPlan plan(shape, policy);
  const size_t in_bytes = plan.EncodedBytes();
  if (in.size() != in_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeBlock: input holds ", in.size(),
                     " bytes, the encoded block has ", in_bytes));
  }
  if (out.size() != out_elems) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeBlock: output holds ", out.size(),
                     " fp16 values, the block shape needs ", out_elems));
  }
  const uint8_t* src = in.data();
  uint16_t* dst = out.data();
  for (Section s : plan.sections()) {
    s.stream_output = stream;
    decode(s, src, dst);
    src += internal::SectionBytes(s);
    dst += s.elements();
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePolicy(const BlockShape& shape,
                            const CodecPolicy& policy) {
  const uint64_t L = shape.num_layers, H = shape.num_kv_heads,
                 D = shape.head_dim, T = shape.tokens_per_block;
  if (L == 0 || H == 0 || D == 0 || T == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block shape has a zero dimension: num_layers=", L, " num_kv_heads=", H,
        " head_dim=", D, " tokens_per_block=", T));
  }
  // T*H*D < 2^96 here, but check step by step to stay within 64 bits.
  if (L > kMaxLayers || T * H >= kMaxSectionElements ||
      T * H * D >= kMaxSectionElements || L * 4 * T * H * D > kMaxBlockBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block shape too large: num_layers=", L, " num_kv_heads=", H,
        " head_dim=", D, " tokens_per_block=", T));
  }
  if (shape.source_dtype != SourceDtype::kFp16 &&
      shape.source_dtype != SourceDtype::kBf16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown source dtype ", static_cast<int>(shape.source_dtype)));
  }
  if (!ValidCodec(policy.codec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown codec ", static_cast<int>(policy.codec)));
  }
  for (uint32_t l : policy.fp16_layers) {
    if (l >= L) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fp16 layer ", l, " is out of range: the block has ", L, " layers"));
    }
  }
  const bool fp8 = internal::IsFp8(policy.codec);
  const absl::string_view name = CodecName(policy.codec);
  switch (policy.scale_mode) {
    case ScaleMode::kDynamic:
      if (!policy.static_k_scales.empty() || !policy.static_v_scales.empty()) {
        return absl::InvalidArgumentError(
            "static scales were given with a dynamic scale mode");
      }
      break;
    case ScaleMode::kStaticPerLayer:
    case ScaleMode::kStaticPerLayerHead: {
      if (!fp8) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a static scale mode is for fp8 codecs only, not ", name));
      }
      const bool per_head = policy.scale_mode == ScaleMode::kStaticPerLayerHead;
      const uint64_t want = per_head ? L * H : L;
      for (int tensor = 0; tensor < 2; ++tensor) {
        const std::vector<float>& v =
            tensor == 0 ? policy.static_k_scales : policy.static_v_scales;
        const char* which = tensor == 0 ? "static_k_scales" : "static_v_scales";
        if (v.size() != want) {
          return absl::InvalidArgumentError(
              absl::StrCat(which, " has ", v.size(), " entries, ",
                           per_head ? "per-layer-per-head" : "per-layer",
                           " mode needs ", want));
        }
        for (size_t i = 0; i < v.size(); ++i) {
          if (!std::isfinite(v[i]) || !(v[i] > 0.0f)) {
            return absl::InvalidArgumentError(absl::StrCat(
                which, "[", i, "] = ", v[i], " is not a finite value > 0"));
          }
        }
      }
      break;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown scale mode ", static_cast<int>(policy.scale_mode)));
  }
  if (internal::IsKivi(policy.codec)) {
    const uint32_t G = policy.kivi_group_size;
    if (G == 0) {
      return absl::InvalidArgumentError("kivi group size must be > 0");
    }
    if (T % G != 0 || D % G != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " group size ", G, " must divide tokens_per_block (", T,
          ") and head_dim (", D, ")"));
    }
  }
  return absl::OkStatus();
}

size_t Fp16BlockBytes(const BlockShape& shape) {
  return size_t{shape.num_layers} * 2 * shape.tokens_per_block *
         shape.num_kv_heads * shape.head_dim * 2;
}

size_t EncodedBlockBytes(const BlockShape& shape, const CodecPolicy& policy) {
  return SectionPlan(shape, policy).EncodedBytes();
}

CodecPolicy LayerPolicy(const BlockShape& shape, const CodecPolicy& policy,
                        uint32_t layer) {
  CodecPolicy out;
  out.kivi_group_size = policy.kivi_group_size;
  if (policy.codec == Codec::kNone ||
      std::find(policy.fp16_layers.begin(), policy.fp16_layers.end(), layer) !=
          policy.fp16_layers.end()) {
    return out;  // stored fp16
  }
  out.codec = policy.codec;
  out.scale_mode = policy.scale_mode;
  const size_t h = shape.num_kv_heads;
  if (policy.scale_mode == ScaleMode::kStaticPerLayer) {
    out.static_k_scales = {policy.static_k_scales[layer]};
    out.static_v_scales = {policy.static_v_scales[layer]};
  } else if (policy.scale_mode == ScaleMode::kStaticPerLayerHead) {
    out.static_k_scales.assign(
        policy.static_k_scales.begin() + layer * h,
        policy.static_k_scales.begin() + (layer + 1) * h);
    out.static_v_scales.assign(
        policy.static_v_scales.begin() + layer * h,
        policy.static_v_scales.begin() + (layer + 1) * h);
  }
  return out;
}

std::vector<size_t> EncodedLayerOffsets(const BlockShape& shape,
                                        const CodecPolicy& policy) {
  BlockShape one = shape;
  one.num_layers = 1;
  std::vector<size_t> offsets(1, 0);
  offsets.reserve(shape.num_layers + 1);
  for (uint32_t l = 0; l < shape.num_layers; ++l) {
    offsets.push_back(offsets.back() +
                      EncodedBlockBytes(one, LayerPolicy(shape, policy, l)));
  }
  return offsets;
}

absl::Status EncodeBlock(const BlockShape& shape, const CodecPolicy& policy,
                         absl::Span<const uint16_t> fp16_in,
                         absl::Span<uint8_t> encoded_out) {
  return EncodeWith(shape, policy, fp16_in, encoded_out,
                    &internal::EncodeSectionSimd, &internal::FindRejectedSimd,
                    /*fast=*/true);
}

absl::Status CheckEncodable(const BlockShape& shape,
                            absl::Span<const uint16_t> fp16_in) {
  if (fp16_in.size() != Fp16BlockBytes(shape) / 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CheckEncodable: input holds ", fp16_in.size(),
        " fp16 values, the block shape needs ", Fp16BlockBytes(shape) / 2));
  }
  return CheckFinite(shape, fp16_in, &internal::FindRejectedSimd);
}

absl::Status DecodeBlock(const BlockShape& shape, const CodecPolicy& policy,
                         absl::Span<const uint8_t> encoded_in,
                         absl::Span<uint16_t> fp16_out, DecodeStores stores) {
  if (stores == DecodeStores::kCached) {
    return DecodeWith(shape, policy, encoded_in, fp16_out,
                      &internal::DecodeSectionSimd);
  }
  absl::Status st = DecodeWith(shape, policy, encoded_in, fp16_out,
                               &internal::DecodeSectionSimd, /*stream=*/true);
  StreamCopyFence();
  return st;
}

absl::Status EncodeBlockReference(const BlockShape& shape,
                                  const CodecPolicy& policy,
                                  absl::Span<const uint16_t> fp16_in,
                                  absl::Span<uint8_t> encoded_out) {
  return EncodeWith(shape, policy, fp16_in, encoded_out,
                    &internal::EncodeSectionReference,
                    &internal::FindRejectedReference, /*fast=*/false);
}

absl::Status DecodeBlockReference(const BlockShape& shape,
                                  const CodecPolicy& policy,
                                  absl::Span<const uint8_t> encoded_in,
                                  absl::Span<uint16_t> fp16_out) {
  return DecodeWith(shape, policy, encoded_in, fp16_out,
                    &internal::DecodeSectionReference);
}

}  // namespace kvcache::kernels

namespace kvcache {

absl::string_view CodecName(Codec c) {
  switch (c) {
    case Codec::kNone:
      return "none";
    case Codec::kFp8E4M3:
      return "fp8_e4m3";
    case Codec::kFp8E5M2:
      return "fp8_e5m2";
    case Codec::kKivi2:
      return "kivi2";
    case Codec::kKivi4:
      return "kivi4";
  }
  return "unknown";
}

std::optional<Codec> CodecFromName(absl::string_view name) {
  for (Codec c : kAllCodecs) {
    if (CodecName(c) == name) return c;
  }
  return std::nullopt;
}

absl::string_view SourceDtypeName(SourceDtype d) {
  switch (d) {
    case SourceDtype::kFp16:
      return "fp16";
    case SourceDtype::kBf16:
      return "bf16";
  }
  return "unknown";
}

std::optional<SourceDtype> SourceDtypeFromName(absl::string_view name) {
  for (SourceDtype d : {SourceDtype::kFp16, SourceDtype::kBf16}) {
    if (SourceDtypeName(d) == name) return d;
  }
  return std::nullopt;
}

}  // namespace kvcache
