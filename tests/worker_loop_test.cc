// WorkerLoop's waiting: a loop with operations in flight and nothing to
// progress sleeps on its event fds instead of spinning (one spinning
// progress thread per client process starves every other process on
// shared cores), and still wakes at once for posted work.
#include "transport/worker_loop.h"

#include <sys/resource.h>

#include <future>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvcache::ucx {
namespace {

// CPU seconds (user + system) this process has used.
double ProcessCpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec * 1e-6;
}

void RunOnLoop(WorkerLoop& loop, absl::AnyInvocable<void()> fn) {
  std::promise<void> done;
  ASSERT_TRUE(loop.Post([&] {
    fn();
    done.set_value();
  }));
  ASSERT_EQ(done.get_future().wait_for(std::chrono::seconds(10)),
            std::future_status::ready);
}

TEST(WorkerLoopTest, ABusyLoopWithNothingToProgressSleeps) {
  auto loop = WorkerLoop::Start({});
  ASSERT_TRUE(loop.ok()) << loop.status();
  WorkerLoop& l = **loop;
  // An operation "in flight" that never completes: the loop has nothing to
  // progress for the whole window.
  RunOnLoop(l, [&] { l.AddBusy(1); });
  absl::SleepFor(absl::Milliseconds(50));
  const double cpu0 = ProcessCpuSeconds();
  const absl::Time t0 = absl::Now();
  absl::SleepFor(absl::Milliseconds(600));
  const double cpu = ProcessCpuSeconds() - cpu0;
  const double wall = absl::ToDoubleSeconds(absl::Now() - t0);
  // A spinning loop uses its whole core (or its share of a loaded one);
  // a sleeping one a few wakeups.
  EXPECT_LT(cpu, 0.1 * wall) << cpu << " CPU-s in " << wall << " s";
  RunOnLoop(l, [&] { l.AddBusy(-1); });
  l.Stop(nullptr);
}

TEST(WorkerLoopTest, ASleepingBusyLoopRunsPostedWorkAtOnce) {
  auto loop = WorkerLoop::Start({});
  ASSERT_TRUE(loop.ok()) << loop.status();
  WorkerLoop& l = **loop;
  RunOnLoop(l, [&] { l.AddBusy(1); });
  absl::SleepFor(absl::Milliseconds(50));  // asleep by now
  // Each task is posted while the loop sleeps: the eventfd wakes it, long
  // before the busy wait's own timeout would.
  for (int i = 0; i < 20; ++i) {
    const absl::Time t0 = absl::Now();
    RunOnLoop(l, [] {});
    EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
    absl::SleepFor(absl::Milliseconds(5));
  }
  RunOnLoop(l, [&] { l.AddBusy(-1); });
  l.Stop(nullptr);
}

}  // namespace
}  // namespace kvcache::ucx
