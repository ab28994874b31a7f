#include "store/store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcache::store {

using kernels::Codec;

struct Store::Namespace {
  uint32_t id = 0;
  NamespaceInfo info;
  kernels::CodecPolicy residual_policy;  // codec none: KIVI's fp16 window
  uint32_t window_blocks = 0;            // 0: no residual window
  uint32_t pages_per_block = 0;          // encoded with the namespace codec
  uint32_t pages_per_residual_block = 0;
  uint64_t residual_payload_bytes = 0;
  std::atomic<uint64_t> blocks{0};
  std::atomic<uint64_t> residual_blocks{0};
};

struct Store::Entry {
  Namespace* ns = nullptr;  // namespaces live as long as the store
  uint32_t ns_id = 0;
  uint8_t shard = 0;
  bool evictable = false;
  bool removed = false;
  bool residual = false;  // fp16 in KIVI's window, re-encoded later
  Codec codec = Codec::kNone;
  uint32_t tokens = 0;
  uint32_t children = 0;  // cached blocks linked to this one as parent
  uint32_t pins = 0;
  uint64_t serial = 0;
  uint64_t last_access = 0;
  uint64_t payload_bytes = 0;
  uint64_t logical_bytes = 0;
  std::string key;
  std::string parent_key;
  uint64_t parent_serial = 0;  // the parent this block is counted in
  std::vector<uint32_t> pages;
};

struct Store::Shard {
  Mutex mu;
  absl::flat_hash_map<std::string, std::unique_ptr<Entry>> index
      ABSL_GUARDED_BY(mu);
  // Removed from the index while pinned; freed at the last unpin.
  absl::flat_hash_map<Entry*, std::unique_ptr<Entry>> zombies
      ABSL_GUARDED_BY(mu);
  // Evictable blocks by (last access tick, entry): the front goes first.
  std::set<std::pair<uint64_t, Entry*>> evictable ABSL_GUARDED_BY(mu);
  std::atomic<uint64_t> evictable_pages{0};
};

struct Store::ReadLease {
  std::vector<Entry*> entries;  // each holds one pin of this lease
  absl::Time deadline;
};

struct Store::WriteLease {
  uint32_t ns_id = 0;
  std::vector<BlockRef> blocks;
  std::vector<bool> present;
  std::vector<std::vector<uint32_t>> pages;  // per block; empty if present
  absl::Time deadline;
  bool committing = false;
};

