#include "kvcache/client.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "client/ucx/client_plane.h"
#include "grpcpp/grpcpp.h"
#include "kernels/codec.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "proto/convert.h"
#include "transport/tcp_segments.h"

namespace kvcache {
namespace {

constexpr char kRetryAfterKey[] = "kvcache-retry-after-ms";
constexpr char kRetryPayloadUrl[] = "type.kvcache.dev/retry-after-ms";
// How long a Put whose blocks the node pulls from the caller's buffer waits,
// after its deadline or a failure, for the node to confirm it stopped
// reading them (as a Read abandoned over shared memory does).
constexpr absl::Duration kPulledWriteGrace = absl::Seconds(5);

// Bytes of a CommitWrite beyond its payloads (keys, framing).
constexpr size_t kMessageSlack = 64 << 10;
// The longest a best-effort cleanup RPC (AbortWrite, EndRead) may take.
constexpr absl::Duration kCleanupTimeout = absl::Seconds(5);
// How long a kAuto client keeps off the data plane of a node it could not
// use: UCX TCP segment sizes that do not fit its own, or a data-plane
// address that does not answer (a restart or a fix may change either).
constexpr absl::Duration kUnusablePlaneRetry = absl::Seconds(30);

std::chrono::system_clock::time_point Chrono(absl::Time t) {
  if (t == absl::InfiniteFuture()) {
    return std::chrono::system_clock::time_point::max();
  }
  return absl::ToChronoTime(t);
}

// The deadline and cancel token of one Client call.
struct CallScope {
  absl::Time deadline;
  CancelToken* cancel = nullptr;

  bool cancelled() const { return cancel != nullptr && cancel->cancelled(); }
};

absl::Status CallerCancelled() {
  return absl::CancelledError("cancelled by the caller");
}

// Cancels a ClientContext from a CancelToken callback, which may run on
// another thread at any time: the context is forgotten (under the mutex)
// before the call that owns it returns.
class ContextCanceller {
 public:
  explicit ContextCanceller(grpc::ClientContext* ctx) : ctx_(ctx) {}
  void Cancel() {
    MutexLock lock(&mu_);
    if (ctx_ != nullptr) ctx_->TryCancel();
  }
  void Forget() {
    MutexLock lock(&mu_);
    ctx_ = nullptr;
  }

 private:
  Mutex mu_;
  grpc::ClientContext* ctx_ ABSL_GUARDED_BY(mu_);
};

// The node sends only codecs it knows; anything else reads as fp16.
Codec CodecFromProto(v1::Codec codec) {
  return proto::CodecFromProto(codec).value_or(Codec::kNone);
}

// The one gRPC -> absl mapping of the client (same code numbers).
absl::Status FromGrpc(const grpc::Status& status,
                      const grpc::ClientContext& ctx) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()),
                   status.error_message());
  const auto& trailers = ctx.GetServerTrailingMetadata();
  if (auto it = trailers.find(kRetryAfterKey); it != trailers.end()) {
    out.SetPayload(
        kRetryPayloadUrl,
        absl::Cord(std::string(it->second.data(), it->second.size())));
  }
  return out;
}

}  // namespace

std::optional<int> RetryAfterMs(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kResourceExhausted) {
    return std::nullopt;
  }
  absl::optional<absl::Cord> payload = status.GetPayload(kRetryPayloadUrl);
  int ms = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &ms)) {
    return std::nullopt;
  }
  return ms;
}

absl::Status DecodeRaw(const GetResult& result, const BlockData& block,
                       absl::Span<uint16_t> fp16_out) {
  if (block.format != ReadFormat::kRaw) {
    return absl::InvalidArgumentError("block was not read in raw format");
  }
  CodecPolicy policy = result.policy;
  if (block.codec != policy.codec) {
    if (block.codec != Codec::kNone) {
      return absl::InvalidArgumentError(
          "block codec differs from its namespace's and is not fp16");
    }
    policy = CodecPolicy{};  // in the residual window: stored as fp16
  }
  return kernels::DecodeBlock(
      result.shape, policy,
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(block.bytes.data()),
                          block.bytes.size()),
      fp16_out);
}

