// kvcache::Client — the C++ client of a kvcache node, for prefill and decode
// workers.
//
// Contract:
//  * Every call takes an optional CallOptions (kvcache/call_options.h): its
//    deadline is CallDeadline(call, ClientOptions::timeout), set on every
//    RPC of the call and bounding every data-plane wait; past it the call
//    returns DEADLINE_EXCEEDED (a data-plane transfer still running then
//    gets 250 ms to end on its own, then is stopped by closing the
//    connection, which fails the other calls on it). Its CancelToken, when it
//    fires, cancels the RPC in flight (grpc::ClientContext::TryCancel) and the
//    call returns CANCELLED at once; a call made with a token cancelled
//    already fails with CANCELLED before anything is sent. Bytes that a Put
//    or Get has already started moving over the data plane finish moving
//    first (bounded by the deadline), because cutting a transfer short
//    closes the connection that other calls share; PendingRead's waits end
//    at once (the transfer itself goes on, see PendingRead).
//  * Status codes as the node defines them: INVALID_ARGUMENT bad
//    shape/key/codec, NOT_FOUND miss (or unknown namespace),
//    RESOURCE_EXHAUSTED pool full (RetryAfterMs() tells when to retry),
//    FAILED_PRECONDITION layout mismatch or stale lease, UNAVAILABLE node
//    down or draining, DATA_LOSS a stored block failed its checksum (the
//    node has dropped it; treat as a miss and recompute).
//  * Keys are opaque byte strings of 1 to 64 bytes, normally chained prefix
//    hashes; a block's parent defaults to the previous block of the same Put.
//  * A block's fp16 tensor is layer-major: for each layer, K then V, each a
//    contiguous [tokens_per_block][num_kv_heads][head_dim] array of IEEE
//    half bit patterns (see docs/architecture.md).
//  * A Client is thread-safe; calls may be made from many threads at once.
#ifndef KVCACHE_CLIENT_CLIENT_H_
#define KVCACHE_CLIENT_CLIENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvcache/call_options.h"
#include "kvcache/codec.h"

namespace kvcache {

// Where KV bytes travel. The control plane is gRPC either way.
enum class DataPlane {
  // UCX when the node offers it (BeginWrite / BeginRead answer with its
  // address) and this process can start UCX; inline gRPC otherwise, and as
  // a fallback when a UCX transfer fails for want of a connection.
  kAuto,
  kUcx,   // UCX only: a node without a data plane is an error
  kGrpc,  // inline gRPC messages only
};

// TLS to a node that serves it (kvcache-node --tls-cert). All paths are
// PEM files, read when the client connects (a rotated client certificate
// takes a new Client).
struct TlsOptions {
  std::string ca_file;    // the CA bundle the node's certificate chains to
  std::string cert_file;  // with key_file: this client's certificate (mTLS,
  std::string key_file;   // for a node with --tls-client-ca)
  // The name checked against the node's certificate; empty: the target's
  // host.
  std::string server_name;

