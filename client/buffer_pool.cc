#include "client/buffer_pool.h"

#include <functional>
#include <utility>

#include "base/populate.h"

namespace kvcache {

struct DataBuffer::Impl {
  std::shared_ptr<ucx::MemoryRegion> region;  // null: plain memory
  std::unique_ptr<uint8_t[]> plain;
  size_t size = 0;
  std::function<void()> unregister;
};

DataBuffer::DataBuffer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DataBuffer::~DataBuffer() {
  if (impl_->unregister) impl_->unregister();
}
absl::Span<uint8_t> DataBuffer::span() const {
  return absl::MakeSpan(
      impl_->region != nullptr ? impl_->region->data() : impl_->plain.get(),
      impl_->size);
}
bool DataBuffer::registered() const { return impl_->region != nullptr; }

namespace internal {

absl::StatusOr<BufferPool::Landing> BufferPool::Take(ucx::ClientPlane* plane,
                                                     size_t bytes) {
  {
    MutexLock lock(&mu_);
    auto it = idle_.lower_bound(bytes);
    if (it != idle_.end() && it->first < 2 * bytes) {
      Landing landing = std::move(it->second);
      idle_bytes_ -= it->first;
      idle_.erase(it);
      return landing;
    }
  }
  absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> region =
      plane->Allocate(bytes);
  if (!region.ok()) return region.status();
  // Where this fails (an older kernel) the first read faults the pages.
  PopulateForWrite((*region)->data(), (*region)->size());
  Landing landing;
  landing.region = *std::move(region);
  MutexLock lock(&mu_);
  landing.id = next_id_++;
  return landing;
}

void BufferPool::GiveBack(ucx::ClientPlane* plane, Landing landing) {
  const size_t size = landing.region->size();
  {
    MutexLock lock(&mu_);
    // A read that outlived its call may still hold the region.
    if (landing.region.use_count() == 1 &&
        idle_bytes_ + size <= max_idle_bytes_) {
      idle_bytes_ += size;
      idle_.emplace(size, std::move(landing));
      return;
    }
  }
  plane->ReleaseBuffer(landing.id);
}

void BufferPool::Unlist(uintptr_t start) {
  MutexLock lock(&mu_);
  listed_.erase(start);
}

std::shared_ptr<ucx::MemoryRegion> BufferPool::Holding(const uint8_t* data,
                                                       size_t n, uint64_t* id) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  MutexLock lock(&mu_);
  auto it = listed_.upper_bound(start);
  if (it == listed_.begin()) return nullptr;
  --it;
  if (start + n > it->first + it->second.size) return nullptr;
  *id = it->second.id;
  return it->second.region.lock();
}

absl::StatusOr<std::unique_ptr<DataBuffer>> BufferPool::Allocate(
    ucx::ClientPlane* plane, size_t bytes) {
  absl::StatusOr<Landing> landing = Take(plane, bytes);
  if (!landing.ok()) return landing.status();
  auto impl = std::make_unique<DataBuffer::Impl>();
  impl->size = bytes;
  impl->region = landing->region;
  const uintptr_t start = reinterpret_cast<uintptr_t>(impl->region->data());
  const uint64_t id = landing->id;
  {
    MutexLock lock(&mu_);
    listed_[start] = {bytes, id, impl->region};
  }
  // Back to the pool (kept only when no read still holds it).
  impl->unregister = [this, plane, start, id, impl_raw = impl.get()] {
    Unlist(start);
    GiveBack(plane, Landing{std::move(impl_raw->region), id});
  };
  return std::make_unique<DataBuffer>(std::move(impl));
}

std::unique_ptr<DataBuffer> BufferPool::AllocatePlain(size_t bytes) {
  auto impl = std::make_unique<DataBuffer::Impl>();
  impl->size = bytes;
  impl->plain = std::make_unique<uint8_t[]>(bytes);
  return std::make_unique<DataBuffer>(std::move(impl));
}

}  // namespace internal
}  // namespace kvcache
