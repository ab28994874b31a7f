// ClientPlane: the client library's side of the UCX data plane (private to
// client/). One UCX context and worker with its progress thread
// (ucx::WorkerLoop), and one endpoint per node address, opened on first use
// and opened again after it fails.
//
// Contract:
//  * SendBlocks and Read::WaitLayers return within their deadline (plus the
//    time UCX takes to fail the operations of a force-closed endpoint).
//    When a deadline passes with operations in flight, the endpoint is
//    force-closed, which completes them with an error; only then does the
//    call return, so no operation outlives the caller's buffers. Other
//    operations on a force-closed endpoint fail with UNAVAILABLE (the next
//    operation opens a new connection). Read::WaitLayers also returns
//    CANCELLED at once when its CancelToken fires; that only stops the
//    wait: the read goes on until it ends or the Read is destroyed.
//  * Known limit: over transports without peer failure handling (UCX 1.13's
//    shared memory), force-closing the local endpoint does not stop the
//    node: puts of a read abandoned mid-transfer (deadline, or a Read
//    destroyed early) may still land in its destination afterwards.
//  * Every active message carries the token the node issued for that lease
//    through the control plane, and UCP_AM_SEND_FLAG_REPLY so that the node
//    can tell which connection sent it.
//  * A Read holds its destination region (shared with the caller when the
//    region is a long-lived buffer): the region stays registered at least
//    as long as the Read lives. The node destroys the remote key it
//    unpacked when that read ends.
#ifndef KVCACHE_CLIENT_UCX_CLIENT_PLANE_H_
#define KVCACHE_CLIENT_UCX_CLIENT_PLANE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "kvcache/call_options.h"
#include "transport/handles.h"
#include "transport/tcp_segments.h"
#include "transport/wire.h"
#include "transport/worker_loop.h"

namespace kvcache::ucx {

// How to reach a node's data plane (DataPlaneInfo): its worker address,
// preferred (UCX may then use shared memory), or its listener.
struct NodeAddress {
  std::string listener;  // "host:port"
  std::string worker;    // packed ucp worker address; may be empty
  // The node checks read destinations against the region's bounds
  // (DataPlaneInfo.bounded_reads): reads send them.
  bool bounded_reads = false;
  // The node takes blocks from a client buffer it maps
  // (DataPlaneInfo.pull_writes).
  bool pull_writes = false;
  // The node can send read data as messages (DataPlaneInfo.message_reads):
  // reads accept them.
  bool message_reads = false;
  // And numbers them in its send order (DataPlaneInfo.sequenced_data):
  // reads ask for that (kReadFlagSequenced).
  bool sequenced_data = false;
  // The node decodes fp16 reads into a destination it maps and says
  // whether it maps a read's destination
  // (DataPlaneInfo.decodes_into_destination): reads ask it to say
  // (kReadFlagReportMapped), see MapsDestinations.
  bool decodes_into_destination = false;
  // A read may name a long-lived buffer it does not land in
  // (DataPlaneInfo.keeps_named_buffers, kReadFlagNamesBuffer).
  bool keeps_named_buffers = false;
  // The node's UCX TCP segment sizes (DataPlaneInfo.tcp_*_seg_bytes; zero:
  // no TCP, or a node that does not say). A node whose sizes and this
  // process's would abort one side is not connected to: UNAVAILABLE.
  TcpSegments tcp_segments;
  // Connections are kept per node under this key; a node that restarts
  // has a new worker address, so a new key.
  std::string key() const { return listener + "|" + worker; }
  // For messages: the listener, or that the worker address is used.
  std::string name() const {
    return listener.empty() ? std::string("the node's worker address")
                            : listener;
  }
};

// How long a new data-plane connection may take to come up before the
// operations on it fail with UNAVAILABLE (IsDataPlaneNotConnected), so that
// an unreachable data plane costs a kAuto call this long, not its deadline.
inline constexpr absl::Duration kConnectTimeout = absl::Seconds(2);

// Whether `status` is the failure of a connection that never came up
// within kConnectTimeout.
bool IsDataPlaneNotConnected(const absl::Status& status);

// Whether `status` is the failure of a connection that failed before any
// transfer on it completed (UNAVAILABLE). The call's bytes did not all
// travel; it may be tried again once on a new connection.
bool IsFreshConnectionReset(const absl::Status& status);

// A long-lived buffer of this client's that a read names to the node
// without landing in it (ClientPlane::StartRead).
struct NamedRegion {
  uint64_t buffer_id = 0;  // 0: none
  const MemoryRegion* region = nullptr;
};

class ClientPlane {
 public:
  static absl::StatusOr<std::unique_ptr<ClientPlane>> Create();
  ~ClientPlane();
  ClientPlane(const ClientPlane&) = delete;
  ClientPlane& operator=(const ClientPlane&) = delete;

