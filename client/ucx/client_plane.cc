#include "client/ucx/client_plane.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <optional>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/functional/function_ref.h"
#include "absl/memory/memory.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "transport/status.h"

namespace kvcache::ucx {
namespace {

// After a force-close, how long UCX may take to fail what was in flight.
constexpr absl::Duration kCloseGrace = absl::Seconds(10);
// How long a transfer past its call's deadline (or cancelled, or
// abandoned) may take to end on its own before its connection is
// force-closed. Closing fails every other call of the process on that
// connection, and over TCP UCX shares one TCP connection between the
// endpoints of two workers, so a force-close can also lose messages of the
// connections made after it (measured: kvcache-soak's chaos worker saw
// calls on fresh connections wait to their deadlines). A node that is
// answering ends the transfer well within this; a stuck one is closed.
constexpr absl::Duration kSettleGrace = absl::Milliseconds(250);
// How long an abandoned read on a connection without peer failure handling
// may take to end on its own before its connection is closed anyway.
constexpr absl::Duration kAbandonGrace = absl::Seconds(5);
// Waits look at their connection this often (half kConnectTimeout; see
// ClientPlane::CloseIfNotConnected), so a connection that never comes up
// fails its calls between kConnectTimeout and 1.5x that after it began.
constexpr absl::Duration kConnectCheckInterval = absl::Seconds(1);
constexpr absl::string_view kNotConnectedPayload =
    "type.kvcache.dev/kvcache.ucx.DataPlaneNotConnected";
constexpr absl::string_view kFreshResetPayload =
    "type.kvcache.dev/kvcache.ucx.FreshConnectionReset";

// Completion count of a batch of sends.
struct SendState {
  explicit SendState(size_t sends) : pending(sends) {}

  Mutex mu;
  CondVar cv;  // signalled when `pending` reaches 0
  size_t pending ABSL_GUARDED_BY(mu);
  absl::Status status ABSL_GUARDED_BY(mu);  // the first error

  void Complete(size_t n, const absl::Status& s) {
    MutexLock lock(&mu);
    if (!s.ok() && status.ok()) status = s;
    pending -= n;
    if (pending == 0) cv.SignalAll();
  }
  // Records why the sends will fail (before they do).
  void Fail(const absl::Status& s) {
    MutexLock lock(&mu);
    if (status.ok()) status = s;
  }
  // True when everything completed before `deadline`.
  bool WaitUntil(absl::Time deadline) {
    MutexLock lock(&mu);
    return cv.WaitUntil(
        &mu, deadline,
        [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return pending == 0; });
  }
  absl::Status Status() {
    MutexLock lock(&mu);
    return status;
  }
};

// Waits for sends until `deadline`, calling `check_connection` every
// kConnectCheckInterval meanwhile; past it, gives them kSettleGrace more,
// then calls `force_close` (which fails whatever is in flight) and waits,
// bounded, for the sends to end, so that no send touches the caller's
// bytes after this returns.
absl::Status WaitForSends(SendState& state, absl::Time deadline,
                          absl::FunctionRef<void()> force_close,
                          absl::FunctionRef<void()> check_connection) {
  for (;;) {
    const absl::Time next =
        std::min(deadline, absl::Now() + kConnectCheckInterval);
    if (state.WaitUntil(next)) break;
    if (next < deadline) {
      check_connection();
      continue;
    }
    if (state.WaitUntil(absl::Now() + kSettleGrace)) {
      // Sent after all, just late: nothing to close.
      return absl::DeadlineExceededError(
          "sending over the data plane passed the call's deadline");
    }
    force_close();
    if (!state.WaitUntil(absl::Now() + kCloseGrace)) {
      return absl::InternalError(
          "data-plane sends did not complete after closing their connection");
    }
    return absl::DeadlineExceededError(
        "sending over the data plane passed the call's deadline");
  }
  return state.Status();
}

// A CancelToken callback, removed when the wait that added it ends.
class CancelHook {
 public:
  CancelHook(CancelToken* token, absl::AnyInvocable<void()> fn)
      : token_(token),
        id_(token == nullptr ? 0 : token->AddCallback(std::move(fn))) {}
  ~CancelHook() {
    if (token_ != nullptr) token_->RemoveCallback(id_);
  }
  CancelHook(const CancelHook&) = delete;
  CancelHook& operator=(const CancelHook&) = delete;

