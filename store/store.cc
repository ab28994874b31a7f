#include "store/store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "store/block_header.h"

namespace kvcache::store {

using kernels::Codec;

struct Store::Namespace {
  uint32_t id = 0;
  NamespaceInfo info;
  uint32_t pages_per_block = 0;
  uint64_t blocks = 0;
};

struct Store::Entry {
  uint32_t ns_id = 0;
  std::string key;
  Codec codec = Codec::kNone;
  uint32_t tokens = 0;
  uint64_t stored_bytes = 0;  // header + payload
  uint64_t logical_bytes = 0;
  std::vector<uint32_t> pages;
  Entry* parent = nullptr;
  std::vector<Entry*> children;
  uint32_t pins = 0;
  uint64_t last_access = 0;
  bool evictable = false;
  bool removed = false;
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

uint64_t Fingerprint(const NamespaceConfig& c) {
  std::string s = absl::StrCat(
      c.name, "|", c.model, "|", c.revision, "|", c.tp_rank, "|",
      c.shape.num_layers, "|", c.shape.num_kv_heads, "|", c.shape.head_dim, "|",
      c.shape.tokens_per_block, "|fp16|", static_cast<int>(c.policy.codec), "|",
      static_cast<int>(c.policy.scale_mode), "|", c.policy.kivi_group_size,
      "|");
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
  return std::unique_ptr<Store>(
      new Store(options, std::move(arena)));  // private constructor
}

namespace {

// Bytes at the start of the arena that hold one BlockHeader per page.
uint64_t HeaderSlabBytes(uint64_t arena_bytes, uint32_t page_size) {
  uint64_t pages = arena_bytes / (page_size + sizeof(BlockHeader));
  return (pages * sizeof(BlockHeader) + 4095) / 4096 * 4096;
}

}  // namespace

Store::Store(const StoreOptions& options, std::unique_ptr<Arena> arena)
    : options_(options),
      arena_(std::move(arena)),
      header_slab_(reinterpret_cast<BlockHeader*>(arena_->base())),
      pool_(arena_->base() + HeaderSlabBytes(arena_->size(), options.page_size),
            arena_->size() - HeaderSlabBytes(arena_->size(), options.page_size),
            options.page_size) {}

BlockHeader* Store::HeaderSlot(uint32_t first_page) const {
  return header_slab_ + first_page;
}

Store::~Store() = default;

void Store::SetQuantizeObserver(QuantizeObserver observer) {
  quantize_observer_ = std::move(observer);
}

absl::StatusOr<NamespaceInfo> Store::RegisterNamespace(NamespaceConfig config) {
  if (absl::Status s = ValidateName(config.name); !s.ok()) return s;
  if (!config.codec_specified) config.policy.codec = options_.default_codec;
  if (absl::Status s = kernels::ValidatePolicy(config.shape, config.policy);
      !s.ok()) {
    return s;
  }
  NamespaceInfo info;
  info.fingerprint = Fingerprint(config);
  info.fp16_block_bytes = kernels::Fp16BlockBytes(config.shape);
  info.encoded_block_bytes =
      kernels::EncodedBlockBytes(config.shape, config.policy);
  info.config = std::move(config);

  MutexLock lock(&mu_);
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
  ns->pages_per_block = pool_.PagesFor(StoredBytesFor(*ns));
  if (ns->pages_per_block > pool_.num_pages()) {
    return absl::InvalidArgumentError(
        absl::StrCat("one block of this layout (", StoredBytesFor(*ns),
                     " bytes) is larger than the whole pool"));
  }
  namespaces_.push_back(std::move(ns));
  return info;
}

uint64_t Store::StoredBytesFor(const Namespace& ns) const {
  return ns.info.encoded_block_bytes;
}

absl::StatusOr<NamespaceInfo> Store::GetNamespace(
    const std::string& name) const {
  MutexLock lock(&mu_);
  absl::StatusOr<Namespace*> ns = FindNamespace(name);
  if (!ns.ok()) return ns.status();
  return (*ns)->info;
}

absl::StatusOr<Store::Namespace*> Store::FindNamespace(
    const std::string& name) const {
  for (const auto& ns : namespaces_) {
    if (ns->info.config.name == name) return ns.get();
  }
  return absl::NotFoundError(
      absl::StrCat("namespace '", name, "' is not registered"));
}

Store::Entry* Store::FindEntry(uint32_t ns_id, const std::string& key) const {
  auto it = index_.find(IndexKey(ns_id, key));
  return it == index_.end() ? nullptr : it->second.get();
}

void Store::Touch(Entry* entry) {
  if (entry->evictable) evictable_.erase({entry->last_access, entry});
  entry->last_access = ++tick_;
  if (entry->evictable) evictable_.insert({entry->last_access, entry});
}

void Store::UpdateEvictable(Entry* entry) {
  bool should = !entry->removed && entry->pins == 0 && entry->children.empty();
  if (should == entry->evictable) return;
  if (should) {
    evictable_.insert({entry->last_access, entry});
  } else {
    evictable_.erase({entry->last_access, entry});
  }
  entry->evictable = should;
}

bool Store::EvictOne() {
  if (evictable_.empty()) return false;
  Entry* victim = evictable_.begin()->second;
  RemoveEntry(victim);
  ++counters_.evictions_capacity;
  return true;
}

bool Store::ReservePages(uint32_t count, std::vector<uint32_t>* pages) {
  // Refuse before evicting anything when eviction could not make room.
  uint64_t evictable_pages = 0;
  if (pool_.free_pages() < count) {
    for (const auto& [tick, entry] : evictable_) {
      evictable_pages += entry->pages.size();
      if (pool_.free_pages() + evictable_pages >= count) break;
    }
    if (pool_.free_pages() + evictable_pages < count) return false;
  }
  while (pool_.free_pages() < count) {
    if (!EvictOne()) return false;
  }
  return pool_.Allocate(count, pages);
}

void Store::RemoveEntry(Entry* entry) {
  if (entry->evictable) {
    evictable_.erase({entry->last_access, entry});
    entry->evictable = false;
  }
  entry->removed = true;
  if (Entry* parent = entry->parent; parent != nullptr) {
    auto& siblings = parent->children;
    siblings.erase(std::remove(siblings.begin(), siblings.end(), entry),
                   siblings.end());
    entry->parent = nullptr;
    UpdateEvictable(parent);
  }
  for (Entry* child : entry->children) child->parent = nullptr;
  entry->children.clear();

  CodecStats& cs = per_codec_[CodecIndex(entry->codec)];
  --cs.blocks;
  cs.tokens -= entry->tokens;
  cs.stored_bytes -= entry->pages.size() * pool_.page_size();
  cs.logical_bytes -= entry->logical_bytes;
  used_pages_ -= entry->pages.size();
  used_payload_bytes_ -= entry->stored_bytes;
  --namespaces_[entry->ns_id]->blocks;

  auto node = index_.extract(IndexKey(entry->ns_id, entry->key));
  if (entry->pins > 0) {
    zombies_.emplace(entry, std::move(node.mapped()));
    return;
  }
  pool_.Release(entry->pages);
}

void Store::Unpin(Entry* entry) {
  if (--entry->pins > 0) return;
  pinned_pages_ -= entry->pages.size();
  if (entry->removed) {
    pool_.Release(entry->pages);
    zombies_.erase(entry);
    return;
  }
  UpdateEvictable(entry);
}

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

absl::StatusOr<LookupResult> Store::Lookup(const std::string& ns_name,
                                           absl::Span<const std::string> keys,
                                           bool pin, absl::Duration ttl) {
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  MutexLock lock(&mu_);
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  LookupResult result;
  std::vector<Entry*> found;
  for (const std::string& key : keys) {
    Entry* entry = FindEntry((*ns)->id, key);
    if (entry == nullptr) break;
    Touch(entry);
    found.push_back(entry);
  }
  result.prefix_blocks = static_cast<uint32_t>(found.size());
  counters_.lookup_hits += found.size();
  counters_.lookup_misses += keys.size() - found.size();
  if (pin && !found.empty()) {
    auto lease = std::make_unique<ReadLease>();
    lease->deadline = LeaseDeadline(ttl);
    for (Entry* entry : found) {
      if (entry->pins++ == 0) pinned_pages_ += entry->pages.size();
      UpdateEvictable(entry);
    }
    lease->entries = std::move(found);
    result.lease_id = NewLeaseId();
    read_leases_.emplace(result.lease_id, std::move(lease));
  }
  return result;
}

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

