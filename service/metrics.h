// Metrics: the node's Prometheus registry (BRIEF section 7). Request and
// quantize metrics are recorded as calls happen; capacity, accounting and
// lease gauges are read from Store::Stats() at scrape time, so a scrape
// always shows the bytes actually held. Every label value comes from a
// closed set (op names, gRPC code names, codec names, registered namespaces
// bounded by --max-namespaces); never keys or request ids.
#ifndef KVCACHE_SERVICE_METRICS_H_
#define KVCACHE_SERVICE_METRICS_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "kernels/codec.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "store/store.h"

namespace kvcache::service {

class Metrics {
 public:
  explicit Metrics(const store::Store* store);

  // `tenant`: a name from the tenants file, "unauthenticated" or "open"
  // (a closed set: never a value a caller chooses).
  void RecordRequest(absl::string_view op, absl::string_view code,
                     absl::string_view tenant, double seconds);
  void RecordQuantize(kernels::Codec codec, double seconds);
  void RecordTransfer(absl::string_view direction, absl::string_view transport,
                      uint64_t bytes);
  void SetReady(bool ready) { ready_->store(ready); }

  // The UCX data plane's state, read at scrape time.
  struct DataPlaneGauges {
    uint64_t staging_capacity_bytes = 0;
    uint64_t staging_used_bytes = 0;
    uint64_t staging_cached_bytes = 0;
    uint64_t connections = 0;
    uint64_t write_sessions = 0;
    uint64_t read_sessions = 0;
    uint64_t rejected_connections = 0;
    uint64_t buffer_keys = 0;
    uint64_t pulled_blocks = 0;
    uint64_t blocks_received_in_place = 0;
    uint64_t message_reads = 0;
    uint64_t copied_reads = 0;
    uint64_t blocks_decoded_into_destination = 0;
    uint64_t blocks_decoded_at_read_start = 0;
    uint64_t reads_checked_while_copying = 0;
    uint64_t reads_checked_before_sending = 0;
    uint64_t read_slices_posted = 0;
    uint64_t prefaulted_buffer_bytes = 0;
    uint64_t buffer_bytes_populated_by_reads = 0;
  };
  // Without a source (no data plane) the kvcache_data_plane_* series are
  // absent.
  void SetDataPlaneSource(std::function<DataPlaneGauges()> source);

  // Starts serving /metrics on host:port (port 0 picks one). Returns the
  // bound port, or an error when the address cannot be bound.
  absl::StatusOr<int> Serve(const std::string& listen);

  // The exposition text, as a scrape would see it.
  std::string Render() const;

 private:
  class StoreCollector;
  class DataPlaneCollector;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StoreCollector> store_collector_;
  std::shared_ptr<DataPlaneCollector> data_plane_collector_;
  std::shared_ptr<std::atomic<bool>> ready_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* request_duration_;
  prometheus::Family<prometheus::Histogram>* quantize_duration_;
  prometheus::Family<prometheus::Counter>* transfer_bytes_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace kvcache::service

#endif  // KVCACHE_SERVICE_METRICS_H_
