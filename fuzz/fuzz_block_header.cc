// fuzz_block_header: the verification of a stored block's 72-byte header
// and payload (store/block_header.h) against what the index expects, with
// the expectations (shape, policy, namespace fingerprint, key) taken from
// the input too (fuzz/fuzz_input.h). Two modes, by the first byte:
//   raw:  the header is 72 bytes of input, the payload the rest. The answer
//         must be OK or DATA_LOSS, VerifyBlock and VerifyBlockMetadata must
//         agree, and OK only when both checksums, the magic, the version and
//         every field match (recomputed here).
//   made: a header made by MakeBlockHeader for a payload must verify; with
//         one byte of header or payload changed, or one expectation
//         different, it must be DATA_LOSS.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "fuzz/fuzz_input.h"
#include "kernels/codec.h"
#include "store/block_header.h"

namespace kvcache::store {
namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "fuzz_block_header: %s\n", what);
  std::abort();
}

struct Expected {
  kernels::BlockShape shape;
  kernels::CodecPolicy policy;
  uint64_t fingerprint = 0;
  std::string key;
};

// Layout: L, H, D, T (u32 each), codec (u8), scale mode (u8), KIVI group
// size (u32), namespace fingerprint (u64), key length (u8, mod 65), key.
Expected ReadExpected(fuzz::Input* in) {
  Expected e;
  e.shape.num_layers = in->U32();
  e.shape.num_kv_heads = in->U32();
  e.shape.head_dim = in->U32();
  e.shape.tokens_per_block = in->U32();
  e.policy.codec = static_cast<kernels::Codec>(in->U8());
  e.policy.scale_mode = static_cast<kernels::ScaleMode>(in->U8());
  e.policy.kivi_group_size = in->U32();
  e.fingerprint = in->U64();
  e.key = in->Bytes(in->U8() % 65);
  return e;
}

std::vector<uint8_t> AsBytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

absl::Status Verify(const BlockHeader& h, const Expected& e,
                    absl::Span<const uint8_t> payload) {
  absl::Status whole =
      VerifyBlock(h, e.shape, e.policy, e.fingerprint, e.key, payload);
  absl::Status metadata = VerifyBlockMetadata(
      h, e.shape, e.policy, e.fingerprint, e.key, payload.size(),
      PayloadChecksum(e.shape, e.policy, payload));
  if (whole.code() != metadata.code()) {
    Fail("VerifyBlock and VerifyBlockMetadata disagree");
  }
  if (!whole.ok() && whole.code() != absl::StatusCode::kDataLoss) {
    Fail("verification failed with a code other than DATA_LOSS");
  }
  return whole;
}

// Everything an accepted header must satisfy, recomputed from scratch.
bool Matches(const BlockHeader& h, const Expected& e,
             absl::Span<const uint8_t> payload) {
  const auto* raw = reinterpret_cast<const uint8_t*>(&h);
  return h.magic == kBlockMagic && h.version == kBlockFormatVersion &&
         h.header_checksum ==
             HashBytes(absl::MakeConstSpan(
                 raw, offsetof(BlockHeader, header_checksum))) &&
         h.namespace_fingerprint == e.fingerprint &&
         h.num_layers == e.shape.num_layers &&
         h.num_kv_heads == e.shape.num_kv_heads &&
         h.head_dim == e.shape.head_dim &&
         h.tokens == e.shape.tokens_per_block &&
         h.codec == static_cast<uint8_t>(e.policy.codec) &&
         h.scale_mode == static_cast<uint8_t>(e.policy.scale_mode) &&
         h.kivi_group_size == e.policy.kivi_group_size &&
         h.key_hash == HashString(e.key) && h.payload_bytes == payload.size() &&
         h.payload_checksum == PayloadChecksum(e.shape, e.policy, payload);
}

// Raw: the expectations, 72 header bytes, the payload.
void Raw(fuzz::Input* in) {
  const Expected e = ReadExpected(in);
  BlockHeader h;
  std::string header_bytes = in->Bytes(sizeof(h));
  header_bytes.resize(sizeof(h));
  std::memcpy(&h, header_bytes.data(), sizeof(h));
  const std::vector<uint8_t> payload = AsBytes(in->Rest());
  const absl::Status s = Verify(h, e, payload);
  if (s.ok() != Matches(h, e, payload)) {
    Fail(s.ok() ? "accepted a header that does not match"
                : "rejected a header that matches");
  }
  // A caller's checksum of other bytes is never accepted.
  if (s.ok() && VerifyBlockMetadata(
                    h, e.shape, e.policy, e.fingerprint, e.key, payload.size(),
                    PayloadChecksum(e.shape, e.policy, payload) + 1)
                    .ok()) {
    Fail("accepted a payload checksum that does not match");
  }
}

// Made (`what` from the first byte): the expectations, the position (u16)
// and the xor (u8; 0 reads as 1) of the byte to change, the other
// expectations, the payload.
void Made(uint8_t what, fuzz::Input* in) {
  const Expected e = ReadExpected(in);
  const size_t position = in->U16();
  const uint8_t flip = std::max<uint8_t>(in->U8(), 1);
  const Expected other = ReadExpected(in);
  std::vector<uint8_t> payload = AsBytes(in->Rest());
  BlockHeader h =
      MakeBlockHeader(e.shape, e.policy, e.fingerprint, e.key, payload);
  if (!Verify(h, e, payload).ok()) Fail("rejected a header it made");
  switch (what % 3) {
    case 0: {  // one header byte changed
      auto* raw = reinterpret_cast<uint8_t*>(&h);
      raw[position % sizeof(h)] ^= flip;
      if (Verify(h, e, payload).ok()) Fail("accepted a changed header");
      break;
    }
    case 1: {  // one payload byte changed
      if (payload.empty()) return;
      payload[position % payload.size()] ^= flip;
      if (Verify(h, e, payload).ok()) Fail("accepted a changed payload");
      break;
    }
    case 2: {  // other expectations: accepted exactly when they match
      const bool same =
          other.shape.num_layers == e.shape.num_layers &&
          other.shape.num_kv_heads == e.shape.num_kv_heads &&
          other.shape.head_dim == e.shape.head_dim &&
          other.shape.tokens_per_block == e.shape.tokens_per_block &&
          other.policy.codec == e.policy.codec &&
          other.policy.scale_mode == e.policy.scale_mode &&
          other.policy.kivi_group_size == e.policy.kivi_group_size &&
          other.fingerprint == e.fingerprint &&
          HashString(other.key) == HashString(e.key);
      if (Verify(h, other, payload).ok() != same) {
        Fail("the answer for other expectations is wrong");
      }
      break;
    }
  }
}

}  // namespace
}  // namespace kvcache::store

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcache::fuzz::Input in(data, size);
  const uint8_t mode = in.U8();
  if (mode % 2 == 0) {
    kvcache::store::Raw(&in);
  } else {
    kvcache::store::Made(static_cast<uint8_t>(mode / 2), &in);
  }
  return 0;
}
