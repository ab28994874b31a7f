// Store: the cache node's state — namespaces, the block index, leases,
// eviction, KIVI's residual window and capacity accounting — over one
// PagePool. It knows nothing of gRPC or UCX; the service maps its
// absl::Status codes onto the wire.
//
// Invariants:
//  * A block is visible (in the index) only after CommitWrite. Its KV never
//    changes; its representation changes once at most, when KIVI's residual
//    window re-encodes it from fp16 to the namespace codec.
//  * Every page is owned by exactly one of: the free stack, a write lease's
//    reservation, a re-encode in progress, a stored block (visible, or
//    removed but still pinned).
//  * A block with pins > 0 is never evicted, never re-encoded, and its pages
//    are never reused; Delete or data loss of a pinned block hides it at
//    once and frees its pages when the last pin goes.
//  * Eviction is prefix aware: a block with cached children is never
//    evicted; among evictable blocks (no children, no pins) the least
//    recently used goes first (exactly, when calls do not race).
//  * Accounting (used bytes, blocks/tokens per codec) changes exactly when a
//    block enters or leaves the store or is re-encoded, so Stats() equals
//    the bytes held whenever no call is in flight.
//  * A block's header sits in the header-slab slot of its first page, its
//    layer checksums in the slots of the pages after it (where it has
//    enough pages, WriteBlockMetadata); the payload fills its pages from the
//    first byte. Every read verifies header and payload checksum, or hands
//    the header-checked layer checksums to a caller that checks the bytes
//    as it moves them (ReadOptions::caller_verifies); a failure answers
//    DATA_LOSS, drops the block and counts it.
//
// Leases: the lease table owns every open lease between calls (their ids
// cross the wire); code that works on one takes it out as a WriteClaim or
// ReadClaim (store/lease_claim.h), which ends it unless handed on. The TTL
// of every lease is clamped here (StoreOptions) and nowhere else: callers
// that bound a session by its lease take the deadline from the result.
//
// Concurrency: the index is split into shards by key hash, each with its own
// mutex, hash set, entry slab and LRU order; the page pool, the leases and
// the namespaces have one mutex each. No thread holds two shard mutexes at
// once; the pool and lease mutexes are taken last.
//
// Owners (tenancy without credentials): every namespace has an opaque
// owner index (NamespaceConfig::owner; the service maps its tenants onto
// them, 0 when it runs open), and every lease an opaque holder
// (Lookup/BeginWrite/ReadOptions): an id-based call names the holder it
// acts for, and a lease of another holder answers as an unknown one
// (CheckLeaseHolder). Each owner may have a quota (SetOwnerQuota): a number
// of namespaces, and a share of the pool in pages. Pages count against an
// owner while its blocks hold them or its open writes reserve them. Under
// pool pressure blocks are evicted from owners over their share first, then
// from owners without a share, by the LRU order among them; an owner within
// its share is never evicted for another's write. A write that would take
// its owner over its share while the pool is full evicts only that owner's
// blocks (RESOURCE_EXHAUSTED when they do not make room).
//
// Dropping a namespace (DropNamespace) removes its blocks, ends its leases
// and frees its table slot for a later registration once no call uses it
// any more (a slot is reused only when nothing refers to the old namespace).
//
// Memory: an index entry is a fixed 88-byte record from its shard's slab
// (keys up to 16 bytes inline), one pointer slot in the shard's hash set and,
// while evictable, one (tick, pointer) pair in the shard's LRU B-tree; page
// lists live in the pool (4 bytes per page). Recency is recorded lazily: a
// hit only stores a tick, and eviction re-files a stale LRU head before
// taking it, which keeps the order exact without re-sorting on every hit.
// Encode, decode, copies and checksums run with no mutex held, on pages that a
// lease, a pin or a re-encode owns.
#ifndef KVCACHE_STORE_STORE_H_
#define KVCACHE_STORE_STORE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "base/parallel_for.h"
#include "kernels/codec.h"
#include "store/arena.h"
#include "store/block_header.h"
#include "store/page_pool.h"

