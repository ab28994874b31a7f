// What a kvcache::ClusterClient reports about its members and itself
// (ClusterClient::Nodes and ClusterClient::counters).
#ifndef KVCACHE_CLIENT_CLUSTER_STATUS_H_
#define KVCACHE_CLIENT_CLUSTER_STATUS_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace kvcache {

struct NodeStatus {
  std::string id;  // "host:port"
  bool up = true;  // false while in backoff after a failure
  int consecutive_failures = 0;
  absl::Time retry_at = absl::InfinitePast();  // when a probe may go
};

struct ClusterCounters {
  uint64_t retries = 0;             // RPC attempts repeated after a backoff
  uint64_t node_failures = 0;       // times a node was marked down
  uint64_t unavailable_keys = 0;    // keys answered as misses for that
  uint64_t membership_changes = 0;  // refreshes that changed the members
  uint64_t refresh_failures = 0;    // DNS / discovery errors
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CLUSTER_STATUS_H_
