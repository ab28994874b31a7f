#include "store/store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/echo.h"
// XXH3_state_t on the stack (its layout is that of the installed header).
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"
// Runtime-dispatched XXH3 (AVX2/AVX-512 where present; same output): about
// twice the SSE2 baseline the shared library is built for.
#if defined(__x86_64__)
#include "xxh_x86dispatch.h"
#endif

namespace kvcache::store {

using kernels::Codec;

namespace {

bool IsKivi(Codec c) { return c == Codec::kKivi2 || c == Codec::kKivi4; }
size_t CodecIndex(Codec c) { return static_cast<size_t>(c); }

enum EntryFlags : uint8_t {
  kEvictable = 1,  // in its shard's LRU order
  kRemoved = 2,    // out of the index; kept while pinned or with children
  kResidual = 4,   // fp16 in KIVI's residual window
};

constexpr size_t kSlabChunk = 256;
static_assert((kNumShards & (kNumShards - 1)) == 0 && kNumShards <= 256,
              "shards are picked by the top bits of the key hash");
constexpr int kShardShift = 64 - 4;
static_assert(kNumShards == 16, "kShardShift assumes 16 shards");

}  // namespace

struct Store::Namespace {
  uint16_t id = 0;
  NamespaceInfo info;
  // Set once, under ns_mu_, by DropNamespace; a dropped namespace is not
  // found by name and takes no new blocks.
  std::atomic<bool> dropped{false};
  // NamespaceRefs alive; the slot of a dropped namespace is reused at 0.
  std::atomic<int64_t> refs{0};
  kernels::CodecPolicy residual_policy;  // codec none: KIVI's fp16 window
  uint32_t window_blocks = 0;            // 0: no residual window
  uint32_t pages_per_block = 0;          // encoded with the namespace codec
  uint32_t pages_per_residual_block = 0;
  // Where each checksummed layer ends (ChecksumLayerEnds), encoded with the
  // namespace codec and stored fp16 (the residual window).
  std::vector<uint64_t> layer_ends;
  std::vector<uint64_t> residual_layer_ends;
  std::atomic<uint64_t> blocks{0};
  std::atomic<uint64_t> residual_blocks{0};
  std::atomic<uint64_t> stored_pages{0};

  Codec codec() const { return info.config.policy.codec; }
  uint16_t owner() const { return info.config.owner; }
};

// A counted reference to a namespace. Taking the first one requires
// ns_mu_ (FindNamespace, RefById); copying requires only the one copied.
class Store::NamespaceRef {
 public:
  NamespaceRef() = default;
  explicit NamespaceRef(Namespace* ns) : ns_(ns) { Acquire(); }
  NamespaceRef(const NamespaceRef& other) : ns_(other.ns_) { Acquire(); }
  NamespaceRef(NamespaceRef&& other) noexcept : ns_(other.ns_) {
    other.ns_ = nullptr;
  }
  NamespaceRef& operator=(NamespaceRef other) noexcept {
    std::swap(ns_, other.ns_);
    return *this;
  }
  ~NamespaceRef() {
    if (ns_ != nullptr) ns_->refs.fetch_sub(1, std::memory_order_acq_rel);
  }
  Namespace* get() const { return ns_; }
  Namespace* operator->() const { return ns_; }
  explicit operator bool() const { return ns_ != nullptr; }

 private:
  void Acquire() {
    if (ns_ != nullptr) ns_->refs.fetch_add(1, std::memory_order_relaxed);
  }
  Namespace* ns_ = nullptr;
};

// One owner's pages and limits (see "Owners" in store.h).
struct Store::OwnerAccount {
  std::atomic<uint64_t> used_pages{0};      // held by its stored blocks
  std::atomic<uint64_t> reserved_pages{0};  // reserved by its open writes
  std::atomic<uint64_t> share_pages{0};     // 0: no share
  std::atomic<uint32_t> max_namespaces{0};  // 0: no limit

  uint64_t pages() const { return used_pages + reserved_pages; }
  bool over_share() const {
    const uint64_t share = share_pages;
    return share > 0 && pages() > share;
  }
};

// One index record (88 bytes). Lives in its shard's slab; the slot of a
// freed entry is reused, never returned, so a stale pointer always points
// at some entry of the same shard and `serial` tells whether it is the one.
struct Store::Entry {
  Entry* parent = nullptr;  // counted in parent->children; free-list link
  uint64_t parent_serial = 0;
  uint64_t serial = 0;       // unique per stored block; 0 when free
  uint64_t last_access = 0;  // recency tick of the last hit
  uint64_t lru_tick = 0;     // the tick it is filed under in the LRU order
  PageList pages;
  uint32_t children = 0;
  uint32_t pins = 0;
  uint16_t ns_id = 0;
  uint8_t shard = 0;
  // Written under the shard's mutex, and read without it by a reader of a
  // pinned entry (kResidual does not change while pinned, but other bits
  // of the byte do: a delete or a drop marks it kRemoved): relaxed atomics
  // make those reads race-free (ThreadSanitizer found one under
  // StoreOwnerTest.DropsRacingWithWritesAndReadsKeepTheAccountingExact).
  std::atomic<uint8_t> flags{0};
  uint16_t owner = 0;  // its namespace's (fills what was padding)
  absl::InlinedVector<char, 16> key;

  bool is(EntryFlags f) const {
    return (flags.load(std::memory_order_relaxed) & f) != 0;
  }
  void set(EntryFlags f, bool on) {
    const uint8_t v = flags.load(std::memory_order_relaxed);
    flags.store(static_cast<uint8_t>(on ? (v | f) : (v & ~f)),
                std::memory_order_relaxed);
  }
  absl::string_view key_view() const { return {key.data(), key.size()}; }
};

namespace {

uint64_t HashKey(uint16_t ns_id, absl::string_view key) {
  return XXH3_64bits_withSeed(key.data(), key.size(), ns_id);
}

}  // namespace

struct Store::Shard {
  struct Hash {
    using is_transparent = void;
    size_t operator()(const Entry* e) const {
      return HashKey(e->ns_id, e->key_view());
    }
    size_t operator()(const KeyRef& r) const { return r.hash; }
  };
  struct Eq {
    using is_transparent = void;
    bool operator()(const Entry* a, const Entry* b) const {
      return a->ns_id == b->ns_id && a->key_view() == b->key_view();
    }
    bool operator()(const Entry* a, const KeyRef& b) const {
      return a->ns_id == b.ns_id && a->key_view() == b.key;
    }
    bool operator()(const KeyRef& a, const Entry* b) const {
      return (*this)(b, a);
    }
  };

  using Lru = absl::btree_set<std::pair<uint64_t, Entry*>>;

  Mutex mu;
  absl::flat_hash_set<Entry*, Hash, Eq> index ABSL_GUARDED_BY(mu);
  // Per owner, evictable entries by (lru_tick, entry); lru_tick may lag
  // last_access.
  std::array<Lru, kMaxOwners> lru ABSL_GUARDED_BY(mu);
  std::atomic<uint64_t> evictable_pages{0};
  std::vector<std::unique_ptr<Entry[]>> slab ABSL_GUARDED_BY(mu);
  Entry* free_entries ABSL_GUARDED_BY(mu) = nullptr;
  uint8_t id = 0;

  Entry* NewEntry() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (free_entries == nullptr) {
      slab.push_back(std::make_unique<Entry[]>(kSlabChunk));
      for (size_t i = 0; i < kSlabChunk; ++i) {
        slab.back()[i].parent = free_entries;
        free_entries = &slab.back()[i];
      }
    }
    Entry* e = free_entries;
    free_entries = e->parent;
    // Field by field: the key's buffer was already emptied by FreeEntry.
    e->parent = nullptr;
    e->parent_serial = e->serial = e->last_access = e->lru_tick = 0;
    e->pages = {};
    e->children = e->pins = 0;
    e->ns_id = 0;
    e->shard = id;
    e->flags.store(0, std::memory_order_relaxed);
    e->owner = 0;
    e->key.clear();
    return e;
  }
  void FreeEntry(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    e->key.clear();
    e->key.shrink_to_fit();
    e->serial = 0;
    e->flags.store(0, std::memory_order_relaxed);
    e->parent = free_entries;
    free_entries = e;
  }
  // Re-files stale heads of `lru` (one of this shard's) until the head's
  // tick is its true last access.
  void NormalizeLru(Lru& lru) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!lru.empty()) {
      auto head = lru.begin();
      Entry* e = head->second;
      if (e->last_access == head->first) return;
      lru.erase(head);
      e->lru_tick = e->last_access;
      lru.insert({e->lru_tick, e});
    }
  }
};

struct Store::ReadLease {
  NamespaceRef ns;     // keeps the namespace's slot
  uint16_t ns_id = 0;  // a BeginRead of another namespace refuses it
  uint32_t holder = 0;
  std::vector<Entry*> entries;  // each holds one pin of this lease
  absl::Time deadline;
  bool held = false;  // HoldReadLease: ends only by EndLease
};

// WriteLease::in_place_offset of a block not received in place.
constexpr uint64_t kNotInPlace = ~uint64_t{0};

struct Store::WriteLease {
  NamespaceRef ns;  // keeps the namespace's slot
  uint16_t ns_id = 0;
  uint16_t owner = 0;  // its reservation counts against this owner
  uint32_t holder = 0;
  std::vector<BlockRef> blocks;
  std::vector<bool> present;
  std::vector<PageList> pages;  // per block; count 0 if present
  // Per block: where in the host arena the block is stored as its fp16
  // bytes in one run (InPlaceOffset, found once by BeginWrite), or
  // kNotInPlace.
  std::vector<uint64_t> in_place_offset;
  // Per block: written into its pages by StageBlock (one byte each, so that
  // concurrent StageBlock calls on different blocks touch different bytes;
  // written under lease_mu_).
  std::vector<uint8_t> staged;
  absl::Time deadline;
  bool committing = false;
  // StageBlock calls and in-place claims running; the pages are in use.
  int staging = 0;
  // AbortWrite came while `staging` > 0: the lease is stale to every call
  // from then on, and the last staging to end releases it.
  bool aborted = false;
};

