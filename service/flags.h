// NodeFlags: the kvcache-node command line (and the optional --config file,
// one `--flag=value` per line, '#' comments), parsed into NodeOptions.
#ifndef KVCACHE_SERVICE_FLAGS_H_
#define KVCACHE_SERVICE_FLAGS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "service/node.h"

namespace kvcache::service {

struct ParsedFlags {
  NodeOptions options;
  // Node::Drain's notice on SIGTERM (--drain-notice).
  absl::Duration drain_notice = absl::Seconds(1);
  bool help = false;
};

std::string NodeUsage();
// INVALID_ARGUMENT naming the flag for an unknown flag or a bad value.
absl::StatusOr<ParsedFlags> ParseNodeFlags(
    const std::vector<std::string>& args);

}  // namespace kvcache::service

#endif  // KVCACHE_SERVICE_FLAGS_H_
