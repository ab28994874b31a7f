#include "service/kvcache_service.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/echo.h"
#include "grpc/grpc_security_constants.h"
#include "proto/convert.h"
#include "store/lease_claim.h"

namespace kvcache::service {
namespace {

using kernels::Codec;

// Milliseconds a client should wait before retrying a RESOURCE_EXHAUSTED.
constexpr char kRetryAfterKey[] = "kvcache-retry-after-ms";
constexpr char kRetryAfterMs[] = "250";

absl::StatusOr<store::NamespaceConfig> ConfigFromProto(
    const v1::NamespaceSpec& spec) {
  store::NamespaceConfig c;
  c.name = spec.name();
  c.model = spec.model();
  c.revision = spec.revision();
  c.tp_rank = spec.tp_rank();
  const v1::Layout& l = spec.layout();
  if (l.dtype() != v1::DTYPE_FP16 && l.dtype() != v1::DTYPE_BF16 &&
      l.dtype() != v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        "unknown source dtype (DTYPE_FP16 or DTYPE_BF16)");
  }
  if (l.tensor_order() != v1::TENSOR_ORDER_UNSPECIFIED &&
      l.tensor_order() != v1::TENSOR_ORDER_LAYER_KV_TOKEN_HEAD_DIM) {
    return absl::InvalidArgumentError("unknown tensor order");
  }
  c.shape = proto::ShapeFromProto(l);
  const v1::CodecPolicy& p = spec.codec_policy();
  c.codec_specified = p.codec() != v1::CODEC_UNSPECIFIED;
  absl::StatusOr<kernels::CodecPolicy> policy = proto::PolicyFromProto(p);
  if (!policy.ok()) return policy.status();
  c.policy = *std::move(policy);
  if (p.has_residual_tokens()) c.residual_tokens = p.residual_tokens();
  return c;
}

std::vector<std::string> Keys(
    const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

// The namespace a request names, with the fingerprint its caller
// registered (0: unchecked).
template <typename Request>
store::NamespaceName NamespaceOf(const Request& request) {
  return store::NamespaceName(request.namespace_name(),
                              request.namespace_fingerprint());
}

absl::Duration Millis(uint32_t ms) { return absl::Milliseconds(ms); }

// INVALID_ARGUMENT for a value outside the enum (a newer client's format
// must not be served as another).
absl::StatusOr<store::ReadFormat> ReadFormatFromProto(
    const v1::BeginReadRequest& request) {
  switch (request.format()) {
    case v1::READ_FORMAT_FP16:
      return store::ReadFormat::kFp16;
    case v1::READ_FORMAT_RAW:
      return store::ReadFormat::kRaw;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown read format ", request.format()));
  }
}

// The store's options for a BeginRead request, with no lease kept.
store::ReadOptions ReadOptionsFromProto(const v1::BeginReadRequest& request,
                                        store::ReadFormat format) {
  store::ReadOptions options;
  options.format = format;
  options.ttl = Millis(request.lease_ttl_ms());
  options.pin_lease_id = request.pin_lease_id();
  options.allow_missing = request.allow_missing();
  return options;
}

// The parts of a read's answer that do not depend on the blocks' bytes:
// the missing keys and the namespace's layout and policy.
void DescribeRead(const store::ReadResult& r, v1::BeginReadResponse* response) {
  for (uint32_t m : r.missing) response->add_missing(m);
  proto::PolicyToProto(r.ns.config.policy, response->mutable_codec_policy());
  response->mutable_codec_policy()->set_residual_tokens(
      r.ns.config.residual_tokens);
  proto::ShapeToProto(r.ns.config.shape, response->mutable_layout());
}

// How a client reaches `plane` for the session of `token`, and the TCP
// segment sizes it checks before connecting (transport/tcp_segments.h);
// each kind of session adds what it offers.
void DescribeDataPlane(const ucx::DataPlane& plane, const ucx::Token& token,
                       v1::DataPlaneInfo* info) {
  info->set_ucx_address(plane.address());
  info->set_worker_address(plane.worker_address());
  info->set_token(ucx::TokenBytes(token));
  info->set_tcp_tx_seg_bytes(plane.tcp_segments().tx_bytes);
  info->set_tcp_rx_seg_bytes(plane.tcp_segments().rx_bytes);
}

// Who will connect to the data plane for a session (DataPlanes::ForClient):
// the client's own name for its UCX worker, else its gRPC peer.
std::string DataPlaneClient(const grpc::CallbackServerContext* ctx,
                            uint64_t data_plane_client) {
  return data_plane_client != 0 ? absl::StrCat("id:", data_plane_client)
                                : ctx->peer();
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

const char* GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::OK:
      return "OK";
    case grpc::CANCELLED:
      return "CANCELLED";
    case grpc::UNKNOWN:
      return "UNKNOWN";
    case grpc::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::ABORTED:
      return "ABORTED";
    case grpc::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::INTERNAL:
      return "INTERNAL";
    case grpc::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

KvCacheServiceImpl::KvCacheServiceImpl(store::Store* store, Metrics* metrics,
                                       ThreadPool* workers,
                                       ucx::DataPlanes* data_plane,
                                       const Tenants* tenants)
    : store_(store),
      metrics_(metrics),
      workers_(workers),
      data_plane_(data_plane),
      tenants_(tenants) {}

const char* KvCacheServiceImpl::DefaultTenantLabel() const {
  return tenants_ == nullptr ? "open" : "unauthenticated";
}

absl::StatusOr<KvCacheServiceImpl::Caller> KvCacheServiceImpl::Authorize(
    grpc::CallbackServerContext* ctx, std::string* label, Role role,
    const std::string* ns) const {
  if (tenants_ == nullptr) return Caller{};
  std::string authorization;
  const auto& metadata = ctx->client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization.assign(it->second.data(), it->second.size());
  }
  // The identities of a verified client certificate (mTLS): its URI and
  // DNS subject alternative names.
  std::vector<std::string> peers;
  std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const char* property :
         {GRPC_PEER_URI_PROPERTY_NAME, GRPC_PEER_SPIFFE_ID_PROPERTY_NAME,
          GRPC_PEER_DNS_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
      for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
        peers.emplace_back(value.data(), value.size());
      }
    }
  }
  absl::StatusOr<std::shared_ptr<const Tenant>> tenant =
      tenants_->Authenticate(authorization, peers);
  if (!tenant.ok()) return tenant.status();
  const Tenant& t = **tenant;
  *label = t.name;
  if (t.role < role) {
    return absl::PermissionDeniedError(
        absl::StrCat("tenant '", t.name, "' has role ", RoleName(t.role),
                     "; this call needs ", RoleName(role)));
  }
  if (ns != nullptr && !t.Owns(*ns)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "namespace '", EchoForError(*ns), "' is not tenant '", t.name, "''s"));
  }
  return Caller{*std::move(tenant)};
}

