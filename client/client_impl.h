// Private to the client library: Client::Impl, shared by client.cc (the
// control plane, reads, buffers) and write_path.cc (Put).
//
// Threading: a Client is thread-safe. What calls share is the lazily
// started UCX plane with its sticky start error and its kAuto refusal
// window (plane_mu), the nodes that refused to map this client's memory
// (pull_mu), and the registered memory (BufferPool, its own mutex). The
// rest is fixed at Connect.
#ifndef KVCACHE_CLIENT_CLIENT_IMPL_H_
#define KVCACHE_CLIENT_CLIENT_IMPL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "client/buffer_pool.h"
#include "client/cleanup_calls.h"
#include "client/ucx/client_plane.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcache {
namespace internal {

// The deadline and cancel token of one Client call.
struct CallScope {
  absl::Time deadline;
  CancelToken* cancel = nullptr;

  bool cancelled() const { return cancel != nullptr && cancel->cancelled(); }
};

absl::Status CallerCancelled();

// Blocks packed into one region start on cache lines.
// Whether a node's answer names a data plane to connect to: its worker
// address (a node without a listener, the default) or a listener.
inline bool OffersDataPlane(const v1::DataPlaneInfo& info) {
  return !info.worker_address().empty() || !info.ucx_address().empty();
}

// A random nonzero 64-bit number.
uint64_t NewDataPlaneClientId();

inline uint64_t CacheLineRound(uint64_t bytes) {
  return (bytes + 63) / 64 * 64;
}

}  // namespace internal

struct Client::Impl {
  explicit Impl(const ClientOptions& client_options)
      : options(client_options),
        authorization(options.bearer_token.empty()
                          ? std::string()
                          : "Bearer " + options.bearer_token),
        buffers(options.max_idle_buffer_bytes) {}
  ~Impl();

  // ---- Calls and RPCs (client.cc)

  internal::CallScope Scope(const CallOptions& call) const;
  // Adds the caller's credential (ClientOptions::bearer_token) to `ctx`.
  void Authorize(grpc::ClientContext* ctx) const {
    if (!authorization.empty())
      ctx->AddMetadata("authorization", authorization);
  }
  // One unary RPC of a call: its deadline on the context, its cancel token
  // wired to TryCancel for as long as the RPC runs.
  absl::Status Rpc(const internal::CallScope& scope,
                   absl::FunctionRef<grpc::Status(grpc::ClientContext*)> rpc);
  // For a write whose blocks the node pulls from this client's memory: ends
  // the write and returns once the node confirms that it no longer reads
  // them (its AbortWrite succeeds, or finds the write gone: committed or
  // dropped), bounded by kPulledWriteGrace. A node stops staging only
  // between blocks, and over shared memory nothing else stops it, so the
  // caller's buffer must not be given back before this.
  absl::Status EndPulledWrite(uint64_t write_id);
  // Best-effort cleanup RPCs: sent without waiting for the answer (the node
  // ends the lease at its TTL anyway), so a call never outlives its
  // deadline for them.
  void AbortWriteAsync(uint64_t write_id);
  void AbandonRead(uint64_t read_id);
  // A PendingRead's transfer abandons read `read_id` (AbandonRead) if it is
  // destroyed without its start having reached the node, which otherwise
  // holds the read's lease until its TTL. Reads whose caller abandons them
  // on every failure itself (Get) do without.
  void TellNodeIfUnsent(ucx::ClientPlane::Read& read, uint64_t read_id);

  // ---- The data plane (client.cc)

  // Whether to ask the node for the data plane: not with kGrpc, nor once
  // UCX could not start in this process (kAuto falls back for good then).
  bool WantDataPlane();
  // Whether a call asks the node for the data plane: WantDataPlane(), and
  // with kAuto not while that node's data plane is known unusable.
  bool AskForDataPlane();
  // A data-plane attempt that kAuto answers inline failed with `status`.
  // A segment-size refusal or a connection that never came up stands until
  // the node may have changed: asked again after kUnusablePlaneRetry.
  void NoteFallback(const absl::Status& status);
  // The UCX side of this client, started on first use.
  absl::StatusOr<ucx::ClientPlane*> Plane();
  // How to reach the node's data plane; a listener advertised as ":port"
  // is on the host of the gRPC target.
  ucx::NodeAddress Resolve(const v1::DataPlaneInfo& info) const;
  // Nodes (NodeAddress::key) that refused to map a buffer of this client:
  // writes to them send their blocks.
  bool PullRefused(const std::string& node);
  void RefusePulls(const std::string& node);