namespace {

// The metadata of a BeginRead answer for `keys`: shape, policy, missing
// keys, and the blocks' keys, positions, codecs and formats (bytes left
// empty). INTERNAL when the answer does not fit the request.
absl::StatusOr<GetResult> MetadataFrom(const std::vector<std::string>& keys,
                                       bool allow_missing,
                                       const v1::BeginReadResponse& response) {
  GetResult result;
  result.shape = proto::ShapeFromProto(response.layout());
  result.policy =
      proto::PolicyFromProto(response.codec_policy()).value_or(CodecPolicy{});
  if (!allow_missing && response.missing_size() > 0) {
    return absl::InternalError("the node listed missing keys unasked");
  }
  if (static_cast<size_t>(response.blocks_size()) +
          static_cast<size_t>(response.missing_size()) !=
      keys.size()) {
    return absl::InternalError(absl::StrCat(
        "asked for ", keys.size(), " blocks, node sent ",
        response.blocks_size(), " and ", response.missing_size(), " missing"));
  }
  for (int m = 0; m < response.missing_size(); ++m) {
    const uint32_t index = response.missing(m);
    if (index >= keys.size() || (m > 0 && index <= response.missing(m - 1))) {
      return absl::InternalError("the node's missing list is malformed");
    }
    result.missing.push_back(index);
  }
  uint32_t index = 0;
  size_t next_missing = 0;
  for (const v1::BlockData& b : response.blocks()) {
    while (next_missing < result.missing.size() &&
           result.missing[next_missing] == index) {
      ++next_missing;
      ++index;
    }
    if (b.key() != keys[index]) {
      return absl::InternalError(
          absl::StrCat("the node answered block ", index, " with another key"));
    }
    BlockData block;
    block.key = b.key();
    block.index = index++;
    block.codec = CodecFromProto(b.codec());
    block.format = b.format() == v1::READ_FORMAT_RAW ? ReadFormat::kRaw
                                                     : ReadFormat::kFp16;
    result.blocks.push_back(std::move(block));
  }
  return result;
}

bool OverDataPlane(const v1::BeginReadResponse& response) {
  return response.has_data_plane() &&
         !response.data_plane().ucx_address().empty();
}

// Layer reports a data-plane read of `response` ends with.
uint32_t PlaneLayers(const v1::BeginReadResponse& response) {
  int layers = 1;
  for (const v1::BlockData& b : response.blocks()) {
    layers = std::max(layers, b.layer_end_offsets_size());
  }
  return static_cast<uint32_t>(layers);
}

// The host part of a gRPC target ("dns:///host:port", "ipv4:host:port",
// "host:port", "[v6]:port").
std::string TargetHost(absl::string_view target) {
  if (size_t slash = target.rfind('/'); slash != absl::string_view::npos) {
    target = target.substr(slash + 1);
  }
  for (absl::string_view scheme : {"ipv4:", "ipv6:", "dns:"}) {
    if (absl::StartsWith(target, scheme)) target.remove_prefix(scheme.size());
  }
  size_t colon = target.rfind(':');
  if (colon == absl::string_view::npos) return std::string(target);
  if (target.front() == '[' || target.find(':') == colon) {
    return std::string(target.substr(0, colon));
  }
  return std::string(target);  // a bare IPv6 address without a port
}

// Blocks packed into one region start on cache lines.
uint64_t CacheLineRound(uint64_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvCache::Stub> stub;

  Mutex plane_mu;
  std::unique_ptr<ucx::ClientPlane> plane ABSL_GUARDED_BY(plane_mu);  // lazy
  absl::Status plane_error ABSL_GUARDED_BY(plane_mu);                 // sticky
  // kAuto: the node's data plane cannot be used from here (its UCX TCP
  // segment sizes would abort one of us, transport/tcp_segments.h; or it
  // does not answer, ucx::kConnectTimeout); calls go inline without asking
  // for it until then, so that each does not first open a UCX session only
  // to drop it (or wait for a connection).
  absl::Time plane_refused_until ABSL_GUARDED_BY(plane_mu) =
      absl::InfinitePast();

  // Registered DataBuffers by first byte.
  struct Buffer {
    size_t size;
    uint64_t id;
    std::weak_ptr<ucx::MemoryRegion> region;
  };
  // Nodes (NodeAddress::key) that refused to map a buffer of this client:
  // writes to them send their blocks.
  Mutex pull_mu;
  absl::flat_hash_set<std::string> pull_refused ABSL_GUARDED_BY(pull_mu);
  bool PullRefused(const std::string& node) {
    MutexLock lock(&pull_mu);
    return pull_refused.contains(node);
  }
  void RefusePulls(const std::string& node) {
    MutexLock lock(&pull_mu);
    pull_refused.insert(node);
  }

  Mutex buffers_mu;
  std::map<uintptr_t, Buffer> buffers ABSL_GUARDED_BY(buffers_mu);
  uint64_t next_buffer_id ABSL_GUARDED_BY(buffers_mu) = 1;

  // The memory of DataBuffers (and so of Get's landing zones): registered
  // regions kept for reuse once freed, so that a node keeps their keys
  // (ReadStartHeader::buffer_id) and no read pays for a fresh mapping. At
  // most options.max_idle_buffer_bytes idle.
  struct Landing {
    std::shared_ptr<ucx::MemoryRegion> region;
    uint64_t id = 0;
  };
  std::multimap<size_t, Landing> idle_landings ABSL_GUARDED_BY(buffers_mu);
  size_t idle_landing_bytes ABSL_GUARDED_BY(buffers_mu) = 0;

  // An idle region of [bytes, 2 * bytes) or a fresh one.
  absl::StatusOr<Landing> TakeLanding(ucx::ClientPlane* plane, size_t bytes) {
    {
      MutexLock lock(&buffers_mu);
      auto it = idle_landings.lower_bound(bytes);
      if (it != idle_landings.end() && it->first < 2 * bytes) {
        Landing landing = std::move(it->second);
        idle_landing_bytes -= it->first;
        idle_landings.erase(it);
        return landing;
      }
    }
    absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> region =
        plane->Allocate(bytes);
    if (!region.ok()) return region.status();
    Landing landing;
    landing.region = *std::move(region);
    MutexLock lock(&buffers_mu);
    landing.id = next_buffer_id++;
    return landing;
  }
  // Keeps `landing` for reuse when nothing else holds it (a read that
  // outlived its call still might) and the idle bound allows; otherwise
  // the node is told to drop its key and the region goes with its last
  // holder.
  void GiveBackLanding(ucx::ClientPlane* plane, Landing landing) {
    const size_t size = landing.region->size();
    {
      MutexLock lock(&buffers_mu);
      if (landing.region.use_count() == 1 &&
          idle_landing_bytes + size <= options.max_idle_buffer_bytes) {
        idle_landing_bytes += size;
        idle_landings.emplace(size, std::move(landing));
        return;
      }
    }
    plane->ReleaseBuffer(landing.id);
  }

  // The registered DataBuffer region holding [data, data + n), if any, and
  // its id.
  std::shared_ptr<ucx::MemoryRegion> BufferHolding(const uint8_t* data,
                                                   size_t n, uint64_t* id) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(data);
    MutexLock lock(&buffers_mu);
    auto it = buffers.upper_bound(start);
    if (it == buffers.begin()) return nullptr;
    --it;
    if (start + n > it->first + it->second.size) return nullptr;
    *id = it->second.id;
    return it->second.region.lock();
  }

  // Copies the blocks of `sends` into one DataBuffer from `client`'s pool,
  // points `pulls` (same order) at the copies, and returns its region (its
  // id in *buffer_id, the buffer in *staged), or null when no registered
  // memory could be had.
  std::shared_ptr<ucx::MemoryRegion> StageForPull(
      Client* client, absl::Span<const ucx::ClientPlane::Block> sends,
      absl::Span<ucx::ClientPlane::PullBlock> pulls,
      std::unique_ptr<DataBuffer>* staged, uint64_t* buffer_id) {
    uint64_t total = 0;
    for (const ucx::ClientPlane::Block& b : sends) {
      total += CacheLineRound(b.bytes.size());
    }
    absl::StatusOr<std::unique_ptr<DataBuffer>> buffer =
        client->AllocateBuffer(total);
    if (!buffer.ok()) return nullptr;
    std::shared_ptr<ucx::MemoryRegion> region =
        BufferHolding((*buffer)->data(), (*buffer)->size(), buffer_id);
    if (region == nullptr) return nullptr;
    uint8_t* at = (*buffer)->data();
    for (size_t j = 0; j < sends.size(); ++j) {
      std::memcpy(at, sends[j].bytes.data(), sends[j].bytes.size());
      pulls[j].address = reinterpret_cast<uintptr_t>(at);
      at += CacheLineRound(sends[j].bytes.size());
    }
    *staged = *std::move(buffer);
    return region;
  }

