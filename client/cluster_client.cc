#include "kvcache/cluster_client.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/executor.h"
#include "client/rendezvous.h"
#include "kernels/codec.h"

namespace kvcache {
namespace internal {

// One member. Its executor runs every RPC to it; its health decides whether
// calls use it. `client` is declared before `executor` so that the
// executor (whose tasks use the client) is destroyed first.
struct NodeState {
  NodeState(std::string node_id, std::unique_ptr<Client> node_client,
            int threads)
      : id(std::move(node_id)),
        seed(NodeSeed(id)),
        client(std::move(node_client)),
        executor(std::make_unique<Executor>(threads)) {}

  const std::string id;
  const uint64_t seed;
  const std::unique_ptr<Client> client;

  absl::Mutex mu;
  int failures ABSL_GUARDED_BY(mu) = 0;
  // Incremented each time the node is marked down: a task planned before
  // that does not send (its keys are unavailable), and one incident marks
  // the node down once however many tasks saw it.
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;
  absl::Time retry_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  std::set<std::string> registered ABSL_GUARDED_BY(mu);
  std::unique_ptr<Executor> executor ABSL_GUARDED_BY(mu);
};

struct Membership {
  std::vector<std::shared_ptr<NodeState>> nodes;  // sorted by id
  std::vector<uint64_t> seeds;                    // nodes[i]->seed
};

}  // namespace internal

namespace {

using internal::Membership;
using internal::NodeState;

constexpr size_t kMaxKeyBytes = 64;
// Bytes of a message beyond its blocks (keys, framing).
constexpr size_t kMessageSlack = 64 << 10;

enum KeyState : uint8_t { kUnknown = 0, kFound = 1, kMiss = 2 };

// Errors that are the caller's and are returned as such; every other code
// from a node turns into misses (or `unavailable` / `rejected` writes).
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

// Codes that say the node itself is unusable now.
bool IsNodeFailure(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kCancelled;
}

bool IsMiss(absl::StatusCode code) {
  return code == absl::StatusCode::kNotFound ||
         code == absl::StatusCode::kDataLoss;
}

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

absl::Status ValidateKey(absl::string_view key, absl::string_view what,
                         size_t index) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", index, " is ", key.size(),
                     " bytes; keys are 1 to ", kMaxKeyBytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ValidateKeys(const std::vector<std::string>& keys) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (absl::Status s = ValidateKey(keys[i], "key", i); !s.ok()) return s;
  }
  return absl::OkStatus();
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

// True when the node may be used now: healthy, or its backoff has passed
// (then this call is the probe, and others skip the node for a probe
// window). *epoch: the node's epoch, for StillUsable / MarkDown.
bool TryUse(NodeState& node, absl::Time now, absl::Duration probe_window,
            uint64_t* epoch) {
  absl::MutexLock lock(&node.mu);
  *epoch = node.epoch;
  if (node.failures == 0) return true;
  if (now < node.retry_at) return false;
  node.retry_at = now + probe_window;
  return true;
}

bool StillUsable(NodeState& node, uint64_t epoch) {
  absl::MutexLock lock(&node.mu);
  return node.epoch == epoch;
}

void MarkUp(NodeState& node) {
  absl::MutexLock lock(&node.mu);
  node.failures = 0;
  node.retry_at = absl::InfinitePast();
}

// A probe that this client cancelled tells nothing: the next call may
// probe the node at once.
void ReleaseProbe(NodeState& node, uint64_t epoch) {
  absl::MutexLock lock(&node.mu);
  if (node.epoch == epoch && node.failures > 0) {
    node.retry_at = std::min(node.retry_at, absl::Now());
  }
}

// Returns true when this call marked the node down (first for its epoch).
bool MarkDown(NodeState& node, uint64_t epoch, absl::Duration initial,
              absl::Duration max) {
  absl::MutexLock lock(&node.mu);
  if (node.epoch != epoch) return false;
  ++node.epoch;
  ++node.failures;
  node.retry_at = absl::Now() + JitteredBackoff(initial, max, node.failures);
  return true;
}

// Groups key indices [0, n) by owner. Keys of nodes that may not be used now
// are left out (they stay kUnknown: unavailable).
struct NodePlan {
  std::shared_ptr<NodeState> node;
  uint64_t epoch = 0;
  std::vector<uint32_t> indices;  // ascending
};

// The bytes a key is placed by: its first `prefix` bytes (0: all of it).
absl::string_view RoutingBytes(absl::string_view key, uint32_t prefix) {
  return prefix == 0 ? key : key.substr(0, prefix);
}

std::vector<NodePlan> PlanByOwner(
    const Membership& m, size_t n,
    absl::FunctionRef<absl::string_view(size_t)> key, uint32_t routing_prefix,
    absl::Duration probe_window, std::string* skipped = nullptr) {
  std::vector<NodePlan> plans;
  if (m.nodes.empty()) return plans;
  std::vector<std::vector<uint32_t>> by_node(m.nodes.size());
  for (size_t i = 0; i < n; ++i) {
    by_node[internal::RendezvousOwner(m.seeds,
                                      RoutingBytes(key(i), routing_prefix))]
        .push_back(static_cast<uint32_t>(i));
  }
  const absl::Time now = absl::Now();
  for (size_t j = 0; j < m.nodes.size(); ++j) {
    if (by_node[j].empty()) continue;
    uint64_t epoch = 0;
    if (!TryUse(*m.nodes[j], now, probe_window, &epoch)) {
      if (skipped != nullptr && skipped->empty()) *skipped = m.nodes[j]->id;
      continue;
    }
    plans.push_back({m.nodes[j], epoch, std::move(by_node[j])});
  }
  return plans;
}

std::vector<std::vector<uint32_t>> Chunks(const std::vector<uint32_t>& indices,
                                          size_t size) {
  std::vector<std::vector<uint32_t>> out;
  for (size_t i = 0; i < indices.size(); i += size) {
    size_t end = std::min(indices.size(), i + size);
    out.emplace_back(indices.begin() + i, indices.begin() + end);
  }
  return out;
}

std::chrono::system_clock::time_point ToChrono(absl::Time t) {
  return absl::ToChronoTime(t);
}

}  // namespace

// ---------------------------------------------------------------------------
// Call: one fanned-out operation. Tasks merge their part into `Partial`;
// the result is delivered exactly once: when every task is done, or at
// Stop() (deadline: what is there, through `finish`; cancel / shutdown:
// CANCELLED). With wait_for_tasks (Put), a stopped call is delivered only
// once no task runs any more.

struct ClusterClient::Namespace {
  NamespaceSpec spec;
  uint64_t fp16_block_bytes = 0;
  uint32_t chunk_blocks = 1;  // blocks per RPC
};

template <typename Partial, typename Result>
class ClusterClient::Call {
 public:
  using Done = absl::AnyInvocable<void(absl::StatusOr<Result>)>;
  using Finish = absl::AnyInvocable<absl::StatusOr<Result>(Partial&)>;

  Call(absl::Time deadline, bool wait_for_tasks, Partial partial, Finish finish,
       Done done)
      : deadline_(deadline),
        wait_for_tasks_(wait_for_tasks),
        partial_(std::move(partial)),
        finish_(std::move(finish)),
        done_(std::move(done)) {}

  absl::Time deadline() const { return deadline_; }
  absl::Notification& stop() { return stop_; }
  // Fired when the call is stopped by a cancel or shutdown (not at its
  // deadline, where every RPC's own deadline ends it): cancels the RPCs and
  // data-plane waits its tasks have in flight.
  const std::shared_ptr<CancelToken>& rpc_cancel() const { return rpc_cancel_; }

  // Runs `cleanup` at delivery (now when delivered already).
  void SetCleanup(absl::AnyInvocable<void()> cleanup) {
    {
      absl::MutexLock lock(&mu_);
      if (!delivered_) {
        cleanup_ = std::move(cleanup);
        return;
      }
    }
    cleanup();
  }

  void AddTask() {
    absl::MutexLock lock(&mu_);
    ++pending_;
  }

  void TaskDone(absl::FunctionRef<void(Partial&)> merge) {
    Delivery d;
    {
      absl::MutexLock lock(&mu_);
      if (!delivered_) merge(partial_);
      --pending_;
      d = MaybeDeliverLocked();
    }
    d.Run();
  }