  bool enabled() const { return !ca_file.empty(); }
};

struct ClientOptions {
  std::string target;  // "host:port" of the node's gRPC listener
  // Empty ca_file: plaintext. INVALID_ARGUMENT at Connect for a file that
  // cannot be read, or a certificate without its key.
  TlsOptions tls;
  // The tenant's bearer token for a node run with --tenants, sent as
  // `authorization: Bearer TOKEN` with every call; empty: none (an open
  // node, or a tenant known by its client certificate). Printable ASCII
  // without spaces, else INVALID_ARGUMENT at Connect. Without TLS it
  // crosses the network readable.
  std::string bearer_token;
  // A call's budget when its CallOptions give neither timeout nor deadline.
  absl::Duration timeout = absl::Seconds(10);
  // Largest gRPC message either way; a Put larger than this is split.
  int max_message_bytes = 256 << 20;
  DataPlane data_plane = DataPlane::kAuto;
  // Registered memory kept for reuse once freed (DataBuffers, and the
  // regions Get lands blocks in), so that later buffers and reads need no
  // fresh mapping and nodes keep their keys; 0 frees at once.
  size_t max_idle_buffer_bytes = size_t{256} << 20;
  // fp16 reads (Get, GetInto) ask the node for the stored encoding and
  // decode it on this client's CPU: fp8 blocks travel at half the bytes and
  // KIVI at a third to a fifth, the node decodes nothing, and the caller
  // gets the same bytes as from the node's decoder, bit for bit (one codec
  // implementation). GetInto lands the encoding in a pooled DataBuffer of
  // this client and decodes layer l into the caller's memory when layer l
  // is waited for (PendingRead::WaitLayer, Wait), on the waiting thread.
  // Except where the node writes into this client's memory itself (shared
  // memory, which a read's status reports): a GetInto into a DataBuffer
  // then asks that node to decode straight into it, in the pass that
  // checks the stored bytes, with no landing buffer (docs/client.md).
  // false: the node decodes and fp16 travels.
  bool decode_on_client = true;
};

// The bearer token in file `path` (its first line, surrounding whitespace
// removed), as tools take it with --token-file. INVALID_ARGUMENT when the
// file cannot be read or holds no token.
absl::StatusOr<std::string> ReadBearerTokenFile(const std::string& path);

struct NamespaceSpec {
  std::string name;
  std::string model;
  std::string revision;
  uint32_t tp_rank = 0;
  BlockShape shape;
  // Unset: the node's default codec.
  std::optional<CodecPolicy> policy;
  // KIVI codecs: per chain, the blocks holding the most recent this many
  // tokens stay fp16 until a later block pushes them out (KIVI's residual).
  // Unset: 128. 0: off.
  std::optional<uint32_t> residual_tokens;
};

struct NamespaceInfo {
  uint64_t fingerprint = 0;
  bool already_registered = false;
  Codec codec = Codec::kNone;
  uint64_t fp16_block_bytes = 0;
  uint64_t encoded_block_bytes = 0;
};

struct LookupResult {
  uint32_t prefix_blocks = 0;  // keys[0, prefix_blocks) are cached
  uint64_t pin_lease = 0;      // nonzero when pinned: pass to Get/Release
};

struct BlockWrite {
  std::string key;
  std::string parent_key;  // empty: the previous block of this Put
  absl::Span<const uint16_t> fp16;
};

struct PutResult {
  uint32_t stored = 0;   // blocks written now
  uint32_t skipped = 0;  // stored already: their bytes did not travel
  uint64_t stored_bytes = 0;
};

enum class ReadFormat { kFp16, kRaw };

// How Get and GetInto read.
struct ReadOptions {
  ReadFormat format = ReadFormat::kFp16;
  // A Lookup pin that this read takes over and ends; 0: none.
  uint64_t pin_lease = 0;
  // false: one missing key fails the whole read with NOT_FOUND, one block
  // that fails its checksum with DATA_LOSS (the node drops it).
  // true: the read returns the blocks the node holds intact and lists the
  // other keys in GetResult::missing (not stored, or corrupt and now
  // dropped); a read where every key is missing succeeds with no blocks.
  // Bad input (keys, namespace, pin lease) is an error either way.
  bool allow_missing = false;
  // GetInto over the UCX data plane. true: the node sends layer l of every
  // block, then layer l + 1, and reports each, so PendingRead::WaitLayer(l)
  // returns as soon as layer l has landed (a decode engine computes layer l
  // while the next ones arrive). false: it sends each block whole, in a
  // sixteenth of the messages for 16 layers; a whole read costs both ends
  // less CPU and ends sooner (docs/benchmarks.md, issue 20), and
  // WaitLayer(l) returns only once the whole read has landed. For callers
  // that wait for the whole read.
  bool layer_by_layer = true;
};

struct BlockData {
  std::string key;
  uint32_t index = 0;          // the key's position in the keys asked for
  Codec codec = Codec::kNone;  // as stored on the node
  ReadFormat format = ReadFormat::kFp16;
  std::string bytes;  // fp16 halves, or the raw encoding
};

struct GetResult {
  // In the order of the keys asked for: one per key, or with allow_missing
  // one per key not in `missing`.
  std::vector<BlockData> blocks;
  // Positions of the keys not read, ascending; empty without allow_missing.
  std::vector<uint32_t> missing;
  BlockShape shape;
  CodecPolicy policy;  // decodes raw blocks (DecodeRaw)

