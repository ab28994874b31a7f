#include "service/metrics.h"

#include <exception>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/gauge.h"
#include "prometheus/text_serializer.h"

namespace kvcache::service {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(const std::string& name, const std::string& help,
                    MetricType type) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

void AddValue(MetricFamily* f, double value,
              std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  if (f->type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f->metric.push_back(std::move(m));
}

std::string CodecLabel(size_t index) {
  return std::string(kernels::CodecName(static_cast<kernels::Codec>(index)));
}

#ifndef KVCACHE_VERSION
#define KVCACHE_VERSION "dev"
#endif

}  // namespace

class Metrics::StoreCollector : public prometheus::Collectable {
 public:
  StoreCollector(const store::Store* store,
                 std::shared_ptr<std::atomic<bool>> ready)
      : store_(store), ready_(std::move(ready)) {}

  std::vector<MetricFamily> Collect() const override {
    store::StoreStats s = store_->Stats();
    std::vector<MetricFamily> out;
    auto gauge = [&](const char* name, const char* help, double v) {
      out.push_back(Family(name, help, MetricType::Gauge));
      AddValue(&out.back(), v);
    };
    gauge("kvcache_pool_capacity_bytes", "Bytes of the block pool.",
          s.capacity_bytes);
    gauge("kvcache_pool_used_bytes", "Pool bytes held by stored blocks.",
          s.used_bytes);
    gauge("kvcache_pool_reserved_bytes",
          "Pool bytes reserved by open write leases.", s.reserved_bytes);
    gauge("kvcache_pool_used_ratio", "Used over capacity bytes.",
          s.capacity_bytes == 0
              ? 0.0
              : static_cast<double>(s.used_bytes) / s.capacity_bytes);
    gauge("kvcache_pool_fragmentation_bytes",
          "Unused tails of the pages that stored blocks hold.",
          s.fragmentation_bytes);
    gauge("kvcache_pinned_bytes", "Pool bytes pinned by reads and lookups.",
          s.pinned_bytes);

    MetricFamily blocks =
        Family("kvcache_blocks", "Stored blocks by codec.", MetricType::Gauge);
    MetricFamily tokens = Family("kvcache_stored_tokens",
                                 "Stored tokens by codec.", MetricType::Gauge);
    MetricFamily logical =
        Family("kvcache_logical_bytes",
               "fp16 bytes that the stored blocks stand for, by codec.",
               MetricType::Gauge);
    for (size_t c = 0; c < s.codecs.size(); ++c) {
      AddValue(&blocks, s.codecs[c].blocks, {{"codec", CodecLabel(c)}});
      AddValue(&tokens, s.codecs[c].tokens, {{"codec", CodecLabel(c)}});
      AddValue(&logical, s.codecs[c].logical_bytes, {{"codec", CodecLabel(c)}});
    }
    out.push_back(std::move(blocks));
    out.push_back(std::move(tokens));
    out.push_back(std::move(logical));

    MetricFamily fit = Family(
        "kvcache_token_capacity_remaining",
        "Tokens that still fit in the free pool, per namespace layout and "
        "codec.",
        MetricType::Gauge);
    for (const store::NamespaceStats& ns : s.namespaces) {
      for (size_t c = 0; c < ns.tokens_that_fit.size(); ++c) {
        AddValue(&fit, ns.tokens_that_fit[c],
                 {{"codec", CodecLabel(c)}, {"kv_namespace", ns.name}});
      }
    }
    out.push_back(std::move(fit));

    MetricFamily evictions =
        Family("kvcache_evictions_total", "Blocks removed, by reason.",
               MetricType::Counter);
    AddValue(&evictions, s.evictions_capacity, {{"reason", "capacity"}});
    AddValue(&evictions, s.evictions_watermark, {{"reason", "watermark"}});
    AddValue(&evictions, s.evictions_data_loss, {{"reason", "data_loss"}});
    AddValue(&evictions, s.deleted, {{"reason", "deleted"}});
    out.push_back(std::move(evictions));

    out.push_back(Family("kvcache_data_loss_total",
                         "Blocks that failed header or checksum "
                         "verification on read.",
                         MetricType::Counter));
    AddValue(&out.back(), s.data_loss_events);

    MetricFamily lookups =
        Family("kvcache_lookup_blocks_total", "Looked-up blocks by result.",
               MetricType::Counter);
    AddValue(&lookups, s.lookup_hits, {{"result", "hit"}});
    AddValue(&lookups, s.lookup_misses, {{"result", "miss"}});
    out.push_back(std::move(lookups));

    MetricFamily leases = Family("kvcache_active_leases",
                                 "Open leases by kind.", MetricType::Gauge);
    AddValue(&leases, s.active_read_leases, {{"kind", "read"}});
    AddValue(&leases, s.active_write_leases, {{"kind", "write"}});
    out.push_back(std::move(leases));

    out.push_back(Family("kvcache_reencoded_blocks_total",
                         "Blocks re-encoded from fp16 to their KIVI codec on "
                         "leaving the residual window.",
                         MetricType::Counter));
    AddValue(&out.back(), s.reencoded_blocks);
    gauge("kvcache_reencode_queue_blocks",
          "Blocks waiting to be re-encoded out of the residual window.",
          s.pending_reencodes);
    MetricFamily residual =
        Family("kvcache_residual_blocks",
               "Blocks kept fp16 in KIVI's residual window, per namespace.",
               MetricType::Gauge);
    for (const store::NamespaceStats& ns : s.namespaces) {
      AddValue(&residual, ns.residual_blocks, {{"kv_namespace", ns.name}});
    }
    out.push_back(std::move(residual));

    out.push_back(Family("kvcache_leases_expired_total",
                         "Leases ended by their TTL.", MetricType::Counter));
    AddValue(&out.back(), s.expired_leases);

    gauge("kvcache_ready", "1 while serving, 0 while starting or draining.",
          ready_->load() ? 1 : 0);
    out.push_back(
        Family("kvcache_build_info", "Build of this node.", MetricType::Gauge));
#ifdef KVCACHE_HAVE_CUDA_BUILD
    const char* cuda = "true";
#else
    const char* cuda = "false";
#endif
    AddValue(&out.back(), 1, {{"cuda", cuda}, {"version", KVCACHE_VERSION}});
    return out;
  }

