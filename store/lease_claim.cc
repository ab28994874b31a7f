#include "store/lease_claim.h"

#include <utility>

namespace kvcache::store {

// ---------------------------------------------------------------- WriteClaim

WriteClaim::WriteClaim(Store* store, uint64_t write_id)
    : store_(store), id_(write_id) {}

WriteClaim::~WriteClaim() { AbortIfHeld(); }

WriteClaim::WriteClaim(WriteClaim&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      id_(std::exchange(other.id_, 0)) {}

WriteClaim& WriteClaim::operator=(WriteClaim&& other) noexcept {
  if (this != &other) {
    AbortIfHeld();
    store_ = std::exchange(other.store_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

absl::StatusOr<CommitResult> WriteClaim::Commit(
    absl::Span<const Store::Payload> payloads) {
  Store* store = std::exchange(store_, nullptr);
  uint64_t id = std::exchange(id_, 0);
  if (store == nullptr) {
    return absl::FailedPreconditionError("the write claim holds no lease");
  }
  return store->CommitWrite(id, payloads);
}

absl::Status WriteClaim::Abort() {
  Store* store = std::exchange(store_, nullptr);
  uint64_t id = std::exchange(id_, 0);
  if (store == nullptr) {
    return absl::FailedPreconditionError("the write claim holds no lease");
  }
  return store->AbortWrite(id);
}

uint64_t WriteClaim::Release() {
  store_ = nullptr;
  return std::exchange(id_, 0);
}

void WriteClaim::AbortIfHeld() {
  if (store_ == nullptr) return;
  // A dropped claim is abandoned work: FAILED_PRECONDITION (the lease
  // expired or was ended by its id) and ABORTED (a commit or a staging is
  // using it and ends it) leave nothing for us to undo.
  store_->AbortWrite(std::exchange(id_, 0)).IgnoreError();
  store_ = nullptr;
}

// -------------------------------------------------------------- InPlaceClaim

absl::StatusOr<InPlaceClaim> InPlaceClaim::Take(Store* store, uint64_t write_id,
                                                uint32_t index) {
  absl::StatusOr<absl::Span<uint8_t>> bytes =
      store->ClaimInPlace(write_id, index);
  if (!bytes.ok()) return bytes.status();
  return InPlaceClaim(store, write_id, index, *bytes);
}

InPlaceClaim::~InPlaceClaim() { GiveUpIfHeld(); }

InPlaceClaim::InPlaceClaim(InPlaceClaim&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      write_id_(std::exchange(other.write_id_, 0)),
      index_(std::exchange(other.index_, 0)),
      bytes_(std::exchange(other.bytes_, {})) {}

InPlaceClaim& InPlaceClaim::operator=(InPlaceClaim&& other) noexcept {
  if (this != &other) {
    GiveUpIfHeld();
    store_ = std::exchange(other.store_, nullptr);
    write_id_ = std::exchange(other.write_id_, 0);
    index_ = std::exchange(other.index_, 0);
    bytes_ = std::exchange(other.bytes_, {});
  }
  return *this;
}

absl::Status InPlaceClaim::Stage() {
  Store* store = std::exchange(store_, nullptr);
  bytes_ = {};
  if (store == nullptr) {
    return absl::FailedPreconditionError("the in-place claim holds no block");
  }
  return store->FinishInPlace(write_id_, index_, /*landed=*/true);
}

void InPlaceClaim::GiveUpIfHeld() {
  if (store_ == nullptr) return;
  // Only INTERNAL (a claim the store does not know), which cannot be.
  store_->FinishInPlace(write_id_, index_, /*landed=*/false).IgnoreError();
  store_ = nullptr;
  bytes_ = {};
}

// ----------------------------------------------------------------- ReadClaim

ReadClaim::ReadClaim(Store* store, uint64_t lease_id)
    : store_(store), id_(lease_id) {}

ReadClaim::~ReadClaim() { EndIfHeld(); }

ReadClaim::ReadClaim(ReadClaim&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      id_(std::exchange(other.id_, 0)) {}

ReadClaim& ReadClaim::operator=(ReadClaim&& other) noexcept {
  if (this != &other) {
    EndIfHeld();
    store_ = std::exchange(other.store_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

absl::Status ReadClaim::Hold() {
  if (store_ == nullptr) {
    return absl::FailedPreconditionError("the read claim holds no lease");
  }
  return store_->HoldReadLease(id_);
}

absl::Status ReadClaim::DropCorruptBlock(size_t block) {
  if (store_ == nullptr) {
    return absl::FailedPreconditionError("the read claim holds no lease");
  }
  return store_->DropCorruptReadBlock(id_, block);
}

absl::Status ReadClaim::End() {
  Store* store = std::exchange(store_, nullptr);
  uint64_t id = std::exchange(id_, 0);
  if (store == nullptr) {
    return absl::FailedPreconditionError("the read claim holds no lease");
  }
  return store->EndLease(id);
}

uint64_t ReadClaim::Release() {
  store_ = nullptr;
  return std::exchange(id_, 0);
}

void ReadClaim::EndIfHeld() {
  if (store_ == nullptr) return;
  // FAILED_PRECONDITION is the only error: the lease expired by its TTL, or a
  // BeginRead took it over, or it was ended by its id. Nothing is pinned
  // for it any more either way.
  store_->EndLease(std::exchange(id_, 0)).IgnoreError();
  store_ = nullptr;
}

}  // namespace kvcache::store
