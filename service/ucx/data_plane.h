// DataPlane: the node's UCX data plane (BRIEF section 5), or one shard of
// it (data_planes.h). One UCX context, one worker progressed by one thread
// (WorkerLoop), at most one listener. KV bytes
// travel here; the gRPC control plane (service/kvcache_service.cc) opens and
// closes the sessions that allow them to.
//
// Protocol (transport/wire.h has the message formats):
//  * Write: BeginWrite (gRPC) reserves store pages and, through OpenWrite,
//    staging for every block not present and not received in place (below),
//    and returns the listener address
//    and a fresh token. The client sends each block as one active message
//    (rendezvous for large blocks: the node receives it straight into its
//    destination). A block stored as its fp16 bytes on a host arena (codec
//    none, a KIVI residual window) lands in its own store pages, claimed
//    for the receive (Store::ClaimInPlace), and is checked and sealed there
//    on the worker pool; any other lands in a staging buffer and is encoded
//    into its pages from there (Store::StageBlock), as it lands. CommitWrite
//    (gRPC, no payloads) waits until every block has landed, then runs
//    Store::CommitWrite on the worker pool; the batch becomes visible only
//    then. Staging is freed
//    when the commit ends, when the write is aborted, when its connection
//    fails before every block has landed (its commit then answers
//    UNAVAILABLE; a write whose blocks have all landed needs no connection
//    and still commits), or when its lease expires.
//  * Read: BeginRead (gRPC, inline_data = false) reserves staging for the
//    worst case, then Store::BeginRead (keep_lease, in_place) pins the
//    blocks: on a host arena a block whose answer is its stored bytes stays
//    where it lies, with its header checked and its layers left for the
//    data plane to check (caller_verifies; unless allow_missing), and is
//    put straight from the pinned pages; only decoded blocks (verified in
//    BeginRead, and every block of a device arena) are copies, and only
//    they keep their staging. A read whose client asked for the decode in
//    its own memory (BeginReadRequest.decode_into_destination) leaves the
//    encoded blocks in place too: at ReadStart the node decodes them
//    straight into the destination where it maps it, or else into copies,
//    with staging reserved then. OpenRead returns the
//    address and a token. The client registers its
//    destination memory and sends ReadStart with the packed remote key and
//    one address per block; the node puts the blocks there (layer by layer
//    when asked), flushes, and reports each layer with ReadStatus (over
//    numbered data messages, wire.h kAmReadData with kReadFlagSequenced, a
//    layer's status follows its messages without a flush; the client holds
//    it until the messages sent before it have landed). When the
//    read ends (done, failed, or expired) and no put or data message of it
//    is still in flight, the node destroys the remote key, ends the store
//    lease and frees the copies. From ReadStart on, the store lease is held
//    (Store::HoldReadLease): it ends only then, never by the store's TTL,
//    which the session's deadline enforces instead (force-closing a
//    connection stuck mid-transfer, which fails its operations). The node never
//    packs a remote key of its own memory. The one exception to "one key, one
//    read": a key that the client marks as covering a long-lived buffer
//    (kvcache::DataBuffer, ReadStartHeader::buffer_id) is kept for later
//    reads into that buffer on the same connection, until the client
//    releases the buffer (kAmReleaseBuffer) or the connection ends, at most
//    kMaxBufferKeys per connection; so is the key of a buffer that a read
//    names without landing in it (kReadFlagNamesBuffer: the DataBuffer a
//    client decodes a read into), ahead of the reads that will land there.
//    Unpacking a key maps the client's segment on shared memory, a page fault
//    per page on first touch; doing that for every read cost 5x the read's
//    throughput. When the node first keeps such a key and the buffer is mapped
//    into the node (shared memory), a background thread faults the whole
//    mapping in at once (PrefaultClientBuffer), so the first reads into it are
//    not charged a fault per 4 KiB page; a read that comes to a part of it
//    before the prefault does faults that part in itself, one call per
//    contiguous range it writes (PopulateAhead). Puts into it still
//    happen only for reads whose token the client presented.
//
// Invariants:
//  * Staging bytes (write buffers and read copies) never exceed
//    options.staging_bytes; a request that would exceed it gets
//    RESOURCE_EXHAUSTED at the control plane, before any byte moves.
//  * Clients connect through the listener or, when they have it, straight
//    to the worker's address (UCX then may use shared memory); both kinds
//    of connection are the same to the rules below.
//  * A connection whose first active message does not carry a valid token
//    of a live session, or that sends none within handshake_timeout, is
//    closed. Any later message with a bad token closes it too.
//  * A session is bound to the first connection that presents its token;
//    other connections cannot touch it.
//  * Every wait is bounded: commit waits by the call's deadline (and the
//    drain deadline), sessions by their lease deadline; a session that
//    expires with bytes in flight force-closes its connection so that the
//    transfers fail and their buffers are released. So does a receive
//    still in flight at its lease's deadline under a waiting commit, or
//    of a write already failed or taken (receiving_orphans_).
//  * Memory that UCX may still write (an in-flight receive) or read (an
//    in-flight put) is owned by that operation's completion, so dropping a
//    session never frees bytes under a transfer. A receive into store pages
//    owns their InPlaceClaim, which keeps the write's lease (an abort
//    waits for it); a receive still in flight when its lease's deadline
//    passes has its connection closed, so that it fails and lets go.
//  * A session holds its store lease as a claim (store/lease_claim.h):
//    whoever takes a session out of the table (commit, abort, expiry, a
//    failed connection, EndRead, Stop) takes its claim, and a claim that
//    nobody commits, ends or hands on aborts the write or ends the read
//    when it goes. Sessions end when their leases do: their deadlines are
//    the store's (BeginWriteResult::deadline, ReadResult::deadline).
#ifndef KVCACHE_SERVICE_UCX_DATA_PLANE_H_
#define KVCACHE_SERVICE_UCX_DATA_PLANE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "kernels/codec.h"
#include "service/ucx/staging.h"
#include "store/lease_claim.h"
#include "store/store.h"
#include "transport/handles.h"
#include "transport/tcp_segments.h"
#include "transport/wire.h"
#include "transport/worker_loop.h"