  // DEADLINE_EXCEEDED delivers what is there; any other status is
  // delivered as the call's error.
  void Stop(absl::Status reason) {
    Delivery d;
    const bool cancel_rpcs =
        reason.code() != absl::StatusCode::kDeadlineExceeded;
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
      stopped_ = true;
      stop_reason_ = std::move(reason);
      stop_.Notify();
      d = MaybeDeliverLocked();
    }
    if (cancel_rpcs) rpc_cancel_->Cancel();
    d.Run();
  }

 private:
  struct Delivery {
    Done done;
    std::optional<absl::StatusOr<Result>> result;
    absl::AnyInvocable<void()> cleanup;
    void Run() {
      if (!result.has_value()) return;
      if (cleanup) cleanup();
      done(*std::move(result));
    }
  };

  Delivery MaybeDeliverLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Delivery d;
    if (delivered_) return d;
    if (pending_ > 0 && !(stopped_ && !wait_for_tasks_)) return d;
    delivered_ = true;
    if (stopped_ &&
        stop_reason_.code() != absl::StatusCode::kDeadlineExceeded) {
      d.result = absl::StatusOr<Result>(stop_reason_);
    } else {
      d.result = finish_(partial_);
    }
    d.done = std::move(done_);
    d.cleanup = std::move(cleanup_);
    return d;
  }

  const absl::Time deadline_;
  const bool wait_for_tasks_;
  const std::shared_ptr<CancelToken> rpc_cancel_ =
      std::make_shared<CancelToken>();
  absl::Notification stop_;
  absl::Mutex mu_;
  Partial partial_ ABSL_GUARDED_BY(mu_);
  Finish finish_ ABSL_GUARDED_BY(mu_);
  Done done_ ABSL_GUARDED_BY(mu_);
  absl::AnyInvocable<void()> cleanup_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 1;  // the planning step's own token
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status stop_reason_ ABSL_GUARDED_BY(mu_);
  bool delivered_ ABSL_GUARDED_BY(mu_) = false;
};

// ---------------------------------------------------------------------------
// Construction, membership

ClusterClient::ClusterClient(ClusterOptions options)
    : options_(std::move(options)),
      timer_(std::make_unique<internal::DeadlineTimer>()),
      work_(std::make_unique<internal::Executor>(options_.work_threads)),
      shutting_down_(std::make_shared<std::atomic<bool>>(false)),
      members_(std::make_shared<Membership>()) {}

absl::StatusOr<std::unique_ptr<ClusterClient>> ClusterClient::Create(
    ClusterOptions options) {
  const int sources = (options.nodes.empty() ? 0 : 1) +
                      (options.dns_name.empty() ? 0 : 1) +
                      (options.discover ? 1 : 0);
  if (sources != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of ClusterOptions.nodes, dns_name, discover");
  }
  for (const std::string& id : options.nodes) {
    if (absl::Status s = ValidateNodeId(id); !s.ok()) return s;
  }
  if (!options.dns_name.empty() &&
      (options.dns_port <= 0 || options.dns_port > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad dns_port ", options.dns_port));
  }
  if (options.default_timeout <= absl::ZeroDuration() ||
      options.rpc_timeout <= absl::ZeroDuration() ||
      options.retry_initial_backoff <= absl::ZeroDuration() ||
      options.retry_max_backoff < options.retry_initial_backoff ||
      options.node_backoff_initial <= absl::ZeroDuration() ||
      options.node_backoff_max < options.node_backoff_initial ||
      options.refresh_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "timeouts and backoffs must be > 0 (and max >= initial)");
  }
  if (options.max_attempts < 1 || options.threads_per_node < 1 ||
      options.work_threads < 1 || options.max_blocks_per_rpc < 1 ||
      options.max_message_bytes <= static_cast<int>(kMessageSlack)) {
    return absl::InvalidArgumentError(
        "max_attempts, threads_per_node, work_threads and max_blocks_per_rpc "
        "must be >= 1 and max_message_bytes > 64 KiB");
  }
  const bool dynamic = options.nodes.empty();
  std::unique_ptr<ClusterClient> cc(new ClusterClient(std::move(options)));
  if (dynamic) {
    // A failure here is not fatal: the client starts empty and retries.
    cc->RefreshMembership().IgnoreError();
    if (cc->options_.refresh_interval > absl::ZeroDuration()) {
      cc->refresh_thread_ = std::thread([c = cc.get()] { c->RefreshLoop(); });
    }
  } else {
    std::vector<std::string> ids = cc->options_.nodes;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    auto m = std::make_shared<Membership>();
    for (const std::string& id : ids) {
      ClientOptions co;
      co.target = id;
      co.timeout = cc->options_.rpc_timeout;
      co.max_message_bytes = cc->options_.max_message_bytes;
      co.data_plane = cc->options_.data_plane;
      auto client = Client::Connect(co);
      if (!client.ok()) return client.status();
      m->nodes.push_back(std::make_shared<NodeState>(
          id, *std::move(client), cc->options_.threads_per_node));
      m->seeds.push_back(m->nodes.back()->seed);
    }
    absl::MutexLock lock(&cc->mu_);
    cc->members_ = std::move(m);
  }
  return cc;
}

ClusterClient::~ClusterClient() {
  stop_refresh_.Notify();
  if (refresh_thread_.joinable()) refresh_thread_.join();
  shutting_down_->store(true);
  shutdown_cancel_->Cancel();
  // Every call still armed is stopped (CANCELLED) now; Lookup and Get are
  // delivered at once, Put once its RPC in flight has ended.
  timer_->Shutdown();
  std::vector<std::shared_ptr<NodeState>> nodes;
  {
    absl::MutexLock lock(&mu_);
    nodes = members_->nodes;
    nodes.insert(nodes.end(), retired_.begin(), retired_.end());
  }
  for (const auto& node : nodes) {
    std::unique_ptr<internal::Executor> executor;
    {
      absl::MutexLock lock(&node->mu);
      executor = std::move(node->executor);
    }
    executor.reset();  // runs what is queued (each task sees the stop), joins
  }
  work_.reset();
}

absl::StatusOr<std::vector<std::string>> ClusterClient::Discover() {
  absl::StatusOr<std::vector<std::string>> ids =
      options_.discover
          ? options_.discover()
          : internal::ResolveIpv4(options_.dns_name, options_.dns_port);
  if (!ids.ok()) return ids.status();
  for (const std::string& id : *ids) {
    if (absl::Status s = ValidateNodeId(id); !s.ok()) return s;
  }
  std::sort(ids->begin(), ids->end());
  ids->erase(std::unique(ids->begin(), ids->end()), ids->end());
  return ids;
}

absl::Status ClusterClient::RefreshMembership() {
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
      ClientOptions co;
      co.target = id;
      co.timeout = options_.rpc_timeout;
      co.max_message_bytes = options_.max_message_bytes;
      co.data_plane = options_.data_plane;
      auto client = Client::Connect(co);
      if (!client.ok()) return client.status();
      node = std::make_shared<NodeState>(id, *std::move(client),
                                         options_.threads_per_node);
    }
    m->nodes.push_back(node);
    m->seeds.push_back(node->seed);
  }
  std::vector<std::shared_ptr<NodeState>> drop;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& n : members_->nodes) {
      if (!std::binary_search(ids->begin(), ids->end(), n->id)) {
        retired_.push_back(n);
      }
    }
    members_ = std::move(m);
    // A retired node referenced only from here has no task left: free it
    // (outside the lock; that joins its idle threads).
    auto unused = [](const std::shared_ptr<NodeState>& n) {
      return n.use_count() == 1;
    };
    for (auto& n : retired_) {
      if (unused(n)) drop.push_back(std::move(n));
    }
    retired_.erase(std::remove(retired_.begin(), retired_.end(), nullptr),
                   retired_.end());
  }
  old.reset();
  drop.clear();
  membership_changes_.fetch_add(1);
  return absl::OkStatus();
}

void ClusterClient::RefreshLoop() {
  while (!stop_refresh_.WaitForNotificationWithTimeout(
      options_.refresh_interval)) {
    RefreshMembership().IgnoreError();
  }
}

std::shared_ptr<const Membership> ClusterClient::Members() const {
  absl::MutexLock lock(&mu_);
  return members_;
}

std::vector<NodeStatus> ClusterClient::Nodes() const {
  std::vector<NodeStatus> out;
  for (const auto& n : Members()->nodes) {
    absl::MutexLock lock(&n->mu);
    NodeStatus s;
    s.id = n->id;
    s.consecutive_failures = n->failures;
    s.up = n->failures == 0;
    s.retry_at = n->retry_at;
    out.push_back(std::move(s));
  }
  return out;
}

std::string ClusterClient::OwnerOf(absl::string_view key) const {
  std::shared_ptr<const Membership> m = Members();
  if (m->nodes.empty()) return "";
  return m
      ->nodes[internal::RendezvousOwner(
          m->seeds, RoutingBytes(key, options_.routing_prefix_bytes))]
      ->id;
}

