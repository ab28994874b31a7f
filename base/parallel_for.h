// ParallelFor: runs fn(0), ..., fn(n - 1) on the calling thread and on
// helper tasks handed to an executor, and returns when every call has
// returned.
//
// Contract:
//  * The caller claims indices too and never waits for a helper that has
//    not started: it waits only for calls already running. So the caller
//    may itself be a task of the executor (a pool task that fans out on its
//    own pool cannot deadlock), and a busy or absent executor costs
//    parallelism, never progress.
//  * Each index runs exactly once. fn must be safe to call concurrently for
//    different indices. A helper that starts after every index was claimed
//    returns without touching fn (which may be gone by then).
#ifndef KVCACHE_BASE_PARALLEL_FOR_H_
#define KVCACHE_BASE_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <type_traits>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"

namespace kvcache {

// Runs `work` later on some thread (a thread pool's Schedule).
using Executor = std::function<void(std::function<void()> work)>;

namespace parallel_for_internal {

template <typename Fn>
struct State {
  State(size_t count, Fn* function) : n(count), fn(function) {}
  const size_t n;
  Fn* const fn;  // valid while an index below n is unclaimed or running
  std::atomic<size_t> next{0};
  Mutex mu;
  CondVar cv;
  size_t done ABSL_GUARDED_BY(mu) = 0;

  void Work() {
    size_t finished = 0;
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      (*fn)(i);
      ++finished;
    }
    if (finished == 0) return;
    MutexLock lock(&mu);
    done += finished;
    if (done == n) cv.SignalAll();
  }
};

}  // namespace parallel_for_internal

// At most `max_helpers` helper tasks go to `executor` (none when it is
// empty); see the contract above.
template <typename Fn>
void ParallelFor(size_t n, const Executor& executor, int max_helpers, Fn&& fn) {
  using State = parallel_for_internal::State<std::remove_reference_t<Fn>>;
  if (n == 0) return;
  size_t helpers = executor && max_helpers > 0
                       ? std::min(static_cast<size_t>(max_helpers), n - 1)
                       : 0;
  if (helpers == 0) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<State>(n, &fn);
  for (size_t h = 0; h < helpers; ++h) {
    executor([state] { state->Work(); });
  }
  state->Work();
  MutexLock lock(&state->mu);
  state->cv.Wait(&state->mu, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) {
    return state->done == state->n;
  });
}

}  // namespace kvcache

#endif  // KVCACHE_BASE_PARALLEL_FOR_H_
