#include "service/ucx/data_plane.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/populate.h"
#include "base/stream_copy.h"
#include "kernels/codec.h"
#include "transport/status.h"
// XXH3_state_t on the stack; runtime-dispatched XXH3 (as block_header.cc).
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"
#if defined(__x86_64__)
#include "xxh_x86dispatch.h"
#endif

namespace kvcache::ucx {
namespace {

// Long-lived client buffer keys kept per connection (ReadStartHeader).
constexpr size_t kMaxBufferKeys = 64;

// How much of a read may be in flight at once (StartPuts): slices (layers)
// are posted while fewer than kMinSlicesInFlight of them, or fewer than
// kBytesInFlight bytes of them, are unfinished. Two slices keep the
// connection busy while one completes; the bytes bound keeps small slices
// from paying a round trip each.
constexpr uint32_t kMinSlicesInFlight = 2;
constexpr uint64_t kBytesInFlight = 8ull << 20;
// Where the node copies a read into the client's mapped memory itself
// (CopySlice), the bytes one pool task copies.
constexpr uint64_t kCopyTaskBytes = 4ull << 20;
// A copy that checks what it copies goes in chunks this size: each chunk's
// source is hashed right after its copy, while it is still in the cache.
constexpr uint64_t kCheckChunkBytes = 64ull << 10;
// Where the node checks a read's slices before it sends them
// (CheckThenPost), how many slices past those posted it checks.
constexpr uint32_t kSlicesCheckedAhead = 2;

// [address, address + length) of the client memory `rkey` covers, as one
// mapping in this process (shared memory); null when it is not one (or
// length is 0).
uint8_t* MappedRange(const RemoteKey& rkey, uint64_t address, uint64_t length) {
  void* first = nullptr;
  void* last = nullptr;
  if (length == 0 || ucp_rkey_ptr(rkey.get(), address, &first) != UCS_OK ||
      ucp_rkey_ptr(rkey.get(), address + length - 1, &last) != UCS_OK ||
      static_cast<uint8_t*>(last) !=
          static_cast<uint8_t*>(first) + length - 1) {
    return nullptr;
  }
  return static_cast<uint8_t*>(first);
}

bool IsWildcardHost(absl::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

absl::string_view HostOf(absl::string_view host_port) {
  size_t colon = host_port.rfind(':');
  return colon == absl::string_view::npos ? host_port
                                          : host_port.substr(0, colon);
}

}  // namespace

// ------------------------------------------------------------ state types

struct DataPlane::Connection {
  uint64_t id = 0;
  std::unique_ptr<Endpoint> ep;
  // A peer that connected to the worker address arrives on an endpoint UCX
  // made for it, which cannot carry RMA; puts and reports then go through
  // an endpoint of the node's own to the client's worker address.
  bool adopted = false;
  std::unique_ptr<Endpoint> put_ep;
  std::string peer;
  absl::Time accepted;
  bool authenticated = false;
  // Remote keys of the client's long-lived buffers (ReadStartHeader::
  // buffer_id, or NamedBuffer::buffer_id of a read that names one), kept
  // for later reads until kAmReleaseBuffer or the end of the connection;
  // at most kMaxBufferKeys.
  struct BufferKey {
    std::string packed;
    std::shared_ptr<RemoteKey> key;
    std::shared_ptr<const BufferPrefault> prefault;  // null: none
  };
  absl::flat_hash_map<uint64_t, BufferKey> buffer_keys;

  // Whether every lane of out() is TCP (unset until a read asks).
  std::optional<bool> tcp_only;

