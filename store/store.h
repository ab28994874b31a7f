// Store: the cache node's state — namespaces, the block index, leases,
// eviction and capacity accounting — over one PagePool. It knows nothing of
// gRPC or UCX; the service maps its absl::Status codes onto the wire.
//
// Invariants (each guarded by mu_):
//  * A block is visible (in index_) only after CommitWrite; a visible block
//    is immutable: its pages are written once, before it becomes visible.
//  * Every page is owned by exactly one of: the free list, a write lease's
//    reservation, a stored block (visible, or removed but still pinned).
//  * A block with pins > 0 is never evicted and its pages are never reused;
//    Delete or data loss of a pinned block hides it at once and frees its
//    pages when the last pin goes.
//  * Eviction is prefix aware: a block with cached children is never
//    evicted; among evictable blocks (no children, no pins) the least
//    recently used goes first.
//  * Accounting (used bytes, blocks/tokens per codec) changes exactly when a
//    block enters or leaves the store, so Stats() equals the bytes held.
//  * A block's header sits in the header-slab slot of its first page; the
//    payload fills its pages from the first byte.
//  * Every read verifies the block header and payload checksum; a failure
//    answers DATA_LOSS, drops the block and counts it.
#ifndef KVCACHE_STORE_STORE_H_
#define KVCACHE_STORE_STORE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/codec.h"
#include "store/arena.h"
#include "store/block_header.h"
#include "store/mutex.h"
#include "store/page_pool.h"

namespace kvcache::store {

inline constexpr size_t kMaxKeyBytes = 64;
inline constexpr size_t kNumCodecs = 5;

struct StoreOptions {
  uint32_t page_size = 64 * 1024;
  absl::Duration default_lease_ttl = absl::Seconds(30);
  absl::Duration max_lease_ttl = absl::Minutes(10);
  size_t max_namespaces = 16;
  size_t max_blocks_per_request = 1024;
  kernels::Codec default_codec = kernels::Codec::kFp8E4M3;
};

struct NamespaceConfig {
  std::string name;
  std::string model;
  std::string revision;
  uint32_t tp_rank = 0;
  kernels::BlockShape shape;
  // codec_specified == false means "the node's default codec".
  bool codec_specified = true;
  kernels::CodecPolicy policy;
};

struct NamespaceInfo {
  NamespaceConfig config;  // with the effective codec filled in
  uint64_t fingerprint = 0;
  uint64_t fp16_block_bytes = 0;
  uint64_t encoded_block_bytes = 0;
  bool already_registered = false;
};

struct BlockRef {
  std::string key;
  std::string parent_key;  // empty: none
};

struct LookupResult {
  uint32_t prefix_blocks = 0;
  uint64_t lease_id = 0;  // nonzero when pinned
};

struct BeginWriteResult {
  uint64_t write_id = 0;
  std::vector<bool> present;
  uint64_t fp16_block_bytes = 0;
  absl::Time deadline;
};

struct CommitResult {
  uint32_t stored = 0;
  uint32_t skipped = 0;
  uint64_t stored_bytes = 0;
};

enum class ReadFormat { kFp16, kRaw };

struct ReadBlock {
  std::string key;
  kernels::Codec codec = kernels::Codec::kNone;
  std::string data;  // fp16 (little-endian half) or the raw encoding
};

struct ReadResult {
  uint64_t lease_id = 0;  // 0 when the read was completed inline
  std::vector<ReadBlock> blocks;
  NamespaceInfo ns;
};

struct CodecStats {
  uint64_t blocks = 0;
  uint64_t tokens = 0;
  uint64_t stored_bytes = 0;   // pages held
  uint64_t logical_bytes = 0;  // fp16 bytes represented
};

struct NamespaceStats {
  std::string name;
  kernels::Codec codec = kernels::Codec::kNone;
  uint64_t blocks = 0;
  uint64_t tokens = 0;
  std::array<uint64_t, kNumCodecs> tokens_that_fit{};  // by codec index
};

struct StoreStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;      // pages held by stored blocks
  uint64_t reserved_bytes = 0;  // pages held by open write leases
  uint64_t pinned_bytes = 0;
  uint64_t fragmentation_bytes = 0;  // unused tails of stored blocks' pages
  uint32_t page_size = 0;
  std::array<CodecStats, kNumCodecs> codecs{};
  std::vector<NamespaceStats> namespaces;
  uint64_t evictions_capacity = 0;
  uint64_t evictions_data_loss = 0;
  uint64_t deleted = 0;
  uint64_t data_loss_events = 0;
  uint64_t lookup_hits = 0;
  uint64_t lookup_misses = 0;
  uint32_t active_read_leases = 0;
  uint32_t active_write_leases = 0;
  uint64_t expired_leases = 0;
};

// Called after each block encode, outside the store lock.
using QuantizeObserver = std::function<void(kernels::Codec, double seconds)>;

