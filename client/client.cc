#include "kvcache/client.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/ucx/client_plane.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "proto/convert.h"

namespace kvcache {
namespace {

constexpr char kRetryAfterKey[] = "kvcache-retry-after-ms";
constexpr char kRetryPayloadUrl[] = "type.kvcache.dev/retry-after-ms";
// Bytes of a CommitWrite beyond its payloads (keys, framing).
constexpr size_t kMessageSlack = 64 << 10;

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

// The metadata of a BeginRead answer: shape, policy, and the blocks' keys,
// codecs and formats (bytes left empty).
GetResult MetadataFrom(const v1::BeginReadResponse& response) {
  GetResult result;
  result.shape = proto::ShapeFromProto(response.layout());
  result.policy =
      proto::PolicyFromProto(response.codec_policy()).value_or(CodecPolicy{});
  for (const v1::BlockData& b : response.blocks()) {
    BlockData block;
    block.key = b.key();
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

}  // namespace

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvCache::Stub> stub;

  std::mutex plane_mu;
  std::unique_ptr<ucx::ClientPlane> plane;  // guarded by plane_mu; lazy
  absl::Status plane_error;                 // guarded by plane_mu; sticky

  // Registered DataBuffers by first byte.
  struct Buffer {
    size_t size;
    uint64_t id;
    std::weak_ptr<ucx::MemoryRegion> region;
  };
  std::mutex buffers_mu;
  std::map<uintptr_t, Buffer> buffers;  // guarded by buffers_mu
  uint64_t next_buffer_id = 1;          // guarded by buffers_mu

  // The registered DataBuffer region holding [data, data + n), if any, and
  // its id.
  std::shared_ptr<ucx::MemoryRegion> BufferHolding(const uint8_t* data,
                                                   size_t n, uint64_t* id) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(data);
    std::lock_guard<std::mutex> lock(buffers_mu);
    auto it = buffers.upper_bound(start);
    if (it == buffers.begin()) return nullptr;
    --it;
    if (start + n > it->first + it->second.size) return nullptr;
    *id = it->second.id;
    return it->second.region.lock();
  }

  void Prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      absl::ToChronoMilliseconds(options.timeout));
  }
  absl::Time Deadline() const { return absl::Now() + options.timeout; }

  // Whether to ask the node for the data plane: not with kGrpc, nor once
  // UCX could not start in this process (kAuto falls back for good then).
  bool WantDataPlane() {
    if (options.data_plane == DataPlane::kGrpc) return false;
    std::lock_guard<std::mutex> lock(plane_mu);
    return plane_error.ok();
  }

  // The UCX side of this client, started on first use.
  absl::StatusOr<ucx::ClientPlane*> Plane() {
    std::lock_guard<std::mutex> lock(plane_mu);
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
    return address;
  }

  absl::StatusOr<v1::BeginReadResponse> BeginRead(
      const std::string& ns, const std::vector<std::string>& keys,
      ReadFormat format, uint64_t pin_lease, bool inline_data) {
    v1::BeginReadRequest request;
    request.set_namespace_name(ns);
    for (const std::string& k : keys) request.add_keys(k);
    request.set_format(format == ReadFormat::kRaw ? v1::READ_FORMAT_RAW
                                                  : v1::READ_FORMAT_FP16);
    request.set_pin_lease_id(pin_lease);
    request.set_inline_data(inline_data);
    v1::BeginReadResponse response;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    absl::Status st = FromGrpc(stub->BeginRead(&ctx, request, &response), ctx);
    if (!st.ok()) return st;
    if (response.blocks_size() != static_cast<int>(keys.size())) {
      return absl::InternalError(absl::StrCat("asked for ", keys.size(),
                                              " blocks, node sent ",
                                              response.blocks_size()));
    }
    return response;
  }

  // Ends a read lease whose bytes will not be fetched (best effort: the
  // node reaps it at its TTL anyway).
  void AbandonRead(uint64_t read_id) {
    v1::EndReadRequest request;
    request.set_lease_id(read_id);
    v1::EndReadResponse response;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    stub->EndRead(&ctx, request, &response);
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
};