  // ---- Reads (client.cc)

  // A BeginRead and its metadata. Over the data plane (when the node
  // answered with one) the read lease stays open until the transfer ends or
  // AbandonRead; a failure here has abandoned it already.
  struct Begun {
    v1::BeginReadResponse response;
    GetResult metadata;
  };
  // What to ask the node for a read the caller asked as `read`: the raw
  // encoding for an fp16 read when the client decodes
  // (ClientOptions::decode_on_client), else the same.
  ReadOptions OnTheWire(const ReadOptions& read) const;
  // Whether an fp16 read into `dest` is best decoded by the node, straight
  // into `dest` (BeginReadRequest.decode_into_destination): the client
  // would decode it (decode_on_client), `dest` lies in a DataBuffer, and
  // the node's last report (ucx::ClientPlane::MapsDestinations) says that
  // it maps this client's DataBuffers (shared memory). There the node
  // decodes in the pass that checks the stored bytes, on its worker pool,
  // with no landing buffer in between; elsewhere raw bytes travel at a
  // fraction of fp16's.
  bool NodeDecodesInto(absl::Span<const uint8_t> dest);
  absl::StatusOr<Begun> BeginRead(const std::string& ns,
                                  const std::vector<std::string>& keys,
                                  const ReadOptions& read, uint64_t pin_lease,
                                  bool inline_data,
                                  const internal::CallScope& scope,
                                  bool decode_into_destination = false);
  // Starts the transfer of a data-plane read into `region`, block i at
  // region->data() + offsets[i].
  absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>> StartRead(
      ucx::ClientPlane* ucx_plane, const v1::BeginReadResponse& response,
      std::shared_ptr<ucx::MemoryRegion> region,
      const std::vector<uint64_t>& offsets, bool per_layer,
      uint64_t buffer_id = 0, ucx::NamedRegion named = {});
  // An inline answer from a node that should have used the data plane.
  absl::Status CheckInline(bool wanted, const v1::BeginReadResponse& response);
  // One Get (Client::Get retries it once on a fresh connection reset).
  absl::StatusOr<GetResult> GetOnce(Client* client, const std::string& ns,
                                    const std::vector<std::string>& keys,
                                    const ReadOptions& read,
                                    const internal::CallScope& scope);
  // A pooled DataBuffer of `client` (the node keeps its key, and it goes
  // back to the pool when the read is over) that holds the blocks of
  // `response`, block i at offsets[i], each on a cache line.
  struct Landing {
    std::unique_ptr<DataBuffer> buffer;
    std::shared_ptr<ucx::MemoryRegion> region;
    uint64_t buffer_id = 0;
    std::vector<uint64_t> offsets;
  };
  absl::StatusOr<Landing> LandingFor(Client* client,
                                     const v1::BeginReadResponse& response);
  // The data-plane transfer of a Get's blocks (`response`) into a pooled
  // DataBuffer, then into result.blocks[i].bytes.
  absl::Status ReadIntoResult(Client* client,
                              const v1::BeginReadResponse& response,
                              const internal::CallScope& scope,
                              GetResult& result);
  // Starts the data-plane transfer of a GetInto into the `bytes` bytes at
  // dest (registered for this read unless they lie in a DataBuffer), at
  // pending.placements; pending.read is the transfer, sent layer by layer
  // or as whole blocks (ReadOptions::layer_by_layer).
  absl::Status StartReadInto(const v1::BeginReadResponse& response,
                             absl::Span<uint8_t> dest, size_t bytes,
                             bool layer_by_layer,
                             const internal::CallScope& scope,
                             PendingRead::Impl& pending);
  // The same for a read that travels raw for the caller's fp16 (LandsRaw):
  // into a Landing, which pending keeps, and a LayerDecoder from there into
  // `dest` at pending.placements.
  absl::Status StartDecodedReadInto(Client* client,
                                    const v1::BeginReadResponse& response,
                                    absl::Span<uint8_t> dest,
                                    bool layer_by_layer,
                                    const internal::CallScope& scope,
                                    PendingRead::Impl& pending);

