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

// One MADV_POPULATE_WRITE over the pages of [data, data + length), with no
// pause: for ranges of a few MiB (see PopulateForWrite for longer ones).
// False where the kernel refused (see below).
inline bool PopulateStepForWrite(void* data, size_t length) {
  constexpr uintptr_t kPage = 4096;
  const uintptr_t at = reinterpret_cast<uintptr_t>(data) & ~(kPage - 1);
  const size_t n = length + (reinterpret_cast<uintptr_t>(data) - at);
  int rc;
  do {
    rc = madvise(reinterpret_cast<void*>(at), n, MADV_POPULATE_WRITE);
  } while (rc != 0 && (errno == EINTR || errno == EAGAIN));
  return rc == 0;
}

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
// `reached(bytes)` is told after each step that [data, data + bytes) is in.
template <typename StopFn, typename ReachedFn>
bool PopulateForWrite(void* data, size_t length, StopFn stop,
                      ReachedFn reached) {
  constexpr uintptr_t kPage = 4096;
  constexpr uintptr_t kStep = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + length;
  for (uintptr_t at = begin & ~(kPage - 1); at < end; at += kStep) {
    if (stop()) return false;
    const size_t n = static_cast<size_t>(std::min(kStep, end - at));
    if (!PopulateStepForWrite(reinterpret_cast<void*>(at), n)) return false;
    reached(static_cast<size_t>(at + n - begin));
    if (at + kStep < end) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

template <typename StopFn>
bool PopulateForWrite(void* data, size_t length, StopFn stop) {
  return PopulateForWrite(data, length, stop, [](size_t) {});
}

inline bool PopulateForWrite(void* data, size_t length) {
  return PopulateForWrite(data, length, [] { return false; });
}

}  // namespace kvcache

#endif  // KVCACHE_BASE_POPULATE_H_