  CallScope Scope(const CallOptions& call) const {
    return CallScope{CallDeadline(call, options.timeout), call.cancel.get()};
  }

  // One unary RPC of a call: its deadline on the context, its cancel token
  // wired to TryCancel for as long as the RPC runs.
  absl::Status Rpc(const CallScope& scope,
                   absl::FunctionRef<grpc::Status(grpc::ClientContext*)> rpc) {
    if (scope.cancelled()) return CallerCancelled();
    if (absl::Now() >= scope.deadline) {
      return absl::DeadlineExceededError("the call's deadline has passed");
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(Chrono(scope.deadline));
    auto canceller = std::make_shared<ContextCanceller>(&ctx);
    const uint64_t id =
        scope.cancel == nullptr
            ? 0
            : scope.cancel->AddCallback([canceller] { canceller->Cancel(); });
    grpc::Status status = rpc(&ctx);
    if (scope.cancel != nullptr) scope.cancel->RemoveCallback(id);
    canceller->Forget();
    absl::Status st = FromGrpc(status, ctx);
    if (st.code() == absl::StatusCode::kCancelled && scope.cancelled()) {
      return CallerCancelled();
    }
    return st;
  }

  // For a write whose blocks the node pulls from this client's memory: ends
  // the write and returns once the node confirms that it no longer reads
  // them (its AbortWrite succeeds, or finds the write gone: committed or
  // dropped), bounded by kPulledWriteGrace. A node stops staging only
  // between blocks, and over shared memory nothing else stops it, so the
  // caller's buffer must not be given back before this.
  absl::Status EndPulledWrite(uint64_t write_id) {
    const absl::Time give_up = absl::Now() + kPulledWriteGrace;
    while (true) {
      v1::AbortWriteRequest request;
      request.set_write_id(write_id);
      v1::AbortWriteResponse response;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(
          std::min(give_up, absl::Now() + absl::Seconds(1))));
      const grpc::Status s = stub->AbortWrite(&ctx, request, &response);
      if (s.ok() || s.error_code() == grpc::StatusCode::NOT_FOUND) {
        return absl::OkStatus();
      }
      if (absl::Now() >= give_up) {
        return absl::InternalError(absl::StrCat(
            "could not confirm that the node stopped reading the buffer of "
            "write ",
            write_id, ": ", s.error_message()));
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
  }

  // Best-effort cleanup RPCs: sent without waiting for the answer (the node
  // ends the lease at its TTL anyway), so a call never outlives its
  // deadline for them.
  void AbortWriteAsync(uint64_t write_id) {
    v1::AbortWriteRequest request;
    request.set_write_id(write_id);
    SendCleanup<v1::AbortWriteResponse>(
        std::move(request), [this](auto* ctx, auto* req, auto* resp,
                                   std::function<void(grpc::Status)> done) {
          stub->async()->AbortWrite(ctx, req, resp, std::move(done));
        });
  }
  void AbandonRead(uint64_t read_id) {
    if (read_id == 0) return;
    v1::EndReadRequest request;
    request.set_lease_id(read_id);
    SendCleanup<v1::EndReadResponse>(
        std::move(request), [this](auto* ctx, auto* req, auto* resp,
                                   std::function<void(grpc::Status)> done) {
          stub->async()->EndRead(ctx, req, resp, std::move(done));
        });
  }
  // Sends one unary request with the callback API and forgets it: the call's
  // state is owned by its callback, gone once the answer (or the deadline)
  // is in.
  template <typename Response, typename Request, typename Start>
  void SendCleanup(Request request, Start start) {
    struct Call {
      grpc::ClientContext ctx;
      Request request;
      Response response;
    };
    auto call = std::make_shared<Call>();
    call->request = std::move(request);
    call->ctx.set_deadline(
        Chrono(absl::Now() + std::min(options.timeout, kCleanupTimeout)));
    start(&call->ctx, &call->request, &call->response,
          [call](grpc::Status) mutable { call.reset(); });
  }

  // Whether to ask the node for the data plane: not with kGrpc, nor once
  // UCX could not start in this process (kAuto falls back for good then).
  bool WantDataPlane() {
    if (options.data_plane == DataPlane::kGrpc) return false;
    MutexLock lock(&plane_mu);
    return plane_error.ok();
  }

  // Whether a call asks the node for the data plane: WantDataPlane(), and
  // with kAuto not while that node's data plane is known unusable.
  bool AskForDataPlane() {
    if (!WantDataPlane()) return false;
    if (options.data_plane != DataPlane::kAuto) return true;
    MutexLock lock(&plane_mu);
    return absl::Now() >= plane_refused_until;
  }
  // A data-plane attempt that kAuto answers inline failed with `status`.
  // A segment-size refusal or a connection that never came up stands until
  // the node may have changed: asked again after kUnusablePlaneRetry.
  void NoteFallback(const absl::Status& status) {
    if (!ucx::IsTcpSegmentsMismatch(status) &&
        !ucx::IsDataPlaneNotConnected(status)) {
      return;
    }
    MutexLock lock(&plane_mu);
    plane_refused_until = absl::Now() + kUnusablePlaneRetry;
  }

  // The UCX side of this client, started on first use.
  absl::StatusOr<ucx::ClientPlane*> Plane() {
    MutexLock lock(&plane_mu);
    if (plane != nullptr) return plane.get();
    if (!plane_error.ok()) return plane_error;
    absl::StatusOr<std::unique_ptr<ucx::ClientPlane>> created =
        ucx::ClientPlane::Create();
    if (!created.ok()) {
      plane_error = absl::UnavailableError(absl::StrCat(
          "cannot start UCX in this process: ", created.status().message()));
      return plane_error;
    }
    plane = *std::move(created);
    return plane.get();
  }

  // How to reach the node's data plane; a listener advertised as ":port"
  // is on the host of the gRPC target.
  ucx::NodeAddress Resolve(const v1::DataPlaneInfo& info) const {
    ucx::NodeAddress address;
    address.listener = info.ucx_address();
    if (!address.listener.empty() && address.listener.front() == ':') {
      address.listener = TargetHost(options.target) + address.listener;
    }
    address.worker = info.worker_address();
    address.bounded_reads = info.bounded_reads();
    address.pull_writes = info.pull_writes();
    address.message_reads = info.message_reads();
    address.tcp_segments.tx_bytes = info.tcp_tx_seg_bytes();
    address.tcp_segments.rx_bytes = info.tcp_rx_seg_bytes();
    return address;
  }

  // A BeginRead and its metadata. Over the data plane (when the node
  // answered with one) the read lease stays open until the transfer ends or
  // AbandonRead; a failure here has abandoned it already.
  struct Begun {
    v1::BeginReadResponse response;
    GetResult metadata;
  };
  absl::StatusOr<Begun> BeginRead(const std::string& ns,
                                  const std::vector<std::string>& keys,
                                  const ReadOptions& read, uint64_t pin_lease,
                                  bool inline_data, const CallScope& scope) {
    v1::BeginReadRequest request;
    request.set_namespace_name(ns);
    for (const std::string& k : keys) request.add_keys(k);
    request.set_format(read.format == ReadFormat::kRaw ? v1::READ_FORMAT_RAW
                                                       : v1::READ_FORMAT_FP16);
    request.set_pin_lease_id(pin_lease);
    request.set_inline_data(inline_data);
    request.set_allow_missing(read.allow_missing);
    Begun begun;
    absl::Status st = Rpc(scope, [&](grpc::ClientContext* ctx) {
      return stub->BeginRead(ctx, request, &begun.response);
    });
    if (!st.ok()) return st;
    absl::StatusOr<GetResult> metadata =
        MetadataFrom(keys, read.allow_missing, begun.response);
    if (!metadata.ok()) {
      if (OverDataPlane(begun.response)) AbandonRead(begun.response.read_id());
      return metadata.status();
    }
    begun.metadata = *std::move(metadata);
    return begun;
  }

  // Starts the transfer of a data-plane read into `region`, block i at
  // region->data() + offsets[i].
  absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> StartRead(
      ucx::ClientPlane* ucx_plane, const v1::BeginReadResponse& response,
      std::shared_ptr<ucx::MemoryRegion> region,
      const std::vector<uint64_t>& offsets, bool per_layer,
      uint64_t buffer_id = 0) {
    absl::StatusOr<ucx::Token> token =
        ucx::TokenFromBytes(response.data_plane().token());
    if (!token.ok()) return token.status();
    std::vector<uint64_t> destinations;
    const uint64_t base = reinterpret_cast<uintptr_t>(region->data());
    for (uint64_t offset : offsets) destinations.push_back(base + offset);
    return ucx_plane->StartRead(Resolve(response.data_plane()),
                                response.read_id(), *token, std::move(region),
                                destinations, PlaneLayers(response), per_layer,
                                buffer_id);
  }

  // An inline answer from a node that should have used the data plane.
  absl::Status CheckInline(bool wanted, const v1::BeginReadResponse& response) {
    if (wanted && options.data_plane == DataPlane::kUcx &&
        response.blocks_size() > 0) {
      return absl::FailedPreconditionError(
          "the node offers no UCX data plane and the client requires one");
    }
    return absl::OkStatus();
  }
};

struct PendingRead::Impl {
  GetResult metadata;
  std::vector<BlockPlacement> placements;
  absl::Time deadline;
  std::shared_ptr<CancelToken> cancel;
  uint32_t plane_layers = 1;
  std::unique_ptr<ucx::ClientPlane::Read> read;  // null: inline, all there
};

PendingRead::PendingRead(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PendingRead::~PendingRead() = default;

absl::Status PendingRead::WaitLayer(uint32_t layer) {
  if (layer >= num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " of a ", num_layers(), "-layer block"));
  }
  if (impl_->read == nullptr) return absl::OkStatus();
  return impl_->read->WaitLayers(std::min(layer + 1, impl_->plane_layers),
                                 impl_->deadline, impl_->cancel.get());
}

absl::Status PendingRead::Wait() {
  if (impl_->read == nullptr) return absl::OkStatus();
  return impl_->read->WaitLayers(impl_->plane_layers, impl_->deadline,
                                 impl_->cancel.get());
}

uint32_t PendingRead::num_layers() const {
  return std::max<uint32_t>(1, impl_->metadata.shape.num_layers);
}
const GetResult& PendingRead::metadata() const { return impl_->metadata; }
const std::vector<BlockPlacement>& PendingRead::placements() const {
  return impl_->placements;
}
bool PendingRead::over_data_plane() const { return impl_->read != nullptr; }

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const ClientOptions& options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("ClientOptions.target is empty");
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ClientOptions.timeout must be > 0");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  impl->channel = grpc::CreateCustomChannel(
      options.target, grpc::InsecureChannelCredentials(), args);
  impl->stub = v1::KvCache::NewStub(impl->channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<NamespaceInfo> Client::RegisterNamespace(
    const NamespaceSpec& spec, const CallOptions& call) {
  v1::RegisterNamespaceRequest request;
  v1::NamespaceSpec* s = request.mutable_spec();
  s->set_name(spec.name);
  s->set_model(spec.model);
  s->set_revision(spec.revision);
  s->set_tp_rank(spec.tp_rank);
  proto::ShapeToProto(spec.shape, s->mutable_layout());
  if (spec.policy.has_value()) {
    const CodecPolicy& p = *spec.policy;
    v1::CodecPolicy* out = s->mutable_codec_policy();
    proto::PolicyToProto(p, out);
    if (spec.residual_tokens.has_value()) {
      out->set_residual_tokens(*spec.residual_tokens);
    }
  }
  v1::RegisterNamespaceResponse response;
  absl::Status st =
      impl_->Rpc(impl_->Scope(call), [&](grpc::ClientContext* ctx) {
        return impl_->stub->RegisterNamespace(ctx, request, &response);
      });
  if (!st.ok()) return st;
  NamespaceInfo info;
  info.fingerprint = response.fingerprint();
  info.already_registered = response.already_registered();
  info.codec = CodecFromProto(response.effective_codec());
  info.fp16_block_bytes = response.fp16_block_bytes();
  info.encoded_block_bytes = response.encoded_block_bytes();
  return info;
}

absl::StatusOr<LookupResult> Client::Lookup(
    const std::string& ns, const std::vector<std::string>& keys, bool pin,
    const CallOptions& call) {
  v1::LookupRequest request;
  request.set_namespace_name(ns);
  for (const std::string& k : keys) request.add_keys(k);
  request.set_pin(pin);
  v1::LookupResponse response;
  absl::Status st =
      impl_->Rpc(impl_->Scope(call), [&](grpc::ClientContext* ctx) {
        return impl_->stub->Lookup(ctx, request, &response);
      });
  if (!st.ok()) return st;
  return LookupResult{response.prefix_blocks(), response.lease_id()};
}

absl::StatusOr<PutResult> Client::Put(const std::string& ns,
                                      absl::Span<const BlockWrite> blocks,
                                      const CallOptions& call) {
  PutResult total;
  if (blocks.empty()) return absl::InvalidArgumentError("no blocks to put");
  const CallScope scope = impl_->Scope(call);
  // One begin/commit round trip per batch that fits in a message.
  size_t begin = 0;
  while (begin < blocks.size()) {
    size_t end = begin;
    size_t bytes = 0;
    const size_t budget =
        static_cast<size_t>(impl_->options.max_message_bytes) - kMessageSlack;
    while (end < blocks.size() &&
           (end == begin || bytes + blocks[end].fp16.size() * 2 <= budget)) {
      bytes += blocks[end].fp16.size() * 2;
      ++end;
    }
    v1::BeginWriteRequest begin_request;
    begin_request.set_namespace_name(ns);
    begin_request.set_use_data_plane(impl_->AskForDataPlane());
    for (size_t i = begin; i < end; ++i) {
      v1::BlockRef* ref = begin_request.add_blocks();
      ref->set_key(blocks[i].key);
      std::string parent = blocks[i].parent_key;
      if (parent.empty() && i == begin && i > 0) parent = blocks[i - 1].key;
      ref->set_parent_key(parent);
    }
    v1::BeginWriteResponse begin_response;
    absl::Status begun = impl_->Rpc(scope, [&](grpc::ClientContext* ctx) {
      return impl_->stub->BeginWrite(ctx, begin_request, &begin_response);
    });
    if (!begun.ok()) return begun;
    auto present = [&](size_t local) {
      return local < static_cast<size_t>(begin_response.present_size()) &&
             begin_response.present(static_cast<int>(local));
    };
    bool sent = false;      // the bytes went over the data plane
    bool pulled = false;    // ... and the node takes them from a DataBuffer
    std::string pull_node;  // when pulled: the node's NodeAddress::key()
    // Blocks copied into a DataBuffer of the client's pool for a node that
    // pulls (see below); declared before `regions` so that it goes back to
    // the pool after them, when nothing else holds its region.
    std::unique_ptr<DataBuffer> staged;
    // Blocks that lie in a DataBuffer go with its registration (held until
    // the commit has answered: a node that pulls reads the buffer until
    // then).
    std::vector<std::shared_ptr<ucx::MemoryRegion>> regions;
    if (begin_response.has_data_plane() &&
        !begin_response.data_plane().ucx_address().empty()) {
      const ucx::NodeAddress node = impl_->Resolve(begin_response.data_plane());
      std::vector<ucx::ClientPlane::Block> sends;
      std::vector<ucx::ClientPlane::PullBlock> pulls;
      // Pulls need every block in one DataBuffer.
      uint64_t pull_buffer = 0;
      bool pullable = node.pull_writes && !impl_->PullRefused(node.key());
      for (size_t i = begin; i < end; ++i) {
        if (present(i - begin)) continue;
        const auto* data =
            reinterpret_cast<const uint8_t*>(blocks[i].fp16.data());
        const size_t size = blocks[i].fp16.size() * sizeof(uint16_t);
        uint64_t buffer_id = 0;
        std::shared_ptr<ucx::MemoryRegion> region =
            impl_->BufferHolding(data, size, &buffer_id);
        ucp_mem_h memh = nullptr;
        if (region != nullptr) {
          memh = region->memh();
          if (pulls.empty()) pull_buffer = buffer_id;
          pullable = pullable && buffer_id == pull_buffer;
          regions.push_back(std::move(region));
        } else {
          pullable = false;
        }
        sends.push_back({static_cast<uint32_t>(i - begin),
                         absl::MakeConstSpan(data, size), memh});
        pulls.push_back({static_cast<uint32_t>(i - begin),
                         reinterpret_cast<uintptr_t>(data)});
      }
      pullable = pullable && !pulls.empty();
      if (!pullable && !pulls.empty() && node.pull_writes &&
          !impl_->PullRefused(node.key())) {
        // Blocks outside one DataBuffer, to a node that may share memory
        // with us: one copy into a pooled DataBuffer here, and the node
        // encodes from it, where UCX's rendezvous over shared memory would
        // copy each block twice (kvcache-bench --put-source=heap,
        // docs/benchmarks.md). A node that cannot map it refuses once.
        uint64_t staged_id = 0;
        std::shared_ptr<ucx::MemoryRegion> region = impl_->StageForPull(
            this, sends, absl::MakeSpan(pulls), &staged, &staged_id);
        if (region != nullptr) {
          regions.insert(regions.begin(), std::move(region));
          pull_buffer = staged_id;
          pullable = true;
        }
      }
      absl::Status st = [&]() -> absl::Status {
        // Once sent, the bytes travel to the end (bounded by the deadline):
        // a cancel does not cut a transfer short.
        if (scope.cancelled()) return CallerCancelled();
        absl::StatusOr<ucx::ClientPlane*> ucx_plane = impl_->Plane();
        if (!ucx_plane.ok()) return ucx_plane.status();
        absl::StatusOr<ucx::Token> token =
            ucx::TokenFromBytes(begin_response.data_plane().token());
        if (!token.ok()) return token.status();
        if (pullable) {
          pulled = true;
          pull_node = node.key();
          return (*ucx_plane)
              ->PullBlocks(node, begin_response.write_id(), *token,
                           *regions.front(), pull_buffer, pulls,
                           scope.deadline);
        }
        return (*ucx_plane)
            ->SendBlocks(node, begin_response.write_id(), *token, sends,
                         scope.deadline);
      }();
      sent = st.ok();
      if (!st.ok() && pulled) {
        // The node may have the request and be reading the buffer.
        if (absl::Status ended =
                impl_->EndPulledWrite(begin_response.write_id());
            !ended.ok()) {
          return ended;
        }
        if (st.code() == absl::StatusCode::kUnavailable &&
            impl_->options.data_plane == DataPlane::kAuto) {
          impl_->NoteFallback(st);
          impl_->RefusePulls(pull_node);
          continue;  // again without a pull, which then falls back inline
        }
        return st;
      }
      // kAuto: a data plane this process cannot reach sends inline with
      // the same lease (the node drops the staging then). Anything else
      // ends the write.
      if (!st.ok() && (impl_->options.data_plane == DataPlane::kUcx ||
                       st.code() != absl::StatusCode::kUnavailable)) {
        impl_->AbortWriteAsync(begin_response.write_id());
        return st;
      }
      if (!st.ok()) impl_->NoteFallback(st);
    } else if (impl_->options.data_plane == DataPlane::kUcx) {
      impl_->AbortWriteAsync(begin_response.write_id());
      return absl::FailedPreconditionError(
          "the node offers no UCX data plane and the client requires one");
    }
    v1::CommitWriteRequest commit;
    commit.set_write_id(begin_response.write_id());
    for (size_t i = begin; i < end && !sent; ++i) {
      size_t local = i - begin;
      if (present(local)) continue;
      v1::BlockPayload* p = commit.add_payloads();
      p->set_index(static_cast<uint32_t>(local));
      p->set_fp16(reinterpret_cast<const char*>(blocks[i].fp16.data()),
                  blocks[i].fp16.size() * sizeof(uint16_t));
    }
    v1::CommitWriteResponse commit_response;
    absl::Status st = impl_->Rpc(scope, [&](grpc::ClientContext* ctx) {
      return impl_->stub->CommitWrite(ctx, commit, &commit_response);
    });
    if (!st.ok() && pulled && st.code() == absl::StatusCode::kUnimplemented) {
      // The node could not map the buffer (no shared memory between us):
      // it has dropped the write; send this batch again, and from now on.
      impl_->RefusePulls(pull_node);
      continue;
    }
    if (!st.ok() && pulled) {
      // A commit cut short (deadline, cancel) may still be waiting for the
      // node to finish reading the buffer: end the write and wait for that.
      if (absl::Status ended = impl_->EndPulledWrite(begin_response.write_id());
          !ended.ok()) {
        return ended;
      }
      return st;
    }
    if (!st.ok()) {
      // Not committed, or not known to be: a commit cut short may still
      // complete on the node; otherwise the lease ends at its TTL.
      if (st.code() != absl::StatusCode::kDeadlineExceeded &&
          st.code() != absl::StatusCode::kCancelled) {
        impl_->AbortWriteAsync(begin_response.write_id());
      }
      return st;
    }
    total.stored += commit_response.blocks_stored();
    total.skipped += commit_response.blocks_skipped();
    total.stored_bytes += commit_response.stored_bytes();
    begin = end;
  }
  return total;
}

absl::StatusOr<GetResult> Client::Get(const std::string& ns,
                                      const std::vector<std::string>& keys,
                                      ReadFormat format, uint64_t pin_lease) {
  ReadOptions read;
  read.format = format;
  read.pin_lease = pin_lease;
  return Get(ns, keys, read);
}

absl::StatusOr<GetResult> Client::Get(const std::string& ns,
                                      const std::vector<std::string>& keys,
                                      const ReadOptions& read,
                                      const CallOptions& call) {
  const CallScope scope = impl_->Scope(call);
  // One read: over the data plane when the node offers it, inline
  // otherwise (and, with kAuto, when the data plane cannot be reached).
  auto once = [&](const ReadOptions& r) -> absl::StatusOr<GetResult> {
    const bool want = impl_->AskForDataPlane();
    absl::StatusOr<Impl::Begun> begun = impl_->BeginRead(
        ns, keys, r, r.pin_lease, /*inline_data=*/!want, scope);
    if (!begun.ok()) return begun.status();
    v1::BeginReadResponse& response = begun->response;
    GetResult& result = begun->metadata;
    if (!OverDataPlane(response)) {
      if (absl::Status s = impl_->CheckInline(want, response); !s.ok()) {
        return s;
      }
      for (int i = 0; i < response.blocks_size(); ++i) {
        result.blocks[i].bytes =
            std::move(*response.mutable_blocks(i)->mutable_data());
      }
      return std::move(result);
    }
    // Over the data plane: into a region UCX allocates (shared memory where a
    // transport offers it), then copied out into the result's strings.
    std::vector<uint64_t> offsets;
    uint64_t total = 0;
    for (const v1::BlockData& b : response.blocks()) {
      offsets.push_back(total);
      total += CacheLineRound(b.length());
    }
    absl::Status st = [&]() -> absl::Status {
      absl::StatusOr<ucx::ClientPlane*> ucx_plane = impl_->Plane();
      if (!ucx_plane.ok()) return ucx_plane.status();
      // A DataBuffer from the client's pool: the node keeps its key, and it
      // goes back to the pool when this read is over.
      absl::StatusOr<std::unique_ptr<DataBuffer>> landing =
          AllocateBuffer(std::max<uint64_t>(total, 64));
      if (!landing.ok()) return landing.status();
      const uint8_t* base = (*landing)->data();
      uint64_t buffer_id = 0;
      std::shared_ptr<ucx::MemoryRegion> region =
          impl_->BufferHolding(base, (*landing)->size(), &buffer_id);
      if (region == nullptr) {
        return absl::UnavailableError("no registered memory for the read");
      }
      absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> transfer =
          impl_->StartRead(*ucx_plane, response, std::move(region), offsets,
                           /*per_layer=*/false, buffer_id);
      if (!transfer.ok()) return transfer.status();
      // Not cut short by a cancel: an abandoned transfer would close the
      // connection (and, without peer failure handling, could not stop the
      // node's puts into the region). Bounded by the deadline.
      absl::Status done =
          (*transfer)->WaitLayers((*transfer)->num_layers(), scope.deadline);
      if (!done.ok()) return done;
      if (scope.cancelled()) return CallerCancelled();
      for (int i = 0; i < response.blocks_size(); ++i) {
        result.blocks[i].bytes.assign(
            reinterpret_cast<const char*>(base + offsets[i]),
            response.blocks(i).length());
      }
      return absl::OkStatus();
    }();
    if (st.ok()) return std::move(result);
    // kAuto: when the data plane cannot be reached, read inline instead (a
    // pin lease, if any, was taken over by the first attempt).
    impl_->AbandonRead(response.read_id());
    if (impl_->options.data_plane == DataPlane::kAuto &&
        st.code() == absl::StatusCode::kUnavailable) {
      impl_->NoteFallback(st);
      absl::StatusOr<Impl::Begun> again =
          impl_->BeginRead(ns, keys, r, 0, /*inline_data=*/true, scope);
      if (!again.ok()) return again.status();
      for (int i = 0; i < again->response.blocks_size(); ++i) {
        again->metadata.blocks[i].bytes =
            std::move(*again->response.mutable_blocks(i)->mutable_data());
      }
      return std::move(again->metadata);
    }
    return st;
  };
  absl::StatusOr<GetResult> got = once(read);
  if (!got.ok() && ucx::IsFreshConnectionReset(got.status()) &&
      !scope.cancelled() && absl::Now() < scope.deadline) {
    // The connection was reset before it carried any transfer (a node
    // resuming from a pause resets the connections it tears down): once
    // more, on a new one. The first attempt took over a pin lease, if any.
    ReadOptions again = read;
    again.pin_lease = 0;
    got = once(again);
  }
  return got;
}

absl::StatusOr<std::unique_ptr<PendingRead>> Client::GetInto(
    const std::string& ns, const std::vector<std::string>& keys,
    ReadFormat format, absl::Span<uint8_t> dest, size_t stride,
    uint64_t pin_lease) {
  ReadOptions read;
  read.format = format;
  read.pin_lease = pin_lease;
  return GetInto(ns, keys, read, dest, stride);
}

absl::StatusOr<std::unique_ptr<PendingRead>> Client::GetInto(
    const std::string& ns, const std::vector<std::string>& keys,
    const ReadOptions& read, absl::Span<uint8_t> dest, size_t stride,
    const CallOptions& call) {
  if (keys.empty()) return absl::InvalidArgumentError("no keys to read");
  if (stride == 0 || dest.size() / stride < keys.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a buffer of ", dest.size(), " bytes does not hold ",
                     keys.size(), " blocks of stride ", stride));
  }
  const CallScope scope = impl_->Scope(call);
  // The pending read of an answer: metadata and placements; inline bytes
  // are copied into `dest` here.
  auto pending = [&](Impl::Begun& begun, bool over_plane)
      -> absl::StatusOr<std::unique_ptr<PendingRead::Impl>> {
    const v1::BeginReadResponse& response = begun.response;
    auto impl = std::make_unique<PendingRead::Impl>();
    impl->deadline = scope.deadline;
    impl->cancel = call.cancel;
    impl->plane_layers = PlaneLayers(response);
    for (int j = 0; j < response.blocks_size(); ++j) {
      const v1::BlockData& b = response.blocks(j);
      BlockPlacement placement;
      placement.offset =
          static_cast<uint64_t>(begun.metadata.blocks[j].index) * stride;
      placement.length = b.length();
      placement.layer_ends.assign(b.layer_end_offsets().begin(),
                                  b.layer_end_offsets().end());
      if (placement.layer_ends.empty()) {
        placement.layer_ends.push_back(b.length());
      }
      const uint64_t bytes = over_plane ? b.length() : b.data().size();
      if (bytes > stride) {
        return absl::InvalidArgumentError(
            absl::StrCat("block ", begun.metadata.blocks[j].index, " has ",
                         bytes, " bytes, more than the stride of ", stride));
      }
      if (!over_plane) {
        std::memcpy(dest.data() + placement.offset, b.data().data(),
                    b.data().size());
      }
      impl->placements.push_back(std::move(placement));
    }
    impl->metadata = std::move(begun.metadata);
    return impl;
  };

  const bool want = impl_->AskForDataPlane();
  absl::StatusOr<Impl::Begun> begun = impl_->BeginRead(
      ns, keys, read, read.pin_lease, /*inline_data=*/!want, scope);
  if (!begun.ok()) return begun.status();
  const bool over_plane = OverDataPlane(begun->response);
  if (!over_plane) {
    if (absl::Status s = impl_->CheckInline(want, begun->response); !s.ok()) {
      return s;
    }
    absl::StatusOr<std::unique_ptr<PendingRead::Impl>> impl =
        pending(*begun, false);
    if (!impl.ok()) return impl.status();
    return std::make_unique<PendingRead>(*std::move(impl));
  }
  const v1::BeginReadResponse& response = begun->response;
  absl::StatusOr<std::unique_ptr<PendingRead::Impl>> impl =
      pending(*begun, true);
  if (!impl.ok()) {
    impl_->AbandonRead(response.read_id());
    return impl.status();
  }
  absl::Status st = [&]() -> absl::Status {
    if (scope.cancelled()) return CallerCancelled();
    absl::StatusOr<ucx::ClientPlane*> ucx_plane = impl_->Plane();
    if (!ucx_plane.ok()) return ucx_plane.status();
    // A DataBuffer is registered already; other memory is registered for
    // this read only, and its remote key dies with the read.
    uint64_t buffer_id = 0;
    std::shared_ptr<ucx::MemoryRegion> region =
        impl_->BufferHolding(dest.data(), keys.size() * stride, &buffer_id);
    if (region == nullptr) {
      absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> registered =
          (*ucx_plane)->Register(dest.data(), keys.size() * stride);
      if (!registered.ok()) return registered.status();
      region = *std::move(registered);
    }
    const uint64_t skip = static_cast<uint64_t>(dest.data() - region->data());
    std::vector<uint64_t> offsets;
    for (const BlockPlacement& p : (*impl)->placements) {
      offsets.push_back(skip + p.offset);
    }
    absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> transfer =
        impl_->StartRead(*ucx_plane, response, std::move(region), offsets,
                         /*per_layer=*/true, buffer_id);
    if (!transfer.ok()) return transfer.status();
    (*impl)->read = *std::move(transfer);
    return absl::OkStatus();
  }();
  if (st.ok()) return std::make_unique<PendingRead>(*std::move(impl));
  impl_->AbandonRead(response.read_id());
  // kAuto: when the data plane cannot be reached, read inline instead (a
  // pin lease, if any, was taken over by the first attempt).
  if (impl_->options.data_plane == DataPlane::kAuto &&
      st.code() == absl::StatusCode::kUnavailable) {
    impl_->NoteFallback(st);
    absl::StatusOr<Impl::Begun> again =
        impl_->BeginRead(ns, keys, read, 0, /*inline_data=*/true, scope);
    if (!again.ok()) return again.status();
    absl::StatusOr<std::unique_ptr<PendingRead::Impl>> inline_impl =
        pending(*again, false);
    if (!inline_impl.ok()) return inline_impl.status();
    return std::make_unique<PendingRead>(*std::move(inline_impl));
  }
  return st;
}