namespace kvcache::ucx {

// How a read's bytes reach the client (see wire.h, kAmReadData).
enum class ReadDelivery {
  // Puts where they are native (shared memory, RDMA); data messages where
  // UCX would emulate puts with active messages (TCP) and the client
  // accepts them. Never data messages over RDMA: their rendezvous would
  // hand the client a remote key to the node's memory.
  kAuto,
  kPuts,  // always puts
};

struct DataPlaneOptions {
  // Opt-in, for trusted networks only: UCX may use its TCP transport, and
  // `listen` may open a listener. UCX 1.13's TCP transport checks no remote
  // keys and aborts the process on malformed headers: any peer that reaches
  // its ports can crash the node or write into its memory. Without it the
  // node's UCX runs over shared memory and RDMA only (TransportsWithoutTcp),
  // opens no listener, and clients connect to the worker address that the
  // control plane hands out with each session.
  bool tcp_trusted_network = false;
  // HOST:PORT of a UCX listener (TCP; port 0 picks a free port), for
  // clients without the worker address. Empty (the default): none. Only
  // with tcp_trusted_network.
  std::string listen;
  // The host clients dial; empty: the listen host. A wildcard host (0.0.0.0,
  // ::, empty) is advertised as ":PORT", which clients complete with the
  // host of their gRPC target.
  std::string advertise_host;
  uint64_t staging_bytes = 256ull << 20;
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Progress-thread tuning (see WorkerLoop).
  int spin_iterations = 64;
  // How many shards (each a UCX worker with its own progress thread) the
  // node's data plane runs (DataPlanes, data_planes.h); a DataPlane itself
  // is one.
  int progress_threads = 1;
  // The name of this DataPlane's UCX context (in UCX's own logs).
  std::string ucx_name = "kvcache-node";
  ReadDelivery read_delivery = ReadDelivery::kAuto;
};

struct DataPlaneStats {
  uint64_t staging_capacity_bytes = 0;
  uint64_t staging_used_bytes = 0;    // held for clients' transfers
  uint64_t staging_cached_bytes = 0;  // freed buffers kept for reuse
  uint32_t connections = 0;
  uint32_t write_sessions = 0;
  uint32_t read_sessions = 0;
  // Blocks of open writes that have not landed yet (awaited or still being
  // received).
  uint32_t write_blocks_unlanded = 0;
  uint64_t rejected_connections = 0;
  uint32_t buffer_keys = 0;  // kept for clients' long-lived buffers
  // Blocks encoded straight from a client buffer the node mapped
  // (kAmWritePull), since the start.
  uint64_t pulled_blocks = 0;
  // Receives begun straight into blocks' store pages (codec none and KIVI
  // residual windows on a host arena: no staging, no copy), since the
  // start; one that then fails counts too.
  uint64_t blocks_received_in_place = 0;
  // Reads whose blocks went as data messages rather than puts (kAmReadData),
  // since the start.
  uint64_t message_reads = 0;
  // Reads the node copied into a client buffer it maps (shared memory), on
  // its worker pool, rather than by UCX puts on its progress thread, since
  // the start.
  uint64_t copied_reads = 0;
  // Blocks an fp16 read asked the node to decode in the client's memory
  // (BeginReadRequest.decode_into_destination), since the start: decoded
  // straight into the client's buffer that the node maps, in the pass that
  // checks them; or, where it did not map it, into staging at ReadStart
  // and then sent.
  uint64_t blocks_decoded_into_destination = 0;
  uint64_t blocks_decoded_at_read_start = 0;
  // Of the blocks the store handed over unchecked (their layers' checksums
  // to be checked here, store::ReadOptions::caller_verifies), the reads
  // whose checks ran in the pass that copies or decodes them into a client
  // buffer the node maps (copied reads) and those checked before their
  // first send, since the start.
  uint64_t reads_checked_while_copying = 0;
  uint64_t reads_checked_before_sending = 0;
  // Slices of reads posted, since the start: a read sent layer by layer
  // posts one per layer (that layer of every block), any other one slice
  // of whole blocks.
  uint64_t read_slices_posted = 0;
  // Bytes of clients' long-lived buffers that the node mapped (shared
  // memory) and faulted in at once when it first got their keys
  // (PrefaultClientBuffer), since the start.
  uint64_t prefaulted_buffer_bytes = 0;
  // Of those buffers, the bytes that reads' copies and decodes asked to
  // fault in themselves because they came to them before the prefault did
  // (DataPlane::PopulateAhead), since the start; a page two reads asked
  // for at once counts twice.
  uint64_t buffer_bytes_populated_by_reads = 0;
};

// The UCX_TLS value a node without tcp_trusted_network runs with, given
// the environment's (`ucx_tls`, empty when unset): "^tcp" (every transport
// but TCP) when unset; an exclusion list ("^...") with tcp added; a list
// that names neither tcp nor "all" as it is. A list naming tcp or "all" is
// FAILED_PRECONDITION, naming the opt-in: the operator asked for TCP.
absl::StatusOr<std::string> TransportsWithoutTcp(absl::string_view ucx_tls);

class DataPlane {
 public:
  // Runs `work` on the worker pool (encode-heavy commits).
  using Executor = std::function<void(std::function<void()> work)>;
  // Bytes moved by the data plane; inbound: writes, else reads.
  using TransferObserver = std::function<void(bool inbound, uint64_t bytes)>;
  using CommitDone =
      std::function<void(absl::StatusOr<store::CommitResult> result)>;

