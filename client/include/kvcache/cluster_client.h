// kvcache::ClusterClient — the client of a fleet of kvcache nodes, for
// prefill and decode workers. Built on kvcache::Client (one per node).
// Its vocabulary has a header per concept, all included here:
// kvcache/cluster_options.h (ClusterOptions), kvcache/cluster_results.h
// (what Lookup, Put and Get return), kvcache/layer_stream.h (layer-wise
// reads), kvcache/cluster_status.h (NodeStatus, ClusterCounters).
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

#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvcache/call_options.h"
#include "kvcache/client.h"
#include "kvcache/cluster_options.h"
#include "kvcache/cluster_results.h"
#include "kvcache/cluster_status.h"
#include "kvcache/layer_stream.h"

namespace kvcache {

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
  struct Impl;  // client/cluster_impl.h
  explicit ClusterClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CLUSTER_CLIENT_H_
