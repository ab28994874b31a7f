// EchoForError: user input as it may appear in an error message. A status
// message travels in gRPC metadata, which clients bound (8 KiB by default):
// echoing a request's bytes whole would turn a clear INVALID_ARGUMENT or
// NOT_FOUND into a transport error, and would let a caller make the node
// build large strings. So at most kMaxEchoBytes bytes are kept, and the rest
// is counted.
#ifndef KVCACHE_BASE_ECHO_H_
#define KVCACHE_BASE_ECHO_H_

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcache {

inline constexpr size_t kMaxEchoBytes = 64;

// `input` itself when it is at most kMaxEchoBytes long; else its first
// kMaxEchoBytes bytes followed by "... (N bytes)".
inline std::string EchoForError(absl::string_view input) {
  if (input.size() <= kMaxEchoBytes) return std::string(input);
  return absl::StrCat(input.substr(0, kMaxEchoBytes), "... (", input.size(),
                      " bytes)");
}

}  // namespace kvcache

#endif  // KVCACHE_BASE_ECHO_H_