namespace kvcache::store {

inline constexpr size_t kMaxKeyBytes = 64;
inline constexpr size_t kMaxNamespaces = 65535;
inline constexpr size_t kNumCodecs = 5;
inline constexpr size_t kNumShards = 16;
// Owners a store accounts for (NamespaceConfig::owner < kMaxOwners).
inline constexpr size_t kMaxOwners = 256;
// The message of FAILED_PRECONDITION for a lease id that is unknown,
// expired or another holder's: one text, so that the three look alike.
inline constexpr char kStaleReadLease[] =
    "read lease is unknown or has expired";
inline constexpr char kStaleWriteLease[] =
    "write lease is unknown or has expired";

struct StoreOptions {
  // 16 KiB: an encoded block is rarely a whole number of larger pages (an
  // fp8 block carries its scales after its codes: 1 MiB + 1 KiB on a
  // 16-layer, 8-head, 128-dim, 32-token layout, which 64 KiB pages round up
  // by 5.8%, 16 KiB pages by 1.4%), and the header slab's 72 bytes per page
  // are 0.44% of a 16 KiB page.
  uint32_t page_size = 16 * 1024;
  absl::Duration default_lease_ttl = absl::Seconds(30);
  absl::Duration max_lease_ttl = absl::Minutes(10);
  size_t max_namespaces = 16;
  size_t max_blocks_per_request = 1024;
  kernels::Codec default_codec = kernels::Codec::kFp8E4M3;
  // Background eviction (RunMaintenance): above high, evict down to low.
  // Fractions of the pool; high >= 1 turns it off.
  double high_watermark = 0.95;
  double low_watermark = 0.90;
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
  // KIVI codecs only: per chain, the blocks holding the most recent this
  // many tokens stay fp16 (0: off). Ignored for other codecs.
  uint32_t residual_tokens = 128;
  // Whose pool share its blocks count against (see "Owners"); not part of
  // the fingerprint. A namespace keeps the owner that registered it.
  uint16_t owner = 0;
};

// An owner's limits (SetOwnerQuota). Zero means none.
struct OwnerQuota {
  uint64_t pool_bytes = 0;  // its share of the pool (rounded up to pages)
  uint32_t max_namespaces = 0;
};

struct OwnerUsage {
  uint64_t pool_bytes = 0;  // pages its blocks hold and its writes reserve
  uint32_t namespaces = 0;
};

struct DropResult {
  uint64_t blocks = 0;
  uint64_t freed_bytes = 0;  // pages its blocks held
};

struct NamespaceInfo {
  NamespaceConfig config;  // with the effective codec filled in
  uint64_t fingerprint = 0;
  uint64_t fp16_block_bytes = 0;
  uint64_t encoded_block_bytes = 0;
  bool already_registered = false;
};

// A namespace as a call names it: by its name and, where the caller knows
// it, by the fingerprint the name had when the caller registered it
// (NamespaceInfo::fingerprint; 0: not checked). Where the name has another
// fingerprint now (dropped and registered again with another spec, or a
// node restarted and another client registered it first) the call is
// FAILED_PRECONDITION: blocks are neither stored nor read, looked up or
// deleted under a spec their caller did not register. Passed by value for
// the length of one call: `name` is not kept.
struct NamespaceName {
  NamespaceName(  // NOLINT: implicit
      const std::string& name ABSL_ATTRIBUTE_LIFETIME_BOUND)
      : name(name) {}
  NamespaceName(const char* name) : name(name) {}  // NOLINT: implicit
  NamespaceName(absl::string_view name ABSL_ATTRIBUTE_LIFETIME_BOUND,
                uint64_t fingerprint)
      : name(name), fingerprint(fingerprint) {}
  absl::string_view name;
  uint64_t fingerprint = 0;
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
  // Per block: whether Store::ClaimInPlace gives it the span it is stored
  // in (false where present).
  std::vector<bool> in_place;
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
  // The codec this block is stored with: the namespace codec, or kNone for a
  // block in KIVI's residual window (then a raw read is plain fp16).
  kernels::Codec codec = kernels::Codec::kNone;
  std::string data;  // fp16 (little-endian half) or the raw encoding
  // Read in place (ReadOptions::in_place): the bytes where they lie in the
  // arena, in order, and `data` is empty. Valid until the read lease ends:
  // pinned pages are neither reused nor rewritten.
  std::vector<absl::Span<const uint8_t>> spans;
  // With ReadOptions::caller_verifies, for a block read in place whose
  // payload BeginRead did not checksum: where each layer ends in the spans'
  // bytes and the xxh3-64 it must have (their digest matched the header).
  // Both empty when BeginRead checked the whole block.
  std::vector<uint64_t> unchecked_layer_ends;
  std::vector<uint64_t> unchecked_layer_sums;
  // ReadOptions::decode_later: the spans hold this block's encoding (with
  // `codec` and the namespace's policy), and what the reader is owed is its
  // fp16 decode, `fp16_bytes` long; the caller decodes it where it delivers
  // it. False: the spans or `data` are the answer as it is.
  bool decode_later = false;
  uint64_t fp16_bytes = 0;
  // The bytes of the stored form: the spans' or `data`'s.
  uint64_t size() const {
    if (spans.empty()) return data.size();
    uint64_t n = 0;
    for (const auto& s : spans) n += s.size();
    return n;
  }
  // The bytes of the answer: fp16_bytes when decode_later, else size().
  uint64_t answer_size() const { return decode_later ? fp16_bytes : size(); }
};

// How BeginRead reads (see there).
struct ReadOptions {
  ReadFormat format = ReadFormat::kFp16;
  // The lease's TTL with keep_lease (<= 0: StoreOptions::default_lease_ttl;
  // at most max_lease_ttl).
  absl::Duration ttl = absl::ZeroDuration();
  // A Lookup pin (or read lease) that this read takes over and ends; 0: none.
  // Not one that a transfer holds (HoldReadLease): FAILED_PRECONDITION.
  uint64_t pin_lease_id = 0;
  bool keep_lease = false;
  bool allow_missing = false;
  bool in_place = false;
  // With in_place: a block read in place has its header and its layer
  // checksums' digest checked, not its payload. The caller must checksum
  // each layer's bytes (ReadBlock::unchecked_layer_sums) before they are
  // used, e.g. in the pass that copies them, and report a mismatch with
  // DropCorruptReadBlock. What BeginRead does not read it cannot reject:
  // a corrupt block is then found by the caller, mid-transfer.
  bool caller_verifies = false;
  // With in_place and format kFp16, on a host arena: a block stored encoded
  // (fp8, KIVI) is read in place too, as its encoding, with
  // ReadBlock::decode_later set, rather than decoded into a copy here. The
  // caller decodes it (layer by layer, kernels::LayerPolicy) where it
  // delivers it, e.g. straight into a client's memory, and checks it first
  // as caller_verifies asks (its layer sums are those of the encoding).
  bool decode_later = false;
  // Who the kept lease belongs to; a pin_lease_id must be this holder's.
  uint32_t holder = 0;
};

struct ReadResult {
  uint64_t lease_id = 0;  // 0 when the read was completed inline
  // With keep_lease: when the store's TTL ends the lease (unless it is held,
  // see HoldReadLease).
  absl::Time deadline;
  // In the order of the keys asked for; with allow_missing, only those read.
  std::vector<ReadBlock> blocks;
  // allow_missing only: positions (ascending) of the keys not read, because
  // they are not stored or their block failed verification and was dropped.
  std::vector<uint32_t> missing;
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
  uint16_t owner = 0;
  kernels::Codec codec = kernels::Codec::kNone;
  uint64_t blocks = 0;
  uint64_t tokens = 0;
  uint64_t residual_blocks = 0;  // kept fp16 by the KIVI residual window
  uint64_t stored_bytes = 0;     // pages its blocks hold
  uint64_t logical_bytes = 0;    // fp16 bytes its blocks stand for
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
  uint64_t evictions_capacity = 0;   // on demand, to make room for a write
  uint64_t evictions_watermark = 0;  // in the background, above high
  uint64_t evictions_data_loss = 0;
  uint64_t deleted = 0;
  uint64_t data_loss_events = 0;
  uint64_t lookup_hits = 0;
  uint64_t lookup_misses = 0;
  uint32_t active_read_leases = 0;
  uint32_t active_write_leases = 0;
  uint64_t expired_leases = 0;
  uint64_t reencoded_blocks = 0;
  uint64_t pending_reencodes = 0;  // queued or running
};

// Called after each block encode, outside every store mutex.
using QuantizeObserver = std::function<void(kernels::Codec, double seconds)>;

class Store {
 public:
  static absl::StatusOr<std::unique_ptr<Store>> Create(
      const StoreOptions& options, std::unique_ptr<Arena> arena);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Set before the store is shared between threads.
  void SetQuantizeObserver(QuantizeObserver observer);
  // Set before the store is shared between threads: BeginRead verifies
  // (and decodes) its blocks on the calling thread and on up to `helpers`
  // tasks of `executor` at once (base/parallel_for.h; the caller may itself
  // be one of its tasks), when the read holds at least `min_bytes` of
  // stored payload: below that a helper's wake-up costs about what the
  // checksums do. Without it, on the calling thread alone.
  void SetReadExecutor(Executor executor, int helpers,
                       uint64_t min_bytes = uint64_t{1} << 20);