  MutexLock lock(&mu_);
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  auto lease = std::make_unique<WriteLease>();
  lease->ns_id = (*ns)->id;
  lease->present.resize(blocks.size());
  lease->pages.resize(blocks.size());
  uint32_t missing = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    Entry* entry = FindEntry((*ns)->id, blocks[i].key);
    lease->present[i] = entry != nullptr;
    if (entry != nullptr) {
      Touch(entry);
    } else {
      ++missing;
    }
  }
  uint32_t per_block = (*ns)->pages_per_block;
  uint64_t needed = static_cast<uint64_t>(missing) * per_block;
  if (needed > pool_.num_pages()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%u blocks need %u pages; the whole pool has %u: split the write",
        missing, needed, pool_.num_pages()));
  }
  std::vector<uint32_t> pages;
  if (!ReservePages(static_cast<uint32_t>(needed), &pages)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "pool full: %u pages needed, %u free and the rest pinned or reserved "
        "by open leases; retry after leases end",
        needed, pool_.free_pages()));
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
  result.fp16_block_bytes = (*ns)->info.fp16_block_bytes;
  result.deadline = lease->deadline;
  result.write_id = NewLeaseId();
  write_leases_.emplace(result.write_id, std::move(lease));
  return result;
}

void Store::ReleaseWriteLease(uint64_t id) {
  auto it = write_leases_.find(id);
  if (it == write_leases_.end()) return;
  for (const auto& pages : it->second->pages) {
    pool_.Release(pages);
    reserved_pages_ -= pages.size();
  }
  write_leases_.erase(it);
}