ClusterCounters ClusterClient::counters() const {
  ClusterCounters c;
  c.retries = retries_.load();
  c.node_failures = node_failures_.load();
  c.unavailable_keys = unavailable_keys_.load();
  c.membership_changes = membership_changes_.load();
  c.refresh_failures = refresh_failures_.load();
  return c;
}

// ---------------------------------------------------------------------------
// Plumbing shared by the operations

absl::StatusOr<std::shared_ptr<const ClusterClient::Namespace>>
ClusterClient::FindNamespace(const std::string& ns) const {
  absl::MutexLock lock(&mu_);
  auto it = namespaces_.find(ns);
  if (it == namespaces_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "namespace '", ns, "' is not registered with this ClusterClient"));
  }
  return it->second;
}

absl::Time ClusterClient::Deadline(const CallOptions& options) const {
  return CallDeadline(options, options_.default_timeout);
}

CallOptions ClusterClient::RpcOptions(
    absl::Time deadline, const std::shared_ptr<CancelToken>& cancel) const {
  CallOptions rpc;
  rpc.timeout = options_.rpc_timeout;
  rpc.deadline = deadline;
  rpc.cancel = cancel;
  return rpc;
}

template <typename C>
void ClusterClient::Arm(const std::shared_ptr<C>& call,
                        const std::shared_ptr<CancelToken>& cancel) {
  std::weak_ptr<C> weak = call;
  std::shared_ptr<std::atomic<bool>> shutting_down = shutting_down_;
  const uint64_t timer_id =
      timer_->Schedule(call->deadline(), [weak, shutting_down] {
        if (std::shared_ptr<C> c = weak.lock()) {
          c->Stop(shutting_down->load()
                      ? absl::CancelledError("ClusterClient is shutting down")
                      : absl::DeadlineExceededError("call deadline"));
        }
      });
  uint64_t cancel_id = 0;
  if (cancel != nullptr) {
    cancel_id = cancel->AddCallback([weak] {
      if (std::shared_ptr<C> c = weak.lock()) {
        c->Stop(absl::CancelledError("cancelled by the caller"));
      }
    });
  }
  call->SetCleanup([timer = timer_.get(), timer_id, cancel, cancel_id] {
    timer->Cancel(timer_id);
    if (cancel != nullptr) cancel->RemoveCallback(cancel_id);
  });
}

bool ClusterClient::Submit(const std::shared_ptr<NodeState>& node,
                           absl::AnyInvocable<void()> task) {
  absl::MutexLock lock(&node->mu);
  return node->executor != nullptr && node->executor->Submit(std::move(task));
}

absl::Status ClusterClient::EnsureRegistered(NodeState& node,
                                             const Namespace& ns,
                                             const CallOptions& rpc) {
  {
    absl::MutexLock lock(&node.mu);
    if (node.registered.count(ns.spec.name) > 0) return absl::OkStatus();
  }
  absl::StatusOr<NamespaceInfo> info =
      node.client->RegisterNamespace(ns.spec, rpc);
  if (!info.ok()) return info.status();
  absl::MutexLock lock(&node.mu);
  node.registered.insert(ns.spec.name);
  return absl::OkStatus();
}

template <typename Fn>
absl::Status ClusterClient::RunOnNode(
    NodeState& node, uint64_t epoch, const Namespace& ns,
    absl::Notification& stop, absl::Time deadline,
    const std::shared_ptr<CancelToken>& cancel, RunFlags flags, Fn&& rpc) {
  int attempt = 0;
  bool reregistered = false;
  while (true) {
    if (stop.HasBeenNotified() || shutting_down_->load()) {
      return absl::CancelledError("the call has ended");
    }
    const CallOptions rpc_options = RpcOptions(deadline, cancel);
    absl::Status st = flags.ensure_registered
                          ? EnsureRegistered(node, ns, rpc_options)
                          : absl::OkStatus();
    if (st.ok() && stop.HasBeenNotified()) {
      return absl::CancelledError("the call has ended");
    }
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
      return absl::CancelledError("the call has ended");
    }
    if (code == absl::StatusCode::kNotFound && flags.reregister_on_not_found &&
        !reregistered) {
      // The node may have lost the namespace (restarted): register again.
      absl::MutexLock lock(&node.mu);
      node.registered.erase(ns.spec.name);
      reregistered = true;
      continue;
    }
    if ((code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kResourceExhausted) &&
        attempt + 1 < options_.max_attempts) {
      ++attempt;
      absl::Duration delay = JitteredBackoff(
          options_.retry_initial_backoff, options_.retry_max_backoff, attempt);
      if (std::optional<int> ms = RetryAfterMs(st); ms.has_value()) {
        delay = absl::Milliseconds(*ms);
      }
      if (absl::Now() + delay < deadline) {
        retries_.fetch_add(1);
        if (stop.WaitForNotificationWithTimeout(delay)) {
          return absl::CancelledError("the call has ended");
        }
        continue;
      }
    }
    if (IsNodeFailure(code)) {
      if (MarkDown(node, epoch, options_.node_backoff_initial,
                   options_.node_backoff_max)) {
        node_failures_.fetch_add(1);
      }
    } else {
      MarkUp(node);  // it answered
    }
    return st;
  }
}

// ---------------------------------------------------------------------------
// RegisterNamespace

absl::StatusOr<NamespaceInfo> ClusterClient::RegisterNamespace(
    const NamespaceSpec& spec, const CallOptions& options) {
  if (!spec.policy.has_value()) {
    return absl::InvalidArgumentError(
        "a ClusterClient namespace must state its codec policy, so that "
        "every node stores it the same way");
  }
  if (absl::Status s = kernels::ValidatePolicy(spec.shape, *spec.policy);
      !s.ok()) {
    return s;
  }
  auto ns = std::make_shared<Namespace>();
  ns->spec = spec;
  ns->fp16_block_bytes = kernels::Fp16BlockBytes(spec.shape);
  const uint64_t by_bytes =
      (static_cast<uint64_t>(options_.max_message_bytes) - kMessageSlack) /
      ns->fp16_block_bytes;
  ns->chunk_blocks = static_cast<uint32_t>(std::max<uint64_t>(
      1, std::min<uint64_t>(options_.max_blocks_per_rpc, by_bytes)));
  // Members registered with an earlier spec of this name get the one in
  // use before their next call.
  for (const auto& node : Members()->nodes) {
    absl::MutexLock lock(&node->mu);
    node->registered.erase(spec.name);
  }

  struct Partial {
    std::optional<NamespaceInfo> info;
    std::optional<absl::Status> error;
  };
  using C = Call<Partial, NamespaceInfo>;
  auto promise =
      std::make_shared<std::promise<absl::StatusOr<NamespaceInfo>>>();
  std::future<absl::StatusOr<NamespaceInfo>> future = promise->get_future();
  auto call = std::make_shared<C>(
      Deadline(options), /*wait_for_tasks=*/false, Partial{},
      [](Partial& p) -> absl::StatusOr<NamespaceInfo> {
        if (p.error.has_value()) return *p.error;
        if (p.info.has_value()) return *p.info;
        return absl::UnavailableError(
            "no member answered; the namespace will be registered on "
            "first use");
      },
      [promise](absl::StatusOr<NamespaceInfo> r) {
        promise->set_value(std::move(r));
      });
  Arm(call, options.cancel);
  const absl::Time now = absl::Now();
  for (const auto& node : Members()->nodes) {
    uint64_t epoch = 0;
    if (!TryUse(*node, now, options_.rpc_timeout, &epoch)) continue;
    call->AddTask();
    auto task = [this, call, node, epoch, ns] {
      {
        absl::MutexLock lock(&node->mu);
        node->registered.erase(ns->spec.name);
      }
      absl::StatusOr<NamespaceInfo> info;
      absl::Status st = RunOnNode(
          *node, epoch, *ns, call->stop(), call->deadline(), call->rpc_cancel(),
          RunFlags{/*ensure_registered=*/false, false},
          [&](const CallOptions& rpc) {
            info = node->client->RegisterNamespace(ns->spec, rpc);
            return info.status();
          });
      if (st.ok()) {
        absl::MutexLock lock(&node->mu);
        node->registered.insert(ns->spec.name);
      }
      call->TaskDone([&](Partial& p) {
        if (st.ok() && !p.info.has_value()) p.info = *info;
        if (!st.ok() && IsCallerError(st.code()) && !p.error.has_value()) {
          p.error = st;
        }
      });
    };
    if (!Submit(node, std::move(task))) call->TaskDone([](Partial&) {});
  }
  call->TaskDone([](Partial&) {});
  // Delivered by the deadline at the latest (the timer stops the call).
  absl::StatusOr<NamespaceInfo> result =
      future.wait_until(ToChrono(call->deadline() + absl::Seconds(5))) ==
              std::future_status::ready
          ? future.get()
          : absl::DeadlineExceededError("RegisterNamespace did not complete");
  // Kept unless a member refused it: then the previous spec (if any) stays.
  if (result.ok() || !IsCallerError(result.status().code())) {
    absl::MutexLock lock(&mu_);
    namespaces_[spec.name] = ns;
  }
  return result;
}

