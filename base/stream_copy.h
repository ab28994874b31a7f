// Copying bytes that the copier will not read again: stores that bypass the
// caches.
//
// An ordinary store to a line that is not in the cache first reads the line
// from memory (read for ownership), so a memcpy of n bytes into cold memory
// moves 3n bytes: n read, n read for ownership, n written. A non-temporal
// store writes the line without reading it: 2n. That is the copy the node
// makes of a read into a client's mapped buffer (shared memory): the
// destination is another process's, which reads it only after the read's
// status reaches it, and a read is usually more bytes than the caches hold
// (measured: docs/benchmarks.md, "Shared-memory reads with stores that
// bypass the cache").
//
// Contract:
//  * StreamCopy(dst, src, n) leaves [dst, dst + n) equal to [src, src + n)
//    and writes no byte outside it, like memcpy (the ranges must not
//    overlap). Bytes are written with non-temporal stores where dst is
//    16-byte aligned or from its first 16-byte boundary on, on x86-64
//    (SSE2, part of the base ISA); elsewhere, and for copies under
//    kStreamCopyMinBytes, it is memcpy.
//  * Non-temporal stores are weakly ordered: a thread that copied with
//    StreamCopy calls StreamCopyFence() before it tells another thread or
//    process that the bytes are there (a mutex, an atomic, a message).
#ifndef KVCACHE_BASE_STREAM_COPY_H_
#define KVCACHE_BASE_STREAM_COPY_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVCACHE_STREAM_COPY_SSE2 1
#else
#define KVCACHE_STREAM_COPY_SSE2 0
#endif

namespace kvcache {

// Below this a copy stays in the cache (memcpy): a small copy is read soon,
// and the fence costs more than the loads it saves.
inline constexpr size_t kStreamCopyMinBytes = 4096;

// Not inlined: a call per chunk costs nothing against the chunk's copy, and
// profiles (bench/peers/profile.py) then count it as a copy.
[[gnu::noinline]] inline void StreamCopy(void* dst, const void* src, size_t n) {
#if KVCACHE_STREAM_COPY_SSE2
  if (n >= kStreamCopyMinBytes) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
      const auto* in = reinterpret_cast<const __m128i*>(s + i);
      auto* out = reinterpret_cast<__m128i*>(d + i);
      const __m128i a = _mm_loadu_si128(in);
      const __m128i b = _mm_loadu_si128(in + 1);
      const __m128i c = _mm_loadu_si128(in + 2);
      const __m128i e = _mm_loadu_si128(in + 3);
      _mm_stream_si128(out, a);
      _mm_stream_si128(out + 1, b);
      _mm_stream_si128(out + 2, c);
      _mm_stream_si128(out + 3, e);
    }
    std::memcpy(d + i, s + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// Orders this thread's earlier non-temporal stores before its later stores.
inline void StreamCopyFence() {
#if KVCACHE_STREAM_COPY_SSE2
  _mm_sfence();
#endif
}

}  // namespace kvcache

#endif  // KVCACHE_BASE_STREAM_COPY_H_