 private:
  CancelToken* token_;
  uint64_t id_;
};

}  // namespace

struct ClientPlane::Connection {
  uint64_t id = 0;
  std::string address;   // the connection's key
  std::string listener;  // for messages
  std::unique_ptr<Endpoint> ep;
  // Whether the endpoint has peer failure handling. Without it (UCX 1.13's
  // shared-memory transports) closing the connection does not stop the
  // node's puts into a read's region.
  bool peer_errors = true;
  bool described = false;  // lanes printed (KVCACHE_UCX_DEBUG)
  // Whether a transfer on it has completed (a read ended OK, a block was
  // sent). A connection that fails before that carried no byte of any
  // call to its end: its calls may be tried again on a new connection
  // (IsFreshConnectionReset).
  bool used = false;
  // Whether UCX has connected it: set by a flush issued when it was made,
  // whose callback shares the flag (a forced close may run that callback
  // while the connection is being destroyed). One still not established
  // kConnectTimeout after `created` is closed as UNAVAILABLE
  // (CloseIfNotConnected): a data-plane address that swallows connections
  // (a firewall, a wrong address) must fail calls early enough for kAuto
  // to use gRPC, not at their deadline.
  std::shared_ptr<bool> established = std::make_shared<bool>(false);
  absl::Time created;
  // Sends started before it was established: told why, if it never is.
  std::vector<std::weak_ptr<SendState>> early_sends;
  // Reads in progress on this connection, by token.
  absl::flat_hash_map<std::string, std::shared_ptr<ReadState>> reads;
};

struct ClientPlane::ReadState {
  // Set before the read starts, then read-only: where data messages
  // (kAmReadData) may land.
  std::string token;                   // TokenBytes of the read's token
  std::string node_key;                // NodeAddress::key of its node
  std::vector<uint64_t> destinations;  // per block
  uint64_t region_base = 0;
  uint64_t region_size = 0;
  ucp_mem_h memh = nullptr;
  // Loop thread only: data messages that have landed, or are being received
  // into the region; the statuses that wait for more to land, in the order
  // they came (see ReadStatusHeader::data_messages); and the end that waits
  // for receives to finish.
  // Messages are numbered in the node's send order: by their sequence when
  // the read is `sequenced`, else in the order they arrive (which is the
  // send order only while UCX delivers them in order). landed_prefix: how
  // many leading ones have all landed; landed_later: those landed beyond it.
  bool sequenced = false;
  uint32_t messages_arrived = 0;
  absl::flat_hash_set<uint32_t> numbered_in_flight;  // being received
  uint32_t landed_prefix = 0;
  absl::btree_set<uint32_t> landed_later;
  uint32_t receiving = 0;
  std::deque<ReadStatusHeader> waiting_statuses;
  // What the read's last successful status said (AcceptStatus): only one
  // that reports more of the same count of layers is kept, so a read holds
  // at most that count of them (0: none yet).
  uint32_t status_layers = 0;
  uint32_t status_num_layers = 0;
  uint32_t status_messages = 0;
  std::atomic<uint32_t> most_statuses_held{0};  // waiting_statuses' peak
  std::optional<absl::Status> detach_when_received;

  Mutex mu;
  CondVar cv;  // signalled on every change of the state below
  uint32_t layers_done ABSL_GUARDED_BY(mu) = 0;
  bool finished ABSL_GUARDED_BY(mu) = false;  // done, failed, or closed
  bool detached ABSL_GUARDED_BY(mu) = false;  // no longer in a connection
  // Set on the progress thread as the ReadStart goes out. A read abandoned
  // before (SettleOrClose) is detached there and then, and never sent.
  bool started ABSL_GUARDED_BY(mu) = false;
  // Set on the progress thread when sending the ReadStart failed: the node
  // may never have heard of the read (Read::SetOnUnsent).
  bool start_failed ABSL_GUARDED_BY(mu) = false;
  // Closing the connection stops the node's puts (see
  // Connection::peer_errors); set when the read starts on a connection.
  bool close_stops_puts ABSL_GUARDED_BY(mu) = true;
  absl::Status status ABSL_GUARDED_BY(mu);

