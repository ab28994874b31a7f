// The UCX data plane's wire format: active-message ids, their headers, and
// the per-lease token. Shared by the node (service/ucx/data_plane.h) and the
// client (client/ucx/).
//
// Messages (all AMs carry UCP_AM_SEND_FLAG_REPLY so that the node knows the
// sending endpoint; every header starts with magic "KVUX" and a version):
//
//   kAmWriteBlock  client -> node  header WriteBlockHeader, data = the fp16
//                  bytes of block `index` of write `write_id` (rendezvous for
//                  large blocks: the node receives straight into staging).
//   kAmReadStart   client -> node  header ReadStartHeader, data = the packed
//                  remote key of the client's destination region, one
//                  little-endian u64 destination address per block, then
//                  the client's own worker address (the node puts through
//                  an endpoint of its own to it when the client connected
//                  to the node's worker address rather than its listener),
//                  then, when the header's flags say so (kReadFlagBounded:
//                  to nodes that offer DataPlaneInfo.bounded_reads), the
//                  region's base address and length (u64 each): the node
//                  refuses a destination outside them; then, with
//                  kReadFlagNamesBuffer (to nodes that offer
//                  DataPlaneInfo.keeps_named_buffers), a long-lived client
//                  buffer the read does not land in: its id, base address
//                  and length (u64 each), the length of its packed remote
//                  key (u32) and that key. The node keeps the key as it
//                  keeps a read's own buffer's and, where it maps the buffer
//                  (shared memory), faults its mapping in ahead of the reads
//                  that will land there. A client that decodes a read
//                  itself lands it in a pooled buffer and names the
//                  DataBuffer it decodes into, which later reads that the
//                  node decodes into it land in directly.
//   kAmWritePull   client -> node  header WritePullHeader, data = the packed
//                  remote key of a long-lived client buffer (a DataBuffer)
//                  holding fp16 blocks of write `write_id`, then per block
//                  its index (u32) and address (u64), then the client's own
//                  worker address; little-endian. Sent instead of one
//                  kAmWriteBlock per block to nodes that offer it
//                  (DataPlaneInfo.pull_writes): the node maps the buffer
//                  (ucp_rkey_ptr: shared memory) and encodes each block
//                  straight from it, so UCX copies nothing. Every block must
//                  lie inside [region_base, region_base + region_length). A
//                  node that cannot map the buffer fails the write with
//                  UNIMPLEMENTED; the client then sends that node blocks.
//   kAmReleaseBuffer client -> node  header ReleaseBufferHeader: the client
//                  freed its long-lived buffer `buffer_id`; the node drops
//                  the remote key it kept for it on this connection.
//   kAmReadStatus  node -> client  header ReadStatusHeader (with the read's
//                  token, which names the read on the client), data = an
//                  error message when `code` is not 0. Sent after each
//                  layer's puts have completed at the client (`layers_done`
//                  counts them; `layers_done == num_layers` ends the read)
//                  or once with the error that ended the read.
//   kAmReadData    node -> client  header ReadDataHeader, data = bytes of
//                  block `block` of the read named by the token, for the
//                  client to place at its destination + `offset`. Sent
//                  instead of puts to a client that asked for it
//                  (kReadFlagMessages, to nodes that offer
//                  DataPlaneInfo.message_reads) where UCX would carry a put
//                  as active messages anyway (TCP): large ones go by
//                  rendezvous, and the client receives them straight into
//                  its registered region, so the bytes are copied by the
//                  kernel only, where an emulated put copies them twice
//                  more. The client checks every piece against its region
//                  and block count. The statuses of such a read carry
//                  `data_messages`, the number of kAmReadData messages sent
//                  before them: the client applies a status only once the
//                  first that many messages of the read have landed, not
//                  merely that many (a later eager piece lands while an
//                  earlier rendezvous one is still being received). "First"
//                  is by `sequence`, the message's place in the node's send
//                  order, which the node writes when the read asks for it
//                  (kReadFlagSequenced, to nodes that offer
//                  DataPlaneInfo.sequenced_data): then no assumption about
//                  the order UCX delivers messages in is needed. Without
//                  it (an older node) the client numbers messages as they
//                  arrive, which holds only while they arrive in send order.
//                  To a sequenced read the node sends a layer's status right
//                  after the layer's messages (only the last one waits for
//                  a flush); the client applies the statuses it holds in the
//                  order they came. An unsequenced read gets every layer's
//                  messages at once and each status after a flush.
//
// Invariants:
//  * A token is 16 bytes from the kernel's CSPRNG (getrandom), issued by the
//    node through the gRPC control plane for exactly one lease, and compared
//    in constant time.
//  * Every header is fixed-size, little-endian, and parsed with its length
//    checked: a short, long or unknown header is rejected, never read past;
//    so is one whose two reserved bytes (after the kind) are not zero.
#ifndef KVCACHE_TRANSPORT_WIRE_H_
#define KVCACHE_TRANSPORT_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache::ucx {

