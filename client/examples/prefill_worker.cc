// kvcache-prefill_worker: an example prefill worker.
//
// It "runs prefill" on a synthetic prompt: writes the prompt's synthetic KV
// into a vLLM-style paged cache (per layer [2, num_blocks, block_size,
// kv_heads, head_dim], or HND) through a shuffled block table, hashes the
// prompt's full blocks with the v1 block hash, looks up what the cluster has
// already, gathers the rest into store blocks and stores them on their
// owning nodes. Run kvcache-decode_worker with the same flags to load it.
#include <cstdio>
#include <map>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kernels/codec.h"
#include "worker_common.h"

namespace kvcache::examples {
namespace {

// One function on purpose (longer than the usual ~80 lines): the example
// reads top to bottom as the steps a prefill worker takes, in order.
int Run(const WorkerArgs& a) {
  auto client = MakeClient(a);
  if (!client.ok()) {
    std::fprintf(stderr, "client: %s\n", client.status().ToString().c_str());
    return 1;
  }
  ClusterClient& cc = **client;
  const NamespaceSpec spec = Spec(a);
  if (auto info = cc.RegisterNamespace(spec); !info.ok()) {
    std::fprintf(stderr, "register %s: %s\n", spec.name.c_str(),
                 info.status().ToString().c_str());
    return 1;
  }
  const std::vector<uint32_t> tokens = Prompt(a);

  // Prefill: the engine computes KV into its paged cache.
  EngineCache engine = MakeEngineCache(a, a.prompt_tokens, a.prompt_seed + 1);
  for (uint64_t p = 0; p < tokens.size(); ++p) {
    for (uint32_t l = 0; l < a.layers; ++l) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        for (uint32_t h = 0; h < a.kv_heads; ++h) {
          uint16_t* row =
              engine.tensors[l].data() + EngineOffset(engine, kv, p, h);
          for (uint32_t d = 0; d < a.head_dim; ++d) {
            row[d] = SyntheticKv(a, p, tokens[p], l, kv, h, d);
          }
        }
      }
    }
  }

  // Keys of the full blocks, and what the cluster holds already.
  auto keys = BlockHashChain(HashConfig(a), tokens);
  if (!keys.ok()) {
    std::fprintf(stderr, "hash: %s\n", keys.status().ToString().c_str());
    return 1;
  }
  auto hit = cc.Lookup(spec.name, *keys);
  if (!hit.ok()) {
    std::fprintf(stderr, "lookup: %s\n", hit.status().ToString().c_str());
    return 1;
  }
  const uint32_t first = hit->prefix_blocks;

  // Gather the blocks after the cached prefix and store them.
  const size_t halves = kernels::Fp16BlockBytes(spec.shape) / 2;
  std::vector<std::vector<uint16_t>> staging(keys->size() - first,
                                             std::vector<uint16_t>(halves));
  std::vector<BlockWrite> writes;
  const PagedKvView view = engine.View();
  std::map<std::string, int> per_node;
  for (uint32_t b = first; b < keys->size(); ++b) {
    std::vector<uint16_t>& buf = staging[b - first];
    absl::Status st = GatherStoreBlock(view, engine.block_table, spec.shape, b,
                                       absl::MakeSpan(buf));
    if (!st.ok()) {
      std::fprintf(stderr, "gather: %s\n", st.ToString().c_str());
      return 1;
    }
    BlockWrite w;
    w.key = (*keys)[b];
    w.parent_key = b > 0 ? (*keys)[b - 1] : "";
    w.fp16 = buf;
    writes.push_back(std::move(w));
    ++per_node[cc.OwnerOf((*keys)[b])];
  }
  ClusterPutResult put;
  const absl::Time start = absl::Now();
  if (!writes.empty()) {
    auto r = cc.Put(spec.name, writes);
    if (!r.ok()) {
      std::fprintf(stderr, "put: %s\n", r.status().ToString().c_str());
      return 1;
    }
    put = *r;
  }
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);

  std::printf("prefill: namespace %s, %zu tokens, %zu full blocks of %u\n",
              spec.name.c_str(), tokens.size(), keys->size(),
              a.tokens_per_block);
  std::printf("prefill: first key %s\n",
              keys->empty() ? "-" : HexKey((*keys)[0]).c_str());
  std::printf(
      "prefill: cached already %u, stored %u, skipped %u, "
      "unavailable %u, rejected %u (%.1f MiB in %.3f s)\n",
      first, put.stored, put.skipped, put.unavailable, put.rejected,
      writes.size() * halves * 2.0 / (1 << 20), secs);
  for (const auto& [node, n] : per_node) {
    std::printf("prefill:   %d blocks -> %s\n", n, node.c_str());
  }
  if (put.unavailable + put.rejected > 0) {
    // A prefill that could not store its KV says why, and fails when it
    // stored none of it.
    std::fprintf(stderr, "prefill: %u blocks not stored: %s\n",
                 put.unavailable + put.rejected,
                 put.why_not_stored.ToString().c_str());
    if (put.stored + put.skipped == 0) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvcache::examples

int main(int argc, char** argv) {
  kvcache::examples::WorkerArgs args;
  if (!kvcache::examples::ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr, "usage: kvcache-prefill_worker\n%s",
                 kvcache::examples::kCommonUsage);
    return 64;
  }
  return kvcache::examples::Run(args);
}