  void Update(uint32_t layers, bool done, const absl::Status& s) {
    MutexLock lock(&mu);
    if (finished) return;
    if (!s.ok()) {
      status = s;
      finished = true;
    } else {
      layers_done = std::max(layers_done, layers);
      finished = done;
    }
    cv.SignalAll();
  }
  void Detach(const absl::Status& s) {
    MutexLock lock(&mu);
    if (!finished) {
      status = s;
      finished = true;
    }
    detached = true;
    cv.SignalAll();
  }
};

// ---------------------------------------------------------------- setup

ClientPlane::ClientPlane(std::unique_ptr<WorkerLoop> loop)
    : loop_(std::move(loop)) {}

absl::StatusOr<std::unique_ptr<ClientPlane>> ClientPlane::Create() {
  WorkerLoop::Options options;
  options.name = "kvcache-client";
  absl::StatusOr<std::unique_ptr<WorkerLoop>> loop = WorkerLoop::Start(options);
  if (!loop.ok()) return loop.status();
  absl::StatusOr<TcpSegments> segments = ReadTcpSegments((*loop)->context());
  if (!segments.ok()) return segments.status();
  std::unique_ptr<ClientPlane> plane =
      absl::WrapUnique(new ClientPlane(*std::move(loop)));
  plane->tcp_segments_ = *segments;
  if (absl::Status s = plane->InstallHandlers(); !s.ok()) return s;
  return plane;
}

absl::Status ClientPlane::InstallHandlers() {
  auto promise = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> result = promise->get_future();
  bool posted = loop_->Post([this, promise] {
    ucp_am_handler_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                       UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG;
    param.id = kAmReadStatus;
    param.cb = &ClientPlane::OnReadStatus;
    param.arg = this;
    absl::Status status =
        UcxStatus(ucp_worker_set_am_recv_handler(loop_->worker().get(), &param),
                  "ucp_worker_set_am_recv_handler");
    if (status.ok()) {
      param.id = kAmReadData;
      param.cb = &ClientPlane::OnReadData;
      status = UcxStatus(
          ucp_worker_set_am_recv_handler(loop_->worker().get(), &param),
          "ucp_worker_set_am_recv_handler");
    }
    if (status.ok()) {
      absl::StatusOr<std::string> address = loop_->worker().Address();
      if (address.ok()) {
        worker_address_ = *std::move(address);
      } else {
        status = address.status();
      }
    }
    promise->set_value(status);
  });
  if (!posted ||
      result.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    return absl::UnavailableError("UCX progress thread did not start");
  }
  return result.get();
}

ClientPlane::~ClientPlane() {
  loop_->Stop([this] {
    for (auto& [address, conn] : connections_) {
      for (auto& [id, state] : conn->reads) {
        state->Detach(absl::CancelledError("the client is closing"));
      }
    }
    address_by_ep_.clear();
    connections_.clear();
  });
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> ClientPlane::Register(
    void* address, size_t length) {
  return MemoryRegion::Register(loop_->context(), address, length);
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> ClientPlane::Allocate(
    size_t length) {
  return MemoryRegion::Allocate(loop_->context(), length);
}

// ---------------------------------------------------------- connections

absl::StatusOr<ClientPlane::Connection*> ClientPlane::GetConnection(
    const NodeAddress& address) {
  const std::string key = address.key();
  auto it = connections_.find(key);
  if (it != connections_.end()) return it->second.get();
  // Before any byte moves: sizes that would make UCX abort this process or
  // the node keep this node off UCX (the caller may use gRPC instead).
  if (absl::Status fits = CheckTcpSegments(tcp_segments_, address.tcp_segments);
      !fits.ok()) {
    if (refused_segments_.insert(key).second) {
      std::fprintf(stderr, "kvcache client: not using UCX with %s: %s\n",
                   address.name().c_str(), std::string(fits.message()).c_str());
    }
    return fits;
  }
  bool peer_errors = true;
  absl::StatusOr<std::unique_ptr<Endpoint>> ep =
      address.worker.empty()
          ? Endpoint::Connect(loop_->worker(), address.listener,
                              &ClientPlane::OnEndpointError, this)
          : Endpoint::ConnectToWorker(loop_->worker(), address.worker,
                                      &ClientPlane::OnEndpointError, this,
                                      &peer_errors);
  if (!ep.ok()) return ep.status();
  auto conn = std::make_unique<Connection>();
  conn->id = next_connection_id_++;
  conn->address = key;
  conn->listener = address.name();
  conn->ep = *std::move(ep);
  conn->peer_errors = peer_errors;
  conn->created = absl::Now();
  Connection* raw = conn.get();
  address_by_ep_[raw->ep->get()] = key;
  connections_[key] = std::move(conn);
  // Completes once UCX has connected the endpoint (measured: a flush on an
  // endpoint whose peer never answers stays pending).
  const ucp_ep_h endpoint = raw->ep->get();
  Operation::Start(
      Operation::Kind::kSend,
      [endpoint](const ucp_request_param_t& param, absl::string_view) {
        return ucp_ep_flush_nbx(endpoint, &param);
      },
      [established = raw->established](absl::Status status) {
        // An error: closed, or failing (its error handler closes it).
        if (status.ok()) *established = true;
      });
  return raw;
}

void ClientPlane::CloseIfNotConnected(const std::string& key) {
  auto it = connections_.find(key);
  if (it == connections_.end() || *it->second->established) return;
  Connection& conn = *it->second;
  if (absl::Now() - conn.created < kConnectTimeout) return;
  absl::Status why = absl::UnavailableError(absl::StrCat(
      "the data-plane connection to ", conn.listener,
      " was not established within ", absl::FormatDuration(kConnectTimeout),
      " (a firewall, or an address that does not answer UCX; "
      "docs/operations.md, \"Ports\")"));
  why.SetPayload(kNotConnectedPayload, absl::Cord());
  for (std::weak_ptr<SendState>& weak : conn.early_sends) {
    if (std::shared_ptr<SendState> state = weak.lock()) state->Fail(why);
  }
  CloseConnection(conn.id, why);
}

bool IsDataPlaneNotConnected(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         status.GetPayload(kNotConnectedPayload).has_value();
}

bool IsFreshConnectionReset(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         status.GetPayload(kFreshResetPayload).has_value();
}

void ClientPlane::OnEndpointError(void* arg, ucp_ep_h ep,
                                  ucs_status_t status) noexcept {
  auto* self = static_cast<ClientPlane*>(arg);
  auto it = self->address_by_ep_.find(ep);
  if (it == self->address_by_ep_.end()) return;
  auto conn = self->connections_.find(it->second);
  if (conn == self->connections_.end()) return;
  uint64_t id = conn->second->id;
  absl::Status why = UcxStatus(status, "data-plane connection failed");
  if (!conn->second->used) {
    // Seen when a node resumes after a pause: its teardown of the
    // connections force-closed meanwhile resets the TCP connection UCX
    // shares with the new endpoint.
    why = absl::UnavailableError(
        absl::StrCat(why.message(), " before its first transfer completed"));
    why.SetPayload(kFreshResetPayload, absl::Cord());
  }
  // Closing from inside a UCX callback is not allowed: defer it.
  self->loop_->Post([self, id, why] { self->CloseConnection(id, why); });
}

void ClientPlane::CloseConnection(uint64_t conn_id, const absl::Status& why) {
  for (auto it = connections_.begin(); it != connections_.end(); ++it) {
    if (it->second->id != conn_id) continue;
    std::unique_ptr<Connection> conn = std::move(it->second);
    connections_.erase(it);
    address_by_ep_.erase(conn->ep->get());
    conn->ep.reset();  // force close: every operation on it fails now
    for (auto& [token, state] : conn->reads) {
      DetachWhenReceived(state, why);
      loop_->AddBusy(-1);
      read_connection_.erase(token);
    }
    return;
  }
}

void ClientPlane::MarkUsed(const std::string& address) {
  auto it = connections_.find(address);
  if (it != connections_.end()) it->second->used = true;
}

void ClientPlane::DescribeOnce(const std::string& address) {
  static const bool debug = std::getenv("KVCACHE_UCX_DEBUG") != nullptr;
  if (!debug) return;
  auto it = connections_.find(address);
  if (it == connections_.end() || it->second->described) return;
  it->second->described = true;
  std::fprintf(stderr, "kvcache client: data-plane lanes to %s:\n",
               it->second->listener.c_str());
  ucp_ep_print_info(it->second->ep->get(), stderr);
}

void ClientPlane::ForceCloseAddress(const std::string& address) {
  auto it = connections_.find(address);
  if (it == connections_.end()) return;
  // The operation that closed it reports its own status; the others may
  // simply be tried again on a new connection.
  CloseConnection(it->second->id,
                  absl::UnavailableError(
                      "another data-plane operation on this connection "
                      "passed its deadline or was abandoned; the connection "
                      "was closed"));
}

// ----------------------------------------------------------------- write

absl::Status ClientPlane::SendBlocks(const NodeAddress& address,
                                     uint64_t write_id, const Token& token,
                                     absl::Span<const Block> blocks,
                                     absl::Time deadline) {
  if (blocks.empty()) return absl::OkStatus();
  auto state = std::make_shared<SendState>(blocks.size());
  std::vector<Block> copy(blocks.begin(), blocks.end());
  bool posted = loop_->Post(
      [this, address, write_id, token, state, copy = std::move(copy)] {
        absl::StatusOr<Connection*> conn = GetConnection(address);
        if (!conn.ok()) {
          state->Complete(copy.size(), conn.status());
          return;
        }
        if (!*(*conn)->established) (*conn)->early_sends.push_back(state);
        const ucp_ep_h ep = (*conn)->ep->get();
        for (const Block& block : copy) {
          WriteBlockHeader h;
          h.write_id = write_id;
          h.token = token;
          h.index = block.index;
          h.length = block.bytes.size();
          const uint8_t* data = block.bytes.data();
          const size_t length = block.bytes.size();
          const ucp_mem_h memh = block.memh;
          loop_->AddBusy(1);
          Operation::Start(
              Operation::Kind::kSend,
              [ep, data, length, memh](const ucp_request_param_t& param,
                                       absl::string_view header) {
                ucp_request_param_t p = param;
                p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
                p.flags = UCP_AM_SEND_FLAG_REPLY;
                if (memh != nullptr) {
                  p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
                  p.memh = memh;
                }
                if (length >= kRendezvousBytes)
                  p.flags |= UCP_AM_SEND_FLAG_RNDV;
                return ucp_am_send_nbx(ep, kAmWriteBlock, header.data(),
                                       header.size(), data, length, &p);
              },
              [this, state, key = address.key()](absl::Status status) {
                loop_->AddBusy(-1);
                if (status.ok()) {
                  MarkUsed(key);
                  DescribeOnce(key);
                }
                state->Complete(1, status);
              },
              Encode(h));
        }
      });
  if (!posted) return absl::UnavailableError("the client is closing");
  const std::string key = address.key();
  return WaitForSends(
      *state, deadline,
      [this, &key] { loop_->Post([this, key] { ForceCloseAddress(key); }); },
      [this, &key] { loop_->Post([this, key] { CloseIfNotConnected(key); }); });
}

absl::Status ClientPlane::PullBlocks(const NodeAddress& address,
                                     uint64_t write_id, const Token& token,
                                     const MemoryRegion& region,
                                     uint64_t buffer_id,
                                     absl::Span<const PullBlock> blocks,
                                     absl::Time deadline) {
  if (blocks.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> rkey = region.PackRemoteKey();
  if (!rkey.ok()) return rkey.status();
  WritePullHeader h;
  h.write_id = write_id;
  h.token = token;
  h.buffer_id = buffer_id;
  h.region_base = reinterpret_cast<uint64_t>(region.data());
  h.region_length = region.size();
  WritePullBody body;
  body.remote_key = *rkey;
  for (const PullBlock& b : blocks) body.blocks.push_back({b.index, b.address});
  body.client_address = worker_address_;
  // Kept by the operation until it completes.
  Message message = EncodeWritePull(h, body);
  auto state = std::make_shared<SendState>(1);
  bool posted =
      loop_->Post([this, address, state, header_size = message.header_bytes,
                   keep = std::move(message.bytes)]() mutable {
        absl::StatusOr<Connection*> conn = GetConnection(address);
        if (!conn.ok()) {
          state->Complete(1, conn.status());
          return;
        }
        if (!*(*conn)->established) (*conn)->early_sends.push_back(state);
        loop_->AddBusy(1);
        SendEagerAm((*conn)->ep->get(), kAmWritePull, std::move(keep),
                    header_size, [this, state](absl::Status status) {
                      loop_->AddBusy(-1);
                      state->Complete(1, status);
                    });
      });
  if (!posted) return absl::UnavailableError("the client is closing");
  const std::string key = address.key();
  return WaitForSends(
      *state, deadline,
      [this, &key] { loop_->Post([this, key] { ForceCloseAddress(key); }); },
      [this, &key] { loop_->Post([this, key] { CloseIfNotConnected(key); }); });
}

// ------------------------------------------------------------------ read

absl::StatusOr<std::unique_ptr<ClientPlane::Read>> ClientPlane::StartRead(
    const NodeAddress& address, uint64_t read_id, const Token& token,
    std::shared_ptr<MemoryRegion> region,
    const std::vector<uint64_t>& destinations, uint32_t num_layers,
    bool per_layer, uint64_t buffer_id, NamedRegion named) {
  absl::StatusOr<std::string> rkey = region->PackRemoteKey();
  if (!rkey.ok()) return rkey.status();
  std::string named_rkey;
  // Not to a node that said it does not map this client's buffers (tcp,
  // RDMA): it would keep a key it never uses, and the read would carry it.
  const bool names = address.keeps_named_buffers && named.buffer_id != 0 &&
                     named.buffer_id != buffer_id && named.region != nullptr &&
                     MapsDestinations(address.key()).value_or(true);
  if (names) {
    absl::StatusOr<std::string> packed = named.region->PackRemoteKey();
    if (!packed.ok()) return packed.status();
    named_rkey = *std::move(packed);
  }
  ReadStartHeader h;
  h.read_id = read_id;
  h.token = token;
  const bool sequenced = address.message_reads && address.sequenced_data;
  h.flags = (per_layer ? kReadFlagPerLayer : 0) |
            (address.bounded_reads ? kReadFlagBounded : 0) |
            (address.message_reads ? kReadFlagMessages : 0) |
            (sequenced ? kReadFlagSequenced : 0) |
            (LearnsMapping(address, buffer_id) ? kReadFlagReportMapped : 0) |
            (names ? kReadFlagNamesBuffer : 0);
  h.buffer_id = buffer_id;
  ReadStartBody body;
  body.remote_key = *rkey;
  body.destinations = destinations;
  body.client_address = worker_address_;
  body.region_base = reinterpret_cast<uint64_t>(region->data());
  body.region_length = region->size();
  if (names) {
    body.named.buffer_id = named.buffer_id;
    body.named.base = reinterpret_cast<uint64_t>(named.region->data());
    body.named.length = named.region->size();
    body.named.remote_key = named_rkey;
  }
  // Kept by the operation until it completes.
  Message message = EncodeReadStart(h, body);
  auto state = std::make_shared<ReadState>();
  state->destinations = destinations;
  state->region_base = reinterpret_cast<uint64_t>(region->data());
  state->region_size = region->size();
  state->memh = region->memh();
  state->sequenced = sequenced;
  state->node_key = address.key();
  if (!address.decodes_into_destination) {
    // A node that no longer says (another build at the same address) is
    // not asked to decode on an earlier one's word.
    MutexLock lock(&maps_mu_);
    maps_destinations_.erase(state->node_key);
  }
  std::string token_bytes = TokenBytes(token);
  state->token = token_bytes;
  bool posted = loop_->Post([this, address, token_bytes, state,
                             header_size = message.header_bytes,
                             keep = std::move(message.bytes)]() mutable {
    {
      MutexLock lock(&state->mu);
      if (state->detached) return;  // abandoned: no connection opened for it
    }
    absl::StatusOr<Connection*> conn = GetConnection(address);
    if (!conn.ok()) {
      state->Detach(conn.status());
      return;
    }
    {
      MutexLock lock(&state->mu);
      if (state->detached) return;  // abandoned before it started
      state->started = true;
      state->close_stops_puts = (*conn)->peer_errors;
    }
    (*conn)->reads[token_bytes] = state;
    read_connection_[token_bytes] = address.key();
    loop_->AddBusy(1);  // until the read ends: the node's puts need progress
    SendEagerAm((*conn)->ep->get(), kAmReadStart, std::move(keep), header_size,
                [this, token_bytes, state](absl::Status status) {
                  if (status.ok()) return;
                  {
                    MutexLock lock(&state->mu);
                    state->start_failed = true;
                  }
                  EndRead(token_bytes, 0, status);
                });
  });
  if (!posted) return absl::UnavailableError("the client is closing");
  return absl::WrapUnique(new Read(this, address.key(), std::move(state),
                                   std::move(region), num_layers));
}

bool ClientPlane::PostForTest(absl::AnyInvocable<void()> task) {
  return loop_->Post(std::move(task));
}

void ClientPlane::ReleaseBuffer(uint64_t buffer_id) {
  ReleaseBufferHeader h;
  h.buffer_id = buffer_id;
  loop_->Post([this, header = Encode(h)]() mutable {
    for (auto& [key, conn] : connections_) {
      loop_->AddBusy(1);
      SendEagerAm(conn->ep->get(), kAmReleaseBuffer, header, header.size(),
                  [this](absl::Status) { loop_->AddBusy(-1); });
    }
  });
}

std::shared_ptr<ClientPlane::ReadState> ClientPlane::FindRead(
    const std::string& token) {
  auto by_token = read_connection_.find(token);
  if (by_token == read_connection_.end()) return nullptr;
  auto conn = connections_.find(by_token->second);
  if (conn == connections_.end()) return nullptr;
  auto it = conn->second->reads.find(token);
  if (it == conn->second->reads.end()) return nullptr;
  return it->second;
}

ucs_status_t ClientPlane::OnReadStatus(
    void* arg, const void* header, size_t header_length, void* data,
    size_t length, const ucp_am_recv_param_t* param) noexcept {
  auto* self = static_cast<ClientPlane*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;
  absl::StatusOr<ReadStatusHeader> h = DecodeReadStatus(
      absl::string_view(static_cast<const char*>(header), header_length));
  if (!h.ok()) return UCS_OK;
  // The token names the read (read ids are only unique per node).
  const std::string token = TokenBytes(h->token);
  std::shared_ptr<ReadState> state = self->FindRead(token);
  if (state == nullptr) return UCS_OK;
  const absl::string_view message(static_cast<const char*>(data), length);
  if (h->code == 0 && h->has_delivery) {
    MutexLock lock(&self->maps_mu_);
    self->maps_destinations_[state->node_key] = h->mapped;
  }
  if (h->code == 0) {
    absl::StatusOr<bool> news = AcceptStatus(*state, *h);
    if (!news.ok()) {
      self->EndRead(token, 0, news.status());
      return UCS_OK;
    }
    if (!*news) return UCS_OK;  // it says nothing the read has not heard
  }
  if (h->code == 0 && h->has_data_messages &&
      (state->landed_prefix < h->data_messages ||
       !state->waiting_statuses.empty())) {
    // Layers whose data is still landing: applied by DataLanded, in order.
    state->waiting_statuses.push_back(*h);
    const uint32_t held = static_cast<uint32_t>(state->waiting_statuses.size());
    if (held > state->most_statuses_held.load(std::memory_order_relaxed)) {
      state->most_statuses_held.store(held, std::memory_order_relaxed);
    }
    return UCS_OK;
  }
  absl::Status status;
  if (h->code != 0) {
    status = absl::Status(static_cast<absl::StatusCode>(h->code), message);
  }
  if (!status.ok() || h->layers_done >= h->num_layers) {
    self->EndRead(token, h->layers_done, status);
  } else {
    state->Update(h->layers_done, false, status);
  }
  return UCS_OK;
}

ucs_status_t ClientPlane::OnReadData(
    void* arg, const void* header, size_t header_length, void* data,
    size_t length, const ucp_am_recv_param_t* param) noexcept {
  auto* self = static_cast<ClientPlane*>(arg);
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // A rendezvous piece that is not received is dropped by returning from
  // this callback (not by ucp_am_data_release, which UCX 1.13 does not
  // allow here); an error status fails the node's send.
  auto drop = [rendezvous](ucs_status_t why) {
    return rendezvous ? why : UCS_OK;
  };
  absl::StatusOr<ReadDataHeader> h = DecodeReadData(
      absl::string_view(static_cast<const char*>(header), header_length));
  if (!h.ok()) return drop(UCS_ERR_INVALID_PARAM);
  const std::string token = TokenBytes(h->token);
  std::shared_ptr<ReadState> state = self->FindRead(token);
  if (state == nullptr) return drop(UCS_OK);  // a read that has ended
  // The node names a block and an offset; the bytes must fall inside the
  // region this read registered.
  uint64_t at = 0;
  if (h->block >= state->destinations.size() ||
      __builtin_add_overflow(state->destinations[h->block], h->offset, &at) ||
      !RegionContains(state->region_base, state->region_size, at, length)) {
    self->EndRead(token, 0,
                  absl::InternalError(
                      absl::StrCat("the node sent ", length, " bytes of block ",
                                   h->block, " at offset ", h->offset,
                                   ", outside the read's destination region")));
    return drop(UCS_ERR_INVALID_PARAM);
  }
  void* destination = reinterpret_cast<void*>(at);
  absl::StatusOr<uint32_t> numbered = self->NumberDataMessage(*state, *h);
  if (!numbered.ok()) {
    self->EndRead(token, 0, numbered.status());
    return drop(UCS_ERR_INVALID_PARAM);
  }
  const uint32_t index = *numbered;
  if (!rendezvous) {
    std::memcpy(destination, data, length);
    self->DataLanded(state, index, absl::OkStatus());
    return UCS_OK;
  }
  ++state->receiving;
  state->numbered_in_flight.insert(index);
  self->loop_->AddBusy(1);
  Operation::Start(
      Operation::Kind::kRecvAm,
      [worker = self->loop_->worker().get(), data, destination, length,
       memh = state->memh](const ucp_request_param_t& param,
                           absl::string_view) {
        ucp_request_param_t p = param;
        if (memh != nullptr) {
          p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
          p.memh = memh;
        }
        return ucp_am_recv_data_nbx(worker, data, destination, length, &p);
      },
      [self, state, index](absl::Status status) {
        self->loop_->AddBusy(-1);
        --state->receiving;
        state->numbered_in_flight.erase(index);
        self->DataLanded(state, index, status);
      });
  return UCS_OK;
}

absl::StatusOr<bool> ClientPlane::AcceptStatus(ReadState& state,
                                               const ReadStatusHeader& h) {
  if (h.layers_done > h.num_layers ||
      (state.status_num_layers != 0 &&
       h.num_layers != state.status_num_layers)) {
    return absl::InternalError(absl::StrCat(
        "the node sent a status for ", h.layers_done, " of ", h.num_layers,
        " layers to a read of ",
        state.status_num_layers != 0 ? state.status_num_layers : h.num_layers,
        " layers"));
  }
  // Statuses sent after flushes (puts) can complete out of order: one that
  // reports no more layers than an earlier one is already covered by it.
  if (h.layers_done <= state.status_layers) return false;
  if (h.has_data_messages && h.data_messages < state.status_messages) {
    return absl::InternalError(absl::StrCat(
        "the node sent a status for ", h.layers_done, " layers after ",
        h.data_messages, " data messages, following one after ",
        state.status_messages));
  }
  state.status_layers = h.layers_done;
  state.status_num_layers = h.num_layers;
  if (h.has_data_messages) state.status_messages = h.data_messages;
  return true;
}

absl::StatusOr<uint32_t> ClientPlane::NumberDataMessage(
    ReadState& state, const ReadDataHeader& h) {
  if (!state.sequenced) return state.messages_arrived++;
  if (!h.has_sequence) {
    return absl::InternalError(
        "the node sent a data message without its sequence number to a read "
        "that asked for them");
  }
  if (h.sequence < state.landed_prefix ||
      state.landed_later.contains(h.sequence) ||
      state.numbered_in_flight.contains(h.sequence)) {
    return absl::InternalError(absl::StrCat("the node sent data message ",
                                            h.sequence, " of the read twice"));
  }
  return h.sequence;
}

void ClientPlane::DataLanded(const std::shared_ptr<ReadState>& state,
                             uint32_t index, const absl::Status& status) {
  if (state->detach_when_received.has_value()) {
    if (state->receiving == 0) state->Detach(*state->detach_when_received);
    return;
  }
  if (!status.ok()) {
    EndRead(state->token, 0, status);
    return;
  }
  if (index == state->landed_prefix) {
    ++state->landed_prefix;
    while (!state->landed_later.empty() &&
           *state->landed_later.begin() == state->landed_prefix) {
      state->landed_later.erase(state->landed_later.begin());
      ++state->landed_prefix;
    }
  } else {
    state->landed_later.insert(index);
  }
  while (!state->waiting_statuses.empty() &&
         state->landed_prefix >=
             state->waiting_statuses.front().data_messages) {
    const ReadStatusHeader h = state->waiting_statuses.front();
    state->waiting_statuses.pop_front();
    if (h.layers_done >= h.num_layers) {
      EndRead(state->token, h.layers_done, absl::OkStatus());
      return;  // the read is over
    }
    state->Update(h.layers_done, false, absl::OkStatus());
  }
}

void ClientPlane::DetachWhenReceived(const std::shared_ptr<ReadState>& state,
                                     const absl::Status& why) {
  if (state->receiving == 0) {
    state->Detach(why);
    return;
  }
  // The receives end when their data lands or their connection fails.
  state->detach_when_received = why;
}

void ClientPlane::EndRead(const std::string& token, uint32_t layers_done,
                          const absl::Status& status) {
  auto by_token = read_connection_.find(token);
  if (by_token == read_connection_.end()) return;
  auto conn = connections_.find(by_token->second);
  read_connection_.erase(by_token);
  if (conn == connections_.end()) return;
  if (status.ok()) conn->second->used = true;
  auto it = conn->second->reads.find(token);
  if (it == conn->second->reads.end()) return;
  std::shared_ptr<ReadState> state = std::move(it->second);
  conn->second->reads.erase(it);
  loop_->AddBusy(-1);
  state->Update(layers_done, /*done=*/true, status);
  DetachWhenReceived(state, status);
}

bool ClientPlane::LearnsMapping(const NodeAddress& address,
                                uint64_t buffer_id) {
  return address.decodes_into_destination && buffer_id != 0;
}

std::optional<bool> ClientPlane::MapsDestinations(
    const std::string& node_key) const {
  MutexLock lock(&maps_mu_);
  auto it = maps_destinations_.find(node_key);
  if (it == maps_destinations_.end()) return std::nullopt;
  return it->second;
}

ClientPlane::Read::~Read() {
  SettleOrClose().IgnoreError();
  if (on_unsent_ == nullptr) return;
  bool reached_node;
  {
    // `started` is final here: SettleOrClose has detached a read that had
    // not started, and the progress thread starts no detached read. A send
    // failure is known unless closing the connection cut the send short
    // after the read detached: then the lease runs to its TTL.
    MutexLock lock(&state_->mu);
    reached_node = state_->started && !state_->start_failed;
  }
  if (!reached_node) on_unsent_();
}

uint32_t ClientPlane::Read::most_statuses_held() const {
  return state_->most_statuses_held.load(std::memory_order_relaxed);
}

absl::Status ClientPlane::Read::SettleOrClose() {
  ReadState* s = state_.get();
  {
    MutexLock lock(&s->mu);
    if (s->detached) return absl::OkStatus();
    if (!s->started) {
      // Still queued for the progress thread, which sends nothing of a
      // detached read: whatever the connection, no put will come.
      if (!s->finished) {
        s->status = absl::CancelledError(
            "the data-plane read was abandoned before it started");
        s->finished = true;
      }
      s->detached = true;
      s->cv.SignalAll();
      return absl::OkStatus();
    }
    // Let the read end on its own first, so that no put lands after the
    // region goes without closing the connection other calls share:
    // briefly where closing stops the node's puts, longer where it does not
    // (shared memory).
    s->cv.WaitFor(&s->mu, s->close_stops_puts ? kSettleGrace : kAbandonGrace,
                  [s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
                    return s->finished || s->detached;
                  });
    if (s->finished) {
      // Ended: detached at once, or once the data messages still being
      // received into the region have landed (bounded; then closing fails
      // them).
      s->cv.WaitFor(
          &s->mu, kCloseGrace,
          [s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->detached; });
    }
    if (s->detached) return absl::OkStatus();
  }
  // The node may still be putting into the region: close the connection
  // (no more puts land where closing stops them) before the region goes.
  return CloseAndWaitDetached();
}

absl::Status ClientPlane::Read::CloseAndWaitDetached() {
  ClientPlane* plane = plane_;
  std::string address = address_;
  plane->loop_->Post([plane, address] { plane->ForceCloseAddress(address); });
  ReadState* s = state_.get();
  MutexLock lock(&s->mu);
  // Bounded: the close detaches every read of the connection.
  s->cv.WaitFor(
      &s->mu, kCloseGrace,
      [s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->detached; });
  if (!s->detached) {
    return absl::InternalError(
        "a data-plane read did not end after closing its connection");
  }
  return absl::OkStatus();
}

absl::Status ClientPlane::Read::WaitLayers(uint32_t layers, absl::Time deadline,
                                           CancelToken* cancel) {
  if (cancel == nullptr) return WaitLayersUntil(layers, deadline, nullptr);
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  // The hook may run after this wait ended (on the cancelling thread): it
  // holds what it touches.
  CancelHook hook(cancel, [cancelled, state = state_] {
    MutexLock lock(&state->mu);
    cancelled->store(true);
    state->cv.SignalAll();
  });
  return WaitLayersUntil(layers, deadline, cancelled.get());
}

absl::Status ClientPlane::Read::WaitLayersUntil(
    uint32_t layers, absl::Time deadline, const std::atomic<bool>* cancelled) {
  ReadState* s = state_.get();
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
    return s->finished || s->layers_done >= layers ||
           (cancelled != nullptr && cancelled->load());
  };
  // Meanwhile, a connection that never comes up is closed as UNAVAILABLE
  // (ClientPlane::CloseIfNotConnected), which ends the read.
  bool waited = false;
  bool close = false;
  {
    MutexLock lock(&s->mu);
    for (;;) {
      const absl::Time next =
          std::min(deadline, absl::Now() + kConnectCheckInterval);
      waited = s->cv.WaitUntil(&s->mu, next, ready);
      if (waited || next >= deadline) break;
      s->mu.Unlock();
      plane_->loop_->Post([plane = plane_, key = address_] {
        plane->CloseIfNotConnected(key);
      });
      s->mu.Lock();
    }
    if (waited) {
      if (!s->status.ok()) return s->status;
      if (s->layers_done >= layers) return absl::OkStatus();
    }
    close = s->close_stops_puts;
  }
  if (!waited) {
    // Where closing stops the node, a read still going after kSettleGrace
    // is closed so the transfer fails; on shared memory the read stays open
    // and the destructor waits for it.
    if (close) {
      if (absl::Status st = SettleOrClose(); !st.ok()) return st;
    }
    return absl::DeadlineExceededError(
        "the data-plane read passed the call's deadline");
  }
  if (cancelled != nullptr && cancelled->load()) {
    return absl::CancelledError(
        "the wait for the data-plane read was cancelled");
  }
  return absl::InternalError("the data-plane read ended early");
}

}  // namespace kvcache::ucx