  Endpoint& out() { return put_ep != nullptr ? *put_ep : *ep; }
};

struct DataPlane::WriteSession {
  // kLanded: in staging, or in its pages when received in place (not yet
  // checked); kStaged: encoded into the store's pages (its
  // staging buffer is released).
  enum class Slot { kPresent, kAwaiting, kReceiving, kLanded, kStaged };
  uint64_t id = 0;  // the store's write lease; never changes
  // Moved out only by whoever takes the session out of writes_ (under mu_),
  // so by one party; StageBlock calls use `id` instead.
  store::WriteClaim claim;
  Token token{};
  absl::Time deadline;
  uint64_t block_bytes = 0;
  std::vector<Slot> slots;
  // Per block: received straight into its store pages (InPlaceClaim)
  // rather than into staging.
  std::vector<bool> in_place;
  // Null where present or received in place.
  std::vector<std::shared_ptr<StagingBuffer>> buffers;
  uint32_t awaiting = 0;  // blocks neither present nor landed
  // Receives not completed (rendezvous, and in-place eager ones while
  // their claim is taken).
  uint32_t in_flight = 0;
  uint32_t encoding = 0;  // StageBlock calls not completed
  uint64_t conn_id = 0;   // the connection it is bound to (0: none yet)
  absl::Status error;     // the first bad block or failed receive
  CommitDone waiter;      // set by Commit()
  absl::Time commit_deadline = absl::InfiniteFuture();
};

// How a read decodes the blocks the store left encoded for it
// (ReadBlock::decode_later): every such block has the namespace's policy
// (a block kept fp16 is never left to decode).
struct DataPlane::LayerDecoding {
  kernels::BlockShape layer_shape;  // the namespace's, one layer
  std::vector<kernels::CodecPolicy> layer_policies;
  std::vector<size_t> offsets;  // EncodedLayerOffsets: num_layers + 1
  uint64_t fp16_layer_bytes = 0;
};

// How far the background prefault of the node's mapping of a client's
// buffer has come (PrefaultClientBuffer). `first` and `length` are set
// before the prefault starts; the atomics are written by the prefault
// alone.
struct DataPlane::BufferPrefault {
  uintptr_t first = 0;  // the mapping of [base, base + length)
  uint64_t length = 0;
  std::atomic<uint64_t> reached{0};  // [first, first + reached) is in
  // The prefault is over: the whole mapping is in, or it stopped (the node
  // stops; a kernel without MADV_POPULATE_WRITE) and reads fault as usual.
  std::atomic<bool> ended{false};
};

struct DataPlane::ReadSession {
  enum class State { kWaiting, kTransferring, kDone };
  uint64_t id = 0;  // the store's read lease; never changes
  // While kWaiting, taken by whoever takes the session out of reads_ (under
  // mu_); from kTransferring on, the loop thread's alone.
  store::ReadClaim claim;
  Token token{};
  absl::Time deadline;
  // Pool tasks read the blocks; DecodeThenSend's tasks also write the
  // copies (`data`) of the blocks they decode, until the last reports.
  store::ReadResult result;
  std::vector<std::vector<uint64_t>> layer_ends;  // per block
  uint32_t num_layers = 0;  // slices reported in per-layer mode
  StagingReservation reservation;
  State state = State::kWaiting;  // guarded by DataPlane::mu_
  uint64_t conn_id = 0;           // guarded by DataPlane::mu_
  // Loop thread only, while transferring.
  std::shared_ptr<RemoteKey> rkey;
  // How the blocks go (StartPuts): to one address per block, over the
  // connection send_conn, slice by slice (PostNextSlices).
  uint64_t send_conn = 0;
  std::vector<uint64_t> remote;
  bool by_messages = false;
  // Per layer: slice l is layer l of every block, and each is reported.
  // Whole blocks: slice b is block b, and the read is reported once, whole.
  bool per_layer = false;
  uint32_t slices = 1;  // per layer: num_layers; else one per block
  uint32_t slices_posted = 0;
  std::vector<uint32_t> slice_sends;  // per slice: its sends in flight
  std::vector<uint64_t> slice_bytes;  // per slice: the bytes it sends
  uint32_t slices_in_flight = 0;      // posted, with sends in flight
  uint64_t bytes_in_flight = 0;       // theirs
  uint32_t outstanding = 0;  // puts, flushes and status sends in flight
  uint32_t layers_done = 0;
  uint32_t data_messages = 0;  // kAmReadData messages issued
  bool sequenced = false;      // numbered for the client (kReadFlagSequenced)
  // Where the node maps every destination (shared memory): each block's
  // destination in this process, which the worker pool copies or decodes
  // into (CopySlice) instead of UCX puts on the loop thread; empty
  // otherwise.
  std::vector<uint8_t*> mapped;
  // The prefault of the buffer `mapped` lies in, while it was under way
  // at ReadStart (copy tasks then PopulateAhead); else null.
  std::shared_ptr<const BufferPrefault> prefault;
  std::vector<bool> slice_copied;  // per slice, once its copies are done
  uint32_t slices_reported = 0;    // statuses sent, in slice order
  // Blocks handed over unchecked (ReadBlock::unchecked_layer_sums) are
  // checked by the copy tasks (check_in_copies) or by pool tasks before
  // their slices are posted (CheckThenPost): slice by slice
  // (check_by_slice; the checks of slices below slices_check_started have
  // started) or whole blocks, counted against slice 0. slice_checks_left[s]
  // tasks still run for slice s; the slices below slices_checked are
  // checked and may be posted.
  bool check_in_copies = false;
  bool check_by_slice = false;
  std::vector<uint32_t> slice_checks_left;
  uint32_t slices_checked = 0;
  uint32_t slices_check_started = 0;
  // Asked with kReadFlagReportMapped: every status says whether `mapped`.
  bool report_mapped = false;
  // Blocks the store left encoded for this read to decode
  // (ReadBlock::decode_later): how, set at ReadStart; pool tasks read it.
  std::shared_ptr<const LayerDecoding> decoding;
  // Where the destination is not mapped, those blocks are decoded into
  // copies first (DecodeThenSend): the tasks still running, and the
  // copies' staging.
  uint32_t decodes_left = 0;
  StagingReservation decode_reservation;
  // Set when the read ends (FinishRead); pool threads read it (they hold
  // the session): copies not yet begun are skipped.
  std::atomic<bool> stop_copies{false};
  absl::Status error;
  bool finished = false;
};

// ------------------------------------------------------------- lifecycle

DataPlane::DataPlane(DataPlaneOptions options, store::Store* store,
                     Executor executor, Executor background,
                     TransferObserver observer,
                     std::shared_ptr<StagingBudget> budget)
    : options_(std::move(options)),
      store_(store),
      executor_(std::move(executor)),
      background_(std::move(background)),
      observer_(std::move(observer)),
      budget_(budget != nullptr
                  ? std::move(budget)
                  : std::make_shared<StagingBudget>(options_.staging_bytes)) {}

absl::StatusOr<std::string> TransportsWithoutTcp(absl::string_view ucx_tls) {
  ucx_tls = absl::StripAsciiWhitespace(ucx_tls);
  if (ucx_tls.empty()) return std::string("^tcp");
  const bool exclusion = absl::ConsumePrefix(&ucx_tls, "^");
  bool names_tcp = false;
  bool names_all = false;
  for (absl::string_view name : absl::StrSplit(ucx_tls, ',')) {
    name = absl::StripAsciiWhitespace(name);
    names_tcp = names_tcp || absl::EqualsIgnoreCase(name, "tcp");
    names_all = names_all || absl::EqualsIgnoreCase(name, "all");
  }
  if (exclusion) {
    return absl::StrCat("^", ucx_tls, names_tcp ? "" : ",tcp");
  }
  if (names_tcp || names_all) {
    return absl::FailedPreconditionError(absl::StrCat(
        "UCX_TLS=", ucx_tls,
        " lets UCX use TCP, whose transport in UCX 1.13 checks no remote "
        "keys and aborts on malformed headers (any peer that reaches its "
        "ports can crash the node or write into its memory): leave tcp out, "
        "or pass --ucx-tcp-trusted-network=true where only trusted peers "
        "reach the node (docs/operations.md, \"Security\")"));
  }
  return std::string(ucx_tls);
}

absl::StatusOr<std::unique_ptr<DataPlane>> DataPlane::Start(
    DataPlaneOptions options, store::Store* store, Executor executor,
    Executor background, TransferObserver observer,
    std::shared_ptr<StagingBudget> budget) {
  WorkerLoop::Options loop_options;
  loop_options.name = options.ucx_name;
  loop_options.spin_iterations = options.spin_iterations;
  if (!options.tcp_trusted_network) {
    if (!options.listen.empty()) {
      return absl::InvalidArgumentError(
          "a UCX listener is TCP: --ucx-listen needs "
          "--ucx-tcp-trusted-network=true (trusted networks only)");
    }
    const char* env = std::getenv("UCX_TLS");
    absl::StatusOr<std::string> tls =
        TransportsWithoutTcp(env == nullptr ? "" : env);
    if (!tls.ok()) return tls.status();
    loop_options.ucx_settings.push_back({"TLS", *std::move(tls)});
  }
  std::unique_ptr<DataPlane> plane = absl::WrapUnique(new DataPlane(
      std::move(options), store, std::move(executor), std::move(background),
      std::move(observer), std::move(budget)));
  absl::StatusOr<std::unique_ptr<WorkerLoop>> loop =
      WorkerLoop::Start(loop_options);
  if (!loop.ok()) return loop.status();
  plane->loop_ = *std::move(loop);
  absl::StatusOr<TcpSegments> segments =
      ReadTcpSegments(plane->loop_->context());
  if (!segments.ok()) {
    plane->Stop();
    return segments.status();
  }
  if (segments->in_use() && !plane->options_.tcp_trusted_network) {
    plane->Stop();
    return absl::InternalError(
        "UCX kept its TCP transport although UCX_TLS left it out");
  }
  plane->tcp_segments_ = *segments;
  if (absl::Status s = plane->Listen(); !s.ok()) {
    plane->Stop();
    return s;
  }
  return plane;
}

absl::Status DataPlane::Listen() {
  // Handlers and the listener belong to the loop thread: set them up there
  // and wait (bounded) for the outcome.
  auto promise = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> result = promise->get_future();
  bool posted = loop_->Post([this, promise] {
    const ucp_worker_h worker = loop_->worker().get();
    for (auto [id, cb] : {std::pair<unsigned, ucp_am_recv_callback_t>{
                              kAmWriteBlock, &DataPlane::OnWriteBlock},
                          {kAmReadStart, &DataPlane::OnReadStart},
                          {kAmReleaseBuffer, &DataPlane::OnReleaseBuffer},
                          {kAmWritePull, &DataPlane::OnWritePull}}) {
      ucp_am_handler_param_t param;
      std::memset(&param, 0, sizeof(param));
      param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                         UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG;
      param.id = id;
      param.cb = cb;
      param.arg = this;
      if (absl::Status s =
              UcxStatus(ucp_worker_set_am_recv_handler(worker, &param),
                        "ucp_worker_set_am_recv_handler");
          !s.ok()) {
        promise->set_value(s);
        return;
      }
    }
    if (!options_.listen.empty()) {
      absl::StatusOr<std::unique_ptr<Listener>> listener = Listener::Create(
          loop_->worker(), options_.listen, &DataPlane::OnConnRequest, this);
      if (!listener.ok()) {
        promise->set_value(listener.status());
        return;
      }
      listener_ = *std::move(listener);
      port_ = listener_->port();
    }
    absl::StatusOr<std::string> address = loop_->worker().Address();
    if (!address.ok()) {
      promise->set_value(address.status());
      return;
    }
    worker_address_ = *std::move(address);
    promise->set_value(absl::OkStatus());
  });
  if (!posted ||
      result.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    return absl::UnavailableError("UCX progress thread did not start");
  }
  absl::Status status = result.get();
  if (!status.ok()) return status;
  // Without a listener, clients have only the worker's address.
  if (options_.listen.empty()) return absl::OkStatus();
  std::string host = options_.advertise_host.empty()
                         ? std::string(HostOf(options_.listen))
                         : options_.advertise_host;
  address_ = IsWildcardHost(host) ? absl::StrCat(":", port_)
                                  : absl::StrCat(host, ":", port_);
  return absl::OkStatus();
}

DataPlane::~DataPlane() { Stop(); }

void DataPlane::Stop() {
  prefaults_stop_.store(true, std::memory_order_relaxed);
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    draining_ = true;
  }
  if (loop_ != nullptr) {
    loop_->Stop([this] {
      listener_.reset();
      connection_by_ep_.clear();
      connections_.clear();  // force-closes: in-flight operations fail
    });
  }
  // The loop has stopped: nothing will touch a session again but what
  // is already scheduled (commit work owns its session).
  absl::flat_hash_map<uint64_t, std::shared_ptr<WriteSession>> writes;
  absl::flat_hash_map<uint64_t, std::shared_ptr<ReadSession>> reads;
  {
    MutexLock lock(&mu_);
    writes.swap(writes_);
    reads.swap(reads_);
  }
  for (auto& [id, session] : writes) {
    session->claim = store::WriteClaim();  // aborts the store write
    if (session->waiter) {
      CommitDone done = std::move(session->waiter);
      done(absl::UnavailableError("the node's data plane is shutting down"));
    }
  }
  for (auto& [id, session] : reads) {
    // Pool tasks not yet begun skip their copies and checks.
    session->stop_copies.store(true, std::memory_order_relaxed);
    session->claim = store::ReadClaim();
  }
  // loop_ itself lives until the destructor: Post() on it now returns false.
}

void DataPlane::BeginDrain(absl::Time deadline) {
  MutexLock lock(&mu_);
  draining_ = true;
  drain_deadline_ = deadline;
  for (auto& [id, session] : writes_) {
    session->commit_deadline = std::min(session->commit_deadline, deadline);
  }
}

DataPlaneStats DataPlane::Stats() const {
  DataPlaneStats s;
  s.staging_capacity_bytes = budget_->capacity();
  s.staging_used_bytes = budget_->used();
  s.staging_cached_bytes = budget_->cached();
  s.connections = connection_count_.load();
  s.rejected_connections = rejected_connections_.load();
  s.buffer_keys = buffer_key_count_.load();
  s.pulled_blocks = pulled_blocks_.load();
  s.blocks_received_in_place = blocks_received_in_place_.load();
  s.prefaulted_buffer_bytes = prefaulted_buffer_bytes_.load();
  s.buffer_bytes_populated_by_reads = buffer_bytes_populated_by_reads_.load();
  s.message_reads = message_reads_.load();
  s.copied_reads = copied_reads_.load();
  s.blocks_decoded_into_destination = blocks_decoded_into_destination_.load();
  s.blocks_decoded_at_read_start = blocks_decoded_at_read_start_.load();
  s.reads_checked_while_copying = reads_checked_while_copying_.load();
  s.reads_checked_before_sending = reads_checked_before_sending_.load();
  s.read_slices_posted = read_slices_posted_.load();
  MutexLock lock(&mu_);
  s.write_sessions = static_cast<uint32_t>(writes_.size());
  s.read_sessions = static_cast<uint32_t>(reads_.size());
  for (const auto& [id, session] : writes_) {
    s.write_blocks_unlanded += session->awaiting + session->in_flight;
  }
  return s;
}

std::vector<std::vector<uint64_t>> DataPlane::LayerEnds(
    const store::ReadResult& result, store::ReadFormat format) {
  const kernels::BlockShape& shape = result.ns.config.shape;
  std::vector<std::vector<uint64_t>> all;
  for (const store::ReadBlock& block : result.blocks) {
    kernels::CodecPolicy policy = result.ns.config.policy;
    if (block.codec != policy.codec) {
      policy = kernels::CodecPolicy{};  // stored fp16 (KIVI's residual)
    }
    std::vector<uint64_t> ends;
    if (format == store::ReadFormat::kFp16) {
      for (uint32_t l = 1; l <= shape.num_layers; ++l) {
        ends.push_back(result.ns.fp16_block_bytes / shape.num_layers * l);
      }
    } else {
      const std::vector<size_t> offsets =
          kernels::EncodedLayerOffsets(shape, policy);
      ends.assign(offsets.begin() + 1, offsets.end());
    }
    if (ends.empty() || ends.back() != block.answer_size()) {
      ends = {block.answer_size()};  // layers not separable: one slice
    }
    all.push_back(std::move(ends));
  }
  return all;
}

// ---------------------------------------------------------------- writes

absl::StatusOr<Token> DataPlane::OpenWrite(
    store::WriteClaim claim, const store::BeginWriteResult& begin) {
  if (!claim.held() || claim.id() != begin.write_id) {
    return absl::InternalError("the claim is not the write's lease");
  }
  // From here every early return drops the session, and so its claim.
  auto session = std::make_shared<WriteSession>();
  session->id = begin.write_id;
  session->claim = std::move(claim);
  session->deadline = begin.deadline;
  session->block_bytes = begin.fp16_block_bytes;
  absl::StatusOr<Token> token = NewToken();
  if (!token.ok()) return token.status();
  session->token = *token;
  auto in_place = [&begin](size_t i) {
    return i < begin.in_place.size() && begin.in_place[i];
  };
  uint32_t needed = 0;  // blocks received into staging
  for (size_t i = 0; i < begin.present.size(); ++i) {
    needed += begin.present[i] || in_place(i) ? 0 : 1;
  }
  {
    MutexLock lock(&mu_);
    if (draining_) {
      return absl::UnavailableError("the node is draining");
    }
  }
  const uint64_t slot_bytes = StagingBudget::Round(begin.fp16_block_bytes);
  absl::StatusOr<StagingReservation> reservation =
      budget_->TryReserve(needed * slot_bytes);
  if (!reservation.ok()) return reservation.status();
  for (size_t i = 0; i < begin.present.size(); ++i) {
    session->in_place.push_back(in_place(i));
    if (begin.present[i] || in_place(i)) {
      session->slots.push_back(begin.present[i]
                                   ? WriteSession::Slot::kPresent
                                   : WriteSession::Slot::kAwaiting);
      session->buffers.push_back(nullptr);
      session->awaiting += begin.present[i] ? 0 : 1;
      continue;
    }
    absl::StatusOr<std::shared_ptr<StagingBuffer>> buffer =
        StagingBuffer::Allocate(reservation->Split(slot_bytes));
    if (!buffer.ok()) return buffer.status();
    session->slots.push_back(WriteSession::Slot::kAwaiting);
    session->buffers.push_back(*std::move(buffer));
    ++session->awaiting;
  }
  MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the node is draining");
  writes_[session->id] = std::move(session);
  return *token;
}

bool DataPlane::HasWrite(uint64_t write_id) const {
  MutexLock lock(&mu_);
  return writes_.contains(write_id);
}

bool DataPlane::HasRead(uint64_t lease_id) const {
  MutexLock lock(&mu_);
  return reads_.contains(lease_id);
}

bool DataPlane::Commit(uint64_t write_id, absl::Time deadline,
                       CommitDone done) {
  std::function<void()> work;
  {
    MutexLock lock(&mu_);
    auto it = writes_.find(write_id);
    if (it == writes_.end()) return false;
    WriteSession& session = *it->second;
    if (session.waiter) {
      done(absl::FailedPreconditionError(
          "this write is being committed by another call"));
      return true;
    }
    session.waiter = std::move(done);
    session.commit_deadline = std::min(deadline, drain_deadline_);
    work = TakeForCommitLocked(write_id);
  }
  if (work) work();
  return true;
}

std::function<void()> DataPlane::TakeForCommitLocked(uint64_t write_id) {
  auto it = writes_.find(write_id);
  if (it == writes_.end()) return nullptr;
  std::shared_ptr<WriteSession> session = it->second;
  if (!session->waiter) return nullptr;
  // Staging encodes write into the lease's pages: the store refuses to
  // commit or abort until they finish, and so does this.
  if (session->encoding > 0) return nullptr;
  if (session->error.ok() &&
      (session->awaiting > 0 || session->in_flight > 0)) {
    return nullptr;  // not every block has landed yet
  }
  writes_.erase(it);
  if (session->in_flight > 0) receiving_orphans_.push_back(session);
  if (!session->error.ok()) {
    return [session] {
      session->claim = store::WriteClaim();  // aborts the store write
      // Staging returns before the reply, so that a client that sends the
      // batch again at once (a refused pull) finds it free; a receive still
      // in flight keeps its own buffer until it completes.
      for (std::shared_ptr<StagingBuffer>& buffer : session->buffers) {
        buffer.reset();
      }
      CommitDone done = std::move(session->waiter);
      done(session->error);
    };
  }
  // Encoding runs on the worker pool; the task owns the session (and so
  // its staging) and touches nothing else of the data plane.
  return [executor = executor_, session, observer = observer_] {
    executor([session, observer] {
      std::vector<store::Store::Payload> payloads;
      uint64_t bytes = 0;
      for (size_t i = 0; i < session->slots.size(); ++i) {
        if (session->slots[i] == WriteSession::Slot::kStaged) {
          bytes += session->block_bytes;  // encoded already, as it landed
          continue;
        }
        if (session->slots[i] != WriteSession::Slot::kLanded) continue;
        payloads.push_back({static_cast<uint32_t>(i),
                            absl::MakeConstSpan(session->buffers[i]->data(),
                                                session->block_bytes)});
        bytes += session->block_bytes;
      }
      absl::StatusOr<store::CommitResult> result =
          session->claim.Commit(payloads);
      if (result.ok() && observer) observer(/*inbound=*/true, bytes);
      session->buffers.clear();  // staging returns before the reply
      CommitDone done = std::move(session->waiter);
      done(std::move(result));
    });
  };
}

std::function<void()> DataPlane::StageLocked(
    std::shared_ptr<WriteSession> session, uint32_t index,
    const uint8_t* source, std::shared_ptr<RemoteKey> mapping,
    std::shared_ptr<store::InPlaceClaim> in_place) {
  ++session->encoding;
  std::shared_ptr<StagingBuffer> buffer;
  if (source == nullptr && in_place == nullptr) {
    buffer = session->buffers[index];
    source = buffer->data();
  }
  return [this, session = std::move(session), buffer = std::move(buffer),
          mapping = std::move(mapping), in_place = std::move(in_place), source,
          index]() mutable {
    executor_([this, session, buffer = std::move(buffer),
               mapping = std::move(mapping), in_place = std::move(in_place),
               source, index]() mutable {
      // By id (or the block's own claim), not through the write's claim,
      // which whoever takes the session may move meanwhile; the store
      // refuses to end the lease while it runs.
      absl::Status status =
          in_place != nullptr
              ? in_place->Stage()
              : store_->StageBlock(
                    session->id, index,
                    absl::MakeConstSpan(source, session->block_bytes));
      // This task's hold on the staging goes before the commit can
      // answer: a client's next write must find the bytes free.
      buffer.reset();
      // A remote key is destroyed on the loop thread (the worker's); once
      // the loop has stopped nothing else uses the worker, and a refused
      // task drops it here.
      if (mapping != nullptr) loop_->Post([mapping = std::move(mapping)] {});
      std::function<void()> done_work;
      {
        MutexLock lock(&mu_);
        --session->encoding;
        if (status.ok()) {
          session->slots[index] = WriteSession::Slot::kStaged;
          session->buffers[index].reset();  // staging returns early
        } else if (session->error.ok()) {
          session->error = status;
        }
        done_work = TakeForCommitLocked(session->id);
      }
      if (done_work) done_work();
    });
  };
}

store::WriteClaim DataPlane::TakeWrite(uint64_t write_id) {
  std::shared_ptr<WriteSession> session;
  {
    MutexLock lock(&mu_);
    auto it = writes_.find(write_id);
    if (it == writes_.end()) return store::WriteClaim(store_, write_id);
    session = std::move(it->second);
    writes_.erase(it);
    if (session->in_flight > 0) receiving_orphans_.push_back(session);
  }
  store::WriteClaim claim = std::move(session->claim);
  if (session->waiter) {
    CommitDone done = std::move(session->waiter);
    done(absl::AbortedError("the write was aborted"));
  }
  return claim;
}

DataPlane::Connection* DataPlane::SenderOf(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
             ? FindConnection(param->reply_ep)
             : nullptr;
}

bool DataPlane::BindLocked(uint64_t* session_conn, uint64_t conn_id) {
  if (*session_conn == 0) *session_conn = conn_id;
  return *session_conn == conn_id;
}

ucs_status_t DataPlane::OnWriteBlock(
    void* arg, const void* header, size_t header_length, void* data,
    size_t length, const ucp_am_recv_param_t* param) noexcept {
  auto* self = static_cast<DataPlane*>(arg);
  Connection* conn = self->SenderOf(param);
  if (conn == nullptr) return UCS_OK;  // unknown sender: dropped
  self->HandleWriteBlock(
      conn, absl::string_view(static_cast<const char*>(header), header_length),
      data, length, (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
  return UCS_OK;
}

void DataPlane::HandleWriteBlock(Connection* conn, absl::string_view header,
                                 void* data, size_t length, bool rendezvous) {
  absl::StatusOr<WriteBlockHeader> h = DecodeWriteBlock(header);
  if (!h.ok()) {
    CloseConnection(conn->id, "malformed write header");
    return;
  }
  const uint64_t conn_id = conn->id;
  enum class Verdict { kClose, kDrop, kDone, kReceive } verdict;
  std::shared_ptr<WriteSession> session;
  std::shared_ptr<StagingBuffer> buffer;
  std::function<void()> work, stage;
  {
    MutexLock lock(&mu_);
    auto it = writes_.find(h->write_id);
    if (it == writes_.end()) {
      // An expired or finished write: harmless from a connection that has
      // authenticated before, fatal for one that has not.
      verdict = conn->authenticated ? Verdict::kDrop : Verdict::kClose;
    } else if (!TokenEquals(it->second->token, h->token) ||
               !BindLocked(&it->second->conn_id, conn_id)) {
      verdict = Verdict::kClose;  // a wrong token or another's session
    } else {
      conn->authenticated = true;
      WriteSession& s = *it->second;
      absl::Status bad = CheckBlockLocked(s, h->index, h->length, length);
      if (!bad.ok()) {
        if (s.error.ok()) s.error = bad;
        verdict = Verdict::kDone;
      } else if (rendezvous || s.in_place[h->index]) {
        s.slots[h->index] = WriteSession::Slot::kReceiving;
        ++s.in_flight;
        session = it->second;
        buffer = s.buffers[h->index];  // null when received in place
        verdict = Verdict::kReceive;
      } else {
        std::memcpy(s.buffers[h->index]->data(), data, length);
        s.slots[h->index] = WriteSession::Slot::kLanded;
        --s.awaiting;
        stage = StageLocked(it->second, h->index);
        verdict = Verdict::kDone;
      }
      if (verdict == Verdict::kDone) work = TakeForCommitLocked(s.id);
    }
  }
  if (stage) stage();
  if (work) work();
  if (verdict == Verdict::kClose) {
    CloseConnection(conn_id, "write block without a valid token");
  }
  if (verdict == Verdict::kReceive) {
    ReceiveBlock(std::move(session), h->index, std::move(buffer), data, length,
                 rendezvous);
  }
}

absl::Status DataPlane::CheckBlockLocked(const WriteSession& s, uint32_t index,
                                         uint64_t header_length,
                                         size_t length) const {
  if (index >= s.slots.size()) {
    return absl::InvalidArgumentError(absl::StrCat("block index ", index,
                                                   " is outside the write's ",
                                                   s.slots.size(), " blocks"));
  }
  if (s.slots[index] != WriteSession::Slot::kAwaiting) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", index, " is present already or was sent twice"));
  }
  if (length != s.block_bytes || header_length != length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", index, " has ", length,
        " bytes; this layout's fp16 block is ", s.block_bytes, " bytes"));
  }
  return absl::OkStatus();
}