  struct Block {
    uint32_t index;  // in the write's BeginWrite list
    absl::Span<const uint8_t> bytes;
    // The registration covering `bytes` (a long-lived buffer), or null. With
    // it, a rendezvous send lets the node take the bytes straight from the
    // registered memory (on shared memory: one copy instead of two).
    ucp_mem_h memh = nullptr;
  };
  // Sends each block as one active message to the node at `address` and
  // returns when UCX has completed every send (for rendezvous sends: the
  // node has the bytes) or the first error.
  absl::Status SendBlocks(const NodeAddress& address, uint64_t write_id,
                          const Token& token, absl::Span<const Block> blocks,
                          absl::Time deadline);

  // Asks the node to take blocks of write `write_id` straight from `region`
  // (a long-lived buffer, `buffer_id`): one message naming each block's
  // index and address, all inside the region. Returns when the message is
  // sent, or the first error; the node then encodes from the region, which
  // must stay unchanged until the write's commit has answered. Only for
  // nodes that offer it (NodeAddress::pull_writes); a node that cannot map
  // the region fails the write with UNIMPLEMENTED.
  struct PullBlock {
    uint32_t index;
    uint64_t address;
  };
  absl::Status PullBlocks(const NodeAddress& address, uint64_t write_id,
                          const Token& token, const MemoryRegion& region,
                          uint64_t buffer_id,
                          absl::Span<const PullBlock> blocks,
                          absl::Time deadline);

  // Destination memory for a read: registered caller memory, or memory UCX
  // allocates (shared memory where a transport offers it).
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* address,
                                                         size_t length);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(size_t length);

  class Read;
  // Asks the node to put the blocks of read `read_id` at `destinations`
  // (one address per block, inside `region`). per_layer: the node reports
  // each layer as it lands. The Read keeps `region` registered until it is
  // destroyed.
  // buffer_id: 0 when `region` is registered for this read only; else the
  // id of the long-lived buffer it is (the node may keep its key until
  // ReleaseBuffer).
  // named: a long-lived buffer the read does not land in but later reads
  // may (the DataBuffer a read landed in a pooled buffer is decoded into),
  // named to nodes that keep such buffers (NodeAddress::keeps_named_buffers)
  // so that they map it ahead of those reads; ignored otherwise, or when
  // its id is 0 or buffer_id's.
  absl::StatusOr<std::unique_ptr<Read>> StartRead(
      const NodeAddress& address, uint64_t read_id, const Token& token,
      std::shared_ptr<MemoryRegion> region,
      const std::vector<uint64_t>& destinations, uint32_t num_layers,
      bool per_layer, uint64_t buffer_id = 0, NamedRegion named = {});

  // What the last successful read from the node of `node_key`
  // (NodeAddress::key) into a long-lived buffer (buffer_id != 0: a
  // DataBuffer, or a pooled region reads land in) heard: whether the node
  // wrote it through its own mapping (shared memory); nullopt before any
  // such read, or after a read to that node found it not offering
  // decodes_into_destination. Reads into memory registered for one read
  // neither ask nor count: the node may not map those where it maps
  // DataBuffers.
  std::optional<bool> MapsDestinations(const std::string& node_key) const;

