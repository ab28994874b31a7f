// fuzz_rpc: the node's gRPC handlers (service/kvcache_service.h) on
// arbitrary requests. One node is built once: its store (16 MiB of host
// memory, 4 KiB pages), metrics, worker pool and KvCacheServiceImpl behind
// a gRPC server reached through an in-process channel (no port), with no
// UCX data plane (the default NodeOptions::data_plane; the data plane's
// own decoders are fuzz_wire's). Namespace "fuzz" (L=2 H=2 D=8 T=4, codec
// none) holds blocks "k0".."k3" from the start.
//
// An input is a sequence of up to kMaxCalls calls, each
//   u8 op, u16 length (little-endian), `length` bytes
// where (op & 0x7f) % 9 names the RPC (RunOne; 0x7f alone names
// DropNamespace, so that the inputs of the nine older RPCs keep their
// meaning) and the bytes are parsed
// (ParseFromArray) as its request; a call whose bytes do not parse is
// skipped. With op & 0x80 the call is aimed at namespace "fuzz" and its ids
// are replaced by the last ones the node returned (write_id of BeginWrite,
// the lease of Lookup or BeginRead), so that a sequence can begin, commit
// and end. Every answer must carry a
// status code of BRIEF section 5's set; any other code aborts. After the
// sequence, the writes and leases it opened are ended, so that inputs do
// not depend on one another beyond the blocks they stored; a sequence that
// dropped namespace "fuzz" has it registered and populated again.
// KVCACHE_FUZZ_RPC_VERBOSE=1 prints every call's answer.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/kvcache_service.h"
#include "service/metrics.h"
#include "service/thread_pool.h"
#include "store/arena.h"
#include "store/store.h"

namespace kvcache::service {
namespace {

constexpr int kMaxCalls = 8;
constexpr char kNamespace[] = "fuzz";

// BRIEF section 5: the codes a node answers with.
bool AllowedCode(grpc::StatusCode code) {
  switch (code) {
    case grpc::OK:
    case grpc::INVALID_ARGUMENT:
    case grpc::NOT_FOUND:
    case grpc::RESOURCE_EXHAUSTED:
    case grpc::FAILED_PRECONDITION:
    case grpc::UNAVAILABLE:
    case grpc::DATA_LOSS:
    case grpc::UNAUTHENTICATED:
    case grpc::PERMISSION_DENIED:
      return true;
    default:
      return false;
  }
}

class FuzzNode {
 public:
  FuzzNode() {
    store::StoreOptions options;
    options.page_size = 4096;
    options.max_blocks_per_request = 64;
    options.max_namespaces = 4096;  // the fuzzer registers many
    absl::StatusOr<std::unique_ptr<store::Arena>> arena =
        store::CreateArena({store::MemoryKind::kHost, 0, 16 << 20});
    if (!arena.ok()) Die("arena", arena.status());
    absl::StatusOr<std::unique_ptr<store::Store>> s =
        store::Store::Create(options, *std::move(arena));
    if (!s.ok()) Die("store", s.status());
    store_ = *std::move(s);
    metrics_ = std::make_unique<Metrics>(store_.get());
    workers_ = std::make_unique<ThreadPool>(2);
    service_ = std::make_unique<KvCacheServiceImpl>(
        store_.get(), metrics_.get(), workers_.get(), nullptr);
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    builder.SetMaxReceiveMessageSize(1 << 20);
    builder.SetMaxSendMessageSize(1 << 20);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) Die("server", absl::UnknownError("not built"));
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(1 << 20);
    args.SetMaxSendMessageSize(1 << 20);
    stub_ = v1::KvCache::NewStub(server_->InProcessChannel(args));
    Populate();
  }

  v1::KvCache::Stub* stub() { return stub_.get(); }
  store::Store* store() { return store_.get(); }
  // After a sequence that dropped namespace "fuzz": as it was at the start.
  void RestoreIfDropped() {
    if (store_->GetNamespace(kNamespace).status().code() ==
        absl::StatusCode::kNotFound) {
      Populate();
    }
  }

 private:
  [[noreturn]] static void Die(const char* what, const absl::Status& s) {
    std::fprintf(stderr, "fuzz_rpc: cannot make the node's %s: %s\n", what,
                 s.ToString().c_str());
    std::abort();
  }

