// The results of kvcache::ClusterClient's Lookup, Put and Get
// (kvcache/cluster_client.h): what was found, stored or read across the
// nodes, and what could not be asked (misses, not errors).
#ifndef KVCACHE_CLIENT_CLUSTER_RESULTS_H_
#define KVCACHE_CLIENT_CLUSTER_RESULTS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kvcache/client.h"

namespace kvcache {

struct ClusterLookupResult {
  uint32_t prefix_blocks = 0;  // keys[0, prefix_blocks) are cached
  // Keys whose node could not be asked or did not answer in time (down,
  // draining, hung, or the call's deadline came first): counted as misses.
  uint32_t unavailable_keys = 0;
};

struct ClusterPutResult {
  uint32_t stored = 0;   // written now
  uint32_t skipped = 0;  // stored already
  // Not confirmed: the owner was down, draining or timed out, or the call
  // ended first (such a block may or may not have been stored).
  uint32_t unavailable = 0;
  // Not stored: the owner stayed full (RESOURCE_EXHAUSTED) after retries.
  uint32_t rejected = 0;
  // Why: the first status an owner answered for blocks counted unavailable
  // or rejected (UNAVAILABLE naming an owner skipped while it backs off
  // after failures; DEADLINE_EXCEEDED when the call ended before owners
  // answered). OK when every block was stored or skipped.
  absl::Status why_not_stored;
};

struct ClusterGetResult {
  // The longest prefix of the keys that was read: keys[0, prefix_blocks).
  // A key missing, evicted, corrupt (DATA_LOSS) or on an unavailable node
  // ends the prefix. (Each node is asked with allow_missing: one round
  // trip per node and chunk, whatever it holds.)
  uint32_t prefix_blocks = 0;
  // read.blocks has prefix_blocks entries, in key order (block i's index
  // is i); read.missing is empty; read.shape and read.policy describe them
  // (DecodeRaw(read, block, out) for kRaw).
  GetResult read;
  uint32_t unavailable_keys = 0;  // as in ClusterLookupResult
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CLUSTER_RESULTS_H_