// ---------------------------------------------------------------------------
// Lookup

void ClusterClient::LookupAsync(const std::string& ns_name,
                                std::vector<std::string> keys,
                                const CallOptions& options,
                                LookupCallback done) {
  absl::StatusOr<std::shared_ptr<const Namespace>> ns = FindNamespace(ns_name);
  if (!ns.ok()) return done(ns.status());
  if (absl::Status s = ValidateKeys(keys); !s.ok()) return done(s);
  if (options.cancel != nullptr && options.cancel->cancelled()) {
    return done(absl::CancelledError("cancelled by the caller"));
  }
  struct Partial {
    std::vector<uint8_t> state;
    std::optional<absl::Status> error;
  };
  using C = Call<Partial, ClusterLookupResult>;
  const size_t n = keys.size();
  auto shared_keys =
      std::make_shared<const std::vector<std::string>>(std::move(keys));
  auto call = std::make_shared<C>(
      Deadline(options), /*wait_for_tasks=*/false,
      Partial{std::vector<uint8_t>(n, kUnknown), std::nullopt},
      [this](Partial& p) -> absl::StatusOr<ClusterLookupResult> {
        if (p.error.has_value()) return *p.error;
        ClusterLookupResult r;
        while (r.prefix_blocks < p.state.size() &&
               p.state[r.prefix_blocks] == kFound) {
          ++r.prefix_blocks;
        }
        r.unavailable_keys = static_cast<uint32_t>(
            std::count(p.state.begin(), p.state.end(), kUnknown));
        unavailable_keys_.fetch_add(r.unavailable_keys);
        return r;
      },
      std::move(done));
  Arm(call, options.cancel);
  std::shared_ptr<const Namespace> space = *ns;
  for (NodePlan& plan : PlanByOwner(
           *Members(), n,
           [&](size_t i) { return absl::string_view((*shared_keys)[i]); },
           options_.routing_prefix_bytes, options_.rpc_timeout)) {
    call->AddTask();
    auto task = [this, call, space, shared_keys, node = plan.node,
                 epoch = plan.epoch, indices = std::move(plan.indices)] {
      std::vector<std::pair<uint32_t, uint8_t>> marks;
      std::optional<absl::Status> error;
      if (StillUsable(*node, epoch)) {
        // Chunks in order; a node's first miss ends its part of the prefix.
        for (const std::vector<uint32_t>& chunk :
             Chunks(indices, space->chunk_blocks)) {
          std::vector<std::string> sub;
          for (uint32_t i : chunk) sub.push_back((*shared_keys)[i]);
          absl::StatusOr<LookupResult> r;
          absl::Status st = RunOnNode(
              *node, epoch, *space, call->stop(), call->deadline(),
              call->rpc_cancel(),
              RunFlags{true, /*reregister_on_not_found=*/true},
              [&](const CallOptions& rpc) {
                r = node->client->Lookup(space->spec.name, sub, false, rpc);
                return r.status();
              });
          if (!st.ok()) {
            if (IsCallerError(st.code())) error = st;
            break;  // the rest stays unknown (unavailable)
          }
          const uint32_t p = std::min<uint32_t>(
              r->prefix_blocks, static_cast<uint32_t>(chunk.size()));
          for (uint32_t j = 0; j < p; ++j) marks.push_back({chunk[j], kFound});
          if (p < chunk.size()) {
            // A miss: this key and every later one of this node lie past
            // the prefix.
            for (uint32_t i : indices) {
              if (i >= chunk[p]) marks.push_back({i, kMiss});
            }
            break;
          }
        }
      }
      call->TaskDone([&](Partial& part) {
        for (const auto& [i, s] : marks) part.state[i] = s;
        if (error.has_value() && !part.error.has_value()) part.error = error;
      });
    };
    if (!Submit(plan.node, std::move(task))) call->TaskDone([](Partial&) {});
  }
  call->TaskDone([](Partial&) {});
}

std::future<absl::StatusOr<ClusterLookupResult>> ClusterClient::LookupAsync(
    const std::string& ns, std::vector<std::string> keys,
    const CallOptions& options) {
  auto promise =
      std::make_shared<std::promise<absl::StatusOr<ClusterLookupResult>>>();
  auto future = promise->get_future();
  LookupAsync(ns, std::move(keys), options,
              [promise](absl::StatusOr<ClusterLookupResult> r) {
                promise->set_value(std::move(r));
              });
  return future;
}

absl::StatusOr<ClusterLookupResult> ClusterClient::Lookup(
    const std::string& ns, std::vector<std::string> keys,
    const CallOptions& options) {
  const absl::Time bound = Deadline(options) + absl::Seconds(5);
  auto future = LookupAsync(ns, std::move(keys), options);
  if (future.wait_until(ToChrono(bound)) != std::future_status::ready) {
    return absl::DeadlineExceededError("Lookup did not complete");
  }
  return future.get();
}

// ---------------------------------------------------------------------------
// Put

void ClusterClient::PutAsync(const std::string& ns_name,
                             absl::Span<const BlockWrite> blocks,
                             const CallOptions& options, PutCallback done) {
  absl::StatusOr<std::shared_ptr<const Namespace>> ns = FindNamespace(ns_name);
  if (!ns.ok()) return done(ns.status());
  if (blocks.empty()) return done(absl::InvalidArgumentError("no blocks"));
  const size_t halves = (*ns)->fp16_block_bytes / 2;
  auto writes = std::make_shared<std::vector<BlockWrite>>();
  writes->reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (absl::Status s = ValidateKey(blocks[i].key, "block key", i); !s.ok()) {
      return done(s);
    }
    if (blocks[i].parent_key.size() > kMaxKeyBytes) {
      return done(absl::InvalidArgumentError(absl::StrCat(
          "parent key of block ", i, " is longer than ", kMaxKeyBytes)));
    }
    if (blocks[i].fp16.size() != halves) {
      return done(absl::InvalidArgumentError(
          absl::StrCat("block ", i, " has ", blocks[i].fp16.size(),
                       " halves; the namespace's blocks have ", halves)));
    }
    BlockWrite w = blocks[i];
    // Explicit parents: a node sees only its own blocks of the chain.
    if (w.parent_key.empty() && i > 0) w.parent_key = blocks[i - 1].key;
    writes->push_back(std::move(w));
  }
  if (options.cancel != nullptr && options.cancel->cancelled()) {
    return done(absl::CancelledError("cancelled by the caller"));
  }
  struct Partial {
    ClusterPutResult result;
    std::optional<absl::Status> error;
  };
  using C = Call<Partial, ClusterPutResult>;
  auto call = std::make_shared<C>(
      Deadline(options), /*wait_for_tasks=*/true, Partial{},
      [this,
       n = blocks.size()](Partial& p) -> absl::StatusOr<ClusterPutResult> {
        if (p.error.has_value()) return *p.error;
        ClusterPutResult r = p.result;
        // Blocks no task confirmed (owner down, timed out, call ended).
        const uint64_t confirmed = uint64_t{r.stored} + r.skipped + r.rejected;
        r.unavailable =
            confirmed >= n ? 0 : static_cast<uint32_t>(n - confirmed);
        unavailable_keys_.fetch_add(r.unavailable);
        if (r.unavailable + r.rejected > 0 && r.why_not_stored.ok()) {
          r.why_not_stored = absl::DeadlineExceededError(
              "the call ended before the owners of some blocks answered");
        }
        return r;
      },
      std::move(done));
  Arm(call, options.cancel);
  std::shared_ptr<const Namespace> space = *ns;
  std::string skipped;
  std::vector<NodePlan> plans = PlanByOwner(
      *Members(), writes->size(),
      [&](size_t i) { return absl::string_view((*writes)[i].key); },
      options_.routing_prefix_bytes, options_.rpc_timeout, &skipped);
  if (!skipped.empty()) {
    call->AddTask();
    call->TaskDone([&](Partial& p) {
      p.result.why_not_stored = absl::UnavailableError(absl::StrCat(
          "node ", skipped, " is skipped while it backs off after failures"));
    });
  }
  for (NodePlan& plan : plans) {
    for (std::vector<uint32_t>& chunk :
         Chunks(plan.indices, space->chunk_blocks)) {
      call->AddTask();
      auto task = [this, call, space, writes, node = plan.node,
                   epoch = plan.epoch, chunk = std::move(chunk)] {
        ClusterPutResult part;
        std::optional<absl::Status> error;
        if (!StillUsable(*node, epoch)) {
          part.why_not_stored = absl::UnavailableError(absl::StrCat(
              "node ", node->id, " failed while this call was queued"));
        } else {
          std::vector<BlockWrite> sub;
          sub.reserve(chunk.size());
          for (uint32_t i : chunk) sub.push_back((*writes)[i]);
          absl::StatusOr<PutResult> r;
          absl::Status st =
              RunOnNode(*node, epoch, *space, call->stop(), call->deadline(),
                        call->rpc_cancel(),
                        RunFlags{true, /*reregister_on_not_found=*/true},
                        [&](const CallOptions& rpc) {
                          r = node->client->Put(space->spec.name, sub, rpc);
                          return r.status();
                        });
          if (st.ok()) {
            part.stored = r->stored;
            part.skipped = r->skipped;
          } else if (st.code() == absl::StatusCode::kResourceExhausted) {
            part.rejected = static_cast<uint32_t>(chunk.size());
          } else if (IsCallerError(st.code())) {
            error = st;
          }
          if (!st.ok()) {
            part.why_not_stored = absl::Status(
                st.code(), absl::StrCat("node ", node->id, ": ", st.message()));
          }
        }
        call->TaskDone([&](Partial& p) {
          p.result.stored += part.stored;
          p.result.skipped += part.skipped;
          p.result.rejected += part.rejected;
          if (p.result.why_not_stored.ok()) {
            p.result.why_not_stored = part.why_not_stored;
          }
          if (error.has_value() && !p.error.has_value()) p.error = error;
        });
      };
      if (!Submit(plan.node, std::move(task))) call->TaskDone([](Partial&) {});
    }
  }
  call->TaskDone([](Partial&) {});
}

