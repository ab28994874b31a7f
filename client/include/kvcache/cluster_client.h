// kvcache::ClusterClient — the client of a fleet of kvcache nodes, for
// prefill and decode workers. Built on kvcache::Client (one per node).
//
// Sharding: every key is owned by one node, chosen by rendezvous
// (highest-random-weight) hashing on xxh3 over the current members (the
// scheme is in docs/client.md, so that clients in any language agree), of
// the whole key or of its routing tag (routing_prefix_bytes). Blocks of one
// prefix chain are spread over the nodes (per block, or per segment with
// routing tags); Lookup asks every node about its keys in parallel and
// returns the longest prefix whose every key was found on its owner.
//
// Membership: a static list of "host:port", or a DNS name (a Kubernetes
// headless Service) whose A records are re-resolved every refresh_interval;
// a node is identified by "ip:port". Keys move only to or from the nodes
// that join or leave.
//
// Failures are misses, not errors: a node that answers UNAVAILABLE
// (down, draining), DEADLINE_EXCEEDED (hung, or slower than the RPC's
// deadline: rpc_timeout or the call's deadline, whichever comes first) or
// CANCELLED is marked down; calls skip it (its keys are misses, its writes
// are not stored and counted as `unavailable`) until a jittered exponential
// backoff (node_backoff_initial doubling to node_backoff_max) has passed,
// when one call probes it again. An RPC that this client cancelled (the
// caller's cancel, shutdown) does not count against the node. NOT_FOUND and
// DATA_LOSS of a block are misses. Only the caller's own mistakes are
// errors: INVALID_ARGUMENT (bad key, wrong block size), FAILED_PRECONDITION
// (a namespace not registered with this ClusterClient, a layout mismatch),
// PERMISSION_DENIED, UNAUTHENTICATED, and CANCELLED when the caller
// cancelled.
//
// Deadlines: every call has one (CallDeadline(CallOptions,
// ClusterOptions::default_timeout): CallOptions::timeout and/or
// CallOptions::deadline) covering its retries. Each RPC attempt is sent
// with the call's deadline, cut to rpc_timeout from its start (the
// deadline of the kvcache::Client call), so nothing waits past the call's
// deadline: Lookup, Get and Delete complete at the latest at their
// deadline, with what they have (keys not answered by then are misses);
// Put completes at its deadline too, never reading the caller's block
// buffers afterwards (a data-plane send still running then is stopped by
// closing its connection; an inline commit cut short may still be applied
// by the node: such blocks count as `unavailable`).
//
// Retries: UNAVAILABLE and RESOURCE_EXHAUSTED only, up to max_attempts per
// node and call, after a jittered exponential backoff (retry_initial_backoff
// doubling to retry_max_backoff, each delay drawn uniformly from [d/2, d]),
// or after the node's RetryAfterMs hint for RESOURCE_EXHAUSTED; never past
// the call's deadline.
//
// Cancellation: a CancelToken in CallOptions; Cancel() completes the calls
// that carry it with CANCELLED at once (on the cancelling thread) and
// cancels their RPCs in flight (kvcache::Client's TryCancel). Bytes already
// moving over the UCX data plane for a Put or Get finish moving (bounded by
// the deadline) rather than close a connection other calls share; a
// layer-wise stream stops delivering at once and lets its transfers run
// out the same way.
//
// Threading: a ClusterClient is thread-safe. Each node has its own worker
// threads (threads_per_node), so a hung node cannot starve calls to the
// others. Callbacks of the *Async calls run exactly once on a client thread
// (a node worker, the deadline timer, or the thread calling
// CancelToken::Cancel); they must not block, must not call the synchronous
// methods, and must not destroy the ClusterClient. The destructor cancels
// outstanding calls (their RPCs and data-plane waits included) and returns
// once every task has ended.
#ifndef KVCACHE_CLIENT_CLUSTER_CLIENT_H_
#define KVCACHE_CLIENT_CLUSTER_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvcache/call_options.h"
#include "kvcache/client.h"