namespace {

absl::Status ValidateName(absl::string_view name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(
        "namespace name must be 1 to 128 characters");
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '.' || c == '_' || c == ':' ||
              c == '/' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("namespace name '", EchoForError(name),
                       "' may hold only [A-Za-z0-9._:/-]"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateKeys(absl::Span<const std::string> keys,
                          size_t max_blocks) {
  if (keys.empty()) return absl::InvalidArgumentError("no keys given");
  if (keys.size() > max_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        keys.size(), " keys in one request; the limit is ", max_blocks));
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("key ", i, " is empty"));
    }
    if (keys[i].size() > kMaxKeyBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("key ", i, " is ", keys[i].size(),
                       " bytes; keys are at most ", kMaxKeyBytes));
    }
  }
  return absl::OkStatus();
}

// A function of the spec alone, the same on every node and across
// versions: clients state it with every call (NamespaceName) and every
// block header binds it, so changing it makes every node refuse the calls
// of clients that registered before, until they register again.
uint64_t Fingerprint(const NamespaceConfig& c) {
  std::string s = absl::StrCat(
      c.name, "|", c.model, "|", c.revision, "|", c.tp_rank, "|",
      c.shape.num_layers, "|", c.shape.num_kv_heads, "|", c.shape.head_dim, "|",
      c.shape.tokens_per_block, "|",
      kernels::SourceDtypeName(c.shape.source_dtype), "|",
      static_cast<int>(c.policy.codec), "|",
      static_cast<int>(c.policy.scale_mode), "|", c.policy.kivi_group_size, "|",
      IsKivi(c.policy.codec) ? c.residual_tokens : 0, "|");
  for (uint32_t layer : c.policy.fp16_layers) absl::StrAppend(&s, layer, ",");
  s += "|";
  auto append_floats = [&s](const std::vector<float>& v) {
    s.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    s += "|";
  };
  append_floats(c.policy.static_k_scales);
  append_floats(c.policy.static_v_scales);
  return HashString(s);
}

// Bytes at the start of the arena that hold one BlockHeader per page.
uint64_t HeaderSlabBytes(uint64_t arena_bytes, uint32_t page_size) {
  uint64_t pages = arena_bytes / (page_size + sizeof(BlockHeader));
  return (pages * sizeof(BlockHeader) + 4095) / 4096 * 4096;
}

// The pool's bytes after the slab: no more pages than the slab has slots
// (the slab's rounding can leave room for a page more, whose slot would
// lie on page 0's bytes).
uint64_t PoolBytes(uint64_t arena_bytes, uint64_t slab_bytes,
                   uint32_t page_size) {
  const uint64_t slots = slab_bytes / sizeof(BlockHeader);
  return std::min(arena_bytes - slab_bytes, slots * page_size);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> Store::Create(
    const StoreOptions& options, std::unique_ptr<Arena> arena) {
  if (arena == nullptr) return absl::InvalidArgumentError("no arena");
  if (options.page_size < 4096 || options.page_size > (64u << 20) ||
      (options.page_size & (options.page_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page size ", options.page_size,
                     " must be a power of two between 4 KiB and 64 MiB"));
  }
  if (arena->size() < 2ull * options.page_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory of ", arena->size(), " bytes holds no page of ",
                     options.page_size, " bytes"));
  }
  if (!(options.low_watermark > 0 &&
        options.low_watermark <= options.high_watermark)) {
    return absl::InvalidArgumentError(
        "watermarks must satisfy 0 < low <= high");
  }
  if (options.max_namespaces == 0 || options.max_namespaces > kMaxNamespaces) {
    return absl::InvalidArgumentError(
        absl::StrCat("max namespaces must be 1 to ", kMaxNamespaces));
  }
  // The constructor is private: Create is the only way to build a Store.
  return std::unique_ptr<Store>(new Store(options, std::move(arena)));
}

Store::Store(const StoreOptions& options, std::unique_ptr<Arena> arena)
    : options_(options),
      arena_(std::move(arena)),
      header_slab_bytes_(HeaderSlabBytes(arena_->size(), options.page_size)),
      namespaces_(std::make_unique<std::unique_ptr<Namespace>[]>(
          options.max_namespaces)),
      owners_(std::make_unique<OwnerAccount[]>(kMaxOwners)),
      pool_(arena_.get(), header_slab_bytes_,
            PoolBytes(arena_->size(), header_slab_bytes_, options.page_size),
            options.page_size),
      shards_(std::make_unique<Shard[]>(kNumShards)) {
  // The memory per cached block that store.h states.
  static_assert(sizeof(Entry) == 88, "store.h: an index entry is 88 bytes");
  for (size_t s = 0; s < kNumShards; ++s) {
    shards_[s].id = static_cast<uint8_t>(s);
  }
}

Store::~Store() = default;

void Store::SetReadExecutor(Executor executor, int helpers,
                            uint64_t min_bytes) {
  read_executor_ = std::move(executor);
  read_helpers_ = helpers;
  read_parallel_bytes_ = min_bytes;
}

void Store::SetQuantizeObserver(QuantizeObserver observer) {
  quantize_observer_ = std::move(observer);
}

absl::Status Store::WriteHeader(uint32_t first_page,
                                const BlockHeader& header) {
  return arena_->Write(uint64_t{first_page} * sizeof(BlockHeader), &header,
                       sizeof(header));
}

std::vector<uint32_t> Store::LayerSumSlots(const PageList& pages,
                                           size_t count) const {
  // Slot i of the list's page i + 1 holds sums [9i, 9i + 9).
  constexpr size_t kPerSlot = sizeof(BlockHeader) / sizeof(uint64_t);
  const size_t slots = (count + kPerSlot - 1) / kPerSlot;
  if (slots + 1 > pages.count) return {};
  std::vector<uint32_t> ids;
  const uint64_t base = pool_.PageOffset(0);
  const uint32_t page = pool_.page_size();
  // ForEachRun only fails on a list shorter than the bytes asked for.
  pool_
      .ForEachRun(
          pages, (slots + 1) * uint64_t{page},
          [&](uint64_t offset, size_t, size_t n) {
            for (size_t i = 0; i < (n + page - 1) / page; ++i) {
              ids.push_back(static_cast<uint32_t>((offset - base) / page + i));
            }
            return absl::OkStatus();
          })
      .IgnoreError();
  if (ids.size() < slots + 1) return {};
  ids.erase(ids.begin());
  ids.resize(slots);
  return ids;
}

absl::Status Store::WriteBlockMetadata(const PageList& pages,
                                       const BlockHeader& header,
                                       absl::Span<const uint64_t> layer_sums) {
  absl::Status status = WriteHeader(pages.first, header);
  // Only blocks read in place (a host arena) are checked by layer.
  if (arena_->host_base() == nullptr) return status;
  constexpr size_t kPerSlot = sizeof(BlockHeader) / sizeof(uint64_t);
  const std::vector<uint32_t> slots = LayerSumSlots(pages, layer_sums.size());
  for (size_t i = 0; i < slots.size() && status.ok(); ++i) {
    const size_t n = std::min(kPerSlot, layer_sums.size() - i * kPerSlot);
    status =
        arena_->Write(uint64_t{slots[i]} * sizeof(BlockHeader),
                      layer_sums.data() + i * kPerSlot, n * sizeof(uint64_t));
  }
  return status;
}

bool Store::ReadLayerSums(const PageList& pages, size_t count,
                          std::vector<uint64_t>* sums) const {
  constexpr size_t kPerSlot = sizeof(BlockHeader) / sizeof(uint64_t);
  const std::vector<uint32_t> slots = LayerSumSlots(pages, count);
  if (slots.empty()) return false;
  sums->resize(count);
  for (size_t i = 0; i < slots.size(); ++i) {
    const size_t n = std::min(kPerSlot, count - i * kPerSlot);
    if (!arena_
             ->Read(uint64_t{slots[i]} * sizeof(BlockHeader),
                    sums->data() + i * kPerSlot, n * sizeof(uint64_t))
             .ok()) {
      return false;
    }
  }
  return true;
}

absl::Status Store::ReadHeader(uint32_t first_page, BlockHeader* header) const {
  return arena_->Read(uint64_t{first_page} * sizeof(BlockHeader), header,
                      sizeof(*header));
}

Store::KeyRef Store::MakeKeyRef(uint16_t ns_id, absl::string_view key) {
  return {ns_id, key, HashKey(ns_id, key)};
}

Store::Shard& Store::ShardOf(const KeyRef& ref) const {
  return shards_[ref.hash >> kShardShift];
}

// ---------------------------------------------------------------- namespaces

absl::StatusOr<std::unique_ptr<Store::Namespace>> Store::MakeNamespace(
    NamespaceConfig config) const {
  if (absl::Status s = ValidateName(config.name); !s.ok()) return s;
  if (config.owner >= kMaxOwners) {
    return absl::InvalidArgumentError(
        absl::StrCat("owner ", config.owner, " is not below ", kMaxOwners));
  }
  if (!config.codec_specified) config.policy.codec = options_.default_codec;
  if (absl::Status s = kernels::ValidatePolicy(config.shape, config.policy);
      !s.ok()) {
    return s;
  }
  if (!IsKivi(config.policy.codec)) config.residual_tokens = 0;
  NamespaceInfo info;
  info.fingerprint = Fingerprint(config);
  info.fp16_block_bytes = kernels::Fp16BlockBytes(config.shape);
  info.encoded_block_bytes =
      kernels::EncodedBlockBytes(config.shape, config.policy);
  info.config = std::move(config);
  auto ns = std::make_unique<Namespace>();
  ns->info = info;
  const uint32_t tokens = info.config.shape.tokens_per_block;
  ns->window_blocks = (info.config.residual_tokens + tokens - 1) / tokens;
  ns->residual_policy.codec = Codec::kNone;
  ns->pages_per_block = pool_.PagesFor(info.encoded_block_bytes);
  ns->pages_per_residual_block = pool_.PagesFor(info.fp16_block_bytes);
  ns->layer_ends = ChecksumLayerEnds(info.config.shape, info.config.policy,
                                     info.encoded_block_bytes);
  ns->residual_layer_ends = ChecksumLayerEnds(
      info.config.shape, ns->residual_policy, info.fp16_block_bytes);
  uint32_t largest = ns->window_blocks > 0 ? ns->pages_per_residual_block
                                           : ns->pages_per_block;
  if (largest > pool_.num_pages()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "one block of this layout (", largest, " pages of ", pool_.page_size(),
        " bytes) is larger than the whole pool"));
  }
  return ns;
}