  // INVALID_ARGUMENT: bad name, shape, codec policy or owner.
  // FAILED_PRECONDITION: the name exists with a different layout or policy.
  // RESOURCE_EXHAUSTED: max_namespaces reached, or the owner's quota of
  // namespaces. Registering an existing name again (same spec) answers it
  // with already_registered, whoever asks; its owner stays. With create
  // false a name that is not registered is NOT_FOUND (nothing is created).
  absl::StatusOr<NamespaceInfo> RegisterNamespace(NamespaceConfig config,
                                                  bool create = true);
  absl::StatusOr<NamespaceInfo> GetNamespace(const std::string& name) const;

  // Longest cached prefix of `keys`. With pin, the prefix is pinned under a
  // read lease (released by EndLease, a BeginRead that takes it over, or
  // its TTL).
  absl::StatusOr<LookupResult> Lookup(NamespaceName ns,
                                      absl::Span<const std::string> keys,
                                      bool pin, absl::Duration ttl,
                                      uint32_t holder = 0);

  // Reserves pages for every block not stored yet, evicting as needed.
  // RESOURCE_EXHAUSTED when the pool cannot hold them even after evicting
  // every block that eviction may take (nothing is evicted when even all
  // unpinned blocks would not make room).
  absl::StatusOr<BeginWriteResult> BeginWrite(NamespaceName ns,
                                              std::vector<BlockRef> blocks,
                                              absl::Duration ttl,
                                              uint32_t holder = 0);

