#include "client/executor.h"

#include <utility>

namespace kvcache::internal {

Executor::Executor(int threads) : state_(std::make_shared<State>()) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) threads_.emplace_back(Loop, state_);
}

Executor::~Executor() {
  {
    MutexLock lock(&state_->mu);
    state_->stop = true;
    state_->cv.SignalAll();
  }
  for (std::thread& t : threads_) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();
    } else {
      t.join();
    }
  }
}

bool Executor::Submit(absl::AnyInvocable<void()> task) {
  MutexLock lock(&state_->mu);
  if (state_->stop) return false;
  state_->queue.push_back(std::move(task));
  state_->cv.Signal();
  return true;
}

void Executor::Loop(std::shared_ptr<State> state) {
  State* s = state.get();
  while (true) {
    absl::AnyInvocable<void()> task;
    {
      MutexLock lock(&s->mu);
      s->cv.Wait(&s->mu, [s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
        return s->stop || !s->queue.empty();
      });
      if (s->queue.empty()) return;  // stop and drained
      task = std::move(s->queue.front());
      s->queue.pop_front();
    }
    task();
    // `task` (and whatever it captured) is destroyed here, outside the lock.
  }
}

DeadlineTimer::DeadlineTimer() : thread_([this] { Loop(); }) {}

DeadlineTimer::~DeadlineTimer() { Shutdown(); }

void DeadlineTimer::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    cv_.SignalAll();
  }
  thread_.join();
  std::map<uint64_t, std::pair<absl::Time, absl::AnyInvocable<void()>>> left;
  {
    MutexLock lock(&mu_);
    left.swap(fns_);
    by_time_.clear();
  }
  for (auto& [id, entry] : left) entry.second();
}

uint64_t DeadlineTimer::Schedule(absl::Time when,
                                 absl::AnyInvocable<void()> fn) {
  uint64_t id;
  {
    MutexLock lock(&mu_);
    id = next_id_++;
    if (!stop_) {
      by_time_.emplace(when, id);
      fns_.emplace(id, std::make_pair(when, std::move(fn)));
      cv_.SignalAll();
      return id;
    }
  }
  fn();  // shut down: at once, outside the lock
  return id;
}

bool DeadlineTimer::Cancel(uint64_t id) {
  MutexLock lock(&mu_);
  auto it = fns_.find(id);
  if (it == fns_.end()) return false;
  auto range = by_time_.equal_range(it->second.first);
  for (auto t = range.first; t != range.second; ++t) {
    if (t->second == id) {
      by_time_.erase(t);
      break;
    }
  }
  fns_.erase(it);
  cv_.SignalAll();
  return true;
}

// Locks and unlocks mu_ by hand: each function runs with it released.
void DeadlineTimer::Loop() {
  mu_.Lock();
  while (!stop_) {
    absl::Time next =
        by_time_.empty() ? absl::InfiniteFuture() : by_time_.begin()->first;
    absl::Time now = absl::Now();
    if (next > now) {
      // Wakes on Schedule/Cancel/stop (any change of the guarded state),
      // or at the earliest deadline; re-evaluated either way.
      const size_t size_before = fns_.size();
      const uint64_t next_id_before = next_id_;
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || fns_.size() != size_before ||
               next_id_ != next_id_before;
      };
      cv_.WaitUntil(&mu_, next, changed);
      continue;
    }
    uint64_t id = by_time_.begin()->second;
    by_time_.erase(by_time_.begin());
    auto it = fns_.find(id);
    absl::AnyInvocable<void()> fn = std::move(it->second.second);
    fns_.erase(it);
    mu_.Unlock();
    fn();
    fn = nullptr;
    mu_.Lock();
  }
  mu_.Unlock();
}

}  // namespace kvcache::internal
