// Mutex, MutexLock and CondVar: a std::mutex with Abseil's thread-safety
// annotations, and a condition variable that waits on it.
//
// Why not absl::Mutex: Debian ships Abseil as uninstrumented shared
// libraries, so ThreadSanitizer cannot see absl::Mutex's synchronization
// and reports races between accesses the mutex does order. std::mutex
// goes through pthread, which TSan intercepts, so the store's stress test
// under TSan reports only real races.
#ifndef KVCACHE_STORE_MUTEX_H_
#define KVCACHE_STORE_MUTEX_H_

#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace kvcache::store {

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
  void SignalAll() { cv_.notify_all(); }
  void Signal() { cv_.notify_one(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_MUTEX_H_
