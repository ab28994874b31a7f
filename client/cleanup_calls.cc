#include "client/cleanup_calls.h"

#include <vector>

namespace kvcache::internal {

bool CleanupCalls::CancelAndWait(absl::Duration bound) {
  std::vector<std::shared_ptr<grpc::ClientContext>> in_flight;
  {
    MutexLock lock(&state_->mu);
    state_->closing = true;
    for (auto& [ctx, weak] : state_->live) {
      if (std::shared_ptr<grpc::ClientContext> held = weak.lock()) {
        in_flight.push_back(std::move(held));
      }
    }
  }
  // Outside the lock: a callback may take it at any time. A call whose
  // callback has run while this held it is destroyed here, on the caller's
  // thread.
  for (const std::shared_ptr<grpc::ClientContext>& ctx : in_flight) {
    ctx->TryCancel();
  }
  in_flight.clear();
  MutexLock lock(&state_->mu);
  return state_->ended.WaitFor(
      &state_->mu, bound, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
        return state_->pending == 0;
      });
}

}  // namespace kvcache::internal
