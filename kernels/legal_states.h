// LegalStates: what a read of one block may return, bit for bit, so that a
// reader that knows what was written can prove every read right.
//
// A block written as the source bytes `source` (fp16 or bf16, by the shape's
// source_dtype) under a codec policy reads back in that dtype in exactly one
// of these states, the same for all its layers:
//  * kSource: the source itself. Legal for codec none (every layer is
//    stored as written) and for KIVI (a block still in the residual window
//    is stored as written, fp16 or bf16).
//  * kRoundTrip: DecodeBlock(EncodeBlock(source)), computed locally; the
//    codecs are exact (BRIEF section 4), so the store's encode and a local
//    one agree bit for bit. Layers the policy keeps at fp16 are their
//    source in this state too. For codec none it equals kSource.
// A read that matches neither, or that mixes them across layers, is wrong
// KV: a non-finite element is always wrong (no legal state holds one).
#ifndef KVCACHE_KERNELS_LEGAL_STATES_H_
#define KVCACHE_KERNELS_LEGAL_STATES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace kvcache::kernels {

enum class BlockState : uint8_t { kSource = 0, kRoundTrip = 1 };

// "source" or "round trip".
const char* BlockStateName(BlockState state);

class LegalStates {
 public:
  // INVALID_ARGUMENT: invalid policy, `source` of the wrong size, or
  // rejected source elements (non-finite; bf16: also |x| >= 2^126), which a
  // store refuses on write.
  static absl::StatusOr<LegalStates> Make(const BlockShape& shape,
                                          const CodecPolicy& policy,
                                          absl::Span<const uint16_t> source);

  // The state a whole block read (in the source dtype) is in. DATA_LOSS when it
  // is in none: the message names the first element (layer, K|V, token, head,
  // channel) that matches no legal state and says whether it is non-finite.
  absl::StatusOr<BlockState> Match(absl::Span<const uint16_t> read) const;
  // The same for one section: layer `layer`, tensor `kv` (0: K, 1: V),
  // T*H*D elements in [T][H][D] order (a LayerSlice's k or v).
  absl::StatusOr<BlockState> MatchSection(
      uint32_t layer, uint32_t kv, absl::Span<const uint16_t> read) const;

  // Whether kSource is legal for this policy (codec none or KIVI).
  bool source_is_legal() const { return source_legal_; }
  const std::vector<uint16_t>& source() const { return source_; }
  const std::vector<uint16_t>& round_trip() const { return round_trip_; }

 private:
  LegalStates(const BlockShape& shape, std::vector<uint16_t> source,
              std::vector<uint16_t> round_trip, bool source_legal)
      : shape_(shape),
        source_(std::move(source)),
        round_trip_(std::move(round_trip)),
        source_legal_(source_legal) {}
  // Matches read against [offset, offset + read.size()) of both states.
  absl::StatusOr<BlockState> MatchRange(size_t offset,
                                        absl::Span<const uint16_t> read) const;
  std::string Where(size_t element) const;

  BlockShape shape_;
  std::vector<uint16_t> source_;
  std::vector<uint16_t> round_trip_;
  bool source_legal_;
};

// Number of non-finite elements in `values`, fp16 or bf16 bit patterns.
uint64_t CountNonFinite(absl::Span<const uint16_t> values,
                        SourceDtype dtype = SourceDtype::kFp16);

}  // namespace kvcache::kernels

#endif  // KVCACHE_KERNELS_LEGAL_STATES_H_
