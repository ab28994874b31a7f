// A thin logger: one line per event on stderr, with a UTC timestamp.
// (Debian's Abseil 20220623 has no absl/log.)
#ifndef KVCACHE_BASE_LOG_H_
#define KVCACHE_BASE_LOG_H_

#include <cstdio>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcache {

inline void LogLine(const char* level, absl::string_view message) {
  std::string line = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ ", absl::Now(),
                                      absl::UTCTimeZone());
  line.append(level).append(" ").append(message.data(), message.size());
  line.push_back('\n');
  std::fwrite(line.data(), 1, line.size(), stderr);
}
inline void LogInfo(absl::string_view message) { LogLine("I", message); }
inline void LogError(absl::string_view message) { LogLine("E", message); }

}  // namespace kvcache

#endif  // KVCACHE_BASE_LOG_H_