struct DataBuffer::Impl {
  std::shared_ptr<ucx::MemoryRegion> region;  // null: plain memory
  std::unique_ptr<uint8_t[]> plain;
  size_t size = 0;
  std::function<void()> unregister;
};

DataBuffer::DataBuffer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DataBuffer::~DataBuffer() {
  if (impl_->unregister) impl_->unregister();
}
absl::Span<uint8_t> DataBuffer::span() const {
  return absl::MakeSpan(
      impl_->region != nullptr ? impl_->region->data() : impl_->plain.get(),
      impl_->size);
}
bool DataBuffer::registered() const { return impl_->region != nullptr; }

absl::StatusOr<std::unique_ptr<DataBuffer>> Client::AllocateBuffer(
    size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a buffer of 0 bytes");
  auto impl = std::make_unique<DataBuffer::Impl>();
  impl->size = bytes;
  absl::StatusOr<ucx::ClientPlane*> ucx_plane =
      impl_->WantDataPlane() ? impl_->Plane()
                             : absl::StatusOr<ucx::ClientPlane*>(
                                   absl::FailedPreconditionError("gRPC only"));
  if (ucx_plane.ok()) {
    absl::StatusOr<Impl::Landing> landing =
        impl_->TakeLanding(*ucx_plane, bytes);
    if (!landing.ok()) return landing.status();
    impl->region = landing->region;
    const uintptr_t start = reinterpret_cast<uintptr_t>(impl->region->data());
    const uint64_t id = landing->id;
    {
      MutexLock lock(&impl_->buffers_mu);
      impl_->buffers[start] = {bytes, id, impl->region};
    }
    Impl* client = impl_.get();
    ucx::ClientPlane* plane = *ucx_plane;
    // Back to the pool (kept only when no read still holds it).
    impl->unregister = [client, plane, start, id, impl_raw = impl.get()] {
      {
        MutexLock lock(&client->buffers_mu);
        client->buffers.erase(start);
      }
      Impl::Landing back{std::move(impl_raw->region), id};
      client->GiveBackLanding(plane, std::move(back));
    };
  } else if (impl_->options.data_plane == DataPlane::kUcx) {
    return ucx_plane.status();
  } else {
    impl->plain = std::make_unique<uint8_t[]>(bytes);
  }
  return std::make_unique<DataBuffer>(std::move(impl));
}

