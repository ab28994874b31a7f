#include "kvcache/client.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcache {
namespace {

constexpr char kRetryAfterKey[] = "kvcache-retry-after-ms";
constexpr char kRetryPayloadUrl[] = "type.kvcache.dev/retry-after-ms";
// Bytes of a CommitWrite beyond its payloads (keys, framing).
constexpr size_t kMessageSlack = 64 << 10;

v1::Codec CodecToProto(Codec codec) {
  return static_cast<v1::Codec>(static_cast<int>(codec) + 1);
}

Codec CodecFromProto(v1::Codec codec) {
  int value = static_cast<int>(codec) - 1;
  return static_cast<Codec>(std::clamp(value, 0, 4));
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

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvCache::Stub> stub;

  void Prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      absl::ToChronoMilliseconds(options.timeout));
  }
};

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
  v1::Layout* l = s->mutable_layout();
  l->set_num_layers(spec.shape.num_layers);
  l->set_num_kv_heads(spec.shape.num_kv_heads);
  l->set_head_dim(spec.shape.head_dim);
  l->set_tokens_per_block(spec.shape.tokens_per_block);
  l->set_dtype(v1::DTYPE_FP16);
  l->set_tensor_order(v1::TENSOR_ORDER_LAYER_KV_TOKEN_HEAD_DIM);
  if (spec.policy.has_value()) {
    const CodecPolicy& p = *spec.policy;
    v1::CodecPolicy* out = s->mutable_codec_policy();
    out->set_codec(CodecToProto(p.codec));
    for (uint32_t layer : p.fp16_layers) out->add_fp16_layers(layer);
    out->set_scale_mode(static_cast<v1::ScaleMode>(p.scale_mode));
    for (float v : p.static_k_scales) out->add_static_k_scales(v);
    for (float v : p.static_v_scales) out->add_static_v_scales(v);
    out->set_kivi_group_size(p.kivi_group_size);
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
    v1::CommitWriteRequest commit;
    commit.set_write_id(begin_response.write_id());
    for (size_t i = begin; i < end; ++i) {
      size_t local = i - begin;
      if (local < static_cast<size_t>(begin_response.present_size()) &&
          begin_response.present(static_cast<int>(local))) {
        continue;
      }
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
  v1::BeginReadRequest request;
  request.set_namespace_name(ns);
  for (const std::string& k : keys) request.add_keys(k);
  request.set_format(format == ReadFormat::kRaw ? v1::READ_FORMAT_RAW
                                                : v1::READ_FORMAT_FP16);
  request.set_pin_lease_id(pin_lease);
  request.set_inline_data(true);
  v1::BeginReadResponse response;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  absl::Status st =
      FromGrpc(impl_->stub->BeginRead(&ctx, request, &response), ctx);
  if (!st.ok()) return st;
  GetResult result;
  const v1::Layout& l = response.layout();
  result.shape = {l.num_layers(), l.num_kv_heads(), l.head_dim(),
                  l.tokens_per_block()};
  const v1::CodecPolicy& p = response.codec_policy();
  result.policy.codec = CodecFromProto(p.codec());
  result.policy.fp16_layers.assign(p.fp16_layers().begin(),
                                   p.fp16_layers().end());
  result.policy.scale_mode = static_cast<ScaleMode>(p.scale_mode());
  result.policy.static_k_scales.assign(p.static_k_scales().begin(),
                                       p.static_k_scales().end());
  result.policy.static_v_scales.assign(p.static_v_scales().begin(),
                                       p.static_v_scales().end());
  result.policy.kivi_group_size = p.kivi_group_size();
  for (v1::BlockData& b : *response.mutable_blocks()) {
    BlockData block;
    block.key = std::move(*b.mutable_key());
    block.codec = CodecFromProto(b.codec());
    block.format = b.format() == v1::READ_FORMAT_RAW ? ReadFormat::kRaw
                                                     : ReadFormat::kFp16;
    block.bytes = std::move(*b.mutable_data());
    result.blocks.push_back(std::move(block));
  }
  if (result.blocks.size() != keys.size()) {
    return absl::InternalError(absl::StrCat("asked for ", keys.size(),
                                            " blocks, node sent ",
                                            result.blocks.size()));
  }
  return result;
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
