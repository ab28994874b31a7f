// Shared by the example workers: flags, the cluster client, the namespace,
// a synthetic prompt and its synthetic KV, and an engine-style paged cache.
//
// The KV of token p is a pure function of (seed, p, token id, layer, K|V,
// head, channel), so the decode worker knows exactly which bytes the prefill
// worker stored without talking to it.
#ifndef KVCACHE_CLIENT_EXAMPLES_WORKER_COMMON_H_
#define KVCACHE_CLIENT_EXAMPLES_WORKER_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/codec.h"
#include "kernels/half.h"
#include "kvcache/block_hash.h"
#include "kvcache/cluster_client.h"
#include "kvcache/paged_layout.h"

namespace kvcache::examples {

struct WorkerArgs {
  std::vector<std::string> nodes;  // --nodes=host:port,host:port
  std::string dns;                 // --dns=name:port
  std::string token_file;          // --token-file: a tenant's bearer token
  std::string ns = "example/llama-8L";
  Codec codec = Codec::kNone;
  SourceDtype dtype = SourceDtype::kFp16;  // the engine's KV dtype
  uint32_t prompt_tokens = 1000;
  uint64_t prompt_seed = 1;
  uint64_t hash_seed = 0;
  std::string salt;  // extra key: a cache salt
  // Blocks per routing segment (kept on one node; 0: place every block by
  // itself). Prefill and decode workers must agree.
  uint32_t segment_blocks = 16;
  uint32_t layers = 8;
  uint32_t kv_heads = 4;
  uint32_t head_dim = 64;
  uint32_t tokens_per_block = 32;
  uint32_t engine_block_size = 16;
  PagedOrder order = PagedOrder::kNHD;
  ReadFormat format = ReadFormat::kFp16;  // decode worker
  int timeout_ms = 5000;
};

inline const char* kCommonUsage =
    "  --nodes=HOST:PORT[,HOST:PORT...] | --dns=NAME:PORT\n"
    "  [--namespace=NAME] [--codec=none|fp8_e4m3|fp8_e5m2|kivi2|kivi4]\n"
    "  [--dtype=fp16|bf16]\n"
    "  [--prompt-tokens=N] [--prompt-seed=N] [--hash-seed=N] [--salt=S]\n"
    "  [--segment-blocks=N]\n"
    "  [--layers=N] [--kv-heads=N] [--head-dim=N] [--tokens-per-block=N]\n"
    "  [--engine-block-size=N] [--layout=nhd|hnd] [--format=fp16|raw]\n"
    "  [--timeout-ms=N] [--token-file=FILE]\n";

template <typename T>
bool ParseNumber(absl::string_view v, T* out) {
  return absl::SimpleAtoi(v, out);
}

inline bool ParseArgs(int argc, char** argv, WorkerArgs* a) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    absl::string_view v;
    auto flag = [&](absl::string_view name) {
      v = arg;
      return absl::ConsumePrefix(&v, name);
    };
    bool ok = true;
    if (flag("--nodes=")) {
      a->nodes = absl::StrSplit(v, ',', absl::SkipEmpty());
    } else if (flag("--dns=")) {
      a->dns = std::string(v);
    } else if (flag("--namespace=")) {
      a->ns = std::string(v);
    } else if (flag("--codec=")) {
      std::optional<Codec> c = kernels::CodecFromName(v);
      ok = c.has_value();
      if (ok) a->codec = *c;
    } else if (flag("--dtype=")) {
      std::optional<SourceDtype> d = SourceDtypeFromName(v);
      ok = d.has_value();
      if (ok) a->dtype = *d;
    } else if (flag("--prompt-tokens=")) {
      ok = ParseNumber(v, &a->prompt_tokens);
    } else if (flag("--prompt-seed=")) {
      ok = ParseNumber(v, &a->prompt_seed);
    } else if (flag("--hash-seed=")) {
      ok = ParseNumber(v, &a->hash_seed);
    } else if (flag("--segment-blocks=")) {
      ok = ParseNumber(v, &a->segment_blocks);
    } else if (flag("--salt=")) {
      a->salt = std::string(v);
    } else if (flag("--layers=")) {
      ok = ParseNumber(v, &a->layers);
    } else if (flag("--kv-heads=")) {
      ok = ParseNumber(v, &a->kv_heads);
    } else if (flag("--head-dim=")) {
      ok = ParseNumber(v, &a->head_dim);
    } else if (flag("--tokens-per-block=")) {
      ok = ParseNumber(v, &a->tokens_per_block);
    } else if (flag("--engine-block-size=")) {
      ok = ParseNumber(v, &a->engine_block_size);
    } else if (flag("--layout=")) {
      ok = v == "nhd" || v == "hnd";
      a->order = v == "hnd" ? PagedOrder::kHND : PagedOrder::kNHD;
    } else if (flag("--format=")) {
      ok = v == "fp16" || v == "raw";
      a->format = v == "raw" ? ReadFormat::kRaw : ReadFormat::kFp16;
    } else if (flag("--timeout-ms=")) {
      ok = ParseNumber(v, &a->timeout_ms) && a->timeout_ms > 0;
    } else if (flag("--token-file=")) {
      a->token_file = std::string(v);
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "bad argument: %s\n", argv[i]);
      return false;
    }
  }
  if (a->nodes.empty() == a->dns.empty()) {
    std::fprintf(stderr, "give exactly one of --nodes and --dns\n");
    return false;
  }
  if (a->layers == 0 || a->kv_heads == 0 || a->head_dim == 0 ||
      a->tokens_per_block == 0 || a->engine_block_size == 0) {
    std::fprintf(stderr, "dimensions must be > 0\n");
    return false;
  }
  return true;
}

