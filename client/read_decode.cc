#include "client/read_decode.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/stream_copy.h"
#include "kernels/codec.h"

namespace kvcache::internal {

absl::StatusOr<CodecPolicy> StoredPolicy(const CodecPolicy& ns_policy,
                                         Codec block_codec) {
  if (block_codec == ns_policy.codec) return ns_policy;
  if (block_codec == Codec::kNone) return CodecPolicy{};
  return absl::DataLossError("block codec differs from its namespace's");
}

namespace {

// DecodeRawLayers with the encoding's layer offsets (EncodedLayerOffsets)
// computed by the caller.
absl::Status DecodeWithOffsets(const BlockShape& shape,
                               const CodecPolicy& policy,
                               const std::vector<size_t>& offsets,
                               absl::Span<const uint8_t> raw, uint32_t from,
                               uint32_t to, absl::Span<uint8_t> fp16,
                               kernels::DecodeStores stores) {
  const size_t fp16_bytes = kernels::Fp16BlockBytes(shape);
  if (fp16.size() != fp16_bytes || shape.num_layers == 0) {
    return absl::InvalidArgumentError(absl::StrCat("a slot of ", fp16.size(),
                                                   " bytes for a block of ",
                                                   fp16_bytes, " bytes"));
  }
  if (offsets.back() != raw.size()) {
    return absl::DataLossError(absl::StrCat("a raw block of ", raw.size(),
                                            " bytes; its encoding has ",
                                            offsets.back()));
  }
  const size_t layer_bytes = fp16_bytes / shape.num_layers;
  BlockShape one = shape;
  one.num_layers = 1;
  for (uint32_t l = from; l < std::min(to, shape.num_layers); ++l) {
    absl::Span<uint16_t> out(
        reinterpret_cast<uint16_t*>(fp16.data() + l * layer_bytes),
        layer_bytes / 2);
    absl::Status st = kernels::DecodeBlock(
        one, kernels::LayerPolicy(shape, policy, l),
        raw.subspan(offsets[l], offsets[l + 1] - offsets[l]), out, stores);
    if (!st.ok()) {
      return absl::DataLossError(absl::StrCat("layer ", l, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeRawLayers(const BlockShape& shape, const CodecPolicy& policy,
                             absl::Span<const uint8_t> raw, uint32_t from,
                             uint32_t to, absl::Span<uint8_t> fp16) {
  return DecodeWithOffsets(shape, policy,
                           kernels::EncodedLayerOffsets(shape, policy), raw,
                           from, to, fp16, kernels::DecodeStores::kCached);
}

absl::Status DecodeResultToFp16(GetResult& result) {
  const size_t fp16_bytes = kernels::Fp16BlockBytes(result.shape);
  for (BlockData& block : result.blocks) {
    if (block.format == ReadFormat::kFp16) continue;
    absl::StatusOr<CodecPolicy> policy =
        StoredPolicy(result.policy, block.codec);
    if (!policy.ok()) return policy.status();
    if (policy->codec != Codec::kNone) {
      std::string fp16(fp16_bytes, '\0');
      absl::Status st = DecodeRawLayers(
          result.shape, *policy,
          absl::MakeConstSpan(
              reinterpret_cast<const uint8_t*>(block.bytes.data()),
              block.bytes.size()),
          0, result.shape.num_layers,
          absl::MakeSpan(reinterpret_cast<uint8_t*>(fp16.data()), fp16.size()));
      if (!st.ok()) return st;
      block.bytes = std::move(fp16);
    } else if (block.bytes.size() != fp16_bytes) {
      return absl::DataLossError(
          absl::StrCat("an fp16 block of ", block.bytes.size(), " bytes"));
    }
    block.format = ReadFormat::kFp16;
  }
  return absl::OkStatus();
}

namespace {

bool WorthStreaming(const std::vector<LayerDecoder::Block>& blocks) {
  uint64_t bytes = 0;
  for (const LayerDecoder::Block& b : blocks) bytes += b.fp16.size();
  return bytes >= kStreamingDecodeBytes;
}

}  // namespace

LayerDecoder::LayerDecoder(BlockShape shape, std::vector<Block> blocks)
    : shape_(shape),
      blocks_(std::move(blocks)),
      stream_(WorthStreaming(blocks_)) {
  for (const Block& b : blocks_) {
    offsets_.push_back(kernels::EncodedLayerOffsets(shape_, b.policy));
  }
}

absl::Status LayerDecoder::DecodeThrough(uint32_t layers) {
  MutexLock lock(&mu_);
  layers = std::min(layers, shape_.num_layers);
  if (!error_.ok() || layers <= decoded_) return error_;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    if (b.policy.codec == Codec::kNone) {
      // Stored fp16: the layers' bytes are the same raw and decoded.
      const size_t layer_bytes = b.fp16.size() / shape_.num_layers;
      const size_t at = decoded_ * layer_bytes;
      const size_t n = (layers - decoded_) * layer_bytes;
      if (stream_) {
        StreamCopy(b.fp16.data() + at, b.raw.data() + at, n);
      } else {
        std::memcpy(b.fp16.data() + at, b.raw.data() + at, n);
      }
      continue;
    }
    error_ = DecodeWithOffsets(shape_, b.policy, offsets_[i], b.raw, decoded_,
                               layers, b.fp16,
                               stream_ ? kernels::DecodeStores::kStreaming
                                       : kernels::DecodeStores::kCached);
    if (!error_.ok()) return error_;
  }
  // Before another thread can be told the layers are there.
  if (stream_) StreamCopyFence();
  decoded_ = layers;
  return absl::OkStatus();
}

}  // namespace kvcache::internal
