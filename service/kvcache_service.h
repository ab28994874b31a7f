// KvCacheServiceImpl: the kvcache.v1.KvCache gRPC service (callback API).
// It translates messages to store calls and back, and is the one place where
// absl::Status becomes grpc::Status. Encode/decode-heavy calls run on the
// worker pool so that gRPC's callback threads never wait on them.
//
// With tenants (service/tenants.h) every call is authenticated and
// authorized before it touches the store or the data plane: the caller's
// tenant needs the call's role and must own the namespace it names; the
// leases it makes carry its id as their holder, and a call naming a lease
// id of another holder answers as for an unknown id (FAILED_PRECONDITION).
// Without tenants the node is open: every caller may do everything.
#ifndef KVCACHE_SERVICE_KVCACHE_SERVICE_H_
#define KVCACHE_SERVICE_KVCACHE_SERVICE_H_

#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/metrics.h"
#include "service/tenants.h"
#include "service/thread_pool.h"
#include "service/ucx/data_plane.h"
#include "service/ucx/data_planes.h"
#include "store/store.h"

namespace kvcache::service {

// The single absl -> gRPC status mapping (the codes are the same numbers).
grpc::Status ToGrpcStatus(const absl::Status& status);
// "OK", "NOT_FOUND", ... as used in the requests_total{code} label.
const char* GrpcCodeName(grpc::StatusCode code);

class KvCacheServiceImpl final : public kvcache::v1::KvCache::CallbackService {
 public:
  // data_plane: the node's UCX data plane, or null when it runs none (then
  // every byte travels inline in gRPC messages). tenants: null runs open.
  // Each must outlive the service.
  KvCacheServiceImpl(store::Store* store, Metrics* metrics, ThreadPool* workers,
                     ucx::DataPlanes* data_plane = nullptr,
                     const Tenants* tenants = nullptr);

  grpc::ServerUnaryReactor* RegisterNamespace(
      grpc::CallbackServerContext* ctx,
      const v1::RegisterNamespaceRequest* request,
      v1::RegisterNamespaceResponse* response) override;
  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext* ctx,
                                   const v1::LookupRequest* request,
                                   v1::LookupResponse* response) override;
  grpc::ServerUnaryReactor* BeginWrite(
      grpc::CallbackServerContext* ctx, const v1::BeginWriteRequest* request,
      v1::BeginWriteResponse* response) override;
  grpc::ServerUnaryReactor* CommitWrite(
      grpc::CallbackServerContext* ctx, const v1::CommitWriteRequest* request,
      v1::CommitWriteResponse* response) override;
  grpc::ServerUnaryReactor* AbortWrite(
      grpc::CallbackServerContext* ctx, const v1::AbortWriteRequest* request,
      v1::AbortWriteResponse* response) override;
  grpc::ServerUnaryReactor* BeginRead(grpc::CallbackServerContext* ctx,
                                      const v1::BeginReadRequest* request,
                                      v1::BeginReadResponse* response) override;
  grpc::ServerUnaryReactor* EndRead(grpc::CallbackServerContext* ctx,
                                    const v1::EndReadRequest* request,
                                    v1::EndReadResponse* response) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx,
                                   const v1::DeleteRequest* request,
                                   v1::DeleteResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx,
                                  const v1::StatsRequest* request,
                                  v1::StatsResponse* response) override;
  grpc::ServerUnaryReactor* DropNamespace(
      grpc::CallbackServerContext* ctx, const v1::DropNamespaceRequest* request,
      v1::DropNamespaceResponse* response) override;

 private:
  // Who a call comes from: a tenant, or no one on an open node.
  struct Caller {
    std::shared_ptr<const Tenant> tenant;  // null: open
    uint32_t holder() const { return tenant ? tenant->id : 0; }
    bool Owns(absl::string_view ns) const {
      return tenant == nullptr || tenant->Owns(ns);
    }
  };
  // Authenticates the call and checks that its tenant has `role` and owns
  // namespace `ns` (when not null). UNAUTHENTICATED / PERMISSION_DENIED.
  // Sets *label to the tenant's name once it is known.
  absl::StatusOr<Caller> Authorize(grpc::CallbackServerContext* ctx,
                                   std::string* label, Role role,
                                   const std::string* ns) const;
  // Authorize, and that lease `lease_id` (a read lease when `read`) is the
  // caller's (FAILED_PRECONDITION as for an unknown id).
  absl::StatusOr<Caller> AuthorizeLease(grpc::CallbackServerContext* ctx,
                                        std::string* label, Role role,
                                        uint64_t lease_id, bool read) const;
  // The store owner of a namespace `caller` registers: its own id, or for
  // an admin the write tenant whose prefix it matches (else the admin's).
  uint16_t OwnerFor(const Caller& caller, const std::string& ns) const;
  void FillStats(const Caller& caller, v1::StatsResponse* response) const;
  template <typename Fn>
  grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext* ctx,
                                const char* op, bool offload, Fn&& fn);
  // Runs fn(&tenant) (inline or on the worker pool), then Finish. fn sets
  // `tenant`, the metrics label, once it knows the caller (Authorize does).
  // Ends a call: retry hint, metrics, reactor->Finish.
  void Finish(grpc::CallbackServerContext* ctx,
              grpc::ServerUnaryReactor* reactor, const char* op,
              absl::Time start, absl::string_view tenant,
              const absl::Status& status);
  // The metrics label of a call whose tenant is not known: "open" without
  // tenants, else "unauthenticated".
  const char* DefaultTenantLabel() const;
  absl::Status CommitInline(const v1::CommitWriteRequest* request,
                            v1::CommitWriteResponse* response);
  // BeginRead over the data plane: pins, stages the copies, answers with
  // lengths, layer offsets, the address and a token; no bytes. The session
  // lives on `shard`, the caller's (DataPlanes::ForClient).
  absl::Status BeginDataPlaneRead(const v1::BeginReadRequest* request,
                                  store::ReadFormat format, uint32_t holder,
                                  ucx::DataPlane& shard,
                                  v1::BeginReadResponse* response);

  store::Store* store_;
  Metrics* metrics_;
  ThreadPool* workers_;
  ucx::DataPlanes* data_plane_;
  const Tenants* tenants_;
};

}  // namespace kvcache::service

#endif  // KVCACHE_SERVICE_KVCACHE_SERVICE_H_