  // How many leading keys were all read: keys[0, n) are blocks[0, n). The
  // longest usable prefix of a chain of prefix-hash keys.
  uint32_t prefix_blocks() const {
    return missing.empty() ? static_cast<uint32_t>(blocks.size())
                           : missing.front();
  }
};

struct CodecUsage {
  uint64_t blocks = 0;
  uint64_t tokens = 0;
  uint64_t stored_bytes = 0;
  uint64_t logical_bytes = 0;
};

struct NamespaceUsage {
  Codec codec = Codec::kNone;
  uint64_t blocks = 0;
  uint64_t tokens = 0;
  uint64_t stored_bytes = 0;     // pool bytes (pages) its blocks hold
  uint64_t logical_bytes = 0;    // the fp16 bytes its blocks stand for
  uint64_t residual_blocks = 0;  // kept fp16 by the KIVI residual window
  std::map<std::string, uint64_t> tokens_that_fit;  // by codec name
};

// A node run with --tenants: the caller's tenant and its share.
struct TenantUsage {
  std::string name;
  uint64_t pool_bytes_used = 0;   // its blocks and open writes
  uint64_t pool_bytes_quota = 0;  // 0: no share
  uint32_t namespaces = 0;
  uint32_t max_namespaces = 0;  // 0: no limit but the node's
};

struct NodeStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t reserved_bytes = 0;
  uint64_t pinned_bytes = 0;
  uint64_t fragmentation_bytes = 0;
  std::map<std::string, CodecUsage> codecs;  // by codec name
  // By namespace name; on a node with tenants, only the caller's (an
  // admin's: all).
  std::map<std::string, NamespaceUsage> namespaces;
  std::optional<TenantUsage> tenant;  // set by a node with tenants
  uint64_t evictions = 0;
  uint64_t data_loss_events = 0;
  uint64_t lookup_hits = 0;
  uint64_t lookup_misses = 0;
};

// Where a block of a GetInto landed in the caller's buffer.
struct BlockPlacement {
  // From the start of the buffer: index * stride, index being the block's
  // position in the keys asked for (BlockData::index).
  uint64_t offset = 0;
  uint64_t length = 0;  // bytes of the block in the requested format
  // Offset within the block where each layer ends; one entry when the
  // block's layers cannot be told apart (it is ready with the last layer).
  std::vector<uint64_t> layer_ends;
};

// A read into caller memory in progress (Client::GetInto). Destroying it
// before the read has ended cancels the transfer first, so the buffer is
// never written after the destructor returns (over the data plane this
// closes the client's connection to the node; other transfers on it fail
// with UNAVAILABLE and a new connection is opened for the next one).
class PendingRead {
 public:
  struct Impl;
  explicit PendingRead(std::unique_ptr<Impl> impl);
  ~PendingRead();
  PendingRead(const PendingRead&) = delete;
  PendingRead& operator=(const PendingRead&) = delete;

