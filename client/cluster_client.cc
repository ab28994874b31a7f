#include "kvcache/cluster_client.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/cluster_impl.h"
#include "client/fan_out.h"
#include "client/node_set.h"
#include "kernels/codec.h"

namespace kvcache {
namespace {

using internal::ClusterNamespace;
using internal::FanOutCall;
using internal::NodePlan;
using internal::NodeSet;
using internal::NodeState;

constexpr size_t kMaxKeyBytes = 64;
// Bytes of a message beyond its blocks (keys, framing).
constexpr size_t kMessageSlack = 64 << 10;
// How long a synchronous call waits past its deadline for its delivery.
constexpr absl::Duration kDeliveryGrace = absl::Seconds(5);

enum KeyState : uint8_t { kUnknown = 0, kFound = 1, kMiss = 2 };

absl::Status ValidateKey(absl::string_view key, absl::string_view what,
                         size_t index) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", index, " is ", key.size(),
                     " bytes; keys are 1 to ", kMaxKeyBytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const ClusterOptions& options) {
  const int sources = (options.nodes.empty() ? 0 : 1) +
                      (options.dns_name.empty() ? 0 : 1) +
                      (options.discover ? 1 : 0);
  if (sources != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of ClusterOptions.nodes, dns_name, discover");
  }
  for (const std::string& id : options.nodes) {
    if (absl::Status s = internal::ValidateNodeId(id); !s.ok()) return s;
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
  return absl::OkStatus();
}

// The result of a synchronous call: the future's value once delivered
// (by `bound` at the latest), DEADLINE_EXCEEDED naming `what` otherwise.
template <typename T>
absl::StatusOr<T> AwaitDelivery(std::future<absl::StatusOr<T>>& future,
                                absl::Time bound, absl::string_view what) {
  if (future.wait_until(absl::ToChronoTime(bound)) !=
      std::future_status::ready) {
    return absl::DeadlineExceededError(absl::StrCat(what, " did not complete"));
  }
  return future.get();
}

// A delivery callback that fulfils a promise, and its future.
template <typename T>
std::pair<absl::AnyInvocable<void(absl::StatusOr<T>)>,
          std::future<absl::StatusOr<T>>>
PromiseCallback() {
  auto promise = std::make_shared<std::promise<absl::StatusOr<T>>>();
  std::future<absl::StatusOr<T>> future = promise->get_future();
  return {[promise](absl::StatusOr<T> r) { promise->set_value(std::move(r)); },
          std::move(future)};
}

// The keys at `indices`.
std::vector<std::string> KeysAt(const std::vector<std::string>& keys,
                                const std::vector<uint32_t>& indices) {
  std::vector<std::string> sub;
  sub.reserve(indices.size());
  for (uint32_t i : indices) sub.push_back(keys[i]);
  return sub;
}

// keys[0, n) found: the prefix; kUnknown: unavailable.
uint32_t FoundPrefix(const std::vector<uint8_t>& state) {
  uint32_t prefix = 0;
  while (prefix < state.size() && state[prefix] == kFound) ++prefix;
  return prefix;
}
uint32_t CountUnknown(const std::vector<uint8_t>& state) {
  return static_cast<uint32_t>(
      std::count(state.begin(), state.end(), kUnknown));
}

void KeepFirstCallerError(const absl::Status& st,
                          std::optional<absl::Status>* error) {
  if (!st.ok() && internal::IsCallerError(st.code()) && !error->has_value()) {
    *error = st;
  }
}

// ---------------------------------------------------------------------------
// The part of each operation that one node runs (on its executor).

struct RegisterPartial {
  std::optional<NamespaceInfo> info;
  std::optional<absl::Status> error;
};
using RegisterCall = FanOutCall<RegisterPartial, NamespaceInfo>;

void RegisterOnNode(NodeSet& nodes, RegisterCall& call,
                    const std::shared_ptr<const ClusterNamespace>& ns,
                    NodeState& node, uint64_t epoch) {
  nodes.SetRegistered(node, ns->spec.name, false);
  absl::StatusOr<NamespaceInfo> info;
  absl::Status st = nodes.RunOnNode(
      node, epoch, *ns, call.stop(), call.deadline(), call.rpc_cancel(),
      NodeSet::RunFlags{/*ensure_registered=*/false, false},
      [&](const CallOptions& rpc) {
        info = node.client->RegisterNamespace(ns->spec, rpc);
        return info.status();
      });
  if (st.ok()) nodes.SetRegistered(node, ns->spec.name, true);
  call.TaskDone([&](RegisterPartial& p) {
    if (st.ok() && !p.info.has_value()) p.info = *info;
    KeepFirstCallerError(st, &p.error);
  });
}

struct LookupPartial {
  std::vector<uint8_t> state;
  std::optional<absl::Status> error;
};
using LookupCall = FanOutCall<LookupPartial, ClusterLookupResult>;

// Chunks in order; a node's first miss ends its part of the prefix.
void LookupOnNode(NodeSet& nodes, LookupCall& call, const ClusterNamespace& ns,
                  const std::vector<std::string>& keys, NodeState& node,
                  uint64_t epoch, const std::vector<uint32_t>& indices) {
  std::vector<std::pair<uint32_t, uint8_t>> marks;
  std::optional<absl::Status> error;
  const std::vector<std::vector<uint32_t>> chunks =
      nodes.StillUsable(node, epoch)
          ? internal::Chunks(indices, ns.chunk_blocks)
          : std::vector<std::vector<uint32_t>>{};
  for (const std::vector<uint32_t>& chunk : chunks) {
    const std::vector<std::string> sub = KeysAt(keys, chunk);
    absl::StatusOr<LookupResult> r;
    absl::Status st = nodes.RunOnNode(
        node, epoch, ns, call.stop(), call.deadline(), call.rpc_cancel(),
        NodeSet::RunFlags{true, /*reregister_on_not_found=*/true},
        [&](const CallOptions& rpc) {
          r = node.client->Lookup(ns.spec.name, sub, false, rpc);
          return r.status();
        });
    if (!st.ok()) {
      if (internal::IsCallerError(st.code())) error = st;
      break;  // the rest stays unknown (unavailable)
    }
    const uint32_t p = std::min<uint32_t>(r->prefix_blocks,
                                          static_cast<uint32_t>(chunk.size()));
    for (uint32_t j = 0; j < p; ++j) marks.push_back({chunk[j], kFound});
    if (p < chunk.size()) {
      // A miss: this key and every later one of this node lie past the
      // prefix.
      for (uint32_t i : indices) {
        if (i >= chunk[p]) marks.push_back({i, kMiss});
      }
      break;
    }
  }
  call.TaskDone([&](LookupPartial& part) {
    for (const auto& [i, s] : marks) part.state[i] = s;
    if (error.has_value() && !part.error.has_value()) part.error = error;
  });
}

struct PutPartial {
  ClusterPutResult result;
  std::optional<absl::Status> error;
};
using PutCall = FanOutCall<PutPartial, ClusterPutResult>;

void PutOnNode(NodeSet& nodes, PutCall& call, const ClusterNamespace& ns,
               const std::vector<BlockWrite>& writes, NodeState& node,
               uint64_t epoch, const std::vector<uint32_t>& chunk) {
  ClusterPutResult part;
  std::optional<absl::Status> error;
  if (!nodes.StillUsable(node, epoch)) {
    part.why_not_stored = absl::UnavailableError(
        absl::StrCat("node ", node.id, " failed while this call was queued"));
  } else {
    std::vector<BlockWrite> sub;
    sub.reserve(chunk.size());
    for (uint32_t i : chunk) sub.push_back(writes[i]);
    absl::StatusOr<PutResult> r;
    absl::Status st = nodes.RunOnNode(
        node, epoch, ns, call.stop(), call.deadline(), call.rpc_cancel(),
        NodeSet::RunFlags{true, /*reregister_on_not_found=*/true},
        [&](const CallOptions& rpc) {
          r = node.client->Put(ns.spec.name, sub, rpc);
          return r.status();
        });
    if (st.ok()) {
      part.stored = r->stored;
      part.skipped = r->skipped;
    } else if (st.code() == absl::StatusCode::kResourceExhausted) {
      part.rejected = static_cast<uint32_t>(chunk.size());
    } else if (internal::IsCallerError(st.code())) {
      error = st;
    }
    if (!st.ok()) {
      part.why_not_stored = absl::Status(
          st.code(), absl::StrCat("node ", node.id, ": ", st.message()));
    }
  }
  call.TaskDone([&](PutPartial& p) {
    p.result.stored += part.stored;
    p.result.skipped += part.skipped;
    p.result.rejected += part.rejected;
    if (p.result.why_not_stored.ok()) {
      p.result.why_not_stored = part.why_not_stored;
    }
    if (error.has_value() && !p.error.has_value()) p.error = error;
  });
}

struct GetPartial {
  std::vector<std::optional<BlockData>> blocks;
  std::vector<uint8_t> state;
  std::optional<absl::Status> error;
  std::optional<GetResult> layout;  // shape and policy of a response
};
using GetCall = FanOutCall<GetPartial, ClusterGetResult>;

// Merges one chunk's answer `got` into `p`.
void MergeGet(const ClusterNamespace& ns, const std::vector<uint32_t>& chunk,
              GetResult& got, GetPartial& p) {
  for (uint32_t j : got.missing) p.state[chunk[j]] = kMiss;
  if (got.blocks.empty()) return;
  if (got.shape.num_layers != ns.spec.shape.num_layers ||
      got.shape.tokens_per_block != ns.spec.shape.tokens_per_block) {
    for (const BlockData& b : got.blocks) p.state[chunk[b.index]] = kMiss;
    return;
  }
  if (!p.layout.has_value()) {
    p.layout.emplace();
    p.layout->shape = got.shape;
    p.layout->policy = got.policy;
  }
  for (BlockData& b : got.blocks) {
    const uint32_t i = chunk[b.index];
    b.index = i;
    p.state[i] = kFound;
    p.blocks[i] = std::move(b);
  }
}

void GetOnNode(NodeSet& nodes, GetCall& call, const ClusterNamespace& ns,
               const std::vector<std::string>& keys, ReadFormat format,
               NodeState& node, uint64_t epoch,
               const std::vector<uint32_t>& chunk) {
  const std::vector<std::string> sub = KeysAt(keys, chunk);
  absl::StatusOr<GetResult> got;
  absl::Status st = absl::CancelledError("node marked down");
  if (nodes.StillUsable(node, epoch)) {
    ReadOptions read;
    read.format = format;
    read.allow_missing = true;
    // NOT_FOUND now means the node lost the namespace: registered again,
    // then read again.
    st = nodes.RunOnNode(
        node, epoch, ns, call.stop(), call.deadline(), call.rpc_cancel(),
        NodeSet::RunFlags{true, /*reregister_on_not_found=*/true},
        [&](const CallOptions& rpc) {
          got = node.client->Get(ns.spec.name, sub, read, rpc);
          return got.status();
        });
    if (internal::IsMiss(st.code())) {
      // A node that predates allow_missing: the whole chunk misses.
      got = GetResult{};
      for (uint32_t j = 0; j < chunk.size(); ++j) got->missing.push_back(j);
      st = absl::OkStatus();
    }
  }
  call.TaskDone([&](GetPartial& p) {
    if (!st.ok()) {
      KeepFirstCallerError(st, &p.error);
      return;  // unknown: unavailable
    }
    MergeGet(ns, chunk, *got, p);
  });
}

struct DeletePartial {
  uint32_t deleted = 0;
  std::optional<absl::Status> error;
};
using DeleteCall = FanOutCall<DeletePartial, uint32_t>;

void DeleteOnNode(NodeSet& nodes, DeleteCall& call, const ClusterNamespace& ns,
                  const std::vector<std::string>& keys, NodeState& node,
                  uint64_t epoch, const std::vector<uint32_t>& chunk) {
  absl::StatusOr<uint32_t> r;
  absl::Status st = absl::CancelledError("node marked down");
  if (nodes.StillUsable(node, epoch)) {
    const std::vector<std::string> sub = KeysAt(keys, chunk);
    st = nodes.RunOnNode(node, epoch, ns, call.stop(), call.deadline(),
                         call.rpc_cancel(), NodeSet::RunFlags{true, false},
                         [&](const CallOptions& rpc) {
                           r = node.client->Delete(ns.spec.name, sub, rpc);
                           return r.status();
                         });
  }
  call.TaskDone([&](DeletePartial& p) {
    if (st.ok()) p.deleted += *r;
    KeepFirstCallerError(st, &p.error);
  });
}

// The blocks of a Put checked against `ns` (keys, sizes), each with its
// parent explicit (a node sees only its own blocks of the chain).
absl::StatusOr<std::vector<BlockWrite>> CheckedWrites(
    const ClusterNamespace& ns, absl::Span<const BlockWrite> blocks) {
  if (blocks.empty()) return absl::InvalidArgumentError("no blocks");
  const size_t halves = ns.fp16_block_bytes / 2;
  std::vector<BlockWrite> writes;
  writes.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (absl::Status s = ValidateKey(blocks[i].key, "block key", i); !s.ok()) {
      return s;
    }
    if (blocks[i].parent_key.size() > kMaxKeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parent key of block ", i, " is longer than ", kMaxKeyBytes));
    }
    if (blocks[i].fp16.size() != halves) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", i, " has ", blocks[i].fp16.size(),
                       " halves; the namespace's blocks have ", halves));
    }
    BlockWrite w = blocks[i];
    if (w.parent_key.empty() && i > 0) w.parent_key = blocks[i - 1].key;
    writes.push_back(std::move(w));
  }
  return writes;
}

}  // namespace

