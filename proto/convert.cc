#include "proto/convert.h"

#include "absl/strings/str_cat.h"

namespace kvcache::proto {

v1::Codec CodecToProto(kvcache::Codec codec) {
  return static_cast<v1::Codec>(static_cast<int>(codec) + 1);
}

absl::StatusOr<kvcache::Codec> CodecFromProto(v1::Codec codec) {
  switch (codec) {
    case v1::CODEC_NONE:
      return kvcache::Codec::kNone;
    case v1::CODEC_FP8_E4M3:
      return kvcache::Codec::kFp8E4M3;
    case v1::CODEC_FP8_E5M2:
      return kvcache::Codec::kFp8E5M2;
    case v1::CODEC_KIVI2:
      return kvcache::Codec::kKivi2;
    case v1::CODEC_KIVI4:
      return kvcache::Codec::kKivi4;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown codec ", static_cast<int>(codec)));
  }
}

void PolicyToProto(const kvcache::CodecPolicy& policy, v1::CodecPolicy* out) {
  out->set_codec(CodecToProto(policy.codec));
  for (uint32_t layer : policy.fp16_layers) out->add_fp16_layers(layer);
  out->set_scale_mode(static_cast<v1::ScaleMode>(policy.scale_mode));
  for (float s : policy.static_k_scales) out->add_static_k_scales(s);
  for (float s : policy.static_v_scales) out->add_static_v_scales(s);
  out->set_kivi_group_size(policy.kivi_group_size);
}

absl::StatusOr<kvcache::CodecPolicy> PolicyFromProto(const v1::CodecPolicy& p) {
  kvcache::CodecPolicy policy;
  if (p.codec() != v1::CODEC_UNSPECIFIED) {
    absl::StatusOr<kvcache::Codec> codec = CodecFromProto(p.codec());
    if (!codec.ok()) return codec.status();
    policy.codec = *codec;
  }
  policy.fp16_layers.assign(p.fp16_layers().begin(), p.fp16_layers().end());
  switch (p.scale_mode()) {
    case v1::SCALE_MODE_DYNAMIC:
      policy.scale_mode = kvcache::ScaleMode::kDynamic;
      break;
    case v1::SCALE_MODE_STATIC_PER_LAYER:
      policy.scale_mode = kvcache::ScaleMode::kStaticPerLayer;
      break;
    case v1::SCALE_MODE_STATIC_PER_LAYER_HEAD:
      policy.scale_mode = kvcache::ScaleMode::kStaticPerLayerHead;
      break;
    default:
      return absl::InvalidArgumentError("unknown scale mode");
  }
  policy.static_k_scales.assign(p.static_k_scales().begin(),
                                p.static_k_scales().end());
  policy.static_v_scales.assign(p.static_v_scales().begin(),
                                p.static_v_scales().end());
  policy.kivi_group_size = p.kivi_group_size() == 0 ? 32 : p.kivi_group_size();
  return policy;
}

void ShapeToProto(const kvcache::BlockShape& shape, v1::Layout* out) {
  out->set_num_layers(shape.num_layers);
  out->set_num_kv_heads(shape.num_kv_heads);
  out->set_head_dim(shape.head_dim);
  out->set_tokens_per_block(shape.tokens_per_block);
  out->set_dtype(shape.source_dtype == kvcache::SourceDtype::kBf16
                     ? v1::DTYPE_BF16
                     : v1::DTYPE_FP16);
  out->set_tensor_order(v1::TENSOR_ORDER_LAYER_KV_TOKEN_HEAD_DIM);
}

kvcache::BlockShape ShapeFromProto(const v1::Layout& l) {
  return {l.num_layers(), l.num_kv_heads(), l.head_dim(), l.tokens_per_block(),
          l.dtype() == v1::DTYPE_BF16 ? kvcache::SourceDtype::kBf16
                                      : kvcache::SourceDtype::kFp16};
}

}  // namespace kvcache::proto