void Store::ReleaseReadLease(uint64_t id) {
  auto it = read_leases_.find(id);
  if (it == read_leases_.end()) return;
  for (Entry* entry : it->second->entries) Unpin(entry);
  read_leases_.erase(it);
}

absl::StatusOr<CommitResult> Store::CommitWrite(
    uint64_t write_id, absl::Span<const Payload> payloads) {
  WriteLease* lease = nullptr;
  Namespace* ns = nullptr;
  {
    MutexLock lock(&mu_);
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
    ns = namespaces_[lease->ns_id].get();
  }
  // From here the lease, its pages and the namespace are ours alone: leases
  // being committed are never expired and namespaces are never removed.
  const NamespaceInfo& info = ns->info;
  auto fail = [&](absl::Status status) {
    MutexLock lock(&mu_);
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
                       " bytes; this layout's "
                       "fp16 block is ",
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

  const kernels::BlockShape& shape = info.config.shape;
  const kernels::CodecPolicy& policy = info.config.policy;
  std::vector<uint8_t> stored(info.encoded_block_bytes);
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
    absl::Span<uint8_t> payload = absl::MakeSpan(stored);
    absl::Time start = absl::Now();
    absl::Status encoded = kernels::EncodeBlock(shape, policy, halves, payload);
    if (!encoded.ok()) {
      return fail(absl::Status(
          encoded.code(), absl::StrCat("block ", i, ": ", encoded.message())));
    }
    if (quantize_observer_) {
      quantize_observer_(policy.codec,
                         absl::ToDoubleSeconds(absl::Now() - start));
    }
    BlockHeader header = MakeBlockHeader(shape, policy, info.fingerprint,
                                         lease->blocks[i].key, payload);
    // Pages and their header slot are owned by this lease.
    std::memcpy(HeaderSlot(lease->pages[i][0]), &header, sizeof(header));
    pool_.Scatter(lease->pages[i], stored);
  }

  CommitResult result;
  MutexLock lock(&mu_);
  for (size_t i = 0; i < lease->blocks.size(); ++i) {
    if (lease->present[i]) {
      ++result.skipped;
      continue;
    }
    const BlockRef& ref = lease->blocks[i];
    if (FindEntry(ns->id, ref.key) != nullptr) {
      ++result.skipped;  // committed by another writer meanwhile
      continue;
    }
    auto entry = std::make_unique<Entry>();
    entry->ns_id = ns->id;
    entry->key = ref.key;
    entry->codec = policy.codec;
    entry->tokens = shape.tokens_per_block;
    entry->stored_bytes = stored.size();
    entry->logical_bytes = info.fp16_block_bytes;
    entry->pages = std::move(lease->pages[i]);
    lease->pages[i].clear();
    reserved_pages_ -= entry->pages.size();
    entry->last_access = ++tick_;
    Entry* raw = entry.get();
    index_.emplace(IndexKey(ns->id, ref.key), std::move(entry));
    if (!ref.parent_key.empty()) {
      if (Entry* parent = FindEntry(ns->id, ref.parent_key);
          parent != nullptr && parent != raw) {
        raw->parent = parent;
        parent->children.push_back(raw);
        UpdateEvictable(parent);
      }
    }
    UpdateEvictable(raw);
    CodecStats& cs = per_codec_[CodecIndex(raw->codec)];
    ++cs.blocks;
    cs.tokens += raw->tokens;
    cs.stored_bytes += raw->pages.size() * pool_.page_size();
    cs.logical_bytes += raw->logical_bytes;
    used_pages_ += raw->pages.size();
    used_payload_bytes_ += raw->stored_bytes;
    ++ns->blocks;
    ++result.stored;
    result.stored_bytes += raw->stored_bytes;
  }
  ReleaseWriteLease(write_id);  // returns pages of blocks skipped above
  return result;
}