inline constexpr unsigned kAmWriteBlock = 0x4b01;
inline constexpr unsigned kAmReadStart = 0x4b02;
inline constexpr unsigned kAmReadStatus = 0x4b03;
inline constexpr unsigned kAmReleaseBuffer = 0x4b04;
inline constexpr unsigned kAmWritePull = 0x4b05;
inline constexpr unsigned kAmReadData = 0x4b06;

// Active-message data of at least this many bytes is sent by rendezvous,
// so that the receiver places it straight where it belongs.
inline constexpr size_t kRendezvousBytes = 64 << 10;

inline constexpr uint32_t kWireMagic = 0x5855564b;  // "KVUX"
inline constexpr uint8_t kWireVersion = 2;

using Token = std::array<uint8_t, 16>;

// A fresh token from getrandom(2). INTERNAL if the kernel refuses.
absl::StatusOr<Token> NewToken();
// Constant-time equality.
bool TokenEquals(const Token& a, const Token& b);
std::string TokenBytes(const Token& token);
// INVALID_ARGUMENT unless `bytes` is exactly 16 bytes.
absl::StatusOr<Token> TokenFromBytes(absl::string_view bytes);

struct WriteBlockHeader {
  uint64_t write_id = 0;
  Token token{};
  uint32_t index = 0;
  uint64_t length = 0;  // bytes of data that follow
};

struct WritePullHeader {
  uint64_t write_id = 0;
  Token token{};
  uint32_t num_blocks = 0;
  uint32_t rkey_length = 0;
  uint32_t client_address_length = 0;
  // The buffer's id (unique within the client process): the node may keep
  // its unpacked key on this connection, as for reads.
  uint64_t buffer_id = 0;
  uint64_t region_base = 0;
  uint64_t region_length = 0;
};

struct ReadStartHeader {
  uint64_t read_id = 0;
  Token token{};
  uint32_t num_blocks = 0;
  uint32_t rkey_length = 0;
  uint32_t client_address_length = 0;
  // kReadFlagPerLayer: put layer by layer and report each layer (else whole
  // blocks, one report); kReadFlagBounded: the region's bounds follow;
  // kReadFlagMessages: the client accepts kAmReadData in place of puts;
  // kReadFlagSequenced: and wants them numbered (ReadDataHeader::sequence).
  uint8_t flags = 0;
  // 0: the remote key is for this read only, and the node destroys it when
  // the read ends. Otherwise the id (unique within the client process) of
  // a long-lived client buffer the key covers: the node may keep the
  // unpacked key for later reads into the same buffer on this connection,
  // until kAmReleaseBuffer names it or the connection ends.
  uint64_t buffer_id = 0;
};

inline constexpr uint8_t kReadFlagPerLayer = 1;
inline constexpr uint8_t kReadFlagBounded = 2;
inline constexpr uint8_t kReadFlagMessages = 4;
inline constexpr uint8_t kReadFlagSequenced = 8;
// The client asks the node to say in each status whether it writes the
// destination through its own mapping of it (shared memory):
// ReadStatusHeader::has_delivery. Only to nodes that advertise it
// (DataPlaneInfo.decodes_into_destination); others refuse unknown flags.
inline constexpr uint8_t kReadFlagReportMapped = 16;
// The body ends with a named buffer (ReadStartBody::named). Only to nodes
// that advertise it (DataPlaneInfo.keeps_named_buffers).
inline constexpr uint8_t kReadFlagNamesBuffer = 32;

struct ReleaseBufferHeader {
  uint64_t buffer_id = 0;
};

// A read's successful statuses report layers of the same num_layers, after
// at least as many data messages as the one before; a client fails the
// read on any other. One that reports no more layers than an earlier one
// (statuses sent after flushes can complete out of order) is dropped. A
// failure (code != 0) ends the read.
struct ReadStatusHeader {
  uint64_t read_id = 0;
  Token token{};
  uint32_t layers_done = 0;
  uint32_t num_layers = 0;
  int32_t code = 0;  // absl::StatusCode of the failure; 0 while fine
  // Reads delivered by kAmReadData only (the header is 4 bytes longer
  // then; statuses of other reads keep the shorter form that clients
  // without kReadFlagMessages expect): the data messages sent before this
  // status.
  bool has_data_messages = false;
  uint32_t data_messages = 0;
  // Reads asked with kReadFlagReportMapped only (the header is 8 bytes
  // longer then, whether or not it counts data messages): whether the node
  // writes this read's destination through its own mapping of it.
  bool has_delivery = false;
  bool mapped = false;
};