namespace {

std::string IndexKey(uint32_t ns_id, absl::string_view key) {
  std::string k(sizeof(ns_id), '\0');
  std::memcpy(k.data(), &ns_id, sizeof(ns_id));
  k.append(key.data(), key.size());
  return k;
}

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
      return absl::InvalidArgumentError(absl::StrCat(
          "namespace name '", name, "' may hold only [A-Za-z0-9._:/-]"));
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

bool IsKivi(Codec c) { return c == Codec::kKivi2 || c == Codec::kKivi4; }

uint64_t Fingerprint(const NamespaceConfig& c) {
  std::string s = absl::StrCat(
      c.name, "|", c.model, "|", c.revision, "|", c.tp_rank, "|",
      c.shape.num_layers, "|", c.shape.num_kv_heads, "|", c.shape.head_dim, "|",
      c.shape.tokens_per_block, "|fp16|", static_cast<int>(c.policy.codec), "|",
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

size_t CodecIndex(Codec c) { return static_cast<size_t>(c); }

// Bytes at the start of the arena that hold one BlockHeader per page.
uint64_t HeaderSlabBytes(uint64_t arena_bytes, uint32_t page_size) {
  uint64_t pages = arena_bytes / (page_size + sizeof(BlockHeader));
  return (pages * sizeof(BlockHeader) + 4095) / 4096 * 4096;
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
  // The constructor is private: Create is the only way to build a Store.
  return std::unique_ptr<Store>(new Store(options, std::move(arena)));
}

Store::Store(const StoreOptions& options, std::unique_ptr<Arena> arena)
    : options_(options),
      arena_(std::move(arena)),
      header_slab_bytes_(HeaderSlabBytes(arena_->size(), options.page_size)),
      pool_(arena_.get(), header_slab_bytes_,
            arena_->size() - header_slab_bytes_, options.page_size),
      shards_(std::make_unique<Shard[]>(kNumShards)) {}

Store::~Store() = default;

void Store::SetQuantizeObserver(QuantizeObserver observer) {
  quantize_observer_ = std::move(observer);
}

absl::Status Store::WriteHeader(uint32_t first_page,
                                const BlockHeader& header) {
  return arena_->Write(uint64_t{first_page} * sizeof(BlockHeader), &header,
                       sizeof(header));
}

absl::Status Store::ReadHeader(uint32_t first_page, BlockHeader* header) const {
  return arena_->Read(uint64_t{first_page} * sizeof(BlockHeader), header,
                      sizeof(*header));
}

Store::Shard& Store::ShardFor(const std::string& index_key) const {
  return shards_[HashString(index_key) % kNumShards];
}

// ---------------------------------------------------------------- namespaces

absl::StatusOr<NamespaceInfo> Store::RegisterNamespace(NamespaceConfig config) {
  if (absl::Status s = ValidateName(config.name); !s.ok()) return s;
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

  MutexLock lock(&ns_mu_);
  for (const auto& ns : namespaces_) {
    if (ns->info.config.name != info.config.name) continue;
    if (ns->info.fingerprint != info.fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "namespace '", info.config.name,
          "' is registered with a different model, layout or codec policy"));
    }
    NamespaceInfo existing = ns->info;
    existing.already_registered = true;
    return existing;
  }
  if (namespaces_.size() >= options_.max_namespaces) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the node holds its limit of ", options_.max_namespaces,
                     " namespaces"));
  }
  auto ns = std::make_unique<Namespace>();
  ns->id = static_cast<uint32_t>(namespaces_.size());
  ns->info = info;
  const uint32_t tokens = info.config.shape.tokens_per_block;
  ns->window_blocks = (info.config.residual_tokens + tokens - 1) / tokens;
  ns->residual_policy.codec = Codec::kNone;
  ns->residual_payload_bytes = info.fp16_block_bytes;
  {
    MutexLock pool_lock(&pool_mu_);
    ns->pages_per_block = pool_.PagesFor(info.encoded_block_bytes);
    ns->pages_per_residual_block = pool_.PagesFor(info.fp16_block_bytes);
    uint32_t largest = ns->window_blocks > 0 ? ns->pages_per_residual_block
                                             : ns->pages_per_block;
    if (largest > pool_.num_pages()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "one block of this layout (", largest, " pages of ",
          pool_.page_size(), " bytes) is larger than the whole pool"));
    }
  }
  namespaces_.push_back(std::move(ns));
  return info;
}

absl::StatusOr<NamespaceInfo> Store::GetNamespace(
    const std::string& name) const {
  absl::StatusOr<Namespace*> ns = FindNamespace(name);
  if (!ns.ok()) return ns.status();
  return (*ns)->info;
}

absl::StatusOr<Store::Namespace*> Store::FindNamespace(
    const std::string& name) const {
  MutexLock lock(&ns_mu_);
  for (const auto& ns : namespaces_) {
    if (ns->info.config.name == name) return ns.get();
  }
  return absl::NotFoundError(
      absl::StrCat("namespace '", name, "' is not registered"));
}

// ------------------------------------------------------------ shard helpers

void Store::Touch(Shard& shard, Entry* entry) {
  if (entry->evictable) shard.evictable.erase({entry->last_access, entry});
  entry->last_access = ++tick_;
  if (entry->evictable) shard.evictable.insert({entry->last_access, entry});
}

void Store::UpdateEvictable(Shard& shard, Entry* entry) {
  bool should = !entry->removed && entry->pins == 0 && entry->children == 0;
  if (should == entry->evictable) return;
  if (should) {
    shard.evictable.insert({entry->last_access, entry});
    shard.evictable_pages += entry->pages.size();
  } else {
    shard.evictable.erase({entry->last_access, entry});
    shard.evictable_pages -= entry->pages.size();
  }
  entry->evictable = should;
}

void Store::Pin(Shard& shard, Entry* entry) {
  if (entry->pins++ == 0) pinned_pages_ += entry->pages.size();
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
  AtomicCodecStats& cs = per_codec_[CodecIndex(entry.codec)];
  add(cs.blocks, 1);
  add(cs.tokens, entry.tokens);
  add(cs.stored_bytes, uint64_t{entry.pages.size()} * options_.page_size);
  add(cs.logical_bytes, entry.logical_bytes);
  add(used_pages_, entry.pages.size());
  add(used_payload_bytes_, entry.payload_bytes);
  add(entry.ns->blocks, 1);
  if (entry.residual) add(entry.ns->residual_blocks, 1);
}

