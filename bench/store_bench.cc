// Store benchmarks (issue: store engine): page allocation and release, a
// 64-key prefix lookup, and the index's heap bytes per stored block. Each
// timing runs next to a baseline in the same process (a bare vector
// push/pop for allocation; 64 finds in an absl::flat_hash_map<string,int>
// for lookup), and the ratio is reported as a counter.
#include <malloc.h>

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "kernels/codec.h"
#include "store/store.h"

namespace kvcache::store {
namespace {

// One 4 KiB page per block: 1 layer, 1 head, head_dim 32, 32 tokens, fp16.
NamespaceConfig TinyConfig() {
  NamespaceConfig c;
  c.name = "bench";
  c.shape = {1, 1, 32, 32};
  c.policy.codec = kernels::Codec::kNone;
  c.residual_tokens = 0;
  return c;
}

std::string BlockKey(int i) {
  // 16-byte keys, like a 128-bit chained prefix hash.
  std::string k = absl::StrCat("k", i);
  k.resize(16, '.');
  return k;
}

std::unique_ptr<Store> MakeStore(uint64_t blocks) {
  StoreOptions options;
  options.page_size = 4096;
  options.max_blocks_per_request = 4096;
  auto arena =
      CreateArena({MemoryKind::kHost, 0, (blocks + 16) * (4096 + 128)});
  auto store = Store::Create(options, *std::move(arena));
  if (!store.ok() || !(*store)->RegisterNamespace(TinyConfig()).ok()) {
    return nullptr;
  }
  return *std::move(store);
}

// The 64-key prefixes of the chains that Fill stores.
std::vector<std::vector<std::string>> ChainQueries(int blocks) {
  std::vector<std::vector<std::string>> queries;
  for (int first = 0; first + 64 <= blocks; first += 64) {
    std::vector<std::string> q;
    for (int i = first; i < first + 64; ++i) q.push_back(BlockKey(i));
    queries.push_back(std::move(q));
  }
  return queries;
}

// Stores blocks [0, n) as chains of 64 (each block the previous one's child).
bool Fill(Store* store, int n) {
  std::vector<uint16_t> fp16(32 * 32 * 2, 0x3C00);
  for (int first = 0; first < n; first += 64) {
    std::vector<BlockRef> refs;
    for (int i = first; i < std::min(n, first + 64); ++i) {
      refs.push_back({BlockKey(i), ""});
    }
    auto begin = store->BeginWrite("bench", refs, absl::Seconds(60));
    if (!begin.ok()) return false;
    std::vector<Store::Payload> payloads;
    for (uint32_t i = 0; i < refs.size(); ++i) {
      payloads.push_back(
          {i, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(fp16.data()),
                                  fp16.size() * 2)});
    }
    if (!store->CommitWrite(begin->write_id, payloads).ok()) return false;
  }
  return true;
}

void BM_PagePoolAllocateRelease(benchmark::State& state) {
  const uint32_t pages_per_block = static_cast<uint32_t>(state.range(0));
  auto arena = CreateArena({MemoryKind::kHost, 0, 1ull << 30});
  PagePool pool(arena->get(), 0, (*arena)->size(), 64 * 1024);
  PageList pages;
  for (auto _ : state) {
    benchmark::DoNotOptimize(pool.Allocate(pages_per_block, &pages));
    pool.Release(pages);
  }
  state.counters["pages"] = pages_per_block;
}
BENCHMARK(BM_PagePoolAllocateRelease)->Arg(1)->Arg(16)->Arg(64);

// The whole store path of a one-block write reservation and its release:
// BeginWrite (index probe, page reservation, lease) + AbortWrite.
void BM_StoreReserveRelease(benchmark::State& state) {
  auto store = MakeStore(1024);
  std::vector<BlockRef> refs = {{BlockKey(1 << 30), ""}};
  for (auto _ : state) {
    auto begin = store->BeginWrite("bench", refs, absl::Seconds(60));
    benchmark::DoNotOptimize(store->AbortWrite(begin->write_id));
  }
}
BENCHMARK(BM_StoreReserveRelease);

void BM_Lookup64(benchmark::State& state) {
  const int blocks = static_cast<int>(state.range(0));
  auto store = MakeStore(blocks);
  if (store == nullptr || !Fill(store.get(), blocks)) {
    state.SkipWithError("fill failed");
    return;
  }
  const std::vector<std::vector<std::string>> queries = ChainQueries(blocks);
  size_t next = 0;
  for (auto _ : state) {
    auto r = store->Lookup("bench", queries[next], false, absl::ZeroDuration());
    benchmark::DoNotOptimize(r);
    if (++next == queries.size()) next = 0;
  }
  state.counters["keys_per_lookup"] = 64;
}
BENCHMARK(BM_Lookup64)->Arg(1 << 14)->Arg(1 << 17);

// Baseline for BM_Lookup64: 64 finds in a bare hash map of the same keys.
void BM_Baseline64MapFinds(benchmark::State& state) {
  const int blocks = static_cast<int>(state.range(0));
  absl::flat_hash_map<std::string, int> map;
  for (int i = 0; i < blocks; ++i) map[BlockKey(i)] = i;
  const std::vector<std::vector<std::string>> queries = ChainQueries(blocks);
  size_t next = 0;
  for (auto _ : state) {
    int found = 0;
    for (const std::string& k : queries[next]) found += map.contains(k);
    benchmark::DoNotOptimize(found);
    if (++next == queries.size()) next = 0;
  }
}
BENCHMARK(BM_Baseline64MapFinds)->Arg(1 << 14)->Arg(1 << 17);

// Heap bytes the index holds per stored block (entries, keys, page lists,
// hash slots, LRU nodes), from malloc's own accounting; the arena is an
// mmap outside the heap.
void BM_IndexBytesPerBlock(benchmark::State& state) {
  const int blocks = static_cast<int>(state.range(0));
  double per_block = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto store = MakeStore(blocks);
    size_t before = mallinfo2().uordblks;
    state.ResumeTiming();
    if (!Fill(store.get(), blocks)) {
      state.SkipWithError("fill failed");
      return;
    }
    state.PauseTiming();
    per_block = static_cast<double>(mallinfo2().uordblks - before) / blocks;
    store.reset();
    state.ResumeTiming();
  }
  state.counters["index_bytes_per_block"] = per_block;
}
BENCHMARK(BM_IndexBytesPerBlock)->Arg(1 << 16)->Iterations(1);

}  // namespace
}  // namespace kvcache::store

BENCHMARK_MAIN();