  void Populate() {
    grpc::ClientContext ctx1;
    v1::RegisterNamespaceRequest reg;
    v1::NamespaceSpec* spec = reg.mutable_spec();
    spec->set_name(kNamespace);
    spec->set_model("fuzz");
    v1::Layout* l = spec->mutable_layout();
    l->set_num_layers(2);
    l->set_num_kv_heads(2);
    l->set_head_dim(8);
    l->set_tokens_per_block(4);
    spec->mutable_codec_policy()->set_codec(v1::CODEC_NONE);
    v1::RegisterNamespaceResponse reg_out;
    grpc::Status s = stub_->RegisterNamespace(&ctx1, reg, &reg_out);
    if (!s.ok()) Die("namespace", absl::UnknownError(s.error_message()));
    grpc::ClientContext ctx2;
    v1::BeginWriteRequest begin;
    begin.set_namespace_name(kNamespace);
    for (int i = 0; i < 4; ++i) {
      v1::BlockRef* b = begin.add_blocks();
      b->set_key("k" + std::to_string(i));
      if (i > 0) b->set_parent_key("k" + std::to_string(i - 1));
    }
    v1::BeginWriteResponse begun;
    s = stub_->BeginWrite(&ctx2, begin, &begun);
    if (!s.ok()) Die("blocks", absl::UnknownError(s.error_message()));
    grpc::ClientContext ctx3;
    v1::CommitWriteRequest commit;
    commit.set_write_id(begun.write_id());
    for (int i = 0; i < 4; ++i) {
      v1::BlockPayload* p = commit.add_payloads();
      p->set_index(i);
      // Finite fp16 values (0x3c00 + i: 1.0 and a little more).
      std::string fp16(begun.fp16_block_bytes(), '\0');
      for (size_t j = 0; j + 1 < fp16.size(); j += 2) {
        fp16[j] = static_cast<char>(j + i);
        fp16[j + 1] = 0x3c;
      }
      p->set_fp16(fp16);
    }
    v1::CommitWriteResponse committed;
    s = stub_->CommitWrite(&ctx3, commit, &committed);
    if (!s.ok()) Die("blocks", absl::UnknownError(s.error_message()));
  }

  std::unique_ptr<store::Store> store_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ThreadPool> workers_;
  std::unique_ptr<KvCacheServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

// The ids a sequence has been handed, to patch later calls with and to end
// when it is done.
struct Ids {
  uint64_t write_id = 0;
  uint64_t lease_id = 0;
  std::vector<uint64_t> writes;
  std::vector<uint64_t> leases;
  void Write(uint64_t id) {
    if (id == 0) return;
    write_id = id;
    writes.push_back(id);
  }
  void Lease(uint64_t id) {
    if (id == 0) return;
    lease_id = id;
    leases.push_back(id);
  }
};

// Parses `bytes` as Req, patches it, calls `rpc` and checks the code.
template <typename Req, typename Resp>
void Call(const char* name, absl::string_view bytes, bool patch, Ids* ids,
          const std::function<void(Req*, const Ids&)>& patcher,
          grpc::Status (v1::KvCache::Stub::*rpc)(grpc::ClientContext*,
                                                 const Req&, Resp*),
          const std::function<void(const Resp&, Ids*)>& record,
          v1::KvCache::Stub* stub) {
  Req request;
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return;
  }
  if (patch && patcher) patcher(&request, *ids);
  Resp response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Status s = (stub->*rpc)(&ctx, request, &response);
  static const bool verbose =
      std::getenv("KVCACHE_FUZZ_RPC_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "fuzz_rpc: %s -> %s %s\n", name,
                 GrpcCodeName(s.error_code()), s.error_message().c_str());
  }
  if (!AllowedCode(s.error_code())) {
    std::fprintf(stderr, "fuzz_rpc: %s answered %s: %s\nrequest: %s\n", name,
                 GrpcCodeName(s.error_code()), s.error_message().c_str(),
                 request.ShortDebugString().c_str());
    std::abort();
  }
  if (s.ok() && record) record(response, ids);
}

