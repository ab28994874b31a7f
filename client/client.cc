#include "kvcache/client.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/mutex.h"
#include "client/buffer_pool.h"
#include "client/client_impl.h"
#include "client/client_test_access.h"
#include "client/grpc_status.h"
#include "client/read_decode.h"
#include "client/ucx/client_plane.h"
#include "grpcpp/grpcpp.h"
#include "kernels/codec.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "proto/convert.h"
#include "transport/tcp_segments.h"

namespace kvcache {
namespace {

// How long a Put whose blocks the node pulls from the caller's buffer waits,
// after its deadline or a failure, for the node to confirm it stopped
// reading them (as a Read abandoned over shared memory does).
constexpr absl::Duration kPulledWriteGrace = absl::Seconds(5);

// The longest a best-effort cleanup RPC (AbortWrite, EndRead) may take.
constexpr absl::Duration kCleanupTimeout = absl::Seconds(5);
// How long ~Impl waits, once it has cancelled them, for those in flight.
// kCleanupTimeout and a second.
constexpr absl::Duration kCleanupWait = absl::Seconds(6);
// How long a kAuto client keeps off the data plane of a node it could not
// use: UCX TCP segment sizes that do not fit its own, or a data-plane
// address that does not answer (a restart or a fix may change either).
constexpr absl::Duration kUnusablePlaneRetry = absl::Seconds(30);

using internal::CacheLineRound;
using internal::CallerCancelled;
using internal::CallScope;
using internal::GrpcDeadline;

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

}  // namespace

absl::Status internal::CallerCancelled() {
  return absl::CancelledError("cancelled by the caller");
}

uint64_t internal::NewDataPlaneClientId() {
  std::random_device random;
  uint64_t id = 0;
  while (id == 0) id = (uint64_t{random()} << 32) ^ random();
  return id;
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
         internal::OffersDataPlane(response.data_plane());
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

}  // namespace

// ---------------------------------------------------------------------------
// Client::Impl

CallScope Client::Impl::Scope(const CallOptions& call) const {
  return CallScope{CallDeadline(call, options.timeout), call.cancel.get()};
}

absl::Status Client::Impl::Rpc(
    const CallScope& scope,
    absl::FunctionRef<grpc::Status(grpc::ClientContext*)> rpc) {
  if (scope.cancelled()) return CallerCancelled();
  if (absl::Now() >= scope.deadline) {
    return absl::DeadlineExceededError("the call's deadline has passed");
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(GrpcDeadline(scope.deadline));
  Authorize(&ctx);
  auto canceller = std::make_shared<ContextCanceller>(&ctx);
  const uint64_t id =
      scope.cancel == nullptr
          ? 0
          : scope.cancel->AddCallback([canceller] { canceller->Cancel(); });
  grpc::Status status = rpc(&ctx);
  if (scope.cancel != nullptr) scope.cancel->RemoveCallback(id);
  canceller->Forget();
  absl::Status st = internal::FromGrpc(status, ctx);
  if (st.code() == absl::StatusCode::kCancelled && scope.cancelled()) {
    return CallerCancelled();
  }
  return st;
}

absl::Status Client::Impl::EndPulledWrite(uint64_t write_id) {
  const absl::Time give_up = absl::Now() + kPulledWriteGrace;
  while (true) {
    v1::AbortWriteRequest request;
    request.set_write_id(write_id);
    v1::AbortWriteResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(
        absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Seconds(1))));
    Authorize(&ctx);
    const grpc::Status s = stub->AbortWrite(&ctx, request, &response);
    // Gone (aborted now, or committed or dropped before): FAILED_PRECONDITION,
    // the stale-lease code; NOT_FOUND from nodes before it. ABORTED: a
    // commit or a stage is still using the write: ask again.
    if (s.ok() || s.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
        s.error_code() == grpc::StatusCode::NOT_FOUND) {
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

Client::Impl::~Impl() {
  // Before the channel goes: cleanup_calls.h's invariant. A cancelled
  // call's callback runs within milliseconds; each ends by its deadline.
  if (cleanups.CancelAndWait(kCleanupWait)) return;
  // gRPC's callback threads are held up (by in-process servers' handlers,
  // say): a callback may still come, and must not drop the channel's last
  // reference. The channel is left open for the life of the process.
  LogError(absl::StrCat("kvcache client for ", options.target,
                        ": a cleanup call did not end within ",
                        absl::FormatDuration(kCleanupWait),
                        " of the client's destruction; its channel is kept"));
  static_cast<void>(
      std::make_unique<std::shared_ptr<grpc::Channel>>(channel).release());
}

void Client::Impl::AbortWriteAsync(uint64_t write_id) {
  v1::AbortWriteRequest request;
  request.set_write_id(write_id);
  cleanups.Send<v1::AbortWriteResponse>(
      std::min(options.timeout, kCleanupTimeout), std::move(request),
      [this](auto* ctx, auto* req, auto* resp,
             std::function<void(grpc::Status)> done) {
        Authorize(ctx);
        stub->async()->AbortWrite(ctx, req, resp, std::move(done));
      });
}

void Client::Impl::AbandonRead(uint64_t read_id) {
  if (read_id == 0) return;
  v1::EndReadRequest request;
  request.set_lease_id(read_id);
  cleanups.Send<v1::EndReadResponse>(
      std::min(options.timeout, kCleanupTimeout), std::move(request),
      [this](auto* ctx, auto* req, auto* resp,
             std::function<void(grpc::Status)> done) {
        Authorize(ctx);
        stub->async()->EndRead(ctx, req, resp, std::move(done));
      });
}

void Client::Impl::TellNodeIfUnsent(ucx::ClientPlane::Read& read,
                                    uint64_t read_id) {
  read.SetOnUnsent([this, read_id] { AbandonRead(read_id); });
}

bool Client::Impl::WantDataPlane() {
  if (options.data_plane == DataPlane::kGrpc) return false;
  MutexLock lock(&plane_mu);
  return plane_error.ok();
}

bool Client::Impl::AskForDataPlane() {
  if (!WantDataPlane()) return false;
  if (options.data_plane != DataPlane::kAuto) return true;
  MutexLock lock(&plane_mu);
  return absl::Now() >= plane_refused_until;
}

void Client::Impl::NoteFallback(const absl::Status& status) {
  if (!ucx::IsTcpSegmentsMismatch(status) &&
      !ucx::IsDataPlaneNotConnected(status)) {
    return;
  }
  MutexLock lock(&plane_mu);
  plane_refused_until = absl::Now() + kUnusablePlaneRetry;
}

absl::StatusOr<ucx::ClientPlane*> Client::Impl::Plane() {
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

absl::StatusOr<ucx::ClientPlane*> internal::ClientTestAccess::Plane(
    Client& client) {
  return client.impl_->Plane();
}

ucx::NodeAddress Client::Impl::Resolve(const v1::DataPlaneInfo& info) const {
  ucx::NodeAddress address;
  address.listener = info.ucx_address();
  if (!address.listener.empty() && address.listener.front() == ':') {
    address.listener = TargetHost(options.target) + address.listener;
  }
  address.worker = info.worker_address();
  address.bounded_reads = info.bounded_reads();
  address.pull_writes = info.pull_writes();
  address.message_reads = info.message_reads();
  address.sequenced_data = info.sequenced_data();
  address.decodes_into_destination = info.decodes_into_destination();
  address.keeps_named_buffers = info.keeps_named_buffers();
  address.tcp_segments.tx_bytes = info.tcp_tx_seg_bytes();
  address.tcp_segments.rx_bytes = info.tcp_rx_seg_bytes();
  return address;
}

bool Client::Impl::PullRefused(const std::string& node) {
  MutexLock lock(&pull_mu);
  return pull_refused.contains(node);
}

void Client::Impl::RefusePulls(const std::string& node) {
  MutexLock lock(&pull_mu);
  pull_refused.insert(node);
}

ReadOptions Client::Impl::OnTheWire(const ReadOptions& read) const {
  ReadOptions wire = read;
  if (options.decode_on_client && read.format == ReadFormat::kFp16) {
    wire.format = ReadFormat::kRaw;
  }
  return wire;
}

bool Client::Impl::NodeDecodesInto(absl::Span<const uint8_t> dest) {
  if (!options.decode_on_client) return false;
  std::string node;
  {
    MutexLock lock(&read_node_mu);
    node = read_node;
  }
  ucx::ClientPlane* ucx_plane;
  {
    MutexLock lock(&plane_mu);
    ucx_plane = plane.get();
  }
  uint64_t buffer_id = 0;
  return ucx_plane != nullptr && !node.empty() &&
         ucx_plane->MapsDestinations(node).value_or(false) &&
         buffers.Holding(dest.data(), dest.size(), &buffer_id) != nullptr;
}

absl::StatusOr<Client::Impl::Begun> Client::Impl::BeginRead(
    const std::string& ns, const std::vector<std::string>& keys,
    const ReadOptions& read, uint64_t pin_lease, bool inline_data,
    const CallScope& scope, bool decode_into_destination) {
  v1::BeginReadRequest request;
  request.set_namespace_name(ns);
  request.set_namespace_fingerprint(FingerprintOf(ns));
  for (const std::string& k : keys) request.add_keys(k);
  request.set_format(read.format == ReadFormat::kRaw ? v1::READ_FORMAT_RAW
                                                     : v1::READ_FORMAT_FP16);
  request.set_pin_lease_id(pin_lease);
  request.set_inline_data(inline_data);
  if (!inline_data) request.set_data_plane_client(data_plane_client);
  request.set_allow_missing(read.allow_missing);
  request.set_decode_into_destination(decode_into_destination);
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

absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> Client::Impl::StartRead(
    ucx::ClientPlane* ucx_plane, const v1::BeginReadResponse& response,
    std::shared_ptr<ucx::MemoryRegion> region,
    const std::vector<uint64_t>& offsets, bool per_layer, uint64_t buffer_id,
    ucx::NamedRegion named) {
  absl::StatusOr<ucx::Token> token =
      ucx::TokenFromBytes(response.data_plane().token());
  if (!token.ok()) return token.status();
  std::vector<uint64_t> destinations;
  const uint64_t base = reinterpret_cast<uintptr_t>(region->data());
  for (uint64_t offset : offsets) destinations.push_back(base + offset);
  const ucx::NodeAddress node = Resolve(response.data_plane());
  {
    MutexLock lock(&read_node_mu);
    read_node = node.key();
  }
  return ucx_plane->StartRead(
      node, response.read_id(), *token, std::move(region), destinations,
      PlaneLayers(response), per_layer, buffer_id, named);
}

uint64_t Client::Impl::FingerprintOf(const std::string& ns) {
  MutexLock lock(&fingerprints_mu);
  auto it = fingerprints.find(ns);
  return it == fingerprints.end() ? 0 : it->second;
}

void Client::Impl::RememberFingerprint(const std::string& ns,
                                       uint64_t fingerprint) {
  if (fingerprint == 0) return ForgetFingerprint(ns);
  MutexLock lock(&fingerprints_mu);
  fingerprints[ns] = fingerprint;
}

void Client::Impl::ForgetFingerprint(const std::string& ns) {
  MutexLock lock(&fingerprints_mu);
  fingerprints.erase(ns);
}

absl::Status Client::Impl::CheckInline(bool wanted,
                                       const v1::BeginReadResponse& response) {
  if (wanted && options.data_plane == DataPlane::kUcx &&
      response.blocks_size() > 0) {
    return absl::FailedPreconditionError(
        "the node offers no UCX data plane and the client requires one");
  }
  return absl::OkStatus();
}

struct PendingRead::Impl {
  GetResult metadata;
  std::vector<BlockPlacement> placements;
  absl::Time deadline;
  std::shared_ptr<CancelToken> cancel;
  uint32_t plane_layers = 1;
  // A read decoded on the client (ClientOptions::decode_on_client) whose
  // blocks travel raw: the DataBuffer they land in and the decoder that
  // turns them into fp16 in the caller's memory. Declared before `read`,
  // so that the transfer has ended before its landing buffer goes back to
  // the pool.
  std::unique_ptr<DataBuffer> landing;
  std::unique_ptr<internal::LayerDecoder> decoder;
  // The node reports each layer (ReadOptions::layer_by_layer); else once.
  bool layer_by_layer = false;
  std::unique_ptr<ucx::ClientPlane::Read> read;  // null: inline, all there
};

PendingRead::PendingRead(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PendingRead::~PendingRead() = default;

absl::Status PendingRead::WaitLayer(uint32_t layer) {
  if (layer >= num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " of a ", num_layers(), "-layer block"));
  }
  if (impl_->read != nullptr) {
    absl::Status st =
        impl_->read->WaitLayers(std::min(layer + 1, impl_->plane_layers),
                                impl_->deadline, impl_->cancel.get());
    if (!st.ok()) return st;
  }
  if (impl_->decoder == nullptr) return absl::OkStatus();
  return impl_->decoder->DecodeThrough(layer + 1);
}

absl::Status PendingRead::Wait() {
  if (impl_->decoder != nullptr && impl_->read != nullptr &&
      impl_->layer_by_layer) {
    // Decoded on the client: each layer as soon as it has landed, while the
    // node still sends the later ones (a read reported layer by layer).
    for (uint32_t layer = 0; layer < num_layers(); ++layer) {
      if (absl::Status st = WaitLayer(layer); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  if (impl_->read != nullptr) {
    absl::Status st = impl_->read->WaitLayers(
        impl_->plane_layers, impl_->deadline, impl_->cancel.get());
    if (!st.ok()) return st;
  }
  if (impl_->decoder == nullptr) return absl::OkStatus();
  return impl_->decoder->DecodeThrough(num_layers());
}

uint32_t PendingRead::num_layers() const {
  return std::max<uint32_t>(1, impl_->metadata.shape.num_layers);
}
const GetResult& PendingRead::metadata() const { return impl_->metadata; }
const std::vector<BlockPlacement>& PendingRead::placements() const {
  return impl_->placements;
}
bool PendingRead::over_data_plane() const { return impl_->read != nullptr; }

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path);
  std::stringstream out;
  if (in) out << in.rdbuf();
  if (!in || out.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TlsOptions.", what, " ", path, ": cannot be read or is empty"));
  }
  return out.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const TlsOptions& tls) {
  if (!tls.enabled()) {
    if (!tls.cert_file.empty() || !tls.key_file.empty()) {
      return absl::InvalidArgumentError(
          "TlsOptions: a client certificate needs ca_file too");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TlsOptions: cert_file and key_file go together");
  }
  grpc::SslCredentialsOptions ssl;
  absl::StatusOr<std::string> ca = ReadPem(tls.ca_file, "ca_file");
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *std::move(ca);
  if (!tls.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem(tls.cert_file, "cert_file");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem(tls.key_file, "key_file");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

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
  for (char c : options.bearer_token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          "ClientOptions.bearer_token holds a space or a character that is "
          "not printable ASCII");
    }
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  auto impl = std::make_unique<Impl>(options);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (!options.tls.server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls.server_name);
  }
  impl->channel = grpc::CreateCustomChannel(options.target, *credentials, args);
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
  impl_->RememberFingerprint(spec.name, response.fingerprint());
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
  request.set_namespace_fingerprint(impl_->FingerprintOf(ns));
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

absl::StatusOr<GetResult> Client::Get(const std::string& ns,
                                      const std::vector<std::string>& keys,
                                      ReadFormat format, uint64_t pin_lease) {
  ReadOptions read;
  read.format = format;
  read.pin_lease = pin_lease;
  return Get(ns, keys, read);
}

namespace {

// The blocks of an inline answer, bytes moved into its metadata.
GetResult WithInlineBytes(v1::BeginReadResponse& response, GetResult result) {
  for (int i = 0; i < response.blocks_size(); ++i) {
    result.blocks[i].bytes =
        std::move(*response.mutable_blocks(i)->mutable_data());
  }
  return result;
}

}  // namespace

absl::StatusOr<Client::Impl::Landing> Client::Impl::LandingFor(
    Client* client, const v1::BeginReadResponse& response) {
  Landing landing;
  uint64_t total = 0;
  for (const v1::BlockData& b : response.blocks()) {
    landing.offsets.push_back(total);
    total += CacheLineRound(b.length());
  }
  absl::StatusOr<std::unique_ptr<DataBuffer>> buffer =
      client->AllocateBuffer(std::max<uint64_t>(total, 64));
  if (!buffer.ok()) return buffer.status();
  landing.buffer = *std::move(buffer);
  landing.region = buffers.Holding(landing.buffer->data(),
                                   landing.buffer->size(), &landing.buffer_id);
  if (landing.region == nullptr) {
    return absl::UnavailableError("no registered memory for the read");
  }
  return landing;
}

absl::Status Client::Impl::ReadIntoResult(Client* client,
                                          const v1::BeginReadResponse& response,
                                          const CallScope& scope,
                                          GetResult& result) {
  absl::StatusOr<ucx::ClientPlane*> ucx_plane = Plane();
  if (!ucx_plane.ok()) return ucx_plane.status();
  absl::StatusOr<Landing> landing = LandingFor(client, response);
  if (!landing.ok()) return landing.status();
  const uint8_t* base = landing->buffer->data();
  const std::vector<uint64_t>& offsets = landing->offsets;
  absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> transfer =
      StartRead(*ucx_plane, response, std::move(landing->region), offsets,
                /*per_layer=*/false, landing->buffer_id);
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
}

absl::StatusOr<GetResult> Client::Impl::GetOnce(
    Client* client, const std::string& ns, const std::vector<std::string>& keys,
    const ReadOptions& asked, const CallScope& scope) {
  const ReadOptions read = OnTheWire(asked);
  const bool want = AskForDataPlane();
  absl::StatusOr<Begun> begun =
      BeginRead(ns, keys, read, read.pin_lease, /*inline_data=*/!want, scope);
  if (!begun.ok()) return begun.status();
  v1::BeginReadResponse& response = begun->response;
  // Raw blocks of a read asked for in fp16 are decoded here (read_decode.h).
  auto as_asked = [&](GetResult result) -> absl::StatusOr<GetResult> {
    if (read.format != asked.format) {
      if (absl::Status s = internal::DecodeResultToFp16(result); !s.ok()) {
        return s;
      }
    }
    return result;
  };
  if (!OverDataPlane(response)) {
    if (absl::Status s = CheckInline(want, response); !s.ok()) return s;
    return as_asked(WithInlineBytes(response, std::move(begun->metadata)));
  }
  // Over the data plane: into a region UCX allocates (shared memory where a
  // transport offers it), then copied out into the result's strings.
  absl::Status st = ReadIntoResult(client, response, scope, begun->metadata);
  if (st.ok()) return as_asked(std::move(begun->metadata));
  // kAuto: when the data plane cannot be reached, read inline instead (a
  // pin lease, if any, was taken over by the first attempt).
  AbandonRead(response.read_id());
  if (options.data_plane == DataPlane::kAuto &&
      st.code() == absl::StatusCode::kUnavailable) {
    NoteFallback(st);
    absl::StatusOr<Begun> again =
        BeginRead(ns, keys, read, 0, /*inline_data=*/true, scope);
    if (!again.ok()) return again.status();
    return as_asked(
        WithInlineBytes(again->response, std::move(again->metadata)));
  }
  return st;
}

absl::StatusOr<GetResult> Client::Get(const std::string& ns,
                                      const std::vector<std::string>& keys,
                                      const ReadOptions& read,
                                      const CallOptions& call) {
  const CallScope scope = impl_->Scope(call);
  // One read: over the data plane when the node offers it, inline
  // otherwise (and, with kAuto, when the data plane cannot be reached).
  absl::StatusOr<GetResult> got = impl_->GetOnce(this, ns, keys, read, scope);
  if (!got.ok() && ucx::IsFreshConnectionReset(got.status()) &&
      !scope.cancelled() && absl::Now() < scope.deadline) {
    // The connection was reset before it carried any transfer (a node
    // resuming from a pause resets the connections it tears down): once
    // more, on a new one. The first attempt took over a pin lease, if any.
    ReadOptions again = read;
    again.pin_lease = 0;
    got = impl_->GetOnce(this, ns, keys, again, scope);
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

namespace {

// Where each layer of an fp16 block of `shape` ends.
std::vector<uint64_t> Fp16LayerEnds(const BlockShape& shape) {
  const uint64_t bytes = kernels::Fp16BlockBytes(shape);
  std::vector<uint64_t> ends;
  for (uint32_t l = 1; l <= shape.num_layers; ++l) {
    ends.push_back(bytes / shape.num_layers * l);
  }
  return ends;
}

// One raw block of an answer asked for in fp16, as fp16 into `slot`.
absl::Status DecodeInto(const GetResult& metadata, const BlockData& block,
                        absl::string_view raw, absl::Span<uint8_t> slot) {
  absl::StatusOr<CodecPolicy> policy =
      internal::StoredPolicy(metadata.policy, block.codec);
  if (!policy.ok()) return policy.status();
  return internal::DecodeRawLayers(
      metadata.shape, *policy,
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(raw.data()),
                          raw.size()),
      0, metadata.shape.num_layers, slot);
}

// The pending read of an answer: metadata and placements (block i of the
// keys at dest[i * stride]); inline bytes are copied into `dest` here.
// `decode`: the answer is raw for a read asked for in fp16
// (ClientOptions::decode_on_client): placements and formats are fp16 ones,
// and inline blocks are decoded into `dest` here.
absl::StatusOr<std::unique_ptr<PendingRead::Impl>> MakePending(
    const v1::BeginReadResponse& response, GetResult metadata, bool over_plane,
    bool decode, absl::Span<uint8_t> dest, size_t stride,
    const CallScope& scope, std::shared_ptr<CancelToken> cancel) {
  auto impl = std::make_unique<PendingRead::Impl>();
  impl->deadline = scope.deadline;
  impl->cancel = std::move(cancel);
  impl->plane_layers = PlaneLayers(response);
  const uint64_t fp16_bytes = kernels::Fp16BlockBytes(metadata.shape);
  for (int j = 0; j < response.blocks_size(); ++j) {
    const v1::BlockData& b = response.blocks(j);
    BlockData& block = metadata.blocks[j];
    BlockPlacement placement;
    placement.offset = static_cast<uint64_t>(block.index) * stride;
    placement.length = decode ? fp16_bytes : b.length();
    if (decode) {
      placement.layer_ends = Fp16LayerEnds(metadata.shape);
      block.format = ReadFormat::kFp16;
    } else {
      placement.layer_ends.assign(b.layer_end_offsets().begin(),
                                  b.layer_end_offsets().end());
    }
    if (placement.layer_ends.empty()) {
      placement.layer_ends.push_back(placement.length);
    }
    const uint64_t bytes = decode       ? fp16_bytes
                           : over_plane ? b.length()
                                        : b.data().size();
    if (bytes > stride) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", block.index, " has ", bytes,
                       " bytes, more than the stride of ", stride));
    }
    if (!over_plane && decode) {
      absl::Status st = DecodeInto(metadata, block, b.data(),
                                   dest.subspan(placement.offset, fp16_bytes));
      if (!st.ok()) return st;
    } else if (!over_plane) {
      std::memcpy(dest.data() + placement.offset, b.data().data(),
                  b.data().size());
    }
    impl->placements.push_back(std::move(placement));
  }
  impl->metadata = std::move(metadata);
  return impl;
}

// Whether a data-plane read of `response` must land somewhere else than
// the caller's memory: its blocks travel raw for an fp16 read, and one of
// them is encoded.
bool LandsRaw(const v1::BeginReadResponse& response, bool decode) {
  if (!decode) return false;
  for (const v1::BlockData& b : response.blocks()) {
    if (b.codec() != v1::CODEC_NONE) return true;
  }
  return false;
}

}  // namespace

absl::Status Client::Impl::StartReadInto(const v1::BeginReadResponse& response,
                                         absl::Span<uint8_t> dest, size_t bytes,
                                         bool layer_by_layer,
                                         const CallScope& scope,
                                         PendingRead::Impl& pending) {
  if (scope.cancelled()) return CallerCancelled();
  absl::StatusOr<ucx::ClientPlane*> ucx_plane = Plane();
  if (!ucx_plane.ok()) return ucx_plane.status();
  // A DataBuffer is registered already; other memory is registered for
  // this read only, and its remote key dies with the read.
  uint64_t buffer_id = 0;
  std::shared_ptr<ucx::MemoryRegion> region =
      buffers.Holding(dest.data(), bytes, &buffer_id);
  if (region == nullptr) {
    absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> registered =
        (*ucx_plane)->Register(dest.data(), bytes);
    if (!registered.ok()) return registered.status();
    region = *std::move(registered);
  }
  const uint64_t skip = static_cast<uint64_t>(dest.data() - region->data());
  std::vector<uint64_t> offsets;
  for (const BlockPlacement& p : pending.placements) {
    offsets.push_back(skip + p.offset);
  }
  absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> transfer =
      StartRead(*ucx_plane, response, std::move(region), offsets,
                layer_by_layer, buffer_id);
  if (!transfer.ok()) return transfer.status();
  pending.read = *std::move(transfer);
  TellNodeIfUnsent(*pending.read, response.read_id());
  return absl::OkStatus();
}

absl::Status Client::Impl::StartDecodedReadInto(
    Client* client, const v1::BeginReadResponse& response,
    absl::Span<uint8_t> dest, bool layer_by_layer, const CallScope& scope,
    PendingRead::Impl& pending) {
  if (scope.cancelled()) return CallerCancelled();
  absl::StatusOr<ucx::ClientPlane*> ucx_plane = Plane();
  if (!ucx_plane.ok()) return ucx_plane.status();
  absl::StatusOr<Landing> landing = LandingFor(client, response);
  if (!landing.ok()) return landing.status();
  const GetResult& metadata = pending.metadata;
  const uint64_t fp16_bytes = kernels::Fp16BlockBytes(metadata.shape);
  std::vector<internal::LayerDecoder::Block> blocks;
  for (int j = 0; j < response.blocks_size(); ++j) {
    absl::StatusOr<CodecPolicy> policy =
        internal::StoredPolicy(metadata.policy, metadata.blocks[j].codec);
    if (!policy.ok()) return policy.status();
    const uint64_t raw_bytes = response.blocks(j).length();
    if (policy->codec == Codec::kNone && raw_bytes != fp16_bytes) {
      return absl::DataLossError(
          absl::StrCat("an fp16 block of ", raw_bytes, " bytes"));
    }
    blocks.push_back(
        {absl::MakeConstSpan(landing->buffer->data() + landing->offsets[j],
                             raw_bytes),
         *policy, dest.subspan(pending.placements[j].offset, fp16_bytes)});
  }
  pending.decoder = std::make_unique<internal::LayerDecoder>(metadata.shape,
                                                             std::move(blocks));
  pending.layer_by_layer = layer_by_layer;
  // A DataBuffer the blocks are decoded into is named to the node, which
  // maps it ahead of the reads it will decode into it itself
  // (NodeDecodesInto).
  ucx::NamedRegion named;
  uint64_t used = 0;  // the bytes of `dest` the read decodes into
  for (const BlockPlacement& p : pending.placements) {
    used = std::max<uint64_t>(used, p.offset + fp16_bytes);
  }
  const std::shared_ptr<ucx::MemoryRegion> dest_region =
      buffers.Holding(dest.data(), used, &named.buffer_id);
  named.region = dest_region.get();
  absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> transfer =
      StartRead(*ucx_plane, response, std::move(landing->region),
                landing->offsets, layer_by_layer, landing->buffer_id, named);
  if (!transfer.ok()) return transfer.status();
  pending.landing = std::move(landing->buffer);
  pending.read = *std::move(transfer);
  TellNodeIfUnsent(*pending.read, response.read_id());
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PendingRead>> Client::GetInto(
    const std::string& ns, const std::vector<std::string>& keys,
    const ReadOptions& asked, absl::Span<uint8_t> dest, size_t stride,
    const CallOptions& call) {
  if (keys.empty()) return absl::InvalidArgumentError("no keys to read");
  if (stride == 0 || dest.size() / stride < keys.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a buffer of ", dest.size(), " bytes does not hold ",
                     keys.size(), " blocks of stride ", stride));
  }
  const CallScope scope = impl_->Scope(call);
  // Decoded here, or (where the node writes into `dest` itself) by the node
  // straight into it.
  const bool node_decodes =
      asked.format == ReadFormat::kFp16 &&
      impl_->NodeDecodesInto(dest.first(keys.size() * stride));
  const ReadOptions read = node_decodes ? asked : impl_->OnTheWire(asked);
  const bool decode = read.format != asked.format;
  auto inline_read =
      [&](Impl::Begun& begun) -> absl::StatusOr<std::unique_ptr<PendingRead>> {
    absl::StatusOr<std::unique_ptr<PendingRead::Impl>> impl = MakePending(
        begun.response, std::move(begun.metadata),
        /*over_plane=*/false, decode, dest, stride, scope, call.cancel);
    if (!impl.ok()) return impl.status();
    return std::make_unique<PendingRead>(*std::move(impl));
  };
  const bool want = impl_->AskForDataPlane();
  absl::StatusOr<Impl::Begun> begun =
      impl_->BeginRead(ns, keys, read, read.pin_lease, /*inline_data=*/!want,
                       scope, /*decode_into_destination=*/node_decodes);
  if (!begun.ok()) return begun.status();
  if (!OverDataPlane(begun->response)) {
    if (absl::Status s = impl_->CheckInline(want, begun->response); !s.ok()) {
      return s;
    }
    return inline_read(*begun);
  }
  const v1::BeginReadResponse& response = begun->response;
  absl::StatusOr<std::unique_ptr<PendingRead::Impl>> impl =
      MakePending(response, std::move(begun->metadata), /*over_plane=*/true,
                  decode, dest, stride, scope, call.cancel);
  if (!impl.ok()) {
    impl_->AbandonRead(response.read_id());
    return impl.status();
  }
  absl::Status st =
      LandsRaw(response, decode)
          ? impl_->StartDecodedReadInto(this, response, dest,
                                        read.layer_by_layer, scope, **impl)
          : impl_->StartReadInto(response, dest, keys.size() * stride,
                                 read.layer_by_layer, scope, **impl);
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
    return inline_read(*again);
  }
  return st;
}

absl::StatusOr<std::unique_ptr<DataBuffer>> Client::AllocateBuffer(
    size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a buffer of 0 bytes");
  absl::StatusOr<ucx::ClientPlane*> ucx_plane =
      impl_->WantDataPlane() ? impl_->Plane()
                             : absl::StatusOr<ucx::ClientPlane*>(
                                   absl::FailedPreconditionError("gRPC only"));
  if (ucx_plane.ok()) return impl_->buffers.Allocate(*ucx_plane, bytes);
  if (impl_->options.data_plane == DataPlane::kUcx) return ucx_plane.status();
  return internal::BufferPool::AllocatePlain(bytes);
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
  request.set_namespace_fingerprint(impl_->FingerprintOf(ns));
  for (const std::string& k : keys) request.add_keys(k);
  v1::DeleteResponse response;
  absl::Status st =
      impl_->Rpc(impl_->Scope(call), [&](grpc::ClientContext* ctx) {
        return impl_->stub->Delete(ctx, request, &response);
      });
  if (!st.ok()) return st;
  return response.deleted();
}

absl::StatusOr<uint64_t> Client::DropNamespace(const std::string& ns,
                                               const CallOptions& call) {
  v1::DropNamespaceRequest request;
  request.set_namespace_name(ns);
  request.set_namespace_fingerprint(impl_->FingerprintOf(ns));
  v1::DropNamespaceResponse response;
  absl::Status st =
      impl_->Rpc(impl_->Scope(call), [&](grpc::ClientContext* ctx) {
        return impl_->stub->DropNamespace(ctx, request, &response);
      });
  if (!st.ok()) return st;
  impl_->ForgetFingerprint(ns);
  return response.blocks_dropped();
}

absl::StatusOr<std::string> ReadBearerTokenFile(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  const std::string token(absl::StripAsciiWhitespace(line));
  if (!in.good() && !in.eof()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, ": cannot be read"));
  }
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, ": cannot be read or is empty"));
  }
  return token;
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
  if (response.has_tenant()) {
    const v1::TenantUsage& t = response.tenant();
    s.tenant = TenantUsage{t.name(), t.pool_bytes_used(), t.pool_bytes_quota(),
                           t.namespaces(), t.max_namespaces()};
  }
  s.evictions = response.evictions();
  s.data_loss_events = response.data_loss_events();
  s.lookup_hits = response.lookup_hits();
  s.lookup_misses = response.lookup_misses();
  return s;
}

}  // namespace kvcache
