// PagePool: fixed-size pages carved out of an Arena.
//
// Invariants: every page index in [0, num_pages) is either on the free stack
// or held by exactly one owner (a stored block, a write reservation or a
// re-encode). A block of any size takes ceil(bytes / page_size) pages that
// need not be contiguous, linked first to last through next_ (4 bytes of
// pool metadata per page), so an owner needs only (first page, count) and
// blocks of different codecs and sizes share one pool without external
// fragmentation. The unused tail of a block's last page is its internal
// fragmentation, which the store accounts for. Allocation and release cost
// O(1) per page; a fresh pool hands out ascending runs, which copy in one go.
//
// Thread safety: the allocator (Allocate, Release, free_pages) takes the
// pool's own mutex, which guards the free stack. The copies (Scatter,
// Gather, ForEachRun, SingleRunOffset) take no mutex and may run
// concurrently on pages that the caller owns: a page's link changes only in
// Allocate, while the page passes from the free stack to its new owner,
// and the mutex (and whatever hands the pages on) orders that write before
// the owner's reads.
#ifndef KVCACHE_STORE_PAGE_POOL_H_
#define KVCACHE_STORE_PAGE_POOL_H_

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "store/arena.h"

namespace kvcache::store {

// A run of pages owned together: `count` pages linked from `first`.
struct PageList {
  uint32_t first = 0;
  uint32_t count = 0;
};

class PagePool {
 public:
  // Pages cover [offset, offset + bytes) of the arena.
  PagePool(Arena* arena, uint64_t offset, uint64_t bytes, uint32_t page_size);

  // The layout is fixed at construction and read without the mutex.
  uint32_t page_size() const { return page_size_; }
  uint32_t num_pages() const { return num_pages_; }
  uint32_t free_pages() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t capacity_bytes() const {
    return static_cast<uint64_t>(num_pages_) * page_size_;
  }
  uint32_t PagesFor(uint64_t bytes) const {
    return static_cast<uint32_t>((bytes + page_size_ - 1) / page_size_);
  }

  // Takes `count` (> 0) pages into *out and returns true, or returns false
  // and changes nothing; *free_left (when given) is the number of free
  // pages after the call.
  bool Allocate(uint32_t count, PageList* out, uint32_t* free_left = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Release(const PageList& pages) ABSL_LOCKS_EXCLUDED(mu_);

  // Arena offset of a page's first byte.
  uint64_t PageOffset(uint32_t page) const {
    return offset_ + static_cast<uint64_t>(page) * page_size_;
  }

  // Copy `bytes` into/out of the pages, in list order (one copy per run of
  // consecutive pages). The pages must hold at least bytes.size() bytes.
  absl::Status Scatter(const PageList& pages,
                       absl::Span<const uint8_t> bytes) const;
  absl::Status Gather(const PageList& pages, absl::Span<uint8_t> bytes) const;

  // The arena offset of the first `bytes` bytes of the list when they lie
  // in one run of consecutive pages, else nullopt.
  std::optional<uint64_t> SingleRunOffset(const PageList& pages,
                                          size_t bytes) const {
    std::optional<uint64_t> first;
    size_t runs = 0;
    ForEachRun(pages, bytes, [&](uint64_t offset, size_t, size_t) {
      if (runs++ == 0) first = offset;
      return absl::OkStatus();
    }).IgnoreError();
    return runs == 1 ? first : std::nullopt;
  }

  // Calls fn(arena offset, offset in the bytes, length) for each run of
  // consecutive pages covering the first `bytes` bytes of the list, in
  // order; stops at and returns the first error fn returns.
  template <typename Fn>
  absl::Status ForEachRun(const PageList& pages, size_t bytes, Fn fn) const {
    size_t done = 0;
    uint32_t page = pages.first;
    for (uint32_t i = 0; i < pages.count && done < bytes;) {
      uint32_t run = 1, last = page;
      while (i + run < pages.count && next_[last] == last + 1) {
        last = next_[last];
        ++run;
      }
      const size_t n =
          std::min<size_t>(uint64_t{run} * page_size_, bytes - done);
      if (absl::Status s = fn(PageOffset(page), done, n); !s.ok()) return s;
      done += n;
      i += run;
      page = next_[last];
    }
    return absl::OkStatus();
  }

 private:
  Arena* arena_;
  uint64_t offset_;
  uint32_t page_size_;
  uint32_t num_pages_;
  mutable Mutex mu_;
  // A stack: the most recently freed on top.
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  // Next page of the same owner; written by Allocate under mu_ (see the
  // thread-safety note above).
  std::vector<uint32_t> next_;
};

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_PAGE_POOL_H_
