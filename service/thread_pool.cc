#include "service/thread_pool.h"

#include <algorithm>
#include <utility>

namespace kvcache::service {

ThreadPool::ThreadPool(int threads) {
  threads = std::max(1, threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  work_or_stop_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::Schedule(std::function<void()> work) {
  {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(work));
  }
  work_or_stop_.Signal();
}

void ThreadPool::Run() {
  while (true) {
    std::function<void()> work;
    {
      MutexLock lock(&mu_);
      work_or_stop_.Wait(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      });
      if (queue_.empty()) return;  // stopping and drained
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

}  // namespace kvcache::service