void DataPlane::ReceiveBlock(std::shared_ptr<WriteSession> session,
                             uint32_t index,
                             std::shared_ptr<StagingBuffer> buffer, void* data,
                             size_t length, bool rendezvous) {
  // The destination: the block's own pages, claimed for as long as the
  // receive may write them; else its staging buffer.
  std::shared_ptr<store::InPlaceClaim> claim;
  uint8_t* destination;
  if (session->in_place[index]) {
    absl::StatusOr<store::InPlaceClaim> taken =
        store::InPlaceClaim::Take(store_, session->id, index);
    if (!taken.ok()) {  // the write ended or is being committed
      BlockArrived(session, index, taken.status(), nullptr);
      return;
    }
    claim = std::make_shared<store::InPlaceClaim>(*std::move(taken));
    destination = claim->bytes().data();
    blocks_received_in_place_.fetch_add(1, std::memory_order_relaxed);
  } else {
    destination = buffer->data();
  }
  if (!rendezvous) {  // eager: the bytes are here already
    std::memcpy(destination, data, length);
    BlockArrived(session, index, absl::OkStatus(), std::move(claim));
    return;
  }
  loop_->AddBusy(1);
  ucp_worker_h worker = loop_->worker().get();
  Operation::Start(
      Operation::Kind::kRecvAm,
      [worker, data, destination, length](const ucp_request_param_t& param,
                                          absl::string_view) {
        return ucp_am_recv_data_nbx(worker, data, destination, length, &param);
      },
      [this, session, buffer, claim, index](absl::Status status) mutable {
        loop_->AddBusy(-1);
        buffer.reset();  // the receive's hold on the staging ends here
        BlockArrived(session, index, status, std::move(claim));
      });
}

void DataPlane::BlockArrived(const std::shared_ptr<WriteSession>& session,
                             uint32_t index, const absl::Status& status,
                             std::shared_ptr<store::InPlaceClaim> claim) {
  std::function<void()> done_work, stage;
  {
    MutexLock lock(&mu_);
    --session->in_flight;
    if (status.ok()) {
      session->slots[index] = WriteSession::Slot::kLanded;
      --session->awaiting;
      // A failed write has answered and let its staging go: nothing to
      // encode (and an unstaged claim gives its block up as it goes).
      if (session->error.ok()) {
        stage = StageLocked(session, index, nullptr, nullptr, std::move(claim));
      }
    } else if (session->error.ok()) {
      session->error = absl::UnavailableError(
          absl::StrCat("block ", index, " did not arrive: ", status.message()));
    }
    done_work = TakeForCommitLocked(session->id);
  }
  claim.reset();  // given up, unless staging took it
  if (stage) stage();
  if (done_work) done_work();
}

// ----------------------------------------------------------------- reads

absl::StatusOr<StagingReservation> DataPlane::ReserveStaging(uint64_t bytes) {
  {
    MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("the node is draining");
  }
  return budget_->TryReserve(bytes);
}

absl::StatusOr<Token> DataPlane::OpenRead(
    store::ReadClaim claim, store::ReadResult result,
    std::vector<std::vector<uint64_t>> layer_ends,
    StagingReservation reservation) {
  if (!claim.held() || claim.id() != result.lease_id) {
    return absl::InternalError("the claim is not the read's lease");
  }
  if (layer_ends.size() != result.blocks.size()) {
    return absl::InternalError("layer offsets do not match the blocks");
  }
  absl::StatusOr<Token> token = NewToken();
  if (!token.ok()) return token.status();
  // From here every early return drops the session, and so its claim.
  auto session = std::make_shared<ReadSession>();
  session->id = result.lease_id;
  session->claim = std::move(claim);
  session->token = *token;
  session->deadline = result.deadline;
  session->result = std::move(result);
  session->layer_ends = std::move(layer_ends);
  session->num_layers = 1;
  for (const auto& ends : session->layer_ends) {
    session->num_layers =
        std::max(session->num_layers, static_cast<uint32_t>(ends.size()));
  }
  session->reservation = std::move(reservation);
  MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the node is draining");
  reads_[session->id] = std::move(session);
  return *token;
}

std::optional<store::ReadClaim> DataPlane::EndRead(uint64_t lease_id) {
  std::shared_ptr<ReadSession> dropped;  // freed outside the lock
  MutexLock lock(&mu_);
  auto it = reads_.find(lease_id);
  if (it == reads_.end()) return store::ReadClaim(store_, lease_id);
  if (it->second->state != ReadSession::State::kWaiting) return std::nullopt;
  dropped = std::move(it->second);
  reads_.erase(it);
  return std::move(dropped->claim);
}

ucs_status_t DataPlane::OnReadStart(void* arg, const void* header,
                                    size_t header_length, void* data,
                                    size_t length,
                                    const ucp_am_recv_param_t* param) noexcept {
  return static_cast<DataPlane*>(arg)->PostRequest(
      header, header_length, data, length, param, "oversized read request",
      &DataPlane::HandleReadStart);
}

ucs_status_t DataPlane::OnWritePull(void* arg, const void* header,
                                    size_t header_length, void* data,
                                    size_t length,
                                    const ucp_am_recv_param_t* param) noexcept {
  return static_cast<DataPlane*>(arg)->PostRequest(
      header, header_length, data, length, param, "oversized write pull",
      &DataPlane::HandleWritePull);
}

