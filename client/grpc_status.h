// Private to the client library: the one gRPC -> absl status edge of the
// client. Every RPC's status goes through FromGrpc, which keeps the code
// numbers (gRPC and absl share them) and the node's RESOURCE_EXHAUSTED
// retry hint (the kvcache-retry-after-ms trailer), as the payload that the
// public RetryAfterMs (kvcache/client.h) reads.
#ifndef KVCACHE_CLIENT_GRPC_STATUS_H_
#define KVCACHE_CLIENT_GRPC_STATUS_H_

#include <chrono>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace kvcache::internal {

// The status of an RPC made with `ctx` (its trailers read for the hint).
absl::Status FromGrpc(const grpc::Status& status,
                      const grpc::ClientContext& ctx);

// A gRPC deadline: absl::InfiniteFuture() is none.
std::chrono::system_clock::time_point GrpcDeadline(absl::Time t);

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_GRPC_STATUS_H_