absl::StatusOr<NamespaceInfo> Store::RegisterNamespace(NamespaceConfig config,
                                                       bool create) {
  absl::StatusOr<std::unique_ptr<Namespace>> made =
      MakeNamespace(std::move(config));
  if (!made.ok()) return made.status();
  std::unique_ptr<Namespace> ns = *std::move(made);
  NamespaceInfo info = ns->info;

  MutexLock lock(&ns_mu_);
  size_t live = 0, owned = 0;
  uint32_t free_slot = slots_used_;
  for (uint32_t i = 0; i < slots_used_; ++i) {
    const Namespace* other = namespaces_[i].get();
    if (other->dropped) {
      if (free_slot == slots_used_ && other->refs.load() == 0) free_slot = i;
      continue;
    }
    ++live;
    if (other->owner() == info.config.owner) ++owned;
    if (other->info.config.name != info.config.name) continue;
    if (other->info.fingerprint != info.fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "namespace '", info.config.name,
          "' is registered with a different model, layout or codec policy"));
    }
    NamespaceInfo existing = other->info;
    existing.already_registered = true;
    return existing;
  }
  if (!create) {
    return absl::NotFoundError(
        absl::StrCat("namespace '", info.config.name, "' is not registered"));
  }
  if (live >= options_.max_namespaces || free_slot >= options_.max_namespaces) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the node holds its limit of ", options_.max_namespaces,
                     " namespaces"));
  }
  const uint32_t quota = owners_[info.config.owner].max_namespaces;
  if (quota > 0 && owned >= quota) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the tenant holds its limit of ", quota, " namespaces"));
  }
  ns->id = static_cast<uint16_t>(free_slot);
  info.config.owner = ns->owner();
  // The slot is free: dropped and unreferenced, so nothing reads it.
  namespaces_[free_slot] = std::move(ns);
  if (free_slot == slots_used_) ++slots_used_;
  uint32_t limit = owner_limit_.load();
  while (limit <= info.config.owner &&
         !owner_limit_.compare_exchange_weak(limit, info.config.owner + 1u)) {
  }
  return info;
}

absl::StatusOr<NamespaceInfo> Store::GetNamespace(
    const std::string& name) const {
  absl::StatusOr<NamespaceRef> ns = FindNamespace(name);
  if (!ns.ok()) return ns.status();
  return (*ns)->info;
}

absl::Status Store::CheckFingerprint(const Namespace& ns,
                                     const NamespaceName& name) {
  if (name.fingerprint == 0 || name.fingerprint == ns.info.fingerprint) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "namespace '", EchoForError(name.name),
      "' is registered here with another spec (fingerprint ",
      absl::Hex(ns.info.fingerprint), ", the caller's ",
      absl::Hex(name.fingerprint),
      "): it was registered again since the caller registered it"));
}

absl::StatusOr<Store::NamespaceRef> Store::FindNamespace(
    NamespaceName name) const {
  MutexLock lock(&ns_mu_);
  for (uint32_t i = 0; i < slots_used_; ++i) {
    Namespace* ns = namespaces_[i].get();
    if (ns->dropped || ns->info.config.name != name.name) continue;
    if (absl::Status s = CheckFingerprint(*ns, name); !s.ok()) return s;
    return NamespaceRef(ns);
  }
  return absl::NotFoundError(absl::StrCat(
      "namespace '", EchoForError(name.name), "' is not registered"));
}

Store::NamespaceRef Store::RefById(uint16_t id) const {
  MutexLock lock(&ns_mu_);
  if (id >= slots_used_ || namespaces_[id]->dropped) return NamespaceRef();
  return NamespaceRef(namespaces_[id].get());
}

Store::Namespace* Store::NamespaceById(uint16_t id) const {
  // The slot is not rewritten while the caller's reference or block lives
  // (see namespaces_); the mutexes that handed those over order its write.
  return namespaces_[id].get();
}

absl::Status Store::SetOwnerQuota(uint16_t owner, const OwnerQuota& quota) {
  if (owner >= kMaxOwners) {
    return absl::InvalidArgumentError(
        absl::StrCat("owner ", owner, " is not below ", kMaxOwners));
  }
  const uint64_t page = options_.page_size;
  owners_[owner].share_pages = (quota.pool_bytes + page - 1) / page;
  owners_[owner].max_namespaces = quota.max_namespaces;
  return absl::OkStatus();
}

OwnerUsage Store::Usage(uint16_t owner) const {
  OwnerUsage usage;
  if (owner >= kMaxOwners) return usage;
  usage.pool_bytes = owners_[owner].pages() * options_.page_size;
  MutexLock lock(&ns_mu_);
  for (uint32_t i = 0; i < slots_used_; ++i) {
    const Namespace& ns = *namespaces_[i];
    if (!ns.dropped && ns.owner() == owner) ++usage.namespaces;
  }
  return usage;
}

// ------------------------------------------------------------ shard helpers

// Each requires the shard's mutex (declared in store.h, where Shard is
// incomplete, so the requirement is stated on these definitions; every
// caller comes after them).
Store::Entry* Store::Find(Shard& shard, const KeyRef& ref)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  auto it = shard.index.find(ref);
  return it == shard.index.end() ? nullptr : *it;
}

void Store::Touch(Entry* entry) { entry->last_access = ++tick_; }

void Store::UpdateEvictable(Shard& shard, Entry* entry)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  bool should =
      !entry->is(kRemoved) && entry->pins == 0 && entry->children == 0;
  if (should == entry->is(kEvictable)) return;
  if (should) {
    entry->lru_tick = entry->last_access;
    shard.lru[entry->owner].insert({entry->lru_tick, entry});
    shard.evictable_pages += entry->pages.count;
  } else {
    shard.lru[entry->owner].erase({entry->lru_tick, entry});
    shard.evictable_pages -= entry->pages.count;
  }
  entry->set(kEvictable, should);
}

void Store::Pin(Shard& shard, Entry* entry)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  if (entry->pins++ == 0) pinned_pages_ += entry->pages.count;
  UpdateEvictable(shard, entry);
}

void Store::AccountAdd(const Entry& entry, int sign) {
  auto add = [sign](std::atomic<uint64_t>& a, uint64_t v) {
    if (sign > 0) {
      a += v;
    } else {
      a -= v;
    }
  };
  Namespace* ns = NamespaceById(entry.ns_id);
  const bool residual = entry.is(kResidual);
  const Codec codec = residual ? Codec::kNone : ns->codec();
  AtomicCodecStats& cs = per_codec_[CodecIndex(codec)];
  add(cs.blocks, 1);
  add(cs.tokens, ns->info.config.shape.tokens_per_block);
  add(cs.stored_bytes, uint64_t{entry.pages.count} * options_.page_size);
  add(cs.logical_bytes, ns->info.fp16_block_bytes);
  add(used_pages_, entry.pages.count);
  add(owners_[entry.owner].used_pages, entry.pages.count);
  add(used_payload_bytes_,
      residual ? ns->info.fp16_block_bytes : ns->info.encoded_block_bytes);
  add(ns->blocks, 1);
  add(ns->stored_pages, entry.pages.count);
  if (residual) add(ns->residual_blocks, 1);
}

void Store::MaybeFree(Shard& shard, Entry* entry)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  if (entry->is(kRemoved) && entry->pins == 0 && entry->children == 0) {
    shard.FreeEntry(entry);
  }
}

Store::Entry* Store::RemoveEntry(Shard& shard, Entry* entry)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  if (entry->is(kEvictable)) {
    shard.lru[entry->owner].erase({entry->lru_tick, entry});
    shard.evictable_pages -= entry->pages.count;
    entry->set(kEvictable, false);
  }
  AccountAdd(*entry, -1);
  shard.index.erase(entry);
  entry->set(kRemoved, true);
  Entry* parent = entry->parent;
  entry->parent = nullptr;
  if (entry->pins == 0) {
    ReleasePages(entry->pages);
    entry->pages = {};
  }
  MaybeFree(shard, entry);
  return parent;
}

void Store::Unpin(Shard& shard, Entry* entry)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu) {
  if (--entry->pins > 0) return;
  pinned_pages_ -= entry->pages.count;
  if (entry->is(kRemoved)) {
    ReleasePages(entry->pages);
    entry->pages = {};
    MaybeFree(shard, entry);
  } else {
    UpdateEvictable(shard, entry);
  }
}

void Store::UnlinkParent(Entry* parent) {
  if (parent == nullptr) return;
  Shard& shard = shards_[parent->shard];
  MutexLock lock(&shard.mu);
  // The child's count keeps the parent's entry alive until this point.
  --parent->children;
  if (parent->is(kRemoved)) {
    MaybeFree(shard, parent);
  } else {
    UpdateEvictable(shard, parent);
  }
}

void Store::UnpinAll(const std::vector<Entry*>& entries) {
  for (Entry* entry : entries) {
    Shard& shard = shards_[entry->shard];
    MutexLock lock(&shard.mu);
    Unpin(shard, entry);
  }
}

// ------------------------------------------------------------- pages, evict

void Store::ReleasePages(const PageList& pages) {
  if (pages.count == 0) return;
  pool_.Release(pages);
}

bool Store::EvictOne(std::atomic<uint64_t>* counter, Victims victims,
                     uint16_t owner) {
  absl::InlinedVector<uint16_t, 8> owners;
  const uint32_t limit = owner_limit_;
  for (uint32_t o = 0; o < limit; ++o) {
    const OwnerAccount& account = owners_[o];
    const bool eligible = victims == Victims::kOwn ? o == owner
                          : victims == Victims::kOverShare
                              ? account.over_share()
                              : account.share_pages == 0;
    if (eligible) owners.push_back(static_cast<uint16_t>(o));
  }
  if (owners.empty()) return false;
  for (size_t attempt = 0; attempt < 2 * kNumShards; ++attempt) {
    size_t best = kNumShards;
    uint16_t best_owner = 0;
    uint64_t best_tick = std::numeric_limits<uint64_t>::max();
    for (size_t s = 0; s < kNumShards; ++s) {
      Shard& shard = shards_[s];
      MutexLock lock(&shard.mu);
      for (uint16_t o : owners) {
        Shard::Lru& lru = shard.lru[o];
        shard.NormalizeLru(lru);
        if (!lru.empty() && lru.begin()->first < best_tick) {
          best_tick = lru.begin()->first;
          best = s;
          best_owner = o;
        }
      }
    }
    if (best == kNumShards) return false;
    Entry* parent;
    {
      Shard& shard = shards_[best];
      MutexLock lock(&shard.mu);
      Shard::Lru& lru = shard.lru[best_owner];
      shard.NormalizeLru(lru);
      if (lru.empty()) continue;  // raced: look again
      parent = RemoveEntry(shard, lru.begin()->second);
    }
    UnlinkParent(parent);
    ++*counter;
    return true;
  }
  return false;
}

