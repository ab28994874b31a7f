// Staging: the bounded memory the data plane holds on behalf of clients —
// write blocks waiting for their commit and read copies waiting for their
// transfer.
//
// Invariants:
//  * StagingBudget::used() never exceeds capacity(): TryReserve() either
//    takes the whole amount or nothing.
//  * used() + cached() never exceeds capacity() either: buffers that were
//    given back are kept for reuse (fresh pages cost a fault and a clear
//    each) only while they fit, and are freed to make room for a
//    reservation.
//  * A StagingReservation returns its bytes exactly once, when it is
//    destroyed (it is move-only); a StagingBuffer owns one reservation for
//    its whole lifetime, so used() is the sum of live buffers and
//    reservations.
#ifndef KVCACHE_SERVICE_UCX_STAGING_H_
#define KVCACHE_SERVICE_UCX_STAGING_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"

namespace kvcache::ucx {

class StagingBudget;

class StagingReservation {
 public:
  StagingReservation() = default;
  StagingReservation(std::shared_ptr<StagingBudget> budget, uint64_t bytes)
      : budget_(std::move(budget)), bytes_(bytes) {}
  ~StagingReservation();
  StagingReservation(StagingReservation&& other) noexcept;
  StagingReservation& operator=(StagingReservation&& other) noexcept;
  StagingReservation(const StagingReservation&) = delete;
  StagingReservation& operator=(const StagingReservation&) = delete;

  uint64_t bytes() const { return bytes_; }
  // Splits `bytes` off into a reservation of its own (bytes <= this one's).
  StagingReservation Split(uint64_t bytes);
  StagingBudget* budget() const { return budget_.get(); }

 private:
  std::shared_ptr<StagingBudget> budget_;
  uint64_t bytes_ = 0;
};

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using StagingMemory = std::unique_ptr<uint8_t, FreeDeleter>;

class StagingBudget : public std::enable_shared_from_this<StagingBudget> {
 public:
  // Staging memory comes in whole pages.
  static constexpr uint64_t kPage = 4096;
  static uint64_t Round(uint64_t bytes) {
    return bytes == 0 ? kPage : (bytes + kPage - 1) / kPage * kPage;
  }

  explicit StagingBudget(uint64_t capacity) : capacity_(capacity) {}
  // RESOURCE_EXHAUSTED (naming both figures) when `bytes` do not fit now.
  absl::StatusOr<StagingReservation> TryReserve(uint64_t bytes);
  uint64_t capacity() const { return capacity_; }
  uint64_t used() const;
  uint64_t cached() const;

  // Memory of `bytes` (a multiple of kPage) for a reservation that covers
  // it: a cached buffer of that size, or a fresh page-aligned one.
  absl::StatusOr<StagingMemory> TakeMemory(uint64_t bytes);
  // Keeps `memory` for reuse (its reservation still counts it, so the
  // bound holds when that is released right after).
  void ReturnMemory(StagingMemory memory, uint64_t bytes);

 private:
  friend class StagingReservation;
  void Release(uint64_t bytes);

  const uint64_t capacity_;
  mutable Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t cached_ ABSL_GUARDED_BY(mu_) = 0;
  // Given-back buffers by size.
  absl::flat_hash_map<uint64_t, std::vector<StagingMemory>> cache_
      ABSL_GUARDED_BY(mu_);
};

// One block's worth of staging memory (page aligned, uninitialized).
class StagingBuffer {
 public:
  // The reservation must cover StagingBudget::Round(size).
  static absl::StatusOr<std::shared_ptr<StagingBuffer>> Allocate(
      StagingReservation reservation);
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  uint8_t* data() const { return data_.get(); }
  uint64_t size() const { return reservation_.bytes(); }

 private:
  StagingBuffer(StagingReservation reservation, StagingMemory data)
      : reservation_(std::move(reservation)), data_(std::move(data)) {}
  StagingReservation reservation_;
  StagingMemory data_;
};

}  // namespace kvcache::ucx

#endif  // KVCACHE_SERVICE_UCX_STAGING_H_