  struct Payload {
    uint32_t index;
    absl::Span<const uint8_t> fp16;  // little-endian IEEE half
  };
  // Encodes and stores the payloads. All or nothing: on any error nothing of
  // this batch becomes visible and the write lease is released.
  absl::StatusOr<CommitResult> CommitWrite(uint64_t write_id,
                                           absl::Span<const Payload> payloads);
  // Releases an open write and its reserved pages. FAILED_PRECONDITION for
  // an unknown, expired, committed or aborted id (a stale lease). ABORTED
  // while a CommitWrite is using it (it then ends with that call) or while
  // blocks are being staged (StageBlock, ClaimInPlace): the write is stale
  // from then on (nothing more is staged or committed) and its pages go
  // back when the last staging ends.
  absl::Status AbortWrite(uint64_t write_id);

  // Encodes block `index` of an open write into its reserved pages now, so
  // that a data plane can encode block i while block i+1 is in flight and
  // encode several blocks at once on different threads. The block stays
  // invisible until CommitWrite, which then needs no payload for it (and
  // refuses one). Calls for different blocks of one write may run
  // concurrently; while any runs, the lease cannot expire and CommitWrite
  // and AbortWrite answer FAILED_PRECONDITION. INVALID_ARGUMENT: index out of
  // range, block present or staged already, wrong size, non-finite values
  // (then the block is not staged and may be sent again).
  absl::Status StageBlock(uint64_t write_id, uint32_t index,
                          absl::Span<const uint8_t> fp16);

  // StageBlock without the copy, for a transport that can receive block
  // `index` of open write `write_id` where it will be stored: when the
  // block is stored as its fp16 bytes (codec none, or a namespace's KIVI
  // residual window) in one run of a host arena's pages
  // (BeginWriteResult::in_place), the span of the arena those bytes go to.
  // The block is claimed as StageBlock claims it (the lease cannot expire,
  // commit or be dropped, and an abort waits) until FinishInPlace, which
  // the caller must call exactly once (store::InPlaceClaim does).
  // FAILED_PRECONDITION for a stale or committing lease or a block that
  // cannot be received in place; INVALID_ARGUMENT as StageBlock.
  absl::StatusOr<absl::Span<uint8_t>> ClaimInPlace(uint64_t write_id,
                                                   uint32_t index);
  // Ends a ClaimInPlace. With `landed` the span holds the block's fp16
  // bytes: they are checked as StageBlock checks a payload (INVALID_ARGUMENT
  // for rejected values), checksummed and sealed, and the block is staged.
  // Without (the transfer failed), when the check fails, or when the write
  // was aborted meanwhile, the block is not staged (it may be sent again).
  absl::Status FinishInPlace(uint64_t write_id, uint32_t index, bool landed);