std::future<absl::StatusOr<ClusterPutResult>> ClusterClient::PutAsync(
    const std::string& ns, absl::Span<const BlockWrite> blocks,
    const CallOptions& options) {
  auto promise =
      std::make_shared<std::promise<absl::StatusOr<ClusterPutResult>>>();
  auto future = promise->get_future();
  PutAsync(ns, blocks, options, [promise](absl::StatusOr<ClusterPutResult> r) {
    promise->set_value(std::move(r));
  });
  return future;
}

absl::StatusOr<ClusterPutResult> ClusterClient::Put(
    const std::string& ns, absl::Span<const BlockWrite> blocks,
    const CallOptions& options) {
  // A Put may outlive its deadline by the RPC in flight (two RPCs of a
  // begin/commit pair): it must not return while that RPC reads `blocks`.
  const absl::Time bound =
      Deadline(options) + 2 * options_.rpc_timeout + absl::Seconds(5);
  auto future = PutAsync(ns, blocks, options);
  if (future.wait_until(ToChrono(bound)) != std::future_status::ready) {
    return absl::DeadlineExceededError("Put did not complete");
  }
  return future.get();
}

// ---------------------------------------------------------------------------
// Get

void ClusterClient::GetAsyncAt(const std::string& ns_name,
                               std::vector<std::string> keys, ReadFormat format,
                               absl::Time deadline,
                               const std::shared_ptr<CancelToken>& cancel,
                               GetCallback done) {
  absl::StatusOr<std::shared_ptr<const Namespace>> ns = FindNamespace(ns_name);
  if (!ns.ok()) return done(ns.status());
  if (absl::Status s = ValidateKeys(keys); !s.ok()) return done(s);
  if (cancel != nullptr && cancel->cancelled()) {
    return done(absl::CancelledError("cancelled by the caller"));
  }
  struct Partial {
    std::vector<std::optional<BlockData>> blocks;
    std::vector<uint8_t> state;
    std::optional<absl::Status> error;
    std::optional<GetResult> layout;  // shape and policy of a response
  };
  using C = Call<Partial, ClusterGetResult>;
  const size_t n = keys.size();
  auto shared_keys =
      std::make_shared<const std::vector<std::string>>(std::move(keys));
  std::shared_ptr<const Namespace> space = *ns;
  Partial initial;
  initial.blocks.resize(n);
  initial.state.assign(n, kUnknown);
  auto call = std::make_shared<C>(
      deadline, /*wait_for_tasks=*/false, std::move(initial),
      [this, space](Partial& p) -> absl::StatusOr<ClusterGetResult> {
        if (p.error.has_value()) return *p.error;
        ClusterGetResult r;
        if (p.layout.has_value()) {
          r.read.shape = p.layout->shape;
          r.read.policy = p.layout->policy;
        } else {
          r.read.shape = space->spec.shape;
          r.read.policy = *space->spec.policy;
        }
        while (r.prefix_blocks < p.blocks.size() &&
               p.blocks[r.prefix_blocks].has_value()) {
          r.read.blocks.push_back(*std::move(p.blocks[r.prefix_blocks]));
          ++r.prefix_blocks;
        }
        r.unavailable_keys = static_cast<uint32_t>(
            std::count(p.state.begin(), p.state.end(), kUnknown));
        unavailable_keys_.fetch_add(r.unavailable_keys);
        return r;
      },
      std::move(done));
  Arm(call, cancel);
  for (NodePlan& plan : PlanByOwner(
           *Members(), n,
           [&](size_t i) { return absl::string_view((*shared_keys)[i]); },
           options_.routing_prefix_bytes, options_.rpc_timeout)) {
    for (std::vector<uint32_t>& chunk :
         Chunks(plan.indices, space->chunk_blocks)) {
      call->AddTask();
      auto task = [this, call, space, shared_keys, format, node = plan.node,
                   epoch = plan.epoch, chunk = std::move(chunk)] {
        std::vector<std::string> sub;
        for (uint32_t i : chunk) sub.push_back((*shared_keys)[i]);
        absl::StatusOr<GetResult> got;
        absl::Status st = absl::CancelledError("node marked down");
        if (StillUsable(*node, epoch)) {
          ReadOptions read;
          read.format = format;
          read.allow_missing = true;
          // NOT_FOUND now means the node lost the namespace: registered
          // again, then read again.
          st = RunOnNode(*node, epoch, *space, call->stop(), call->deadline(),
                         call->rpc_cancel(),
                         RunFlags{true, /*reregister_on_not_found=*/true},
                         [&](const CallOptions& rpc) {
                           got = node->client->Get(space->spec.name, sub, read,
                                                   rpc);
                           return got.status();
                         });
          if (IsMiss(st.code())) {
            // A node that predates allow_missing: the whole chunk misses.
            got = GetResult{};
            for (uint32_t j = 0; j < chunk.size(); ++j) {
              got->missing.push_back(j);
            }
            st = absl::OkStatus();
          }
        }
        call->TaskDone([&](Partial& p) {
          if (!st.ok()) {
            if (IsCallerError(st.code()) && !p.error.has_value()) p.error = st;
            return;  // unknown: unavailable
          }
          for (uint32_t j : got->missing) p.state[chunk[j]] = kMiss;
          if (got->blocks.empty()) return;
          if (got->shape.num_layers != space->spec.shape.num_layers ||
              got->shape.tokens_per_block !=
                  space->spec.shape.tokens_per_block) {
            for (const BlockData& b : got->blocks) {
              p.state[chunk[b.index]] = kMiss;
            }
            return;
          }
          if (!p.layout.has_value()) {
            p.layout.emplace();
            p.layout->shape = got->shape;
            p.layout->policy = got->policy;
          }
          for (BlockData& b : got->blocks) {
            const uint32_t i = chunk[b.index];
            b.index = i;
            p.state[i] = kFound;
            p.blocks[i] = std::move(b);
          }
        });
      };
      if (!Submit(plan.node, std::move(task))) call->TaskDone([](Partial&) {});
    }
  }
  call->TaskDone([](Partial&) {});
}

void ClusterClient::GetAsync(const std::string& ns,
                             std::vector<std::string> keys, ReadFormat format,
                             const CallOptions& options, GetCallback done) {
  GetAsyncAt(ns, std::move(keys), format, Deadline(options), options.cancel,
             std::move(done));
}

