// WriteClaim and ReadClaim: who ends a store lease, stated in types.
//
// Between calls the store's lease table owns every lease: its id crosses
// the wire, and the lease ends by the id-based calls (CommitWrite,
// AbortWrite, EndLease, a BeginRead that takes a pin over) or by its TTL.
// Code that works on a lease takes it out as a claim, and then the claim
// decides how the lease ends:
//  * A claim is move-only. Handing it over by move hands over the duty to
//    end the lease; a moved-from or default-constructed claim is empty and
//    does nothing.
//  * Destroying (or assigning over) a claim that still holds its lease ends
//    it: a WriteClaim aborts the write (its reservation returns to the
//    pool), a ReadClaim ends the read lease (its pins go). That is the one
//    place where the store's answer to a cleanup is not looked at.
//  * Commit, Abort and End end the lease explicitly and answer with the
//    store's status; the claim is empty afterwards, whatever the answer.
//    Release hands the lease back to the table (then its TTL, or a later
//    claim, ends it) and returns its id.
//  * Taking a claim looks nothing up: a claim for an unknown or expired id
//    is allowed, and its operations answer as the id-based calls would
//    (FAILED_PRECONDITION for a stale lease). Claims are not recorded in the
//    table; the code that hands out ids (one data-plane session per lease, one
//    RPC per call) keeps at most one claim per lease.
//
// Thread safety: a claim is one object with one owner; its methods must not
// run concurrently with each other or with a move of it. Different claims
// may be used from different threads, as the Store may. The Store must
// outlive every claim taken on it.
#ifndef KVCACHE_STORE_LEASE_CLAIM_H_
#define KVCACHE_STORE_LEASE_CLAIM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "store/store.h"

namespace kvcache::store {

// The duty to finish one write lease (Store::BeginWrite's write_id).
class WriteClaim {
 public:
  // Empty: holds no lease.
  WriteClaim() = default;
  // Takes write lease `write_id` of `store` out of the table.
  WriteClaim(Store* store, uint64_t write_id);
  // Aborts the write if the claim still holds it.
  ~WriteClaim();
  WriteClaim(WriteClaim&& other) noexcept;
  // Aborts the write this claim held (if any), then takes over other's.
  WriteClaim& operator=(WriteClaim&& other) noexcept;
  WriteClaim(const WriteClaim&) = delete;
  WriteClaim& operator=(const WriteClaim&) = delete;

  // The lease's id; 0 when empty.
  uint64_t id() const { return id_; }
  bool held() const { return store_ != nullptr; }

  // Store::CommitWrite; the claim is empty afterwards. On an error the store
  // has released the lease, except where it answers FAILED_PRECONDITION
  // (unknown, expired, or in use by another call or by StageBlock): then the
  // lease, if any, is left to its TTL or to whoever is using it.
  absl::StatusOr<CommitResult> Commit(
      absl::Span<const Store::Payload> payloads);
  // Store::AbortWrite; the claim is empty afterwards. FAILED_PRECONDITION:
  // the lease had expired or ended. ABORTED: it is being committed or
  // staged, and ends when that ends.
  absl::Status Abort();
  // Hands the lease back to the table, where its TTL ends it unless another
  // claim or an id-based call does first; returns its id (0 when empty).
  uint64_t Release();

 private:
  // The single cleanup of a held lease (destructor and move assignment).
  void AbortIfHeld();

  Store* store_ = nullptr;
  uint64_t id_ = 0;
};

// The duty to finish one block received in place (Store::ClaimInPlace):
// while it is held, the block's span stays the block's and its write
// cannot end, so a transfer writing into the span must own the claim
// until the transfer has ended.
class InPlaceClaim {
 public:
  // Empty: holds no block.
  InPlaceClaim() = default;
  // Store::ClaimInPlace; its errors.
  static absl::StatusOr<InPlaceClaim> Take(Store* store, uint64_t write_id,
                                           uint32_t index);
  // Gives the block up unstaged (FinishInPlace without `landed`) if the
  // claim still holds it.
  ~InPlaceClaim();
  InPlaceClaim(InPlaceClaim&& other) noexcept;
  InPlaceClaim& operator=(InPlaceClaim&& other) noexcept;
  InPlaceClaim(const InPlaceClaim&) = delete;
  InPlaceClaim& operator=(const InPlaceClaim&) = delete;

  bool held() const { return store_ != nullptr; }
  // Where the block's fp16 bytes go (empty when the claim is).
  absl::Span<uint8_t> bytes() const { return bytes_; }

  // The bytes have landed: Store::FinishInPlace(landed = true), which
  // checks, seals and stages the block. The claim is empty afterwards.
  absl::Status Stage();

 private:
  InPlaceClaim(Store* store, uint64_t write_id, uint32_t index,
               absl::Span<uint8_t> bytes)
      : store_(store), write_id_(write_id), index_(index), bytes_(bytes) {}
  void GiveUpIfHeld();

  Store* store_ = nullptr;
  uint64_t write_id_ = 0;
  uint32_t index_ = 0;
  absl::Span<uint8_t> bytes_;
};

// The duty to end one read lease (a BeginRead with keep_lease, or a Lookup
// pin).
class ReadClaim {
 public:
  // Empty: holds no lease.
  ReadClaim() = default;
  // Takes read lease `lease_id` of `store` out of the table.
  ReadClaim(Store* store, uint64_t lease_id);
  // Ends the lease if the claim still holds it.
  ~ReadClaim();
  ReadClaim(ReadClaim&& other) noexcept;
  // Ends the lease this claim held (if any), then takes over other's.
  ReadClaim& operator=(ReadClaim&& other) noexcept;
  ReadClaim(const ReadClaim&) = delete;
  ReadClaim& operator=(const ReadClaim&) = delete;

  // The lease's id; 0 when empty.
  uint64_t id() const { return id_; }
  bool held() const { return store_ != nullptr; }

  // Store::HoldReadLease: the lease no longer expires by its TTL, so that
  // it ends only by this claim. The claim still holds it.
  // FAILED_PRECONDITION: the lease had expired or ended.
  absl::Status Hold();
  // Store::EndLease; the claim is empty afterwards. FAILED_PRECONDITION: the
  // lease had expired or ended.
  absl::Status End();
  // Store::DropCorruptReadBlock for block `block` of the held lease.
  absl::Status DropCorruptBlock(size_t block);
  // Hands the lease back to the table (its TTL, EndLease or a BeginRead
  // taking the pin over ends it); returns its id (0 when empty).
  uint64_t Release();

 private:
  // The single cleanup of a held lease (destructor and move assignment).
  void EndIfHeld();

  Store* store_ = nullptr;
  uint64_t id_ = 0;
};

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_LEASE_CLAIM_H_
