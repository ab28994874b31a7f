// Private to the cluster client: one operation fanned out over many nodes
// (FanOutCall), stopped at its deadline and by its cancel token (Arm).
//
// Contract: tasks merge their part into `Partial` (TaskDone); the result
// is delivered exactly once: when every task is done, or at Stop()
// (deadline: what is there, through `finish`; cancel / shutdown:
// CANCELLED). With wait_for_tasks (Put), a stopped call is delivered only
// once no task runs any more. The call starts with one task of its own,
// the planning step, which ends with Planned(): nothing is delivered
// before every task is known.
#ifndef KVCACHE_CLIENT_FAN_OUT_H_
#define KVCACHE_CLIENT_FAN_OUT_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "base/notification.h"
#include "client/executor.h"
#include "kvcache/call_options.h"

namespace kvcache::internal {

template <typename Partial, typename Result>
class FanOutCall {
 public:
  using Done = absl::AnyInvocable<void(absl::StatusOr<Result>)>;
  using Finish = absl::AnyInvocable<absl::StatusOr<Result>(Partial&)>;

  FanOutCall(absl::Time deadline, bool wait_for_tasks, Partial partial,
             Finish finish, Done done)
      : deadline_(deadline),
        wait_for_tasks_(wait_for_tasks),
        partial_(std::move(partial)),
        finish_(std::move(finish)),
        done_(std::move(done)) {}

  absl::Time deadline() const { return deadline_; }
  // Notified when the call stops (deadline, cancel, shutdown).
  const Notification& stop() const { return stop_; }
  // Fired when the call is stopped by a cancel or shutdown (not at its
  // deadline, where every RPC's own deadline ends it): cancels the RPCs and
  // data-plane waits its tasks have in flight.
  const std::shared_ptr<CancelToken>& rpc_cancel() const { return rpc_cancel_; }

  // Runs `cleanup` at delivery (now when delivered already).
  void SetCleanup(absl::AnyInvocable<void()> cleanup) {
    {
      MutexLock lock(&mu_);
      if (!delivered_) {
        cleanup_ = std::move(cleanup);
        return;
      }
    }
    cleanup();
  }

  void AddTask() {
    MutexLock lock(&mu_);
    ++pending_;
  }

  // Adds a task and hands it to `submit`; a task `submit` drops (false)
  // counts as done with nothing to merge.
  void Spawn(absl::FunctionRef<bool(absl::AnyInvocable<void()>)> submit,
             absl::AnyInvocable<void()> task) {
    AddTask();
    if (!submit(std::move(task))) TaskDone([](Partial&) {});
  }

  void TaskDone(absl::FunctionRef<void(Partial&)> merge) {
    Delivery d;
    {
      MutexLock lock(&mu_);
      if (!delivered_) merge(partial_);
      --pending_;
      d = MaybeDeliverLocked();
    }
    d.Run();
  }

  // Ends the planning step: every task has been spawned.
  void Planned() {
    TaskDone([](Partial&) {});
  }

  // DEADLINE_EXCEEDED delivers what is there; any other status is
  // delivered as the call's error.
  void Stop(absl::Status reason) {
    Delivery d;
    const bool cancel_rpcs =
        reason.code() != absl::StatusCode::kDeadlineExceeded;
    {
      MutexLock lock(&mu_);
      if (stopped_) return;
      stopped_ = true;
      stop_reason_ = std::move(reason);
      stop_.Notify();
      d = MaybeDeliverLocked();
    }
    if (cancel_rpcs) rpc_cancel_->Cancel();
    d.Run();
  }

 private:
  struct Delivery {
    Done done;
    std::optional<absl::StatusOr<Result>> result;
    absl::AnyInvocable<void()> cleanup;
    void Run() {
      if (!result.has_value()) return;
      if (cleanup) cleanup();
      done(*std::move(result));
    }
  };

  Delivery MaybeDeliverLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Delivery d;
    if (delivered_) return d;
    if (pending_ > 0 && !(stopped_ && !wait_for_tasks_)) return d;
    delivered_ = true;
    if (stopped_ &&
        stop_reason_.code() != absl::StatusCode::kDeadlineExceeded) {
      d.result = absl::StatusOr<Result>(stop_reason_);
    } else {
      d.result = finish_(partial_);
    }
    d.done = std::move(done_);
    d.cleanup = std::move(cleanup_);
    return d;
  }

  const absl::Time deadline_;
  const bool wait_for_tasks_;
  const std::shared_ptr<CancelToken> rpc_cancel_ =
      std::make_shared<CancelToken>();
  Notification stop_;
  Mutex mu_;
  Partial partial_ ABSL_GUARDED_BY(mu_);
  Finish finish_ ABSL_GUARDED_BY(mu_);
  Done done_ ABSL_GUARDED_BY(mu_);
  absl::AnyInvocable<void()> cleanup_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 1;  // the planning step's own token
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status stop_reason_ ABSL_GUARDED_BY(mu_);
  bool delivered_ ABSL_GUARDED_BY(mu_) = false;
};

// Stops `call` at its deadline (DEADLINE_EXCEEDED, or CANCELLED once
// `shutting_down`) on `timer`, and when `cancel` (optional) fires; both
// are undone at delivery. `timer` must outlive the call's delivery.
template <typename C>
void Arm(DeadlineTimer* timer,
         const std::shared_ptr<std::atomic<bool>>& shutting_down,
         const std::shared_ptr<C>& call,
         const std::shared_ptr<CancelToken>& cancel) {
  std::weak_ptr<C> weak = call;
  const uint64_t timer_id =
      timer->Schedule(call->deadline(), [weak, shutting_down] {
        if (std::shared_ptr<C> c = weak.lock()) {
          c->Stop(shutting_down->load()
                      ? absl::CancelledError("ClusterClient is shutting down")
                      : absl::DeadlineExceededError("call deadline"));
        }
      });
  uint64_t cancel_id = 0;
  if (cancel != nullptr) {
    cancel_id = cancel->AddCallback([weak] {
      if (std::shared_ptr<C> c = weak.lock()) {
        c->Stop(absl::CancelledError("cancelled by the caller"));
      }
    });
  }
  call->SetCleanup([timer, timer_id, cancel, cancel_id] {
    timer->Cancel(timer_id);
    if (cancel != nullptr) cancel->RemoveCallback(cancel_id);
  });
}

// `indices` cut into runs of at most `size`.
inline std::vector<std::vector<uint32_t>> Chunks(
    const std::vector<uint32_t>& indices, size_t size) {
  std::vector<std::vector<uint32_t>> out;
  for (size_t i = 0; i < indices.size(); i += size) {
    size_t end = std::min(indices.size(), i + size);
    out.emplace_back(indices.begin() + i, indices.begin() + end);
  }
  return out;
}

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_FAN_OUT_H_