std::future<absl::StatusOr<ClusterGetResult>> ClusterClient::GetAsync(
    const std::string& ns, std::vector<std::string> keys, ReadFormat format,
    const CallOptions& options) {
  auto promise =
      std::make_shared<std::promise<absl::StatusOr<ClusterGetResult>>>();
  auto future = promise->get_future();
  GetAsync(ns, std::move(keys), format, options,
           [promise](absl::StatusOr<ClusterGetResult> r) {
             promise->set_value(std::move(r));
           });
  return future;
}

absl::StatusOr<ClusterGetResult> ClusterClient::Get(
    const std::string& ns, std::vector<std::string> keys, ReadFormat format,
    const CallOptions& options) {
  const absl::Time bound = Deadline(options) + absl::Seconds(5);
  auto future = GetAsync(ns, std::move(keys), format, options);
  if (future.wait_until(ToChrono(bound)) != std::future_status::ready) {
    return absl::DeadlineExceededError("Get did not complete");
  }
  return future.get();
}

// ---------------------------------------------------------------------------
// Delete

absl::StatusOr<uint32_t> ClusterClient::Delete(const std::string& ns_name,
                                               std::vector<std::string> keys,
                                               const CallOptions& options) {
  absl::StatusOr<std::shared_ptr<const Namespace>> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  if (absl::Status s = ValidateKeys(keys); !s.ok()) return s;
  struct Partial {
    uint32_t deleted = 0;
    std::optional<absl::Status> error;
  };
  using C = Call<Partial, uint32_t>;
  auto promise = std::make_shared<std::promise<absl::StatusOr<uint32_t>>>();
  std::future<absl::StatusOr<uint32_t>> future = promise->get_future();
  auto call = std::make_shared<C>(
      Deadline(options), /*wait_for_tasks=*/false, Partial{},
      [](Partial& p) -> absl::StatusOr<uint32_t> {
        if (p.error.has_value()) return *p.error;
        return p.deleted;
      },
      [promise](absl::StatusOr<uint32_t> r) {
        promise->set_value(std::move(r));
      });
  Arm(call, options.cancel);
  auto shared_keys =
      std::make_shared<const std::vector<std::string>>(std::move(keys));
  std::shared_ptr<const Namespace> space = *ns;
  for (NodePlan& plan : PlanByOwner(
           *Members(), shared_keys->size(),
           [&](size_t i) { return absl::string_view((*shared_keys)[i]); },
           options_.routing_prefix_bytes, options_.rpc_timeout)) {
    for (std::vector<uint32_t>& chunk :
         Chunks(plan.indices, space->chunk_blocks)) {
      call->AddTask();
      auto task = [this, call, space, shared_keys, node = plan.node,
                   epoch = plan.epoch, chunk = std::move(chunk)] {
        absl::StatusOr<uint32_t> r;
        absl::Status st = absl::CancelledError("node marked down");
        if (StillUsable(*node, epoch)) {
          std::vector<std::string> sub;
          for (uint32_t i : chunk) sub.push_back((*shared_keys)[i]);
          st = RunOnNode(*node, epoch, *space, call->stop(), call->deadline(),
                         call->rpc_cancel(), RunFlags{true, false},
                         [&](const CallOptions& rpc) {
                           r = node->client->Delete(space->spec.name, sub, rpc);
                           return r.status();
                         });
        }
        call->TaskDone([&](Partial& p) {
          if (st.ok()) p.deleted += *r;
          if (!st.ok() && IsCallerError(st.code()) && !p.error.has_value()) {
            p.error = st;
          }
        });
      };
      if (!Submit(plan.node, std::move(task))) call->TaskDone([](Partial&) {});
    }
  }
  call->TaskDone([](Partial&) {});
  if (future.wait_until(ToChrono(call->deadline() + absl::Seconds(5))) !=
      std::future_status::ready) {
    return absl::DeadlineExceededError("Delete did not complete");
  }
  return future.get();
}

// ---------------------------------------------------------------------------
// Layer-wise Get
//
// One Client::GetInto per node and chunk (allow_missing), into a buffer of
// the stream's own. The node's answers fix the prefix (a metadata Call:
// complete when every chunk has answered, or at the deadline with what has
// answered). Each chunk's task then waits for its layers one by one
// (PendingRead::WaitLayer); once layer l of every chunk of the prefix is
// there, a delivery task on a work thread decodes it (raw reads), hands it
// to on_layer and marks it ready. A chunk's transfer always runs to its end
// (or its deadline) before its buffer is let go, also when the stream has
// stopped: a cancelled stream never closes a data-plane connection that
// other calls share.

namespace internal {

// One GetInto: the keys at `indices` (ascending) of one node.
struct StreamChunk {
  std::string node_id;
  std::vector<uint32_t> indices;
  size_t stride = 0;
  // indices.size() * stride bytes, set by the chunk's task before its read:
  // a DataBuffer of the node's Client (registered once and pooled, so that
  // the node keeps its key; `owner` keeps that Client alive meanwhile), or
  // heap memory when the client has no data plane.
  uint8_t* buffer = nullptr;
  std::shared_ptr<NodeState> owner;
  std::unique_ptr<DataBuffer> registered;  // after `owner`: destroyed first
  std::unique_ptr<uint8_t[]> heap;

  // Guarded by LayerStream::State::mu.
  GetResult metadata;  // blocks: index = position in `indices`
  std::vector<BlockPlacement> placements;
  uint32_t layers_arrived = 0;  // of every block of the chunk
  absl::Status error;           // the transfer failed
  bool needed = false;          // holds blocks of the prefix
};

// Where block b of the prefix is.
struct StreamBlock {
  StreamChunk* chunk = nullptr;
  const uint8_t* bytes = nullptr;  // the block's bytes in the chunk buffer
  uint64_t length = 0;
  ReadFormat format = ReadFormat::kFp16;
  CodecPolicy policy;           // kRaw: the block's own (residual: none)
  std::vector<size_t> offsets;  // kRaw: layer offsets, num_layers + 1
};

struct StreamPrefix {
  uint32_t prefix = 0;
  uint32_t unavailable = 0;
};

}  // namespace internal

using internal::StreamBlock;
using internal::StreamChunk;
using internal::StreamPrefix;

struct LayerStream::State {
  absl::Mutex mu;
  // Fixed before the fetch starts.
  BlockShape shape;
  uint32_t num_layers = 0;
  size_t section = 0;  // halves of one layer's K (or V) of one block
  absl::Time wait_bound;
  ReadFormat format = ReadFormat::kFp16;
  LayerCallback on_layer;
  internal::Executor* work = nullptr;
  std::shared_ptr<CancelToken> cancel = std::make_shared<CancelToken>();
  std::shared_ptr<CancelToken> caller_cancel;
  uint64_t caller_cancel_id = 0;
  std::vector<std::shared_ptr<StreamChunk>> chunks;

  bool stop ABSL_GUARDED_BY(mu) = false;
  bool in_callback ABSL_GUARDED_BY(mu) = false;
  bool fetched ABSL_GUARDED_BY(mu) = false;     // the prefix is fixed
  bool delivering ABSL_GUARDED_BY(mu) = false;  // a delivery task is queued
  uint32_t ready_layers ABSL_GUARDED_BY(mu) = 0;
  absl::Status error ABSL_GUARDED_BY(mu);
  uint32_t prefix ABSL_GUARDED_BY(mu) = 0;
  uint32_t unavailable ABSL_GUARDED_BY(mu) = 0;
  // Set with `fetched`, then read-only (the delivery task writes `decoded`
  // layer by layer, each before ready_layers passes it).
  std::vector<StreamBlock> blocks;
  // kRaw: per prefix block, every layer decoded to fp16.
  std::vector<std::vector<uint16_t>> decoded;

  void Fail(absl::Status status) {
    absl::MutexLock lock(&mu);
    if (error.ok()) error = std::move(status);
  }
  void Stop(absl::Status status) {
    absl::MutexLock lock(&mu);
    stop = true;
    if (error.ok()) error = std::move(status);
  }
  // The fp16 of layer `l` of prefix block `b` (K then V).
  const uint16_t* Layer(uint32_t b, uint32_t l) const {
    const uint16_t* base =
        format == ReadFormat::kRaw
            ? decoded[b].data()
            : reinterpret_cast<const uint16_t*>(blocks[b].bytes);
    return base + size_t{l} * 2 * section;
  }
};