  // Blocks until layer `layer` of every block is in the buffer, or the read
  // failed (its status). Bounded by the GetInto call's deadline
  // (DEADLINE_EXCEEDED; the transfer is stopped then) and ended by its
  // CancelToken (CANCELLED; the transfer goes on until it ends or this
  // PendingRead is destroyed). Layers arrive in order; in a read that is
  // not layer by layer (ReadOptions::layer_by_layer), WaitLayer returns
  // only once the whole read has landed. A read that found no block
  // (allow_missing) has every layer ready.
  absl::Status WaitLayer(uint32_t layer);
  // Every layer.
  absl::Status Wait();
  uint32_t num_layers() const;
  // Keys, positions, codecs and formats of the blocks read (their bytes are
  // empty: they are in the buffer), the keys missing (allow_missing), and
  // the shape and policy that decode raw blocks.
  const GetResult& metadata() const;
  // One per block of metadata().blocks, in the same order.
  const std::vector<BlockPlacement>& placements() const;
  // True when the bytes travel over the UCX data plane.
  bool over_data_plane() const;

 private:
  std::unique_ptr<Impl> impl_;
};

// Milliseconds the node asked the caller to wait before retrying a
// RESOURCE_EXHAUSTED; nullopt for other statuses.
std::optional<int> RetryAfterMs(const absl::Status& status);

// Dequantizes one raw block of `result` into fp16 on the client's CPU. A
// block still in KIVI's residual window (block.codec == Codec::kNone in a
// KIVI namespace) is plain fp16 and is copied.
absl::Status DecodeRaw(const GetResult& result, const BlockData& block,
                       absl::Span<uint16_t> fp16_out);

// Memory for GetInto destinations and Put sources that the data plane
// reaches without registering it per call: allocated by UCX (shared memory
// where a transport offers it, so a node on the same host copies straight
// into or out of it) and registered once, for the buffer's lifetime. A
// GetInto whose destination lies inside a DataBuffer of the same Client
// uses it as is (any other memory is registered for that read only); a Put
// whose block lies inside one sends it from the registered memory. Without a
// data plane (gRPC only) it is plain memory. Its pages are faulted in when it
// is allocated, so the first read into it takes no page faults. A DataBuffer
// must not outlive the Client that allocated it; reads in progress keep its
// registration alive until they end. A freed buffer's memory stays
// registered for reuse by later buffers and Gets
// (ClientOptions::max_idle_buffer_bytes), and nodes keep its key until the
// client lets it go.
class DataBuffer {
 public:
  struct Impl;
  explicit DataBuffer(std::unique_ptr<Impl> impl);
  ~DataBuffer();
  DataBuffer(const DataBuffer&) = delete;
  DataBuffer& operator=(const DataBuffer&) = delete;

  absl::Span<uint8_t> span() const;
  uint8_t* data() const { return span().data(); }
  size_t size() const { return span().size(); }
  // True when the data plane can put into it without a per-read
  // registration.
  bool registered() const;

 private:
  std::unique_ptr<Impl> impl_;
};

namespace internal {
struct ClientTestAccess;  // client/client_test_access.h
}  // namespace internal

class Client {
 public:
  // Creates a channel to options.target; does not wait for the node.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const ClientOptions& options);
  // Cancels the best-effort cleanup calls still in flight (an abandoned
  // read's EndRead, an AbortWrite) and returns once they have ended:
  // milliseconds. Not to be run on a thread of gRPC's own (a callback of a
  // gRPC server or of gRPC's callback API).
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Idempotent for an identical spec; FAILED_PRECONDITION when the name is
  // taken by a different layout or policy. The client remembers the
  // namespace's fingerprint (until it drops the namespace) and sends it with
  // every Lookup, Put, Get and Delete on that name: where the name has
  // another spec on the node since (the node restarted and another client
  // registered the name first, or it was dropped and registered again),
  // those calls fail with FAILED_PRECONDITION and touch nothing, rather than
  // store, read or delete blocks under a spec this client did not register.
  absl::StatusOr<NamespaceInfo> RegisterNamespace(const NamespaceSpec& spec,
                                                  const CallOptions& call = {});