class Store {
 public:
  static absl::StatusOr<std::unique_ptr<Store>> Create(
      const StoreOptions& options, std::unique_ptr<Arena> arena);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  void SetQuantizeObserver(QuantizeObserver observer);

  // INVALID_ARGUMENT: bad name, shape or codec policy. FAILED_PRECONDITION:
  // the name exists with a different layout or policy. RESOURCE_EXHAUSTED:
  // max_namespaces reached.
  absl::StatusOr<NamespaceInfo> RegisterNamespace(NamespaceConfig config);
  absl::StatusOr<NamespaceInfo> GetNamespace(const std::string& name) const;

  // Longest cached prefix of `keys`. With pin, the prefix is pinned under a
  // read lease (released by EndLease or its TTL).
  absl::StatusOr<LookupResult> Lookup(const std::string& ns,
                                      absl::Span<const std::string> keys,
                                      bool pin, absl::Duration ttl);

  // Reserves pages for every block not stored yet. RESOURCE_EXHAUSTED when
  // the pool cannot hold them even after evicting every evictable block.
  absl::StatusOr<BeginWriteResult> BeginWrite(const std::string& ns,
                                              std::vector<BlockRef> blocks,
                                              absl::Duration ttl);

  struct Payload {
    uint32_t index;
    absl::Span<const uint8_t> fp16;  // little-endian IEEE half
  };
  // Encodes and stores the payloads. All or nothing: on any error nothing of
  // this batch becomes visible and the write lease is released.
  absl::StatusOr<CommitResult> CommitWrite(uint64_t write_id,
                                           absl::Span<const Payload> payloads);
  absl::Status AbortWrite(uint64_t write_id);

  // Pins the blocks of `keys` (all must be stored: NOT_FOUND names the first
  // missing key), verifies and copies them out. With keep_lease == false the
  // pins are released before returning and lease_id is 0.
  absl::StatusOr<ReadResult> BeginRead(const std::string& ns,
                                       absl::Span<const std::string> keys,
                                       ReadFormat format, absl::Duration ttl,
                                       uint64_t pin_lease_id, bool keep_lease);
  // Ends a read lease or a Lookup pin. NOT_FOUND for an unknown or expired id.
  absl::Status EndLease(uint64_t lease_id);

  absl::StatusOr<uint32_t> Delete(const std::string& ns,
                                  absl::Span<const std::string> keys);

  StoreStats Stats() const;

  // Ends every lease whose deadline is before `now`; returns how many.
  int ExpireLeases(absl::Time now);

  // Test hook: flips one byte of a stored block's payload (or of its
  // header) in place, to show that reads detect corruption. NOT_FOUND when
  // the block is absent.
  absl::Status CorruptBlockForTest(const std::string& ns,
                                   const std::string& key, bool header = false);

 private:
  struct Namespace;
  struct Entry;
  struct ReadLease;
  struct WriteLease;

  Store(const StoreOptions& options, std::unique_ptr<Arena> arena);

  absl::StatusOr<Namespace*> FindNamespace(const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Entry* FindEntry(uint32_t ns_id, const std::string& key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Touch(Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateEvictable(Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReservePages(uint32_t count, std::vector<uint32_t>* pages)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EvictOne() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a block from the index and accounting; frees its pages now or,
  // when pinned, when the last pin goes.
  void RemoveEntry(Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unpin(Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseReadLease(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseWriteLease(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t NewLeaseId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Time LeaseDeadline(absl::Duration ttl) const;
  uint64_t StoredBytesFor(const Namespace& ns) const;
  // The header of the block whose first page is `first_page`: headers live
  // in a slab at the start of the arena, one slot per page, so a block's
  // payload fills whole pages without a header spilling into one more.
  BlockHeader* HeaderSlot(uint32_t first_page) const;

  const StoreOptions options_;
  const std::unique_ptr<Arena> arena_;
  BlockHeader* header_slab_;
  QuantizeObserver quantize_observer_;

  mutable Mutex mu_;
  PagePool pool_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Namespace>> namespaces_ ABSL_GUARDED_BY(mu_);
  // Key: 4-byte namespace id followed by the block key.
  absl::flat_hash_map<std::string, std::unique_ptr<Entry>> index_
      ABSL_GUARDED_BY(mu_);
  // Removed from the index while pinned; freed at the last unpin.
  absl::flat_hash_map<Entry*, std::unique_ptr<Entry>> zombies_
      ABSL_GUARDED_BY(mu_);
  // Evictable blocks by (last access tick, entry): the front goes first.
  std::set<std::pair<uint64_t, Entry*>> evictable_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::unique_ptr<ReadLease>> read_leases_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::unique_ptr<WriteLease>> write_leases_
      ABSL_GUARDED_BY(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);
  StoreStats counters_ ABSL_GUARDED_BY(mu_);  // the cumulative fields
  std::array<CodecStats, kNumCodecs> per_codec_ ABSL_GUARDED_BY(mu_){};
  uint64_t used_pages_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t used_payload_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserved_pages_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pinned_pages_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_STORE_H_
