#include "store/page_pool.h"

#include <algorithm>
#include <cstring>

namespace kvcache::store {

PagePool::PagePool(uint8_t* base, uint64_t arena_bytes, uint32_t page_size)
    : base_(base),
      page_size_(page_size),
      num_pages_(static_cast<uint32_t>(
          std::min<uint64_t>(arena_bytes / page_size, UINT32_MAX))) {
  free_.reserve(num_pages_);
  for (uint32_t i = num_pages_; i > 0; --i) free_.push_back(i - 1);
}

bool PagePool::Allocate(uint32_t count, std::vector<uint32_t>* out) {
  if (count > free_.size()) return false;
  out->insert(out->end(), free_.end() - count, free_.end());
  free_.resize(free_.size() - count);
  return true;
}

void PagePool::Release(absl::Span<const uint32_t> pages) {
  free_.insert(free_.end(), pages.begin(), pages.end());
}

void PagePool::Scatter(absl::Span<const uint32_t> pages,
                       absl::Span<const uint8_t> bytes) {
  size_t offset = 0;
  for (uint32_t page : pages) {
    if (offset >= bytes.size()) break;
    size_t n = std::min<size_t>(page_size_, bytes.size() - offset);
    std::memcpy(PageAddress(page), bytes.data() + offset, n);
    offset += n;
  }
}

void PagePool::Gather(absl::Span<const uint32_t> pages,
                      absl::Span<uint8_t> bytes) const {
  size_t offset = 0;
  for (uint32_t page : pages) {
    if (offset >= bytes.size()) break;
    size_t n = std::min<size_t>(page_size_, bytes.size() - offset);
    std::memcpy(bytes.data() + offset, PageAddress(page), n);
    offset += n;
  }
}

}  // namespace kvcache::store
