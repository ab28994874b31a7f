#include "base/parallel_for.h"

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvcache {
namespace {

// Runs each task on a thread of its own; joins them when destroyed.
class ThreadPerTask {
 public:
  ~ThreadPerTask() {
    for (std::thread& t : threads_) t.join();
  }
  Executor executor() {
    return [this](std::function<void()> work) {
      threads_.emplace_back(std::move(work));
    };
  }

 private:
  std::vector<std::thread> threads_;
};

TEST(ParallelForTest, RunsEveryIndexOnceAcrossTheHelpers) {
  ThreadPerTask pool;
  std::vector<std::atomic<int>> runs(1000);
  std::atomic<int> off_caller{0};
  const std::thread::id caller = std::this_thread::get_id();
  ParallelFor(runs.size(), pool.executor(), 3, [&](size_t i) {
    runs[i].fetch_add(1);
    if (std::this_thread::get_id() != caller) off_caller.fetch_add(1);
    std::this_thread::yield();
  });
  for (size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(runs[i].load(), 1) << i;
  EXPECT_GT(off_caller.load(), 0) << "no helper took an index";
}

// The caller never waits for a helper that has not started: with an
// executor that holds its tasks until after the call, the caller runs
// every index itself, and the held helpers, run afterwards, touch nothing.
TEST(ParallelForTest, CompletesAloneWhenTheHelpersNeverStart) {
  std::vector<std::function<void()>> held;
  Executor holding = [&](std::function<void()> work) {
    held.push_back(std::move(work));
  };
  int calls = 0;
  {
    auto count = [&](size_t) { ++calls; };
    ParallelFor(10, holding, 4, count);
  }
  EXPECT_EQ(calls, 10);
  EXPECT_EQ(held.size(), 4u);
  for (auto& work : held) work();  // the callable is gone: must not be used
  EXPECT_EQ(calls, 10);
}

TEST(ParallelForTest, WithoutAnExecutorRunsInOrderOnTheCaller) {
  std::vector<size_t> order;
  ParallelFor(5, Executor(), 4, [&](size_t i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 3, 4}));
  ParallelFor(0, Executor(), 4, [&](size_t) { FAIL() << "no index"; });
}

}  // namespace
}  // namespace kvcache