bool Store::EvictFor(uint16_t owner, uint32_t count,
                     std::atomic<uint64_t>* counter) {
  // An owner going over its share makes room from its own blocks alone;
  // otherwise owners over their share go first, then those without one.
  const OwnerAccount& account = owners_[owner];
  const uint64_t share = account.share_pages;
  if (share > 0 && account.pages() + count > share) {
    return EvictOne(counter, Victims::kOwn, owner);
  }
  return EvictOne(counter, Victims::kOverShare, owner) ||
         EvictOne(counter, Victims::kNoShare, owner);
}

absl::Status Store::ReservePages(uint16_t owner, uint32_t count,
                                 PageList* pages) {
  while (true) {
    uint32_t free_pages;
    if (pool_.Allocate(count, pages, &free_pages)) {
      owners_[owner].reserved_pages += count;
      return absl::OkStatus();
    }
    // Refuse before evicting anything when even every unpinned block could
    // not make room. (Only leaves are evictable, but evicting a leaf makes
    // its parent one, so every unpinned block without pinned descendants
    // can go.)
    uint64_t used = used_pages_.load(), pinned = pinned_pages_.load();
    uint64_t unpinned = used > pinned ? used - pinned : 0;
    if (free_pages + unpinned >= count &&
        EvictFor(owner, count, &evictions_capacity_)) {
      continue;
    }
    const OwnerAccount& account = owners_[owner];
    if (account.share_pages > 0 &&
        account.pages() + count > account.share_pages) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "pool full and this tenant is at its share (%u pages of %u "
          "bytes): none of its blocks can be evicted to make room; end its "
          "leases or delete its blocks",
          account.share_pages.load(), options_.page_size));
    }
    return absl::ResourceExhaustedError(
        "pool full: the rest is pinned, reserved by open leases or within "
        "other tenants' shares; retry after leases end");
  }
}

// ------------------------------------------------------------------- leases

uint64_t Store::NewLeaseId() {
  uint64_t id;
  do {
    id = absl::Uniform<uint64_t>(rng_);
  } while (id == 0 || read_leases_.contains(id) || write_leases_.contains(id));
  return id;
}

absl::Time Store::LeaseDeadline(absl::Duration ttl) const {
  if (ttl <= absl::ZeroDuration()) ttl = options_.default_lease_ttl;
  return absl::Now() + std::min(ttl, options_.max_lease_ttl);
}

void Store::ReleaseReadLease(uint64_t id, bool unless_held) {
  std::unique_ptr<ReadLease> lease;
  {
    MutexLock lock(&lease_mu_);
    auto it = read_leases_.find(id);
    if (it == read_leases_.end() || (unless_held && it->second->held)) return;
    lease = std::move(it->second);
    read_leases_.erase(it);
  }
  UnpinAll(lease->entries);
}

bool Store::ReleaseWriteLease(uint64_t id, bool if_idle) {
  std::unique_ptr<WriteLease> lease;
  {
    MutexLock lock(&lease_mu_);
    auto it = write_leases_.find(id);
    if (it == write_leases_.end()) return false;
    // Expiry leaves a lease alone while a commit or a staging uses it.
    if (if_idle && (it->second->committing || it->second->staging > 0)) {
      return false;
    }
    lease = std::move(it->second);
    write_leases_.erase(it);
  }
  FreeWriteLease(*lease);
  return true;
}

void Store::FreeWriteLease(const WriteLease& lease) {
  for (const PageList& pages : lease.pages) {
    ReleasePages(pages);
    reserved_pages_ -= pages.count;
    owners_[lease.owner].reserved_pages -= pages.count;
  }
}

int Store::ExpireLeases(absl::Time now) {
  std::vector<uint64_t> reads, writes;
  {
    MutexLock lock(&lease_mu_);
    for (const auto& [id, lease] : read_leases_) {
      if (lease->deadline < now && !lease->held) reads.push_back(id);
    }
    for (const auto& [id, lease] : write_leases_) {
      if (lease->deadline < now) writes.push_back(id);
    }
  }
  for (uint64_t id : reads) ReleaseReadLease(id);
  int expired = static_cast<int>(reads.size());
  for (uint64_t id : writes) expired += ReleaseWriteLease(id, /*if_idle=*/true);
  expired_leases_ += expired;
  return expired;
}

absl::Status Store::EndLease(uint64_t lease_id) {
  {
    MutexLock lock(&lease_mu_);
    if (!read_leases_.contains(lease_id)) {
      return absl::FailedPreconditionError(kStaleReadLease);
    }
  }
  ReleaseReadLease(lease_id);
  return absl::OkStatus();
}

absl::Status Store::HoldReadLease(uint64_t lease_id) {
  MutexLock lock(&lease_mu_);
  auto it = read_leases_.find(lease_id);
  if (it == read_leases_.end()) {
    return absl::FailedPreconditionError(kStaleReadLease);
  }
  it->second->held = true;
  return absl::OkStatus();
}

absl::Status Store::CheckLeaseHolder(uint64_t lease_id, bool read,
                                     uint32_t holder) const {
  MutexLock lock(&lease_mu_);
  if (read) {
    auto it = read_leases_.find(lease_id);
    if (it == read_leases_.end() || it->second->holder != holder) {
      return absl::FailedPreconditionError(kStaleReadLease);
    }
  } else {
    const WriteLease* lease = LiveWriteLeaseLocked(lease_id);
    if (lease == nullptr || lease->holder != holder) {
      return absl::FailedPreconditionError(kStaleWriteLease);
    }
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------- lookup

absl::StatusOr<LookupResult> Store::Lookup(NamespaceName ns_name,
                                           absl::Span<const std::string> keys,
                                           bool pin, absl::Duration ttl,
                                           uint32_t holder) {
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<NamespaceRef> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  std::vector<Entry*> found;
  found.reserve(keys.size());
  for (const std::string& key : keys) {
    KeyRef ref = MakeKeyRef((*ns)->id, key);
    Shard& shard = ShardOf(ref);
    MutexLock lock(&shard.mu);
    Entry* entry = Find(shard, ref);
    if (entry == nullptr) break;
    Touch(entry);
    if (pin) Pin(shard, entry);
    found.push_back(entry);
  }
  LookupResult result;
  result.prefix_blocks = static_cast<uint32_t>(found.size());
  lookup_hits_ += found.size();
  lookup_misses_ += keys.size() - found.size();
  if (pin && !found.empty()) {
    auto lease = std::make_unique<ReadLease>();
    lease->ns = *ns;
    lease->ns_id = (*ns)->id;
    lease->holder = holder;
    lease->deadline = LeaseDeadline(ttl);
    lease->entries = std::move(found);
    MutexLock lock(&lease_mu_);
    result.lease_id = NewLeaseId();
    read_leases_.emplace(result.lease_id, std::move(lease));
  }
  return result;
}

// -------------------------------------------------------------------- write

absl::StatusOr<BeginWriteResult> Store::BeginWrite(NamespaceName ns_name,
                                                   std::vector<BlockRef> blocks,
                                                   absl::Duration ttl,
                                                   uint32_t holder) {
  std::vector<std::string> keys;
  keys.reserve(blocks.size());
  for (const BlockRef& b : blocks) keys.push_back(b.key);
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  absl::flat_hash_set<absl::string_view> seen;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!seen.insert(blocks[i].key).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("key ", i, " appears twice in one write"));
    }
    if (blocks[i].parent_key.size() > kMaxKeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat("parent key of block ", i,
                                                     " is longer than ",
                                                     kMaxKeyBytes, " bytes"));
    }
    if (blocks[i].parent_key.empty() && i > 0) {
      blocks[i].parent_key = blocks[i - 1].key;
    }
  }
  absl::StatusOr<NamespaceRef> found_ns = FindNamespace(ns_name);
  if (!found_ns.ok()) return found_ns.status();
  Namespace* ns = found_ns->get();

  auto lease = std::make_unique<WriteLease>();
  lease->ns = *found_ns;
  lease->ns_id = ns->id;
  lease->owner = ns->owner();
  lease->holder = holder;
  lease->present.resize(blocks.size());
  lease->pages.resize(blocks.size());
  lease->staged.resize(blocks.size(), 0);
  uint32_t missing = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    KeyRef ref = MakeKeyRef(ns->id, blocks[i].key);
    Shard& shard = ShardOf(ref);
    MutexLock lock(&shard.mu);
    Entry* entry = Find(shard, ref);
    lease->present[i] = entry != nullptr;
    if (entry != nullptr) {
      Touch(entry);
    } else {
      ++missing;
    }
  }
  // Blocks of a namespace with a residual window arrive as fp16.
  const uint32_t per_block = ns->window_blocks > 0
                                 ? ns->pages_per_residual_block
                                 : ns->pages_per_block;
  const uint64_t needed = uint64_t{missing} * per_block;
  const uint32_t total_pages = pool_.num_pages();
  if (needed > total_pages) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%u blocks need %u pages; the whole pool has %u: split the write",
        missing, needed, total_pages));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (lease->present[i]) continue;
    if (absl::Status s = ReservePages(ns->owner(), per_block, &lease->pages[i]);
        !s.ok()) {
      for (const PageList& pages : lease->pages) {
        ReleasePages(pages);
        owners_[ns->owner()].reserved_pages -= pages.count;
      }
      return absl::ResourceExhaustedError(
          absl::StrFormat("%u pages needed: %s", needed, s.message()));
    }
  }
  reserved_pages_ += needed;
  lease->blocks = std::move(blocks);
  lease->deadline = LeaseDeadline(ttl);

  BeginWriteResult result;
  result.present = lease->present;
  result.in_place.resize(lease->present.size());
  lease->in_place_offset.resize(lease->present.size());
  for (size_t i = 0; i < lease->present.size(); ++i) {
    const std::optional<uint64_t> offset = InPlaceOffset(*ns, lease->pages[i]);
    lease->in_place_offset[i] = offset.value_or(kNotInPlace);
    result.in_place[i] = offset.has_value();
  }
  result.fp16_block_bytes = ns->info.fp16_block_bytes;
  result.deadline = lease->deadline;
  MutexLock lock(&lease_mu_);
  result.write_id = NewLeaseId();
  write_leases_.emplace(result.write_id, std::move(lease));
  return result;
}

