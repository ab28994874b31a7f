// fuzz_wire: every decoder of the data-plane wire (transport/wire.h) on
// bytes a peer sends. The first byte picks the decoder; the rest is its
// input. Where a decode succeeds, encoding what it decoded must give the
// input back, byte for byte:
//   headers: Encode(Decode*(bytes)) == bytes;
//   bodies:  EncodeReadStart / EncodeWritePull of the decoded header and
//            body == header bytes + body bytes (the body decoders get a
//            header whose 8-byte prefix is made valid, so that the fuzzer
//            spends its time in the body);
//   tokens:  TokenBytes(TokenFromBytes(bytes)) == bytes;
// and RegionContains agrees with 128-bit arithmetic. Any mismatch aborts.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/wire.h"

namespace kvcache::ucx {
namespace {

[[noreturn]] void Fail(const char* what, absl::string_view input) {
  std::fprintf(stderr, "fuzz_wire: %s (input of %zu bytes)\n", what,
               input.size());
  std::abort();
}

// A decode that fails must say INVALID_ARGUMENT; one that succeeds must
// round-trip.
template <typename Header>
void CheckHeader(absl::StatusOr<Header> (*decode)(absl::string_view),
                 absl::string_view input, const char* name) {
  absl::StatusOr<Header> h = decode(input);
  if (!h.ok()) {
    if (h.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail(name, input);
    }
    return;
  }
  if (Encode(*h) != input) Fail(name, input);
}

// `input` with the valid prefix (magic, version, kind) of `Header`'s
// encoding over its first 8 bytes.
template <typename Header>
std::string WithValidPrefix(absl::string_view input) {
  std::string bytes(input);
  const std::string prefix = Encode(Header{}).substr(0, 8);
  bytes.replace(0, std::min(bytes.size(), prefix.size()),
                prefix.substr(0, std::min(bytes.size(), prefix.size())));
  return bytes;
}

void CheckReadStartBody(absl::string_view input) {
  const std::string bytes = WithValidPrefix<ReadStartHeader>(input);
  const size_t header_bytes = Encode(ReadStartHeader{}).size();
  if (bytes.size() < header_bytes) return;
  absl::string_view view(bytes);
  absl::StatusOr<ReadStartHeader> h =
      DecodeReadStart(view.substr(0, header_bytes));
  if (!h.ok()) Fail("ReadStart header with a valid prefix", input);
  absl::StatusOr<ReadStartBody> body =
      DecodeReadStartBody(*h, view.substr(header_bytes));
  if (!body.ok()) {
    if (body.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("DecodeReadStartBody status", input);
    }
    return;
  }
  // Accepted bounds never wrap the address space (RegionContains needs it).
  if ((h->flags & kReadFlagBounded) != 0 &&
      body->region_length > UINT64_MAX - body->region_base) {
    Fail("DecodeReadStartBody accepted wrapping bounds", input);
  }
  // A named buffer it accepts has an id and bounds that do not wrap.
  if ((h->flags & kReadFlagNamesBuffer) != 0 &&
      (body->named.buffer_id == 0 ||
       body->named.length > UINT64_MAX - body->named.base)) {
    Fail("DecodeReadStartBody accepted a bad named buffer", input);
  }
  Message m = EncodeReadStart(*h, *body);
  if (m.header_bytes != header_bytes || m.bytes != bytes) {
    Fail("ReadStart header + body round trip", input);
  }
}

void CheckWritePullBody(absl::string_view input) {
  const std::string bytes = WithValidPrefix<WritePullHeader>(input);
  const size_t header_bytes = Encode(WritePullHeader{}).size();
  if (bytes.size() < header_bytes) return;
  absl::string_view view(bytes);
  absl::StatusOr<WritePullHeader> h =
      DecodeWritePull(view.substr(0, header_bytes));
  if (!h.ok()) Fail("WritePull header with a valid prefix", input);
  absl::StatusOr<WritePullBody> body =
      DecodeWritePullBody(*h, view.substr(header_bytes));
  if (!body.ok()) {
    if (body.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("DecodeWritePullBody status", input);
    }
    return;
  }
  if (h->region_length > UINT64_MAX - h->region_base) {
    Fail("DecodeWritePullBody accepted a wrapping region", input);
  }
  Message m = EncodeWritePull(*h, *body);
  if (m.header_bytes != header_bytes || m.bytes != bytes) {
    Fail("WritePull header + body round trip", input);
  }
}

void CheckToken(absl::string_view input) {
  absl::StatusOr<Token> t = TokenFromBytes(input);
  if (t.ok() != (input.size() == 16)) Fail("TokenFromBytes size", input);
  if (t.ok() && TokenBytes(*t) != input) Fail("token round trip", input);
  if (t.ok() && !TokenEquals(*t, *t)) Fail("TokenEquals", input);
}

uint64_t U64At(absl::string_view in, size_t at) {
  uint64_t v = 0;
  if (in.size() >= at + 8) std::memcpy(&v, in.data() + at, 8);
  return v;
}

void CheckRegionContains(absl::string_view input) {
  const uint64_t base = U64At(input, 0);
  const uint64_t length = U64At(input, 8);
  const uint64_t address = U64At(input, 16);
  const uint64_t size = U64At(input, 24);
  using U128 = unsigned __int128;
  if (U128{base} + length > U128{UINT64_MAX}) return;  // decoders refuse it
  const bool want =
      address >= base && U128{address} + size <= U128{base} + U128{length};
  if (RegionContains(base, length, address, size) != want) {
    Fail("RegionContains", input);
  }
}

}  // namespace
}  // namespace kvcache::ucx

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcache::ucx;  // NOLINT(build/namespaces)
  if (size == 0) return 0;
  const absl::string_view input(reinterpret_cast<const char*>(data) + 1,
                                size - 1);
  switch (data[0] % 10) {
    case 0:
      CheckHeader<WriteBlockHeader>(DecodeWriteBlock, input, "WriteBlock");
      break;
    case 1:
      CheckHeader<WritePullHeader>(DecodeWritePull, input, "WritePull");
      break;
    case 2:
      CheckHeader<ReadStartHeader>(DecodeReadStart, input, "ReadStart");
      break;
    case 3:
      CheckHeader<ReadStatusHeader>(DecodeReadStatus, input, "ReadStatus");
      break;
    case 4:
      CheckHeader<ReleaseBufferHeader>(DecodeReleaseBuffer, input,
                                       "ReleaseBuffer");
      break;
    case 5:
      CheckHeader<ReadDataHeader>(DecodeReadData, input, "ReadData");
      break;
    case 6:
      CheckReadStartBody(input);
      break;
    case 7:
      CheckWritePullBody(input);
      break;
    case 8:
      CheckToken(input);
      break;
    case 9:
      CheckRegionContains(input);
      break;
  }
  return 0;
}