  // Pins the blocks of `keys`, verifies and copies them out in
  // options.format. A nonzero options.pin_lease_id must name a live read
  // lease of the same namespace (else FAILED_PRECONDITION), which ends once
  // the blocks are pinned.
  // With keep_lease == false the pins are released before returning and
  // lease_id is 0; with keep_lease they stay under a new read lease of
  // options.ttl. Without allow_missing every key must be stored (NOT_FOUND
  // names the first missing one) and verify (DATA_LOSS drops the block and
  // fails the read). With allow_missing the read returns the blocks that are
  // stored and verify, and lists the others in ReadResult::missing (a block
  // that fails verification is dropped and counted as data loss all the
  // same); a lease is kept even when no block was read.
  // in_place (with keep_lease, on a host arena): a block whose answer is its
  // stored bytes (a raw read, or an fp16 block read as fp16) is verified
  // where it lies and returned as spans of the arena instead of a copy;
  // the others are copied (decoded) as usual. The caller must not use the
  // spans after EndLease or the lease's TTL. With caller_verifies as well,
  // such a block's payload is not checksummed here (see ReadOptions).
  absl::StatusOr<ReadResult> BeginRead(NamespaceName ns,
                                       absl::Span<const std::string> keys,
                                       const ReadOptions& options);
  // Ends a read lease or a Lookup pin. FAILED_PRECONDITION for an unknown or
  // expired id (a stale lease, BRIEF section 5).
  absl::Status EndLease(uint64_t lease_id);
  // Hands a read lease to a holder that bounds its life itself (a data-plane
  // transfer sending from the pinned pages): the lease no longer expires by
  // its TTL and ends only by EndLease. FAILED_PRECONDITION for an unknown or
  // expired id.
  absl::Status HoldReadLease(uint64_t lease_id);
  // Block `block` (its index in ReadResult::blocks) of held read lease
  // `lease_id` failed its caller's check (ReadOptions::caller_verifies): it
  // is dropped and counted as data loss, as BeginRead drops a corrupt block;
  // the lease keeps its pin until it ends. FAILED_PRECONDITION for an
  // unknown lease, INVALID_ARGUMENT for an index outside it.
  absl::Status DropCorruptReadBlock(uint64_t lease_id, size_t block);

  absl::StatusOr<uint32_t> Delete(NamespaceName ns,
                                  absl::Span<const std::string> keys);

  // OK when `lease_id` names an open read lease (read) or write lease (not
  // read) of `holder`; otherwise FAILED_PRECONDITION with kStaleReadLease
  // or kStaleWriteLease, the answer to an unknown id.
  absl::Status CheckLeaseHolder(uint64_t lease_id, bool read,
                                uint32_t holder) const;

  // Removes namespace `name`: its blocks leave the index and the
  // accounting at once (a pinned block's pages go back at its last unpin),
  // its read leases and idle write leases end (a read lease held by a
  // transfer, HoldReadLease, ends with the transfer; a write being
  // committed or staged stores nothing), its name is free for a new
  // registration at once and its slot once nothing refers to it. NOT_FOUND
  // when it is not registered; FAILED_PRECONDITION (nothing dropped) when
  // `name` states a fingerprint it does not have.
  absl::StatusOr<DropResult> DropNamespace(NamespaceName name);

  // Sets (or, with a zero quota, clears) owner's limits; takes effect on
  // the next registration, reservation or eviction. INVALID_ARGUMENT for
  // owner >= kMaxOwners.
  absl::Status SetOwnerQuota(uint16_t owner, const OwnerQuota& quota);
  OwnerUsage Usage(uint16_t owner) const;

  StoreStats Stats() const;

  // Whether a read with ReadOptions::in_place (and keep_lease) of `format`
  // from namespace `ns` answers every block in place, copying none: on a
  // host arena, a raw read, or any read of a codec-none namespace (whose
  // fp16 answer is its stored bytes). A data plane reserves staging for
  // the copies it will hold by this. With `decode_later`
  // (ReadOptions::decode_later), an fp16 read of an encoded namespace too.
  bool ReadsInPlace(const NamespaceInfo& ns, ReadFormat format,
                    bool decode_later = false) const;