absl::StatusOr<CommitResult> Store::CommitWrite(
    uint64_t write_id, absl::Span<const Payload> payloads) {
  WriteLease* lease = nullptr;
  {
    MutexLock lock(&lease_mu_);
    lease = LiveWriteLeaseLocked(write_id);
    if (lease == nullptr) {
      return absl::FailedPreconditionError(kStaleWriteLease);
    }
    if (lease->committing) {
      return absl::FailedPreconditionError(
          "this write lease is being committed by another call");
    }
    if (lease->staging > 0) {
      return absl::FailedPreconditionError(
          "blocks of this write are still being staged");
    }
    lease->committing = true;  // the reaper leaves it alone from now on
  }
  // From here the lease and its pages are ours alone: leases being committed
  // are never expired nor dropped, and the lease's reference keeps the
  // namespace.
  Namespace* ns = lease->ns.get();
  const NamespaceInfo& info = ns->info;
  auto fail = [&](absl::Status status) {
    ReleaseWriteLease(write_id);
    return status;
  };
  if (ns->dropped) {
    return fail(absl::FailedPreconditionError(
        "the write's namespace was dropped; nothing was stored"));
  }
  std::vector<const Payload*> by_block(lease->blocks.size(), nullptr);
  for (const Payload& p : payloads) {
    if (p.index >= lease->blocks.size()) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("payload index ", p.index, " is outside the write's ",
                       lease->blocks.size(), " blocks")));
    }
    if (lease->present[p.index]) continue;  // stored already: not needed
    if (lease->staged[p.index]) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("block ", p.index, " was staged already")));
    }
    if (by_block[p.index] != nullptr) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("two payloads for block ", p.index)));
    }
    if (p.fp16.size() != info.fp16_block_bytes) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("block ", p.index, " has ", p.fp16.size(),
                       " bytes; this layout's fp16 block is ",
                       info.fp16_block_bytes, " bytes")));
    }
    by_block[p.index] = &p;
  }
  for (size_t i = 0; i < by_block.size(); ++i) {
    if (!lease->present[i] && !lease->staged[i] && by_block[i] == nullptr) {
      return fail(
          absl::InvalidArgumentError(absl::StrCat("no payload for block ", i)));
    }
  }

  const bool residual = ns->window_blocks > 0;
  for (size_t i = 0; i < by_block.size(); ++i) {
    if (by_block[i] == nullptr) continue;
    absl::Status written = EncodeToPages(*ns, lease->blocks[i].key,
                                         by_block[i]->fp16, lease->pages[i]);
    if (!written.ok()) {
      return fail(absl::Status(
          written.code(), absl::StrCat("block ", i, ": ", written.message())));
    }
  }
  const uint64_t block_payload_bytes =
      residual ? info.fp16_block_bytes : info.encoded_block_bytes;

  CommitResult result;
  for (size_t i = 0; i < lease->blocks.size(); ++i) {
    if (lease->present[i]) {
      ++result.skipped;
      continue;
    }
    const BlockRef& block = lease->blocks[i];
    // Count this block in its cached parent first, so that the parent is
    // never evictable while the child is visible.
    Entry* parent = nullptr;
    uint64_t parent_serial = 0;
    if (!block.parent_key.empty() && block.parent_key != block.key) {
      KeyRef ref = MakeKeyRef(ns->id, block.parent_key);
      Shard& shard = ShardOf(ref);
      MutexLock lock(&shard.mu);
      parent = Find(shard, ref);
      if (parent != nullptr) {
        ++parent->children;
        UpdateEvictable(shard, parent);
        parent_serial = parent->serial;
      }
    }
    Entry* inserted = nullptr;
    {
      KeyRef ref = MakeKeyRef(ns->id, block.key);
      Shard& shard = ShardOf(ref);
      MutexLock lock(&shard.mu);
      // A drop that began after this commit did scans this shard after
      // this insert, or this check sees it.
      if (!ns->dropped && Find(shard, ref) == nullptr) {
        Entry* entry = shard.NewEntry();
        entry->ns_id = ns->id;
        entry->owner = ns->owner();
        entry->key.assign(block.key.begin(), block.key.end());
        entry->parent = parent;
        entry->parent_serial = parent_serial;
        entry->serial = ++serial_;
        entry->last_access = ++tick_;
        entry->pages = lease->pages[i];
        entry->set(kResidual, residual);
        lease->pages[i] = {};
        reserved_pages_ -= entry->pages.count;
        owners_[lease->owner].reserved_pages -= entry->pages.count;
        shard.index.insert(entry);
        AccountAdd(*entry, +1);
        UpdateEvictable(shard, entry);
        inserted = entry;
        result.stored_bytes += block_payload_bytes;
      }
    }
    if (inserted == nullptr) {
      ++result.skipped;  // committed by another writer meanwhile
      UnlinkParent(parent);
      continue;
    }
    ++result.stored;
    if (residual) QueueWindowExit(*ns, inserted);
  }
  ReleaseWriteLease(write_id);  // returns pages of blocks skipped above
  return result;
}

absl::Status Store::EncodeToPages(const Namespace& ns, absl::string_view key,
                                  absl::Span<const uint8_t> fp16,
                                  const PageList& pages) {
  // Per thread and reused: a fresh buffer per block would be fresh memory
  // per block, and the kernel zeroing it (a 2 MiB huge page per fault) cost
  // more than the encoding. Buffers above kKeptScratchBytes are not kept.
  constexpr size_t kKeptScratchBytes = size_t{32} << 20;
  static thread_local std::vector<uint8_t> scratch_buffer;
  std::vector<uint8_t>* scratch = &scratch_buffer;
  const bool residual = ns.window_blocks > 0;
  const NamespaceInfo& info = ns.info;
  const kernels::BlockShape& shape = info.config.shape;
  const kernels::CodecPolicy& policy =
      residual ? ns.residual_policy : info.config.policy;
  const size_t payload_bytes =
      residual ? info.fp16_block_bytes : info.encoded_block_bytes;
  // On a host arena, a block whose pages are one run is encoded straight
  // into them; otherwise into scratch, then scattered over the runs.
  absl::Span<uint8_t> out;
  if (uint8_t* base = arena_->host_base(); base != nullptr) {
    if (std::optional<uint64_t> offset =
            pool_.SingleRunOffset(pages, payload_bytes)) {
      out = absl::MakeSpan(base + *offset, payload_bytes);
    }
  }
  if (out.empty()) {
    scratch->resize(payload_bytes);
    out = absl::MakeSpan(*scratch);
  }
  std::vector<uint16_t> aligned;
  absl::Span<const uint16_t> halves;
  if (reinterpret_cast<uintptr_t>(fp16.data()) % alignof(uint16_t) == 0) {
    halves = absl::MakeConstSpan(reinterpret_cast<const uint16_t*>(fp16.data()),
                                 fp16.size() / 2);
  } else {
    aligned.resize(fp16.size() / 2);
    std::memcpy(aligned.data(), fp16.data(), fp16.size());
    halves = aligned;
  }
  absl::Time start = absl::Now();
  absl::Status status = kernels::EncodeBlock(shape, policy, halves, out);
  if (!status.ok()) return status;
  if (quantize_observer_) {
    quantize_observer_(policy.codec,
                       absl::ToDoubleSeconds(absl::Now() - start));
  }
  status = SealPayload(ns, key, out, pages);
  if (status.ok() && out.data() == scratch->data()) {
    status = pool_.Scatter(pages, out);
  }
  if (scratch->capacity() > kKeptScratchBytes) {
    std::vector<uint8_t>().swap(*scratch);
  }
  return status;
}

absl::Status Store::SealPayload(const Namespace& ns, absl::string_view key,
                                absl::Span<const uint8_t> payload,
                                const PageList& pages) {
  const bool residual = ns.window_blocks > 0;
  const std::vector<uint64_t> layer_sums = LayerChecksums(
      payload, residual ? ns.residual_layer_ends : ns.layer_ends);
  return WriteBlockMetadata(
      pages,
      MakeBlockHeader(ns.info.config.shape,
                      residual ? ns.residual_policy : ns.info.config.policy,
                      ns.info.fingerprint, key, payload.size(),
                      CombineLayerChecksums(layer_sums)),
      layer_sums);
}

absl::Status Store::SealInPlace(const Namespace& ns, absl::string_view key,
                                absl::Span<const uint8_t> fp16,
                                const PageList& pages) {
  // Received where it lies: only the check that codec none's encoding
  // makes is left (the bytes are aligned, as the arena's pages are).
  absl::Time start = absl::Now();
  absl::Status status = kernels::CheckEncodable(
      ns.info.config.shape,
      absl::MakeConstSpan(reinterpret_cast<const uint16_t*>(fp16.data()),
                          fp16.size() / 2));
  if (!status.ok()) return status;
  if (quantize_observer_) {
    quantize_observer_(Codec::kNone,
                       absl::ToDoubleSeconds(absl::Now() - start));
  }
  return SealPayload(ns, key, fp16, pages);
}

Store::WriteLease* Store::LiveWriteLeaseLocked(uint64_t write_id) const {
  auto it = write_leases_.find(write_id);
  if (it == write_leases_.end() || it->second->aborted) return nullptr;
  return it->second.get();
}

absl::StatusOr<Store::WriteLease*> Store::ClaimBlockLocked(uint64_t write_id,
                                                           uint32_t index) {
  WriteLease* lease = LiveWriteLeaseLocked(write_id);
  if (lease == nullptr) return absl::FailedPreconditionError(kStaleWriteLease);
  if (lease->committing) {
    return absl::FailedPreconditionError("write lease is being committed");
  }
  if (index >= lease->blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block index ", index, " is outside the write's ",
                     lease->blocks.size(), " blocks"));
  }
  if (lease->present[index] || lease->staged[index]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", index, " is stored already or was staged before"));
  }
  lease->staged[index] = 1;  // claimed: a second call for it is refused
  ++lease->staging;
  return lease;
}