Store::ParentLink Store::RemoveEntry(Shard& shard, Entry* entry) {
  if (entry->evictable) {
    shard.evictable.erase({entry->last_access, entry});
    shard.evictable_pages -= entry->pages.size();
    entry->evictable = false;
  }
  entry->removed = true;
  AccountAdd(*entry, -1);
  ParentLink link{entry->ns_id, entry->parent_key, entry->parent_serial};
  entry->parent_serial = 0;
  auto node = shard.index.extract(IndexKey(entry->ns_id, entry->key));
  if (entry->pins > 0) {
    shard.zombies.emplace(entry, std::move(node.mapped()));
  } else {
    ReleasePages(entry->pages);
  }
  return link;
}

void Store::Unpin(Shard& shard, Entry* entry) {
  if (--entry->pins > 0) return;
  pinned_pages_ -= entry->pages.size();
  if (entry->removed) {
    ReleasePages(entry->pages);
    shard.zombies.erase(entry);
    return;
  }
  UpdateEvictable(shard, entry);
}

void Store::UnlinkParent(const ParentLink& link) {
  if (link.parent_serial == 0) return;
  std::string index_key = IndexKey(link.ns_id, link.parent_key);
  Shard& shard = ShardFor(index_key);
  MutexLock lock(&shard.mu);
  auto it = shard.index.find(index_key);
  if (it == shard.index.end()) return;
  Entry* parent = it->second.get();
  if (parent->serial != link.parent_serial || parent->children == 0) return;
  --parent->children;
  UpdateEvictable(shard, parent);
}

void Store::UnpinAll(const std::vector<Entry*>& entries) {
  for (Entry* entry : entries) {
    Shard& shard = shards_[entry->shard];
    MutexLock lock(&shard.mu);
    Unpin(shard, entry);
  }
}

// ------------------------------------------------------------- pages, evict

void Store::ReleasePages(absl::Span<const uint32_t> pages) {
  MutexLock lock(&pool_mu_);
  pool_.Release(pages);
}

bool Store::EvictOne(std::atomic<uint64_t>* counter) {
  for (size_t attempt = 0; attempt < 2 * kNumShards; ++attempt) {
    size_t best = kNumShards;
    uint64_t best_tick = std::numeric_limits<uint64_t>::max();
    for (size_t s = 0; s < kNumShards; ++s) {
      MutexLock lock(&shards_[s].mu);
      if (!shards_[s].evictable.empty() &&
          shards_[s].evictable.begin()->first < best_tick) {
        best_tick = shards_[s].evictable.begin()->first;
        best = s;
      }
    }
    if (best == kNumShards) return false;
    ParentLink link;
    {
      Shard& shard = shards_[best];
      MutexLock lock(&shard.mu);
      if (shard.evictable.empty()) continue;  // raced: look again
      link = RemoveEntry(shard, shard.evictable.begin()->second);
    }
    UnlinkParent(link);
    ++*counter;
    return true;
  }
  return false;
}

