#include "transport/worker_loop.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/status.h"

namespace kvcache::ucx {
namespace {

// Upper bound of ucp_worker_progress calls in a row before the loop looks
// at its task queue again, so that posted work is never starved.
constexpr int kMaxProgressBurst = 256;

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerLoop>> WorkerLoop::Start(Options options) {
  absl::StatusOr<std::unique_ptr<Context>> context =
      Context::Create(options.name, options.ucx_settings);
  if (!context.ok()) return context.status();
  absl::StatusOr<std::unique_ptr<Worker>> worker = Worker::Create(**context);
  if (!worker.ok()) return worker.status();
  int event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (event_fd < 0) {
    return absl::InternalError(absl::StrCat("eventfd: ", strerror(errno)));
  }
  int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd < 0) {
    close(event_fd);
    return absl::InternalError(
        absl::StrCat("epoll_create1: ", strerror(errno)));
  }
  for (int fd : {event_fd, (*worker)->event_fd()}) {
    epoll_event ev;
    std::memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      absl::Status s =
          absl::InternalError(absl::StrCat("epoll_ctl: ", strerror(errno)));
      close(epoll_fd);
      close(event_fd);
      return s;
    }
  }
  std::unique_ptr<WorkerLoop> loop =
      absl::WrapUnique(new WorkerLoop(std::move(options), *std::move(context),
                                      *std::move(worker), event_fd, epoll_fd));
  loop->thread_ = std::thread([raw = loop.get()] { raw->Run(); });
  return loop;
}

WorkerLoop::WorkerLoop(Options options, std::unique_ptr<Context> context,
                       std::unique_ptr<Worker> worker, int event_fd,
                       int epoll_fd)
    : options_(std::move(options)),
      context_(std::move(context)),
      worker_(std::move(worker)),
      event_fd_(event_fd),
      epoll_fd_(epoll_fd) {}

WorkerLoop::~WorkerLoop() {
  Stop(nullptr);
  worker_.reset();   // after every worker-bound object is gone
  context_.reset();  // after the worker
  close(epoll_fd_);
  close(event_fd_);
}

bool WorkerLoop::Post(Task task) {
  {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
    pending_.store(tasks_.size(), std::memory_order_release);
  }
  Wake();
  return true;
}

void WorkerLoop::Wake() {
  uint64_t one = 1;
  // A full eventfd counter still wakes the loop; nothing to handle.
  [[maybe_unused]] ssize_t n = write(event_fd_, &one, sizeof(one));
}

void WorkerLoop::Stop(Task shutdown, absl::Duration grace) {
  MutexLock stop_lock(&stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    shutdown_ = std::move(shutdown);
  }
  grace_ = grace;
  stop_requested_.store(true);
  Wake();
  if (thread_.joinable()) thread_.join();
}

bool WorkerLoop::RunTasks() {
  if (pending_.load(std::memory_order_acquire) == 0) return false;
  std::vector<Task> batch;
  {
    MutexLock lock(&mu_);
    batch.swap(tasks_);
    pending_.store(0, std::memory_order_relaxed);
  }
  for (Task& task : batch) task();
  return !batch.empty();
}

void WorkerLoop::Run() {
  ucp_worker_h worker = worker_->get();
  int idle = 0;  // empty polls since the last event
  absl::Time last_event = absl::Now();
  while (!stop_requested_.load(std::memory_order_acquire)) {
    bool active = RunTasks();
    for (int i = 0; i < kMaxProgressBurst && ucp_worker_progress(worker) != 0;
         ++i) {
      active = true;
    }
    if (active) {
      idle = 0;
      last_event = absl::Now();
      continue;
    }
    // Poll a little after an event (the next completion often follows at
    // once); yield each time so that other threads of a busy host run.
    if (++idle < options_.spin_iterations &&
        absl::Now() - last_event < options_.spin_time) {
      sched_yield();
      continue;
    }
    if (ucp_worker_arm(worker) == UCS_ERR_BUSY) continue;
    const absl::Duration wait =
        busy_ > 0 ? options_.busy_wait : options_.idle_wait;
    epoll_event events[2];
    int n = epoll_wait(
        epoll_fd_, events, 2,
        std::max(1, static_cast<int>(absl::ToInt64Milliseconds(wait))));
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == event_fd_) {
        uint64_t count = 0;
        [[maybe_unused]] ssize_t r = read(event_fd_, &count, sizeof(count));
      }
    }
    if (n != 0) {  // woken (a timeout is no event: straight back to sleep)
      idle = 0;
      last_event = absl::Now();
    }
  }
  // Stopping: run what was posted before Stop(), then the owner's shutdown,
  // then progress (bounded) so that closes and cancellations complete.
  RunTasks();
  Task shutdown;
  {
    MutexLock lock(&mu_);
    shutdown = std::move(shutdown_);
  }
  if (shutdown) shutdown();
  absl::Time deadline = absl::Now() + grace_;
  absl::Time quiet_since = absl::Now();
  while (absl::Now() < deadline) {
    if (ucp_worker_progress(worker) != 0) {
      quiet_since = absl::Now();
    } else if (busy_ <= 0 &&
               absl::Now() - quiet_since > absl::Milliseconds(10)) {
      break;
    }
  }
}

}  // namespace kvcache::ucx