ucs_status_t DataPlane::PostRequest(const void* header, size_t header_length,
                                    const void* data, size_t length,
                                    const ucp_am_recv_param_t* param,
                                    const char* oversized,
                                    RequestHandler handle) {
  Connection* conn = SenderOf(param);
  if (conn == nullptr) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // A request is a few hundred bytes; a rendezvous one is abuse.
    CloseConnection(conn->id, oversized);
    return UCS_OK;
  }
  // Handled in a task, not inside this callback: the reply endpoint of a
  // peer that connected to the worker address may still be completing its
  // wireup here.
  std::string copy_header(static_cast<const char*>(header), header_length);
  std::string copy_data(static_cast<const char*>(data), length);
  const uint64_t conn_id = conn->id;
  loop_->Post([this, conn_id, handle, h = std::move(copy_header),
               d = std::move(copy_data)] {
    auto it = connections_.find(conn_id);
    if (it == connections_.end()) return;
    (this->*handle)(it->second.get(), h, d);
  });
  return UCS_OK;
}

void DataPlane::HandleWritePull(Connection* conn, absl::string_view header,
                                absl::string_view data) {
  absl::StatusOr<WritePullHeader> h = DecodeWritePull(header);
  if (!h.ok()) {
    CloseConnection(conn->id, "malformed write pull");
    return;
  }
  const uint64_t conn_id = conn->id;
  std::shared_ptr<WriteSession> session;
  bool close = false;
  {
    MutexLock lock(&mu_);
    auto it = writes_.find(h->write_id);
    if (it == writes_.end()) {
      close = !conn->authenticated;  // else an expired write: dropped
    } else if (!TokenEquals(it->second->token, h->token) ||
               !BindLocked(&it->second->conn_id, conn_id)) {
      close = true;
    } else {
      conn->authenticated = true;
      session = it->second;
    }
  }
  if (close) {
    CloseConnection(conn_id, "write pull without a valid token");
    return;
  }
  if (session == nullptr) return;
  // From here on a failure fails the write; its commit answers with it.
  auto fail = [&](absl::Status status) {
    std::function<void()> work;
    {
      MutexLock lock(&mu_);
      if (session->error.ok()) session->error = std::move(status);
      work = TakeForCommitLocked(session->id);
    }
    if (work) work();
  };
  absl::StatusOr<WritePullBody> body = DecodeWritePullBody(*h, data);
  if (!body.ok()) {
    fail(body.status());
    return;
  }
  const size_t blocks = body->blocks.size();
  if (blocks == 0 || blocks > session->slots.size()) {
    fail(absl::InvalidArgumentError(absl::StrCat("write pull names ", blocks,
                                                 " blocks; the write has ",
                                                 session->slots.size())));
    return;
  }
  struct Pull {
    uint32_t index;
    uint64_t address;
    const uint8_t* source;
  };
  std::vector<Pull> pulls(blocks);
  const uint64_t base = h->region_base, length = h->region_length;
  const uint64_t size = session->block_bytes;
  for (size_t i = 0; i < blocks; ++i) {
    pulls[i].index = body->blocks[i].index;
    pulls[i].address = body->blocks[i].address;
    // A block outside the region would be read from outside the node's
    // mapping of the client's segment.
    if (!RegionContains(base, length, pulls[i].address, size)) {
      fail(absl::InvalidArgumentError(absl::StrCat(
          "block ", pulls[i].index, " (", size, " bytes at 0x",
          absl::Hex(pulls[i].address), ") lies outside the registered region (",
          length, " bytes at 0x", absl::Hex(base), ")")));
      return;
    }
  }
  if (absl::Status st = EnsureClientEndpoint(conn, body->client_address);
      !st.ok()) {
    fail(st);
    return;
  }
  bool kept_new = false;  // a pulled buffer is mapped as its blocks are read
  absl::StatusOr<std::shared_ptr<RemoteKey>> rkey =
      ClientKey(conn, h->buffer_id, body->remote_key, &kept_new);
  if (!rkey.ok()) {
    fail(rkey.status());
    return;
  }
  for (Pull& pull : pulls) {
    void* mapped = nullptr;
    const ucs_status_t st = ucp_rkey_ptr((*rkey)->get(), pull.address, &mapped);
    if (st != UCS_OK) {
      fail(absl::UnimplementedError(
          absl::StrCat("this node cannot map the client's buffer (",
                       ucs_status_string(st), "); send it the blocks")));
      return;
    }
    pull.source = static_cast<const uint8_t*>(mapped);
  }
  std::vector<std::function<void()>> stages;
  std::function<void()> work;
  {
    MutexLock lock(&mu_);
    for (const Pull& pull : pulls) {
      if (pull.index >= session->slots.size() ||
          session->slots[pull.index] != WriteSession::Slot::kAwaiting) {
        if (session->error.ok()) {
          session->error = absl::InvalidArgumentError(absl::StrCat(
              "block ", pull.index,
              " is outside the write, present already or was sent twice"));
        }
        break;
      }
      session->slots[pull.index] = WriteSession::Slot::kLanded;
      --session->awaiting;
      session->buffers[pull.index].reset();  // its staging is not needed
      stages.push_back(StageLocked(session, pull.index, pull.source, *rkey));
      pulled_blocks_.fetch_add(1);
    }
    work = TakeForCommitLocked(session->id);
  }
  for (auto& stage : stages) stage();
  if (work) work();
}

ucs_status_t DataPlane::OnReleaseBuffer(
    void* arg, const void* header, size_t header_length, void* data,
    size_t length, const ucp_am_recv_param_t* param) noexcept {
  auto* self = static_cast<DataPlane*>(arg);
  Connection* conn = self->SenderOf(param);
  if (conn == nullptr) return UCS_OK;
  absl::StatusOr<ReleaseBufferHeader> h = DecodeReleaseBuffer(
      absl::string_view(static_cast<const char*>(header), header_length));
  if (!h.ok() || length != 0 ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    self->CloseConnection(conn->id, "malformed buffer release");
    return UCS_OK;
  }
  // The key is destroyed outside the callback (reads in progress hold it).
  const uint64_t conn_id = conn->id;
  self->loop_->Post([self, conn_id, id = h->buffer_id] {
    auto it = self->connections_.find(conn_id);
    if (it != self->connections_.end() &&
        it->second->buffer_keys.erase(id) > 0) {
      self->buffer_key_count_.fetch_sub(1);
    }
  });
  return UCS_OK;
}

absl::Status DataPlane::EnsureClientEndpoint(Connection* conn,
                                             absl::string_view worker_address) {
  if (!conn->adopted || conn->put_ep != nullptr) return absl::OkStatus();
  bool peer_errors = false;
  absl::StatusOr<std::unique_ptr<Endpoint>> put_ep = Endpoint::ConnectToWorker(
      loop_->worker(), worker_address, &DataPlane::OnEndpointError, this,
      &peer_errors);
  if (!put_ep.ok()) return put_ep.status();
  conn->put_ep = *std::move(put_ep);
  connection_by_ep_[conn->put_ep->get()] = conn->id;
  return absl::OkStatus();
}

bool DataPlane::KeepsKey(const Connection& conn, uint64_t buffer_id) {
  return buffer_id != 0 && (conn.buffer_keys.contains(buffer_id) ||
                            conn.buffer_keys.size() < kMaxBufferKeys);
}

absl::StatusOr<std::shared_ptr<RemoteKey>> DataPlane::ClientKey(
    Connection* conn, uint64_t buffer_id, absl::string_view packed,
    bool* kept_new) {
  *kept_new = false;
  auto kept = buffer_id == 0 ? conn->buffer_keys.end()
                             : conn->buffer_keys.find(buffer_id);
  if (kept != conn->buffer_keys.end() && kept->second.packed == packed) {
    // A long-lived buffer's key: unpacking it again would map the client's
    // segment again (on shared memory, a fault per page touched).
    return kept->second.key;
  }
  absl::StatusOr<std::unique_ptr<RemoteKey>> unpacked =
      RemoteKey::Unpack(conn->out(), packed);
  if (!unpacked.ok()) return unpacked.status();
  std::shared_ptr<RemoteKey> key = *std::move(unpacked);
  if (KeepsKey(*conn, buffer_id)) {
    if (kept == conn->buffer_keys.end()) buffer_key_count_.fetch_add(1);
    conn->buffer_keys[buffer_id] = {std::string(packed), key, nullptr};
    *kept_new = true;
  }
  return key;
}

std::shared_ptr<const DataPlane::BufferPrefault>
DataPlane::PrefaultClientBuffer(std::shared_ptr<RemoteKey> key, uint64_t base,
                                uint64_t length) {
  uint8_t* first = MappedRange(*key, base, length);
  if (first == nullptr) return nullptr;  // not one mapping of this process
  auto progress = std::make_shared<BufferPrefault>();
  progress->first = reinterpret_cast<uintptr_t>(first);
  progress->length = length;
  // Not on the worker pool: 2 MiB steps with pauses between them, for as
  // long as the buffer takes (a 1 GiB one: 512 pauses), would hold up the
  // copies and decodes of every read queued behind it.
  background_([this, key = std::move(key), progress, first, length]() mutable {
    // false: an older kernel, or the node stops; the puts fault as before.
    const bool done = PopulateForWrite(
        first, length,
        [this] { return prefaults_stop_.load(std::memory_order_relaxed); },
        [&progress](size_t reached) {
          progress->reached.store(reached, std::memory_order_release);
        });
    progress->ended.store(true, std::memory_order_release);
    if (done) prefaulted_buffer_bytes_.fetch_add(length);
    // A remote key is destroyed on the loop thread (see StageLocked).
    loop_->Post([key = std::move(key)] {});
  });
  return progress;
}

absl::Status DataPlane::KeepNamedBuffer(Connection* conn,
                                        const NamedBuffer& named) {
  if (!KeepsKey(*conn, named.buffer_id)) {
    // It would not be kept: unpacking it (on shared memory, attaching the
    // client's segment) would be work thrown away on every such read.
    return absl::OkStatus();
  }
  bool kept_new = false;
  absl::StatusOr<std::shared_ptr<RemoteKey>> key =
      ClientKey(conn, named.buffer_id, named.remote_key, &kept_new);
  if (!key.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the read's named buffer has a bad remote key: ",
                     key.status().message()));
  }
  if (kept_new) {
    conn->buffer_keys[named.buffer_id].prefault =
        PrefaultClientBuffer(*std::move(key), named.base, named.length);
  }
  return absl::OkStatus();
}

void DataPlane::PopulateAhead(const BufferPrefault* prefault, uint8_t* out,
                              uint64_t length) {
  if (prefault == nullptr || prefault->ended.load(std::memory_order_acquire)) {
    return;
  }
  const uintptr_t reached =
      prefault->first + prefault->reached.load(std::memory_order_acquire);
  const uintptr_t lo = std::max(reinterpret_cast<uintptr_t>(out), reached);
  const uintptr_t hi = std::min(reinterpret_cast<uintptr_t>(out) + length,
                                prefault->first + prefault->length);
  if (lo >= hi) return;
  // A refusal (no memory) leaves the writes to fault as usual.
  if (PopulateStepForWrite(reinterpret_cast<void*>(lo), hi - lo)) {
    buffer_bytes_populated_by_reads_.fetch_add(hi - lo);
  }
}