namespace kvcache {

namespace internal {
class DeadlineTimer;
class Executor;
struct NodeState;
struct Membership;
}  // namespace internal

struct ClusterOptions {
  // Either a static list of "host:port" (each a node id, as written) ...
  std::vector<std::string> nodes;
  // ... or a DNS name whose A records are the nodes, at dns_port.
  std::string dns_name;
  int dns_port = 50051;
  // ... or a discovery function returning node ids ("host:port"); it
  // replaces DNS when set (custom service discovery, tests).
  std::function<absl::StatusOr<std::vector<std::string>>()> discover;
  // Re-resolution period of dns_name / discover; zero: only at Create and
  // at RefreshMembership(). A failed re-resolution keeps the old members.
  absl::Duration refresh_interval = absl::Seconds(10);
  // > 0: place a key by its first this many bytes (the routing tag of
  // BlockHashConfig::segment_blocks, kRoutingTagBytes) instead of the whole
  // key, so that a segment of a chain stays on one node. Every client of a
  // fleet must use the same value.
  uint32_t routing_prefix_bytes = 0;

  absl::Duration default_timeout = absl::Seconds(5);
  // One RPC attempt on one node (for a layer-wise read: its BeginRead and
  // the transfer that follows).
  absl::Duration rpc_timeout = absl::Seconds(2);
  int max_attempts = 3;  // per node and call; >= 1
  absl::Duration retry_initial_backoff = absl::Milliseconds(20);
  absl::Duration retry_max_backoff = absl::Seconds(1);
  absl::Duration node_backoff_initial = absl::Milliseconds(250);
  absl::Duration node_backoff_max = absl::Seconds(30);