bool Store::ReservePages(uint32_t count, std::vector<uint32_t>* pages) {
  while (true) {
    uint64_t free_pages;
    {
      MutexLock lock(&pool_mu_);
      if (pool_.Allocate(count, pages)) return true;
      free_pages = pool_.free_pages();
    }
    // Refuse before evicting anything when even every unpinned block could
    // not make room. (Only leaves are evictable, but evicting a leaf makes
    // its parent one, so every unpinned block without pinned descendants
    // can go.)
    uint64_t used = used_pages_.load(), pinned = pinned_pages_.load();
    uint64_t unpinned = used > pinned ? used - pinned : 0;
    if (free_pages + unpinned < count) return false;
    if (!EvictOne(&evictions_capacity_)) return false;
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

void Store::ReleaseReadLease(uint64_t id) {
  std::unique_ptr<ReadLease> lease;
  {
    MutexLock lock(&lease_mu_);
    auto node = read_leases_.extract(id);
    if (node.empty()) return;
    lease = std::move(node.mapped());
  }
  UnpinAll(lease->entries);
}

void Store::ReleaseWriteLease(uint64_t id) {
  std::unique_ptr<WriteLease> lease;
  {
    MutexLock lock(&lease_mu_);
    auto node = write_leases_.extract(id);
    if (node.empty()) return;
    lease = std::move(node.mapped());
  }
  for (const auto& pages : lease->pages) {
    ReleasePages(pages);
    reserved_pages_ -= pages.size();
  }
}

int Store::ExpireLeases(absl::Time now) {
  std::vector<uint64_t> reads, writes;
  {
    MutexLock lock(&lease_mu_);
    for (const auto& [id, lease] : read_leases_) {
      if (lease->deadline < now) reads.push_back(id);
    }
    for (const auto& [id, lease] : write_leases_) {
      if (lease->deadline < now && !lease->committing) writes.push_back(id);
    }
  }
  for (uint64_t id : reads) ReleaseReadLease(id);
  for (uint64_t id : writes) ReleaseWriteLease(id);
  int expired = static_cast<int>(reads.size() + writes.size());
  expired_leases_ += expired;
  return expired;
}

absl::Status Store::EndLease(uint64_t lease_id) {
  {
    MutexLock lock(&lease_mu_);
    if (!read_leases_.contains(lease_id)) {
      return absl::NotFoundError("read lease is unknown or has expired");
    }
  }
  ReleaseReadLease(lease_id);
  return absl::OkStatus();
}

// ------------------------------------------------------------------- lookup

absl::StatusOr<LookupResult> Store::Lookup(const std::string& ns_name,
                                           absl::Span<const std::string> keys,
                                           bool pin, absl::Duration ttl) {
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  std::vector<Entry*> found;
  for (const std::string& key : keys) {
    std::string index_key = IndexKey((*ns)->id, key);
    Shard& shard = ShardFor(index_key);
    MutexLock lock(&shard.mu);
    auto it = shard.index.find(index_key);
    if (it == shard.index.end()) break;
    Entry* entry = it->second.get();
    Touch(shard, entry);
    if (pin) Pin(shard, entry);
    found.push_back(entry);
  }
  LookupResult result;
  result.prefix_blocks = static_cast<uint32_t>(found.size());
  lookup_hits_ += found.size();
  lookup_misses_ += keys.size() - found.size();
  if (pin && !found.empty()) {
    auto lease = std::make_unique<ReadLease>();
    lease->deadline = LeaseDeadline(ttl);
    lease->entries = std::move(found);
    MutexLock lock(&lease_mu_);
    result.lease_id = NewLeaseId();
    read_leases_.emplace(result.lease_id, std::move(lease));
  }
  return result;
}

// -------------------------------------------------------------------- write

absl::StatusOr<BeginWriteResult> Store::BeginWrite(const std::string& ns_name,
                                                   std::vector<BlockRef> blocks,
                                                   absl::Duration ttl) {
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
  absl::StatusOr<Namespace*> found_ns = FindNamespace(ns_name);
  if (!found_ns.ok()) return found_ns.status();
  Namespace* ns = *found_ns;

  auto lease = std::make_unique<WriteLease>();
  lease->ns_id = ns->id;
  lease->present.resize(blocks.size());
  lease->pages.resize(blocks.size());
  uint32_t missing = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::string index_key = IndexKey(ns->id, blocks[i].key);
    Shard& shard = ShardFor(index_key);
    MutexLock lock(&shard.mu);
    auto it = shard.index.find(index_key);
    lease->present[i] = it != shard.index.end();
    if (lease->present[i]) {
      Touch(shard, it->second.get());
    } else {
      ++missing;
    }
  }
  // Blocks of a namespace with a residual window arrive as fp16.
  const uint32_t per_block = ns->window_blocks > 0
                                 ? ns->pages_per_residual_block
                                 : ns->pages_per_block;
  const uint64_t needed = uint64_t{missing} * per_block;
  uint32_t total_pages;
  {
    MutexLock lock(&pool_mu_);
    total_pages = pool_.num_pages();
  }
  if (needed > total_pages) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%u blocks need %u pages; the whole pool has %u: split the write",
        missing, needed, total_pages));
  }
  std::vector<uint32_t> pages;
  if (!ReservePages(static_cast<uint32_t>(needed), &pages)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "pool full: %u pages needed and the rest is pinned or reserved by "
        "open leases; retry after leases end",
        needed));
  }
  reserved_pages_ += needed;
  size_t next = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (lease->present[i]) continue;
    lease->pages[i].assign(pages.begin() + next,
                           pages.begin() + next + per_block);
    next += per_block;
  }
  lease->blocks = std::move(blocks);
  lease->deadline = LeaseDeadline(ttl);

  BeginWriteResult result;
  result.present = lease->present;
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
    auto it = write_leases_.find(write_id);
    if (it == write_leases_.end()) {
      return absl::FailedPreconditionError(
          "write lease is unknown or has expired; begin the write again");
    }
    if (it->second->committing) {
      return absl::FailedPreconditionError(
          "this write lease is being committed by another call");
    }
    lease = it->second.get();
    lease->committing = true;  // the reaper leaves it alone from now on
  }
  Namespace* ns;
  {
    MutexLock lock(&ns_mu_);
    ns = namespaces_[lease->ns_id].get();
  }
  // From here the lease and its pages are ours alone: leases being committed
  // are never expired, and namespaces are never removed.
  const NamespaceInfo& info = ns->info;
  auto fail = [&](absl::Status status) {
    ReleaseWriteLease(write_id);
    return status;
  };
  std::vector<const Payload*> by_block(lease->blocks.size(), nullptr);
  for (const Payload& p : payloads) {
    if (p.index >= lease->blocks.size()) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("payload index ", p.index, " is outside the write's ",
                       lease->blocks.size(), " blocks")));
    }
    if (lease->present[p.index]) continue;  // stored already: not needed
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
    if (!lease->present[i] && by_block[i] == nullptr) {
      return fail(
          absl::InvalidArgumentError(absl::StrCat("no payload for block ", i)));
    }
  }

  const bool residual = ns->window_blocks > 0;
  const kernels::BlockShape& shape = info.config.shape;
  const kernels::CodecPolicy& policy =
      residual ? ns->residual_policy : info.config.policy;
  const uint64_t payload_bytes =
      residual ? ns->residual_payload_bytes : info.encoded_block_bytes;
  std::vector<uint8_t> stored(payload_bytes);
  std::vector<uint16_t> aligned;
  for (size_t i = 0; i < by_block.size(); ++i) {
    if (by_block[i] == nullptr) continue;
    absl::Span<const uint8_t> bytes = by_block[i]->fp16;
    absl::Span<const uint16_t> halves;
    if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(uint16_t) == 0) {
      halves = absl::MakeConstSpan(
          reinterpret_cast<const uint16_t*>(bytes.data()), bytes.size() / 2);
    } else {
      aligned.resize(bytes.size() / 2);
      std::memcpy(aligned.data(), bytes.data(), bytes.size());
      halves = aligned;
    }
    absl::Time start = absl::Now();
    absl::Status encoded =
        kernels::EncodeBlock(shape, policy, halves, absl::MakeSpan(stored));
    if (!encoded.ok()) {
      return fail(absl::Status(
          encoded.code(), absl::StrCat("block ", i, ": ", encoded.message())));
    }
    if (quantize_observer_) {
      quantize_observer_(policy.codec,
                         absl::ToDoubleSeconds(absl::Now() - start));
    }
    BlockHeader header = MakeBlockHeader(shape, policy, info.fingerprint,
                                         lease->blocks[i].key, stored);
    // The pages and their header slot are owned by this lease.
    absl::Status written = WriteHeader(lease->pages[i][0], header);
    if (written.ok()) written = pool_.Scatter(lease->pages[i], stored);
    if (!written.ok()) return fail(written);
  }

  CommitResult result;
  for (size_t i = 0; i < lease->blocks.size(); ++i) {
    if (lease->present[i]) {
      ++result.skipped;
      continue;
    }
    const BlockRef& ref = lease->blocks[i];
    // Count this block in its cached parent first, so that the parent is
    // never evictable while the child is visible.
    uint64_t parent_serial = 0;
    if (!ref.parent_key.empty() && ref.parent_key != ref.key) {
      std::string parent_index = IndexKey(ns->id, ref.parent_key);
      Shard& shard = ShardFor(parent_index);
      MutexLock lock(&shard.mu);
      auto it = shard.index.find(parent_index);
      if (it != shard.index.end()) {
        Entry* parent = it->second.get();
        ++parent->children;
        UpdateEvictable(shard, parent);
        parent_serial = parent->serial;
      }
    }
    bool inserted = false;
    {
      std::string index_key = IndexKey(ns->id, ref.key);
      Shard& shard = ShardFor(index_key);
      MutexLock lock(&shard.mu);
      if (!shard.index.contains(index_key)) {
        auto entry = std::make_unique<Entry>();
        entry->ns = ns;
        entry->ns_id = ns->id;
        entry->shard = static_cast<uint8_t>(&shard - shards_.get());
        entry->residual = residual;
        entry->codec = policy.codec;
        entry->tokens = shape.tokens_per_block;
        entry->serial = ++serial_;
        entry->last_access = ++tick_;
        entry->payload_bytes = payload_bytes;
        entry->logical_bytes = info.fp16_block_bytes;
        entry->key = ref.key;
        entry->parent_key = ref.parent_key;
        entry->parent_serial = parent_serial;
        entry->pages = std::move(lease->pages[i]);
        lease->pages[i].clear();
        reserved_pages_ -= entry->pages.size();
        Entry* raw = entry.get();
        shard.index.emplace(std::move(index_key), std::move(entry));
        AccountAdd(*raw, +1);
        UpdateEvictable(shard, raw);
        inserted = true;
        result.stored_bytes += raw->payload_bytes;
      }
    }
    if (!inserted) {
      ++result.skipped;  // committed by another writer meanwhile
      UnlinkParent({ns->id, ref.parent_key, parent_serial});
      continue;
    }
    ++result.stored;
    if (residual) QueueWindowExit(*ns, ref);
  }
  ReleaseWriteLease(write_id);  // returns pages of blocks skipped above
  return result;
}