absl::Status Client::Release(uint64_t pin_lease, const CallOptions& call) {
  v1::EndReadRequest request;
  request.set_lease_id(pin_lease);
  v1::EndReadResponse response;
  return impl_->Rpc(impl_->Scope(call), [&](grpc::ClientContext* ctx) {
    return impl_->stub->EndRead(ctx, request, &response);
  });
}

absl::StatusOr<uint32_t> Client::Delete(const std::string& ns,
                                        const std::vector<std::string>& keys,
                                        const CallOptions& call) {
  v1::DeleteRequest request;
  request.set_namespace_name(ns);
  for (const std::string& k : keys) request.add_keys(k);
  v1::DeleteResponse response;
  absl::Status st =
      impl_->Rpc(impl_->Scope(call), [&](grpc::ClientContext* ctx) {
        return impl_->stub->Delete(ctx, request, &response);
      });
  if (!st.ok()) return st;
  return response.deleted();
}

absl::StatusOr<NodeStats> Client::Stats(const CallOptions& call) {
  v1::StatsRequest request;
  v1::StatsResponse response;
  absl::Status st =
      impl_->Rpc(impl_->Scope(call), [&](grpc::ClientContext* ctx) {
        return impl_->stub->Stats(ctx, request, &response);
      });
  if (!st.ok()) return st;
  NodeStats s;
  s.capacity_bytes = response.capacity_bytes();
  s.used_bytes = response.used_bytes();
  s.reserved_bytes = response.reserved_bytes();
  s.pinned_bytes = response.pinned_bytes();
  s.fragmentation_bytes = response.fragmentation_bytes();
  for (const v1::CodecCapacity& c : response.codecs()) {
    CodecUsage u{c.blocks(), c.tokens(), c.stored_bytes(), c.logical_bytes()};
    s.codecs[std::string(kernels::CodecName(CodecFromProto(c.codec())))] = u;
  }
  for (const v1::NamespaceCapacity& n : response.namespaces()) {
    NamespaceUsage u;
    u.codec = CodecFromProto(n.codec());
    u.blocks = n.blocks();
    u.tokens = n.tokens();
    u.stored_bytes = n.stored_bytes();
    u.logical_bytes = n.logical_bytes();
    u.residual_blocks = n.residual_blocks();
    u.tokens_that_fit.insert(n.tokens_that_fit().begin(),
                             n.tokens_that_fit().end());
    s.namespaces[n.name()] = std::move(u);
  }
  s.evictions = response.evictions();
  s.data_loss_events = response.data_loss_events();
  s.lookup_hits = response.lookup_hits();
  s.lookup_misses = response.lookup_misses();
  return s;
}

}  // namespace kvcache
