// Arena: one contiguous region of memory that holds every stored block.
//
// Contract: an Arena owns its region for its whole lifetime and never moves
// it. Bytes move in and out only through Write/Read, so the store works the
// same over host memory and over GPU memory it cannot address directly.
//  * host:SIZE — one anonymous mapping, transparent huge pages advised.
//    It is never pinned for CUDA: nothing on the node copies between it
//    and a device, and pinning all of it at start (cudaHostRegister) would
//    lock the whole pool in memory and take seconds per tens of GiB.
//    StartPrefault faults it in on a background thread, so that the first
//    writes into it do not pay the kernel's page faults.
//  * gpu:INDEX:SIZE — cudaMalloc on that device; Write/Read are synchronous
//    cudaMemcpy. Asking for a device that is not there (or a build without
//    CUDA) fails at start-up with one clear message.
#ifndef KVCACHE_STORE_ARENA_H_
#define KVCACHE_STORE_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
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
  virtual uint64_t size() const = 0;
  virtual MemoryKind kind() const = 0;
  virtual std::string Describe() const = 0;
  // Copy n bytes between host memory and [offset, offset + n) of the arena.
  // The range must lie inside the arena. Errors only on device failures.
  virtual absl::Status Write(uint64_t offset, const void* src, size_t n) = 0;
  virtual absl::Status Read(uint64_t offset, void* dst, size_t n) const = 0;
  // The region's first byte when this process can address it (host
  // memory), else nullptr: readers use stored bytes in place, writers fill
  // pages they own in place.
  virtual uint8_t* host_base() const { return nullptr; }
  // Makes the whole region resident in the background, without changing a
  // byte of it (MADV_POPULATE_WRITE, 2 MiB at a time with a pause between,
  // so that other threads can still change their mappings), and returns at
  // once; safe while the region is in use. The arena's destructor stops
  // and joins that work. Where the kernel cannot (before Linux 5.14, or
  // out of memory) it stops quietly, and pages fault in as they are first
  // written. A no-op on device memory and on a second call.
  virtual void StartPrefault() {}
  // True once StartPrefault has made every page resident.
  virtual bool prefaulted() const { return false; }
};

// Creates the arena named by spec, or explains why it cannot.
absl::StatusOr<std::unique_ptr<Arena>> CreateArena(const MemorySpec& spec);

// Number of CUDA devices this process can use; 0 (with the reason in *why)
// when the build has no CUDA, there is no driver or no device.
int CudaDeviceCount(std::string* why);

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_ARENA_H_
