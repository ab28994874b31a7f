#include "kvcache/call_options.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"

namespace kvcache {

struct CancelToken::State {
  Mutex mu;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  std::map<uint64_t, absl::AnyInvocable<void()>> callbacks ABSL_GUARDED_BY(mu);
};

CancelToken::CancelToken() : state_(std::make_unique<State>()) {}
CancelToken::~CancelToken() = default;

void CancelToken::Cancel() {
  std::map<uint64_t, absl::AnyInvocable<void()>> run;
  {
    MutexLock lock(&state_->mu);
    if (state_->cancelled) return;
    state_->cancelled = true;
    run.swap(state_->callbacks);
  }
  for (auto& [id, fn] : run) fn();
}

bool CancelToken::cancelled() const {
  MutexLock lock(&state_->mu);
  return state_->cancelled;
}

uint64_t CancelToken::AddCallback(absl::AnyInvocable<void()> fn) {
  {
    MutexLock lock(&state_->mu);
    if (!state_->cancelled) {
      uint64_t id = state_->next_id++;
      state_->callbacks.emplace(id, std::move(fn));
      return id;
    }
  }
  fn();
  return 0;
}

void CancelToken::RemoveCallback(uint64_t id) {
  MutexLock lock(&state_->mu);
  state_->callbacks.erase(id);
}

absl::Time CallDeadline(const CallOptions& options,
                        absl::Duration default_timeout, absl::Time now) {
  if (options.timeout > absl::ZeroDuration()) {
    return std::min(options.deadline, now + options.timeout);
  }
  if (options.deadline != absl::InfiniteFuture()) return options.deadline;
  return now + default_timeout;
}

}  // namespace kvcache
