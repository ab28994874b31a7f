// kvcache::ClusterOptions: how a kvcache::ClusterClient finds its nodes,
// places keys, bounds and retries its calls (kvcache/cluster_client.h).
#ifndef KVCACHE_CLIENT_CLUSTER_OPTIONS_H_
#define KVCACHE_CLIENT_CLUSTER_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvcache/client.h"

namespace kvcache {

struct ClusterOptions {
  // Either a static list of "host:port" (each a node id, as written) ...
  std::vector<std::string> nodes;
  // ... or a DNS name whose A records are the nodes, at dns_port.
  std::string dns_name;
  int dns_port = 50051;
  // ... or a discovery function returning node ids ("host:port"); it
  // replaces DNS when set (custom service discovery, tests).
  std::function<absl::StatusOr<std::vector<std::string>>()> discover;
  // Re-resolution period of dns_name / discover; zero: only at Create and
  // at RefreshMembership(). A failed re-resolution keeps the old members.
  absl::Duration refresh_interval = absl::Seconds(10);
  // > 0: place a key by its first this many bytes (the routing tag of
  // BlockHashConfig::segment_blocks, kRoutingTagBytes) instead of the whole
  // key, so that a segment of a chain stays on one node. Every client of a
  // fleet must use the same value.
  uint32_t routing_prefix_bytes = 0;

  absl::Duration default_timeout = absl::Seconds(5);
  // One RPC attempt on one node (for a layer-wise read: its BeginRead and
  // the transfer that follows).
  absl::Duration rpc_timeout = absl::Seconds(2);
  int max_attempts = 3;  // per node and call; >= 1
  absl::Duration retry_initial_backoff = absl::Milliseconds(20);
  absl::Duration retry_max_backoff = absl::Seconds(1);
  absl::Duration node_backoff_initial = absl::Milliseconds(250);
  absl::Duration node_backoff_max = absl::Seconds(30);

  int threads_per_node = 4;
  int work_threads = 2;               // layer-wise decode and delivery
  uint32_t max_blocks_per_rpc = 256;  // <= the nodes' --max-blocks-per-request
  int max_message_bytes = 256 << 20;
  // Where KV bytes travel to and from each node (ClientOptions::data_plane).
  DataPlane data_plane = DataPlane::kAuto;
  // TLS to every node (ClientOptions::tls).
  TlsOptions tls;
  // The tenant's bearer token for nodes run with --tenants
  // (ClientOptions::bearer_token).
  std::string bearer_token;
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CLUSTER_OPTIONS_H_