 private:
  const store::Store* store_;
  std::shared_ptr<std::atomic<bool>> ready_;
};

class Metrics::DataPlaneCollector : public prometheus::Collectable {
 public:
  void SetSource(std::function<DataPlaneGauges()> source) {
    MutexLock lock(&mu_);
    source_ = std::move(source);
  }

  std::vector<MetricFamily> Collect() const override {
    std::function<DataPlaneGauges()> source;
    {
      MutexLock lock(&mu_);
      source = source_;
    }
    std::vector<MetricFamily> out;
    if (!source) return out;
    DataPlaneGauges g = source();
    auto add = [&](MetricType type, const char* name, const char* help,
                   double v) {
      out.push_back(Family(name, help, type));
      AddValue(&out.back(), v);
    };
    auto gauge = [&](const char* name, const char* help, double v) {
      add(MetricType::Gauge, name, help, v);
    };
    auto counter = [&](const char* name, const char* help, double v) {
      add(MetricType::Counter, name, help, v);
    };
    gauge("kvcache_data_plane_staging_capacity_bytes",
          "Bytes the UCX data plane may hold for transfers (--staging-bytes).",
          g.staging_capacity_bytes);
    gauge("kvcache_data_plane_staging_used_bytes",
          "Bytes the UCX data plane holds: write blocks awaiting commit and "
          "read copies awaiting transfer.",
          g.staging_used_bytes);
    gauge("kvcache_data_plane_staging_cached_bytes",
          "Freed staging buffers the UCX data plane keeps for reuse (within "
          "--staging-bytes together with the used bytes).",
          g.staging_cached_bytes);
    gauge("kvcache_data_plane_connections", "Open UCX connections.",
          g.connections);
    MetricFamily sessions =
        Family("kvcache_data_plane_sessions",
               "Open data-plane sessions by kind.", MetricType::Gauge);
    AddValue(&sessions, g.write_sessions, {{"kind", "write"}});
    AddValue(&sessions, g.read_sessions, {{"kind", "read"}});
    out.push_back(std::move(sessions));
    counter("kvcache_data_plane_rejected_connections_total",
            "UCX connections closed for not presenting a valid "
            "token.",
            g.rejected_connections);
    gauge("kvcache_data_plane_buffer_keys",
          "Remote keys of clients' long-lived buffers (DataBuffers) the node "
          "keeps on its connections.",
          g.buffer_keys);
    counter("kvcache_data_plane_pulled_blocks_total",
            "Blocks encoded straight from a client buffer the "
            "node mapped (pulled writes: no copy).",
            g.pulled_blocks);
    counter("kvcache_data_plane_blocks_received_in_place_total",
            "Receives begun straight into blocks' store pages (codec none "
            "and KIVI residual windows on host memory: no staging, no copy).",
            g.blocks_received_in_place);
    counter("kvcache_data_plane_message_reads_total",
            "Reads whose blocks went to the client as data "
            "messages (rendezvous into its buffer) rather than "
            "puts, as on TCP.",
            g.message_reads);
    counter("kvcache_data_plane_copied_reads_total",
            "Reads the node copied into a client buffer it maps "
            "(shared memory) on its worker pool, rather than by "
            "UCX puts on its progress thread.",
            g.copied_reads);
    counter("kvcache_data_plane_blocks_decoded_into_destination_total",
            "Blocks of fp16 reads that the node decoded straight into a "
            "client buffer it maps (shared memory), in the pass that "
            "checks them.",
            g.blocks_decoded_into_destination);
    counter("kvcache_data_plane_blocks_decoded_at_read_start_total",
            "Blocks of fp16 reads asked to be decoded in the client's "
            "memory that the node could not map, decoded into staging "
            "when the transfer began.",
            g.blocks_decoded_at_read_start);
    counter("kvcache_data_plane_reads_checked_while_copying_total",
            "Reads of blocks in place whose layer checksums the "
            "node checked in the pass that copied them into a "
            "client buffer it maps (shared memory).",
            g.reads_checked_while_copying);
    counter(
        "kvcache_data_plane_reads_checked_before_sending_total",
        "Reads of blocks in place whose layer checksums the node checked on "
        "its worker pool before sending each slice (TCP, RDMA).",
        g.reads_checked_before_sending);
    counter("kvcache_data_plane_read_slices_posted_total",
            "Slices of reads sent: one per layer for a read "
            "layer by layer, one per block for a whole read.",
            g.read_slices_posted);
    counter("kvcache_data_plane_prefaulted_buffer_bytes_total",
            "Bytes of clients' long-lived buffers that the node mapped "
            "(shared memory) and faulted in on a thread of its own when "
            "it first kept their keys.",
            g.prefaulted_buffer_bytes);
    counter("kvcache_data_plane_buffer_bytes_populated_by_reads_total",
            "Bytes of such buffers that reads faulted in themselves "
            "because they came before that prefault did.",
            g.buffer_bytes_populated_by_reads);
    return out;
  }

