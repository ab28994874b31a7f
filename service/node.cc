#include "service/node.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "service/kvcache_service.h"
#include "service/metrics.h"
#include "service/thread_pool.h"

namespace kvcache::service {

Node::Node(NodeOptions options) : options_(std::move(options)) {}

Node::~Node() { Drain(); }

absl::Status Node::Start() {
  absl::StatusOr<std::unique_ptr<store::Arena>> arena =
      store::CreateArena(options_.memory);
  if (!arena.ok()) return arena.status();
  std::string arena_description = (*arena)->Describe();
  if (options_.prefault_memory) {
    (*arena)->StartPrefault();
    arena_description += ", faulted in by a background thread";
  }
  absl::StatusOr<std::unique_ptr<store::Store>> store =
      store::Store::Create(options_.store, *std::move(arena));
  if (!store.ok()) return store.status();
  store_ = *std::move(store);
  if (!options_.tenants_file.empty()) {
    absl::StatusOr<std::unique_ptr<Tenants>> tenants =
        Tenants::Load(options_.tenants_file, store_.get());
    if (!tenants.ok()) return tenants.status();
    tenants_ = *std::move(tenants);
    next_tenants_check_ = absl::Now() + options_.tenants_refresh;
  }
  metrics_ = std::make_unique<Metrics>(store_.get());
  store_->SetQuantizeObserver(
      [metrics = metrics_.get()](kernels::Codec codec, double seconds) {
        metrics->RecordQuantize(codec, seconds);
      });
  int threads = options_.worker_threads > 0
                    ? options_.worker_threads
                    : static_cast<int>(std::thread::hardware_concurrency());
  workers_ = std::make_unique<ThreadPool>(threads);
  store_->SetReadExecutor(
      [pool = workers_.get()](std::function<void()> work) {
        pool->Schedule(std::move(work));
      },
      threads - 1);
  if (options_.data_plane == DataPlaneMode::kUcx) {
    if (absl::Status s = StartDataPlane(); !s.ok()) return s;
  }
  service_ = std::make_unique<KvCacheServiceImpl>(
      store_.get(), metrics_.get(), workers_.get(), data_plane_.get(),
      tenants_.get());

  if (!options_.metrics_listen.empty()) {
    absl::StatusOr<int> port = metrics_->Serve(options_.metrics_listen);
    if (!port.ok()) return port.status();
    metrics_port_ = *port;
  }
  if (absl::Status s = StartServers(); !s.ok()) return s;
  reaper_ = std::thread([this] { ReaperLoop(); });
  for (grpc::Server* s : {server_.get(), health_server_.get()}) {
    if (s == nullptr) continue;
    s->GetHealthCheckService()->SetServingStatus(true);
    s->GetHealthCheckService()->SetServingStatus("kvcache.v1.KvCache", true);
  }
  metrics_->SetReady(true);
  started_ = true;
  LogStarted(arena_description);
  return absl::OkStatus();
}

absl::Status Node::StartDataPlane() {
  background_ = std::make_unique<ThreadPool>(1);
  absl::StatusOr<std::unique_ptr<ucx::DataPlanes>> plane =
      ucx::DataPlanes::Start(
          options_.ucx, store_.get(),
          [pool = workers_.get()](std::function<void()> work) {
            pool->Schedule(std::move(work));
          },
          [pool = background_.get()](std::function<void()> work) {
            pool->Schedule(std::move(work));
          },
          [metrics = metrics_.get()](bool inbound, uint64_t bytes) {
            metrics->RecordTransfer(inbound ? "in" : "out", "ucx", bytes);
          });
  if (!plane.ok()) {
    return absl::Status(
        plane.status().code(),
        absl::StrCat("cannot start the UCX data plane",
                     options_.ucx.listen.empty()
                         ? std::string()
                         : absl::StrCat(" on ", options_.ucx.listen),
                     ": ", plane.status().message()));
  }
  data_plane_ = *std::move(plane);
  metrics_->SetDataPlaneSource([plane = data_plane_.get()] {
    ucx::DataPlaneStats s = plane->Stats();
    Metrics::DataPlaneGauges g;
    g.staging_capacity_bytes = s.staging_capacity_bytes;
    g.staging_used_bytes = s.staging_used_bytes;
    g.staging_cached_bytes = s.staging_cached_bytes;
    g.connections = s.connections;
    g.write_sessions = s.write_sessions;
    g.read_sessions = s.read_sessions;
    g.rejected_connections = s.rejected_connections;
    g.buffer_keys = s.buffer_keys;
    g.pulled_blocks = s.pulled_blocks;
    g.blocks_received_in_place = s.blocks_received_in_place;
    g.message_reads = s.message_reads;
    g.copied_reads = s.copied_reads;
    g.blocks_decoded_into_destination = s.blocks_decoded_into_destination;
    g.blocks_decoded_at_read_start = s.blocks_decoded_at_read_start;
    g.reads_checked_while_copying = s.reads_checked_while_copying;
    g.reads_checked_before_sending = s.reads_checked_before_sending;
    g.read_slices_posted = s.read_slices_posted;
    g.prefaulted_buffer_bytes = s.prefaulted_buffer_bytes;
    g.buffer_bytes_populated_by_reads = s.buffer_bytes_populated_by_reads;
    return g;
  });
  return absl::OkStatus();
}

absl::Status Node::StartServers() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentials(options_.tls);
  if (!credentials.ok()) return credentials.status();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.listen, *credentials, &port_);
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(options_.max_request_bytes);
  builder.SetMaxSendMessageSize(options_.max_request_bytes);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for gRPC on ", options_.listen));
  }
  if (!options_.health_listen.empty()) {
    grpc::ServerBuilder health_builder;
    health_builder.AddListeningPort(options_.health_listen,
                                    grpc::InsecureServerCredentials(),
                                    &health_port_);
    health_server_ = health_builder.BuildAndStart();
    if (health_server_ == nullptr || health_port_ == 0) {
      server_->Shutdown();
      return absl::UnavailableError(absl::StrCat(
          "cannot listen for health checks on ", options_.health_listen));
    }
  }
  return absl::OkStatus();
}