void DataPlane::HandleReadStart(Connection* conn, absl::string_view header,
                                absl::string_view data) {
  absl::StatusOr<ReadStartHeader> h = DecodeReadStart(header);
  if (!h.ok()) {
    CloseConnection(conn->id, "malformed read header");
    return;
  }
  std::shared_ptr<ReadSession> session;
  bool known = false;
  {
    MutexLock lock(&mu_);
    auto it = reads_.find(h->read_id);
    known = it != reads_.end();
    if (known && TokenEquals(it->second->token, h->token) &&
        it->second->state == ReadSession::State::kWaiting) {
      session = it->second;
      session->state = ReadSession::State::kTransferring;
      session->conn_id = conn->id;
    }
  }
  if (session == nullptr) {
    if (!known && conn->authenticated) {
      // An expired read, asked for by a connection that has authenticated
      // before: tell it rather than leave it waiting.
      SendReadStatus(conn->id, h->read_id, h->token, 0, 0,
                     absl::FailedPreconditionError(
                         "read lease is unknown or has expired"));
    } else {
      CloseConnection(conn->id, "read request without a valid token");
    }
    return;
  }
  conn->authenticated = true;
  // From here the session, not the store's TTL, ends the lease: its
  // deadline force-closes a stuck transfer, and the lease ends only once
  // no send reads the pinned pages (ReleaseIfIdle).
  if (absl::Status held = session->claim.Hold(); !held.ok()) {
    FinishRead(session, absl::FailedPreconditionError(
                            "read lease is unknown or has expired"));
    return;
  }
  const size_t blocks = session->result.blocks.size();
  if ((h->flags & ~(kReadFlagPerLayer | kReadFlagBounded | kReadFlagMessages |
                    kReadFlagSequenced | kReadFlagReportMapped |
                    kReadFlagNamesBuffer)) != 0) {
    FinishRead(session, absl::InvalidArgumentError(absl::StrCat(
                            "read request with unknown flags ", h->flags)));
    return;
  }
  absl::StatusOr<ReadStartBody> body = DecodeReadStartBody(*h, data);
  if (!body.ok()) {
    FinishRead(session, body.status());
    return;
  }
  if (body->destinations.size() != blocks) {
    FinishRead(session, absl::InvalidArgumentError(absl::StrCat(
                            "read request names ", body->destinations.size(),
                            " blocks; the read has ", blocks)));
    return;
  }
  std::vector<uint64_t> remote = std::move(body->destinations);
  if ((h->flags & kReadFlagBounded) != 0) {
    // Over shared memory a put is a memcpy into the node's mapping of the
    // client's segment, which UCX does not bound: a destination outside the
    // region would be written outside that mapping.
    for (size_t i = 0; i < blocks; ++i) {
      const uint64_t size = session->result.blocks[i].answer_size();
      if (!RegionContains(body->region_base, body->region_length, remote[i],
                          size)) {
        FinishRead(session, absl::InvalidArgumentError(absl::StrCat(
                                "read destination of block ", i, " (", size,
                                " bytes at 0x", absl::Hex(remote[i]),
                                ") lies outside the registered region (",
                                body->region_length, " bytes at 0x",
                                absl::Hex(body->region_base), ")")));
        return;
      }
    }
  }
  if (absl::Status st = EnsureClientEndpoint(conn, body->client_address);
      !st.ok()) {
    FinishRead(session, st);
    return;
  }
  if (absl::Status st = AttachClientBuffers(conn, *h, *body, *session);
      !st.ok()) {
    FinishRead(session, st);
    return;
  }
  const bool by_messages = (h->flags & kReadFlagMessages) != 0 && blocks > 0 &&
                           options_.read_delivery == ReadDelivery::kAuto &&
                           !PutsAreNative(conn, *session->rkey, remote[0]);
  if (by_messages) message_reads_.fetch_add(1);
  session->sequenced = (h->flags & kReadFlagSequenced) != 0;
  session->report_mapped = (h->flags & kReadFlagReportMapped) != 0;
  StartPuts(session, conn, std::move(remote),
            (h->flags & kReadFlagPerLayer) != 0, by_messages);
}

absl::Status DataPlane::AttachClientBuffers(Connection* conn,
                                            const ReadStartHeader& h,
                                            const ReadStartBody& body,
                                            ReadSession& session) {
  bool kept_new = false;
  absl::StatusOr<std::shared_ptr<RemoteKey>> rkey =
      ClientKey(conn, h.buffer_id, body.remote_key, &kept_new);
  if (!rkey.ok()) return rkey.status();
  if (kept_new && (h.flags & kReadFlagBounded) != 0) {
    conn->buffer_keys[h.buffer_id].prefault =
        PrefaultClientBuffer(*rkey, body.region_base, body.region_length);
  }
  if (auto kept = conn->buffer_keys.find(h.buffer_id);
      h.buffer_id != 0 && kept != conn->buffer_keys.end() &&
      kept->second.key == *rkey && kept->second.prefault != nullptr &&
      !kept->second.prefault->ended.load(std::memory_order_acquire)) {
    session.prefault = kept->second.prefault;
  }
  session.rkey = *std::move(rkey);
  if ((h.flags & kReadFlagNamesBuffer) != 0) {
    return KeepNamedBuffer(conn, body.named);
  }
  return absl::OkStatus();
}

bool DataPlane::PutsAreNative(Connection* conn, const RemoteKey& rkey,
                              uint64_t address) {
  void* mapped = nullptr;
  if (ucp_rkey_ptr(rkey.get(), address, &mapped) == UCS_OK) return true;
  if (!conn->tcp_only.has_value()) {
    // Only where every lane of the endpoint is TCP do puts count as
    // emulated: anything else (RDMA above all, where a data message's
    // rendezvous would expose the node's memory) keeps puts.
    int lanes = 0;
    int tcp_lanes = 0;
    if (absl::StatusOr<std::string> text = conn->out().Describe(); text.ok()) {
      for (absl::string_view line : absl::StrSplit(*text, '\n')) {
        if (!absl::StrContains(line, "lane[")) continue;
        ++lanes;
        if (absl::StrContains(line, ":tcp/")) ++tcp_lanes;
      }
    }
    conn->tcp_only = lanes > 0 && lanes == tcp_lanes;
  }
  return !*conn->tcp_only;
}

void DataPlane::StartPuts(const std::shared_ptr<ReadSession>& session,
                          Connection* conn, std::vector<uint64_t> remote,
                          bool per_layer, bool by_messages) {
  session->send_conn = conn->id;
  session->remote = std::move(remote);
  session->by_messages = by_messages;
  // Per layer: slice l of every block, then a report. Whole blocks: one
  // slice per block (so that block b + 1 is checked while block b is
  // sent), one report at the end.
  session->per_layer = per_layer;
  session->slices =
      per_layer ? session->num_layers
                : std::max<uint32_t>(
                      1, static_cast<uint32_t>(session->result.blocks.size()));
  session->slice_sends.assign(session->slices, 0);
  session->slice_bytes.assign(session->slices, 0);
  session->slices_checked = session->slices;  // unless CheckThenPost
  if (!by_messages) MapDestinations(*session);
  session->decoding = PlanDecoding(session->result);
  if (session->decoding != nullptr) {
    if (session->mapped.empty()) {
      DecodeThenSend(session);
      return;
    }
    blocks_decoded_into_destination_.fetch_add(std::count_if(
        session->result.blocks.begin(), session->result.blocks.end(),
        [](const store::ReadBlock& b) { return b.decode_later; }));
  }
  CheckAndSend(session, DecodesCheck(session->result));
}

void DataPlane::CheckAndSend(const std::shared_ptr<ReadSession>& session,
                             bool checked_in_decodes) {
  bool unchecked = false;
  for (const store::ReadBlock& block : session->result.blocks) {
    unchecked = unchecked || NeedsCheck(block);
  }
  if (unchecked && !session->mapped.empty() && ChecksFollowSlices(*session)) {
    session->check_in_copies = true;
    reads_checked_while_copying_.fetch_add(1);
  } else if (unchecked) {
    reads_checked_before_sending_.fetch_add(1);
    CheckThenPost(session);
    return;
  } else if (checked_in_decodes) {
    (session->mapped.empty() ? reads_checked_before_sending_
                             : reads_checked_while_copying_)
        .fetch_add(1);
  }
  PostNextSlices(session);
}

bool DataPlane::ChecksFollowSlices(const ReadSession& session) {
  for (uint32_t slice = 0; slice < session.slices; ++slice) {
    const auto [first, last] = SliceBlocks(session, slice);
    for (size_t b = first; b < last; ++b) {
      if (!NeedsCheck(session.result.blocks[b])) continue;
      const std::vector<uint64_t>& ends =
          session.result.blocks[b].unchecked_layer_ends;
      auto on_bound = [&](uint64_t at) {
        return at == 0 || std::binary_search(ends.begin(), ends.end(), at);
      };
      uint64_t start, end;
      if (!ends.empty() && SliceRange(session, slice, b, &start, &end) &&
          (!on_bound(start) || !on_bound(end))) {
        return false;
      }
    }
  }
  return true;
}

std::optional<uint32_t> DataPlane::FirstBadLayer(const store::ReadBlock& block,
                                                 uint32_t first, uint32_t end) {
  const std::vector<uint64_t>& ends = block.unchecked_layer_ends;
  XXH3_state_t state;
  for (uint32_t l = first; l < end; ++l) {
    XXH3_64bits_reset(&state);
    ForEachPieceOf(block, l == 0 ? 0 : ends[l - 1], ends[l],
                   [&](const uint8_t* src, uint64_t length, uint64_t) {
                     XXH3_64bits_update(&state, src, length);
                   });
    if (XXH3_64bits_digest(&state) != block.unchecked_layer_sums[l]) return l;
  }
  return std::nullopt;
}

void DataPlane::CheckThenPost(const std::shared_ptr<ReadSession>& session) {
  // Slice by slice where the slices are whole checked layers, so that the
  // first layer goes once it is checked; otherwise whole blocks, all before
  // slice 0. A client that does not number data messages gets every slice
  // posted at once (PostNextSlices): its checks all go before slice 0 too.
  session->check_by_slice = (!session->by_messages || session->sequenced) &&
                            ChecksFollowSlices(*session);
  session->slice_checks_left.assign(session->slices, 0);
  session->slices_checked = 0;
  session->slices_check_started = 0;
  if (session->check_by_slice) {
    StartChecksAhead(session);
  } else {
    StartChecks(session, 0, /*whole_blocks=*/true);
    session->slices_check_started = session->slices;
  }
  PostCheckedSlices(session);  // the slices that need no check, if any
}

void DataPlane::StartChecksAhead(const std::shared_ptr<ReadSession>& session) {
  // Only a few slices ahead of the sends: on a node short of cores the
  // checks of later layers would otherwise slow the first layer's sends.
  while (!session->finished &&
         session->slices_check_started < session->slices &&
         session->slices_check_started <
             session->slices_posted + kSlicesCheckedAhead) {
    StartChecks(session, session->slices_check_started++,
                /*whole_blocks=*/false);
  }
}

void DataPlane::StartChecks(const std::shared_ptr<ReadSession>& session,
                            uint32_t slice, bool whole_blocks) {
  // Tasks of about kCopyTaskBytes: (block, first layer, end layer) each.
  struct Unit {
    size_t block;
    uint32_t first, end;
  };
  std::vector<std::vector<Unit>> tasks(1);
  uint64_t task_bytes = 0;
  const auto [first_block, end_block] =
      whole_blocks ? std::pair<size_t, size_t>{0, session->result.blocks.size()}
                   : SliceBlocks(*session, slice);
  for (size_t b = first_block; b < end_block; ++b) {
    const store::ReadBlock& block = session->result.blocks[b];
    const std::vector<uint64_t>& ends = block.unchecked_layer_ends;
    uint64_t start = 0, end = block.size();
    if (!NeedsCheck(block) ||
        (!whole_blocks && !SliceRange(*session, slice, b, &start, &end))) {
      continue;
    }
    // The layers within [start, end) (ChecksFollowSlices for a slice).
    const auto first = static_cast<uint32_t>(
        std::upper_bound(ends.begin(), ends.end(), start) - ends.begin());
    const auto last = static_cast<uint32_t>(
        std::lower_bound(ends.begin(), ends.end(), end) - ends.begin());
    if (task_bytes >= kCopyTaskBytes) {
      tasks.emplace_back();
      task_bytes = 0;
    }
    tasks.back().push_back({b, first, last + 1});
    task_bytes += end - start;
  }
  for (std::vector<Unit>& units : tasks) {
    if (units.empty()) continue;
    ++session->outstanding;
    ++session->slice_checks_left[slice];
    loop_->AddBusy(1);
    executor_([this, session, slice, units = std::move(units)] {
      std::optional<std::pair<size_t, uint32_t>> corrupt;
      for (const Unit& u : units) {
        if (session->stop_copies.load(std::memory_order_relaxed)) break;
        const store::ReadBlock& block = session->result.blocks[u.block];
        if (auto bad = FirstBadLayer(block, u.first, u.end)) {
          corrupt.emplace(u.block, *bad);
          break;
        }
      }
      loop_->Post([this, session, slice, corrupt] {
        loop_->AddBusy(-1);
        --session->outstanding;
        --session->slice_checks_left[slice];
        if (corrupt) FailCorrupt(*session, corrupt->first, corrupt->second);
        if (!session->finished && !session->error.ok()) {
          FinishRead(session, session->error);
        } else {
          PostCheckedSlices(session);
        }
        ReleaseIfIdle(*session);
      });
    });
  }
}

void DataPlane::PostCheckedSlices(const std::shared_ptr<ReadSession>& session) {
  if (session->finished) return;
  AdvanceCheckedSlices(*session);
  PostNextSlices(session);
}

