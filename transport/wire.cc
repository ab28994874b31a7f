#include "transport/wire.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcache::ucx {
namespace {

// Appends little-endian integers; reads them back with bounds checked by
// the caller (the decoders check the total size first).
class Writer {
 public:
  // A message body: no prefix.
  Writer() = default;
  // A header: the prefix (magic, version, kind) first.
  explicit Writer(unsigned kind) {
    U32(kWireMagic);
    U8(kWireVersion);
    U8(static_cast<uint8_t>(kind & 0xff));
    U16(0);
  }
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void Bytes(const Token& t) {
    out_.append(reinterpret_cast<const char*>(t.data()), t.size());
  }
  void Bytes(absl::string_view bytes) {
    out_.append(bytes.data(), bytes.size());
  }
  std::string Take() { return std::move(out_); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
  }
  std::string out_;
};

class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  uint8_t U8() { return static_cast<uint8_t>(in_[pos_++]); }
  uint16_t U16() { return static_cast<uint16_t>(Le(2)); }
  uint32_t U32() { return static_cast<uint32_t>(Le(4)); }
  uint64_t U64() { return Le(8); }
  void Bytes(Token* t) {
    std::memcpy(t->data(), in_.data() + pos_, t->size());
    pos_ += t->size();
  }
  absl::string_view View(size_t n) {
    absl::string_view v = in_.substr(pos_, n);
    pos_ += n;
    return v;
  }

 private:
  uint64_t Le(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) {
      v |= static_cast<uint64_t>(static_cast<uint8_t>(in_[pos_++])) << (8 * i);
    }
    return v;
  }
  absl::string_view in_;
  size_t pos_ = 0;
};

constexpr size_t kPrefixBytes = 8;
constexpr size_t kWriteBlockBytes = kPrefixBytes + 8 + 16 + 4 + 8;
constexpr size_t kReadStartBytes = kPrefixBytes + 8 + 16 + 4 + 4 + 4 + 1 + 8;
constexpr size_t kReleaseBufferBytes = kPrefixBytes + 8;
constexpr size_t kWritePullBytes =
    kPrefixBytes + 8 + 16 + 4 + 4 + 4 + 8 + 8 + 8;
constexpr size_t kReadStatusBytes = kPrefixBytes + 8 + 16 + 4 + 4 + 4;
constexpr size_t kReadStatusCountedBytes = kReadStatusBytes + 4;
// The form with delivery flags: data_messages (0 when not counted), then
// the flags below.
constexpr size_t kReadStatusDeliveryBytes = kReadStatusBytes + 8;
constexpr uint32_t kDeliveryCounted = 1;
constexpr uint32_t kDeliveryMapped = 2;
constexpr size_t kReadDataBytes = kPrefixBytes + 8 + 16 + 4 + 8;
constexpr size_t kReadDataSequencedBytes = kReadDataBytes + 4;
// Body parts: a kAmWritePull entry (index u32, address u64), a kAmReadStart
// destination (u64) and the region's bounds (base, length: u64 each).
constexpr uint64_t kWritePullEntryBytes = 4 + 8;
constexpr uint64_t kDestinationBytes = 8;
constexpr uint64_t kReadBoundsBytes = 8 + 8;
constexpr uint64_t kNamedBufferBytes = 8 + 8 + 8 + 4;  // then its key