absl::Status Store::AbortWrite(uint64_t write_id) {
  MutexLock lock(&mu_);
  auto it = write_leases_.find(write_id);
  if (it == write_leases_.end()) {
    return absl::NotFoundError("write lease is unknown or has expired");
  }
  if (it->second->committing) {
    return absl::FailedPreconditionError("write lease is being committed");
  }
  ReleaseWriteLease(write_id);
  return absl::OkStatus();
}

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
  std::vector<Entry*> entries;
  ReadResult result;
  {
    MutexLock lock(&mu_);
    absl::StatusOr<Namespace*> ns = FindNamespace(ns_name);
    if (!ns.ok()) return ns.status();
    if (pin_lease_id != 0 && !read_leases_.contains(pin_lease_id)) {
      return absl::FailedPreconditionError(
          "pin lease is unknown or has expired");
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      Entry* entry = FindEntry((*ns)->id, keys[i]);
      if (entry == nullptr) {
        return absl::NotFoundError(absl::StrCat("block ", i, " is not stored"));
      }
      entries.push_back(entry);
    }
    for (Entry* entry : entries) {
      if (entry->pins++ == 0) pinned_pages_ += entry->pages.size();
      UpdateEvictable(entry);
      Touch(entry);
    }
    if (pin_lease_id != 0) ReleaseReadLease(pin_lease_id);
    result.ns = (*ns)->info;
  }
  // Pinned pages are immutable and never reused, so they are read unlocked.
  const kernels::BlockShape& shape = result.ns.config.shape;
  const kernels::CodecPolicy& policy = result.ns.config.policy;
  std::vector<uint8_t> stored;
  absl::Status status;
  size_t failed = 0;
  for (size_t i = 0; i < entries.size() && status.ok(); ++i) {
    Entry* entry = entries[i];
    stored.resize(entry->stored_bytes);
    pool_.Gather(entry->pages, absl::MakeSpan(stored));
    BlockHeader header;
    std::memcpy(&header, HeaderSlot(entry->pages[0]), sizeof(header));
    absl::Span<const uint8_t> payload = absl::MakeConstSpan(stored);
    status = VerifyBlock(header, shape, policy, result.ns.fingerprint,
                         entry->key, payload);
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
      block.data.assign(reinterpret_cast<const char*>(payload.data()),
                        payload.size());
    } else {
      block.data.resize(result.ns.fp16_block_bytes);
      status = kernels::DecodeBlock(
          shape, policy, payload,
          absl::MakeSpan(reinterpret_cast<uint16_t*>(block.data.data()),
                         block.data.size() / 2));
      if (!status.ok()) break;
    }
    result.blocks.push_back(std::move(block));
  }

  MutexLock lock(&mu_);
  if (status.code() == absl::StatusCode::kDataLoss) {
    ++counters_.data_loss_events;
    if (!entries[failed]->removed) {
      RemoveEntry(entries[failed]);
      ++counters_.evictions_data_loss;
    }
  }
  if (!status.ok() || !keep_lease) {
    for (Entry* entry : entries) Unpin(entry);
    if (!status.ok()) return status;
    return result;
  }
  auto lease = std::make_unique<ReadLease>();
  lease->entries = std::move(entries);
  lease->deadline = LeaseDeadline(ttl);
  result.lease_id = NewLeaseId();
  read_leases_.emplace(result.lease_id, std::move(lease));
  return result;
}

