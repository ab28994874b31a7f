#include "kernels/legal_states.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/half.h"

namespace kvcache::kernels {
namespace {

bool IsNonFinite(SourceDtype dtype, uint16_t v) {
  return dtype == SourceDtype::kBf16 ? Bf16IsNonFinite(v) : HalfIsNonFinite(v);
}

}  // namespace

const char* BlockStateName(BlockState state) {
  return state == BlockState::kSource ? "source" : "round trip";
}

uint64_t CountNonFinite(absl::Span<const uint16_t> values, SourceDtype dtype) {
  uint64_t n = 0;
  for (uint16_t v : values) n += IsNonFinite(dtype, v);
  return n;
}

absl::StatusOr<LegalStates> LegalStates::Make(
    const BlockShape& shape, const CodecPolicy& policy,
    absl::Span<const uint16_t> source) {
  if (absl::Status s = ValidatePolicy(shape, policy); !s.ok()) return s;
  if (source.size() * 2 != Fp16BlockBytes(shape)) {
    return absl::InvalidArgumentError(absl::StrCat("source has ", source.size(),
                                                   " elements; the block has ",
                                                   Fp16BlockBytes(shape) / 2));
  }
  std::vector<uint8_t> encoded(EncodedBlockBytes(shape, policy));
  if (absl::Status s =
          EncodeBlock(shape, policy, source, absl::MakeSpan(encoded));
      !s.ok()) {
    return s;
  }
  std::vector<uint16_t> round_trip(source.size());
  if (absl::Status s =
          DecodeBlock(shape, policy, encoded, absl::MakeSpan(round_trip));
      !s.ok()) {
    return s;
  }
  const bool source_legal = policy.codec == Codec::kNone ||
                            policy.codec == Codec::kKivi2 ||
                            policy.codec == Codec::kKivi4;
  return LegalStates(shape, std::vector<uint16_t>(source.begin(), source.end()),
                     std::move(round_trip), source_legal);
}

absl::StatusOr<BlockState> LegalStates::Match(
    absl::Span<const uint16_t> read) const {
  if (read.size() != source_.size()) {
    return absl::DataLossError(absl::StrCat(
        "read has ", read.size(), " elements; the block has ", source_.size()));
  }
  return MatchRange(0, read);
}

absl::StatusOr<BlockState> LegalStates::MatchSection(
    uint32_t layer, uint32_t kv, absl::Span<const uint16_t> read) const {
  const size_t section =
      size_t{shape_.tokens_per_block} * shape_.num_kv_heads * shape_.head_dim;
  if (layer >= shape_.num_layers || kv > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("no section (layer ", layer, ", ", kv ? "V" : "K", ")"));
  }
  if (read.size() != section) {
    return absl::DataLossError(absl::StrCat("section read has ", read.size(),
                                            " elements; a section has ",
                                            section));
  }
  return MatchRange((size_t{layer} * 2 + kv) * section, read);
}

absl::StatusOr<BlockState> LegalStates::MatchRange(
    size_t offset, absl::Span<const uint16_t> read) const {
  // Round trip first: for codec none and fp16 layers it is the source too.
  const uint16_t* rt = round_trip_.data() + offset;
  const uint16_t* src = source_.data() + offset;
  size_t i = 0;
  while (i < read.size() && read[i] == rt[i]) ++i;
  if (i == read.size()) return BlockState::kRoundTrip;
  size_t first_wrong = i;
  if (source_legal_) {
    size_t j = 0;
    while (j < read.size() && read[j] == src[j]) ++j;
    if (j == read.size()) return BlockState::kSource;
    first_wrong = std::max(first_wrong, j);
  }
  const uint16_t got = read[first_wrong];
  return absl::DataLossError(absl::StrCat(
      "element ", Where(offset + first_wrong), " is 0x", absl::Hex(got),
      IsNonFinite(shape_.source_dtype, got) ? " (not finite)" : "",
      "; legal: 0x", absl::Hex(rt[first_wrong]), " (round trip)",
      source_legal_
          ? absl::StrCat(" or 0x", absl::Hex(src[first_wrong]), " (source)")
          : std::string()));
}

std::string LegalStates::Where(size_t element) const {
  const size_t d = shape_.head_dim, h = shape_.num_kv_heads,
               t = shape_.tokens_per_block;
  const size_t section = t * h * d;
  const size_t in = element % section, s = element / section;
  return absl::StrCat("(layer ", s / 2, ", ", s % 2 ? "V" : "K", ", token ",
                      in / (h * d), ", head ", in / d % h, ", channel ", in % d,
                      ")");
}

}  // namespace kvcache::kernels
