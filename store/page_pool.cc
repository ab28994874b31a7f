#include "store/page_pool.h"

#include <algorithm>

namespace kvcache::store {

PagePool::PagePool(Arena* arena, uint64_t offset, uint64_t bytes,
                   uint32_t page_size)
    : arena_(arena),
      offset_(offset),
      page_size_(page_size),
      num_pages_(static_cast<uint32_t>(
          std::min<uint64_t>(bytes / page_size, UINT32_MAX - 1))),
      next_(num_pages_, 0) {
  free_.reserve(num_pages_);
  for (uint32_t i = num_pages_; i > 0; --i) free_.push_back(i - 1);
}

uint32_t PagePool::free_pages() const {
  MutexLock lock(&mu_);
  return static_cast<uint32_t>(free_.size());
}

bool PagePool::Allocate(uint32_t count, PageList* out, uint32_t* free_left) {
  MutexLock lock(&mu_);
  if (count == 0 || count > free_.size()) {
    if (free_left != nullptr) *free_left = static_cast<uint32_t>(free_.size());
    return false;
  }
  // Pop `count` pages; link them in pop order (ascending on a fresh pool).
  uint32_t first = free_.back();
  uint32_t prev = first;
  free_.pop_back();
  for (uint32_t i = 1; i < count; ++i) {
    uint32_t page = free_.back();
    free_.pop_back();
    next_[prev] = page;
    prev = page;
  }
  *out = {first, count};
  if (free_left != nullptr) *free_left = static_cast<uint32_t>(free_.size());
  return true;
}

void PagePool::Release(const PageList& pages) {
  MutexLock lock(&mu_);
  // Push in reverse list order, so a re-allocation pops them in list order.
  uint32_t stack_top = static_cast<uint32_t>(free_.size());
  uint32_t page = pages.first;
  for (uint32_t i = 0; i < pages.count; ++i) {
    free_.push_back(page);
    page = next_[page];
  }
  std::reverse(free_.begin() + stack_top, free_.end());
}

absl::Status PagePool::Scatter(const PageList& pages,
                               absl::Span<const uint8_t> bytes) const {
  return ForEachRun(pages, bytes.size(),
                    [&](uint64_t offset, size_t at, size_t n) {
                      return arena_->Write(offset, bytes.data() + at, n);
                    });
}

absl::Status PagePool::Gather(const PageList& pages,
                              absl::Span<uint8_t> bytes) const {
  return ForEachRun(pages, bytes.size(),
                    [&](uint64_t offset, size_t at, size_t n) {
                      return arena_->Read(offset, bytes.data() + at, n);
                    });
}

}  // namespace kvcache::store
