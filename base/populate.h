// Faulting memory in before it is used: a store's arena, a client's buffer,
// the node's mapping of a client's buffer.
#ifndef KVCACHE_BASE_POPULATE_H_
#define KVCACHE_BASE_POPULATE_H_

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>

namespace kvcache {

// Faults in the pages of [data, data + length) for writing, as a first write
// would, so that later writes (this process's, or UCX's on its behalf) take
// no page fault. A page already resident keeps its bytes, and a write racing
// the populate of a page meets the same fault path: no byte changes.
//
// Each MADV_POPULATE_WRITE holds the process's mmap lock for reading. Called
// back to back over gigabytes they kept any thread that changes its mappings
// (malloc growing its heap, so every gRPC thread) waiting until the whole
// range was in: 17 s for an 8 GiB node's first put. So it goes in 2 MiB
// steps with a 50 us pause between (about 0.3 s more per 8 GiB;
// ArenaTest.ThePrefaultLetsOtherThreadsChangeTheirMappings).
//
// Returns true when the whole range is in; false when `stop()` returned true
// before a step, or the kernel refused (EINVAL: a kernel before 5.14;
// ENOMEM: no memory), where later writes simply fault as usual.
template <typename StopFn>
bool PopulateForWrite(void* data, size_t length, StopFn stop) {
  constexpr uintptr_t kPage = 4096;
  constexpr uintptr_t kStep = uintptr_t{2} << 20;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + length;
  for (uintptr_t at = reinterpret_cast<uintptr_t>(data) & ~(kPage - 1);
       at < end; at += kStep) {
    if (stop()) return false;
    const size_t n = static_cast<size_t>(std::min(kStep, end - at));
    int rc;
    do {
      rc = madvise(reinterpret_cast<void*>(at), n, MADV_POPULATE_WRITE);
    } while (rc != 0 && (errno == EINTR || errno == EAGAIN));
    if (rc != 0) return false;
    if (at + kStep < end) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

inline bool PopulateForWrite(void* data, size_t length) {
  return PopulateForWrite(data, length, [] { return false; });
}

}  // namespace kvcache

#endif  // KVCACHE_BASE_POPULATE_H_
