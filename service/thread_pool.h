// ThreadPool: a fixed set of threads running scheduled closures in FIFO
// order. Used so that encode/decode work never runs on gRPC's callback
// threads. The destructor runs every closure already scheduled, then joins.
#ifndef KVCACHE_SERVICE_THREAD_POOL_H_
#define KVCACHE_SERVICE_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"

namespace kvcache::service {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> work);

 private:
  void Run();

  // Mutex, not absl::Mutex: ThreadSanitizer sees its handoffs.
  Mutex mu_;
  CondVar work_or_stop_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvcache::service

#endif  // KVCACHE_SERVICE_THREAD_POOL_H_