  // `executor`: the worker pool, which copies, checks, decodes and commits
  // (reads' slices wait for its tasks). `background`: work that may take
  // long and must not hold those up (faulting in the node's mapping of a
  // client's buffer, PrefaultClientBuffer); not the worker pool.
  // `budget`: the staging budget this data plane draws from, shared with
  // other shards of the node's data plane; null: one of its own, of
  // options.staging_bytes.
  static absl::StatusOr<std::unique_ptr<DataPlane>> Start(
      DataPlaneOptions options, store::Store* store, Executor executor,
      Executor background, TransferObserver observer,
      std::shared_ptr<StagingBudget> budget = nullptr);
  ~DataPlane();
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  // "host:port" (or ":port", see DataPlaneOptions::advertise_host).
  const std::string& address() const { return address_; }
  // The worker's packed UCX address (DataPlaneInfo.worker_address).
  const std::string& worker_address() const { return worker_address_; }
  int port() const { return port_; }
  // The UCX TCP segment sizes of this node (DataPlaneInfo.tcp_*_seg_bytes;
  // zero without TCP): clients whose sizes would abort one side stay off
  // UCX with this node (transport/tcp_segments.h).
  const TcpSegments& tcp_segments() const { return tcp_segments_; }

  // After Store::BeginWrite succeeded: a session for the write that `claim`
  // holds, with staging for each block not present, until begin.deadline.
  // The session keeps the claim: it commits or aborts the store write. On
  // an error (RESOURCE_EXHAUSTED when staging is full, UNAVAILABLE while
  // draining) the claim is dropped, which aborts the store write.
  absl::StatusOr<Token> OpenWrite(store::WriteClaim claim,
                                  const store::BeginWriteResult& begin);
  // CommitWrite without payloads. False when `write_id` has no session (the
  // caller takes the inline path with a claim of its own). Otherwise the
  // session's claim commits, and `done` runs exactly once, on a worker or
  // the caller's thread, when every block has landed and the store commit
  // ended, or with an error (a bad block, a failed connection,
  // DEADLINE_EXCEEDED at `deadline`; the store write is then aborted).
  bool Commit(uint64_t write_id, absl::Time deadline, CommitDone done);
  // Drops the session of `write_id` and hands its claim to the caller (who
  // aborts the write, or commits it with inline payloads); a commit waiting
  // on the session fails with ABORTED. Without a session (none was opened,
  // or its commit has begun, or it ended) the claim is taken from the
  // store's table as the write stands there.
  store::WriteClaim TakeWrite(uint64_t write_id);