absl::Status Store::AbortWrite(uint64_t write_id) {
  {
    MutexLock lock(&lease_mu_);
    auto it = write_leases_.find(write_id);
    if (it == write_leases_.end()) {
      return absl::NotFoundError("write lease is unknown or has expired");
    }
    if (it->second->committing) {
      return absl::FailedPreconditionError("write lease is being committed");
    }
  }
  ReleaseWriteLease(write_id);
  return absl::OkStatus();
}

// ------------------------------------------------------- KIVI residual window

void Store::QueueWindowExit(const Namespace& ns, const BlockRef& newest) {
  // `newest` is at distance 0; distances 0 .. window-1 stay fp16, so the
  // ancestor at distance `window` has just left the window.
  std::string key = newest.parent_key;
  for (uint32_t distance = 1; !key.empty(); ++distance) {
    std::string index_key = IndexKey(ns.id, key);
    Shard& shard = ShardFor(index_key);
    MutexLock lock(&shard.mu);
    auto it = shard.index.find(index_key);
    if (it == shard.index.end()) return;
    Entry* entry = it->second.get();
    if (distance == ns.window_blocks) {
      if (entry->residual) {
        MutexLock queue_lock(&reencode_mu_);
        reencode_queue_.push_back({ns.id, entry->key, entry->serial});
      }
      return;
    }
    key = entry->parent_key;
  }
}

