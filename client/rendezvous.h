// Private to the client library: rendezvous (highest-random-weight) hashing
// of keys over nodes, and DNS resolution of a headless service.
//
// The scheme (every client of a fleet must agree; docs/client.md):
//   node_seed(id)   = XXH3_64bits(id bytes), id = "ip:port" as resolved
//   score(id, key)  = XXH3_64bits_withSeed(key bytes, node_seed(id))
//   owner(key)      = the node of highest score; on a tie, the node whose id
//                     sorts first (bytewise).
// Removing a node moves only the keys it owned; adding one moves to it only
// the keys it now wins.
#ifndef KVCACHE_CLIENT_RENDEZVOUS_H_
#define KVCACHE_CLIENT_RENDEZVOUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcache::internal {

uint64_t NodeSeed(absl::string_view node_id);
uint64_t RendezvousScore(uint64_t node_seed, absl::string_view key);

// Index into `node_seeds` of the owner of `key`; `node_seeds` must be
// ordered as the node ids sort (so that the lower index wins a tie) and not
// be empty.
size_t RendezvousOwner(absl::Span<const uint64_t> node_seeds,
                       absl::string_view key);

// The IPv4 addresses (A records, through getaddrinfo and so /etc/hosts and
// the system resolver) of `name`, as sorted unique "a.b.c.d:port" strings.
// NOT_FOUND when the name has no address; UNAVAILABLE on a resolver
// failure that may be temporary. Blocks for at most the resolver's own
// timeouts (resolv.conf).
absl::StatusOr<std::vector<std::string>> ResolveIpv4(const std::string& name,
                                                     int port);

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_RENDEZVOUS_H_
