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
// Thread safety: Allocate and Release need external serialization (the
// Store's pool mutex). Scatter and Gather may run concurrently on pages that
// the caller owns.
#ifndef KVCACHE_STORE_PAGE_POOL_H_
#define KVCACHE_STORE_PAGE_POOL_H_

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
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

  uint32_t page_size() const { return page_size_; }
  uint32_t num_pages() const { return num_pages_; }
  uint32_t free_pages() const { return static_cast<uint32_t>(free_.size()); }
  uint64_t capacity_bytes() const {
    return static_cast<uint64_t>(num_pages_) * page_size_;
  }
  uint32_t PagesFor(uint64_t bytes) const {
    return static_cast<uint32_t>((bytes + page_size_ - 1) / page_size_);
  }

  // Takes `count` (> 0) pages into *out and returns true, or returns false
  // and changes nothing.
  bool Allocate(uint32_t count, PageList* out);
  void Release(const PageList& pages);

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
  std::vector<uint32_t> free_;  // a stack: the most recently freed on top
  std::vector<uint32_t> next_;  // next page of the same owner
};

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_PAGE_POOL_H_
