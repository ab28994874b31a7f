// Notification: a one-shot event that threads wait for, on base/mutex.h (so
// that ThreadSanitizer sees the handoff, unlike Debian's uninstrumented
// absl::Notification).
#ifndef KVCACHE_BASE_NOTIFICATION_H_
#define KVCACHE_BASE_NOTIFICATION_H_

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "base/mutex.h"

namespace kvcache {

class Notification {
 public:
  Notification() = default;
  Notification(const Notification&) = delete;
  Notification& operator=(const Notification&) = delete;

  // Idempotent: wakes every waiter, now and later.
  void Notify() {
    MutexLock lock(&mu_);
    notified_ = true;
    cv_.SignalAll();
  }
  bool HasBeenNotified() const {
    MutexLock lock(&mu_);
    return notified_;
  }
  void WaitForNotification() const {
    MutexLock lock(&mu_);
    cv_.Wait(&mu_,
             [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return notified_; });
  }
  // True when notified before `timeout` passed.
  bool WaitForNotificationWithTimeout(absl::Duration timeout) const {
    MutexLock lock(&mu_);
    return cv_.WaitFor(
        &mu_, timeout,
        [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return notified_; });
  }

 private:
  mutable Mutex mu_;
  mutable CondVar cv_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcache

#endif  // KVCACHE_BASE_NOTIFICATION_H_