absl::Status internal::ValidateKeys(const std::vector<std::string>& keys) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (absl::Status s = ValidateKey(keys[i], "key", i); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Construction, membership

ClusterClient::Impl::Impl(ClusterOptions cluster_options)
    : options(std::move(cluster_options)),
      timer(std::make_unique<internal::DeadlineTimer>()),
      work(std::make_unique<internal::Executor>(options.work_threads)),
      shutting_down(std::make_shared<std::atomic<bool>>(false)),
      shutdown_cancel(std::make_shared<CancelToken>()),
      nodes(options, shutting_down) {}

ClusterClient::Impl::~Impl() {
  nodes.StopRefresh();
  shutting_down->store(true);
  shutdown_cancel->Cancel();
  // Every call still armed is stopped (CANCELLED) now; Lookup and Get are
  // delivered at once, Put once its RPC in flight has ended.
  timer->Shutdown();
  nodes.Shutdown();
  work.reset();
}

absl::StatusOr<std::shared_ptr<const ClusterNamespace>>
ClusterClient::Impl::FindNamespace(const std::string& ns) const {
  MutexLock lock(&mu);
  auto it = namespaces.find(ns);
  if (it == namespaces.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "namespace '", ns, "' is not registered with this ClusterClient"));
  }
  return it->second;
}