  // Staging for `bytes` of read copies; RESOURCE_EXHAUSTED when full.
  absl::StatusOr<StagingReservation> ReserveStaging(uint64_t bytes);
  // After Store::BeginRead(keep_lease = true): a session for the read
  // lease that `claim` holds (result.lease_id), which holds the copies
  // until the client has them and ends by result.deadline.
  // `layer_ends[b][l]` is the byte offset in block b where layer l ends
  // (see LayerEnds). The session keeps the claim and ends the lease once no
  // transfer reads its pages; on an error the claim is dropped, which ends
  // the lease.
  absl::StatusOr<Token> OpenRead(store::ReadClaim claim,
                                 store::ReadResult result,
                                 std::vector<std::vector<uint64_t>> layer_ends,
                                 StagingReservation reservation);
  // EndRead (gRPC) for `lease_id`: returns the claim the caller ends, or
  // nullopt when the data plane keeps it. A transfer under way keeps it:
  // the session ends the lease when the transfer ends (at the latest at its
  // deadline), so that pinned pages are never released under a put. A read
  // session the client has not started (it fell back to gRPC, or gave up)
  // is dropped now, its staging returned, and its claim handed over.
  // Without a session (a Lookup pin, an inline read's lease, one that
  // ended) the claim is taken from the store's table.
  std::optional<store::ReadClaim> EndRead(uint64_t lease_id);

  // Called periodically (the node's reaper): fails commit waits past their
  // deadline, drops expired sessions, closes connections that never
  // presented a token.
  void Expire(absl::Time now);
  // New sessions are refused from now on; commit waits end by `deadline`.
  void BeginDrain(absl::Time deadline);
  // Closes the listener and every connection, fails what is pending and
  // frees every session. Idempotent; the destructor calls it.
  void Stop();

  DataPlaneStats Stats() const;

  // Whether a session of this data plane holds the write `write_id` or the
  // read lease `lease_id` (a snapshot: it may end right after).
  bool HasWrite(uint64_t write_id) const;
  bool HasRead(uint64_t lease_id) const;

  // For each block of `result`, the offsets where each of its layers ends
  // in `format` (fp16: equal slices; raw: the sections of the codec the
  // block is stored with). A block whose layers cannot be told apart gets
  // one entry, its length.
  static std::vector<std::vector<uint64_t>> LayerEnds(
      const store::ReadResult& result, store::ReadFormat format);

 private:
  struct Connection;
  struct WriteSession;
  struct ReadSession;
  struct LayerDecoding;
  struct BufferPrefault;
  // Layer `layer` of block `block` (ReadBlock::decode_later), decoded into
  // `out`.
  struct DecodeUnit {
    size_t block;
    uint32_t layer;
    uint8_t* out;
  };

  DataPlane(DataPlaneOptions options, store::Store* store, Executor executor,
            Executor background, TransferObserver observer,
            std::shared_ptr<StagingBudget> budget);
  absl::Status Listen();

  // UCX callbacks (loop thread).
  static void OnConnRequest(ucp_conn_request_h request, void* arg) noexcept;
  static void OnEndpointError(void* arg, ucp_ep_h ep,
                              ucs_status_t status) noexcept;
  static ucs_status_t OnWriteBlock(void* arg, const void* header,
                                   size_t header_length, void* data,
                                   size_t length,
                                   const ucp_am_recv_param_t* param) noexcept;
  static ucs_status_t OnWritePull(void* arg, const void* header,
                                  size_t header_length, void* data,
                                  size_t length,
                                  const ucp_am_recv_param_t* param) noexcept;
  static ucs_status_t OnReleaseBuffer(
      void* arg, const void* header, size_t header_length, void* data,
      size_t length, const ucp_am_recv_param_t* param) noexcept;
  static ucs_status_t OnReadStart(void* arg, const void* header,
                                  size_t header_length, void* data,
                                  size_t length,
                                  const ucp_am_recv_param_t* param) noexcept;