absl::Status Store::EndLease(uint64_t lease_id) {
  MutexLock lock(&mu_);
  if (!read_leases_.contains(lease_id)) {
    return absl::NotFoundError("read lease is unknown or has expired");
  }
  ReleaseReadLease(lease_id);
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Store::Delete(const std::string& ns_name,
                                       absl::Span<const std::string> keys) {
  if (absl::Status s = ValidateKeys(keys, options_.max_blocks_per_request);
      !s.ok()) {
    return s;
  }
  MutexLock lock(&mu_);
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  uint32_t deleted = 0;
  for (const std::string& key : keys) {
    if (Entry* entry = FindEntry((*ns)->id, key); entry != nullptr) {
      RemoveEntry(entry);
      ++deleted;
    }
  }
  counters_.deleted += deleted;
  return deleted;
}

int Store::ExpireLeases(absl::Time now) {
  MutexLock lock(&mu_);
  std::vector<uint64_t> reads, writes;
  for (const auto& [id, lease] : read_leases_) {
    if (lease->deadline < now) reads.push_back(id);
  }
  for (const auto& [id, lease] : write_leases_) {
    if (lease->deadline < now && !lease->committing) writes.push_back(id);
  }
  for (uint64_t id : reads) ReleaseReadLease(id);
  for (uint64_t id : writes) ReleaseWriteLease(id);
  int expired = static_cast<int>(reads.size() + writes.size());
  counters_.expired_leases += expired;
  return expired;
}

StoreStats Store::Stats() const {
  MutexLock lock(&mu_);
  StoreStats s = counters_;
  const uint64_t page = pool_.page_size();
  s.page_size = pool_.page_size();
  s.capacity_bytes = pool_.capacity_bytes();
  s.used_bytes = used_pages_ * page;
  s.reserved_bytes = reserved_pages_ * page;
  s.pinned_bytes = pinned_pages_ * page;
  s.fragmentation_bytes = s.used_bytes - used_payload_bytes_;
  s.codecs = per_codec_;
  s.active_read_leases = static_cast<uint32_t>(read_leases_.size());
  s.active_write_leases = static_cast<uint32_t>(write_leases_.size());
  const uint64_t free_pages = pool_.free_pages();
  for (const auto& ns : namespaces_) {
    NamespaceStats n;
    n.name = ns->info.config.name;
    n.codec = ns->info.config.policy.codec;
    n.blocks = ns->blocks;
    n.tokens = ns->blocks * ns->info.config.shape.tokens_per_block;
    for (Codec codec : kernels::kAllCodecs) {
      kernels::CodecPolicy policy;
      policy.codec = codec;
      policy.fp16_layers = ns->info.config.policy.fp16_layers;
      policy.kivi_group_size = ns->info.config.policy.kivi_group_size;
      if (codec == n.codec) policy = ns->info.config.policy;
      const kernels::BlockShape& shape = ns->info.config.shape;
      if (!kernels::ValidatePolicy(shape, policy).ok()) continue;
      uint64_t pages_per_block =
          pool_.PagesFor(kernels::EncodedBlockBytes(shape, policy));
      n.tokens_that_fit[CodecIndex(codec)] =
          free_pages / pages_per_block * shape.tokens_per_block;
    }
    s.namespaces.push_back(std::move(n));
  }
  return s;
}

absl::Status Store::CorruptBlockForTest(const std::string& ns_name,
                                        const std::string& key, bool header) {
  MutexLock lock(&mu_);
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_name);
  if (!ns.ok()) return ns.status();
  Entry* entry = FindEntry((*ns)->id, key);
  if (entry == nullptr) return absl::NotFoundError("block is not stored");
  if (header) {
    reinterpret_cast<uint8_t*>(HeaderSlot(entry->pages[0]))[20] ^= 0x01;
  } else {
    pool_.PageAddress(entry->pages[0])[0] ^= 0x5A;
  }
  return absl::OkStatus();
}

}  // namespace kvcache::store
