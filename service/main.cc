// kvcache-node: runs one cache node until SIGTERM/SIGINT, then drains.
#include <pthread.h>
#include <signal.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "service/flags.h"
#include "service/node.h"

int main(int argc, char** argv) {
  using kvcache::LogError;
  std::vector<std::string> args(argv + 1, argv + argc);
  absl::StatusOr<kvcache::service::ParsedFlags> flags =
      kvcache::service::ParseNodeFlags(args);
  if (!flags.ok()) {
    LogError(absl::StrCat("kvcache-node: ", flags.status().message()));
    return 2;
  }
  if (flags->help) {
    std::fputs(kvcache::service::NodeUsage().c_str(), stdout);
    return 0;
  }
  // Block the stop signals in every thread; this one waits for them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // On the heap and never destroyed: see the end of main.
  auto node = std::make_unique<kvcache::service::Node>(flags->options);
  if (absl::Status s = node->Start(); !s.ok()) {
    LogError(absl::StrCat("kvcache-node: cannot start: ", s.message()));
    return 1;
  }
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  kvcache::LogInfo(
      absl::StrCat("received signal ", signal_number, ", draining"));
  node->Drain(flags->drain_notice);
  // Drain has stopped every server, the data plane, the workers and the
  // reaper. Destroying the grpc::Server objects after that took 8.6 s in
  // about one exit in twenty (gRPC tearing down its own state), past
  // --drain-timeout + 1 s; there is nothing left to release that the
  // process's exit does not, so it exits here (the node stays reachable
  // from this frame, so leak checkers do not count it).
  std::exit(0);
}
