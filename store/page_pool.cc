#include "store/page_pool.h"

#include <algorithm>
#include <cstring>

namespace kvcache::store {

PagePool::PagePool(Arena* arena, uint64_t offset, uint64_t bytes,
                   uint32_t page_size)
    : arena_(arena),
      offset_(offset),
      page_size_(page_size),
      num_pages_(static_cast<uint32_t>(
          std::min<uint64_t>(bytes / page_size, UINT32_MAX))) {
  free_.reserve(num_pages_);
  for (uint32_t i = num_pages_; i > 0; --i) free_.push_back(i - 1);
}

bool PagePool::Allocate(uint32_t count, std::vector<uint32_t>* out) {
  if (count > free_.size()) return false;
  // Reversed, so a fresh pool hands out ascending runs of pages.
  out->insert(out->end(), free_.rbegin(), free_.rbegin() + count);
  free_.resize(free_.size() - count);
  return true;
}

void PagePool::Release(absl::Span<const uint32_t> pages) {
  free_.insert(free_.end(), pages.begin(), pages.end());
}

absl::Status PagePool::Scatter(absl::Span<const uint32_t> pages,
                               absl::Span<const uint8_t> bytes) const {
  size_t done = 0;
  for (size_t i = 0; i < pages.size() && done < bytes.size();) {
    // Runs of consecutive pages move in one copy.
    size_t run = 1;
    while (i + run < pages.size() && pages[i + run] == pages[i] + run) ++run;
    size_t n = std::min<size_t>(run * page_size_, bytes.size() - done);
    absl::Status s =
        arena_->Write(PageOffset(pages[i]), bytes.data() + done, n);
    if (!s.ok()) return s;
    done += n;
    i += run;
  }
  return absl::OkStatus();
}

absl::Status PagePool::Gather(absl::Span<const uint32_t> pages,
                              absl::Span<uint8_t> bytes) const {
  size_t done = 0;
  for (size_t i = 0; i < pages.size() && done < bytes.size();) {
    size_t run = 1;
    while (i + run < pages.size() && pages[i + run] == pages[i] + run) ++run;
    size_t n = std::min<size_t>(run * page_size_, bytes.size() - done);
    absl::Status s = arena_->Read(PageOffset(pages[i]), bytes.data() + done, n);
    if (!s.ok()) return s;
    done += n;
    i += run;
  }
  return absl::OkStatus();
}

}  // namespace kvcache::store
