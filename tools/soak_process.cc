#include "tools/soak_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcache::soak {

absl::StatusOr<Child> Child::Spawn(
    const std::vector<std::string>& argv,
    const std::map<std::string, std::string>& env,
    const std::string& log_path) {
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (log < 0) {
    return absl::InternalError(
        absl::StrCat("open ", log_path, ": ", std::strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid < 0) {
    close(log);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    for (const auto& [k, v] : env) {
      if (v.empty()) {
        unsetenv(k.c_str());
      } else {
        setenv(k.c_str(), v.c_str(), 1);
      }
    }
    dup2(log, STDOUT_FILENO);
    dup2(log, STDERR_FILENO);
    execv(args[0], args.data());
    std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  close(log);
  return Child(pid);
}

Child& Child::operator=(Child&& other) noexcept {
  if (this != &other) {
    this->~Child();
    pid_ = other.pid_;
    other.pid_ = -1;
  }
  return *this;
}

Child::~Child() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
}

absl::StatusOr<int> Child::Wait(absl::Time deadline) {
  if (pid_ <= 0) return absl::FailedPreconditionError("no child");
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (r < 0) return absl::InternalError(std::strerror(errno));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("the child is still running");
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::StatusOr<int> Child::Stop(absl::Time deadline) {
  if (pid_ <= 0) return absl::FailedPreconditionError("no child");
  kill(pid_, SIGTERM);
  absl::StatusOr<int> status = Wait(deadline);
  if (!status.ok()) {
    kill(pid_, SIGKILL);
    return Wait(absl::InfiniteFuture());
  }
  return status;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::StatusOr<NodeProcess> StartNode(const std::string& node_bin,
                                      const std::string& memory,
                                      const std::string& log_path) {
  absl::StatusOr<Child> child =
      Child::Spawn({node_bin, "--listen=127.0.0.1:0", "--metrics-listen=",
                    absl::StrCat("--memory=", memory), "--page-size=16KiB",
                    "--data-plane=ucx", "--ucx-tcp-trusted-network=true",
                    "--ucx-listen=127.0.0.1:0", "--lease-ttl=10"},
                   {{"UCX_TLS", ""}, {"UCX_NET_DEVICES", "lo"}}, log_path);
  if (!child.ok()) return child.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  const std::string kServing = "serving gRPC on port ";
  while (absl::Now() < deadline) {
    const std::string log = ReadFile(log_path);
    const size_t at = log.find(kServing);
    if (at != std::string::npos) {
      const size_t from = at + kServing.size();
      const size_t to = log.find_first_not_of("0123456789", from);
      int port = 0;
      if (absl::SimpleAtoi(log.substr(from, to - from), &port) && port > 0) {
        return NodeProcess{*std::move(child), absl::StrCat("127.0.0.1:", port),
                           log_path};
      }
    }
    if (child->Wait(absl::Now()).ok()) {
      return absl::InternalError(absl::StrCat("the node exited: ", log));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError("the node did not start in 20 s");
}

}  // namespace kvcache::soak