void RunOne(v1::KvCache::Stub* stub, int op, absl::string_view bytes,
            Ids* ids) {
  using v1::KvCache;
  const bool patch = (op & 0x80) != 0;
  if ((op & 0x7f) == 0x7f) {
    Call<v1::DropNamespaceRequest, v1::DropNamespaceResponse>(
        "DropNamespace", bytes, patch, ids,
        [](v1::DropNamespaceRequest* r, const Ids&) {
          r->set_namespace_name(kNamespace);
        },
        &KvCache::Stub::DropNamespace, nullptr, stub);
    return;
  }
  switch ((op & 0x7f) % 9) {
    case 0:
      Call<v1::RegisterNamespaceRequest, v1::RegisterNamespaceResponse>(
          "RegisterNamespace", bytes, patch, ids, nullptr,
          &KvCache::Stub::RegisterNamespace, nullptr, stub);
      break;
    case 1:
      Call<v1::LookupRequest, v1::LookupResponse>(
          "Lookup", bytes, patch, ids,
          [](v1::LookupRequest* r, const Ids&) {
            r->set_namespace_name(kNamespace);
          },
          &KvCache::Stub::Lookup,
          [](const v1::LookupResponse& r, Ids* ids) {
            ids->Lease(r.lease_id());
          },
          stub);
      break;
    case 2:
      Call<v1::BeginWriteRequest, v1::BeginWriteResponse>(
          "BeginWrite", bytes, patch, ids,
          [](v1::BeginWriteRequest* r, const Ids&) {
            r->set_namespace_name(kNamespace);
          },
          &KvCache::Stub::BeginWrite,
          [](const v1::BeginWriteResponse& r, Ids* ids) {
            ids->Write(r.write_id());
          },
          stub);
      break;
    case 3:
      Call<v1::CommitWriteRequest, v1::CommitWriteResponse>(
          "CommitWrite", bytes, patch, ids,
          [](v1::CommitWriteRequest* r, const Ids& ids) {
            r->set_write_id(ids.write_id);
          },
          &KvCache::Stub::CommitWrite, nullptr, stub);
      break;
    case 4:
      Call<v1::AbortWriteRequest, v1::AbortWriteResponse>(
          "AbortWrite", bytes, patch, ids,
          [](v1::AbortWriteRequest* r, const Ids& ids) {
            r->set_write_id(ids.write_id);
          },
          &KvCache::Stub::AbortWrite, nullptr, stub);
      break;
    case 5:
      Call<v1::BeginReadRequest, v1::BeginReadResponse>(
          "BeginRead", bytes, patch, ids,
          [](v1::BeginReadRequest* r, const Ids& ids) {
            r->set_namespace_name(kNamespace);
            r->set_pin_lease_id(ids.lease_id);
          },
          &KvCache::Stub::BeginRead,
          [](const v1::BeginReadResponse& r, Ids* ids) {
            ids->Lease(r.read_id());
          },
          stub);
      break;
    case 6:
      Call<v1::EndReadRequest, v1::EndReadResponse>(
          "EndRead", bytes, patch, ids,
          [](v1::EndReadRequest* r, const Ids& ids) {
            r->set_lease_id(ids.lease_id);
          },
          &KvCache::Stub::EndRead, nullptr, stub);
      break;
    case 7:
      Call<v1::DeleteRequest, v1::DeleteResponse>(
          "Delete", bytes, patch, ids,
          [](v1::DeleteRequest* r, const Ids&) {
            r->set_namespace_name(kNamespace);
          },
          &KvCache::Stub::Delete, nullptr, stub);
      break;
    case 8:
      Call<v1::StatsRequest, v1::StatsResponse>("Stats", bytes, patch, ids,
                                                nullptr, &KvCache::Stub::Stats,
                                                nullptr, stub);
      break;
  }
}

// Ends what a sequence left open (any answer will do: a commit may have
// ended its write already).
void Cleanup(v1::KvCache::Stub* stub, const Ids& ids) {
  for (uint64_t id : ids.writes) {
    grpc::ClientContext ctx;
    v1::AbortWriteRequest r;
    r.set_write_id(id);
    v1::AbortWriteResponse out;
    stub->AbortWrite(&ctx, r, &out);
  }
  for (uint64_t id : ids.leases) {
    grpc::ClientContext ctx;
    v1::EndReadRequest r;
    r.set_lease_id(id);
    v1::EndReadResponse out;
    stub->EndRead(&ctx, r, &out);
  }
}

}  // namespace
}  // namespace kvcache::service

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvcache::service::FuzzNode;
  static FuzzNode* node = new FuzzNode();  // never destroyed
  static uint64_t runs = 0;
  kvcache::service::Ids ids;
  size_t at = 0;
  for (int call = 0; call < kvcache::service::kMaxCalls && at + 3 <= size;
       ++call) {
    const int op = data[at];
    const size_t length = data[at + 1] | (size_t{data[at + 2]} << 8);
    at += 3;
    const size_t n = std::min(length, size - at);
    kvcache::service::RunOne(
        node->stub(), op,
        absl::string_view(reinterpret_cast<const char*>(data) + at, n), &ids);
    at += n;
  }
  kvcache::service::Cleanup(node->stub(), ids);
  node->RestoreIfDropped();
  // What the node's reaper does, now and then: expiry and eviction.
  if (++runs % 1024 == 0) node->store()->RunMaintenance(absl::Now());
  return 0;
}
