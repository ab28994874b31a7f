// Private to the cluster client: the members of the cluster, their health,
// and the retry policy of one operation on one node, as one object
// (NodeSet).
//
// Invariants:
//  * Membership is an immutable snapshot (Membership), replaced whole on a
//    refresh; a call plans on the snapshot it took. A node that leaves is
//    retired, not destroyed, while tasks may still use it; Shutdown joins
//    the executors of members and retired nodes alike.
//  * Health: a node is up (failures == 0) or backing off until retry_at.
//    Its epoch grows each time it is marked down, so that one incident
//    marks it down once however many tasks saw it, and a task planned
//    before that does not send.
//  * Every RPC to a node runs on that node's executor (threads_per_node),
//    so a hung node cannot starve calls to the others.
#ifndef KVCACHE_CLIENT_NODE_SET_H_
#define KVCACHE_CLIENT_NODE_SET_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "base/notification.h"
#include "client/executor.h"
#include "kvcache/call_options.h"
#include "kvcache/client.h"
#include "kvcache/cluster_options.h"
#include "kvcache/cluster_status.h"

namespace kvcache::internal {

// How node answers are read (see kvcache/cluster_client.h, "Failures").
// The caller's own mistakes: returned as the call's error. Every other code
// from a node turns into misses (or `unavailable` / `rejected` writes).
bool IsCallerError(absl::StatusCode code);
// The node itself is unusable now: it is marked down.
bool IsNodeFailure(absl::StatusCode code);
// A block that is not there (or was dropped as corrupt).
bool IsMiss(absl::StatusCode code);

// INVALID_ARGUMENT unless `id` is "host:port".
absl::Status ValidateNodeId(const std::string& id);

// A namespace as registered with the cluster client.
struct ClusterNamespace {
  NamespaceSpec spec;
  uint64_t fp16_block_bytes = 0;
  uint32_t chunk_blocks = 1;  // blocks per RPC
};

// One member. Its executor runs every RPC to it; its health decides whether
// calls use it. `client` is declared before `executor` so that the
// executor (whose tasks use the client) is destroyed first.
struct NodeState {
  NodeState(std::string node_id, std::unique_ptr<Client> node_client,
            int threads);

  const std::string id;
  const uint64_t seed;
  const std::unique_ptr<Client> client;

  Mutex mu;
  int failures ABSL_GUARDED_BY(mu) = 0;
  // Incremented each time the node is marked down (see the top of file).
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;
  absl::Time retry_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  std::set<std::string> registered ABSL_GUARDED_BY(mu);  // namespace names
  std::unique_ptr<Executor> executor ABSL_GUARDED_BY(mu);
};

struct Membership {
  std::vector<std::shared_ptr<NodeState>> nodes;  // sorted by id
  std::vector<uint64_t> seeds;                    // nodes[i]->seed
};

// The keys (their indices, ascending) one usable node owns, and the epoch
// it was planned in.
struct NodePlan {
  std::shared_ptr<NodeState> node;
  uint64_t epoch = 0;
  std::vector<uint32_t> indices;
};

class NodeSet {
 public:
  // `options` and `shutting_down` must outlive the NodeSet.
  NodeSet(const ClusterOptions& options,
          std::shared_ptr<std::atomic<bool>> shutting_down);
  ~NodeSet();  // stops the refresh thread
  NodeSet(const NodeSet&) = delete;
  NodeSet& operator=(const NodeSet&) = delete;

  // ---- Membership

  // The members of options.nodes (static lists); an error of
  // Client::Connect otherwise.
  absl::Status SetStaticMembers();
  // Re-resolves options.dns_name / options.discover and replaces the
  // members when they changed (no-op for a static list). A failure keeps
  // the old members.
  absl::Status Refresh();
  // Refresh() every options.refresh_interval on a thread of its own until
  // StopRefresh() (or destruction).
  void StartRefresh();
  void StopRefresh();
  std::shared_ptr<const Membership> Members() const;
  std::vector<NodeStatus> Nodes() const;
  std::string OwnerOf(absl::string_view key) const;

