// kvcache::CallOptions and kvcache::CancelToken: the per-call deadline and
// cancellation that kvcache::Client and kvcache::ClusterClient share.
//
// Contract:
//  * A call's deadline is fixed when it starts: CallDeadline(options,
//    default) below. Every wait of the call (its RPCs, data-plane
//    transfers, and for a read into caller memory the layer waits that
//    follow) ends at that deadline at the latest.
//  * A CancelToken cancels every call that carries it, now and later (a
//    call that starts with a cancelled token fails at once with CANCELLED).
//    Cancelling is idempotent and thread-safe; share a token by shared_ptr.
#ifndef KVCACHE_CLIENT_CALL_OPTIONS_H_
#define KVCACHE_CLIENT_CALL_OPTIONS_H_

#include <cstdint>
#include <memory>

#include "absl/functional/any_invocable.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcache {

// Cancels every call that carries it. Thread-safe; share it by shared_ptr.
class CancelToken {
 public:
  CancelToken();
  ~CancelToken();
  CancelToken(const CancelToken&) = delete;
  CancelToken& operator=(const CancelToken&) = delete;

  // Idempotent. Runs the registered callbacks on this thread.
  void Cancel();
  bool cancelled() const;

  // Runs `fn` at Cancel(), or now (on this thread) when cancelled already.
  // `fn` must not block. Returns an id for RemoveCallback (0 when `fn` ran
  // already). A callback may still be running on the cancelling thread when
  // RemoveCallback returns: what it touches must outlive that (hold it by
  // shared_ptr).
  uint64_t AddCallback(absl::AnyInvocable<void()> fn);
  // Forgets a callback that has not run; unknown ids are ignored.
  void RemoveCallback(uint64_t id);

 private:
  struct State;  // the mutex and what it guards (call_options.cc)
  const std::unique_ptr<State> state_;
};

struct CallOptions {
  // The call's budget from when it starts; zero or negative: the client's
  // default (ClientOptions::timeout, ClusterOptions::default_timeout).
  absl::Duration timeout = absl::ZeroDuration();
  // An absolute deadline; absl::InfiniteFuture(): none. Given alone it
  // replaces the default; given with a timeout, the earlier of the two
  // applies.
  absl::Time deadline = absl::InfiniteFuture();
  std::shared_ptr<CancelToken> cancel;  // optional
};

// The deadline of a call with `options` that starts at `now`.
absl::Time CallDeadline(const CallOptions& options,
                        absl::Duration default_timeout,
                        absl::Time now = absl::Now());

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_CALL_OPTIONS_H_
