// ClientTestAccess: what a test of kvcache::Client reaches inside it, and
// nothing a caller of the library needs. Private to the client library and
// its tests.
#ifndef KVCACHE_CLIENT_CLIENT_TEST_ACCESS_H_
#define KVCACHE_CLIENT_CLIENT_TEST_ACCESS_H_

#include "absl/status/statusor.h"
#include "client/ucx/client_plane.h"
#include "kvcache/client.h"

namespace kvcache::internal {

struct ClientTestAccess {
  // The client's UCX side, started if it was not (UNAVAILABLE where UCX
  // cannot start in this process, as its first data-plane read would be
  // told). Tests post onto its progress thread (ClientPlane::PostForTest)
  // to hold back the start of the client's reads.
  static absl::StatusOr<ucx::ClientPlane*> Plane(Client& client);
};

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_CLIENT_TEST_ACCESS_H_