inline absl::StatusOr<std::unique_ptr<ClusterClient>> MakeClient(
    const WorkerArgs& a) {
  ClusterOptions o;
  if (!a.nodes.empty()) {
    o.nodes = a.nodes;
  } else {
    std::pair<std::string, std::string> hp =
        absl::StrSplit(a.dns, absl::MaxSplits(':', 1));
    o.dns_name = hp.first;
    if (!absl::SimpleAtoi(hp.second, &o.dns_port)) {
      return absl::InvalidArgumentError("--dns must be NAME:PORT");
    }
  }
  o.default_timeout = absl::Milliseconds(a.timeout_ms);
  if (a.segment_blocks > 0) o.routing_prefix_bytes = kRoutingTagBytes;
  if (!a.token_file.empty()) {
    absl::StatusOr<std::string> token = ReadBearerTokenFile(a.token_file);
    if (!token.ok()) return token.status();
    o.bearer_token = *std::move(token);
  }
  return ClusterClient::Create(std::move(o));
}

inline BlockShape Shape(const WorkerArgs& a) {
  return {a.layers, a.kv_heads, a.head_dim, a.tokens_per_block, a.dtype};
}

inline NamespaceSpec Spec(const WorkerArgs& a) {
  NamespaceSpec spec;
  // The dtype is part of a namespace's layout: each gets its own name.
  spec.name = absl::StrCat(a.ns, "/", kernels::CodecName(a.codec),
                           a.dtype == SourceDtype::kBf16 ? "/bf16" : "");
  spec.model = "example-llama";
  spec.revision = "1";
  spec.shape = Shape(a);
  CodecPolicy policy;
  policy.codec = a.codec;
  spec.policy = policy;
  return spec;
}

inline BlockHashConfig HashConfig(const WorkerArgs& a) {
  BlockHashConfig c;
  c.tokens_per_block = a.tokens_per_block;
  c.seed = a.hash_seed;
  if (!a.salt.empty()) c.extra = EncodeExtraKeys({"salt:" + a.salt});
  c.segment_blocks = a.segment_blocks;
  return c;
}

// The prompt: token ids in [0, 128000).
inline std::vector<uint32_t> Prompt(const WorkerArgs& a) {
  std::mt19937_64 rng(a.prompt_seed);
  std::vector<uint32_t> t(a.prompt_tokens);
  for (uint32_t& x : t) x = static_cast<uint32_t>(rng() % 128000);
  return t;
}

inline uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// An element's value: `bits` read as the worker's dtype.
inline float KvValue(const WorkerArgs& a, uint16_t bits) {
  return a.dtype == SourceDtype::kBf16 ? kernels::Bf16ToFloat(bits)
                                       : kernels::HalfToFloat(bits);
}

