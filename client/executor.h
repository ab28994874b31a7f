// Private to the client library: a fixed-size worker pool and a deadline
// timer, both with bounded shutdown.
#ifndef KVCACHE_CLIENT_EXECUTOR_H_
#define KVCACHE_CLIENT_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/time/time.h"
#include "base/mutex.h"

namespace kvcache::internal {

// Runs tasks on `threads` threads in FIFO order. The destructor lets queued
// tasks run, then joins the threads; when it runs on one of the pool's own
// threads (the last reference to the pool's owner was dropped by a task),
// that thread is detached instead and exits once the queue is empty (the
// queue state is shared with the threads, so nothing dangles).
class Executor {
 public:
  explicit Executor(int threads);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // False (and the task is dropped) once the destructor has started.
  bool Submit(absl::AnyInvocable<void()> task);

 private:
  struct State {
    Mutex mu;
    CondVar cv;  // signalled when `queue` grows or `stop` is set
    std::deque<absl::AnyInvocable<void()>> queue ABSL_GUARDED_BY(mu);
    bool stop ABSL_GUARDED_BY(mu) = false;
  };
  static void Loop(std::shared_ptr<State> state);

  std::shared_ptr<State> state_;
  std::vector<std::thread> threads_;
};

// Calls a function at a deadline unless cancelled first. One thread.
class DeadlineTimer {
 public:
  DeadlineTimer();
  ~DeadlineTimer();
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Returns an id for Cancel. `fn` runs on the timer thread (or in the
  // destructor) and must not block.
  uint64_t Schedule(absl::Time when, absl::AnyInvocable<void()> fn);
  // True when `fn` was removed before it ran.
  bool Cancel(uint64_t id);
  // Idempotent: joins the thread, then runs every function still scheduled
  // (on this thread). Schedule after Shutdown runs `fn` at once. Cancel
  // stays valid until destruction.
  void Shutdown();

 private:
  void Loop();

  Mutex mu_;
  CondVar cv_;  // signalled on every change of the state below
  std::multimap<absl::Time, uint64_t> by_time_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::pair<absl::Time, absl::AnyInvocable<void()>>> fns_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_EXECUTOR_H_
