#include "kvcache/call_options.h"

#include <algorithm>
#include <utility>

namespace kvcache {

void CancelToken::Cancel() {
  std::map<uint64_t, absl::AnyInvocable<void()>> run;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    run.swap(callbacks_);
  }
  for (auto& [id, fn] : run) fn();
}

bool CancelToken::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

uint64_t CancelToken::AddCallback(absl::AnyInvocable<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (!cancelled_) {
      uint64_t id = next_id_++;
      callbacks_.emplace(id, std::move(fn));
      return id;
    }
  }
  fn();
  return 0;
}

void CancelToken::RemoveCallback(uint64_t id) {
  absl::MutexLock lock(&mu_);
  callbacks_.erase(id);
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
