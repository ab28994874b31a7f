#include "client/node_set.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/rendezvous.h"

namespace kvcache::internal {
namespace {

// d doubled per attempt from `initial`, capped at `max`, then drawn
// uniformly from [d/2, d].
absl::Duration JitteredBackoff(absl::Duration initial, absl::Duration max,
                               int attempt) {
  absl::Duration d = initial;
  for (int i = 1; i < attempt && d < max; ++i) d *= 2;
  d = std::min(d, max);
  thread_local absl::BitGen gen;
  return d * absl::Uniform(gen, 0.5, 1.0);
}

// The bytes a key is placed by: its first `prefix` bytes (0: all of it).
absl::string_view RoutingBytes(absl::string_view key, uint32_t prefix) {
  return prefix == 0 ? key : key.substr(0, prefix);
}

absl::Status CallEnded() { return absl::CancelledError("the call has ended"); }

}  // namespace

bool IsCallerError(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kUnimplemented:
      return true;
    default:
      return false;
  }
}

bool IsNodeFailure(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kCancelled;
}

bool IsMiss(absl::StatusCode code) {
  return code == absl::StatusCode::kNotFound ||
         code == absl::StatusCode::kDataLoss;
}

absl::Status ValidateNodeId(const std::string& id) {
  size_t colon = id.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(id).substr(colon + 1), &port) ||
      port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("node '", id, "' is not host:port"));
  }
  return absl::OkStatus();
}

NodeState::NodeState(std::string node_id, std::unique_ptr<Client> node_client,
                     int threads)
    : id(std::move(node_id)),
      seed(NodeSeed(id)),
      client(std::move(node_client)),
      executor(std::make_unique<Executor>(threads)) {}

NodeSet::NodeSet(const ClusterOptions& options,
                 std::shared_ptr<std::atomic<bool>> shutting_down)
    : options_(options),
      shutting_down_(std::move(shutting_down)),
      members_(std::make_shared<Membership>()) {}

NodeSet::~NodeSet() { StopRefresh(); }

// ---------------------------------------------------------------------------
// Membership

absl::StatusOr<std::shared_ptr<NodeState>> NodeSet::Connect(
    const std::string& id) {
  ClientOptions co;
  co.target = id;
  co.timeout = options_.rpc_timeout;
  co.max_message_bytes = options_.max_message_bytes;
  co.data_plane = options_.data_plane;
  co.tls = options_.tls;
  co.bearer_token = options_.bearer_token;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(co);
  if (!client.ok()) return client.status();
  return std::make_shared<NodeState>(id, *std::move(client),
                                     options_.threads_per_node);
}