absl::Status CheckPrefix(absl::string_view bytes, size_t want, unsigned kind,
                         Reader* r) {
  if (bytes.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data-plane header of ", bytes.size(), " bytes; expected ", want));
  }
  uint32_t magic = r->U32();
  uint8_t version = r->U8();
  uint8_t k = r->U8();
  uint16_t reserved = r->U16();
  // Reserved bytes other than zero are refused: an accepted header is the
  // encoding of what it decodes to.
  if (magic != kWireMagic || version != kWireVersion ||
      k != static_cast<uint8_t>(kind & 0xff) || reserved != 0) {
    return absl::InvalidArgumentError(
        "data-plane header with a bad magic, version, kind or reserved bytes");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Token> NewToken() {
  Token t;
  size_t filled = 0;
  while (filled < t.size()) {
    ssize_t n = getrandom(t.data() + filled, t.size() - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", strerror(errno)));
    }
    filled += static_cast<size_t>(n);
  }
  return t;
}

bool TokenEquals(const Token& a, const Token& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

std::string TokenBytes(const Token& token) {
  return std::string(reinterpret_cast<const char*>(token.data()), token.size());
}

absl::StatusOr<Token> TokenFromBytes(absl::string_view bytes) {
  Token t;
  if (bytes.size() != t.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data-plane token of ", bytes.size(), " bytes"));
  }
  std::memcpy(t.data(), bytes.data(), t.size());
  return t;
}

std::string Encode(const WriteBlockHeader& h) {
  Writer w(kAmWriteBlock);
  w.U64(h.write_id);
  w.Bytes(h.token);
  w.U32(h.index);
  w.U64(h.length);
  return w.Take();
}

std::string Encode(const WritePullHeader& h) {
  Writer w(kAmWritePull);
  w.U64(h.write_id);
  w.Bytes(h.token);
  w.U32(h.num_blocks);
  w.U32(h.rkey_length);
  w.U32(h.client_address_length);
  w.U64(h.buffer_id);
  w.U64(h.region_base);
  w.U64(h.region_length);
  return w.Take();
}

std::string Encode(const ReadStartHeader& h) {
  Writer w(kAmReadStart);
  w.U64(h.read_id);
  w.Bytes(h.token);
  w.U32(h.num_blocks);
  w.U32(h.rkey_length);
  w.U32(h.client_address_length);
  w.U8(h.flags);
  w.U64(h.buffer_id);
  return w.Take();
}

std::string Encode(const ReleaseBufferHeader& h) {
  Writer w(kAmReleaseBuffer);
  w.U64(h.buffer_id);
  return w.Take();
}

std::string Encode(const ReadStatusHeader& h) {
  Writer w(kAmReadStatus);
  w.U64(h.read_id);
  w.Bytes(h.token);
  w.U32(h.layers_done);
  w.U32(h.num_layers);
  w.U32(static_cast<uint32_t>(h.code));
  if (h.has_delivery) {
    w.U32(h.has_data_messages ? h.data_messages : 0);
    w.U32((h.has_data_messages ? kDeliveryCounted : 0) |
          (h.mapped ? kDeliveryMapped : 0));
  } else if (h.has_data_messages) {
    w.U32(h.data_messages);
  }
  return w.Take();
}

std::string Encode(const ReadDataHeader& h) {
  Writer w(kAmReadData);
  w.U64(h.read_id);
  w.Bytes(h.token);
  w.U32(h.block);
  w.U64(h.offset);
  if (h.has_sequence) w.U32(h.sequence);
  return w.Take();
}

absl::StatusOr<WriteBlockHeader> DecodeWriteBlock(absl::string_view bytes) {
  Reader r(bytes);
  if (absl::Status s = CheckPrefix(bytes, kWriteBlockBytes, kAmWriteBlock, &r);
      !s.ok()) {
    return s;
  }
  WriteBlockHeader h;
  h.write_id = r.U64();
  r.Bytes(&h.token);
  h.index = r.U32();
  h.length = r.U64();
  return h;
}

absl::StatusOr<WritePullHeader> DecodeWritePull(absl::string_view bytes) {
  Reader r(bytes);
  if (absl::Status s = CheckPrefix(bytes, kWritePullBytes, kAmWritePull, &r);
      !s.ok()) {
    return s;
  }
  WritePullHeader h;
  h.write_id = r.U64();
  r.Bytes(&h.token);
  h.num_blocks = r.U32();
  h.rkey_length = r.U32();
  h.client_address_length = r.U32();
  h.buffer_id = r.U64();
  h.region_base = r.U64();
  h.region_length = r.U64();
  return h;
}

absl::StatusOr<ReadStartHeader> DecodeReadStart(absl::string_view bytes) {
  Reader r(bytes);
  if (absl::Status s = CheckPrefix(bytes, kReadStartBytes, kAmReadStart, &r);
      !s.ok()) {
    return s;
  }
  ReadStartHeader h;
  h.read_id = r.U64();
  r.Bytes(&h.token);
  h.num_blocks = r.U32();
  h.rkey_length = r.U32();
  h.client_address_length = r.U32();
  h.flags = r.U8();
  h.buffer_id = r.U64();
  return h;
}

absl::StatusOr<ReleaseBufferHeader> DecodeReleaseBuffer(
    absl::string_view bytes) {
  Reader r(bytes);
  if (absl::Status s =
          CheckPrefix(bytes, kReleaseBufferBytes, kAmReleaseBuffer, &r);
      !s.ok()) {
    return s;
  }
  ReleaseBufferHeader h;
  h.buffer_id = r.U64();
  return h;
}

absl::StatusOr<ReadStatusHeader> DecodeReadStatus(absl::string_view bytes) {
  Reader r(bytes);
  const bool delivery = bytes.size() == kReadStatusDeliveryBytes;
  const bool counted = bytes.size() == kReadStatusCountedBytes;
  if (absl::Status s = CheckPrefix(bytes,
                                   delivery  ? kReadStatusDeliveryBytes
                                   : counted ? kReadStatusCountedBytes
                                             : kReadStatusBytes,
                                   kAmReadStatus, &r);
      !s.ok()) {
    return s;
  }
  ReadStatusHeader h;
  h.read_id = r.U64();
  r.Bytes(&h.token);
  h.layers_done = r.U32();
  h.num_layers = r.U32();
  h.code = static_cast<int32_t>(r.U32());
  if (counted) {
    h.has_data_messages = true;
    h.data_messages = r.U32();
  }
  if (delivery) {
    h.has_delivery = true;
    h.data_messages = r.U32();
    const uint32_t flags = r.U32();
    // Like reserved bytes: an accepted header is the encoding of what it
    // decodes to.
    if ((flags & ~(kDeliveryCounted | kDeliveryMapped)) != 0 ||
        ((flags & kDeliveryCounted) == 0 && h.data_messages != 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("read status with unknown delivery flags ", flags));
    }
    h.has_data_messages = (flags & kDeliveryCounted) != 0;
    h.mapped = (flags & kDeliveryMapped) != 0;
  }
  return h;
}

absl::StatusOr<ReadDataHeader> DecodeReadData(absl::string_view bytes) {
  Reader r(bytes);
  const bool sequenced = bytes.size() == kReadDataSequencedBytes;
  if (absl::Status s = CheckPrefix(
          bytes, sequenced ? kReadDataSequencedBytes : kReadDataBytes,
          kAmReadData, &r);
      !s.ok()) {
    return s;
  }
  ReadDataHeader h;
  h.read_id = r.U64();
  r.Bytes(&h.token);
  h.block = r.U32();
  h.offset = r.U64();
  if (sequenced) {
    h.has_sequence = true;
    h.sequence = r.U32();
  }
  return h;
}

bool RegionContains(uint64_t base, uint64_t length, uint64_t address,
                    uint64_t size) {
  return address >= base && address - base <= length &&
         size <= length - (address - base);
}

Message EncodeReadStart(ReadStartHeader header, const ReadStartBody& body) {
  const bool bounded = (header.flags & kReadFlagBounded) != 0;
  header.num_blocks = static_cast<uint32_t>(body.destinations.size());
  header.rkey_length = static_cast<uint32_t>(body.remote_key.size());
  header.client_address_length =
      static_cast<uint32_t>(body.client_address.size());
  Message m;
  m.bytes = Encode(header);
  m.header_bytes = m.bytes.size();
  Writer w;
  w.Bytes(body.remote_key);
  for (uint64_t d : body.destinations) w.U64(d);
  w.Bytes(body.client_address);
  if (bounded) {
    w.U64(body.region_base);
    w.U64(body.region_length);
  }
  if ((header.flags & kReadFlagNamesBuffer) != 0) {
    w.U64(body.named.buffer_id);
    w.U64(body.named.base);
    w.U64(body.named.length);
    w.U32(static_cast<uint32_t>(body.named.remote_key.size()));
    w.Bytes(body.named.remote_key);
  }
  m.bytes += w.Take();
  return m;
}

absl::StatusOr<ReadStartBody> DecodeReadStartBody(const ReadStartHeader& h,
                                                  absl::string_view data) {
  const bool bounded = (h.flags & kReadFlagBounded) != 0;
  const bool named = (h.flags & kReadFlagNamesBuffer) != 0;
  const uint64_t want =
      uint64_t{h.rkey_length} + kDestinationBytes * h.num_blocks +
      h.client_address_length + (bounded ? kReadBoundsBytes : 0);
  uint64_t named_key_length = 0;
  if (named && data.size() >= want + kNamedBufferBytes) {
    named_key_length = Reader(data.substr(want + kNamedBufferBytes - 4)).U32();
  }
  if (named && data.size() != want + kNamedBufferBytes + named_key_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "read request names ", h.num_blocks, " blocks, keys of ", h.rkey_length,
        " + ", h.client_address_length, " bytes", bounded ? " with bounds" : "",
        " and a named buffer in ", data.size(), " bytes; expected ",
        want + kNamedBufferBytes, " plus its key (", named_key_length, ")"));
  }
  if (!named && data.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "read request names ", h.num_blocks, " blocks and keys of ",
        h.rkey_length, " + ", h.client_address_length, " bytes",
        bounded ? " with bounds" : "", " in ", data.size(), " bytes; expected ",
        want));
  }
  Reader r(data);
  ReadStartBody body;
  body.remote_key = r.View(h.rkey_length);
  body.destinations.resize(h.num_blocks);
  for (uint64_t& d : body.destinations) d = r.U64();
  body.client_address = r.View(h.client_address_length);
  if (bounded) {
    body.region_base = r.U64();
    body.region_length = r.U64();
    if (body.region_length > UINT64_MAX - body.region_base) {
      return absl::InvalidArgumentError("read region wraps the address space");
    }
  }
  if (named) {
    body.named.buffer_id = r.U64();
    body.named.base = r.U64();
    body.named.length = r.U64();
    body.named.remote_key = r.View(r.U32());
    if (body.named.buffer_id == 0) {
      return absl::InvalidArgumentError("a named buffer with id 0");
    }
    if (body.named.length > UINT64_MAX - body.named.base) {
      return absl::InvalidArgumentError("named buffer wraps the address space");
    }
  }
  return body;
}