void Store::EndStaging(uint64_t write_id, WriteLease* lease, uint32_t index,
                       bool staged) {
  std::unique_ptr<WriteLease> ended;
  {
    MutexLock lock(&lease_mu_);
    if (!staged) lease->staged[index] = 0;
    // The last staging of an aborted lease ends it, in this same step.
    if (--lease->staging == 0 && lease->aborted) {
      auto it = write_leases_.find(write_id);
      ended = std::move(it->second);
      write_leases_.erase(it);
    }
  }
  if (ended != nullptr) FreeWriteLease(*ended);
}

absl::Status Store::StageBlock(uint64_t write_id, uint32_t index,
                               absl::Span<const uint8_t> fp16) {
  WriteLease* lease;
  {
    MutexLock lock(&lease_mu_);
    absl::StatusOr<WriteLease*> claimed = ClaimBlockLocked(write_id, index);
    if (!claimed.ok()) return claimed.status();
    lease = *claimed;
  }
  // The lease cannot expire, commit or be dropped while `staging` > 0 (an
  // abort marks it and waits), and block `index`'s pages are this call's
  // alone.
  Namespace* ns = lease->ns.get();
  absl::Status status;
  if (fp16.size() != ns->info.fp16_block_bytes) {
    status = absl::InvalidArgumentError(
        absl::StrCat("block ", index, " has ", fp16.size(),
                     " bytes; this layout's fp16 block is ",
                     ns->info.fp16_block_bytes, " bytes"));
  } else {
    status =
        EncodeToPages(*ns, lease->blocks[index].key, fp16, lease->pages[index]);
    if (!status.ok()) {
      status = absl::Status(
          status.code(), absl::StrCat("block ", index, ": ", status.message()));
    }
  }
  EndStaging(write_id, lease, index, status.ok());
  return status;
}

std::optional<uint64_t> Store::InPlaceOffset(const Namespace& ns,
                                             const PageList& pages) const {
  // Stored as its fp16 bytes: codec none, or a KIVI residual window.
  if (ns.window_blocks == 0 && ns.info.config.policy.codec != Codec::kNone) {
    return std::nullopt;
  }
  if (arena_->host_base() == nullptr || pages.count == 0) return std::nullopt;
  return pool_.SingleRunOffset(pages, ns.info.fp16_block_bytes);
}

absl::StatusOr<absl::Span<uint8_t>> Store::ClaimInPlace(uint64_t write_id,
                                                        uint32_t index) {
  MutexLock lock(&lease_mu_);
  absl::StatusOr<WriteLease*> claimed = ClaimBlockLocked(write_id, index);
  if (!claimed.ok()) return claimed.status();
  WriteLease* lease = *claimed;
  const uint64_t offset = lease->in_place_offset[index];
  if (offset == kNotInPlace) {
    lease->staged[index] = 0;
    --lease->staging;  // not aborted: ClaimBlockLocked found it live
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", index, " of this write cannot be received in place"));
  }
  return absl::MakeSpan(arena_->host_base() + offset,
                        lease->ns.get()->info.fp16_block_bytes);
}

absl::Status Store::FinishInPlace(uint64_t write_id, uint32_t index,
                                  bool landed) {
  WriteLease* lease;
  bool aborted;
  {
    MutexLock lock(&lease_mu_);
    auto it = write_leases_.find(write_id);
    // Only a caller that holds the claim gets here, and the claim keeps the
    // lease (aborted or not) in the table.
    if (it == write_leases_.end() || index >= it->second->blocks.size() ||
        !it->second->staged[index] || it->second->staging == 0) {
      return absl::InternalError(absl::StrCat(
          "block ", index, " of write ", write_id, " has no in-place claim"));
    }
    lease = it->second.get();
    aborted = lease->aborted;
  }
  absl::Status status;
  if (landed && aborted) {
    status = absl::FailedPreconditionError(kStaleWriteLease);
  } else if (landed) {
    const Namespace& ns = *lease->ns.get();
    const uint64_t offset = lease->in_place_offset[index];
    status = SealInPlace(ns, lease->blocks[index].key,
                         absl::MakeConstSpan(arena_->host_base() + offset,
                                             ns.info.fp16_block_bytes),
                         lease->pages[index]);
    if (!status.ok()) {
      status = absl::Status(
          status.code(), absl::StrCat("block ", index, ": ", status.message()));
    }
  }
  EndStaging(write_id, lease, index, landed && status.ok());
  return status;
}

absl::Status Store::AbortWrite(uint64_t write_id) {
  std::unique_ptr<WriteLease> ended;
  {
    MutexLock lock(&lease_mu_);
    WriteLease* lease = LiveWriteLeaseLocked(write_id);
    if (lease == nullptr)
      return absl::FailedPreconditionError(kStaleWriteLease);
    // ABORTED, not FAILED_PRECONDITION: the write ends with the call using
    // it (a commit stores or fails; the last staging releases it), not
    // now.
    if (lease->committing) {
      return absl::AbortedError("write lease is being committed; try again");
    }
    if (lease->staging > 0) {
      lease->aborted = true;  // the last staging to end releases it
      return absl::AbortedError(
          "blocks of this write are being staged; the write ends when they "
          "finish");
    }
    // Out of the table in the step that found it idle: a claim (StageBlock,
    // ClaimInPlace) or a commit taken in between would work on pages
    // already back in the pool.
    auto it = write_leases_.find(write_id);
    ended = std::move(it->second);
    write_leases_.erase(it);
  }
  FreeWriteLease(*ended);
  return absl::OkStatus();
}

// ------------------------------------------------------- KIVI residual window

void Store::QueueWindowExit(const Namespace& ns, Entry* newest) {
  // `newest` is at distance 0; distances 0 .. window-1 stay fp16, so the
  // ancestor at distance `window` has just left the window. Each hop checks
  // the serial under the hop's shard mutex: a slab slot is never unmapped,
  // so a stale pointer is harmless once its serial tells it apart.
  Entry* entry;
  uint64_t serial;
  {
    Shard& shard = shards_[newest->shard];
    MutexLock lock(&shard.mu);
    if (newest->is(kRemoved)) return;
    entry = newest->parent;
    serial = newest->parent_serial;
  }
  for (uint32_t distance = 1; entry != nullptr; ++distance) {
    Shard& shard = shards_[entry->shard];
    MutexLock lock(&shard.mu);
    if (entry->serial != serial || entry->is(kRemoved)) return;
    if (distance == ns.window_blocks) {
      if (entry->is(kResidual)) {
        MutexLock queue_lock(&reencode_mu_);
        reencode_queue_.push_back(
            {ns.id, std::string(entry->key_view()), entry->serial});
      }
      return;
    }
    serial = entry->parent_serial;
    entry = entry->parent;
  }
}

void Store::DropCorrupt(Entry* entry, uint64_t serial) {
  ++data_loss_events_;
  Entry* parent = nullptr;
  {
    // An entry's shard never changes (slab slots stay in their shard).
    Shard& shard = shards_[entry->shard];
    MutexLock lock(&shard.mu);
    if (entry->serial == serial && !entry->is(kRemoved)) {
      parent = RemoveEntry(shard, entry);
      ++evictions_data_loss_;
    }
  }
  UnlinkParent(parent);
}

bool Store::Reencode(const ReencodeJob& job) {
  // The slot may hold another namespace by now: the serial tells.
  NamespaceRef held = RefById(job.ns_id);
  if (!held) return false;
  Namespace* ns = held.get();
  KeyRef ref = MakeKeyRef(job.ns_id, job.key);
  Shard& shard = ShardOf(ref);
  Entry* entry;
  {
    MutexLock lock(&shard.mu);
    entry = Find(shard, ref);
    if (entry == nullptr || entry->serial != job.serial ||
        !entry->is(kResidual)) {
      return false;
    }
    Pin(shard, entry);
  }
  // Pinned: its pages and flags cannot change under us.
  const kernels::BlockShape& shape = ns->info.config.shape;
  const kernels::CodecPolicy& policy = ns->info.config.policy;
  std::vector<uint8_t> fp16(ns->info.fp16_block_bytes);
  BlockHeader header;
  absl::Status status = pool_.Gather(entry->pages, absl::MakeSpan(fp16));
  if (status.ok()) status = ReadHeader(entry->pages.first, &header);
  if (status.ok()) {
    status = VerifyBlock(header, shape, ns->residual_policy,
                         ns->info.fingerprint, job.key, fp16);
  }
  if (!status.ok()) {
    DropCorrupt(entry, job.serial);
    MutexLock lock(&shard.mu);
    Unpin(shard, entry);
    return false;
  }
  std::vector<uint8_t> encoded(ns->info.encoded_block_bytes);
  absl::Time start = absl::Now();
  status = kernels::EncodeBlock(
      shape, policy,
      absl::MakeConstSpan(reinterpret_cast<const uint16_t*>(fp16.data()),
                          fp16.size() / 2),
      absl::MakeSpan(encoded));
  if (status.ok() && quantize_observer_) {
    quantize_observer_(policy.codec,
                       absl::ToDoubleSeconds(absl::Now() - start));
  }
  PageList pages;
  if (status.ok()) {
    status = ReservePages(ns->owner(), ns->pages_per_block, &pages);
    // The pages become the block's (accounted as it is) or go back.
    if (status.ok()) owners_[ns->owner()].reserved_pages -= pages.count;
  }
  if (status.ok()) {
    const std::vector<uint64_t> layer_sums =
        LayerChecksums(encoded, ns->layer_ends);
    status = WriteBlockMetadata(
        pages,
        MakeBlockHeader(shape, policy, ns->info.fingerprint, job.key,
                        encoded.size(), CombineLayerChecksums(layer_sums)),
        layer_sums);
    if (status.ok()) status = pool_.Scatter(pages, encoded);
  }
  PageList to_release;
  bool swapped = false, retry = false;
  {
    MutexLock lock(&shard.mu);
    if (status.ok() && !entry->is(kRemoved) && entry->pins == 1) {
      // Nobody else holds the block: switch it to its encoded pages.
      AccountAdd(*entry, -1);
      pinned_pages_ -= entry->pages.count;
      to_release = entry->pages;
      entry->pages = pages;
      pinned_pages_ += entry->pages.count;
      entry->set(kResidual, false);
      AccountAdd(*entry, +1);
      swapped = true;
    } else {
      to_release = pages;
      retry = status.ok() && !entry->is(kRemoved);  // a reader holds it
    }
    Unpin(shard, entry);
  }
  ReleasePages(to_release);
  if (retry) {
    MutexLock lock(&reencode_mu_);
    reencode_queue_.push_back(job);
  }
  if (swapped) ++reencoded_blocks_;
  return swapped;
}