absl::Status NodeSet::SetStaticMembers() {
  std::vector<std::string> ids = options_.nodes;
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  auto m = std::make_shared<Membership>();
  for (const std::string& id : ids) {
    absl::StatusOr<std::shared_ptr<NodeState>> node = Connect(id);
    if (!node.ok()) return node.status();
    m->nodes.push_back(*std::move(node));
    m->seeds.push_back(m->nodes.back()->seed);
  }
  MutexLock lock(&mu_);
  members_ = std::move(m);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> NodeSet::Discover() {
  absl::StatusOr<std::vector<std::string>> ids =
      options_.discover ? options_.discover()
                        : ResolveIpv4(options_.dns_name, options_.dns_port);
  if (!ids.ok()) return ids.status();
  for (const std::string& id : *ids) {
    if (absl::Status s = ValidateNodeId(id); !s.ok()) return s;
  }
  std::sort(ids->begin(), ids->end());
  ids->erase(std::unique(ids->begin(), ids->end()), ids->end());
  return ids;
}

absl::Status NodeSet::Refresh() {
  if (!options_.nodes.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<std::string>> ids = Discover();
  if (!ids.ok()) {
    refresh_failures_.fetch_add(1);
    return ids.status();
  }
  std::shared_ptr<const Membership> old = Members();
  std::vector<std::string> old_ids;
  for (const auto& n : old->nodes) old_ids.push_back(n->id);
  if (old_ids == *ids) return absl::OkStatus();

  auto m = std::make_shared<Membership>();
  for (const std::string& id : *ids) {
    std::shared_ptr<NodeState> node;
    for (const auto& n : old->nodes) {
      if (n->id == id) node = n;
    }
    if (node == nullptr) {
      absl::StatusOr<std::shared_ptr<NodeState>> connected = Connect(id);
      if (!connected.ok()) return connected.status();
      node = *std::move(connected);
    }
    m->nodes.push_back(node);
    m->seeds.push_back(node->seed);
  }
  old.reset();
  Replace(std::move(m), *ids);
  membership_changes_.fetch_add(1);
  return absl::OkStatus();
}

// Installs `members` (of `ids`, sorted); the nodes that left are retired.
void NodeSet::Replace(std::shared_ptr<Membership> members,
                      const std::vector<std::string>& ids) {
  std::vector<std::shared_ptr<NodeState>> drop;
  {
    MutexLock lock(&mu_);
    for (const auto& n : members_->nodes) {
      if (!std::binary_search(ids.begin(), ids.end(), n->id)) {
        retired_.push_back(n);
      }
    }
    members_ = std::move(members);
    // A retired node referenced only from here has no task left: free it
    // (outside the lock; that joins its idle threads).
    for (auto& n : retired_) {
      if (n.use_count() == 1) drop.push_back(std::move(n));
    }
    retired_.erase(std::remove(retired_.begin(), retired_.end(), nullptr),
                   retired_.end());
  }
  drop.clear();
}

void NodeSet::StartRefresh() {
  refresh_thread_ = std::thread([this] {
    while (!stop_refresh_.WaitForNotificationWithTimeout(
        options_.refresh_interval)) {
      Refresh().IgnoreError();
    }
  });
}

void NodeSet::StopRefresh() {
  stop_refresh_.Notify();
  if (refresh_thread_.joinable()) refresh_thread_.join();
}

std::shared_ptr<const Membership> NodeSet::Members() const {
  MutexLock lock(&mu_);
  return members_;
}

std::vector<NodeStatus> NodeSet::Nodes() const {
  std::vector<NodeStatus> out;
  for (const auto& n : Members()->nodes) {
    MutexLock lock(&n->mu);
    NodeStatus s;
    s.id = n->id;
    s.consecutive_failures = n->failures;
    s.up = n->failures == 0;
    s.retry_at = n->retry_at;
    out.push_back(std::move(s));
  }
  return out;
}

std::string NodeSet::OwnerOf(absl::string_view key) const {
  std::shared_ptr<const Membership> m = Members();
  if (m->nodes.empty()) return "";
  return m
      ->nodes[RendezvousOwner(m->seeds,
                              RoutingBytes(key, options_.routing_prefix_bytes))]
      ->id;
}

std::vector<NodePlan> NodeSet::PlanByOwner(
    size_t n, absl::FunctionRef<absl::string_view(size_t)> key,
    std::string* skipped) const {
  std::shared_ptr<const Membership> m = Members();
  std::vector<NodePlan> plans;
  if (m->nodes.empty()) return plans;
  std::vector<std::vector<uint32_t>> by_node(m->nodes.size());
  for (size_t i = 0; i < n; ++i) {
    by_node[RendezvousOwner(
                m->seeds, RoutingBytes(key(i), options_.routing_prefix_bytes))]
        .push_back(static_cast<uint32_t>(i));
  }
  const absl::Time now = absl::Now();
  for (size_t j = 0; j < m->nodes.size(); ++j) {
    if (by_node[j].empty()) continue;
    uint64_t epoch = 0;
    if (!TryUse(*m->nodes[j], now, &epoch)) {
      if (skipped != nullptr && skipped->empty()) *skipped = m->nodes[j]->id;
      continue;
    }
    plans.push_back({m->nodes[j], epoch, std::move(by_node[j])});
  }
  return plans;
}

void NodeSet::Shutdown() {
  std::vector<std::shared_ptr<NodeState>> nodes;
  {
    MutexLock lock(&mu_);
    nodes = members_->nodes;
    nodes.insert(nodes.end(), retired_.begin(), retired_.end());
  }
  for (const auto& node : nodes) {
    std::unique_ptr<Executor> executor;
    {
      MutexLock lock(&node->mu);
      executor = std::move(node->executor);
    }
    executor.reset();  // runs what is queued (each task sees the stop), joins
  }
}

// ---------------------------------------------------------------------------
// Health

bool NodeSet::TryUse(NodeState& node, absl::Time now, uint64_t* epoch) const {
  MutexLock lock(&node.mu);
  *epoch = node.epoch;
  if (node.failures == 0) return true;
  if (now < node.retry_at) return false;
  // The probe: others skip the node for a probe window.
  node.retry_at = now + options_.rpc_timeout;
  return true;
}

bool NodeSet::StillUsable(NodeState& node, uint64_t epoch) const {
  MutexLock lock(&node.mu);
  return node.epoch == epoch;
}

void NodeSet::MarkUp(NodeState& node) {
  MutexLock lock(&node.mu);
  node.failures = 0;
  node.retry_at = absl::InfinitePast();
}

// A probe that this client cancelled tells nothing: the next call may
// probe the node at once.
void NodeSet::ReleaseProbe(NodeState& node, uint64_t epoch) {
  MutexLock lock(&node.mu);
  if (node.epoch == epoch && node.failures > 0) {
    node.retry_at = std::min(node.retry_at, absl::Now());
  }
}

void NodeSet::MarkDown(NodeState& node, uint64_t epoch) {
  {
    MutexLock lock(&node.mu);
    if (node.epoch != epoch) return;  // marked down already
    ++node.epoch;
    ++node.failures;
    node.retry_at =
        absl::Now() + JitteredBackoff(options_.node_backoff_initial,
                                      options_.node_backoff_max, node.failures);
  }
  node_failures_.fetch_add(1);
}

bool NodeSet::Submit(const std::shared_ptr<NodeState>& node,
                     absl::AnyInvocable<void()> task) {
  MutexLock lock(&node->mu);
  return node->executor != nullptr && node->executor->Submit(std::move(task));
}

// ---------------------------------------------------------------------------
// Registration

absl::Status NodeSet::EnsureRegistered(NodeState& node,
                                       const ClusterNamespace& ns,
                                       const CallOptions& rpc) {
  {
    MutexLock lock(&node.mu);
    if (node.registered.count(ns.spec.name) > 0) return absl::OkStatus();
  }
  absl::StatusOr<NamespaceInfo> info =
      node.client->RegisterNamespace(ns.spec, rpc);
  if (!info.ok()) return info.status();
  SetRegistered(node, ns.spec.name, true);
  return absl::OkStatus();
}

void NodeSet::SetRegistered(NodeState& node, const std::string& ns,
                            bool registered) {
  MutexLock lock(&node.mu);
  if (registered) {
    node.registered.insert(ns);
  } else {
    node.registered.erase(ns);
  }
}

void NodeSet::ForgetRegistrations(const std::string& ns) {
  for (const auto& node : Members()->nodes) SetRegistered(*node, ns, false);
}

// ---------------------------------------------------------------------------
// The retry policy

CallOptions NodeSet::RpcOptions(
    absl::Time deadline, const std::shared_ptr<CancelToken>& cancel) const {
  CallOptions rpc;
  rpc.timeout = options_.rpc_timeout;
  rpc.deadline = deadline;
  rpc.cancel = cancel;
  return rpc;
}

bool NodeSet::ShouldRetry(const absl::Status& st, int* attempt,
                          absl::Time deadline, const Notification& stop,
                          bool* stopped) {
  const absl::StatusCode code = st.code();
  if ((code != absl::StatusCode::kUnavailable &&
       code != absl::StatusCode::kResourceExhausted) ||
      *attempt + 1 >= options_.max_attempts) {
    return false;
  }
  ++*attempt;
  absl::Duration delay = JitteredBackoff(options_.retry_initial_backoff,
                                         options_.retry_max_backoff, *attempt);
  if (std::optional<int> ms = RetryAfterMs(st); ms.has_value()) {
    delay = absl::Milliseconds(*ms);
  }
  if (absl::Now() + delay >= deadline) return false;
  retries_.fetch_add(1);
  *stopped = stop.WaitForNotificationWithTimeout(delay);
  return true;
}

absl::Status NodeSet::RunOnNode(
    NodeState& node, uint64_t epoch, const ClusterNamespace& ns,
    const Notification& stop, absl::Time deadline,
    const std::shared_ptr<CancelToken>& cancel, RunFlags flags,
    absl::FunctionRef<absl::Status(const CallOptions&)> rpc) {
  int attempt = 0;
  bool reregistered = false;
  while (true) {
    if (stop.HasBeenNotified() || shutting_down_->load()) return CallEnded();
    const CallOptions rpc_options = RpcOptions(deadline, cancel);
    absl::Status st = flags.ensure_registered
                          ? EnsureRegistered(node, ns, rpc_options)
                          : absl::OkStatus();
    if (st.ok() && stop.HasBeenNotified()) return CallEnded();
    if (st.ok()) st = rpc(rpc_options);
    if (st.ok()) {
      MarkUp(node);
      return st;
    }
    const absl::StatusCode code = st.code();
    if (code == absl::StatusCode::kCancelled &&
        ((cancel != nullptr && cancel->cancelled()) ||
         shutting_down_->load())) {
      // This client cancelled it (the caller, or shutdown): not the node.
      ReleaseProbe(node, epoch);
      return CallEnded();
    }
    if (code == absl::StatusCode::kNotFound && flags.reregister_on_not_found &&
        !reregistered) {
      // The node may have lost the namespace (restarted): register again.
      SetRegistered(node, ns.spec.name, false);
      reregistered = true;
      continue;
    }
    bool stopped = false;
    if (ShouldRetry(st, &attempt, deadline, stop, &stopped)) {
      if (stopped) return CallEnded();
      continue;
    }
    if (IsNodeFailure(code)) {
      MarkDown(node, epoch);
    } else {
      MarkUp(node);  // it answered
    }
    return st;
  }
}

}  // namespace kvcache::internal