namespace {

using StreamState = LayerStream::State;

// Decodes layer `l` of one raw block into `out` (2*section halves).
absl::Status DecodeRawLayer(const BlockShape& shape, const StreamBlock& block,
                            uint32_t l, absl::Span<uint16_t> out) {
  BlockShape one = shape;
  one.num_layers = 1;
  return kernels::DecodeBlock(
      one, kernels::LayerPolicy(shape, block.policy, l),
      absl::MakeConstSpan(block.bytes + block.offsets[l],
                          block.offsets[l + 1] - block.offsets[l]),
      out);
}

// The effective policy of one stored block (KIVI's residual window keeps
// some blocks fp16: their codec is none).
absl::StatusOr<CodecPolicy> BlockPolicy(const CodecPolicy& ns_policy,
                                        Codec block_codec) {
  if (block_codec == ns_policy.codec) return ns_policy;
  if (block_codec == Codec::kNone) return CodecPolicy{};
  return absl::DataLossError("block codec differs from its namespace's");
}

void Deliver(const std::shared_ptr<StreamState>& s);

// Starts a delivery task when the next layer is ready everywhere (or a
// chunk of the prefix failed) and none runs.
void MaybeDeliver(const std::shared_ptr<StreamState>& s) {
  {
    absl::MutexLock lock(&s->mu);
    if (!s->fetched || s->delivering || s->stop || !s->error.ok() ||
        s->ready_layers >= s->num_layers) {
      return;
    }
    const uint32_t l = s->ready_layers;
    for (const auto& c : s->chunks) {
      if (c->needed && c->layers_arrived <= l && c->error.ok()) return;
    }
    s->delivering = true;
  }
  if (s->work == nullptr || !s->work->Submit([s] { Deliver(s); })) {
    absl::MutexLock lock(&s->mu);
    s->delivering = false;
    if (s->error.ok()) {
      s->error = absl::CancelledError("ClusterClient is shutting down");
    }
  }
}

// Delivers every layer that is ready, in order.
void Deliver(const std::shared_ptr<StreamState>& s) {
  std::vector<LayerSlice> slices(s->blocks.size());
  while (true) {
    uint32_t l;
    {
      absl::MutexLock lock(&s->mu);
      if (s->stop || !s->error.ok() || s->ready_layers >= s->num_layers) {
        s->delivering = false;
        return;
      }
      l = s->ready_layers;
      for (const auto& c : s->chunks) {
        if (!c->needed || c->layers_arrived > l) continue;
        if (!c->error.ok()) {
          const absl::StatusCode code = c->error.code();
          s->error = code == absl::StatusCode::kDeadlineExceeded ||
                             code == absl::StatusCode::kCancelled
                         ? c->error  // the deadline, or shutdown
                         : absl::UnavailableError(absl::StrCat(
                               "node ", c->node_id,
                               " failed after the prefix was fixed, before "
                               "layer ",
                               l, ": ", c->error.message()));
        }
        s->delivering = false;
        return;
      }
    }
    for (uint32_t b = 0; b < s->blocks.size(); ++b) {
      if (s->format == ReadFormat::kRaw) {
        absl::Span<uint16_t> out =
            absl::MakeSpan(s->decoded[b])
                .subspan(size_t{l} * 2 * s->section, 2 * s->section);
        absl::Status st = DecodeRawLayer(s->shape, s->blocks[b], l, out);
        if (!st.ok()) {
          absl::MutexLock lock(&s->mu);
          if (s->error.ok()) s->error = st;
          s->delivering = false;
          return;
        }
      }
      const uint16_t* layer = s->Layer(b, l);
      slices[b] = {b, absl::MakeConstSpan(layer, s->section),
                   absl::MakeConstSpan(layer + s->section, s->section)};
    }
    {
      absl::MutexLock lock(&s->mu);
      if (s->stop) {
        s->delivering = false;
        return;
      }
      s->in_callback = s->on_layer != nullptr;
    }
    absl::Status st = s->on_layer ? s->on_layer(l, absl::MakeConstSpan(slices))
                                  : absl::OkStatus();
    absl::MutexLock lock(&s->mu);
    s->in_callback = false;
    if (!st.ok()) {
      if (s->error.ok()) s->error = st;
      s->delivering = false;
      return;
    }
    s->ready_layers = l + 1;
  }
}

// Fixes the prefix from the chunks' answers: where each of its blocks is,
// and (raw reads) how its layers are cut. Then starts delivery.
void FixPrefix(const std::shared_ptr<StreamState>& s, const StreamPrefix& p,
               const std::vector<std::pair<uint32_t, uint32_t>>& where) {
  const size_t fp16_bytes = 4 * s->section * s->num_layers;
  absl::Status error;
  {
    absl::MutexLock lock(&s->mu);
    s->prefix = p.prefix;
    s->unavailable = p.unavailable;
    s->blocks.resize(p.prefix);
    for (uint32_t b = 0; b < p.prefix && error.ok(); ++b) {
      StreamChunk& chunk = *s->chunks[where[b].first];
      const uint32_t position = where[b].second;
      size_t j = 0;
      while (j < chunk.metadata.blocks.size() &&
             chunk.metadata.blocks[j].index != position) {
        ++j;
      }
      if (j == chunk.metadata.blocks.size()) {
        error = absl::InternalError("a block of the prefix has no placement");
        break;
      }
      const BlockData& meta = chunk.metadata.blocks[j];
      StreamBlock& block = s->blocks[b];
      block.chunk = &chunk;
      block.bytes = chunk.buffer + chunk.placements[j].offset;
      block.length = chunk.placements[j].length;
      block.format = meta.format;
      chunk.needed = true;
      if (meta.format != ReadFormat::kRaw) {
        if (block.length != fp16_bytes) {
          error = absl::DataLossError("fp16 block of the wrong size");
        }
        continue;
      }
      absl::StatusOr<CodecPolicy> policy =
          BlockPolicy(chunk.metadata.policy, meta.codec);
      if (!policy.ok()) {
        error = policy.status();
        break;
      }
      block.policy = *std::move(policy);
      block.offsets = kernels::EncodedLayerOffsets(s->shape, block.policy);
      if (block.offsets.back() != block.length) {
        error = absl::DataLossError(
            absl::StrCat("raw block ", b, " has ", block.length,
                         " bytes; expected ", block.offsets.back()));
      }
    }
    if (error.ok() && s->format == ReadFormat::kRaw) {
      s->decoded.resize(p.prefix);
      for (auto& d : s->decoded) d.resize(2 * s->section * s->num_layers);
    }
    if (!error.ok()) {
      s->blocks.clear();
      s->prefix = 0;
      if (s->error.ok()) s->error = error;
    } else if (p.prefix == 0) {
      s->ready_layers = s->num_layers;  // nothing cached: trivially ready
    }
    s->fetched = true;
  }
  MaybeDeliver(s);
}

}  // namespace

LayerStream::LayerStream(std::shared_ptr<State> state)
    : state_(std::move(state)) {}

LayerStream::~LayerStream() {
  Cancel();
  if (state_->caller_cancel != nullptr) {
    state_->caller_cancel->RemoveCallback(state_->caller_cancel_id);
  }
  // No on_layer starts after Cancel(); wait for one that runs (it is the
  // caller's own bounded work on memory that may die with this stream).
  absl::MutexLock lock(&state_->mu);
  state_->mu.Await(absl::Condition(
      +[](State* s)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return !s->in_callback; },
      state_.get()));
}

void LayerStream::Cancel() {
  state_->Stop(absl::CancelledError("stream cancelled"));
  state_->cancel->Cancel();
}

absl::StatusOr<uint32_t> LayerStream::WaitLayer(uint32_t layer) {
  State* s = state_.get();
  absl::MutexLock lock(&s->mu);
  if (layer >= s->num_layers) {
    if (!s->error.ok()) return s->error;
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, " is out of range (", s->num_layers, " layers)"));
  }
  auto ready = [s, layer]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
    return s->ready_layers > layer || !s->error.ok();
  };
  if (!s->mu.AwaitWithDeadline(absl::Condition(&ready), s->wait_bound)) {
    s->stop = true;
    if (s->error.ok()) {
      s->error = absl::DeadlineExceededError(
          absl::StrCat("layer ", layer, " was not ready by the deadline"));
    }
    // No on_layer starts now; let one that runs finish before returning.
    s->mu.Await(absl::Condition(
        +[](State* st)
             ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return !st->in_callback; },
        s));
  }
  if (s->ready_layers > layer) return s->prefix;
  return s->error;
}

absl::Span<const uint16_t> LayerStream::K(uint32_t block,
                                          uint32_t layer) const {
  State* s = state_.get();
  absl::MutexLock lock(&s->mu);
  if (layer >= s->ready_layers || block >= s->blocks.size()) return {};
  return absl::MakeConstSpan(s->Layer(block, layer), s->section);
}