bool DataPlane::AdvanceCheckedSlices(ReadSession& session) {
  const uint32_t before = session.slices_checked;
  // Slices whose checks have not started are not checked.
  while (session.slices_checked < session.slices_check_started &&
         session.slice_checks_left[session.slices_checked] == 0) {
    ++session.slices_checked;
  }
  return session.slices_checked != before;
}

void DataPlane::FailCorrupt(ReadSession& session, size_t block,
                            uint32_t layer) {
  // The claim holds the lease until the read is released, on this thread.
  if (absl::Status dropped = session.claim.DropCorruptBlock(block);
      !dropped.ok()) {
    LogError(absl::StrCat("read ", session.id, ": dropping corrupt block ",
                          block, ": ", dropped.ToString()));
  }
  if (!session.error.ok()) return;
  session.error = absl::DataLossError(absl::StrCat(
      "block ", block, " of the read, layer ", layer,
      ": stored block failed verification: payload checksum mismatch; the "
      "block was dropped"));
}

void DataPlane::MapDestinations(ReadSession& session) {
  std::vector<uint8_t*> mapped;
  for (size_t b = 0; b < session.result.blocks.size(); ++b) {
    const uint64_t size = session.result.blocks[b].answer_size();
    uint8_t* at = MappedRange(*session.rkey, session.remote[b], size);
    if (size != 0 && at == nullptr) return;  // not mapped here: UCX puts
    mapped.push_back(at);
  }
  session.mapped = std::move(mapped);
  copied_reads_.fetch_add(1);
  session.slice_copied.assign(session.slices, false);
}

void DataPlane::PostNextSlices(const std::shared_ptr<ReadSession>& session) {
  // A client that numbers data messages as they arrive (no
  // kReadFlagSequenced) gets them all at once, as before windowing: the
  // window interleaves layers' messages with their flushes more finely,
  // and a read so sent was seen reported early (1 run in 60 under load).
  const bool window = !session->by_messages || session->sequenced;
  while (true) {
    while (!session->finished && session->slices_posted < session->slices &&
           session->slices_posted < session->slices_checked &&
           (!window || session->slices_in_flight < kMinSlicesInFlight ||
            session->bytes_in_flight < kBytesInFlight)) {
      PostNextSlice(session);
    }
    if (!session->check_by_slice || session->finished) return;
    // Posting makes room for the checks of later slices. A slice with
    // nothing to check (whole blocks the store checked, or decoded) is
    // checked once its checks start: then post again.
    StartChecksAhead(session);
    if (!AdvanceCheckedSlices(*session)) return;
  }
}

void DataPlane::SliceSent(const std::shared_ptr<ReadSession>& session,
                          uint32_t slice) {
  if (--session->slice_sends[slice] > 0) return;
  --session->slices_in_flight;
  session->bytes_in_flight -= session->slice_bytes[slice];
  if (!session->mapped.empty()) {
    session->slice_copied[slice] = true;
    ReportCopiedSlices(session);
  }
  PostNextSlices(session);
}

void DataPlane::PostNextSlice(const std::shared_ptr<ReadSession>& session) {
  if (!session->error.ok()) {
    // A failed send: the slices after it will not go, so their report
    // will not come.
    FinishRead(session, session->error);
    return;
  }
  auto conn = connections_.find(session->send_conn);
  if (conn == connections_.end()) {
    FinishRead(session, absl::UnavailableError("the connection closed"));
    return;
  }
  const uint32_t slice = session->slices_posted++;
  read_slices_posted_.fetch_add(1, std::memory_order_relaxed);
  // Held while posting, so that sends completing at once cannot end the
  // slice (and post the next one, and its report) before this one's.
  ++session->slice_sends[slice];
  ++session->slices_in_flight;
  PostSlice(session, *conn->second, slice);
  session->bytes_in_flight += session->slice_bytes[slice];
  SliceSent(session, slice);
}

std::pair<size_t, size_t> DataPlane::SliceBlocks(const ReadSession& session,
                                                 uint32_t slice) {
  const size_t blocks = session.result.blocks.size();
  if (session.per_layer) return {0, blocks};
  return {std::min<size_t>(slice, blocks), std::min<size_t>(slice + 1, blocks)};
}

bool DataPlane::SliceRange(const ReadSession& session, uint32_t slice, size_t b,
                           uint64_t* start, uint64_t* end) {
  const uint64_t size = session.result.blocks[b].answer_size();
  const std::vector<uint64_t>& ends = session.layer_ends[b];
  *start = 0;
  *end = size;
  if (!session.per_layer) {
    if (slice != b) return false;  // whole blocks: slice b is block b
  } else if (session.slices > 1 && ends.size() == session.num_layers) {
    *start = slice == 0 ? 0 : ends[slice - 1];
    *end = ends[slice];
  } else if (slice > 0) {
    return false;  // a block whose layers are not separable went whole
  }
  return *start < *end && *end <= size;
}

void DataPlane::ForEachPieceOf(
    const store::ReadBlock& block, uint64_t start, uint64_t end,
    absl::FunctionRef<void(const uint8_t*, uint64_t, uint64_t)> fn) {
  if (block.spans.empty()) {
    fn(reinterpret_cast<const uint8_t*>(block.data.data()) + start, end - start,
       start);
    return;
  }
  // In place: the range may cross page runs; one piece per run, straight
  // from the pinned arena pages.
  uint64_t at = 0;
  for (absl::Span<const uint8_t> span : block.spans) {
    const uint64_t lo = std::max(start, at);
    const uint64_t hi = std::min(end, at + span.size());
    if (lo < hi) fn(span.data() + (lo - at), hi - lo, lo);
    at += span.size();
    if (at >= end) break;
  }
}

void DataPlane::ForEachPiece(
    const ReadSession& session, uint32_t slice,
    absl::FunctionRef<void(const uint8_t*, uint64_t, size_t, uint64_t)> fn) {
  const auto [first, last] = SliceBlocks(session, slice);
  for (size_t b = first; b < last; ++b) {
    uint64_t start, end;
    if (!SliceRange(session, slice, b, &start, &end)) continue;
    ForEachPieceOf(session.result.blocks[b], start, end,
                   [&](const uint8_t* src, uint64_t length, uint64_t offset) {
                     fn(src, length, b, offset);
                   });
  }
}

namespace {

// One contiguous copy of a copy task; with `checked`, its source is hashed
// into the running layer checksum, and with `ends_layer` that checksum must
// then equal `expected` (layer `layer` of block `block`).
struct CopyPiece {
  uint8_t* dst;
  const uint8_t* src;
  uint64_t length;
  bool checked = false;
  bool ends_layer = false;
  uint32_t layer = 0;
  size_t block = 0;
  uint64_t expected = 0;
};

// Adds [out, out + length) to `runs`, extending the last run when it ends
// at `out`.
void AddRun(std::vector<std::pair<uint8_t*, uint64_t>>& runs, uint8_t* out,
            uint64_t length) {
  if (!runs.empty() && runs.back().first + runs.back().second == out) {
    runs.back().second += length;
  } else {
    runs.emplace_back(out, length);
  }
}

// Copies the pieces in order; returns the first (block, layer) whose bytes
// do not match their checksum (the task stops there), or nullopt. `stop`
// ends it early (*stopped). The check hashes the stored bytes (the
// source), from the cache right after their copy: what it vouches for is
// the block as stored, as BeginRead's check did. The copy bypasses the
// cache (StreamCopy): the destination is the client's, read by it later;
// the caller fences before it reports the copy.
std::optional<std::pair<size_t, uint32_t>> CopyAndCheck(
    absl::Span<const CopyPiece> pieces, const std::atomic<bool>& stop,
    bool* stopped) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (const CopyPiece& piece : pieces) {
    if (stop.load(std::memory_order_relaxed)) {
      *stopped = true;
      return std::nullopt;
    }
    if (!piece.checked) {
      StreamCopy(piece.dst, piece.src, piece.length);
      continue;
    }
    for (uint64_t at = 0; at < piece.length; at += kCheckChunkBytes) {
      const uint64_t n = std::min(kCheckChunkBytes, piece.length - at);
      StreamCopy(piece.dst + at, piece.src + at, n);
      XXH3_64bits_update(&state, piece.src + at, n);
    }
    if (piece.ends_layer) {
      if (XXH3_64bits_digest(&state) != piece.expected) {
        return std::make_pair(piece.block, piece.layer);
      }
      XXH3_64bits_reset(&state);
    }
  }
  return std::nullopt;
}

}  // namespace

void DataPlane::CopySlice(const std::shared_ptr<ReadSession>& session,
                          uint32_t slice) {
  // Tasks of about kCopyTaskBytes, so that a large slice is copied by
  // several pool threads at once; a task ends only between blocks, so that
  // each checked layer is hashed by one task.
  struct Task {
    std::vector<CopyPiece> pieces;
    std::vector<DecodeUnit> decodes;
    // Where session->prefault: the destinations the task writes, as
    // contiguous runs, to PopulateAhead.
    std::vector<std::pair<uint8_t*, uint64_t>> runs;
  };
  std::vector<Task> tasks(1);
  uint64_t task_bytes = 0;
  const auto [first_block, end_block] = SliceBlocks(*session, slice);
  for (size_t b = first_block; b < end_block; ++b) {
    uint64_t start, end;
    if (!SliceRange(*session, slice, b, &start, &end)) continue;
    if (task_bytes >= kCopyTaskBytes) {
      tasks.emplace_back();
      task_bytes = 0;
    }
    std::vector<CopyPiece>& pieces = tasks.back().pieces;
    const store::ReadBlock& block = session->result.blocks[b];
    auto add = [&](const uint8_t* src, uint64_t length, uint64_t offset) {
      pieces.push_back({session->mapped[b] + offset, src, length});
    };
    task_bytes += end - start;
    session->slice_bytes[slice] += end - start;
    if (session->prefault != nullptr) {
      AddRun(tasks.back().runs, session->mapped[b] + start, end - start);
    }
    if (block.decode_later) {
      // Slices of a decoded block are whole fp16 layers (LayerEnds).
      const uint64_t layer_bytes = session->decoding->fp16_layer_bytes;
      for (uint64_t at = start; at < end; at += layer_bytes) {
        tasks.back().decodes.push_back({b,
                                        static_cast<uint32_t>(at / layer_bytes),
                                        session->mapped[b] + at});
      }
      continue;
    }
    if (!session->check_in_copies || block.unchecked_layer_sums.empty()) {
      ForEachPieceOf(block, start, end, add);
      continue;
    }
    // ChecksFollowSlices: [start, end) is whole checked layers.
    const std::vector<uint64_t>& ends = block.unchecked_layer_ends;
    for (uint32_t l = 0; l < ends.size(); ++l) {
      const uint64_t lo = l == 0 ? 0 : ends[l - 1];
      if (lo < start || ends[l] > end || lo == ends[l]) continue;
      const size_t first = pieces.size();
      ForEachPieceOf(block, lo, ends[l], add);
      for (size_t i = first; i < pieces.size(); ++i) pieces[i].checked = true;
      CopyPiece& last = pieces.back();
      last.ends_layer = true;
      last.layer = l;
      last.block = b;
      last.expected = block.unchecked_layer_sums[l];
    }
  }
  for (Task& task : tasks) {
    if (task.pieces.empty() && task.decodes.empty()) continue;
    ++session->outstanding;
    ++session->slice_sends[slice];
    loop_->AddBusy(1);
    executor_([this, session, slice, task = std::move(task)] {
      for (const auto& [out, length] : task.runs) {
        if (session->stop_copies.load(std::memory_order_relaxed)) break;
        PopulateAhead(session->prefault.get(), out, length);
      }
      bool stopped = false;
      std::optional<std::pair<size_t, uint32_t>> corrupt =
          CopyAndCheck(task.pieces, session->stop_copies, &stopped);
      absl::Status decoded;
      if (!corrupt && !stopped) {
        decoded =
            DecodeUnits(*session, task.decodes,
                        kernels::DecodeStores::kStreaming, &corrupt, &stopped);
      }
      // The copies are in the client's memory before the loop thread can
      // report them.
      StreamCopyFence();
      loop_->Post([this, session, slice, stopped, corrupt, decoded] {
        loop_->AddBusy(-1);
        --session->outstanding;
        if (corrupt) FailCorrupt(*session, corrupt->first, corrupt->second);
        if (!decoded.ok() && session->error.ok()) session->error = decoded;
        if (stopped && session->error.ok()) {
          session->error = absl::AbortedError("the read ended early");
        }
        SliceSent(session, slice);
        ReleaseIfIdle(*session);
      });
    });
  }
}