  // Loop thread. The connection an active message came from; a peer that
  // connected to the worker address is adopted here, unauthenticated.
  Connection* FindConnection(ucp_ep_h ep);
  // The connection an active message came from (its reply endpoint), or
  // null.
  Connection* SenderOf(const ucp_am_recv_param_t* param);
  void CloseConnection(uint64_t conn_id, const char* why);
  void HandleWriteBlock(Connection* conn, absl::string_view header, void* data,
                        size_t length, bool rendezvous);
  // A request message (ReadStart, WritePull): refused when it came by
  // rendezvous, else copied and handed to `handle` in a loop task.
  using RequestHandler = void (DataPlane::*)(Connection*, absl::string_view,
                                             absl::string_view);
  ucs_status_t PostRequest(const void* header, size_t header_length,
                           const void* data, size_t length,
                           const ucp_am_recv_param_t* param,
                           const char* oversized, RequestHandler handle);
  void HandleWritePull(Connection* conn, absl::string_view header,
                       absl::string_view data);
  void HandleReadStart(Connection* conn, absl::string_view header,
                       absl::string_view data);
  // A connection adopted from the node's worker address gets an endpoint of
  // the node's own to the client's worker for RMA (and remote keys).
  absl::Status EnsureClientEndpoint(Connection* conn,
                                    absl::string_view worker_address);
  // Whether a key for `buffer_id` is (or would be) kept on `conn`: not 0,
  // and already kept or under kMaxBufferKeys kept.
  static bool KeepsKey(const Connection& conn, uint64_t buffer_id);
  // The unpacked remote key of a client region; a long-lived buffer's
  // (buffer_id != 0) is kept on the connection and reused. *kept_new:
  // whether this call unpacked a key that the connection now keeps.
  absl::StatusOr<std::shared_ptr<RemoteKey>> ClientKey(Connection* conn,
                                                       uint64_t buffer_id,
                                                       absl::string_view packed,
                                                       bool* kept_new);
  // Where `key` maps the client region [base, base + length) into this
  // process (shared memory): faults that mapping in on `background_`
  // (MADV_POPULATE_WRITE, which changes no byte), so that puts into a
  // long-lived buffer do not pay a page fault per 4 KiB page of it on
  // their first pass, and returns how far it has come, for the reads into
  // the buffer meanwhile (PopulateAhead). Elsewhere (no mapping: tcp, RDMA)
  // nothing, and null.
  // Loop thread (it keeps the result in conn->buffer_keys).
  std::shared_ptr<const BufferPrefault> PrefaultClientBuffer(
      std::shared_ptr<RemoteKey> key, uint64_t base, uint64_t length);
  // Loop thread, at ReadStart: the key of the read's destination (kept when
  // it is a long-lived buffer's, and then prefaulted when first kept) into
  // session.rkey, with the buffer's prefault while under way; then the key
  // of the buffer the read names, if any (KeepNamedBuffer). An error ends
  // the read.
  absl::Status AttachClientBuffers(Connection* conn, const ReadStartHeader& h,
                                   const ReadStartBody& body,
                                   ReadSession& session);
  // Loop thread: a read's named buffer (kReadFlagNamesBuffer): its key is
  // kept as a read's own long-lived buffer's is (ClientKey), and prefaulted
  // when first kept; nothing when the connection keeps kMaxBufferKeys keys
  // already. A key that does not unpack is INVALID_ARGUMENT and fails the
  // read, as a bad key for the read's own destination does: a client that
  // sends one is broken, and would not be told otherwise.
  absl::Status KeepNamedBuffer(Connection* conn, const NamedBuffer& named);
  // Pool thread, before a copy or decode task writes [out, out + length)
  // of a client's mapped buffer: the part of it that the buffer's
  // prefault (`prefault`, null: none) has yet to reach is faulted in here,
  // in one call, rather than a page fault per 4 KiB page as the task
  // writes it (a fault per page cost the node's decodes more than the
  // decodes themselves on a fresh buffer). Nothing once the prefault has
  // ended, so reads into a warm buffer pay nothing. Counts the bytes asked
  // for (buffer_bytes_populated_by_reads).
  void PopulateAhead(const BufferPrefault* prefault, uint8_t* out,
                     uint64_t length);
  // Whether puts over `conn` into the region of `rkey` are native: false
  // only where the node cannot map the region and every lane of the
  // endpoint is TCP, where UCX emulates puts with active messages.
  bool PutsAreNative(Connection* conn, const RemoteKey& rkey, uint64_t address);
  // Moves the read's blocks to `remote` (one address per block): puts, or
  // kAmReadData messages when `by_messages`; per layer, a slice (layer l of
  // every block) at a time, with few slices' sends in flight (see
  // kBytesInFlight), so that a layer's bytes are not held up behind those
  // of the layers after it (UCX shares a connection between the transfers
  // posted on it).
  void StartPuts(const std::shared_ptr<ReadSession>& session, Connection* conn,
                 std::vector<uint64_t> remote, bool per_layer,
                 bool by_messages);
  // Posts slices while the in-flight bounds allow.
  void PostNextSlices(const std::shared_ptr<ReadSession>& session);
  // Posts the session's next slice: its sends and then its report (a
  // status, or a flush that sends it); ends the read instead once a send
  // has failed or the connection is gone.
  void PostNextSlice(const std::shared_ptr<ReadSession>& session);
  // A send of `slice` completed (or its posting ended): when it was the
  // slice's last, the slice leaves the window and more may go.
  void SliceSent(const std::shared_ptr<ReadSession>& session, uint32_t slice);
  void PostSlice(const std::shared_ptr<ReadSession>& session, Connection& conn,
                 uint32_t slice);
  // Sends bytes [start, start + length) of block `b`, at `src`, as part of
  // `slice`: a put into the client's region, or a kAmReadData message when
  // the read is delivered by messages. Counted in the slice's sends.
  void SendPiece(const std::shared_ptr<ReadSession>& session, Connection& conn,
                 uint32_t slice, const uint8_t* src, uint64_t length, size_t b,
                 uint64_t start);
  // Flushes `conn`, then reports `layers_done` to the client (and finishes
  // the read at its last layer), or ends the read with its error.
  void FlushAndReport(const std::shared_ptr<ReadSession>& session,
                      Connection& conn, uint32_t layers_done,
                      std::optional<uint32_t> data_messages);
  // Calls fn(source, length, block, offset in the block) for each piece of
  // `slice`: a piece is contiguous in the node's memory.
  static void ForEachPiece(
      const ReadSession& session, uint32_t slice,
      absl::FunctionRef<void(const uint8_t*, uint64_t, size_t, uint64_t)> fn);
  // The blocks [first, end) that `slice` may move bytes of: every block for
  // a slice of layers, block `slice` alone for a slice of whole blocks.
  static std::pair<size_t, size_t> SliceBlocks(const ReadSession& session,
                                               uint32_t slice);
  // The bytes [*start, *end) of block `b` that `slice` moves; false when it
  // moves none of them.
  static bool SliceRange(const ReadSession& session, uint32_t slice, size_t b,
                         uint64_t* start, uint64_t* end);
  // fn(source, length, offset in the block) for each piece of [start, end)
  // of `block` that is contiguous in the node's memory.
  static void ForEachPieceOf(
      const store::ReadBlock& block, uint64_t start, uint64_t end,
      absl::FunctionRef<void(const uint8_t*, uint64_t, uint64_t)> fn);
  // Whether every slice of every unchecked block starts and ends on one of
  // its checksummed layers' bounds, so that a copy task can check whole
  // layers as it copies them.
  static bool ChecksFollowSlices(const ReadSession& session);
  // Checks the read's unchecked blocks on the worker pool and lets each
  // slice be posted once it is checked (slice by slice, a few ahead of the
  // sends, where slices are whole checked layers; else all before the
  // first); or drops what failed and ends the read DATA_LOSS.
  void CheckThenPost(const std::shared_ptr<ReadSession>& session);
  // Starts the checks of slices up to kSlicesCheckedAhead past those
  // posted (slice by slice).
  void StartChecksAhead(const std::shared_ptr<ReadSession>& session);
  // Starts the pool tasks that check `slice` (or, with whole_blocks, every
  // unchecked block, counted against slice 0).
  void StartChecks(const std::shared_ptr<ReadSession>& session, uint32_t slice,
                   bool whole_blocks);
  // Moves slices_checked past the slices with no check left, and posts.
  void PostCheckedSlices(const std::shared_ptr<ReadSession>& session);
  // Moves slices_checked past the slices whose checks started and ended;
  // true when it moved.
  static bool AdvanceCheckedSlices(ReadSession& session);
  // The first of layers [first, end) of `block` whose bytes do not match
  // their checksum (ReadBlock::unchecked_layer_sums), or nullopt.
  static std::optional<uint32_t> FirstBadLayer(const store::ReadBlock& block,
                                               uint32_t first, uint32_t end);
  // A check found block `block`'s layer `layer` corrupt (loop thread): the
  // store drops the block and the read fails, unless it failed already.
  void FailCorrupt(ReadSession& session, size_t block, uint32_t layer);
  // Where the node maps every destination of the read (shared memory), sets
  // session.mapped: the pool then copies each slice (CopySlice, with stores
  // that bypass the cache) instead of UCX putting it on the loop thread,
  // and reports it once copied
  // (ReportCopiedSlices) instead of after a flush.
  void MapDestinations(ReadSession& session);
  // Whether `block` has layers the data plane checks before it sends them
  // as they lie (a block left to decode is checked as it is decoded).
  static bool NeedsCheck(const store::ReadBlock& block);
  // How the read decodes the blocks the store left encoded for it; null
  // when there is none.
  static std::shared_ptr<const LayerDecoding> PlanDecoding(
      const store::ReadResult& result);
  // Pool thread: checks each unit's layer of stored bytes against its sum
  // (where the store left that to the read), then decodes it into
  // unit.out with `stores`. A mismatch sets *corrupt and stops; so does
  // the read's end (*stopped). An error: a decode that failed.
  static absl::Status DecodeUnits(
      const ReadSession& session, absl::Span<const DecodeUnit> units,
      kernels::DecodeStores stores,
      std::optional<std::pair<size_t, uint32_t>>* corrupt, bool* stopped);
  // The blocks left encoded, where the destination is not mapped: decoded
  // into copies (staging reserved now; RESOURCE_EXHAUSTED ends the read)
  // on the worker pool, then sent as other copies are (SendDecoded).
  void DecodeThenSend(const std::shared_ptr<ReadSession>& session);
  void SendDecoded(const std::shared_ptr<ReadSession>& session);
  // Whether the decodes of `result`'s blocks left encoded check layers
  // (ReadBlock::unchecked_layer_sums), counted as the read's checks.
  static bool DecodesCheck(const store::ReadResult& result);
  // StartPuts' second half: checks what needs it, then posts the slices.
  // checked_in_decodes: the read's decodes checked (or check) its blocks
  // left encoded, counted in reads_checked_* when nothing else is.
  void CheckAndSend(const std::shared_ptr<ReadSession>& session,
                    bool checked_in_decodes);
  // Copies `slice` on the worker pool, in tasks of about kCopyTaskBytes;
  // with session.check_in_copies each task also checksums each layer it
  // copies, from the source just read, and a layer that does not match
  // fails the read before its status can go. Blocks left encoded
  // (ReadBlock::decode_later) are checked and decoded into the destination
  // layer by layer in the same tasks (DecodeUnits).
  void CopySlice(const std::shared_ptr<ReadSession>& session, uint32_t slice);
  // Sends the statuses of the copied slices, in order; ends the read after
  // the last (or on an error, or once the connection is gone).
  void ReportCopiedSlices(const std::shared_ptr<ReadSession>& session);
  void FinishRead(const std::shared_ptr<ReadSession>& session,
                  absl::Status status);
  // Once a finished read has no operation in flight: frees its key, copies
  // and staging, and drops its claim, which ends the store lease. Only then
  // may the pinned pages it sends from be released or reused: a rendezvous
  // data message reads them until its send completes, which can be after the
  // flush that reported the read (ucp_ep_flush_nbx does not wait for it).
  void ReleaseIfIdle(ReadSession& session);
  // data_messages: for a read delivered by kAmReadData, the messages sent
  // before this status (ReadStatusHeader::data_messages). mapped: for a
  // read asked with kReadFlagReportMapped, whether the node writes its
  // destination through its own mapping (Delivery).
  void SendReadStatus(uint64_t conn_id, uint64_t read_id, const Token& token,
                      uint32_t layers_done, uint32_t num_layers,
                      const absl::Status& status,
                      std::optional<uint32_t> data_messages = std::nullopt,
                      std::optional<bool> mapped = std::nullopt);
  static std::optional<bool> Delivery(const ReadSession& session);