bool Store::Reencode(const ReencodeJob& job) {
  Namespace* ns;
  {
    MutexLock lock(&ns_mu_);
    ns = namespaces_[job.ns_id].get();
  }
  const std::string index_key = IndexKey(job.ns_id, job.key);
  Shard& shard = ShardFor(index_key);
  Entry* entry;
  {
    MutexLock lock(&shard.mu);
    auto it = shard.index.find(index_key);
    if (it == shard.index.end()) return false;
    entry = it->second.get();
    if (entry->serial != job.serial || !entry->residual) return false;
    Pin(shard, entry);
  }
  // Pinned: pages, codec and the residual flag cannot change under us.
  const kernels::BlockShape& shape = ns->info.config.shape;
  const kernels::CodecPolicy& policy = ns->info.config.policy;
  std::vector<uint8_t> fp16(entry->payload_bytes);
  BlockHeader header;
  absl::Status status = pool_.Gather(entry->pages, absl::MakeSpan(fp16));
  if (status.ok()) status = ReadHeader(entry->pages[0], &header);
  if (status.ok()) {
    status = VerifyBlock(header, shape, ns->residual_policy,
                         ns->info.fingerprint, entry->key, fp16);
  }
  if (!status.ok()) {
    ParentLink link;
    {
      MutexLock lock(&shard.mu);
      ++data_loss_events_;
      if (!entry->removed) {
        link = RemoveEntry(shard, entry);
        ++evictions_data_loss_;
      }
      Unpin(shard, entry);
    }
    UnlinkParent(link);
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
  std::vector<uint32_t> pages;
  if (status.ok() && !ReservePages(ns->pages_per_block, &pages)) {
    status = absl::ResourceExhaustedError("no room to re-encode");
  }
  if (status.ok()) {
    BlockHeader new_header = MakeBlockHeader(
        shape, policy, ns->info.fingerprint, entry->key, encoded);
    status = WriteHeader(pages[0], new_header);
    if (status.ok()) status = pool_.Scatter(pages, encoded);
  }
  std::vector<uint32_t> to_release;
  bool swapped = false;
  bool retry = false;
  {
    MutexLock lock(&shard.mu);
    if (status.ok() && !entry->removed && entry->pins == 1) {
      // Nobody else holds the block: switch it to its encoded pages.
      AccountAdd(*entry, -1);
      pinned_pages_ -= entry->pages.size();
      to_release = std::move(entry->pages);
      entry->pages = std::move(pages);
      pinned_pages_ += entry->pages.size();
      entry->codec = policy.codec;
      entry->payload_bytes = encoded.size();
      entry->residual = false;
      AccountAdd(*entry, +1);
      swapped = true;
    } else {
      to_release = std::move(pages);
      retry = status.ok() && !entry->removed;  // a reader holds it: later
    }
    Unpin(shard, entry);
  }
  if (!to_release.empty()) ReleasePages(to_release);
  if (retry) {
    MutexLock lock(&reencode_mu_);
    reencode_queue_.push_back(job);
  }
  if (swapped) ++reencoded_blocks_;
  return swapped;
}

// --------------------------------------------------------------------- read

absl::StatusOr<ReadResult> Store::BeginRead(const std::string& ns_name,
                                            absl::Span<const std::string> keys,
                                            ReadFormat format,
                                            absl::Duration ttl,
                                            uint64_t pin_lease_id,
                                            bool keep_lease) {
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<Namespace*> found_ns = FindNamespace(ns_name);
  if (!found_ns.ok()) return found_ns.status();
  Namespace* ns = *found_ns;
  if (pin_lease_id != 0) {
    MutexLock lock(&lease_mu_);
    if (!read_leases_.contains(pin_lease_id)) {
      return absl::FailedPreconditionError(
          "pin lease is unknown or has expired");
    }
  }
  std::vector<Entry*> entries;
  for (size_t i = 0; i < keys.size(); ++i) {
    std::string index_key = IndexKey(ns->id, keys[i]);
    Shard& shard = ShardFor(index_key);
    Entry* entry = nullptr;
    {
      MutexLock lock(&shard.mu);
      auto it = shard.index.find(index_key);
      if (it != shard.index.end()) {
        entry = it->second.get();
        Pin(shard, entry);
        Touch(shard, entry);
      }
    }
    if (entry == nullptr) {
      UnpinAll(entries);
      return absl::NotFoundError(absl::StrCat("block ", i, " is not stored"));
    }
    entries.push_back(entry);
  }
  if (pin_lease_id != 0) ReleaseReadLease(pin_lease_id);

  ReadResult result;
  result.ns = ns->info;
  // Pinned pages are immutable and never reused, so they are read unlocked.
  const kernels::BlockShape& shape = ns->info.config.shape;
  std::vector<uint8_t> stored;
  absl::Status status;
  size_t failed = 0;
  for (size_t i = 0; i < entries.size() && status.ok(); ++i) {
    Entry* entry = entries[i];
    const kernels::CodecPolicy& policy =
        entry->residual ? ns->residual_policy : ns->info.config.policy;
    stored.resize(entry->payload_bytes);
    BlockHeader header;
    status = pool_.Gather(entry->pages, absl::MakeSpan(stored));
    if (status.ok()) status = ReadHeader(entry->pages[0], &header);
    if (!status.ok()) break;
    status = VerifyBlock(header, shape, policy, ns->info.fingerprint,
                         entry->key, stored);
    if (!status.ok()) {
      failed = i;
      status = absl::DataLossError(absl::StrCat(
          "block ", i, ": ", status.message(), "; the block was dropped"));
      break;
    }
    ReadBlock block;
    block.key = entry->key;
    block.codec = entry->codec;
    if (format == ReadFormat::kRaw) {
      block.data.assign(reinterpret_cast<const char*>(stored.data()),
                        stored.size());
    } else {
      block.data.resize(ns->info.fp16_block_bytes);
      status = kernels::DecodeBlock(
          shape, policy, stored,
          absl::MakeSpan(reinterpret_cast<uint16_t*>(block.data.data()),
                         block.data.size() / 2));
      if (!status.ok()) break;
    }
    result.blocks.push_back(std::move(block));
  }

  if (status.code() == absl::StatusCode::kDataLoss) {
    ++data_loss_events_;
    Entry* bad = entries[failed];
    ParentLink link;
    {
      Shard& shard = shards_[bad->shard];
      MutexLock lock(&shard.mu);
      if (!bad->removed) {
        link = RemoveEntry(shard, bad);
        ++evictions_data_loss_;
      }
    }
    UnlinkParent(link);
  }
  if (!status.ok() || !keep_lease) {
    UnpinAll(entries);
    if (!status.ok()) return status;
    return result;
  }
  auto lease = std::make_unique<ReadLease>();
  lease->entries = std::move(entries);
  lease->deadline = LeaseDeadline(ttl);
  MutexLock lock(&lease_mu_);
  result.lease_id = NewLeaseId();
  read_leases_.emplace(result.lease_id, std::move(lease));
  return result;
}

// ------------------------------------------------------------------- delete

absl::StatusOr<uint32_t> Store::Delete(const std::string& ns_name,
                                       absl::Span<const std::string> keys) {
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  uint32_t deleted = 0;
  for (const std::string& key : keys) {
    std::string index_key = IndexKey((*ns)->id, key);
    Shard& shard = ShardFor(index_key);
    ParentLink link;
    {
      MutexLock lock(&shard.mu);
      auto it = shard.index.find(index_key);
      if (it == shard.index.end()) continue;
      link = RemoveEntry(shard, it->second.get());
    }
    UnlinkParent(link);
    ++deleted;
  }
  deleted_ += deleted;
  return deleted;
}

// -------------------------------------------------------------- maintenance

int Store::RunMaintenance(absl::Time now) {
  ExpireLeases(now);
  if (options_.high_watermark < 1.0) {
    uint64_t total;
    {
      MutexLock lock(&pool_mu_);
      total = pool_.num_pages();
    }
    const double high = options_.high_watermark * total;
    const double low = options_.low_watermark * total;
    if (static_cast<double>(used_pages_ + reserved_pages_) > high) {
      while (static_cast<double>(used_pages_ + reserved_pages_) > low &&
             EvictOne(&evictions_watermark_)) {
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
    }
    if (Reencode(job)) ++reencoded;
  }
  return reencoded;
}

// -------------------------------------------------------------------- stats

StoreStats Store::Stats() const {
  StoreStats s;
  const uint64_t page = options_.page_size;
  uint64_t free_pages;
  {
    MutexLock lock(&pool_mu_);
    s.capacity_bytes = pool_.capacity_bytes();
    free_pages = pool_.free_pages();
  }
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
    s.pending_reencodes = reencode_queue_.size();
  }
  MutexLock lock(&ns_mu_);
  for (const auto& ns : namespaces_) {
    NamespaceStats n;
    n.name = ns->info.config.name;
    n.codec = ns->info.config.policy.codec;
    n.blocks = ns->blocks;
    n.tokens = n.blocks * ns->info.config.shape.tokens_per_block;
    n.residual_blocks = ns->residual_blocks;
    const kernels::BlockShape& shape = ns->info.config.shape;
    for (Codec codec : kernels::kAllCodecs) {
      kernels::CodecPolicy policy;
      policy.codec = codec;
      policy.fp16_layers = ns->info.config.policy.fp16_layers;
      policy.kivi_group_size = ns->info.config.policy.kivi_group_size;
      if (codec == n.codec) policy = ns->info.config.policy;
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
                                        const std::string& key, bool header) {
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  std::string index_key = IndexKey((*ns)->id, key);
  Shard& shard = ShardFor(index_key);
  MutexLock lock(&shard.mu);
  auto it = shard.index.find(index_key);
  if (it == shard.index.end())
    return absl::NotFoundError("block is not stored");
  const Entry& entry = *it->second;
  uint64_t offset = header ? uint64_t{entry.pages[0]} * sizeof(BlockHeader) + 20
                           : pool_.PageOffset(entry.pages[0]);
  uint8_t byte;
  if (absl::Status s = arena_->Read(offset, &byte, 1); !s.ok()) return s;
  byte ^= header ? 0x01 : 0x5A;
  return arena_->Write(offset, &byte, 1);
}

}  // namespace kvcache::store