  // Tells every connected node to drop the key it kept for `buffer_id`
  // (best effort; a connection's end drops it too). Does not wait.
  void ReleaseBuffer(uint64_t buffer_id);

  // Runs `task` on the progress thread after what is queued there; false
  // when the plane is closing. For tests: a task that blocks holds back
  // the start of every read begun meanwhile.
  bool PostForTest(absl::AnyInvocable<void()> task);

 private:
  struct Connection;
  struct ReadState;

  explicit ClientPlane(std::unique_ptr<WorkerLoop> loop);
  absl::Status InstallHandlers();

  // Loop thread.
  static void OnEndpointError(void* arg, ucp_ep_h ep,
                              ucs_status_t status) noexcept;
  static ucs_status_t OnReadStatus(void* arg, const void* header,
                                   size_t header_length, void* data,
                                   size_t length,
                                   const ucp_am_recv_param_t* param) noexcept;
  static ucs_status_t OnReadData(void* arg, const void* header,
                                 size_t header_length, void* data,
                                 size_t length,
                                 const ucp_am_recv_param_t* param) noexcept;
  // Whether a read into `buffer_id`'s region asks the node of `address` to
  // report its delivery (kReadFlagReportMapped), see MapsDestinations.
  static bool LearnsMapping(const NodeAddress& address, uint64_t buffer_id);
  // The read named by `token` bytes, if it is in progress.
  std::shared_ptr<ReadState> FindRead(const std::string& token);
  // Records successful status `h` of `state` and returns true when it
  // reports more layers than the last one; false (to be dropped) when it
  // reports no more; INTERNAL when its layer count differs from the earlier
  // ones' or is exceeded, or it follows fewer data messages than the last.
  static absl::StatusOr<bool> AcceptStatus(ReadState& state,
                                           const ReadStatusHeader& h);
  // The place of data message `h` of `state` in the node's send order: its
  // sequence on a sequenced read (INTERNAL when it has none or repeats one
  // already numbered), else its place among the arrivals so far.
  static absl::StatusOr<uint32_t> NumberDataMessage(ReadState& state,
                                                    const ReadDataHeader& h);
  // A data message of `state` has landed (or failed: `status`).
  // `index`: its number from NumberDataMessage.
  void DataLanded(const std::shared_ptr<ReadState>& state, uint32_t index,
                  const absl::Status& status);
  // Ends `state` once none of its data messages is still being received
  // (their bytes land in its region until then).
  void DetachWhenReceived(const std::shared_ptr<ReadState>& state,
                          const absl::Status& why);
  absl::StatusOr<Connection*> GetConnection(const NodeAddress& address);
  void CloseConnection(uint64_t conn_id, const absl::Status& why);
  void ForceCloseAddress(const std::string& address);
  // Closes the connection of `key` as UNAVAILABLE (IsDataPlaneNotConnected)
  // if UCX has not connected it kConnectTimeout after it was made.
  void CloseIfNotConnected(const std::string& key);
  // A transfer on the connection of `address` completed (Connection::used).
  void MarkUsed(const std::string& address);
  // With KVCACHE_UCX_DEBUG set: prints the connection's transport lanes
  // once, after its first completed transfer.
  void DescribeOnce(const std::string& address);
  // Ends the read of `token` if it is still registered.
  void EndRead(const std::string& token, uint32_t layers_done,
               const absl::Status& status);

