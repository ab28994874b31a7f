// Mutex, MutexLock and CondVar: a std::mutex with Abseil's thread-safety
// annotations, and a condition variable that waits on it. The project's one
// lock idiom: every mutex in base/, kernels/, store/, transport/, service/,
// client/ and tools/ is this one, and the clang build with
// -DKVCACHE_THREAD_SAFETY=ON checks every ABSL_GUARDED_BY against it.
//
// Why not absl::Mutex: Debian ships Abseil as uninstrumented shared
// libraries, so ThreadSanitizer cannot see absl::Mutex's synchronization
// and reports races between accesses the mutex does order. std::mutex
// goes through pthread, which TSan intercepts, so the tests under TSan
// report only real races. Why not a bare std::mutex: clang cannot check
// what it guards.
#ifndef KVCACHE_BASE_MUTEX_H_
#define KVCACHE_BASE_MUTEX_H_

#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcache {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

// Waits on a Mutex the caller holds (it is released while waiting and held
// again on return).
class CondVar {
 public:
  // Until `done()` holds; `done` runs with `mu` held.
  template <typename Predicate>
  void Wait(Mutex* mu, Predicate done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock, done);
    lock.release();  // still held, by the caller's MutexLock
  }
  // Until `done()` holds or `deadline` passes; returns the last done().
  template <typename Predicate>
  bool WaitUntil(Mutex* mu, absl::Time deadline, Predicate done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (deadline == absl::InfiniteFuture()) {
      Wait(mu, done);
      return true;
    }
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    // absl::ToChronoTime saturates; a deadline in the past returns at once.
    const bool result =
        cv_.wait_until(lock, absl::ToChronoTime(deadline), done);
    lock.release();
    return result;
  }
  template <typename Predicate>
  bool WaitFor(Mutex* mu, absl::Duration timeout, Predicate done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return WaitUntil(mu, absl::Now() + timeout, done);
  }
  void SignalAll() { cv_.notify_all(); }
  void Signal() { cv_.notify_one(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvcache

#endif  // KVCACHE_BASE_MUTEX_H_