struct ReadDataHeader {
  uint64_t read_id = 0;
  Token token{};
  uint32_t block = 0;   // index into the read's destinations
  uint64_t offset = 0;  // of the data within the block
  // Reads with kReadFlagSequenced only (the header is 4 bytes longer then):
  // this message's place among the read's data messages in the order the
  // node sent them, from 0.
  bool has_sequence = false;
  uint32_t sequence = 0;
};

std::string Encode(const WriteBlockHeader& h);
std::string Encode(const WritePullHeader& h);
std::string Encode(const ReadStartHeader& h);
std::string Encode(const ReadStatusHeader& h);
std::string Encode(const ReleaseBufferHeader& h);
std::string Encode(const ReadDataHeader& h);
// INVALID_ARGUMENT for a header of the wrong size, magic or version.
absl::StatusOr<WriteBlockHeader> DecodeWriteBlock(absl::string_view bytes);
absl::StatusOr<WritePullHeader> DecodeWritePull(absl::string_view bytes);
absl::StatusOr<ReadStartHeader> DecodeReadStart(absl::string_view bytes);
absl::StatusOr<ReadStatusHeader> DecodeReadStatus(absl::string_view bytes);
absl::StatusOr<ReleaseBufferHeader> DecodeReleaseBuffer(
    absl::string_view bytes);
absl::StatusOr<ReadDataHeader> DecodeReadData(absl::string_view bytes);

// ---- Message bodies: what follows the header of kAmReadStart and
// kAmWritePull. Every integer is little-endian.

// kAmReadStart: the packed remote key of the destination region, one u64
// destination address per block, the client's worker address, then (with
// kReadFlagBounded in the header's flags) the region's base and length,
// then (with kReadFlagNamesBuffer) a named buffer.
struct NamedBuffer {
  uint64_t buffer_id = 0;  // never 0
  uint64_t base = 0;
  uint64_t length = 0;
  absl::string_view remote_key;
};
struct ReadStartBody {
  absl::string_view remote_key;
  std::vector<uint64_t> destinations;
  absl::string_view client_address;
  uint64_t region_base = 0;  // kReadFlagBounded only
  uint64_t region_length = 0;
  NamedBuffer named;  // kReadFlagNamesBuffer only
};

// kAmWritePull: the packed remote key of the client's buffer, per block its
// index (u32) and address (u64), then the client's worker address. The
// buffer's bounds are in the header.
struct WritePullEntry {
  uint32_t index = 0;
  uint64_t address = 0;
};
struct WritePullBody {
  absl::string_view remote_key;
  std::vector<WritePullEntry> blocks;
  absl::string_view client_address;
};

// A whole message: the header's bytes, then the body's.
struct Message {
  std::string bytes;
  size_t header_bytes = 0;
};
// The header's counts and lengths (num_blocks, rkey_length,
// client_address_length) are taken from `body`; its flags decide whether
// the bounds and the named buffer are sent.
Message EncodeReadStart(ReadStartHeader header, const ReadStartBody& body);
Message EncodeWritePull(WritePullHeader header, const WritePullBody& body);

// The body that follows `header`, as views into `data` (which must outlive
// them). INVALID_ARGUMENT when the size of `data` is not exactly what the
// header's counts, lengths and flags say (a named buffer's key length
// included), the region's or the named buffer's bounds wrap the address
// space, or the named buffer's id is 0.
absl::StatusOr<ReadStartBody> DecodeReadStartBody(const ReadStartHeader& header,
                                                  absl::string_view data);
absl::StatusOr<WritePullBody> DecodeWritePullBody(const WritePullHeader& header,
                                                  absl::string_view data);

// Whether the `size` bytes at `address` lie inside the region of `length`
// bytes at `base` (which must not wrap: the decoders check it). A block
// outside would be read or written outside the peer's mapping of the
// region, which UCX does not bound over shared memory.
bool RegionContains(uint64_t base, uint64_t length, uint64_t address,
                    uint64_t size);

}  // namespace kvcache::ucx

#endif  // KVCACHE_TRANSPORT_WIRE_H_