// Synthetic KV element, a bit pattern of the worker's dtype in about [-4, 4].
inline uint16_t SyntheticKv(const WorkerArgs& a, uint64_t pos, uint32_t token,
                            uint32_t layer, uint32_t kv, uint32_t head,
                            uint32_t dim) {
  const uint64_t seed = a.prompt_seed;
  uint64_t h = Mix(seed ^ Mix(pos * 0x100000001B3ull + token));
  h = Mix(h ^ (uint64_t{layer} << 40 | uint64_t{kv} << 32 |
               uint64_t{head} << 16 | dim));
  const float x = (static_cast<float>(h % 20001) - 10000.0f) / 2500.0f;
  return a.dtype == SourceDtype::kBf16 ? kernels::Bf16FromFloat(x)
                                       : kernels::HalfFromFloat(x);
}

// An engine's paged KV cache (host memory) with a shuffled block table, so
// that a sequence's blocks are scattered as in a real engine.
struct EngineCache {
  PagedKvLayout layout;
  std::vector<std::vector<uint16_t>> tensors;  // one per layer
  std::vector<uint32_t> block_table;
  PagedKvView View() {
    PagedKvView v;
    v.layout = layout;
    for (auto& t : tensors) v.layers.push_back(t.data());
    return v;
  }
};

inline EngineCache MakeEngineCache(const WorkerArgs& a, uint32_t tokens,
                                   uint64_t table_seed) {
  EngineCache c;
  const uint32_t needed =
      (tokens + a.engine_block_size - 1) / a.engine_block_size;
  c.layout = {a.order,    a.layers,  needed + 8, a.engine_block_size,
              a.kv_heads, a.head_dim};
  c.tensors.assign(a.layers,
                   std::vector<uint16_t>(PagedLayerElements(c.layout)));
  std::vector<uint32_t> physical(c.layout.num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), std::mt19937_64(table_seed));
  c.block_table.assign(physical.begin(), physical.begin() + needed);
  return c;
}

// Offset of (kv, token p, head h, channel 0) in a layer tensor.
inline size_t EngineOffset(const EngineCache& c, uint32_t kv, uint64_t p,
                           uint32_t h) {
  const PagedKvLayout& l = c.layout;
  const size_t b = c.block_table[p / l.block_size];
  const size_t s = p % l.block_size;
  if (l.order == PagedOrder::kNHD) {
    return (((kv * size_t{l.num_blocks} + b) * l.block_size + s) *
                l.num_kv_heads +
            h) *
           l.head_dim;
  }
  return (((kv * size_t{l.num_blocks} + b) * l.num_kv_heads + h) *
              l.block_size +
          s) *
         l.head_dim;
}

// Block b of the prompt as the prefill worker stores it: for each layer,
// K then V, [T][H][D] (kernels/codec.h).
inline std::vector<uint16_t> SourceBlock(const WorkerArgs& a,
                                         const std::vector<uint32_t>& tokens,
                                         uint32_t b) {
  std::vector<uint16_t> block(size_t{2} * a.layers * a.tokens_per_block *
                              a.kv_heads * a.head_dim);
  size_t i = 0;
  for (uint32_t l = 0; l < a.layers; ++l) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t t = 0; t < a.tokens_per_block; ++t) {
        const uint64_t p = uint64_t{b} * a.tokens_per_block + t;
        for (uint32_t h = 0; h < a.kv_heads; ++h) {
          for (uint32_t d = 0; d < a.head_dim; ++d) {
            block[i++] = SyntheticKv(a, p, tokens[p], l, kv, h, d);
          }
        }
      }
    }
  }
  return block;
}

// Block b of the prompt as it lies in `engine`'s paged cache, gathered into
// the layout of SourceBlock.
inline std::vector<uint16_t> EngineBlock(const WorkerArgs& a,
                                         const EngineCache& engine,
                                         uint32_t b) {
  std::vector<uint16_t> block(size_t{2} * a.layers * a.tokens_per_block *
                              a.kv_heads * a.head_dim);
  uint16_t* out = block.data();
  for (uint32_t l = 0; l < a.layers; ++l) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t t = 0; t < a.tokens_per_block; ++t) {
        const uint64_t p = uint64_t{b} * a.tokens_per_block + t;
        for (uint32_t h = 0; h < a.kv_heads; ++h) {
          const uint16_t* row =
              engine.tensors[l].data() + EngineOffset(engine, kv, p, h);
          out = std::copy(row, row + a.head_dim, out);
        }
      }
    }
  }
  return block;
}

}  // namespace kvcache::examples

#endif  // KVCACHE_CLIENT_EXAMPLES_WORKER_COMMON_H_