absl::Time ClusterClient::Impl::Deadline(const CallOptions& call) const {
  return CallDeadline(call, options.default_timeout);
}

std::vector<NodePlan> ClusterClient::Impl::PlanKeys(
    const std::vector<std::string>& keys, std::string* skipped) const {
  return nodes.PlanByOwner(
      keys.size(), [&](size_t i) { return absl::string_view(keys[i]); },
      skipped);
}

ClusterClient::ClusterClient(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

ClusterClient::~ClusterClient() = default;

absl::StatusOr<std::unique_ptr<ClusterClient>> ClusterClient::Create(
    ClusterOptions options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  const bool dynamic = options.nodes.empty();
  std::unique_ptr<ClusterClient> cc(
      new ClusterClient(std::make_unique<Impl>(std::move(options))));
  internal::NodeSet& nodes = cc->impl_->nodes;
  if (!dynamic) {
    if (absl::Status s = nodes.SetStaticMembers(); !s.ok()) return s;
    return cc;
  }
  // A failure here is not fatal: the client starts empty and retries.
  nodes.Refresh().IgnoreError();
  if (cc->impl_->options.refresh_interval > absl::ZeroDuration()) {
    nodes.StartRefresh();
  }
  return cc;
}

absl::Status ClusterClient::RefreshMembership() {
  return impl_->nodes.Refresh();
}

std::vector<NodeStatus> ClusterClient::Nodes() const {
  return impl_->nodes.Nodes();
}

std::string ClusterClient::OwnerOf(absl::string_view key) const {
  return impl_->nodes.OwnerOf(key);
}

ClusterCounters ClusterClient::counters() const {
  ClusterCounters c;
  c.retries = impl_->nodes.retries();
  c.node_failures = impl_->nodes.node_failures();
  c.unavailable_keys = impl_->unavailable_keys.load();
  c.membership_changes = impl_->nodes.membership_changes();
  c.refresh_failures = impl_->nodes.refresh_failures();
  return c;
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
  auto ns = std::make_shared<ClusterNamespace>();
  ns->spec = spec;
  ns->fp16_block_bytes = kernels::Fp16BlockBytes(spec.shape);
  const uint64_t by_bytes =
      (static_cast<uint64_t>(impl_->options.max_message_bytes) -
       kMessageSlack) /
      ns->fp16_block_bytes;
  ns->chunk_blocks = static_cast<uint32_t>(std::max<uint64_t>(
      1, std::min<uint64_t>(impl_->options.max_blocks_per_rpc, by_bytes)));
  // Members registered with an earlier spec of this name get the one in
  // use before their next call.
  impl_->nodes.ForgetRegistrations(spec.name);

  auto [done, future] = PromiseCallback<NamespaceInfo>();
  auto call = std::make_shared<RegisterCall>(
      impl_->Deadline(options), /*wait_for_tasks=*/false, RegisterPartial{},
      [](RegisterPartial& p) -> absl::StatusOr<NamespaceInfo> {
        if (p.error.has_value()) return *p.error;
        if (p.info.has_value()) return *p.info;
        return absl::UnavailableError(
            "no member answered; the namespace will be registered on "
            "first use");
      },
      std::move(done));
  impl_->Arm(call, options.cancel);
  const absl::Time now = absl::Now();
  Impl* impl = impl_.get();
  for (const auto& node : impl->nodes.Members()->nodes) {
    uint64_t epoch = 0;
    if (!impl->nodes.TryUse(*node, now, &epoch)) continue;
    call->Spawn(impl->SubmitTo(node), [impl, call, node, epoch, ns] {
      RegisterOnNode(impl->nodes, *call, ns, *node, epoch);
    });
  }
  call->Planned();
  // Delivered by the deadline at the latest (the timer stops the call).
  absl::StatusOr<NamespaceInfo> result = AwaitDelivery(
      future, call->deadline() + kDeliveryGrace, "RegisterNamespace");
  // Kept unless a member refused it: then the previous spec (if any) stays.
  if (result.ok() || !internal::IsCallerError(result.status().code())) {
    MutexLock lock(&impl_->mu);
    impl_->namespaces[spec.name] = ns;
  }
  return result;
}

// ---------------------------------------------------------------------------
// Lookup

void ClusterClient::LookupAsync(const std::string& ns_name,
                                std::vector<std::string> keys,
                                const CallOptions& options,
                                LookupCallback done) {
  absl::StatusOr<std::shared_ptr<const ClusterNamespace>> ns =
      impl_->FindNamespace(ns_name);
  if (!ns.ok()) return done(ns.status());
  if (absl::Status s = internal::ValidateKeys(keys); !s.ok()) return done(s);
  if (options.cancel != nullptr && options.cancel->cancelled()) {
    return done(absl::CancelledError("cancelled by the caller"));
  }
  Impl* impl = impl_.get();
  const size_t n = keys.size();
  auto shared_keys =
      std::make_shared<const std::vector<std::string>>(std::move(keys));
  auto call = std::make_shared<LookupCall>(
      impl->Deadline(options), /*wait_for_tasks=*/false,
      LookupPartial{std::vector<uint8_t>(n, kUnknown), std::nullopt},
      [impl](LookupPartial& p) -> absl::StatusOr<ClusterLookupResult> {
        if (p.error.has_value()) return *p.error;
        ClusterLookupResult r;
        r.prefix_blocks = FoundPrefix(p.state);
        r.unavailable_keys = CountUnknown(p.state);
        impl->unavailable_keys.fetch_add(r.unavailable_keys);
        return r;
      },
      std::move(done));
  impl->Arm(call, options.cancel);
  std::shared_ptr<const ClusterNamespace> space = *ns;
  for (NodePlan& plan : impl->PlanKeys(*shared_keys)) {
    call->Spawn(impl->SubmitTo(plan.node),
                [impl, call, space, shared_keys, node = plan.node,
                 epoch = plan.epoch, indices = std::move(plan.indices)] {
                  LookupOnNode(impl->nodes, *call, *space, *shared_keys, *node,
                               epoch, indices);
                });
  }
  call->Planned();
}

std::future<absl::StatusOr<ClusterLookupResult>> ClusterClient::LookupAsync(
    const std::string& ns, std::vector<std::string> keys,
    const CallOptions& options) {
  auto [done, future] = PromiseCallback<ClusterLookupResult>();
  LookupAsync(ns, std::move(keys), options, std::move(done));
  return std::move(future);
}

absl::StatusOr<ClusterLookupResult> ClusterClient::Lookup(
    const std::string& ns, std::vector<std::string> keys,
    const CallOptions& options) {
  const absl::Time bound = impl_->Deadline(options) + kDeliveryGrace;
  auto future = LookupAsync(ns, std::move(keys), options);
  return AwaitDelivery(future, bound, "Lookup");
}

// ---------------------------------------------------------------------------
// Put

void ClusterClient::PutAsync(const std::string& ns_name,
                             absl::Span<const BlockWrite> blocks,
                             const CallOptions& options, PutCallback done) {
  absl::StatusOr<std::shared_ptr<const ClusterNamespace>> ns =
      impl_->FindNamespace(ns_name);
  if (!ns.ok()) return done(ns.status());
  absl::StatusOr<std::vector<BlockWrite>> checked = CheckedWrites(**ns, blocks);
  if (!checked.ok()) return done(checked.status());
  auto writes =
      std::make_shared<const std::vector<BlockWrite>>(*std::move(checked));
  if (options.cancel != nullptr && options.cancel->cancelled()) {
    return done(absl::CancelledError("cancelled by the caller"));
  }
  Impl* impl = impl_.get();
  auto call = std::make_shared<PutCall>(
      impl->Deadline(options), /*wait_for_tasks=*/true, PutPartial{},
      [impl,
       n = blocks.size()](PutPartial& p) -> absl::StatusOr<ClusterPutResult> {
        if (p.error.has_value()) return *p.error;
        ClusterPutResult r = p.result;
        // Blocks no task confirmed (owner down, timed out, call ended).
        const uint64_t confirmed = uint64_t{r.stored} + r.skipped + r.rejected;
        r.unavailable =
            confirmed >= n ? 0 : static_cast<uint32_t>(n - confirmed);
        impl->unavailable_keys.fetch_add(r.unavailable);
        if (r.unavailable + r.rejected > 0 && r.why_not_stored.ok()) {
          r.why_not_stored = absl::DeadlineExceededError(
              "the call ended before the owners of some blocks answered");
        }
        return r;
      },
      std::move(done));
  impl->Arm(call, options.cancel);
  std::shared_ptr<const ClusterNamespace> space = *ns;
  std::string skipped;
  std::vector<NodePlan> plans = impl->nodes.PlanByOwner(
      writes->size(),
      [&](size_t i) { return absl::string_view((*writes)[i].key); }, &skipped);
  if (!skipped.empty()) {
    call->AddTask();
    call->TaskDone([&](PutPartial& p) {
      p.result.why_not_stored = absl::UnavailableError(absl::StrCat(
          "node ", skipped, " is skipped while it backs off after failures"));
    });
  }
  for (NodePlan& plan : plans) {
    for (std::vector<uint32_t>& chunk :
         internal::Chunks(plan.indices, space->chunk_blocks)) {
      call->Spawn(impl->SubmitTo(plan.node),
                  [impl, call, space, writes, node = plan.node,
                   epoch = plan.epoch, chunk = std::move(chunk)] {
                    PutOnNode(impl->nodes, *call, *space, *writes, *node, epoch,
                              chunk);
                  });
    }
  }
  call->Planned();
}

std::future<absl::StatusOr<ClusterPutResult>> ClusterClient::PutAsync(
    const std::string& ns, absl::Span<const BlockWrite> blocks,
    const CallOptions& options) {
  auto [done, future] = PromiseCallback<ClusterPutResult>();
  PutAsync(ns, blocks, options, std::move(done));
  return std::move(future);
}

absl::StatusOr<ClusterPutResult> ClusterClient::Put(
    const std::string& ns, absl::Span<const BlockWrite> blocks,
    const CallOptions& options) {
  // A Put may outlive its deadline by the RPC in flight (two RPCs of a
  // begin/commit pair): it must not return while that RPC reads `blocks`.
  const absl::Time bound = impl_->Deadline(options) +
                           2 * impl_->options.rpc_timeout + kDeliveryGrace;
  auto future = PutAsync(ns, blocks, options);
  return AwaitDelivery(future, bound, "Put");
}

// ---------------------------------------------------------------------------
// Get

void ClusterClient::GetAsync(const std::string& ns_name,
                             std::vector<std::string> keys, ReadFormat format,
                             const CallOptions& options, GetCallback done) {
  absl::StatusOr<std::shared_ptr<const ClusterNamespace>> ns =
      impl_->FindNamespace(ns_name);
  if (!ns.ok()) return done(ns.status());
  if (absl::Status s = internal::ValidateKeys(keys); !s.ok()) return done(s);
  if (options.cancel != nullptr && options.cancel->cancelled()) {
    return done(absl::CancelledError("cancelled by the caller"));
  }
  Impl* impl = impl_.get();
  const size_t n = keys.size();
  auto shared_keys =
      std::make_shared<const std::vector<std::string>>(std::move(keys));
  std::shared_ptr<const ClusterNamespace> space = *ns;
  GetPartial initial;
  initial.blocks.resize(n);
  initial.state.assign(n, kUnknown);
  auto call = std::make_shared<GetCall>(
      impl->Deadline(options), /*wait_for_tasks=*/false, std::move(initial),
      [impl, space](GetPartial& p) -> absl::StatusOr<ClusterGetResult> {
        if (p.error.has_value()) return *p.error;
        ClusterGetResult r;
        r.read.shape =
            p.layout.has_value() ? p.layout->shape : space->spec.shape;
        r.read.policy =
            p.layout.has_value() ? p.layout->policy : *space->spec.policy;
        while (r.prefix_blocks < p.blocks.size() &&
               p.blocks[r.prefix_blocks].has_value()) {
          r.read.blocks.push_back(*std::move(p.blocks[r.prefix_blocks]));
          ++r.prefix_blocks;
        }
        r.unavailable_keys = CountUnknown(p.state);
        impl->unavailable_keys.fetch_add(r.unavailable_keys);
        return r;
      },
      std::move(done));
  impl->Arm(call, options.cancel);
  for (NodePlan& plan : impl->PlanKeys(*shared_keys)) {
    for (std::vector<uint32_t>& chunk :
         internal::Chunks(plan.indices, space->chunk_blocks)) {
      call->Spawn(impl->SubmitTo(plan.node),
                  [impl, call, space, shared_keys, format, node = plan.node,
                   epoch = plan.epoch, chunk = std::move(chunk)] {
                    GetOnNode(impl->nodes, *call, *space, *shared_keys, format,
                              *node, epoch, chunk);
                  });
    }
  }
  call->Planned();
}

std::future<absl::StatusOr<ClusterGetResult>> ClusterClient::GetAsync(
    const std::string& ns, std::vector<std::string> keys, ReadFormat format,
    const CallOptions& options) {
  auto [done, future] = PromiseCallback<ClusterGetResult>();
  GetAsync(ns, std::move(keys), format, options, std::move(done));
  return std::move(future);
}

absl::StatusOr<ClusterGetResult> ClusterClient::Get(
    const std::string& ns, std::vector<std::string> keys, ReadFormat format,
    const CallOptions& options) {
  const absl::Time bound = impl_->Deadline(options) + kDeliveryGrace;
  auto future = GetAsync(ns, std::move(keys), format, options);
  return AwaitDelivery(future, bound, "Get");
}

// ---------------------------------------------------------------------------
// Delete

absl::StatusOr<uint32_t> ClusterClient::Delete(const std::string& ns_name,
                                               std::vector<std::string> keys,
                                               const CallOptions& options) {
  absl::StatusOr<std::shared_ptr<const ClusterNamespace>> ns =
      impl_->FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  if (absl::Status s = internal::ValidateKeys(keys); !s.ok()) return s;
  Impl* impl = impl_.get();
  auto [done, future] = PromiseCallback<uint32_t>();
  auto call = std::make_shared<DeleteCall>(
      impl->Deadline(options), /*wait_for_tasks=*/false, DeletePartial{},
      [](DeletePartial& p) -> absl::StatusOr<uint32_t> {
        if (p.error.has_value()) return *p.error;
        return p.deleted;
      },
      std::move(done));
  impl->Arm(call, options.cancel);
  auto shared_keys =
      std::make_shared<const std::vector<std::string>>(std::move(keys));
  std::shared_ptr<const ClusterNamespace> space = *ns;
  for (NodePlan& plan : impl->PlanKeys(*shared_keys)) {
    for (std::vector<uint32_t>& chunk :
         internal::Chunks(plan.indices, space->chunk_blocks)) {
      call->Spawn(impl->SubmitTo(plan.node),
                  [impl, call, space, shared_keys, node = plan.node,
                   epoch = plan.epoch, chunk = std::move(chunk)] {
                    DeleteOnNode(impl->nodes, *call, *space, *shared_keys,
                                 *node, epoch, chunk);
                  });
    }
  }
  call->Planned();
  return AwaitDelivery(future, call->deadline() + kDeliveryGrace, "Delete");
}

}  // namespace kvcache