  // ---- Writes (write_path.cc: the routes and their fallbacks)

  enum class WriteRoute;
  struct WriteBatch;
  // One BeginWrite / CommitWrite round trip of blocks[begin, end), adding
  // what was stored to *total: true when done, false when the batch must
  // begin again (a pull the node refused).
  absl::StatusOr<bool> PutBatch(Client* client, const std::string& ns,
                                absl::Span<const BlockWrite> blocks,
                                size_t begin, size_t end,
                                const internal::CallScope& scope,
                                PutResult* total);
  absl::Status BeginWrite(const std::string& ns,
                          absl::Span<const BlockWrite> blocks, size_t begin,
                          size_t end, const internal::CallScope& scope,
                          v1::BeginWriteResponse* response);
  // Sets batch.route (and what it needs) from the BeginWrite answer.
  void ChooseRoute(Client* client, WriteBatch& batch);
  std::shared_ptr<ucx::MemoryRegion> StageForPull(
      Client* client, absl::Span<const ucx::ClientPlane::Block> sends,
      absl::Span<ucx::ClientPlane::PullBlock> pulls,
      std::unique_ptr<DataBuffer>* staged, uint64_t* buffer_id);
  // The data-plane transfer of a batch whose route is not kInline.
  absl::Status Transfer(WriteBatch& batch, const internal::CallScope& scope);
  // After Transfer failed with `st`: true to commit inline instead, false
  // to begin the batch again, or the Put's error.
  absl::StatusOr<bool> AfterFailedTransfer(WriteBatch& batch,
                                           const absl::Status& st);
  // The CommitWrite (with the bytes when the route is kInline): true when
  // committed, false to begin the batch again, or the Put's error.
  absl::StatusOr<bool> Commit(WriteBatch& batch,
                              const internal::CallScope& scope,
                              PutResult* total);

  const ClientOptions options;
  const std::string authorization;  // "Bearer TOKEN", or empty
  // Names this client's UCX worker to nodes (BeginWriteRequest's
  // data_plane_client): random, nonzero.
  const uint64_t data_plane_client = internal::NewDataPlaneClientId();
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvCache::Stub> stub;
  // AbortWriteAsync's and AbandonRead's calls; ~Impl cancels and waits for
  // those still in flight.
  internal::CleanupCalls cleanups;

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

  Mutex pull_mu;
  absl::flat_hash_set<std::string> pull_refused ABSL_GUARDED_BY(pull_mu);

  // The fingerprint of each namespace this client registered (until it
  // drops it), sent with every call that names it: a node where the name
  // has another spec since refuses the call (LookupRequest's
  // namespace_fingerprint). 0 for a name this client did not register.
  uint64_t FingerprintOf(const std::string& ns);
  // A fingerprint of 0 (a node that states none) is forgotten: calls on
  // `ns` then go unchecked.
  void RememberFingerprint(const std::string& ns, uint64_t fingerprint);
  void ForgetFingerprint(const std::string& ns);
  Mutex fingerprints_mu;
  absl::flat_hash_map<std::string, uint64_t> fingerprints
      ABSL_GUARDED_BY(fingerprints_mu);

  // The node key (ucx::NodeAddress::key) of this client's last data-plane
  // read, for NodeDecodesInto.
  Mutex read_node_mu;
  std::string read_node ABSL_GUARDED_BY(read_node_mu);

  // DataBuffers and Get's landing zones. Declared after `plane`, so that
  // it (with the idle regions of the plane it holds) is destroyed first.
  internal::BufferPool buffers;
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CLIENT_IMPL_H_
