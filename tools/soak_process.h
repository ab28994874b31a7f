// Child processes of kvcache-soak: nodes and workers, each an owned pid
// that is killed and reaped when its owner goes.
#ifndef KVCACHE_TOOLS_SOAK_PROCESS_H_
#define KVCACHE_TOOLS_SOAK_PROCESS_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvcache::soak {

class Child {
 public:
  // Runs `argv` with `env` added to this process's environment (an empty
  // value unsets the variable); stdout and stderr go to `log_path`.
  static absl::StatusOr<Child> Spawn(
      const std::vector<std::string>& argv,
      const std::map<std::string, std::string>& env,
      const std::string& log_path);
  Child(Child&& other) noexcept : pid_(other.pid_) { other.pid_ = -1; }
  Child& operator=(Child&& other) noexcept;
  ~Child();  // SIGKILL and reap, if still running

  // Waits until the child exits or `deadline`; its exit status (128 + N
  // for a signal), or DEADLINE_EXCEEDED (it is still running).
  absl::StatusOr<int> Wait(absl::Time deadline);
  // SIGTERM, then Wait(deadline), then SIGKILL.
  absl::StatusOr<int> Stop(absl::Time deadline);
  pid_t pid() const { return pid_; }

 private:
  explicit Child(pid_t pid) : pid_(pid) {}
  pid_t pid_;
};

// Reads `path` whole; empty when it cannot be read.
std::string ReadFile(const std::string& path);

// A kvcache-node from `node_bin` on loopback with the UCX data plane, its
// pool `memory`; waits (bounded) for its "serving gRPC on port N" line.
struct NodeProcess {
  Child child;
  std::string address;  // 127.0.0.1:PORT
  std::string log_path;
};
absl::StatusOr<NodeProcess> StartNode(const std::string& node_bin,
                                      const std::string& memory,
                                      const std::string& log_path);

}  // namespace kvcache::soak

#endif  // KVCACHE_TOOLS_SOAK_PROCESS_H_