Message EncodeWritePull(WritePullHeader header, const WritePullBody& body) {
  header.num_blocks = static_cast<uint32_t>(body.blocks.size());
  header.rkey_length = static_cast<uint32_t>(body.remote_key.size());
  header.client_address_length =
      static_cast<uint32_t>(body.client_address.size());
  Message m;
  m.bytes = Encode(header);
  m.header_bytes = m.bytes.size();
  Writer w;
  w.Bytes(body.remote_key);
  for (const WritePullEntry& e : body.blocks) {
    w.U32(e.index);
    w.U64(e.address);
  }
  w.Bytes(body.client_address);
  m.bytes += w.Take();
  return m;
}

absl::StatusOr<WritePullBody> DecodeWritePullBody(const WritePullHeader& h,
                                                  absl::string_view data) {
  const uint64_t want = uint64_t{h.rkey_length} +
                        kWritePullEntryBytes * h.num_blocks +
                        h.client_address_length;
  if (data.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("write pull names ", h.num_blocks, " blocks and keys of ",
                     h.rkey_length, " + ", h.client_address_length,
                     " bytes in ", data.size(), " bytes; expected ", want));
  }
  if (h.region_length > UINT64_MAX - h.region_base) {
    return absl::InvalidArgumentError("write region wraps the address space");
  }
  Reader r(data);
  WritePullBody body;
  body.remote_key = r.View(h.rkey_length);
  body.blocks.resize(h.num_blocks);
  for (WritePullEntry& e : body.blocks) {
    e.index = r.U32();
    e.address = r.U64();
  }
  body.client_address = r.View(h.client_address_length);
  return body;
}

}  // namespace kvcache::ucx