  // Longest cached prefix of `keys`. pin: hold it against eviction until
  // Get(..., pin_lease) or Release(pin_lease) or the lease TTL.
  absl::StatusOr<LookupResult> Lookup(const std::string& ns,
                                      const std::vector<std::string>& keys,
                                      bool pin = false,
                                      const CallOptions& call = {});

  // Stores whole blocks (all-or-nothing per node round trip). Blocks the
  // node holds already cost no transfer. Returns only once nothing reads
  // `blocks` any more, also when it fails (DEADLINE_EXCEEDED, CANCELLED: a
  // round trip cut short may or may not have stored its blocks). Blocks in
  // one DataBuffer may be read by the node straight from it (shared
  // memory): then a Put cut short waits, up to 5 s past its deadline, for
  // the node to confirm it stopped, and returns INTERNAL if it cannot.
  absl::StatusOr<PutResult> Put(const std::string& ns,
                                absl::Span<const BlockWrite> blocks,
                                const CallOptions& call = {});

  // Reads blocks (see ReadOptions for missing keys).
  absl::StatusOr<GetResult> Get(const std::string& ns,
                                const std::vector<std::string>& keys,
                                const ReadOptions& read,
                                const CallOptions& call = {});
  // Get(ns, keys, {format, pin_lease}): NOT_FOUND when any key is missing.
  absl::StatusOr<GetResult> Get(const std::string& ns,
                                const std::vector<std::string>& keys,
                                ReadFormat format = ReadFormat::kFp16,
                                uint64_t pin_lease = 0);

  // Reads blocks straight into `dest`: the block of keys[i] at
  // dest[i * stride, ...) (with allow_missing, the slots of missing keys
  // are left untouched). Over the UCX data plane the node puts them there
  // layer by layer, so a decode worker can start on layer 0 while later
  // layers travel; inline (no data plane) the bytes are copied in and
  // every layer is ready at once. Returns once the node has answered
  // (metadata and placements are known); the call's deadline and cancel
  // token go on to bound PendingRead's waits. INVALID_ARGUMENT when `dest`
  // cannot hold keys.size() slots of `stride` bytes or a block is larger
  // than its slot. `dest` must outlive the PendingRead, and the PendingRead
  // the Client.
  absl::StatusOr<std::unique_ptr<PendingRead>> GetInto(
      const std::string& ns, const std::vector<std::string>& keys,
      const ReadOptions& read, absl::Span<uint8_t> dest, size_t stride,
      const CallOptions& call = {});
  // GetInto(ns, keys, {format, pin_lease}, dest, stride).
  absl::StatusOr<std::unique_ptr<PendingRead>> GetInto(
      const std::string& ns, const std::vector<std::string>& keys,
      ReadFormat format, absl::Span<uint8_t> dest, size_t stride,
      uint64_t pin_lease = 0);

  // A buffer of `bytes` (> 0) for GetInto destinations (see DataBuffer).
  // Falls back to plain memory when this client has no data plane;
  // INVALID_ARGUMENT for 0 bytes.
  absl::StatusOr<std::unique_ptr<DataBuffer>> AllocateBuffer(size_t bytes);

  // Ends a Lookup pin without reading.
  absl::Status Release(uint64_t pin_lease, const CallOptions& call = {});

  // Returns how many of `keys` were stored and are now deleted.
  absl::StatusOr<uint32_t> Delete(const std::string& ns,
                                  const std::vector<std::string>& keys,
                                  const CallOptions& call = {});

  absl::StatusOr<NodeStats> Stats(const CallOptions& call = {});

  // Drops namespace `ns`: its blocks, its leases (their ids go stale) and
  // its registration; returns the number of blocks dropped. NOT_FOUND when
  // it is not registered; on a node with tenants, its owner or an admin
  // may (PERMISSION_DENIED otherwise).
  absl::StatusOr<uint64_t> DropNamespace(const std::string& ns,
                                         const CallOptions& call = {});

 private:
  friend struct internal::ClientTestAccess;
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CLIENT_H_
