// Private to the cluster client: ClusterClient::Impl, shared by
// cluster_client.cc (Create, the per-key operations) and layer_stream.cc
// (GetLayerwise).
//
// Threading: tasks on the node executors and on `work` hold a pointer to
// the Impl; the destructor ends them all (executors joined) before any
// member goes.
#ifndef KVCACHE_CLIENT_CLUSTER_IMPL_H_
#define KVCACHE_CLIENT_CLUSTER_IMPL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "client/executor.h"
#include "client/fan_out.h"
#include "client/node_set.h"
#include "kvcache/cluster_client.h"
#include "kvcache/layer_stream.h"

namespace kvcache {
namespace internal {

// INVALID_ARGUMENT unless every key is 1 to 64 bytes.
absl::Status ValidateKeys(const std::vector<std::string>& keys);

}  // namespace internal

struct ClusterClient::Impl {
  explicit Impl(ClusterOptions cluster_options);
  // Stops the refresh, cancels every call (their RPCs and data-plane waits
  // included) and joins every executor.
  ~Impl();

  absl::StatusOr<std::shared_ptr<const internal::ClusterNamespace>>
  FindNamespace(const std::string& ns) const;
  // The deadline of a call with `call`.
  absl::Time Deadline(const CallOptions& call) const;
  // See internal::Arm.
  template <typename C>
  void Arm(const std::shared_ptr<C>& fan_out,
           const std::shared_ptr<CancelToken>& cancel) {
    internal::Arm(timer.get(), shutting_down, fan_out, cancel);
  }
  // Plans keys[0, keys.size()) by owner (NodeSet::PlanByOwner).
  std::vector<internal::NodePlan> PlanKeys(
      const std::vector<std::string>& keys,
      std::string* skipped = nullptr) const;
  // Starts the GetIntos of a layer-wise read of `keys` (validated) in
  // `space` into `state` (layer_stream.cc).
  void StartLayerFetch(const std::shared_ptr<LayerStream::State>& state,
                       std::shared_ptr<const internal::ClusterNamespace> space,
                       std::vector<std::string> keys, absl::Time deadline);
  // Submits to `node` (for FanOutCall::Spawn).
  auto SubmitTo(const std::shared_ptr<internal::NodeState>& node) {
    return [this, node](absl::AnyInvocable<void()> task) {
      return nodes.Submit(node, std::move(task));
    };
  }

  const ClusterOptions options;
  std::unique_ptr<internal::DeadlineTimer> timer;
  std::unique_ptr<internal::Executor> work;  // layer-wise decode, delivery
  const std::shared_ptr<std::atomic<bool>> shutting_down;
  // Fired by the destructor: ends the RPCs and transfers of layer-wise
  // streams, which a stream's own cancel lets run out.
  const std::shared_ptr<CancelToken> shutdown_cancel;
  internal::NodeSet nodes;
  std::atomic<uint64_t> unavailable_keys{0};

  mutable Mutex mu;
  std::map<std::string, std::shared_ptr<const internal::ClusterNamespace>>
      namespaces ABSL_GUARDED_BY(mu);
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CLUSTER_IMPL_H_
