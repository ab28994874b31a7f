// Node: one cache node — the store, the gRPC control plane (with health
// checking and reflection), an optional plaintext health-only server for
// probes, the /metrics endpoint and the lease reaper — and its lifecycle.
//
// Lifecycle: Start() binds everything and turns health SERVING. Drain()
// turns health NOT_SERVING on every port (so probes and clients stop
// sending) and keeps serving for the notice it is given, so that a probe
// sees NOT_SERVING before the ports go away; then it lets in-flight calls
// finish until drain_timeout (counted from the start of the drain, notice
// included), cancels what is left and stops every server. Drain is
// idempotent and is called by the destructor (with no notice).
// With DataPlaneMode::kUcx the UCX data plane (service/ucx/data_planes.h,
// one or more progress threads) starts before the gRPC server; Drain refuses
// new data-plane sessions, ends commit waits by the drain deadline and stops
// the data plane after the gRPC server and before the worker pool. With a
// tenants file (service/tenants.h) every control-plane call is authenticated;
// the reaper re-reads the file every tenants_refresh. Without one the node runs
// open and says so in one warning line at start.
#ifndef KVCACHE_SERVICE_NODE_H_
#define KVCACHE_SERVICE_NODE_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "base/notification.h"
#include "service/tenants.h"
#include "service/tls.h"
#include "service/ucx/data_planes.h"
#include "store/arena.h"
#include "store/store.h"

namespace grpc {
class Server;
}

namespace kvcache::service {

class KvCacheServiceImpl;
class Metrics;
class ThreadPool;

// Where KV bytes travel besides inline gRPC messages.
enum class DataPlaneMode { kNone, kUcx };

struct NodeOptions {
  std::string listen = "0.0.0.0:50051";
  std::string health_listen;                    // empty: none
  std::string metrics_listen = "0.0.0.0:9464";  // empty: none
  store::MemorySpec memory{store::MemoryKind::kHost, 0, 1ull << 30};
  store::StoreOptions store;
  // TLS (mTLS with a client CA) on `listen`; the health port stays
  // plaintext and serves only grpc.health.v1.
  TlsOptions tls;
  // The tenants file (--tenants; empty: open) and how often it is re-read.
  std::string tenants_file;
  absl::Duration tenants_refresh = absl::Seconds(10);
  int max_request_bytes = 256 << 20;
  absl::Duration drain_timeout = absl::Seconds(20);
  absl::Duration reaper_interval = absl::Milliseconds(200);
  int worker_threads = 0;  // 0: hardware concurrency
  // Faults the host arena in on a background thread from the start
  // (Arena::StartPrefault): the node's resident memory is then the whole
  // arena at once, and the first writes run as fast as later ones.
  bool prefault_memory = true;
  DataPlaneMode data_plane = DataPlaneMode::kNone;
  // With kUcx: listener, advertised host, staging bound. The lease TTLs
  // are taken from `store`.
  ucx::DataPlaneOptions ucx;
};

class Node {
 public:
  explicit Node(NodeOptions options);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  absl::Status Start();
  // `notice` is capped at options.drain_timeout (kvcache-node gives
  // --drain-notice, 1 s by default).
  void Drain(absl::Duration notice = absl::ZeroDuration());

  int port() const { return port_; }
  int health_port() const { return health_port_; }
  int metrics_port() const { return metrics_port_; }
  // The UCX listener's port; 0 without a data plane.
  int ucx_port() const { return data_plane_ ? data_plane_->port() : 0; }
  store::Store* store() { return store_.get(); }
  // Null without --data-plane=ucx, and after Drain.
  ucx::DataPlanes* data_plane() { return data_plane_.get(); }
  Metrics* metrics() { return metrics_.get(); }
  // Null when the node runs open.
  const Tenants* tenants() const { return tenants_.get(); }

 private:
  // Start's steps: the UCX data plane (before the gRPC server, which hands
  // it sessions), then the gRPC and health servers.
  absl::Status StartDataPlane();
  absl::Status StartServers();
  void LogStarted(absl::string_view arena_description) const;
  void ReaperLoop();
  // Re-reads the tenants file when due; logs a reload, and each new error
  // once (the last good set keeps serving).
  void RefreshTenants(absl::Time now);

  NodeOptions options_;
  std::unique_ptr<store::Store> store_;
  std::unique_ptr<Tenants> tenants_;
  absl::Time next_tenants_check_;   // reaper thread only
  std::string last_tenants_error_;  // reaper thread only
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ThreadPool> workers_;
  // One thread for the data plane's long background work (faulting in its
  // mappings of clients' buffers), which must not queue ahead of reads'
  // copies on workers_.
  std::unique_ptr<ThreadPool> background_;
  std::unique_ptr<ucx::DataPlanes> data_plane_;
  std::unique_ptr<KvCacheServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;
  std::thread reaper_;
  Notification stop_reaper_;
  Mutex drain_mu_;  // serializes Drain()
  bool started_ = false;
  bool drained_ ABSL_GUARDED_BY(drain_mu_) = false;
  int port_ = 0;
  int health_port_ = 0;
  int metrics_port_ = 0;
};

}  // namespace kvcache::service

#endif  // KVCACHE_SERVICE_NODE_H_