absl::StatusOr<KvCacheServiceImpl::Caller> KvCacheServiceImpl::AuthorizeLease(
    grpc::CallbackServerContext* ctx, std::string* label, Role role,
    uint64_t lease_id, bool read) const {
  absl::StatusOr<Caller> caller = Authorize(ctx, label, role, nullptr);
  if (!caller.ok() || tenants_ == nullptr) return caller;
  if (absl::Status s =
          store_->CheckLeaseHolder(lease_id, read, caller->holder());
      !s.ok()) {
    return s;
  }
  return caller;
}

uint16_t KvCacheServiceImpl::OwnerFor(const Caller& caller,
                                      const std::string& ns) const {
  if (caller.tenant == nullptr) return 0;
  if (!caller.tenant->admin()) return caller.tenant->id;
  std::shared_ptr<const Tenant> owner = tenants_->PrefixOwner(ns);
  return owner != nullptr ? owner->id : caller.tenant->id;
}

void KvCacheServiceImpl::Finish(grpc::CallbackServerContext* ctx,
                                grpc::ServerUnaryReactor* reactor,
                                const char* op, absl::Time start,
                                absl::string_view tenant,
                                const absl::Status& status) {
  if (status.code() == absl::StatusCode::kResourceExhausted) {
    ctx->AddTrailingMetadata(kRetryAfterKey, kRetryAfterMs);
  }
  grpc::Status grpc_status = ToGrpcStatus(status);
  metrics_->RecordRequest(op, GrpcCodeName(grpc_status.error_code()), tenant,
                          absl::ToDoubleSeconds(absl::Now() - start));
  reactor->Finish(grpc_status);
}

