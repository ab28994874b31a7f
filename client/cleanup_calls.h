// Best-effort RPCs a Client sends without waiting for their answers.
//
// AbortWrite and EndRead only hand a lease back early (the node ends it at
// its TTL anyway), so a call of the caller's never waits for them. Each is
// sent with gRPC's callback API and its state is owned by its callback.
//
// Invariant: no callback drops the last reference to the Client's channel.
// Its ClientContext holds one, and the callback runs on a thread of gRPC's
// process-wide callback queue; in libgrpc 1.51 the channel's destructor
// releases that queue and, when it held the last reference, shuts it down,
// joins its polling threads (the current one included, which fails
// silently) and frees it while the current thread still polls it. So the
// Client's destructor calls CancelAndWait before it lets go of the channel.
//
// Thread-safe.

#ifndef KVCACHE_CLIENT_CLEANUP_CALLS_H_
#define KVCACHE_CLIENT_CLEANUP_CALLS_H_

#include <functional>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "client/grpc_status.h"
#include "grpcpp/grpcpp.h"

namespace kvcache::internal {

class CleanupCalls {
 public:
  CleanupCalls() = default;
  CleanupCalls(const CleanupCalls&) = delete;
  CleanupCalls& operator=(const CleanupCalls&) = delete;

  // Sends `request` through `start(ctx, &request, &response, done)`, which
  // must start exactly one callback-API call that ends by calling `done`,
  // with `timeout` as its deadline. Sends nothing once CancelAndWait began.
  template <typename Response, typename Request, typename Start>
  void Send(absl::Duration timeout, Request request, Start start);

  // Cancels every call still in flight and waits, at most `bound`, until
  // each one's callback has run. Later Sends send nothing. Returns false
  // when `bound` passed first: a callback may still come, and the caller
  // must then keep its channel alive for good.
  bool CancelAndWait(absl::Duration bound);

 private:
  struct State {
    Mutex mu;
    CondVar ended;
    bool closing ABSL_GUARDED_BY(mu) = false;
    // Calls whose callback has not yet run, by context. Each is owned by
    // its callback; CancelAndWait holds one only while it cancels it.
    absl::flat_hash_map<grpc::ClientContext*,
                        std::weak_ptr<grpc::ClientContext>>
        live ABSL_GUARDED_BY(mu);
    // Calls not yet destroyed by their callback (live, and those whose
    // callback is destroying them).
    int pending ABSL_GUARDED_BY(mu) = 0;
  };
  // Shared with the callbacks: one that runs after a CancelAndWait that
  // gave up still finds it.
  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

template <typename Response, typename Request, typename Start>
void CleanupCalls::Send(absl::Duration timeout, Request request, Start start) {
  struct Call {
    grpc::ClientContext ctx;
    Request request;
    Response response;
  };
  auto call = std::make_shared<Call>();
  call->request = std::move(request);
  call->ctx.set_deadline(GrpcDeadline(absl::Now() + timeout));
  grpc::ClientContext* const ctx = &call->ctx;
  {
    MutexLock lock(&state_->mu);
    if (state_->closing) return;
    state_->live.emplace(ctx, std::shared_ptr<grpc::ClientContext>(call, ctx));
    ++state_->pending;
  }
  start(ctx, &call->request, &call->response,
        [call, ctx, state = state_](grpc::Status) mutable {
          {
            MutexLock lock(&state->mu);
            state->live.erase(ctx);
          }
          call.reset();  // the context, and its reference to the channel
          MutexLock lock(&state->mu);
          if (--state->pending == 0) state->ended.SignalAll();
        });
}

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_CLEANUP_CALLS_H_
