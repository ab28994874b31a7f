// DataPlanes: the node's UCX data plane as one or more shards. Each shard is
// a DataPlane (data_plane.h): its own UCX context, worker and progress
// thread. The shards share the store, the worker pool and one staging
// budget, so that the bytes of many client processes are not all moved by
// one progress thread (BRIEF section 5).
//
// Invariants:
//  * A client (its gRPC connection, named by the peer the control plane
//    sees) is served by one shard: its first data-plane session goes to
//    the shard that serves the fewest clients, and its later sessions to
//    the same shard until it has opened none for kClientIdle. So a client
//    process keeps one UCX connection per node, and the node maps each of
//    its long-lived buffers once.
//  * A session lives on the shard that opened it. Commit, TakeWrite and
//    EndRead go to the shard that holds the session; one that no shard
//    holds is answered as a single DataPlane answers it (from the store's
//    table).
//  * Only shard 0 opens the listener (DataPlaneOptions::listen). Sessions
//    of the other shards name their worker address alone, which every
//    client of this tree dials first (DataPlaneInfo.worker_address).
//  * Staging never exceeds options.staging_bytes over all shards together.
#ifndef KVCACHE_SERVICE_UCX_DATA_PLANES_H_
#define KVCACHE_SERVICE_UCX_DATA_PLANES_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "service/ucx/data_plane.h"

namespace kvcache::ucx {

// A client that opens no data-plane session for this long is forgotten:
// its next session may go to another shard.
inline constexpr absl::Duration kClientIdle = absl::Minutes(5);

// Whether `shards` data planes can run under the environment's
// UCX_TCP_PORT_RANGE (`port_range`, "MIN-MAX", empty when unset): each
// shard's UCX context binds a TCP interface port of its own, so with TCP
// in use the range must hold one port per shard. FAILED_PRECONDITION
// naming both when it does not; INVALID_ARGUMENT for a range that is not
// "MIN-MAX".
absl::Status CheckTcpPortRange(const DataPlaneOptions& options, int shards,
                               absl::string_view port_range);

class DataPlanes {
 public:
  // Starts options.progress_threads shards (at least 1; see
  // CheckTcpPortRange); the arguments are DataPlane::Start's.
  static absl::StatusOr<std::unique_ptr<DataPlanes>> Start(
      DataPlaneOptions options, store::Store* store,
      DataPlane::Executor executor, DataPlane::Executor background,
      DataPlane::TransferObserver observer);
  ~DataPlanes();
  DataPlanes(const DataPlanes&) = delete;
  DataPlanes& operator=(const DataPlanes&) = delete;

  // The shard that serves `client` (see the invariants). Thread-safe.
  DataPlane& ForClient(absl::string_view client);

  // DataPlane's, routed to the shard that holds the session.
  bool Commit(uint64_t write_id, absl::Time deadline,
              DataPlane::CommitDone done);
  store::WriteClaim TakeWrite(uint64_t write_id);
  std::optional<store::ReadClaim> EndRead(uint64_t lease_id);
  // From the shared budget; UNAVAILABLE while draining.
  absl::StatusOr<StagingReservation> ReserveStaging(uint64_t bytes);

  // Every shard's.
  void Expire(absl::Time now);
  void BeginDrain(absl::Time deadline);
  void Stop();
  // Summed over the shards (staging: the shared budget's, once).
  DataPlaneStats Stats() const;

  size_t size() const { return shards_.size(); }
  DataPlane& shard(size_t i) { return *shards_[i]; }
  // Shard 0's: the listener's port (0: none), its worker address, and the
  // TCP segment sizes (the same in every shard: one process environment).
  int port() const { return shards_[0]->port(); }
  const std::string& address() const { return shards_[0]->address(); }
  const std::string& worker_address() const {
    return shards_[0]->worker_address();
  }
  const TcpSegments& tcp_segments() const { return shards_[0]->tcp_segments(); }

 private:
  struct Client {
    size_t shard = 0;
    absl::Time last_seen;
  };

  explicit DataPlanes(std::vector<std::unique_ptr<DataPlane>> shards);
  // The shard holding the session `has` finds, else shard 0.
  template <typename Has>
  DataPlane& Holder(Has has);

  std::vector<std::unique_ptr<DataPlane>> shards_;

  Mutex mu_;
  absl::flat_hash_map<std::string, Client> clients_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> clients_per_shard_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcache::ucx

#endif  // KVCACHE_SERVICE_UCX_DATA_PLANES_H_