bool DataPlane::NeedsCheck(const store::ReadBlock& block) {
  return !block.unchecked_layer_sums.empty() && !block.decode_later;
}

std::shared_ptr<const DataPlane::LayerDecoding> DataPlane::PlanDecoding(
    const store::ReadResult& result) {
  const bool any =
      std::any_of(result.blocks.begin(), result.blocks.end(),
                  [](const store::ReadBlock& b) { return b.decode_later; });
  if (!any) return nullptr;
  const kernels::BlockShape& shape = result.ns.config.shape;
  auto plan = std::make_shared<LayerDecoding>();
  plan->layer_shape = shape;
  plan->layer_shape.num_layers = 1;
  for (uint32_t l = 0; l < shape.num_layers; ++l) {
    plan->layer_policies.push_back(
        kernels::LayerPolicy(shape, result.ns.config.policy, l));
  }
  plan->offsets = kernels::EncodedLayerOffsets(shape, result.ns.config.policy);
  plan->fp16_layer_bytes = result.ns.fp16_block_bytes / shape.num_layers;
  return plan;
}

absl::Status DataPlane::DecodeUnits(
    const ReadSession& session, absl::Span<const DecodeUnit> units,
    kernels::DecodeStores stores,
    std::optional<std::pair<size_t, uint32_t>>* corrupt, bool* stopped) {
  if (units.empty()) return absl::OkStatus();  // a task of copies only
  const LayerDecoding& plan = *session.decoding;
  // A layer that crosses page runs is gathered here first (a layer's
  // encoding is small enough to stay in the cache for its decode).
  static thread_local std::vector<uint8_t> gathered;
  for (const DecodeUnit& unit : units) {
    if (session.stop_copies.load(std::memory_order_relaxed)) {
      *stopped = true;
      return absl::OkStatus();
    }
    const store::ReadBlock& block = session.result.blocks[unit.block];
    const uint32_t l = unit.layer;
    const uint64_t lo = plan.offsets[l];
    const uint64_t hi = plan.offsets[l + 1];
    const uint8_t* src = nullptr;
    int pieces = 0;
    ForEachPieceOf(block, lo, hi,
                   [&](const uint8_t* piece, uint64_t, uint64_t) {
                     if (pieces++ == 0) src = piece;
                   });
    if (pieces > 1) {
      gathered.resize(hi - lo);
      ForEachPieceOf(block, lo, hi,
                     [&](const uint8_t* piece, uint64_t n, uint64_t at) {
                       std::memcpy(gathered.data() + (at - lo), piece, n);
                     });
      src = gathered.data();
    }
    const absl::Span<const uint8_t> encoded(src, hi - lo);
    if (!block.unchecked_layer_sums.empty() &&
        block.unchecked_layer_sums.size() + 1 != plan.offsets.size()) {
      // The store hands over one sum per layer of the encoding; anything
      // else cannot be checked layer by layer here.
      return absl::InternalError(absl::StrCat(
          "block ", unit.block, ": ", block.unchecked_layer_sums.size(),
          " layer checksums for ", plan.offsets.size() - 1, " layers"));
    }
    // The stored bytes are checked before anything is decoded from them:
    // what the client gets is the decode of what was written.
    if (!block.unchecked_layer_sums.empty() &&
        XXH3_64bits(encoded.data(), encoded.size()) !=
            block.unchecked_layer_sums[l]) {
      corrupt->emplace(unit.block, l);
      return absl::OkStatus();
    }
    absl::Status st = kernels::DecodeBlock(
        plan.layer_shape, plan.layer_policies[l], encoded,
        absl::MakeSpan(reinterpret_cast<uint16_t*>(unit.out),
                       plan.fp16_layer_bytes / 2),
        stores);
    if (!st.ok()) {
      return absl::InternalError(absl::StrCat("block ", unit.block, ", layer ",
                                              l, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

void DataPlane::DecodeThenSend(const std::shared_ptr<ReadSession>& session) {
  // Not mapped here (TCP, RDMA): the blocks left encoded are decoded into
  // copies, which then go as those decoded in BeginRead do.
  uint64_t bytes = 0;
  for (const store::ReadBlock& block : session->result.blocks) {
    if (block.decode_later) bytes += block.fp16_bytes;
  }
  absl::StatusOr<StagingReservation> reserved = ReserveStaging(bytes);
  if (!reserved.ok()) {
    FinishRead(session, reserved.status());
    return;
  }
  session->decode_reservation = *std::move(reserved);
  // Tasks of about kCopyTaskBytes of whole blocks. Each task sizes its
  // blocks' copies itself: zero-filling them here would hold up the loop
  // thread. Until the last task reports, only pool tasks touch them.
  std::vector<std::vector<size_t>> tasks(1);
  uint64_t task_bytes = 0;
  for (size_t b = 0; b < session->result.blocks.size(); ++b) {
    const store::ReadBlock& block = session->result.blocks[b];
    if (!block.decode_later) continue;
    if (task_bytes >= kCopyTaskBytes) {
      tasks.emplace_back();
      task_bytes = 0;
    }
    tasks.back().push_back(b);
    task_bytes += block.fp16_bytes;
    blocks_decoded_at_read_start_.fetch_add(1);
  }
  for (std::vector<size_t>& blocks : tasks) {
    ++session->outstanding;
    ++session->decodes_left;
    loop_->AddBusy(1);
    executor_([this, session, blocks = std::move(blocks)] {
      std::optional<std::pair<size_t, uint32_t>> corrupt;
      bool stopped = false;
      absl::Status decoded;
      const LayerDecoding& plan = *session->decoding;
      std::vector<DecodeUnit> units;
      for (size_t b : blocks) {
        store::ReadBlock& block = session->result.blocks[b];
        block.data.resize(block.fp16_bytes);
        auto* out = reinterpret_cast<uint8_t*>(block.data.data());
        units.clear();
        for (uint32_t l = 0; l + 1 < plan.offsets.size(); ++l) {
          units.push_back({b, l, out + uint64_t{l} * plan.fp16_layer_bytes});
        }
        decoded = DecodeUnits(*session, units, kernels::DecodeStores::kCached,
                              &corrupt, &stopped);
        if (!decoded.ok() || corrupt || stopped) break;
      }
      loop_->Post([this, session, corrupt, decoded, stopped] {
        loop_->AddBusy(-1);
        --session->outstanding;
        --session->decodes_left;
        if (corrupt) FailCorrupt(*session, corrupt->first, corrupt->second);
        if (!decoded.ok() && session->error.ok()) session->error = decoded;
        if (stopped && session->error.ok()) {
          session->error = absl::AbortedError("the read ended early");
        }
        if (!session->finished && !session->error.ok()) {
          // At once, not after the other blocks' decodes: FinishRead stops
          // them (stop_copies), and the session is released once they end.
          FinishRead(session, session->error);
        } else if (!session->finished && session->decodes_left == 0) {
          SendDecoded(session);
        }
        ReleaseIfIdle(*session);
      });
    });
  }
}

bool DataPlane::DecodesCheck(const store::ReadResult& result) {
  return std::any_of(result.blocks.begin(), result.blocks.end(),
                     [](const store::ReadBlock& b) {
                       return b.decode_later && !b.unchecked_layer_sums.empty();
                     });
}

void DataPlane::SendDecoded(const std::shared_ptr<ReadSession>& session) {
  const bool checked = DecodesCheck(session->result);
  for (store::ReadBlock& block : session->result.blocks) {
    if (!block.decode_later) continue;
    // Checked and decoded: the copy is the answer now.
    block.spans.clear();
    block.unchecked_layer_ends.clear();
    block.unchecked_layer_sums.clear();
    block.decode_later = false;
  }
  CheckAndSend(session, checked);
}

void DataPlane::ReportCopiedSlices(
    const std::shared_ptr<ReadSession>& session) {
  // Statuses go in slice order, each once every slice before it is copied:
  // a layer is reported only when it and the layers before it are in the
  // client's memory, whichever pool thread finished first.
  while (!session->finished &&
         session->slices_reported < session->slices_posted &&
         session->slice_copied[session->slices_reported]) {
    if (!session->error.ok()) {
      FinishRead(session, session->error);
      return;
    }
    if (!connections_.contains(session->send_conn)) {
      FinishRead(session, absl::UnavailableError("the connection closed"));
      return;
    }
    ++session->slices_reported;
    // Whole blocks: one report, once the last block is copied.
    if (!session->per_layer && session->slices_reported < session->slices) {
      continue;
    }
    const uint32_t layers_done =
        session->per_layer ? session->slices_reported : session->num_layers;
    session->layers_done = layers_done;
    SendReadStatus(session->send_conn, session->id, session->token, layers_done,
                   session->num_layers, absl::OkStatus(), std::nullopt,
                   Delivery(*session));
    if (layers_done == session->num_layers) {
      FinishRead(session, absl::OkStatus());
    }
  }
}

void DataPlane::PostSlice(const std::shared_ptr<ReadSession>& session,
                          Connection& conn, uint32_t slice) {
  if (!session->mapped.empty()) {
    CopySlice(session, slice);
    return;
  }
  const uint32_t num_layers = session->num_layers;
  ForEachPiece(
      *session, slice,
      [&](const uint8_t* src, uint64_t length, size_t b, uint64_t start) {
        SendPiece(session, conn, slice, src, length, b, start);
      });
  // Whole blocks: the read is reported once, after its last block.
  if (!session->per_layer && slice + 1 < session->slices) return;
  const uint32_t layers_done = session->per_layer ? slice + 1 : num_layers;
  std::optional<uint32_t> data_messages;
  if (session->by_messages) data_messages = session->data_messages;
  if (session->by_messages && session->sequenced && layers_done < num_layers) {
    // Numbered data messages need no flush: the client applies a status
    // once the messages sent before it have landed, by their sequence
    // numbers. So a layer's status follows its messages at once.
    session->layers_done = layers_done;
    SendReadStatus(conn.id, session->id, session->token, layers_done,
                   num_layers, absl::OkStatus(), data_messages,
                   Delivery(*session));
    return;
  }
  FlushAndReport(session, conn, layers_done, data_messages);
}

void DataPlane::SendPiece(const std::shared_ptr<ReadSession>& session,
                          Connection& conn, uint32_t slice, const uint8_t* src,
                          uint64_t length, size_t b, uint64_t start) {
  const ucp_ep_h ep = conn.out().get();
  auto track = [this, session, slice](absl::Status status) {
    loop_->AddBusy(-1);
    --session->outstanding;
    if (!status.ok() && session->error.ok()) session->error = status;
    SliceSent(session, slice);
    ReleaseIfIdle(*session);
  };
  ++session->outstanding;
  ++session->slice_sends[slice];
  session->slice_bytes[slice] += length;
  loop_->AddBusy(1);
  if (!session->by_messages) {
    const ucp_rkey_h rkey = session->rkey->get();
    const uint64_t dst = session->remote[b] + start;
    Operation::Start(
        Operation::Kind::kSend,
        [ep, rkey, src, length, dst](const ucp_request_param_t& param,
                                     absl::string_view) {
          return ucp_put_nbx(ep, src, length, dst, rkey, &param);
        },
        track);
    return;
  }
  ReadDataHeader h;
  h.read_id = session->id;
  h.token = session->token;
  h.block = static_cast<uint32_t>(b);
  h.offset = start;
  h.has_sequence = session->sequenced;
  h.sequence = session->data_messages++;
  Operation::Start(
      Operation::Kind::kSend,
      [ep, src, length](const ucp_request_param_t& param,
                        absl::string_view header) {
        ucp_request_param_t p = param;
        if (length >= kRendezvousBytes) {
          // Rendezvous: the client receives straight into its region.
          p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
          p.flags = UCP_AM_SEND_FLAG_RNDV;
        }
        return ucp_am_send_nbx(ep, kAmReadData, header.data(), header.size(),
                               src, length, &p);
      },
      track, Encode(h));
}

void DataPlane::FlushAndReport(const std::shared_ptr<ReadSession>& session,
                               Connection& conn, uint32_t layers_done,
                               std::optional<uint32_t> data_messages) {
  // The flush completes once every put issued so far is in the client's
  // memory; then the client hears that these layers are there.
  const uint64_t conn_id = conn.id;
  const uint32_t num_layers = session->num_layers;
  ++session->outstanding;
  loop_->AddBusy(1);
  Operation::Start(
      Operation::Kind::kSend,
      [ep = conn.out().get()](const ucp_request_param_t& param,
                              absl::string_view) {
        return ucp_ep_flush_nbx(ep, &param);
      },
      [this, session, conn_id, layers_done, num_layers,
       data_messages](absl::Status status) {
        loop_->AddBusy(-1);
        --session->outstanding;
        if (!status.ok() && session->error.ok()) session->error = status;
        if (session->finished) {
          ReleaseIfIdle(*session);
          return;
        }
        if (!session->error.ok()) {
          FinishRead(session, session->error);
          return;
        }
        session->layers_done = layers_done;
        SendReadStatus(conn_id, session->id, session->token, layers_done,
                       num_layers, absl::OkStatus(), data_messages,
                       Delivery(*session));
        if (layers_done == num_layers) FinishRead(session, absl::OkStatus());
      });
}

void DataPlane::SendReadStatus(uint64_t conn_id, uint64_t read_id,
                               const Token& token, uint32_t layers_done,
                               uint32_t num_layers, const absl::Status& status,
                               std::optional<uint32_t> data_messages,
                               std::optional<bool> mapped) {
  auto it = connections_.find(conn_id);
  if (it == connections_.end()) return;
  ReadStatusHeader h;
  h.read_id = read_id;
  h.token = token;
  h.layers_done = layers_done;
  h.num_layers = num_layers;
  h.code = static_cast<int32_t>(status.code());
  h.has_data_messages = data_messages.has_value();
  h.data_messages = data_messages.value_or(0);
  h.has_delivery = mapped.has_value();
  h.mapped = mapped.value_or(false);
  std::string header = Encode(h);
  const size_t header_size = header.size();
  const ucp_ep_h ep = it->second->out().get();
  // Header and message live in the operation until it completes.
  std::string keep = absl::StrCat(header, status.message());
  loop_->AddBusy(1);
  SendEagerAm(ep, kAmReadStatus, std::move(keep), header_size,
              [this](absl::Status) { loop_->AddBusy(-1); });
}

std::optional<bool> DataPlane::Delivery(const ReadSession& session) {
  if (!session.report_mapped) return std::nullopt;
  return !session.mapped.empty();
}

void DataPlane::FinishRead(const std::shared_ptr<ReadSession>& session,
                           absl::Status status) {
  if (session->finished) return;
  session->finished = true;
  session->stop_copies.store(true, std::memory_order_relaxed);
  uint64_t conn_id;
  {
    MutexLock lock(&mu_);
    session->state = ReadSession::State::kDone;
    conn_id = session->conn_id;
    auto it = reads_.find(session->id);
    if (it != reads_.end() && it->second == session) reads_.erase(it);
  }
  if (!status.ok()) {
    SendReadStatus(conn_id, session->id, session->token, session->layers_done,
                   session->num_layers, status, std::nullopt,
                   Delivery(*session));
  } else if (observer_) {
    uint64_t bytes = 0;
    for (const store::ReadBlock& b : session->result.blocks) {
      bytes += b.answer_size();
    }
    observer_(/*inbound=*/false, bytes);
  }
  ReleaseIfIdle(*session);
}

void DataPlane::ReleaseIfIdle(ReadSession& session) {
  if (!session.finished || session.outstanding > 0) return;
  // No operation references the pinned pages, the copies or the key any
  // more: the claim goes (once; an empty claim does nothing), which ends
  // the lease unless it had ended already (it was never held: the read
  // failed before it could be, and the store's TTL ended it).
  session.claim = store::ReadClaim();
  session.rkey.reset();
  session.result.blocks.clear();
  session.result.blocks.shrink_to_fit();
  session.reservation = StagingReservation();
  session.decode_reservation = StagingReservation();
}

// ----------------------------------------------------------- connections

void DataPlane::OnConnRequest(ucp_conn_request_h request, void* arg) noexcept {
  auto* self = static_cast<DataPlane*>(arg);
  ConnRequest owned(self->listener_->get(), request);
  {
    MutexLock lock(&self->mu_);
    if (self->draining_) return;  // rejected by ~ConnRequest
  }
  auto conn = std::make_unique<Connection>();
  conn->id = self->next_connection_id_++;
  conn->peer = owned.PeerAddress();
  conn->accepted = absl::Now();
  absl::StatusOr<std::unique_ptr<Endpoint>> ep = Endpoint::Accept(
      self->loop_->worker(), &owned, &DataPlane::OnEndpointError, self);
  if (!ep.ok()) return;
  conn->ep = *std::move(ep);
  self->connection_by_ep_[conn->ep->get()] = conn->id;
  self->connections_[conn->id] = std::move(conn);
  self->connection_count_.store(
      static_cast<uint32_t>(self->connections_.size()));
}

void DataPlane::OnEndpointError(void* arg, ucp_ep_h ep,
                                ucs_status_t status) noexcept {
  auto* self = static_cast<DataPlane*>(arg);
  auto it = self->connection_by_ep_.find(ep);
  if (it == self->connection_by_ep_.end()) return;
  uint64_t conn_id = it->second;
  // Closing from inside a UCX callback is not allowed: defer it.
  self->loop_->Post(
      [self, conn_id] { self->CloseConnection(conn_id, "peer failed"); });
}

DataPlane::Connection* DataPlane::FindConnection(ucp_ep_h ep) {
  auto it = connection_by_ep_.find(ep);
  if (it != connection_by_ep_.end()) {
    auto conn = connections_.find(it->second);
    return conn == connections_.end() ? nullptr : conn->second.get();
  }
  {
    MutexLock lock(&mu_);
    if (draining_) return nullptr;
  }
  // A peer that connected to the worker's address: UCX made this endpoint
  // for it. It is ours now, and it is on probation like any other.
  auto conn = std::make_unique<Connection>();
  conn->id = next_connection_id_++;
  conn->accepted = absl::Now();
  conn->ep = Endpoint::Adopt(ep);
  conn->adopted = true;
  Connection* raw = conn.get();
  connection_by_ep_[ep] = conn->id;
  connections_[conn->id] = std::move(conn);
  connection_count_.store(static_cast<uint32_t>(connections_.size()));
  return raw;
}

void DataPlane::CloseConnection(uint64_t conn_id, const char* why) {
  // Deferred to a task so that no UCX callback destroys its own endpoint.
  // Once stopping, the post is refused and Stop() closes every connection.
  loop_->Post([this, conn_id, why] {
    auto it = connections_.find(conn_id);
    if (it == connections_.end()) return;
    if (!it->second->authenticated) {
      rejected_connections_.fetch_add(1);
      LogInfo(absl::StrCat("closed a UCX data-plane connection",
                           it->second->peer.empty() ? "" : " from ",
                           it->second->peer, ": ", why));
    }
    std::unique_ptr<Connection> conn = std::move(it->second);
    connections_.erase(it);
    buffer_key_count_.fetch_sub(
        static_cast<uint32_t>(conn->buffer_keys.size()));
    conn->buffer_keys.clear();  // before its endpoints
    connection_by_ep_.erase(conn->ep->get());
    if (conn->put_ep != nullptr) {
      connection_by_ep_.erase(conn->put_ep->get());
      conn->put_ep.reset();
    }
    connection_count_.store(static_cast<uint32_t>(connections_.size()));
    conn.reset();  // force close: its operations fail now
    DropConnectionSessions(conn_id);
  });
}

// A write whose blocks have all landed needs its connection no more: it
// stays for its commit, bounded by its lease deadline (another call of the
// client may have closed the connection the client's threads share). A
// write still waiting for blocks fails now: its store write is aborted and
// its staging freed, and the session stays behind, empty, so that its
// commit answers UNAVAILABLE (begin again) rather than the stale-lease
// code; Expire drops it at its deadline.
void DataPlane::DropConnectionSessions(uint64_t conn_id) {
  std::vector<std::function<void()>> work;
  std::vector<store::WriteClaim> aborted;
  std::vector<std::shared_ptr<StagingBuffer>> freed;
  {
    MutexLock lock(&mu_);
    std::vector<uint64_t> waited;
    for (auto& [id, session] : writes_) {
      WriteSession& s = *session;
      // It stays bound to the dead connection: no other can touch it.
      if (s.conn_id != conn_id) continue;
      if (s.error.ok() && s.awaiting == 0 && s.in_flight == 0) continue;
      if (s.error.ok()) {
        s.error = absl::UnavailableError(
            "the data-plane connection of this write closed before every "
            "block arrived; begin the write again");
      }
      if (s.waiter) {
        waited.push_back(id);
        continue;
      }
      // Receives still in flight hold their own buffers.
      aborted.push_back(std::move(s.claim));
      for (std::shared_ptr<StagingBuffer>& b : s.buffers) {
        if (b != nullptr) freed.push_back(std::move(b));
      }
    }
    for (uint64_t id : waited) {
      if (std::function<void()> w = TakeForCommitLocked(id)) {
        work.push_back(std::move(w));
      }
    }
  }
  for (auto& w : work) w();
  // `aborted` and `freed` end here, outside the lock.
  // Reads bound to the connection end when their flush fails (the
  // endpoint was force-closed); reads not started are not bound yet.
}

// ---------------------------------------------------------------- expiry

void DataPlane::CloseStalledOrphansLocked(
    absl::Time now, std::vector<uint64_t>* close,
    std::vector<std::shared_ptr<WriteSession>>* seen) {
  auto ended = [&](const std::weak_ptr<WriteSession>& weak) {
    std::shared_ptr<WriteSession> s = weak.lock();
    if (s == nullptr) return true;
    // Held until the caller unlocks: the receive may drop its reference
    // meanwhile, and a session is not destroyed under mu_.
    seen->push_back(s);
    if (s->in_flight == 0) return true;
    if (now < s->deadline) return false;
    if (s->conn_id != 0) close->push_back(s->conn_id);
    return true;
  };
  receiving_orphans_.erase(std::remove_if(receiving_orphans_.begin(),
                                          receiving_orphans_.end(), ended),
                           receiving_orphans_.end());
}

void DataPlane::Expire(absl::Time now) {
  std::vector<std::function<void()>> work;
  std::vector<std::shared_ptr<WriteSession>> expired_writes;
  std::vector<std::shared_ptr<WriteSession>> orphans_seen;
  std::vector<std::shared_ptr<ReadSession>> expired_reads;
  std::vector<uint64_t> close;
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    std::vector<uint64_t> ids;
    for (auto& [id, session] : writes_) {
      if (session->waiter && now >= session->commit_deadline) {
        if (session->error.ok()) {
          session->error = absl::DeadlineExceededError(
              "not every block arrived before the commit's deadline");
        }
        ids.push_back(id);
      } else if (!session->waiter && now >= session->deadline) {
        expired_writes.push_back(session);
      } else if (now >= session->deadline && session->in_flight > 0 &&
                 session->conn_id != 0) {
        close.push_back(session->conn_id);  // a commit waits on a stall
      }
    }
    for (uint64_t id : ids) {
      if (std::function<void()> w = TakeForCommitLocked(id)) {
        work.push_back(std::move(w));
      }
    }
    // After the commits above: a failed one may have just made an orphan.
    CloseStalledOrphansLocked(now, &close, &orphans_seen);
    for (auto& s : expired_writes) {
      writes_.erase(s->id);
      if (s->in_flight > 0 && s->conn_id != 0) close.push_back(s->conn_id);
    }
    for (auto& [id, session] : reads_) {
      if (now < session->deadline) continue;
      if (session->state == ReadSession::State::kWaiting) {
        expired_reads.push_back(session);
      } else if (session->conn_id != 0) {
        close.push_back(session->conn_id);  // stuck mid-transfer
      }
    }
    for (auto& s : expired_reads) reads_.erase(s->id);
  }
  for (auto& w : work) w();
  // Their claims go now (aborting the writes, ending the reads), not when
  // an operation still in flight drops its last reference.
  for (auto& s : expired_writes) s->claim = store::WriteClaim();
  for (auto& s : expired_reads) s->claim = store::ReadClaim();
  for (uint64_t id : close) CloseConnection(id, "session expired mid-transfer");
  const absl::Duration handshake = options_.handshake_timeout;
  loop_->Post([this, now, handshake] {
    std::vector<uint64_t> idle;
    for (auto& [id, conn] : connections_) {
      if (!conn->authenticated && now - conn->accepted > handshake) {
        idle.push_back(id);
      }
    }
    for (uint64_t id : idle) CloseConnection(id, "no token presented in time");
  });
}

}  // namespace kvcache::ucx