  int threads_per_node = 4;
  int work_threads = 2;               // layer-wise decode and delivery
  uint32_t max_blocks_per_rpc = 256;  // <= the nodes' --max-blocks-per-request
  int max_message_bytes = 256 << 20;
  // Where KV bytes travel to and from each node (ClientOptions::data_plane).
  DataPlane data_plane = DataPlane::kAuto;
};

struct ClusterLookupResult {
  uint32_t prefix_blocks = 0;  // keys[0, prefix_blocks) are cached
  // Keys whose node could not be asked or did not answer in time (down,
  // draining, hung, or the call's deadline came first): counted as misses.
  uint32_t unavailable_keys = 0;
};

struct ClusterPutResult {
  uint32_t stored = 0;   // written now
  uint32_t skipped = 0;  // stored already
  // Not confirmed: the owner was down, draining or timed out, or the call
  // ended first (such a block may or may not have been stored).
  uint32_t unavailable = 0;
  // Not stored: the owner stayed full (RESOURCE_EXHAUSTED) after retries.
  uint32_t rejected = 0;
  // Why: the first status an owner answered for blocks counted unavailable
  // or rejected (UNAVAILABLE naming an owner skipped while it backs off
  // after failures; DEADLINE_EXCEEDED when the call ended before owners
  // answered). OK when every block was stored or skipped.
  absl::Status why_not_stored;
};

struct ClusterGetResult {
  // The longest prefix of the keys that was read: keys[0, prefix_blocks).
  // A key missing, evicted, corrupt (DATA_LOSS) or on an unavailable node
  // ends the prefix. (Each node is asked with allow_missing: one round
  // trip per node and chunk, whatever it holds.)
  uint32_t prefix_blocks = 0;
  // read.blocks has prefix_blocks entries, in key order (block i's index
  // is i); read.missing is empty; read.shape and read.policy describe them
  // (DecodeRaw(read, block, out) for kRaw).
  GetResult read;
  uint32_t unavailable_keys = 0;  // as in ClusterLookupResult
};

// One layer of one block of a layer-wise read: K and V, [T][H][D] each.
struct LayerSlice {
  uint32_t block = 0;  // index into the keys
  absl::Span<const uint16_t> k;
  absl::Span<const uint16_t> v;
};

// Called once per layer, in layer order, on a client work thread, with the
// layer of every block of the loaded prefix (e.g. to scatter it into the
// engine's paged cache with ScatterStoreBlockLayer). An error stops the
// stream: that layer and later ones fail with it.
using LayerCallback = std::function<absl::Status(
    uint32_t layer, absl::Span<const LayerSlice> blocks)>;

struct LayerwiseOptions {
  // kRaw: the node sends the stored encoding and it is dequantized here,
  // one layer at a time; kFp16: the node dequantizes.
  ReadFormat format = ReadFormat::kFp16;
  LayerCallback on_layer;  // optional
  CallOptions call;
  // How long WaitLayer may wait past the call's deadline for local work
  // (decode, on_layer) on a fetched prefix.
  absl::Duration local_work_budget = absl::Seconds(10);
};

// A layer-wise read in progress (ClusterClient::GetLayerwise).
//
// How it travels: one kvcache::Client::GetInto (allow_missing) per node and
// chunk of at most max_blocks_per_rpc keys, all in parallel, into buffers
// the stream owns. The nodes' answers fix the prefix (the longest run of
// keys found, once every node has answered or at the call's deadline).
// Over the UCX data plane each node then puts its blocks layer by layer
// (all blocks' layer l, then l+1), and layer l is ready as soon as it has
// arrived from every node holding blocks of the prefix: it is decoded
// (kRaw: each block's encoding is cut into per-layer sections, decoded
// bit-identically to the node's own decode), handed to on_layer and
// released to WaitLayer while later layers are still on the wire. Over
// the inline gRPC path every layer of a node's chunk arrives at once; the
// decode and delivery still go layer by layer.
//
// Failures: a node that is down, hung or misses keys shortens the prefix
// (misses, as for Get). A node that fails after the prefix was fixed (its
// transfer breaks) fails the layers not yet delivered with UNAVAILABLE (or
// DEADLINE_EXCEEDED): those layers must be recomputed, the ones delivered
// stay valid. A stopped stream (Cancel, the caller's token, destruction, a
// WaitLayer past its bound) lets its transfers run out before their
// buffers go; only ClusterClient's destructor cuts them short.
class LayerStream {
 public:
  ~LayerStream();  // cancels what is left; waits for a running on_layer
  LayerStream(const LayerStream&) = delete;
  LayerStream& operator=(const LayerStream&) = delete;

  // Blocks until layer `layer` of every block of the loaded prefix is
  // ready (and delivered to on_layer), then returns the prefix length (the
  // same for every layer; 0 when nothing was cached). Errors: CANCELLED,
  // DEADLINE_EXCEEDED (the layer did not arrive in time, or the local work
  // budget ran out), UNAVAILABLE (a node failed mid-transfer),
  // INVALID_ARGUMENT (layer out of range, a bad key), FAILED_PRECONDITION
  // (namespace not registered), DATA_LOSS (a block of the wrong size), or
  // on_layer's error. Bounded by the call's deadline plus
  // local_work_budget.
  absl::StatusOr<uint32_t> WaitLayer(uint32_t layer);

  // Layer `layer` of block `block`; valid once WaitLayer(layer) succeeded,
  // for the stream's lifetime. Empty spans out of range.
  absl::Span<const uint16_t> K(uint32_t block, uint32_t layer) const;
  absl::Span<const uint16_t> V(uint32_t block, uint32_t layer) const;

  // Keys of unavailable nodes (valid once WaitLayer succeeded once).
  uint32_t unavailable_keys() const;

  // Stops the stream: no further on_layer call starts; waiting and future
  // WaitLayer calls fail with CANCELLED (layers ready before stay
  // readable through K and V).
  void Cancel();

  struct State;