  std::unique_ptr<WorkerLoop> loop_;
  TcpSegments tcp_segments_;  // this process's, read once by Create
  // Loop thread only.
  absl::flat_hash_map<std::string, std::unique_ptr<Connection>> connections_;
  absl::flat_hash_map<ucp_ep_h, std::string> address_by_ep_;
  // Nodes refused for their TCP segment sizes, each reported once.
  absl::flat_hash_set<std::string> refused_segments_;
  // Reads in progress: token -> the key of their connection.
  absl::flat_hash_map<std::string, std::string> read_connection_;
  uint64_t next_connection_id_ = 1;
  std::string worker_address_;  // set once by InstallHandlers
  // MapsDestinations: by node key, written on the loop thread.
  mutable Mutex maps_mu_;
  absl::flat_hash_map<std::string, bool> maps_destinations_
      ABSL_GUARDED_BY(maps_mu_);
};

// A read in progress: the node puts into the region and reports layers.
class ClientPlane::Read {
 public:
  ~Read();
  Read(const Read&) = delete;
  Read& operator=(const Read&) = delete;

  // Waits until `layers` layers are in place (num_layers: all), the read
  // failed, `deadline` (DEADLINE_EXCEEDED; where closing the connection
  // stops the node's puts, a read that has not ended kSettleGrace later is
  // force-closed and fails, otherwise the read stays open for the
  // destructor), or `cancel` (optional) fires: then this wait returns
  // CANCELLED and the read goes on.
  absl::Status WaitLayers(uint32_t layers, absl::Time deadline,
                          CancelToken* cancel = nullptr);
  uint32_t num_layers() const { return num_layers_; }
  // The most statuses the read held at once, waiting for their data to land
  // (at most one per layer; for tests and diagnostics).
  uint32_t most_statuses_held() const;
  // Destroying a Read that the progress thread has not sent yet (it starts
  // there, StartRead only queues it) stops it from being sent: no byte of
  // it lands. Destroying a Read that has not ended: on connections where
  // closing stops the node (TCP, verbs) the read may end on its own for
  // kSettleGrace, then the connection is closed; on UCX
  // 1.13's shared memory, where it does not, the destructor first waits
  // (bounded by kAbandonGrace) for the node's final report, so that no put
  // lands in the region afterwards, and closes the connection only past
  // that bound.
  MemoryRegion& region() { return *region_; }

  // `tell_node` runs once, on the thread that destroys this Read, when its
  // ReadStart never reached the node: abandoned while still queued, its
  // connection failed before it went out, or sending it failed. The node
  // leased the blocks when the read began (BeginRead) and otherwise holds
  // them until the lease's TTL; `tell_node` ends that lease (EndRead). To
  // be set before anything may destroy the Read.
  void SetOnUnsent(absl::AnyInvocable<void()> tell_node) {
    on_unsent_ = std::move(tell_node);
  }

 private:
  friend class ClientPlane;
  // Settles or force-closes (SettleOrClose) when `deadline` passes first.
  absl::Status WaitLayersUntil(uint32_t layers, absl::Time deadline,
                               const std::atomic<bool>* cancelled);
  Read(ClientPlane* plane, std::string address,
       std::shared_ptr<ReadState> state, std::shared_ptr<MemoryRegion> region,
       uint32_t num_layers)
      : plane_(plane),
        address_(std::move(address)),
        state_(std::move(state)),
        region_(std::move(region)),
        num_layers_(num_layers) {}

  // Closes the read's connection and waits (bounded) until it is detached.
  absl::Status CloseAndWaitDetached();
  // Lets the read end on its own (kSettleGrace where closing stops the
  // node's puts, kAbandonGrace where it does not; then, once ended, until
  // its receives have landed), so that no other call loses the connection;
  // past that, closes it (CloseAndWaitDetached). The destructor's path too.
  absl::Status SettleOrClose();

  ClientPlane* plane_;
  std::string address_;
  std::shared_ptr<ReadState> state_;
  std::shared_ptr<MemoryRegion> region_;
  uint32_t num_layers_;
  absl::AnyInvocable<void()> on_unsent_;
};

}  // namespace kvcache::ucx

#endif  // KVCACHE_CLIENT_UCX_CLIENT_PLANE_H_
