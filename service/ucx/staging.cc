#include "service/ucx/staging.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcache::ucx {

StagingReservation::~StagingReservation() {
  if (budget_ != nullptr && bytes_ > 0) budget_->Release(bytes_);
}

StagingReservation::StagingReservation(StagingReservation&& other) noexcept
    : budget_(std::move(other.budget_)),
      bytes_(std::exchange(other.bytes_, 0)) {}

StagingReservation& StagingReservation::operator=(
    StagingReservation&& other) noexcept {
  if (this != &other) {
    if (budget_ != nullptr && bytes_ > 0) budget_->Release(bytes_);
    budget_ = std::move(other.budget_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

StagingReservation StagingReservation::Split(uint64_t bytes) {
  if (bytes > bytes_) bytes = bytes_;
  bytes_ -= bytes;
  return StagingReservation(budget_, bytes);
}

absl::StatusOr<StagingReservation> StagingBudget::TryReserve(uint64_t bytes) {
  std::vector<StagingMemory> evicted;  // freed after unlocking
  {
    MutexLock lock(&mu_);
    if (bytes > capacity_ - used_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("data-plane staging is full: ", bytes, " bytes asked, ",
                       used_, " of ", capacity_, " in use; retry later"));
    }
    for (auto it = cache_.begin();
         used_ + cached_ + bytes > capacity_ && it != cache_.end(); ++it) {
      while (!it->second.empty() && used_ + cached_ + bytes > capacity_) {
        evicted.push_back(std::move(it->second.back()));
        it->second.pop_back();
        cached_ -= it->first;
      }
    }
    used_ += bytes;
  }
  return StagingReservation(shared_from_this(), bytes);
}

uint64_t StagingBudget::used() const {
  MutexLock lock(&mu_);
  return used_;
}

uint64_t StagingBudget::cached() const {
  MutexLock lock(&mu_);
  return cached_;
}

void StagingBudget::Release(uint64_t bytes) {
  MutexLock lock(&mu_);
  used_ -= bytes;
}

absl::StatusOr<StagingMemory> StagingBudget::TakeMemory(uint64_t bytes) {
  {
    MutexLock lock(&mu_);
    auto it = cache_.find(bytes);
    if (it != cache_.end() && !it->second.empty()) {
      StagingMemory memory = std::move(it->second.back());
      it->second.pop_back();
      cached_ -= bytes;
      return memory;
    }
  }
  void* p = std::aligned_alloc(kPage, bytes);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of staging"));
  }
  return StagingMemory(static_cast<uint8_t*>(p));
}

void StagingBudget::ReturnMemory(StagingMemory memory, uint64_t bytes) {
  MutexLock lock(&mu_);
  // The caller's reservation (in used_) is released right after: the bytes
  // move from used to cached and the sum stays within capacity.
  cache_[bytes].push_back(std::move(memory));
  cached_ += bytes;
}

absl::StatusOr<std::shared_ptr<StagingBuffer>> StagingBuffer::Allocate(
    StagingReservation reservation) {
  if (reservation.budget() == nullptr ||
      reservation.bytes() != StagingBudget::Round(reservation.bytes())) {
    return absl::InternalError("staging reservation of a partial page");
  }
  absl::StatusOr<StagingMemory> memory =
      reservation.budget()->TakeMemory(reservation.bytes());
  if (!memory.ok()) return memory.status();
  return std::shared_ptr<StagingBuffer>(
      new StagingBuffer(std::move(reservation), *std::move(memory)));
}

StagingBuffer::~StagingBuffer() {
  if (data_ != nullptr && reservation_.budget() != nullptr) {
    reservation_.budget()->ReturnMemory(std::move(data_), reservation_.bytes());
  }
}

}  // namespace kvcache::ucx