 private:
  friend class ClusterClient;
  explicit LayerStream(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

struct NodeStatus {
  std::string id;  // "host:port"
  bool up = true;  // false while in backoff after a failure
  int consecutive_failures = 0;
  absl::Time retry_at = absl::InfinitePast();  // when a probe may go
};

struct ClusterCounters {
  uint64_t retries = 0;             // RPC attempts repeated after a backoff
  uint64_t node_failures = 0;       // times a node was marked down
  uint64_t unavailable_keys = 0;    // keys answered as misses for that
  uint64_t membership_changes = 0;  // refreshes that changed the members
  uint64_t refresh_failures = 0;    // DNS / discovery errors
};

class ClusterClient {
 public:
  using LookupCallback =
      absl::AnyInvocable<void(absl::StatusOr<ClusterLookupResult>)>;
  using PutCallback =
      absl::AnyInvocable<void(absl::StatusOr<ClusterPutResult>)>;
  using GetCallback =
      absl::AnyInvocable<void(absl::StatusOr<ClusterGetResult>)>;

  // INVALID_ARGUMENT for bad options (none or several of nodes / dns_name /
  // discover, a bad node id, non-positive timeouts or counts). With DNS or
  // discover, a failing first resolution is not an error: the client starts
  // with no members (every key a miss) and keeps resolving.
  static absl::StatusOr<std::unique_ptr<ClusterClient>> Create(
      ClusterOptions options);
  ~ClusterClient();
  ClusterClient(const ClusterClient&) = delete;
  ClusterClient& operator=(const ClusterClient&) = delete;

  // Registers `spec` on every member now and on every later member before
  // its first use (and again on a member that lost it, e.g. restarted).
  // spec.policy must be set (every node must store the namespace the same
  // way). Returns the first member's answer; FAILED_PRECONDITION or
  // INVALID_ARGUMENT when a member refuses the spec; UNAVAILABLE when no
  // member answered (the spec is still kept and registered later).
  absl::StatusOr<NamespaceInfo> RegisterNamespace(
      const NamespaceSpec& spec, const CallOptions& options = {});

  // Longest cached prefix of `keys` (ordered, normally a BlockHashChain).
  void LookupAsync(const std::string& ns, std::vector<std::string> keys,
                   const CallOptions& options, LookupCallback done);
  std::future<absl::StatusOr<ClusterLookupResult>> LookupAsync(
      const std::string& ns, std::vector<std::string> keys,
      const CallOptions& options = {});
  absl::StatusOr<ClusterLookupResult> Lookup(const std::string& ns,
                                             std::vector<std::string> keys,
                                             const CallOptions& options = {});

  // Stores whole blocks on their owners. A block's parent_key defaults to
  // the previous block of `blocks` (the first one's: none). The fp16 spans
  // must stay valid until the call completes. Block sizes and keys are
  // checked before anything is sent; not all-or-nothing across nodes.
  void PutAsync(const std::string& ns, absl::Span<const BlockWrite> blocks,
                const CallOptions& options, PutCallback done);
  std::future<absl::StatusOr<ClusterPutResult>> PutAsync(
      const std::string& ns, absl::Span<const BlockWrite> blocks,
      const CallOptions& options = {});
  absl::StatusOr<ClusterPutResult> Put(const std::string& ns,
                                       absl::Span<const BlockWrite> blocks,
                                       const CallOptions& options = {});

  // Reads the longest readable prefix of `keys`.
  void GetAsync(const std::string& ns, std::vector<std::string> keys,
                ReadFormat format, const CallOptions& options,
                GetCallback done);
  std::future<absl::StatusOr<ClusterGetResult>> GetAsync(
      const std::string& ns, std::vector<std::string> keys,
      ReadFormat format = ReadFormat::kFp16, const CallOptions& options = {});
  absl::StatusOr<ClusterGetResult> Get(const std::string& ns,
                                       std::vector<std::string> keys,
                                       ReadFormat format = ReadFormat::kFp16,
                                       const CallOptions& options = {});

  // Reads the longest readable prefix of `keys` and hands it over layer by
  // layer (see LayerStream). Never null.
  std::unique_ptr<LayerStream> GetLayerwise(const std::string& ns,
                                            std::vector<std::string> keys,
                                            LayerwiseOptions options);

  // Deletes `keys` from their owners; returns how many were stored.
  // Unavailable owners keep theirs (stale blocks are still correct KV).
  absl::StatusOr<uint32_t> Delete(const std::string& ns,
                                  std::vector<std::string> keys,
                                  const CallOptions& options = {});

  // Re-resolves the DNS name / discover now (no-op for a static list).
  absl::Status RefreshMembership();
  std::vector<NodeStatus> Nodes() const;
  // The owner's id; empty when there are no members.
  std::string OwnerOf(absl::string_view key) const;
  ClusterCounters counters() const;

 private:
  struct Namespace;
  template <typename Partial, typename Result>
  class Call;

  explicit ClusterClient(ClusterOptions options);
  absl::StatusOr<std::vector<std::string>> Discover();
  void RefreshLoop();
  std::shared_ptr<const internal::Membership> Members() const;
  absl::StatusOr<std::shared_ptr<const Namespace>> FindNamespace(
      const std::string& ns) const;
  absl::Time Deadline(const CallOptions& options) const;
  // The options of one RPC of a call: the call's deadline, at most
  // rpc_timeout from now, and `cancel`.
  CallOptions RpcOptions(absl::Time deadline,
                         const std::shared_ptr<CancelToken>& cancel) const;
  // Stops `call` at its deadline and when `cancel` fires.
  template <typename C>
  void Arm(const std::shared_ptr<C>& call,
           const std::shared_ptr<CancelToken>& cancel);
  absl::Status EnsureRegistered(internal::NodeState& node, const Namespace& ns,
                                const CallOptions& rpc);
  struct RunFlags {
    bool ensure_registered = true;
    bool reregister_on_not_found = false;
  };
  // One operation on one node with the retry policy: `rpc(options)` with
  // the options of each attempt (RpcOptions(deadline, cancel)). Marks the
  // node down on UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED from the node
  // (not on a CANCELLED of `cancel` or of shutdown).
  template <typename Fn>
  absl::Status RunOnNode(internal::NodeState& node, uint64_t epoch,
                         const Namespace& ns, absl::Notification& stop,
                         absl::Time deadline,
                         const std::shared_ptr<CancelToken>& cancel,
                         RunFlags flags, Fn&& rpc);
  bool Submit(const std::shared_ptr<internal::NodeState>& node,
              absl::AnyInvocable<void()> task);
  void GetAsyncAt(const std::string& ns, std::vector<std::string> keys,
                  ReadFormat format, absl::Time deadline,
                  const std::shared_ptr<CancelToken>& cancel, GetCallback done);

  const ClusterOptions options_;
  std::unique_ptr<internal::DeadlineTimer> timer_;
  std::unique_ptr<internal::Executor> work_;
  std::shared_ptr<std::atomic<bool>> shutting_down_;
  // Fired by the destructor: ends the RPCs and transfers of layer-wise
  // streams, which a stream's own cancel lets run out.
  const std::shared_ptr<CancelToken> shutdown_cancel_ =
      std::make_shared<CancelToken>();

  mutable absl::Mutex mu_;
  std::shared_ptr<const internal::Membership> members_ ABSL_GUARDED_BY(mu_);
  // Former members that in-flight tasks may still use; joined at exit.
  std::vector<std::shared_ptr<internal::NodeState>> retired_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<const Namespace>> namespaces_
      ABSL_GUARDED_BY(mu_);

  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> node_failures_{0};
  std::atomic<uint64_t> unavailable_keys_{0};
  std::atomic<uint64_t> membership_changes_{0};
  std::atomic<uint64_t> refresh_failures_{0};

  absl::Notification stop_refresh_;
  std::thread refresh_thread_;
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CLUSTER_CLIENT_H_