// --------------------------------------------------------------------- read

absl::Status Store::PinForRead(const Namespace& ns,
                               absl::Span<const std::string> keys,
                               bool allow_missing, std::vector<Entry*>* entries,
                               std::vector<uint32_t>* positions,
                               std::vector<uint32_t>* missing) {
  entries->reserve(keys.size());
  positions->reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    KeyRef ref = MakeKeyRef(ns.id, keys[i]);
    Shard& shard = ShardOf(ref);
    Entry* entry;
    {
      MutexLock lock(&shard.mu);
      entry = Find(shard, ref);
      if (entry != nullptr) {
        Pin(shard, entry);
        Touch(entry);
      }
    }
    if (entry == nullptr) {
      if (allow_missing) {
        missing->push_back(static_cast<uint32_t>(i));
        continue;
      }
      UnpinAll(*entries);
      entries->clear();
      return absl::NotFoundError(absl::StrCat("block ", i, " is not stored"));
    }
    entries->push_back(entry);
    positions->push_back(static_cast<uint32_t>(i));
  }
  return absl::OkStatus();
}

absl::Status Store::ReadPinnedBlock(const Namespace& ns, const Entry& entry,
                                    const ReadOptions& options,
                                    std::vector<uint8_t>* stored,
                                    ReadBlock* block, absl::Status* verified) {
  // Pinned pages are immutable and never reused, so they are read unlocked.
  const kernels::BlockShape& shape = ns.info.config.shape;
  const bool residual = entry.is(kResidual);
  const kernels::CodecPolicy& policy =
      residual ? ns.residual_policy : ns.info.config.policy;
  const size_t payload_bytes =
      residual ? ns.info.fp16_block_bytes : ns.info.encoded_block_bytes;
  block->codec = policy.codec;
  // In place (see the header): verified where it lies, one pass over the
  // pages (the checksum) and no copy; the pin keeps the pages as they are
  // until the lease ends. Otherwise a raw read gathers straight into the
  // reply and an fp16 read gathers into scratch and decodes into the
  // reply: one copy of the pages either way.
  const uint8_t* base = arena_->host_base();
  const std::vector<uint64_t>& layer_ends =
      residual ? ns.residual_layer_ends : ns.layer_ends;
  const bool here = options.in_place && options.keep_lease &&
                    InPlace(policy.codec, options.format, options.decode_later);
  BlockHeader header;
  absl::Status status;
  if (here) {
    status = pool_.ForEachRun(entry.pages, payload_bytes,
                              [&](uint64_t offset, size_t, size_t n) {
                                block->spans.emplace_back(base + offset, n);
                                return absl::OkStatus();
                              });
    if (status.ok()) status = ReadHeader(entry.pages.first, &header);
    if (!status.ok()) return status;
    if (options.format == ReadFormat::kFp16 &&
        policy.codec != kernels::Codec::kNone) {
      block->decode_later = true;
      block->fp16_bytes = ns.info.fp16_block_bytes;
    }
    std::vector<uint64_t> sums;
    if (options.caller_verifies &&
        ReadLayerSums(entry.pages, layer_ends.size(), &sums)) {
      // The header vouches for the layer checksums; the caller checks the
      // bytes against them as it copies or sends them.
      *verified = VerifyBlockMetadata(
          header, shape, policy, ns.info.fingerprint, block->key, block->size(),
          CombineLayerChecksums(sums));
      if (verified->ok()) {
        block->unchecked_layer_ends = layer_ends;
        block->unchecked_layer_sums = std::move(sums);
      }
      return absl::OkStatus();
    }
    *verified = VerifyBlockMetadata(
        header, shape, policy, ns.info.fingerprint, block->key, block->size(),
        CombineLayerChecksums(LayerChecksums(block->spans, layer_ends)));
    return absl::OkStatus();
  }
  absl::Span<uint8_t> payload;
  if (options.format == ReadFormat::kRaw) {
    block->data.resize(payload_bytes);
    payload = absl::MakeSpan(reinterpret_cast<uint8_t*>(block->data.data()),
                             payload_bytes);
  } else {
    stored->resize(payload_bytes);
    payload = absl::MakeSpan(*stored);
  }
  status = pool_.Gather(entry.pages, payload);
  if (status.ok()) status = ReadHeader(entry.pages.first, &header);
  if (!status.ok()) return status;
  *verified = VerifyBlockMetadata(
      header, shape, policy, ns.info.fingerprint, block->key, payload.size(),
      CombineLayerChecksums(LayerChecksums(payload, layer_ends)));
  if (!verified->ok() || options.format != ReadFormat::kFp16) {
    return absl::OkStatus();
  }
  block->data.resize(ns.info.fp16_block_bytes);
  return kernels::DecodeBlock(
      shape, policy, *stored,
      absl::MakeSpan(reinterpret_cast<uint16_t*>(block->data.data()),
                     block->data.size() / 2));
}

bool Store::InPlace(kernels::Codec stored, ReadFormat format,
                    bool decode_later) const {
  return arena_->host_base() != nullptr &&
         (format == ReadFormat::kRaw || stored == kernels::Codec::kNone ||
          decode_later);
}

bool Store::ReadsInPlace(const NamespaceInfo& ns, ReadFormat format,
                         bool decode_later) const {
  // A block in KIVI's residual window is stored with codec none, so in
  // place for either format: where the namespace's codec is, every block is.
  return InPlace(ns.config.policy.codec, format, decode_later);
}

absl::Status Store::CheckPinTakeover(const Namespace& ns,
                                     const ReadOptions& options) {
  MutexLock lock(&lease_mu_);
  auto pin = read_leases_.find(options.pin_lease_id);
  // Another holder's pin answers as an unknown one.
  if (pin == read_leases_.end() || pin->second->holder != options.holder) {
    return absl::FailedPreconditionError("pin lease is unknown or has expired");
  }
  // Taking a pin over releases it: only a read of its own namespace may.
  if (pin->second->ns_id != ns.id) {
    return absl::FailedPreconditionError(
        "pin lease belongs to another namespace");
  }
  // A held lease is a transfer's, which still reads its pages.
  if (pin->second->held) {
    return absl::FailedPreconditionError(
        "pin lease is in use by a data-plane transfer");
  }
  return absl::OkStatus();
}

absl::Status Store::ReadPinnedBlocks(const Namespace& ns,
                                     absl::Span<const std::string> keys,
                                     const ReadOptions& options,
                                     absl::Span<const uint32_t> positions,
                                     std::vector<Entry*>* entries,
                                     ReadResult* result) {
  // Every block is verified (and decoded) at once on the read executor;
  // then, in key order, the first error ends the read and corrupt blocks
  // are dropped.
  struct Pending {
    ReadBlock block;
    absl::Status status;
    absl::Status verified;
  };
  std::vector<Pending> pending(entries->size());
  // Helpers only where there is enough to share (SetReadExecutor).
  const int helpers =
      ns.info.encoded_block_bytes * entries->size() >= read_parallel_bytes_
          ? read_helpers_
          : 0;
  ParallelFor(entries->size(), read_executor_, helpers, [&](size_t j) {
    // Decode scratch per thread and reused (a fresh buffer per block is
    // fresh memory per block); not kept above kKeptScratchBytes.
    constexpr size_t kKeptScratchBytes = size_t{32} << 20;
    static thread_local std::vector<uint8_t> stored;
    pending[j].block.key = keys[positions[j]];
    pending[j].status =
        ReadPinnedBlock(ns, *(*entries)[j], options, &stored, &pending[j].block,
                        &pending[j].verified);
    if (stored.capacity() > kKeptScratchBytes) {
      std::vector<uint8_t>().swap(stored);
    }
  });
  absl::Status status;
  for (size_t j = 0; j < entries->size() && status.ok(); ++j) {
    Entry* entry = (*entries)[j];
    status = pending[j].status;
    if (!status.ok()) break;
    if (const absl::Status& verified = pending[j].verified; !verified.ok()) {
      DropCorrupt(entry, entry->serial);  // pinned: the serial holds
      if (!options.allow_missing) {
        status = absl::DataLossError(absl::StrCat("block ", positions[j], ": ",
                                                  verified.message(),
                                                  "; the block was dropped"));
        break;
      }
      // A miss like any other: this read no longer holds it.
      {
        Shard& shard = shards_[entry->shard];
        MutexLock lock(&shard.mu);
        Unpin(shard, entry);
      }
      (*entries)[j] = nullptr;
      result->missing.push_back(positions[j]);
      continue;
    }
    result->blocks.push_back(std::move(pending[j].block));
  }
  entries->erase(std::remove(entries->begin(), entries->end(), nullptr),
                 entries->end());
  std::sort(result->missing.begin(), result->missing.end());
  return status;
}

absl::StatusOr<ReadResult> Store::BeginRead(NamespaceName ns_name,
                                            absl::Span<const std::string> keys,
                                            const ReadOptions& options) {
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<NamespaceRef> found_ns = FindNamespace(ns_name);
  if (!found_ns.ok()) return found_ns.status();
  Namespace* ns = found_ns->get();
  if (options.pin_lease_id != 0) {
    if (absl::Status s = CheckPinTakeover(*ns, options); !s.ok()) return s;
  }
  ReadResult result;
  std::vector<Entry*> entries;
  std::vector<uint32_t> positions;  // of entries[j] in keys
  if (absl::Status s = PinForRead(*ns, keys, options.allow_missing, &entries,
                                  &positions, &result.missing);
      !s.ok()) {
    return s;
  }
  if (options.pin_lease_id != 0) {
    ReleaseReadLease(options.pin_lease_id, /*unless_held=*/true);
  }

  result.ns = ns->info;
  absl::Status status =
      ReadPinnedBlocks(*ns, keys, options, positions, &entries, &result);
  if (!status.ok() || !options.keep_lease) {
    UnpinAll(entries);
    if (!status.ok()) return status;
    return result;
  }
  auto lease = std::make_unique<ReadLease>();
  lease->ns = *found_ns;
  lease->ns_id = ns->id;
  lease->holder = options.holder;
  lease->entries = std::move(entries);
  lease->deadline = LeaseDeadline(options.ttl);
  result.deadline = lease->deadline;
  MutexLock lock(&lease_mu_);
  result.lease_id = NewLeaseId();
  read_leases_.emplace(result.lease_id, std::move(lease));
  return result;
}