  // Groups key indices [0, n) by owner on the current members. Keys of
  // nodes that may not be used now are left out (unavailable); *skipped,
  // when given and empty, names the first such node. The call using the
  // plan is the probe of a node whose backoff has passed.
  std::vector<NodePlan> PlanByOwner(
      size_t n, absl::FunctionRef<absl::string_view(size_t)> key,
      std::string* skipped = nullptr) const;

  // Ends every node's executor (queued tasks run and see the shutdown),
  // joining their threads; later Submits fail.
  void Shutdown();

  // ---- Health

  // True when the node may be used now (healthy, or its backoff has passed:
  // then this caller is the probe). *epoch: for StillUsable / MarkDown.
  bool TryUse(NodeState& node, absl::Time now, uint64_t* epoch) const;
  // False once the node was marked down after `epoch`.
  bool StillUsable(NodeState& node, uint64_t epoch) const;
  // Marks the node down (once per epoch: counted as a node failure).
  void MarkDown(NodeState& node, uint64_t epoch);

  // Runs `task` on the node's executor; false (the task dropped) once it
  // has shut down.
  bool Submit(const std::shared_ptr<NodeState>& node,
              absl::AnyInvocable<void()> task);

  // ---- Registration

  // Registers `ns` on the node unless it was already.
  absl::Status EnsureRegistered(NodeState& node, const ClusterNamespace& ns,
                                const CallOptions& rpc);
  void SetRegistered(NodeState& node, const std::string& ns, bool registered);
  // Every member registers `ns` again before its next use of it.
  void ForgetRegistrations(const std::string& ns);

  // ---- The retry policy

  struct RunFlags {
    bool ensure_registered = true;
    bool reregister_on_not_found = false;
  };
  // One operation on one node: `rpc(options)` with the options of each
  // attempt (the call's `deadline`, cut to rpc_timeout from the attempt's
  // start, and `cancel`). UNAVAILABLE and RESOURCE_EXHAUSTED are retried up
  // to max_attempts after a jittered backoff (or the node's RetryAfterMs),
  // never past `deadline`; a NOT_FOUND with reregister_on_not_found
  // registers the namespace again once. Marks the node down on
  // UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED from the node (not on a
  // CANCELLED of `cancel` or of shutdown, which ends the call: CANCELLED),
  // up on any other answer. Ends with CANCELLED once `stop` is notified.
  absl::Status RunOnNode(
      NodeState& node, uint64_t epoch, const ClusterNamespace& ns,
      const Notification& stop, absl::Time deadline,
      const std::shared_ptr<CancelToken>& cancel, RunFlags flags,
      absl::FunctionRef<absl::Status(const CallOptions&)> rpc);

  uint64_t retries() const { return retries_.load(); }
  uint64_t node_failures() const { return node_failures_.load(); }
  uint64_t membership_changes() const { return membership_changes_.load(); }
  uint64_t refresh_failures() const { return refresh_failures_.load(); }

 private:
  absl::StatusOr<std::shared_ptr<NodeState>> Connect(const std::string& id);
  absl::StatusOr<std::vector<std::string>> Discover();
  void Replace(std::shared_ptr<Membership> members,
               const std::vector<std::string>& ids);
  CallOptions RpcOptions(absl::Time deadline,
                         const std::shared_ptr<CancelToken>& cancel) const;
  // What one failed attempt leads to: true to try again (after the
  // backoff), false to return `st`.
  bool ShouldRetry(const absl::Status& st, int* attempt, absl::Time deadline,
                   const Notification& stop, bool* stopped);
  void MarkUp(NodeState& node);
  void ReleaseProbe(NodeState& node, uint64_t epoch);

  const ClusterOptions& options_;
  const std::shared_ptr<std::atomic<bool>> shutting_down_;

  mutable Mutex mu_;
  std::shared_ptr<const Membership> members_ ABSL_GUARDED_BY(mu_);
  // Former members that in-flight tasks may still use; joined at Shutdown.
  std::vector<std::shared_ptr<NodeState>> retired_ ABSL_GUARDED_BY(mu_);

  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> node_failures_{0};
  std::atomic<uint64_t> membership_changes_{0};
  std::atomic<uint64_t> refresh_failures_{0};

  Notification stop_refresh_;
  std::thread refresh_thread_;
};

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_NODE_SET_H_
