// Arena: one contiguous region of memory that holds every stored block.
//
// Contract: an Arena owns its region for its whole lifetime and never moves
// it; base() is aligned to at least 4 KiB. The host arena is one anonymous
// mapping (transparent huge pages advised where the kernel offers them).
// The device tier (gpu:INDEX:SIZE) is parsed here so that asking for it gives
// one clear start-up error on a machine or build without that device.
#ifndef KVCACHE_STORE_ARENA_H_
#define KVCACHE_STORE_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache::store {

enum class MemoryKind { kHost, kGpu };

struct MemorySpec {
  MemoryKind kind = MemoryKind::kHost;
  int device = 0;
  uint64_t bytes = 0;
  std::string ToString() const;
};

// Parses "host:SIZE" or "gpu:INDEX:SIZE"; SIZE accepts B, KiB, MiB, GiB, TiB
// (and K, M, G, T as binary units), e.g. "host:1GiB".
absl::StatusOr<MemorySpec> ParseMemorySpec(absl::string_view text);
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

class Arena {
 public:
  virtual ~Arena() = default;
  virtual uint8_t* base() = 0;
  virtual uint64_t size() const = 0;
  virtual MemoryKind kind() const = 0;
  virtual std::string Describe() const = 0;
};

// Creates the arena named by spec, or explains why it cannot.
absl::StatusOr<std::unique_ptr<Arena>> CreateArena(const MemorySpec& spec);

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_ARENA_H_