void Node::LogStarted(absl::string_view arena_description) const {
  if (tenants_ == nullptr) {
    LogInfo(
        "warning: running open (no --tenants): every caller may read, "
        "write and delete every namespace");
  }
  if (!options_.tls.enabled()) {
    LogInfo(tenants_ == nullptr
                ? "warning: the control plane is plaintext (no --tls-cert): "
                  "anyone who reaches the port can use the node"
                : "warning: the control plane is plaintext (no --tls-cert): "
                  "bearer tokens cross the network readable");
  }
  std::string plane;
  if (data_plane_ != nullptr) {
    const ucx::TcpSegments& segments = data_plane_->tcp_segments();
    plane = absl::StrCat(
        ", UCX data plane ",
        options_.ucx.tcp_trusted_network
            ? (data_plane_->port() != 0
                   ? absl::StrCat("on port ", data_plane_->port(),
                                  " with TCP (trusted network)")
                   : std::string("with TCP (trusted network), no listener"))
            : std::string("on shared memory and RDMA only, no listener"),
        " (", data_plane_->size(),
        data_plane_->size() == 1 ? " progress thread" : " progress threads",
        ", staging ", options_.ucx.staging_bytes, " bytes",
        segments.in_use()
            ? absl::StrCat(", TCP segments tx ", segments.tx_bytes, " rx ",
                           segments.rx_bytes)
            : std::string(),
        ")");
  }
  LogInfo(absl::StrCat(
      "kvcache-node serving gRPC on port ", port_,
      options_.tls.enabled()
          ? (options_.tls.client_ca_file.empty() ? " (TLS)" : " (mTLS)")
          : " (plaintext)",
      health_port_ ? absl::StrCat(", health on port ", health_port_)
                   : std::string(),
      metrics_port_ ? absl::StrCat(", metrics on port ", metrics_port_)
                    : std::string(),
      plane,
      tenants_ != nullptr
          ? absl::StrCat(", ", tenants_->Names().size(), " tenants from ",
                         options_.tenants_file)
          : std::string(),
      "; ", arena_description, ", page size ", options_.store.page_size,
      ", default codec ", kernels::CodecName(options_.store.default_codec)));
}

void Node::ReaperLoop() {
  while (
      !stop_reaper_.WaitForNotificationWithTimeout(options_.reaper_interval)) {
    // Lease expiry, watermark eviction, KIVI residual re-encodes.
    store_->RunMaintenance(absl::Now());
    RefreshTenants(absl::Now());
    // Data-plane sessions end with their leases; commit waits with their
    // calls' deadlines.
    if (data_plane_ != nullptr) data_plane_->Expire(absl::Now());
  }
}

void Node::RefreshTenants(absl::Time now) {
  if (tenants_ == nullptr || now < next_tenants_check_) return;
  next_tenants_check_ = now + options_.tenants_refresh;
  absl::StatusOr<bool> reloaded = tenants_->Reload();
  if (!reloaded.ok()) {
    std::string error(reloaded.status().message());
    if (error != last_tenants_error_) {
      LogInfo(
          absl::StrCat("warning: tenants not reloaded, the last good "
                       "file keeps serving: ",
                       error));
      last_tenants_error_ = std::move(error);
    }
    return;
  }
  last_tenants_error_.clear();
  if (*reloaded) {
    LogInfo(absl::StrCat("tenants reloaded from ", options_.tenants_file, ": ",
                         tenants_->Names().size(), " tenants"));
  }
}

void Node::Drain(absl::Duration notice) {
  MutexLock lock(&drain_mu_);
  if (drained_) return;
  drained_ = true;
  const absl::Time deadline = absl::Now() + options_.drain_timeout;
  if (metrics_ != nullptr) metrics_->SetReady(false);
  for (grpc::Server* s : {server_.get(), health_server_.get()}) {
    if (s == nullptr) continue;
    s->GetHealthCheckService()->SetServingStatus(false);
  }
  if (data_plane_ != nullptr) {
    // No new sessions; commits waiting for bytes end by the drain deadline.
    data_plane_->BeginDrain(deadline);
  }
  if (server_ != nullptr) {
    if (started_) LogInfo("draining: health NOT_SERVING, finishing calls");
    // Every port still answers (NOT_SERVING) during the notice.
    absl::SleepFor(std::min(notice, options_.drain_timeout));
    server_->Shutdown(absl::ToChronoTime(deadline));
    server_->Wait();
  }
  // The data plane stops before the pool: it schedules commits there. Work
  // already queued owns what it touches.
  if (data_plane_ != nullptr) {
    data_plane_->Stop();
    metrics_->SetDataPlaneSource(nullptr);  // the plane goes before metrics
  }
  workers_.reset();     // runs what is queued; every reactor has finished
  background_.reset();  // a prefault under way stops at its next step
  if (health_server_ != nullptr) {
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_->Wait();
  }
  if (reaper_.joinable()) {
    stop_reaper_.Notify();
    reaper_.join();
  }
  // The UCX context and worker go now (the reaper, which expires sessions,
  // has stopped), not at the node's destruction: kvcache-node exits after
  // Drain without destroying the node (main.cc).
  data_plane_.reset();
  if (started_) LogInfo("drained");
}

}  // namespace kvcache::service