struct PendingRead::Impl {
  GetResult metadata;
  std::vector<BlockPlacement> placements;
  absl::Time deadline;
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
                                 impl_->deadline);
}

absl::Status PendingRead::Wait() {
  if (impl_->read == nullptr) return absl::OkStatus();
  return impl_->read->WaitLayers(impl_->plane_layers, impl_->deadline);
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
    const NamespaceSpec& spec) {
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
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  absl::Status st =
      FromGrpc(impl_->stub->RegisterNamespace(&ctx, request, &response), ctx);
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
    const std::string& ns, const std::vector<std::string>& keys, bool pin) {
  v1::LookupRequest request;
  request.set_namespace_name(ns);
  for (const std::string& k : keys) request.add_keys(k);
  request.set_pin(pin);
  v1::LookupResponse response;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  absl::Status st =
      FromGrpc(impl_->stub->Lookup(&ctx, request, &response), ctx);
  if (!st.ok()) return st;
  return LookupResult{response.prefix_blocks(), response.lease_id()};
}

absl::StatusOr<PutResult> Client::Put(const std::string& ns,
                                      absl::Span<const BlockWrite> blocks) {
  PutResult total;
  if (blocks.empty()) return absl::InvalidArgumentError("no blocks to put");
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
    begin_request.set_use_data_plane(impl_->WantDataPlane());
    for (size_t i = begin; i < end; ++i) {
      v1::BlockRef* ref = begin_request.add_blocks();
      ref->set_key(blocks[i].key);
      std::string parent = blocks[i].parent_key;
      if (parent.empty() && i == begin && i > 0) parent = blocks[i - 1].key;
      ref->set_parent_key(parent);
    }
    v1::BeginWriteResponse begin_response;
    {
      grpc::ClientContext ctx;
      impl_->Prepare(&ctx);
      absl::Status st = FromGrpc(
          impl_->stub->BeginWrite(&ctx, begin_request, &begin_response), ctx);
      if (!st.ok()) return st;
    }
    auto present = [&](size_t local) {
      return local < static_cast<size_t>(begin_response.present_size()) &&
             begin_response.present(static_cast<int>(local));
    };
    // Ends the write lease at once (best effort: its TTL ends it anyway).
    auto abort = [&] {
      v1::AbortWriteRequest request;
      request.set_write_id(begin_response.write_id());
      v1::AbortWriteResponse response;
      grpc::ClientContext ctx;
      impl_->Prepare(&ctx);
      impl_->stub->AbortWrite(&ctx, request, &response);
    };
    bool sent = false;  // the bytes went over the data plane
    if (begin_response.has_data_plane() &&
        !begin_response.data_plane().ucx_address().empty()) {
      std::vector<ucx::ClientPlane::Block> sends;
      // Blocks that lie in a DataBuffer go with its registration (held for
      // the sends).
      std::vector<std::shared_ptr<ucx::MemoryRegion>> regions;
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
          regions.push_back(std::move(region));
        }
        sends.push_back({static_cast<uint32_t>(i - begin),
                         absl::MakeConstSpan(data, size), memh});
      }
      absl::Status st = [&]() -> absl::Status {
        absl::StatusOr<ucx::ClientPlane*> ucx_plane = impl_->Plane();
        if (!ucx_plane.ok()) return ucx_plane.status();
        absl::StatusOr<ucx::Token> token =
            ucx::TokenFromBytes(begin_response.data_plane().token());
        if (!token.ok()) return token.status();
        return (*ucx_plane)
            ->SendBlocks(impl_->Resolve(begin_response.data_plane()),
                         begin_response.write_id(), *token, sends,
                         impl_->Deadline());
      }();
      sent = st.ok();
      // kAuto: a data plane this process cannot reach sends inline with
      // the same lease (the node drops the staging then). Anything else
      // ends the write.
      if (!st.ok() && (impl_->options.data_plane == DataPlane::kUcx ||
                       st.code() != absl::StatusCode::kUnavailable)) {
        abort();
        return st;
      }
    } else if (impl_->options.data_plane == DataPlane::kUcx) {
      abort();
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
    grpc::ClientContext ctx;
    impl_->Prepare(&ctx);
    absl::Status st =
        FromGrpc(impl_->stub->CommitWrite(&ctx, commit, &commit_response), ctx);
    if (!st.ok()) return st;
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
  const bool want = impl_->WantDataPlane();
  absl::StatusOr<v1::BeginReadResponse> response =
      impl_->BeginRead(ns, keys, format, pin_lease, /*inline_data=*/!want);
  if (!response.ok()) return response.status();
  GetResult result = MetadataFrom(*response);
  if (!OverDataPlane(*response)) {
    if (want && impl_->options.data_plane == DataPlane::kUcx) {
      return absl::FailedPreconditionError(
          "the node offers no UCX data plane and the client requires one");
    }
    for (int i = 0; i < response->blocks_size(); ++i) {
      result.blocks[i].bytes =
          std::move(*response->mutable_blocks(i)->mutable_data());
    }
    return result;
  }
  // Over the data plane: into a region UCX allocates (shared memory where a
  // transport offers it), then copied out into the result's strings.
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
  for (const v1::BlockData& b : response->blocks()) {
    offsets.push_back(total);
    total += (b.length() + 63) / 64 * 64;
  }
  absl::Status st = [&]() -> absl::Status {
    absl::StatusOr<ucx::ClientPlane*> ucx_plane = impl_->Plane();
    if (!ucx_plane.ok()) return ucx_plane.status();
    absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> region =
        (*ucx_plane)->Allocate(std::max<uint64_t>(total, 64));
    if (!region.ok()) return region.status();
    const uint8_t* base = (*region)->data();
    absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> read =
        impl_->StartRead(*ucx_plane, *response, *std::move(region), offsets,
                         /*per_layer=*/false);
    if (!read.ok()) return read.status();
    absl::Status done =
        (*read)->WaitLayers((*read)->num_layers(), impl_->Deadline());
    if (!done.ok()) return done;
    for (int i = 0; i < response->blocks_size(); ++i) {
      result.blocks[i].bytes.assign(
          reinterpret_cast<const char*>(base + offsets[i]),
          response->blocks(i).length());
    }
    return absl::OkStatus();
  }();
  if (st.ok()) return result;
  // kAuto: when the data plane cannot be reached, read inline instead (a
  // pin lease, if any, was taken over by the first attempt).
  impl_->AbandonRead(response->read_id());
  if (impl_->options.data_plane == DataPlane::kAuto &&
      st.code() == absl::StatusCode::kUnavailable) {
    absl::StatusOr<v1::BeginReadResponse> again =
        impl_->BeginRead(ns, keys, format, 0, /*inline_data=*/true);
    if (!again.ok()) return again.status();
    GetResult inline_result = MetadataFrom(*again);
    for (int i = 0; i < again->blocks_size(); ++i) {
      inline_result.blocks[i].bytes =
          std::move(*again->mutable_blocks(i)->mutable_data());
    }
    return inline_result;
  }
  return st;
}