 private:
  mutable Mutex mu_;
  std::function<DataPlaneGauges()> source_ ABSL_GUARDED_BY(mu_);
};

void Metrics::SetDataPlaneSource(std::function<DataPlaneGauges()> source) {
  data_plane_collector_->SetSource(std::move(source));
}

Metrics::Metrics(const store::Store* store)
    : registry_(std::make_shared<prometheus::Registry>()),
      ready_(std::make_shared<std::atomic<bool>>(false)) {
  store_collector_ = std::make_shared<StoreCollector>(store, ready_);
  data_plane_collector_ = std::make_shared<DataPlaneCollector>();
  requests_ = &prometheus::BuildCounter()
                   .Name("kvcache_requests_total")
                   .Help(
                       "Control-plane requests by operation, gRPC code and "
                       "tenant.")
                   .Register(*registry_);
  request_duration_ = &prometheus::BuildHistogram()
                           .Name("kvcache_request_duration_seconds")
                           .Help("Control-plane request latency by operation.")
                           .Register(*registry_);
  quantize_duration_ = &prometheus::BuildHistogram()
                            .Name("kvcache_quantize_duration_seconds")
                            .Help("Time to encode one block, by codec.")
                            .Register(*registry_);
  transfer_bytes_ =
      &prometheus::BuildCounter()
           .Name("kvcache_transfer_bytes_total")
           .Help(
               "KV bytes moved by direction (in: writes, out: reads) and "
               "transport.")
           .Register(*registry_);
  // Series that exist before the first request, so dashboards and alerts
  // see zeros rather than gaps.
  for (const char* dir : {"in", "out"}) {
    for (const char* transport : {"grpc", "ucx"}) {
      transfer_bytes_->Add({{"direction", dir}, {"transport", transport}});
    }
  }
}

void Metrics::RecordRequest(absl::string_view op, absl::string_view code,
                            absl::string_view tenant, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
      0.025,  0.05,    0.1,    0.25,  0.5,    1,     2.5};
  requests_
      ->Add({{"op", std::string(op)},
             {"code", std::string(code)},
             {"tenant", std::string(tenant)}})
      .Increment();
  request_duration_->Add({{"op", std::string(op)}}, kBuckets).Observe(seconds);
}

void Metrics::RecordQuantize(kernels::Codec codec, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001,
      0.0025,  0.005,    0.01,    0.025,  0.05,    0.1};
  quantize_duration_
      ->Add({{"codec", std::string(kernels::CodecName(codec))}}, kBuckets)
      .Observe(seconds);
}

void Metrics::RecordTransfer(absl::string_view direction,
                             absl::string_view transport, uint64_t bytes) {
  transfer_bytes_
      ->Add({{"direction", std::string(direction)},
             {"transport", std::string(transport)}})
      .Increment(static_cast<double>(bytes));
}

namespace {
constexpr int kMetricsThreads = 8;
constexpr absl::Duration kMetricsRequestTimeout = absl::Seconds(2);
}  // namespace

absl::StatusOr<int> Metrics::Serve(const std::string& listen) {
  try {
    // civetweb gives each connection a thread until its request has
    // arrived: with its defaults (2 threads, 30 s) two idle connections stop
    // every scrape for 30 s. More threads than scrapers plus a short
    // request timeout keep /metrics answering with idle and slow
    // connections open; no connection holds a thread for longer than it.
    exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", listen, "num_threads", absl::StrCat(kMetricsThreads),
        "request_timeout_ms",
        absl::StrCat(absl::ToInt64Milliseconds(kMetricsRequestTimeout))});
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(store_collector_);
  exposer_->RegisterCollectable(data_plane_collector_);
  std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

std::string Metrics::Render() const {
  std::vector<MetricFamily> families = registry_->Collect();
  std::vector<MetricFamily> store_families = store_collector_->Collect();
  families.insert(families.end(), store_families.begin(), store_families.end());
  std::vector<MetricFamily> plane_families = data_plane_collector_->Collect();
  families.insert(families.end(), plane_families.begin(), plane_families.end());
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace kvcache::service
