// PagePool: fixed-size pages carved out of an Arena.
//
// Invariants: every page index in [0, num_pages) is either on the free stack
// or held by exactly one owner (a stored block or a write reservation).
// Allocation and release are O(pages) with O(1) per page. A block of any
// size takes ceil(bytes / page_size) pages that need not be contiguous, so
// blocks of different codecs and sizes share one pool without external
// fragmentation; the unused tail of the last page is the internal
// fragmentation, which the store accounts for.
// Not thread-safe: the Store serializes access.
#ifndef KVCACHE_STORE_PAGE_POOL_H_
#define KVCACHE_STORE_PAGE_POOL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "store/arena.h"

namespace kvcache::store {

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

  // Appends `count` pages to `out` and returns true, or returns false and
  // leaves both the pool and `out` unchanged.
  bool Allocate(uint32_t count, std::vector<uint32_t>* out);
  void Release(absl::Span<const uint32_t> pages);

  // Arena offset of a page's first byte.
  uint64_t PageOffset(uint32_t page) const {
    return offset_ + static_cast<uint64_t>(page) * page_size_;
  }

  // Copy `bytes` into/out of the page list, page by page (one copy per run
  // of consecutive pages). The pages must hold at least bytes.size() bytes.
  // Safe to call concurrently on pages that the caller owns.
  absl::Status Scatter(absl::Span<const uint32_t> pages,
                       absl::Span<const uint8_t> bytes) const;
  absl::Status Gather(absl::Span<const uint32_t> pages,
                      absl::Span<uint8_t> bytes) const;

 private:
  Arena* arena_;
  uint64_t offset_;
  uint32_t page_size_;
  uint32_t num_pages_;
  std::vector<uint32_t> free_;  // a stack: the most recently freed first
};

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_PAGE_POOL_H_