absl::Span<const uint16_t> LayerStream::V(uint32_t block,
                                          uint32_t layer) const {
  State* s = state_.get();
  absl::MutexLock lock(&s->mu);
  if (layer >= s->ready_layers || block >= s->blocks.size()) return {};
  return absl::MakeConstSpan(s->Layer(block, layer) + s->section, s->section);
}

uint32_t LayerStream::unavailable_keys() const {
  absl::MutexLock lock(&state_->mu);
  return state_->fetched ? state_->unavailable : 0;
}

std::unique_ptr<LayerStream> ClusterClient::GetLayerwise(
    const std::string& ns_name, std::vector<std::string> keys,
    LayerwiseOptions options) {
  auto state = std::make_shared<LayerStream::State>();
  std::unique_ptr<LayerStream> stream(new LayerStream(state));
  absl::StatusOr<std::shared_ptr<const Namespace>> ns = FindNamespace(ns_name);
  if (!ns.ok()) {
    state->Fail(ns.status());
    return stream;
  }
  std::shared_ptr<const Namespace> space = *ns;
  const BlockShape& shape = space->spec.shape;
  state->shape = shape;
  state->num_layers = shape.num_layers;
  state->section =
      size_t{shape.tokens_per_block} * shape.num_kv_heads * shape.head_dim;
  state->format = options.format;
  state->on_layer = std::move(options.on_layer);
  state->work = work_.get();
  const absl::Time deadline = Deadline(options.call);
  state->wait_bound = deadline + options.local_work_budget;
  if (absl::Status s = ValidateKeys(keys); !s.ok()) {
    state->Fail(s);
    return stream;
  }
  if (options.call.cancel != nullptr) {
    std::weak_ptr<LayerStream::State> weak = state;
    state->caller_cancel = options.call.cancel;
    state->caller_cancel_id = options.call.cancel->AddCallback([weak] {
      if (auto s = weak.lock()) {
        s->Stop(absl::CancelledError("cancelled by the caller"));
        s->cancel->Cancel();
      }
    });
  }
  {
    absl::MutexLock lock(&state->mu);
    if (state->stop) return stream;  // cancelled already
  }

  // Chunks per owner; `where[i]`: key i's chunk and position in it.
  const size_t n = keys.size();
  auto shared_keys =
      std::make_shared<const std::vector<std::string>>(std::move(keys));
  auto where = std::make_shared<std::vector<std::pair<uint32_t, uint32_t>>>(
      n, std::make_pair(0u, 0u));
  struct Task {
    std::shared_ptr<NodeState> node;
    uint64_t epoch;
    std::shared_ptr<StreamChunk> chunk;
  };
  std::vector<Task> tasks;
  const size_t stride = (space->fp16_block_bytes + 63) / 64 * 64;
  for (NodePlan& plan : PlanByOwner(
           *Members(), n,
           [&](size_t i) { return absl::string_view((*shared_keys)[i]); },
           options_.routing_prefix_bytes, options_.rpc_timeout)) {
    for (std::vector<uint32_t>& indices :
         Chunks(plan.indices, space->chunk_blocks)) {
      auto chunk = std::make_shared<StreamChunk>();
      chunk->node_id = plan.node->id;
      for (uint32_t j = 0; j < indices.size(); ++j) {
        (*where)[indices[j]] = {static_cast<uint32_t>(state->chunks.size()), j};
      }
      chunk->indices = std::move(indices);
      chunk->stride = stride;
      state->chunks.push_back(chunk);
      tasks.push_back({plan.node, plan.epoch, std::move(chunk)});
    }
  }

  struct Partial {
    std::vector<uint8_t> state;
    std::optional<absl::Status> error;
  };
  using C = Call<Partial, StreamPrefix>;
  auto call = std::make_shared<C>(
      deadline, /*wait_for_tasks=*/false,
      Partial{std::vector<uint8_t>(n, kUnknown), std::nullopt},
      [this](Partial& p) -> absl::StatusOr<StreamPrefix> {
        if (p.error.has_value()) return *p.error;
        StreamPrefix r;
        while (r.prefix < p.state.size() && p.state[r.prefix] == kFound) {
          ++r.prefix;
        }
        r.unavailable = static_cast<uint32_t>(
            std::count(p.state.begin(), p.state.end(), kUnknown));
        unavailable_keys_.fetch_add(r.unavailable);
        return r;
      },
      [state, where](absl::StatusOr<StreamPrefix> r) {
        if (!r.ok()) return state->Fail(r.status());
        FixPrefix(state, *r, *where);
      });
  Arm(call, state->cancel);
  for (Task& t : tasks) {
    call->AddTask();
    auto task = [this, call, state, space, shared_keys, format = options.format,
                 node = t.node, epoch = t.epoch, chunk = t.chunk] {
      std::vector<std::string> sub;
      for (uint32_t i : chunk->indices) sub.push_back((*shared_keys)[i]);
      absl::StatusOr<std::unique_ptr<PendingRead>> read;
      absl::Status st = absl::CancelledError("node marked down");
      if (StillUsable(*node, epoch)) {
        const size_t bytes = chunk->indices.size() * chunk->stride;
        absl::StatusOr<std::unique_ptr<DataBuffer>> registered =
            node->client->AllocateBuffer(bytes);
        if (registered.ok() && (*registered)->registered()) {
          chunk->owner = node;
          chunk->registered = *std::move(registered);
          chunk->buffer = chunk->registered->data();
        } else {
          chunk->heap = std::make_unique<uint8_t[]>(bytes);
          chunk->buffer = chunk->heap.get();
        }
        ReadOptions read_options;
        read_options.format = format;
        read_options.allow_missing = true;
        // Not the call's cancel: a stopped stream lets its transfers run
        // out (bounded by their deadline) rather than close a connection
        // that other calls share.
        st = RunOnNode(
            *node, epoch, *space, call->stop(), call->deadline(),
            shutdown_cancel_, RunFlags{true, /*reregister_on_not_found=*/true},
            [&](const CallOptions& rpc) {
              read = node->client->GetInto(
                  space->spec.name, sub, read_options,
                  absl::MakeSpan(chunk->buffer,
                                 chunk->indices.size() * chunk->stride),
                  chunk->stride, rpc);
              return read.status();
            });
      }
      GetResult metadata;
      bool all_missing = false;
      if (IsMiss(st.code())) {  // a node that predates allow_missing
        all_missing = true;
        st = absl::OkStatus();
      } else if (st.ok()) {
        metadata = (*read)->metadata();
        const BlockShape& got = metadata.shape;
        const BlockShape& want = space->spec.shape;
        // Not the layout this client knows: unusable.
        all_missing = !metadata.blocks.empty() &&
                      (got.num_layers != want.num_layers ||
                       got.tokens_per_block != want.tokens_per_block ||
                       got.num_kv_heads != want.num_kv_heads ||
                       got.head_dim != want.head_dim);
        // Recorded before TaskDone: the prefix may be fixed inside it.
        absl::MutexLock lock(&state->mu);
        chunk->metadata = metadata;
        chunk->placements = (*read)->placements();
      }
      call->TaskDone([&](Partial& p) {
        if (!st.ok()) {
          if (IsCallerError(st.code()) && !p.error.has_value()) p.error = st;
          return;  // unknown: unavailable
        }
        if (all_missing) {
          for (uint32_t i : chunk->indices) p.state[i] = kMiss;
          return;
        }
        for (uint32_t j : metadata.missing) p.state[chunk->indices[j]] = kMiss;
        for (const BlockData& b : metadata.blocks) {
          p.state[chunk->indices[b.index]] = kFound;
        }
      });
      if (!st.ok() || all_missing || metadata.blocks.empty()) return;
      // Layer by layer until the transfer ends, also when the stream no
      // longer needs it (the buffer must outlive the transfer).
      const uint32_t layers = (*read)->num_layers();
      for (uint32_t l = 0; l < layers; ++l) {
        absl::Status arrived = (*read)->WaitLayer(l);
        {
          absl::MutexLock lock(&state->mu);
          if (arrived.ok()) {
            chunk->layers_arrived = l + 1;
          } else {
            chunk->error = arrived;
          }
        }
        MaybeDeliver(state);
        if (!arrived.ok()) {
          if (IsNodeFailure(arrived.code()) && !shutting_down_->load() &&
              MarkDown(*node, epoch, options_.node_backoff_initial,
                       options_.node_backoff_max)) {
            node_failures_.fetch_add(1);
          }
          return;
        }
      }
    };
    if (!Submit(t.node, std::move(task))) call->TaskDone([](Partial&) {});
  }
  call->TaskDone([](Partial&) {});
  return stream;
}

}  // namespace kvcache