absl::Status Store::DropCorruptReadBlock(uint64_t lease_id, size_t block) {
  Entry* entry;
  uint64_t serial;
  {
    MutexLock lock(&lease_mu_);
    auto it = read_leases_.find(lease_id);
    if (it == read_leases_.end()) {
      return absl::FailedPreconditionError(kStaleReadLease);
    }
    if (block >= it->second->entries.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", block, " is outside the read's ",
                       it->second->entries.size(), " blocks"));
    }
    // Pinned by the lease while it is in the table: the serial is its.
    entry = it->second->entries[block];
    serial = entry->serial;
  }
  // Shard mutex after, not under, lease_mu_. Should the lease end
  // meanwhile (against the contract) and the slot be reused, the serial
  // no longer matches and nothing is dropped.
  DropCorrupt(entry, serial);
  return absl::OkStatus();
}

// ------------------------------------------------------------------- delete

absl::StatusOr<uint32_t> Store::Delete(NamespaceName ns_name,
                                       absl::Span<const std::string> keys) {
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<NamespaceRef> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  uint32_t deleted = 0;
  for (const std::string& key : keys) {
    KeyRef ref = MakeKeyRef((*ns)->id, key);
    Shard& shard = ShardOf(ref);
    Entry* parent;
    {
      MutexLock lock(&shard.mu);
      Entry* entry = Find(shard, ref);
      if (entry == nullptr) continue;
      parent = RemoveEntry(shard, entry);
    }
    UnlinkParent(parent);
    ++deleted;
  }
  deleted_ += deleted;
  return deleted;
}

// ------------------------------------------------------------------- drop

absl::StatusOr<DropResult> Store::DropNamespace(NamespaceName name) {
  NamespaceRef ns;
  {
    // Found and marked in one step: no new call or lease finds it after.
    MutexLock lock(&ns_mu_);
    for (uint32_t i = 0; i < slots_used_ && !ns; ++i) {
      Namespace* candidate = namespaces_[i].get();
      if (candidate->dropped || candidate->info.config.name != name.name) {
        continue;
      }
      if (absl::Status s = CheckFingerprint(*candidate, name); !s.ok()) {
        return s;
      }
      ns = NamespaceRef(candidate);
      candidate->dropped = true;
    }
  }
  if (!ns) {
    return absl::NotFoundError(absl::StrCat(
        "namespace '", EchoForError(name.name), "' is not registered"));
  }
  // Its leases end; a write being committed or staged ends with its call
  // (CommitWrite then stores nothing of a dropped namespace).
  std::vector<std::unique_ptr<ReadLease>> reads;
  std::vector<uint64_t> writes;
  {
    MutexLock lock(&lease_mu_);
    for (auto it = read_leases_.begin(); it != read_leases_.end();) {
      auto here = it++;
      // A held lease is a transfer's, still sending from its pages: it
      // ends with the transfer.
      if (here->second->ns_id != ns->id || here->second->held) continue;
      reads.push_back(std::move(here->second));
      read_leases_.erase(here);
    }
    for (const auto& [id, lease] : write_leases_) {
      if (lease->ns_id == ns->id) writes.push_back(id);
    }
  }
  for (const std::unique_ptr<ReadLease>& lease : reads) {
    UnpinAll(lease->entries);
  }
  for (uint64_t id : writes) ReleaseWriteLease(id, /*if_idle=*/true);
  DropResult result;
  for (size_t s = 0; s < kNumShards; ++s) {
    Shard& shard = shards_[s];
    std::vector<Entry*> parents;
    {
      MutexLock lock(&shard.mu);
      std::vector<Entry*> victims;
      for (Entry* entry : shard.index) {
        if (entry->ns_id == ns->id) victims.push_back(entry);
      }
      for (Entry* entry : victims) {
        ++result.blocks;
        result.freed_bytes += uint64_t{entry->pages.count} * options_.page_size;
        parents.push_back(RemoveEntry(shard, entry));
      }
    }
    for (Entry* parent : parents) UnlinkParent(parent);
  }
  deleted_ += result.blocks;
  return result;
}

// -------------------------------------------------------------- maintenance

int Store::RunMaintenance(absl::Time now) {
  ExpireLeases(now);
  if (options_.high_watermark < 1.0) {
    const uint64_t total = pool_.num_pages();
    const double high = options_.high_watermark * total;
    const double low = options_.low_watermark * total;
    if (static_cast<double>(used_pages_ + reserved_pages_) > high) {
      // Owners within their share are left alone (store.h, "Owners").
      while (static_cast<double>(used_pages_ + reserved_pages_) > low &&
             (EvictOne(&evictions_watermark_, Victims::kOverShare, 0) ||
              EvictOne(&evictions_watermark_, Victims::kNoShare, 0))) {
      }
    }
  }
  int reencoded = 0;
  // Bounded per call, so that maintenance never starves lease expiry.
  for (int i = 0; i < 256; ++i) {
    ReencodeJob job;
    {
      MutexLock lock(&reencode_mu_);
      if (reencode_queue_.empty()) break;
      job = std::move(reencode_queue_.front());
      reencode_queue_.pop_front();
      ++reencodes_running_;
    }
    if (Reencode(job)) ++reencoded;
    MutexLock lock(&reencode_mu_);
    --reencodes_running_;
  }
  return reencoded;
}

// -------------------------------------------------------------------- stats

StoreStats Store::Stats() const {
  StoreStats s;
  const uint64_t page = options_.page_size;
  s.capacity_bytes = pool_.capacity_bytes();
  const uint64_t free_pages = pool_.free_pages();
  s.page_size = options_.page_size;
  s.used_bytes = used_pages_ * page;
  s.reserved_bytes = reserved_pages_ * page;
  s.pinned_bytes = pinned_pages_ * page;
  s.fragmentation_bytes = s.used_bytes - used_payload_bytes_;
  for (size_t c = 0; c < kNumCodecs; ++c) {
    s.codecs[c] = {per_codec_[c].blocks, per_codec_[c].tokens,
                   per_codec_[c].stored_bytes, per_codec_[c].logical_bytes};
  }
  s.evictions_capacity = evictions_capacity_;
  s.evictions_watermark = evictions_watermark_;
  s.evictions_data_loss = evictions_data_loss_;
  s.deleted = deleted_;
  s.data_loss_events = data_loss_events_;
  s.lookup_hits = lookup_hits_;
  s.lookup_misses = lookup_misses_;
  s.expired_leases = expired_leases_;
  s.reencoded_blocks = reencoded_blocks_;
  {
    MutexLock lock(&lease_mu_);
    s.active_read_leases = static_cast<uint32_t>(read_leases_.size());
    s.active_write_leases = static_cast<uint32_t>(write_leases_.size());
  }
  {
    MutexLock lock(&reencode_mu_);
    s.pending_reencodes = reencode_queue_.size() + reencodes_running_;
  }
  MutexLock lock(&ns_mu_);
  for (uint32_t i = 0; i < slots_used_; ++i) {
    const Namespace& ns = *namespaces_[i];
    if (ns.dropped) continue;
    NamespaceStats n;
    n.name = ns.info.config.name;
    n.owner = ns.owner();
    n.codec = ns.codec();
    n.blocks = ns.blocks;
    n.tokens = n.blocks * ns.info.config.shape.tokens_per_block;
    n.residual_blocks = ns.residual_blocks;
    n.stored_bytes = ns.stored_pages * page;
    n.logical_bytes = n.blocks * ns.info.fp16_block_bytes;
    const kernels::BlockShape& shape = ns.info.config.shape;
    for (Codec codec : kernels::kAllCodecs) {
      kernels::CodecPolicy policy;
      policy.codec = codec;
      policy.fp16_layers = ns.info.config.policy.fp16_layers;
      policy.kivi_group_size = ns.info.config.policy.kivi_group_size;
      if (codec == n.codec) policy = ns.info.config.policy;
      if (!kernels::ValidatePolicy(shape, policy).ok()) continue;
      uint64_t pages_per_block =
          (kernels::EncodedBlockBytes(shape, policy) + page - 1) / page;
      n.tokens_that_fit[CodecIndex(codec)] =
          free_pages / pages_per_block * shape.tokens_per_block;
    }
    s.namespaces.push_back(std::move(n));
  }
  return s;
}

absl::Status Store::CorruptBlockForTest(const std::string& ns_name,
                                        const std::string& key, bool header,
                                        uint64_t payload_offset) {
  absl::StatusOr<NamespaceRef> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  KeyRef ref = MakeKeyRef((*ns)->id, key);
  Shard& shard = ShardOf(ref);
  MutexLock lock(&shard.mu);
  Entry* entry = Find(shard, ref);
  if (entry == nullptr) return absl::NotFoundError("block is not stored");
  uint64_t offset = uint64_t{entry->pages.first} * sizeof(BlockHeader) + 20;
  if (!header) {
    std::optional<uint64_t> found;
    absl::Status s = pool_.ForEachRun(
        entry->pages, payload_offset + 1,
        [&](uint64_t run, size_t at, size_t n) {
          if (payload_offset >= at && payload_offset < at + n) {
            found = run + (payload_offset - at);
          }
          return absl::OkStatus();
        });
    if (!s.ok()) return s;
    if (!found) return absl::OutOfRangeError("offset is past the block");
    offset = *found;
  }
  uint8_t byte;
  if (absl::Status s = arena_->Read(offset, &byte, 1); !s.ok()) return s;
  byte ^= header ? 0x01 : 0x5A;
  return arena_->Write(offset, &byte, 1);
}

}  // namespace kvcache::store