template <typename Fn>
grpc::ServerUnaryReactor* KvCacheServiceImpl::Run(
    grpc::CallbackServerContext* ctx, const char* op, bool offload, Fn&& fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Time start = absl::Now();
  auto work = [this, ctx, op, reactor, start, fn = std::forward<Fn>(fn)]() {
    absl::Status status;
    std::string tenant = DefaultTenantLabel();
    if (ctx->IsCancelled()) {
      status = absl::CancelledError("call cancelled before it ran");
    } else {
      status = fn(&tenant);
    }
    Finish(ctx, reactor, op, start, tenant, status);
  };
  if (offload) {
    workers_->Schedule(std::move(work));
  } else {
    work();
  }
  return reactor;
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::RegisterNamespace(
    grpc::CallbackServerContext* ctx,
    const v1::RegisterNamespaceRequest* request,
    v1::RegisterNamespaceResponse* response) {
  return Run(ctx, "register_namespace", false, [=](std::string* tenant) {
    // A reader may "register" what exists with the same spec (workers do at
    // start); creating one takes the write role.
    absl::StatusOr<Caller> caller =
        Authorize(ctx, tenant, Role::kRead, &request->spec().name());
    if (!caller.ok()) return caller.status();
    const bool create =
        caller->tenant == nullptr || caller->tenant->role >= Role::kWrite;
    absl::StatusOr<store::NamespaceConfig> config =
        ConfigFromProto(request->spec());
    if (!config.ok()) return config.status();
    config->owner = OwnerFor(*caller, config->name);
    absl::StatusOr<store::NamespaceInfo> info =
        store_->RegisterNamespace(*std::move(config), create);
    if (!create && info.status().code() == absl::StatusCode::kNotFound) {
      return absl::PermissionDeniedError(
          absl::StrCat("tenant '", caller->tenant->name,
                       "' has role read: it cannot register a new namespace"));
    }
    if (!info.ok()) return info.status();
    response->set_fingerprint(info->fingerprint);
    response->set_already_registered(info->already_registered);
    response->set_effective_codec(
        proto::CodecToProto(info->config.policy.codec));
    response->set_fp16_block_bytes(info->fp16_block_bytes);
    response->set_encoded_block_bytes(info->encoded_block_bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::Lookup(
    grpc::CallbackServerContext* ctx, const v1::LookupRequest* request,
    v1::LookupResponse* response) {
  return Run(ctx, "lookup", false, [=](std::string* tenant) {
    absl::StatusOr<Caller> caller =
        Authorize(ctx, tenant, Role::kRead, &request->namespace_name());
    if (!caller.ok()) return caller.status();
    absl::StatusOr<store::LookupResult> r = store_->Lookup(
        NamespaceOf(*request), Keys(request->keys()), request->pin(),
        Millis(request->pin_ttl_ms()), caller->holder());
    if (!r.ok()) return r.status();
    response->set_prefix_blocks(r->prefix_blocks);
    response->set_lease_id(r->lease_id);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::BeginWrite(
    grpc::CallbackServerContext* ctx, const v1::BeginWriteRequest* request,
    v1::BeginWriteResponse* response) {
  return Run(ctx, "begin_write", false, [=](std::string* tenant) {
    absl::StatusOr<Caller> caller =
        Authorize(ctx, tenant, Role::kWrite, &request->namespace_name());
    if (!caller.ok()) return caller.status();
    std::vector<store::BlockRef> blocks;
    blocks.reserve(request->blocks_size());
    for (const v1::BlockRef& b : request->blocks()) {
      blocks.push_back({b.key(), b.parent_key()});
    }
    absl::StatusOr<store::BeginWriteResult> r =
        store_->BeginWrite(NamespaceOf(*request), std::move(blocks),
                           Millis(request->lease_ttl_ms()), caller->holder());
    if (!r.ok()) return r.status();
    if (request->use_data_plane() && data_plane_ != nullptr) {
      // Staging for the blocks that will travel; none: no write at all (the
      // session's claim aborts the store write).
      ucx::DataPlane& shard = data_plane_->ForClient(
          DataPlaneClient(ctx, request->data_plane_client()));
      absl::StatusOr<ucx::Token> token =
          shard.OpenWrite(store::WriteClaim(store_, r->write_id), *r);
      if (!token.ok()) return token.status();
      DescribeDataPlane(shard, *token, response->mutable_data_plane());
      response->mutable_data_plane()->set_pull_writes(true);
    }
    response->set_write_id(r->write_id);
    for (bool present : r->present) response->add_present(present);
    response->set_fp16_block_bytes(r->fp16_block_bytes);
    response->set_lease_deadline_unix_ms(absl::ToUnixMillis(r->deadline));
    return absl::OkStatus();
  });
}

absl::Status KvCacheServiceImpl::CommitInline(
    const v1::CommitWriteRequest* request, v1::CommitWriteResponse* response) {
  std::vector<store::Store::Payload> payloads;
  uint64_t bytes = 0;
  payloads.reserve(request->payloads_size());
  for (const v1::BlockPayload& p : request->payloads()) {
    payloads.push_back(
        {p.index(),
         absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(p.fp16().data()),
                             p.fp16().size())});
    bytes += p.fp16().size();
  }
  absl::StatusOr<store::CommitResult> r =
      store::WriteClaim(store_, request->write_id()).Commit(payloads);
  if (!r.ok()) return r.status();
  metrics_->RecordTransfer("in", "grpc", bytes);
  response->set_blocks_stored(r->stored);
  response->set_blocks_skipped(r->skipped);
  response->set_stored_bytes(r->stored_bytes);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::CommitWrite(
    grpc::CallbackServerContext* ctx, const v1::CommitWriteRequest* request,
    v1::CommitWriteResponse* response) {
  // Checked before the data plane sees the id: another tenant's id must not
  // end (or wait on) a session.
  std::string label = DefaultTenantLabel();
  if (absl::StatusOr<Caller> caller = AuthorizeLease(
          ctx, &label, Role::kWrite, request->write_id(), /*read=*/false);
      !caller.ok()) {
    return Run(ctx, "commit_write", false,
               [status = caller.status(), label](std::string* tenant) {
                 *tenant = label;
                 return status;
               });
  }
  if (data_plane_ != nullptr && request->payloads_size() == 0) {
    // The bytes came (or are coming) over the data plane: the commit runs
    // once they have all landed, bounded by this call's deadline.
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    absl::Time start = absl::Now();
    auto finish = [this, ctx, reactor, start,
                   label](const absl::Status& status) {
      Finish(ctx, reactor, "commit_write", start, label, status);
    };
    bool handled = data_plane_->Commit(
        request->write_id(), absl::FromChrono(ctx->deadline()),
        [response, finish](absl::StatusOr<store::CommitResult> r) {
          if (r.ok()) {
            response->set_blocks_stored(r->stored);
            response->set_blocks_skipped(r->skipped);
            response->set_stored_bytes(r->stored_bytes);
          }
          finish(r.status());
        });
    if (!handled) {
      // No data-plane session for this write: the inline path.
      workers_->Schedule([this, request, response, finish] {
        finish(CommitInline(request, response));
      });
    }
    return reactor;
  }
  if (data_plane_ != nullptr) {
    // Inline bytes replace staging: the session goes, and its lease returns
    // to the table for the inline commit to claim.
    data_plane_->TakeWrite(request->write_id()).Release();
  }
  return Run(ctx, "commit_write", true, [=](std::string* tenant) {
    *tenant = label;
    return CommitInline(request, response);
  });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::AbortWrite(
    grpc::CallbackServerContext* ctx, const v1::AbortWriteRequest* request,
    v1::AbortWriteResponse* response) {
  return Run(ctx, "abort_write", false, [=](std::string* tenant) {
    absl::StatusOr<Caller> caller = AuthorizeLease(
        ctx, tenant, Role::kWrite, request->write_id(), /*read=*/false);
    if (!caller.ok()) return caller.status();
    store::WriteClaim claim =
        data_plane_ != nullptr ? data_plane_->TakeWrite(request->write_id())
                               : store::WriteClaim(store_, request->write_id());
    return claim.Abort();
  });
}

absl::Status KvCacheServiceImpl::BeginDataPlaneRead(
    const v1::BeginReadRequest* request, store::ReadFormat format,
    uint32_t holder, ucx::DataPlane& shard, v1::BeginReadResponse* response) {
  // Staging for the verified copies the store hands over, reserved before
  // they exist: a raw block is at most its fp16 size (KIVI's residual
  // window keeps some blocks fp16). A read that the store answers wholly in
  // place copies nothing and needs none. One whose client asks for its
  // decode in its own memory (decode_into_destination) leaves encoded
  // blocks in place too, for the data plane to decode at ReadStart: into
  // the client's mapping of it, or into staging it reserves then.
  absl::StatusOr<store::NamespaceInfo> ns =
      store_->GetNamespace(request->namespace_name());
  if (!ns.ok()) return ns.status();
  const bool decode_later =
      request->decode_into_destination() && format == store::ReadFormat::kFp16;
  const uint64_t per_block =
      store_->ReadsInPlace(*ns, format, decode_later)
          ? 0
          : std::max(ns->fp16_block_bytes, ns->encoded_block_bytes);
  absl::StatusOr<ucx::StagingReservation> reservation =
      data_plane_->ReserveStaging(per_block * request->keys_size());
  if (!reservation.ok()) return reservation.status();
  store::ReadOptions options = ReadOptionsFromProto(*request, format);
  options.holder = holder;
  options.keep_lease = true;
  options.in_place = true;
  // The data plane checks each layer of a block read in place as it copies
  // or before it sends it (DataPlane::CopySlice, CheckThenPost), instead of
  // a separate pass here. A read that may leave out what fails
  // (allow_missing) is checked here, so that a corrupt block is listed as
  // missing rather than failing the read mid-transfer.
  options.caller_verifies = !options.allow_missing;
  options.decode_later = decode_later;
  absl::StatusOr<store::ReadResult> r =
      store_->BeginRead(NamespaceOf(*request), Keys(request->keys()), options);
  if (!r.ok()) return r.status();
  store::ReadClaim claim(store_, r->lease_id);
  DescribeRead(*r, response);
  if (r->blocks.empty()) {
    // Nothing to move (every key missing): no data-plane session, and the
    // claim ends the lease.
    return absl::OkStatus();
  }
  // Blocks read in place are put from the pinned arena pages: only copies
  // (decoded blocks, or every block of a device arena) hold staging.
  uint64_t copied = 0;
  for (const store::ReadBlock& block : r->blocks) copied += block.data.size();
  ucx::StagingReservation held = reservation->Split(copied);
  std::vector<std::vector<uint64_t>> ends =
      ucx::DataPlane::LayerEnds(*r, format);
  for (size_t i = 0; i < r->blocks.size(); ++i) {
    const store::ReadBlock& block = r->blocks[i];
    v1::BlockData* out = response->add_blocks();
    out->set_key(block.key);
    out->set_codec(proto::CodecToProto(block.codec));
    out->set_format(request->format());
    out->set_length(block.answer_size());
    for (uint64_t end : ends[i]) out->add_layer_end_offsets(end);
  }
  response->set_read_id(r->lease_id);
  // The session takes the claim; on an error it has ended the lease.
  absl::StatusOr<ucx::Token> token = shard.OpenRead(
      std::move(claim), *std::move(r), std::move(ends), std::move(held));
  if (!token.ok()) return token.status();
  DescribeDataPlane(shard, *token, response->mutable_data_plane());
  response->mutable_data_plane()->set_bounded_reads(true);
  response->mutable_data_plane()->set_message_reads(true);
  response->mutable_data_plane()->set_sequenced_data(true);
  response->mutable_data_plane()->set_decodes_into_destination(true);
  response->mutable_data_plane()->set_keeps_named_buffers(true);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::BeginRead(
    grpc::CallbackServerContext* ctx, const v1::BeginReadRequest* request,
    v1::BeginReadResponse* response) {
  return Run(ctx, "begin_read", true, [=](std::string* tenant) {
    absl::StatusOr<Caller> caller =
        Authorize(ctx, tenant, Role::kRead, &request->namespace_name());
    if (!caller.ok()) return caller.status();
    absl::StatusOr<store::ReadFormat> format = ReadFormatFromProto(*request);
    if (!format.ok()) return format.status();
    // Without a data plane a node answers inline whatever was asked.
    if (!request->inline_data() && data_plane_ != nullptr) {
      return BeginDataPlaneRead(request, *format, caller->holder(),
                                data_plane_->ForClient(DataPlaneClient(
                                    ctx, request->data_plane_client())),
                                response);
    }
    store::ReadOptions options = ReadOptionsFromProto(*request, *format);
    options.holder = caller->holder();
    absl::StatusOr<store::ReadResult> r = store_->BeginRead(
        NamespaceOf(*request), Keys(request->keys()), options);
    if (!r.ok()) return r.status();
    DescribeRead(*r, response);
    uint64_t bytes = 0;
    for (store::ReadBlock& block : r->blocks) {
      v1::BlockData* out = response->add_blocks();
      out->set_key(std::move(block.key));
      out->set_codec(proto::CodecToProto(block.codec));
      out->set_format(request->format());
      out->set_length(block.data.size());
      bytes += block.data.size();
      out->set_data(std::move(block.data));
    }
    response->set_read_id(r->lease_id);
    metrics_->RecordTransfer("out", "grpc", bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::EndRead(
    grpc::CallbackServerContext* ctx, const v1::EndReadRequest* request,
    v1::EndReadResponse* response) {
  return Run(ctx, "end_read", false, [=](std::string* tenant) {
    absl::StatusOr<Caller> caller = AuthorizeLease(
        ctx, tenant, Role::kRead, request->lease_id(), /*read=*/true);
    if (!caller.ok()) return caller.status();
    std::optional<store::ReadClaim> claim =
        data_plane_ != nullptr ? data_plane_->EndRead(request->lease_id())
                               : store::ReadClaim(store_, request->lease_id());
    if (!claim.has_value()) {
      return absl::OkStatus();  // the transfer's end ends the lease
    }
    return claim->End();
  });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::Delete(
    grpc::CallbackServerContext* ctx, const v1::DeleteRequest* request,
    v1::DeleteResponse* response) {
  return Run(ctx, "delete", false, [=](std::string* tenant) {
    absl::StatusOr<Caller> caller =
        Authorize(ctx, tenant, Role::kWrite, &request->namespace_name());
    if (!caller.ok()) return caller.status();
    absl::StatusOr<uint32_t> n =
        store_->Delete(NamespaceOf(*request), Keys(request->keys()));
    if (!n.ok()) return n.status();
    response->set_deleted(*n);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::Stats(
    grpc::CallbackServerContext* ctx, const v1::StatsRequest* request,
    v1::StatsResponse* response) {
  return Run(ctx, "stats", false, [=](std::string* tenant) {
    absl::StatusOr<Caller> caller =
        Authorize(ctx, tenant, Role::kRead, nullptr);
    if (!caller.ok()) return caller.status();
    FillStats(*caller, response);
    return absl::OkStatus();
  });
}

void KvCacheServiceImpl::FillStats(const Caller& caller,
                                   v1::StatsResponse* response) const {
  store::StoreStats s = store_->Stats();
  response->set_capacity_bytes(s.capacity_bytes);
  response->set_used_bytes(s.used_bytes);
  response->set_reserved_bytes(s.reserved_bytes);
  response->set_pinned_bytes(s.pinned_bytes);
  response->set_fragmentation_bytes(s.fragmentation_bytes);
  response->set_page_size(s.page_size);
  for (size_t c = 0; c < s.codecs.size(); ++c) {
    v1::CodecCapacity* cc = response->add_codecs();
    cc->set_codec(proto::CodecToProto(static_cast<Codec>(c)));
    cc->set_blocks(s.codecs[c].blocks);
    cc->set_tokens(s.codecs[c].tokens);
    cc->set_stored_bytes(s.codecs[c].stored_bytes);
    cc->set_logical_bytes(s.codecs[c].logical_bytes);
  }
  for (const store::NamespaceStats& ns : s.namespaces) {
    if (!caller.Owns(ns.name)) continue;  // another tenant's
    v1::NamespaceCapacity* nc = response->add_namespaces();
    nc->set_name(ns.name);
    nc->set_codec(proto::CodecToProto(ns.codec));
    nc->set_blocks(ns.blocks);
    nc->set_tokens(ns.tokens);
    nc->set_stored_bytes(ns.stored_bytes);
    nc->set_logical_bytes(ns.logical_bytes);
    nc->set_residual_blocks(ns.residual_blocks);
    for (size_t c = 0; c < ns.tokens_that_fit.size(); ++c) {
      (*nc->mutable_tokens_that_fit())[std::string(
          kernels::CodecName(static_cast<Codec>(c)))] = ns.tokens_that_fit[c];
    }
  }
  response->set_evictions(s.evictions_capacity + s.evictions_watermark);
  response->set_data_loss_events(s.data_loss_events);
  response->set_lookup_hits(s.lookup_hits);
  response->set_lookup_misses(s.lookup_misses);
  response->set_active_read_leases(s.active_read_leases);
  response->set_active_write_leases(s.active_write_leases);
  response->set_memory_tier("host");
  if (caller.tenant != nullptr) {
    const Tenant& t = *caller.tenant;
    store::OwnerUsage usage = store_->Usage(t.id);
    v1::TenantUsage* out = response->mutable_tenant();
    out->set_name(t.name);
    out->set_pool_bytes_used(usage.pool_bytes);
    out->set_pool_bytes_quota(t.pool_bytes);
    out->set_namespaces(usage.namespaces);
    out->set_max_namespaces(t.max_namespaces);
  }
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::DropNamespace(
    grpc::CallbackServerContext* ctx, const v1::DropNamespaceRequest* request,
    v1::DropNamespaceResponse* response) {
  return Run(ctx, "drop_namespace", false, [=](std::string* tenant) {
    absl::StatusOr<Caller> caller =
        Authorize(ctx, tenant, Role::kWrite, &request->namespace_name());
    if (!caller.ok()) return caller.status();
    absl::StatusOr<store::DropResult> r =
        store_->DropNamespace(NamespaceOf(*request));
    if (!r.ok()) return r.status();
    response->set_blocks_dropped(r->blocks);
    response->set_freed_bytes(r->freed_bytes);
    return absl::OkStatus();
  });
}

}  // namespace kvcache::service