  // Takes the session out of the table and runs or schedules its end: the
  // store commit (all landed), or abort + error. Returns work to run after
  // unlocking.
  std::function<void()> TakeForCommitLocked(uint64_t write_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Block `index` of `session` has landed: returns the work that encodes it
  // into the store's reserved pages on the worker pool (Store::StageBlock),
  // so that encoding overlaps the transfer of the blocks after it. Its bytes
  // are the slot's staging buffer, or `source` for a pulled block (in the
  // node's mapping of a client buffer, which `mapping` keeps alive; the
  // last reference to it is dropped on the loop thread). Run the returned
  // work after releasing mu_.
  // With `in_place`, the block was received into its pages: the work
  // checks and seals it there (InPlaceClaim::Stage).
  std::function<void()> StageLocked(
      std::shared_ptr<WriteSession> session, uint32_t index,
      const uint8_t* source = nullptr,
      std::shared_ptr<RemoteKey> mapping = nullptr,
      std::shared_ptr<store::InPlaceClaim> in_place = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why block `index` of `s` (the header's length, the message's) cannot
  // be taken now; OK when it can.
  absl::Status CheckBlockLocked(const WriteSession& s, uint32_t index,
                                uint64_t header_length, size_t length) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Receives block `index` (a slot set to kReceiving, counted in flight)
  // into its pages where it is received in place, else into `buffer`, its
  // staging: from UCX's rendezvous, or the eager bytes at `data`. Loop
  // thread.
  void ReceiveBlock(std::shared_ptr<WriteSession> session, uint32_t index,
                    std::shared_ptr<StagingBuffer> buffer, void* data,
                    size_t length, bool rendezvous);
  // A receive of block `index` ended with `status`: stages the block (its
  // `claim` when received in place) or records the failure, and lets a
  // waiting commit go on.
  void BlockArrived(const std::shared_ptr<WriteSession>& session,
                    uint32_t index, const absl::Status& status,
                    std::shared_ptr<store::InPlaceClaim> claim);
  // Binds a session to `conn_id` or checks that it is bound to it.
  static bool BindLocked(uint64_t* session_conn, uint64_t conn_id);
  void DropConnectionSessions(uint64_t conn_id);
  // Forgets the orphans whose receives ended, and adds to `close` the
  // connections of those still receiving past their lease's deadline.
  // `seen` keeps the sessions it looked at alive until the caller unlocks.
  void CloseStalledOrphansLocked(
      absl::Time now, std::vector<uint64_t>* close,
      std::vector<std::shared_ptr<WriteSession>>* seen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const DataPlaneOptions options_;
  store::Store* const store_;
  const Executor executor_;
  const Executor background_;
  // Set by Stop: a prefault under way ends at its next step.
  std::atomic<bool> prefaults_stop_{false};
  const TransferObserver observer_;
  const std::shared_ptr<StagingBudget> budget_;
  std::unique_ptr<WorkerLoop> loop_;
  std::string address_;
  std::string worker_address_;
  int port_ = 0;
  TcpSegments tcp_segments_;  // set before Start returns

  // Loop thread only.
  std::unique_ptr<Listener> listener_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Connection>> connections_;
  absl::flat_hash_map<ucp_ep_h, uint64_t> connection_by_ep_;
  uint64_t next_connection_id_ = 1;

  // Guards the session tables and, within each session, what the loop
  // thread and the worker pool share (its slots, error and claim).
  mutable Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<WriteSession>> writes_
      ABSL_GUARDED_BY(mu_);
  // Writes taken out of writes_ (failed, or taken by TakeWrite) while
  // receives of theirs were in flight. A receive into a block's pages holds
  // its write's store lease (InPlaceClaim), so one that stalls must not
  // outlive the lease's deadline: Expire then closes its connection.
  std::vector<std::weak_ptr<WriteSession>> receiving_orphans_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<ReadSession>> reads_
      ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time drain_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint32_t> connection_count_{0};
  std::atomic<uint32_t> buffer_key_count_{0};
  std::atomic<uint64_t> pulled_blocks_{0};
  std::atomic<uint64_t> blocks_received_in_place_{0};
  std::atomic<uint64_t> message_reads_{0};
  std::atomic<uint64_t> copied_reads_{0};
  std::atomic<uint64_t> blocks_decoded_into_destination_{0};
  std::atomic<uint64_t> blocks_decoded_at_read_start_{0};
  std::atomic<uint64_t> reads_checked_while_copying_{0};
  std::atomic<uint64_t> reads_checked_before_sending_{0};
  std::atomic<uint64_t> read_slices_posted_{0};
  std::atomic<uint64_t> prefaulted_buffer_bytes_{0};
  std::atomic<uint64_t> buffer_bytes_populated_by_reads_{0};
  std::atomic<uint64_t> rejected_connections_{0};
};

}  // namespace kvcache::ucx

#endif  // KVCACHE_SERVICE_UCX_DATA_PLANE_H_