  // Ends every lease whose deadline is before `now`; returns how many.
  int ExpireLeases(absl::Time now);

  // Background work, called periodically: expires leases, evicts down to the
  // low watermark when above the high one, and re-encodes blocks that left
  // KIVI's residual window. Returns the number of blocks re-encoded.
  int RunMaintenance(absl::Time now);

  // Test hook: flips one byte of a stored block's payload (the one at
  // payload_offset) or of its header in place, to show that reads detect
  // corruption. NOT_FOUND when the block is absent.
  absl::Status CorruptBlockForTest(const std::string& ns,
                                   const std::string& key, bool header = false,
                                   uint64_t payload_offset = 0);

 private:
  struct Namespace;
  struct Entry;
  struct Shard;
  struct ReadLease;
  struct WriteLease;
  class NamespaceRef;
  struct OwnerAccount;
  // Which blocks an eviction may take (see "Owners").
  enum class Victims { kOwn, kOverShare, kNoShare };
  struct ReencodeJob {
    uint16_t ns_id;
    std::string key;
    uint64_t serial;
  };
  // Identifies a block by (namespace, key) without building a string.
  struct KeyRef {
    uint16_t ns_id;
    absl::string_view key;
    uint64_t hash;
  };

  Store(const StoreOptions& options, std::unique_ptr<Arena> arena);

  // The namespace `config` describes, validated (RegisterNamespace's
  // INVALID_ARGUMENT cases), not in the table yet.
  absl::StatusOr<std::unique_ptr<Namespace>> MakeNamespace(
      NamespaceConfig config) const;
  // A live namespace by name, referenced (its slot stays while the
  // reference lives). NOT_FOUND when none; FAILED_PRECONDITION when its
  // fingerprint is not the one `name` states (see NamespaceName).
  absl::StatusOr<NamespaceRef> FindNamespace(NamespaceName name) const;
  // FAILED_PRECONDITION when `name` states a fingerprint `ns` does not have.
  static absl::Status CheckFingerprint(const Namespace& ns,
                                       const NamespaceName& name);
  // A live namespace by slot (null when the slot is empty or dropped).
  NamespaceRef RefById(uint16_t id) const;
  // The namespace in slot `id`. Only for a caller that holds a reference
  // to it, or a block of it in the index (the slot is not reused then).
  Namespace* NamespaceById(uint16_t id) const;
  static KeyRef MakeKeyRef(uint16_t ns_id, absl::string_view key);
  Shard& ShardOf(const KeyRef& ref) const;

  // Shard-level helpers; each requires the shard's mutex. (Annotated where
  // they are defined, in store.cc: Shard is complete only there.)
  Entry* Find(Shard& shard, const KeyRef& ref);
  void Touch(Entry* entry);
  void UpdateEvictable(Shard& shard, Entry* entry);
  void Pin(Shard& shard, Entry* entry);
  // Hides a block: out of the index and the accounting. Its pages go back
  // now, or at the last unpin; its entry lives on while it has pins or
  // cached children. Returns the parent whose child count the caller must
  // drop (UnlinkParent) after releasing the shard mutex.
  Entry* RemoveEntry(Shard& shard, Entry* entry);
  // Drops one pin; at the last one a removed block's pages go back.
  void Unpin(Shard& shard, Entry* entry);
  // Returns a removed entry to its shard's slab once no pin and no cached
  // child refers to it.
  void MaybeFree(Shard& shard, Entry* entry);

