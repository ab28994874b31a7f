// WorkerLoop: one UCX context and worker and the thread that progresses it.
//
// Invariants:
//  * Only the loop thread touches the worker and the objects bound to it
//    (listener, endpoints, remote keys, requests); other threads hand work
//    over with Post(), which never blocks on the loop.
//  * After the last event the thread polls at most `spin_iterations` times
//    and for at most `spin_time` (yielding the CPU between polls); then it
//    arms the worker and sleeps in epoll on the worker's event fd and the
//    loop's eventfd, whether or not operations are in flight: a spinning
//    progress thread per client process starves every other process on
//    shared cores. Every sleep is bounded: `busy_wait` while the owner
//    reports operations in flight (AddBusy), a safety net should an event
//    be missed; `idle_wait` otherwise.
//  * Posted tasks run in FIFO order on the loop thread. Once Stop() has
//    begun, Post() drops the task and returns false.
//  * Stop() runs the owner's shutdown task on the loop thread (it must
//    destroy every worker-bound object it owns), progresses for at most
//    `grace` so that closes complete, joins the thread; then the worker and
//    the context are destroyed, in that order.
#ifndef KVCACHE_TRANSPORT_WORKER_LOOP_H_
#define KVCACHE_TRANSPORT_WORKER_LOOP_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "transport/handles.h"

namespace kvcache::ucx {

class WorkerLoop {
 public:
  struct Options {
    std::string name = "kvcache";
    int spin_iterations = 64;
    absl::Duration spin_time = absl::Microseconds(30);
    absl::Duration busy_wait = absl::Milliseconds(1);
    absl::Duration idle_wait = absl::Milliseconds(100);
    // UCX settings of the loop's context (Context::Create).
    Context::Settings ucx_settings;
  };
  using Task = absl::AnyInvocable<void()>;

  static absl::StatusOr<std::unique_ptr<WorkerLoop>> Start(Options options);
  ~WorkerLoop();
  WorkerLoop(const WorkerLoop&) = delete;
  WorkerLoop& operator=(const WorkerLoop&) = delete;

  // Thread-safe. False (and the task is dropped) once Stop() has begun.
  bool Post(Task task);
  // Idempotent; see the invariants above. Must not be called on the loop
  // thread.
  void Stop(Task shutdown, absl::Duration grace = absl::Milliseconds(500));

  const Context& context() const { return *context_; }
  // Loop thread only.
  const Worker& worker() const { return *worker_; }
  bool InLoopThread() const {
    return std::this_thread::get_id() == thread_.get_id();
  }
  // Loop thread only: operations in flight (they bound its sleeps by
  // busy_wait).
  void AddBusy(int delta) { busy_ += delta; }

 private:
  WorkerLoop(Options options, std::unique_ptr<Context> context,
             std::unique_ptr<Worker> worker, int event_fd, int epoll_fd);
  void Run();
  // Runs every queued task; true when there was one.
  bool RunTasks();
  void Wake();

  const Options options_;
  std::unique_ptr<Context> context_;
  std::unique_ptr<Worker> worker_;
  const int event_fd_;  // eventfd that Post() writes
  const int epoll_fd_;
  std::thread thread_;
  int busy_ = 0;  // loop thread only

  Mutex mu_;
  std::vector<Task> tasks_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> pending_{0};  // tasks_.size(), read without mu_
  Task shutdown_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stop_requested_{false};
  absl::Duration grace_;  // written before stop_requested_ is set
  Mutex stop_mu_;         // serializes Stop()
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
};

}  // namespace kvcache::ucx

#endif  // KVCACHE_TRANSPORT_WORKER_LOOP_H_
