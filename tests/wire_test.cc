// The data plane's wire format (transport/wire.h): every header and body
// round-trips, and any other length, kind or count is refused.
#include "transport/wire.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace kvcache {
namespace {

// The headers data messages add: a status with and without its message
// count, and a data header, round-trip; any other length, or another
// message's header, is refused.
TEST(UcxWireTest, ReadStatusAndDataHeadersRoundTripAndRejectBadLengths) {
  ucx::ReadStatusHeader status;
  status.read_id = 7;
  status.token = *ucx::NewToken();
  status.layers_done = 3;
  status.num_layers = 32;
  const std::string plain = ucx::Encode(status);
  status.has_data_messages = true;
  status.data_messages = 96;
  const std::string counted = ucx::Encode(status);
  EXPECT_EQ(counted.size(), plain.size() + 4);
  auto back = ucx::DecodeReadStatus(plain);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->has_data_messages);
  EXPECT_EQ(back->layers_done, 3u);
  back = ucx::DecodeReadStatus(counted);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->has_data_messages);
  EXPECT_EQ(back->data_messages, 96u);
  EXPECT_TRUE(ucx::TokenEquals(back->token, status.token));

  ucx::ReadDataHeader data;
  data.read_id = 9;
  data.token = status.token;
  data.block = 5;
  data.offset = uint64_t{1} << 40;
  const std::string encoded = ucx::Encode(data);
  auto data_back = ucx::DecodeReadData(encoded);
  ASSERT_TRUE(data_back.ok()) << data_back.status();
  EXPECT_EQ(data_back->read_id, 9u);
  EXPECT_EQ(data_back->block, 5u);
  EXPECT_EQ(data_back->offset, uint64_t{1} << 40);
  EXPECT_FALSE(data_back->has_sequence);
  // A sequenced read's data messages carry their place in the send order.
  ucx::ReadDataHeader numbered = data;
  numbered.has_sequence = true;
  numbered.sequence = 70000;
  const std::string sequenced = ucx::Encode(numbered);
  EXPECT_EQ(sequenced.size(), encoded.size() + 4);
  data_back = ucx::DecodeReadData(sequenced);
  ASSERT_TRUE(data_back.ok()) << data_back.status();
  EXPECT_TRUE(data_back->has_sequence);
  EXPECT_EQ(data_back->sequence, 70000u);
  EXPECT_EQ(data_back->block, 5u);
  EXPECT_EQ(ucx::DecodeReadData(sequenced + "x").status().code(),
            absl::StatusCode::kInvalidArgument);

  for (const std::string& bad :
       {plain.substr(0, plain.size() - 1), counted + "x", std::string()}) {
    EXPECT_EQ(ucx::DecodeReadStatus(bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(ucx::DecodeReadData(encoded + "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ucx::DecodeReadData(counted).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Same length, another message's kind.
  std::string relabelled = encoded;
  relabelled[5] = static_cast<char>(ucx::kAmReadStatus & 0xff);
  EXPECT_EQ(ucx::DecodeReadData(relabelled).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A status of a read asked with kReadFlagReportMapped carries whether the
// node writes the destination through its own mapping, with or without a
// message count; flags it does not know, or a count that it says is not
// one, are refused.
TEST(UcxWireTest, ReadStatusWithDeliveryRoundTripsAndRejectsUnknownFlags) {
  ucx::ReadStatusHeader status;
  status.read_id = 11;
  status.token = *ucx::NewToken();
  status.layers_done = 2;
  status.num_layers = 2;
  const size_t plain_size = ucx::Encode(status).size();
  status.has_delivery = true;
  status.mapped = true;
  const std::string mapped = ucx::Encode(status);
  EXPECT_EQ(mapped.size(), plain_size + 8);
  auto back = ucx::DecodeReadStatus(mapped);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->has_delivery);
  EXPECT_TRUE(back->mapped);
  EXPECT_FALSE(back->has_data_messages);
  EXPECT_EQ(ucx::Encode(*back), mapped);

  status.mapped = false;
  status.has_data_messages = true;
  status.data_messages = 40;
  const std::string counted = ucx::Encode(status);
  EXPECT_EQ(counted.size(), plain_size + 8);
  back = ucx::DecodeReadStatus(counted);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->has_delivery);
  EXPECT_FALSE(back->mapped);
  EXPECT_TRUE(back->has_data_messages);
  EXPECT_EQ(back->data_messages, 40u);
  EXPECT_EQ(ucx::Encode(*back), counted);

  // The flags are the last four bytes, little-endian.
  std::string unknown = mapped;
  unknown[unknown.size() - 4] = 4;
  EXPECT_EQ(ucx::DecodeReadStatus(unknown).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::string uncounted = counted;
  uncounted[uncounted.size() - 4] = 0;  // a count of 40, "not counted"
  EXPECT_EQ(ucx::DecodeReadStatus(uncounted).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The two bytes after the kind are reserved and encoded as zero: a header
// with anything else there is refused, so that every accepted header is
// the encoding of what it decodes to (fuzz/regressions/fuzz_wire/).
TEST(UcxWireTest, EveryHeaderRefusesNonzeroReservedBytes) {
  const std::string headers[] = {
      ucx::Encode(ucx::WriteBlockHeader{}),
      ucx::Encode(ucx::WritePullHeader{}),
      ucx::Encode(ucx::ReadStartHeader{}),
      ucx::Encode(ucx::ReadStatusHeader{}),
      ucx::Encode(ucx::ReleaseBufferHeader{}),
      ucx::Encode(ucx::ReadDataHeader{}),
  };
  for (const std::string& header : headers) {
    for (size_t at : {6, 7}) {
      std::string bad = header;
      bad[at] = 0x10;
      absl::Status got[] = {
          ucx::DecodeWriteBlock(bad).status(),
          ucx::DecodeWritePull(bad).status(),
          ucx::DecodeReadStart(bad).status(),
          ucx::DecodeReadStatus(bad).status(),
          ucx::DecodeReleaseBuffer(bad).status(),
          ucx::DecodeReadData(bad).status(),
      };
      for (const absl::Status& s : got) {
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument)
            << "header kind " << int{header[5]} << ", byte " << at;
      }
    }
  }
}

ucx::ReadStartHeader ReadStart(uint8_t flags) {
  ucx::ReadStartHeader h;
  h.read_id = 11;
  h.token = *ucx::NewToken();
  h.flags = flags;
  h.buffer_id = 4;
  return h;
}

ucx::ReadStartBody ReadStartBodyOf3() {
  ucx::ReadStartBody body;
  body.remote_key = "packed-remote-key";
  body.destinations = {0x1000, 0x3000, uint64_t{1} << 47};
  body.client_address = "worker-address";
  body.region_base = 0x1000;
  body.region_length = uint64_t{1} << 47;
  return body;
}

// The header's counts and lengths come from the body; the body decodes to
// the same key, destinations, address and (bounded) region.
TEST(WireBodyTest, ReadStartRoundTripsWithAndWithoutBounds) {
  for (uint8_t flags :
       {uint8_t{0}, ucx::kReadFlagBounded,
        uint8_t(ucx::kReadFlagBounded | ucx::kReadFlagPerLayer)}) {
    const ucx::ReadStartBody body = ReadStartBodyOf3();
    const ucx::Message m = ucx::EncodeReadStart(ReadStart(flags), body);
    auto h = ucx::DecodeReadStart(
        absl::string_view(m.bytes).substr(0, m.header_bytes));
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->num_blocks, 3u);
    EXPECT_EQ(h->rkey_length, body.remote_key.size());
    EXPECT_EQ(h->client_address_length, body.client_address.size());
    EXPECT_EQ(h->flags, flags);
    auto back = ucx::DecodeReadStartBody(
        *h, absl::string_view(m.bytes).substr(m.header_bytes));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->remote_key, body.remote_key);
    EXPECT_EQ(back->destinations, body.destinations);
    EXPECT_EQ(back->client_address, body.client_address);
    const bool bounded = (flags & ucx::kReadFlagBounded) != 0;
    EXPECT_EQ(back->region_base, bounded ? body.region_base : 0);
    EXPECT_EQ(back->region_length, bounded ? body.region_length : 0);
    // Without bounds the message is 16 bytes shorter.
    EXPECT_EQ(m.bytes.size() - m.header_bytes, body.remote_key.size() + 8 * 3 +
                                                   body.client_address.size() +
                                                   (bounded ? 16 : 0));
  }
}

TEST(WireBodyTest, ReadStartRefusesEveryOtherSizeAndWrappingBounds) {
  const ucx::Message m = ucx::EncodeReadStart(ReadStart(ucx::kReadFlagBounded),
                                              ReadStartBodyOf3());
  const ucx::ReadStartHeader h = *ucx::DecodeReadStart(
      absl::string_view(m.bytes).substr(0, m.header_bytes));
  const std::string data = m.bytes.substr(m.header_bytes);
  for (const std::string& bad :
       {data.substr(0, data.size() - 1), data + "x", std::string()}) {
    EXPECT_EQ(ucx::DecodeReadStartBody(h, bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad.size();
  }
  // A header that claims one more block (or a longer key) than was sent.
  ucx::ReadStartHeader more = h;
  more.num_blocks = 4;
  EXPECT_FALSE(ucx::DecodeReadStartBody(more, data).ok());
  more = h;
  more.rkey_length = 0xFFFFFFFFu;
  EXPECT_FALSE(ucx::DecodeReadStartBody(more, data).ok());
  // Bounds whose end wraps past 2^64.
  ucx::ReadStartBody wraps = ReadStartBodyOf3();
  wraps.region_base = UINT64_MAX - 10;
  wraps.region_length = 11;
  const ucx::Message w =
      ucx::EncodeReadStart(ReadStart(ucx::kReadFlagBounded), wraps);
  EXPECT_EQ(ucx::DecodeReadStartBody(h, w.bytes.substr(w.header_bytes))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A read that names a buffer it does not land in (kReadFlagNamesBuffer)
// carries the buffer's id, bounds and key after everything else, with or
// without the read's own bounds; every other size, a named id of 0 and
// named bounds that wrap are refused.
TEST(WireBodyTest, ReadStartNamesABufferAndRefusesWhatDoesNotFit) {
  ucx::ReadStartBody body = ReadStartBodyOf3();
  body.named.buffer_id = 42;
  body.named.base = 0x7000000;
  body.named.length = uint64_t{1} << 30;
  body.named.remote_key = "the named buffer's packed key";
  for (uint8_t flags :
       {ucx::kReadFlagNamesBuffer,
        uint8_t(ucx::kReadFlagNamesBuffer | ucx::kReadFlagBounded)}) {
    const ucx::Message m = ucx::EncodeReadStart(ReadStart(flags), body);
    const ucx::ReadStartHeader h = *ucx::DecodeReadStart(
        absl::string_view(m.bytes).substr(0, m.header_bytes));
    const std::string data = m.bytes.substr(m.header_bytes);
    const bool bounded = (flags & ucx::kReadFlagBounded) != 0;
    EXPECT_EQ(data.size(), body.remote_key.size() + 8 * 3 +
                               body.client_address.size() + (bounded ? 16 : 0) +
                               28 + body.named.remote_key.size());
    auto back = ucx::DecodeReadStartBody(h, data);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->destinations, body.destinations);
    EXPECT_EQ(back->client_address, body.client_address);
    EXPECT_EQ(back->region_length, bounded ? body.region_length : 0);
    EXPECT_EQ(back->named.buffer_id, 42u);
    EXPECT_EQ(back->named.base, body.named.base);
    EXPECT_EQ(back->named.length, body.named.length);
    EXPECT_EQ(back->named.remote_key, body.named.remote_key);
    // The same bytes read without the flag, and cut or lengthened ones.
    ucx::ReadStartHeader unflagged = h;
    unflagged.flags &= ~ucx::kReadFlagNamesBuffer;
    EXPECT_FALSE(ucx::DecodeReadStartBody(unflagged, data).ok());
    for (size_t cut : {size_t{1}, body.named.remote_key.size(),
                       body.named.remote_key.size() + 4,
                       body.named.remote_key.size() + 28}) {
      EXPECT_EQ(ucx::DecodeReadStartBody(h, data.substr(0, data.size() - cut))
                    .status()
                    .code(),
                absl::StatusCode::kInvalidArgument)
          << cut;
    }
    EXPECT_FALSE(ucx::DecodeReadStartBody(h, data + "x").ok());
  }
  for (auto spoil : {+[](ucx::ReadStartBody& b) { b.named.buffer_id = 0; },
                     +[](ucx::ReadStartBody& b) {
                       b.named.base = UINT64_MAX - 10;
                       b.named.length = 11;
                     }}) {
    ucx::ReadStartBody bad = body;
    spoil(bad);
    const ucx::Message m =
        ucx::EncodeReadStart(ReadStart(ucx::kReadFlagNamesBuffer), bad);
    const ucx::ReadStartHeader h = *ucx::DecodeReadStart(
        absl::string_view(m.bytes).substr(0, m.header_bytes));
    EXPECT_EQ(ucx::DecodeReadStartBody(h, m.bytes.substr(m.header_bytes))
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(WireBodyTest, WritePullRoundTripsAndRefusesOtherSizes) {
  ucx::WritePullHeader h;
  h.write_id = 3;
  h.token = *ucx::NewToken();
  h.buffer_id = 8;
  h.region_base = 0x10000;
  h.region_length = 0x40000;
  ucx::WritePullBody body;
  body.remote_key = "key";
  body.blocks = {{0, 0x10000}, {7, 0x20000}, {0xFFFFFFFFu, 0x30000}};
  body.client_address = "address";
  const ucx::Message m = ucx::EncodeWritePull(h, body);
  auto header = ucx::DecodeWritePull(
      absl::string_view(m.bytes).substr(0, m.header_bytes));
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->num_blocks, 3u);
  const std::string data = m.bytes.substr(m.header_bytes);
  EXPECT_EQ(data.size(), 3 + 12 * 3 + 7u);
  auto back = ucx::DecodeWritePullBody(*header, data);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->remote_key, "key");
  EXPECT_EQ(back->client_address, "address");
  ASSERT_EQ(back->blocks.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back->blocks[i].index, body.blocks[i].index) << i;
    EXPECT_EQ(back->blocks[i].address, body.blocks[i].address) << i;
  }
  for (const std::string& bad :
       {data.substr(0, data.size() - 1), data + "x", std::string()}) {
    EXPECT_EQ(ucx::DecodeWritePullBody(*header, bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  ucx::WritePullHeader wraps = *header;
  wraps.region_base = UINT64_MAX;
  wraps.region_length = 1;
  EXPECT_EQ(ucx::DecodeWritePullBody(wraps, data).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(WireBodyTest, RegionContainsOnlyWhatLiesInside) {
  EXPECT_TRUE(ucx::RegionContains(100, 50, 100, 50));
  EXPECT_TRUE(ucx::RegionContains(100, 50, 149, 1));
  EXPECT_TRUE(ucx::RegionContains(100, 50, 150, 0));
  EXPECT_FALSE(ucx::RegionContains(100, 50, 99, 1));
  EXPECT_FALSE(ucx::RegionContains(100, 50, 149, 2));
  EXPECT_FALSE(ucx::RegionContains(100, 50, 151, 0));
  EXPECT_FALSE(ucx::RegionContains(100, 50, 100, UINT64_MAX));
  EXPECT_FALSE(ucx::RegionContains(0, 10, UINT64_MAX, 2));
}

}  // namespace
}  // namespace kvcache