  // Drops one cached child from `parent` (a removed parent has already
  // dropped its own link, so nothing cascades). Takes its shard's mutex.
  void UnlinkParent(Entry* parent);
  // Counts a block that failed verification as data loss and takes it out
  // of the index, if `entry` is still the block of `serial`; a caller's pin
  // stays (its pages are freed at the last unpin). Takes the shard mutex.
  void DropCorrupt(Entry* entry, uint64_t serial);
  void UnpinAll(const std::vector<Entry*>& entries);
  // BeginRead's first step: pins the stored blocks of `keys` (entries, at
  // `positions` in keys) and lists the absent ones in `missing`; without
  // allow_missing an absent key unpins them all and answers NOT_FOUND.
  absl::Status PinForRead(const Namespace& ns,
                          absl::Span<const std::string> keys,
                          bool allow_missing, std::vector<Entry*>* entries,
                          std::vector<uint32_t>* positions,
                          std::vector<uint32_t>* missing);
  // The one rule for serving a block in place (ReadsInPlace and
  // ReadPinnedBlock both apply it, so staging reserved by the first covers
  // what the second copies): a host arena, and stored bytes that are the
  // answer as they lie, a raw read or a block stored with codec none; or
  // an fp16 read whose caller decodes (ReadOptions::decode_later).
  bool InPlace(kernels::Codec stored, ReadFormat format,
               bool decode_later) const;
  // Reads one pinned block into `block` (whose key is set) as `options`
  // asks, with `stored` as scratch. An error answers a failed copy or
  // decode; *verified is the verification's outcome (nothing is decoded
  // when it fails).
  absl::Status ReadPinnedBlock(const Namespace& ns, const Entry& entry,
                               const ReadOptions& options,
                               std::vector<uint8_t>* stored, ReadBlock* block,
                               absl::Status* verified);
  // BeginRead's check of a pin it is to take over (options.pin_lease_id):
  // FAILED_PRECONDITION unless it is a live, unheld pin of the caller's in
  // `ns`. Takes lease_mu_.
  absl::Status CheckPinTakeover(const Namespace& ns, const ReadOptions& options)
      ABSL_LOCKS_EXCLUDED(lease_mu_);
  // BeginRead's second step: reads the pinned `entries` (of keys at
  // `positions`) into result->blocks in key order. A corrupt block is
  // dropped from the index and, with allow_missing, unpinned, taken out of
  // `entries` and listed in result->missing; otherwise it is DATA_LOSS. The
  // first error ends the read; `entries` then still holds every pin.
  absl::Status ReadPinnedBlocks(const Namespace& ns,
                                absl::Span<const std::string> keys,
                                const ReadOptions& options,
                                absl::Span<const uint32_t> positions,
                                std::vector<Entry*>* entries,
                                ReadResult* result);
  // Evicts the least recently used evictable block among `victims` (kOwn:
  // `owner`'s); false when none.
  bool EvictOne(std::atomic<uint64_t>* counter, Victims victims,
                uint16_t owner);
  // Evicts for a reservation of `count` pages by `owner` (see "Owners");
  // false when nothing may go.
  bool EvictFor(uint16_t owner, uint32_t count, std::atomic<uint64_t>* counter);
  // Pages for `owner` (counted in its reserved pages), evicting as needed.
  // RESOURCE_EXHAUSTED when they cannot be had.
  absl::Status ReservePages(uint16_t owner, uint32_t count, PageList* pages);
  void ReleasePages(const PageList& pages);
  // unless_held: a lease a transfer holds (HoldReadLease) stays.
  void ReleaseReadLease(uint64_t id, bool unless_held = false);
  // Returns true when it released the lease. With if_idle, a lease that a
  // commit or a staging (StageBlock, ClaimInPlace) is using is left alone.
  bool ReleaseWriteLease(uint64_t id, bool if_idle = false);
  // Returns the pages of a write lease already taken out of the table.
  void FreeWriteLease(const WriteLease& lease);
  // The live (not aborted) write lease `write_id`, or null.
  WriteLease* LiveWriteLeaseLocked(uint64_t write_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_mu_);
  // Claims block `index` of a live write for staging (StageBlock's checks).
  absl::StatusOr<WriteLease*> ClaimBlockLocked(uint64_t write_id,
                                               uint32_t index)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_mu_);
  // Ends a claim of ClaimBlockLocked; releases an aborted lease at its last.
  void EndStaging(uint64_t write_id, WriteLease* lease, uint32_t index,
                  bool staged);
  // Where a block of `ns` on `pages` can be received in place (see
  // ClaimInPlace): the arena offset of its payload, or nullopt.
  std::optional<uint64_t> InPlaceOffset(const Namespace& ns,
                                        const PageList& pages) const;
  // Writes header and layer checksums of `payload`, a block of `ns` as new
  // blocks are stored, into `pages` (the payload's bytes are not copied).
  absl::Status SealPayload(const Namespace& ns, absl::string_view key,
                           absl::Span<const uint8_t> payload,
                           const PageList& pages);
  // Checks the fp16 block received into its pages, then SealPayload.
  absl::Status SealInPlace(const Namespace& ns, absl::string_view key,
                           absl::Span<const uint8_t> fp16,
                           const PageList& pages);
  // Encodes one fp16 block as its namespace stores new blocks and writes
  // header, layer checksums and payload into `pages`, which the caller owns.
  absl::Status EncodeToPages(const Namespace& ns, absl::string_view key,
                             absl::Span<const uint8_t> fp16,
                             const PageList& pages);
  uint64_t NewLeaseId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_mu_);
  absl::Time LeaseDeadline(absl::Duration ttl) const;
  void AccountAdd(const Entry& entry, int sign);
  void QueueWindowExit(const Namespace& ns, Entry* newest);
  bool Reencode(const ReencodeJob& job);
  absl::Status WriteHeader(uint32_t first_page, const BlockHeader& header);
  // A block's layer checksums live in the header slots of its pages after
  // the first (9 to a slot), which no header uses; a block of too few pages
  // for them has none (a reader then checksums it whole). The header's
  // payload checksum is their digest, so a reader trusts them only once it
  // matches. The slots holding `count` sums of `pages`; empty if too few.
  std::vector<uint32_t> LayerSumSlots(const PageList& pages,
                                      size_t count) const;
  // The header, and on a host arena the layer checksums where the pages
  // have slots for them.
  absl::Status WriteBlockMetadata(const PageList& pages,
                                  const BlockHeader& header,
                                  absl::Span<const uint64_t> layer_sums);
  // False where the block has no slots for them (or the arena fails).
  bool ReadLayerSums(const PageList& pages, size_t count,
                     std::vector<uint64_t>* sums) const;
  absl::Status ReadHeader(uint32_t first_page, BlockHeader* header) const;

  const StoreOptions options_;
  const std::unique_ptr<Arena> arena_;
  const uint64_t header_slab_bytes_;
  QuantizeObserver quantize_observer_;
  Executor read_executor_;
  int read_helpers_ = 0;
  uint64_t read_parallel_bytes_ = 0;

  mutable Mutex ns_mu_;
  // max_namespaces slots. A slot is written under ns_mu_ before any block
  // of it exists, and again only once its namespace is dropped and no
  // NamespaceRef to it is left (so a reader holding a reference, or one of
  // its blocks in the index, sees it unchanged).
  std::unique_ptr<std::unique_ptr<Namespace>[]> namespaces_;
  uint32_t slots_used_ ABSL_GUARDED_BY(ns_mu_) = 0;  // high-water mark

  // kMaxOwners accounts; owners [0, owner_limit_) may hold blocks.
  std::unique_ptr<OwnerAccount[]> owners_;
  std::atomic<uint32_t> owner_limit_{1};

  // Allocation takes the pool's own mutex; copies run lock-free on pages
  // their caller owns.
  PagePool pool_;

  std::unique_ptr<Shard[]> shards_;

  mutable Mutex lease_mu_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<ReadLease>> read_leases_
      ABSL_GUARDED_BY(lease_mu_);
  absl::flat_hash_map<uint64_t, std::unique_ptr<WriteLease>> write_leases_
      ABSL_GUARDED_BY(lease_mu_);
  absl::BitGen rng_ ABSL_GUARDED_BY(lease_mu_);

  mutable Mutex reencode_mu_;
  std::deque<ReencodeJob> reencode_queue_ ABSL_GUARDED_BY(reencode_mu_);
  // Jobs taken off the queue and not finished yet.
  uint32_t reencodes_running_ ABSL_GUARDED_BY(reencode_mu_) = 0;

  std::atomic<uint64_t> tick_{0};
  std::atomic<uint64_t> serial_{0};
  struct AtomicCodecStats {
    std::atomic<uint64_t> blocks{0}, tokens{0}, stored_bytes{0},
        logical_bytes{0};
  };
  std::array<AtomicCodecStats, kNumCodecs> per_codec_;
  std::atomic<uint64_t> used_pages_{0}, used_payload_bytes_{0},
      reserved_pages_{0}, pinned_pages_{0};
  std::atomic<uint64_t> evictions_capacity_{0}, evictions_watermark_{0},
      evictions_data_loss_{0}, deleted_{0}, data_loss_events_{0},
      lookup_hits_{0}, lookup_misses_{0}, expired_leases_{0},
      reencoded_blocks_{0};
};

}  // namespace kvcache::store

#endif  // KVCACHE_STORE_STORE_H_