absl::StatusOr<std::unique_ptr<PendingRead>> Client::GetInto(
    const std::string& ns, const std::vector<std::string>& keys,
    ReadFormat format, absl::Span<uint8_t> dest, size_t stride,
    uint64_t pin_lease) {
  if (keys.empty()) return absl::InvalidArgumentError("no keys to read");
  if (stride == 0 || dest.size() / stride < keys.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a buffer of ", dest.size(), " bytes does not hold ",
                     keys.size(), " blocks of stride ", stride));
  }
  const bool want = impl_->WantDataPlane();
  absl::StatusOr<v1::BeginReadResponse> response =
      impl_->BeginRead(ns, keys, format, pin_lease, /*inline_data=*/!want);
  if (!response.ok()) return response.status();
  const bool over_plane = OverDataPlane(*response);
  auto impl = std::make_unique<PendingRead::Impl>();
  impl->metadata = MetadataFrom(*response);
  impl->deadline = impl_->Deadline();
  impl->plane_layers = PlaneLayers(*response);
  std::vector<uint64_t> offsets;
  for (int i = 0; i < response->blocks_size(); ++i) {
    const v1::BlockData& b = response->blocks(i);
    BlockPlacement placement;
    placement.offset = static_cast<uint64_t>(i) * stride;
    placement.length = b.length();
    placement.layer_ends.assign(b.layer_end_offsets().begin(),
                                b.layer_end_offsets().end());
    if (placement.layer_ends.empty())
      placement.layer_ends.push_back(b.length());
    if (b.length() > stride) {
      if (over_plane) impl_->AbandonRead(response->read_id());
      return absl::InvalidArgumentError(
          absl::StrCat("block ", i, " has ", b.length(),
                       " bytes, more than the stride of ", stride));
    }
    offsets.push_back(placement.offset);
    impl->placements.push_back(std::move(placement));
  }
  if (!over_plane) {
    if (want && impl_->options.data_plane == DataPlane::kUcx) {
      return absl::FailedPreconditionError(
          "the node offers no UCX data plane and the client requires one");
    }
    for (int i = 0; i < response->blocks_size(); ++i) {
      const std::string& data = response->blocks(i).data();
      std::memcpy(dest.data() + offsets[i], data.data(), data.size());
    }
    return std::make_unique<PendingRead>(std::move(impl));
  }
  absl::Status st = [&]() -> absl::Status {
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
    for (uint64_t& offset : offsets) offset += skip;
    absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> read =
        impl_->StartRead(*ucx_plane, *response, std::move(region), offsets,
                         /*per_layer=*/true, buffer_id);
    if (!read.ok()) return read.status();
    impl->read = *std::move(read);
    return absl::OkStatus();
  }();
  if (!st.ok()) {
    impl_->AbandonRead(response->read_id());
    return st;
  }
  return std::make_unique<PendingRead>(std::move(impl));
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
    absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> region =
        (*ucx_plane)->Allocate(bytes);
    if (!region.ok()) return region.status();
    impl->region = *std::move(region);
    const uintptr_t start = reinterpret_cast<uintptr_t>(impl->region->data());
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(impl_->buffers_mu);
      id = impl_->next_buffer_id++;
      impl_->buffers[start] = {bytes, id, impl->region};
    }
    Impl* client = impl_.get();
    ucx::ClientPlane* plane = *ucx_plane;
    impl->unregister = [client, plane, start, id] {
      {
        std::lock_guard<std::mutex> lock(client->buffers_mu);
        client->buffers.erase(start);
      }
      plane->ReleaseBuffer(id);
    };
  } else if (impl_->options.data_plane == DataPlane::kUcx) {
    return ucx_plane.status();
  } else {
    impl->plain = std::make_unique<uint8_t[]>(bytes);
  }
  return std::make_unique<DataBuffer>(std::move(impl));
}

absl::Status Client::Release(uint64_t pin_lease) {
  v1::EndReadRequest request;
  request.set_lease_id(pin_lease);
  v1::EndReadResponse response;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  return FromGrpc(impl_->stub->EndRead(&ctx, request, &response), ctx);
}

absl::StatusOr<uint32_t> Client::Delete(const std::string& ns,
                                        const std::vector<std::string>& keys) {
  v1::DeleteRequest request;
  request.set_namespace_name(ns);
  for (const std::string& k : keys) request.add_keys(k);
  v1::DeleteResponse response;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  absl::Status st =
      FromGrpc(impl_->stub->Delete(&ctx, request, &response), ctx);
  if (!st.ok()) return st;
  return response.deleted();
}

absl::StatusOr<NodeStats> Client::Stats() {
  v1::StatsRequest request;
  v1::StatsResponse response;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  absl::Status st = FromGrpc(impl_->stub->Stats(&ctx, request, &response), ctx);
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
