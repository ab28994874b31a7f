// kvcache-demo: the main job. Drives a realistic serving workload through the
// client against a running node and reports what the node stores and what
// quantization bought.
//
// Workload: a few shared system prompts; many multi-turn conversations, each
// starting from one of them. Every turn the "prefill worker" looks up the
// longest cached prefix of the conversation's full blocks (chained prefix
// keys), computes KV only for the blocks after it, and stores them; then the
// "decode worker" reads the whole prefix back. The same workload runs
// against one namespace per codec (same model and layout), so their
// capacity figures compare directly. KV is synthetic but shaped like real
// KV: keys with persistent outlier channels and a large sink token, values
// roughly gaussian; it is a deterministic function of the block key, so
// every read is compared with what was written.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "kernels/codec.h"
#include "kernels/half.h"
#include "kernels/legal_states.h"
#include "kvcache/client.h"
#include "xxhash.h"

namespace {

using kvcache::BlockShape;
using kvcache::Codec;
using kvcache::SourceDtype;

struct Args {
  std::string node = "127.0.0.1:50051";
  std::string metrics = "127.0.0.1:9464";
  int conversations = 16;
  int turns = 3;
  uint64_t seed = 1;
  std::string token_file;  // a tenant's bearer token (--token-file)
  SourceDtype dtype = SourceDtype::kFp16;  // the model's KV dtype (--dtype)
  std::vector<Codec> codecs = {Codec::kNone, Codec::kFp8E4M3, Codec::kKivi4,
                               Codec::kKivi2};
};

// Chained prefix key of a block: H_i = xxh3-128(H_{i-1} || token ids).
std::string ChainKey(const std::string& parent, const uint32_t* tokens,
                     size_t n) {
  std::string buf = parent;
  buf.append(reinterpret_cast<const char*>(tokens), n * sizeof(uint32_t));
  XXH128_hash_t h = XXH3_128bits(buf.data(), buf.size());
  std::string key(16, '\0');
  std::memcpy(key.data(), &h.low64, 8);
  std::memcpy(key.data() + 8, &h.high64, 8);
  return key;
}

// A value of the block's source dtype, from and to its bit pattern.
uint16_t FromFloat(SourceDtype d, float x) {
  return d == SourceDtype::kBf16 ? kvcache::kernels::Bf16FromFloat(x)
                                 : kvcache::kernels::HalfFromFloat(x);
}
float ToFloat(SourceDtype d, uint16_t bits) {
  return d == SourceDtype::kBf16 ? kvcache::kernels::Bf16ToFloat(bits)
                                 : kvcache::kernels::HalfToFloat(bits);
}

// Synthetic KV of one block (in the shape's source dtype), a pure function
// of its key.
std::vector<uint16_t> BlockKv(const BlockShape& s, const std::string& key,
                              bool first_block) {
  uint64_t seed = XXH3_64bits(key.data(), key.size());
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t per_tensor =
      size_t{s.tokens_per_block} * s.num_kv_heads * s.head_dim;
  std::vector<uint16_t> out(size_t{s.num_layers} * 2 * per_tensor);
  for (uint32_t l = 0; l < s.num_layers; ++l) {
    uint16_t* k = out.data() + (size_t{l} * 2) * per_tensor;
    uint16_t* v = k + per_tensor;
    for (uint32_t t = 0; t < s.tokens_per_block; ++t) {
      for (uint32_t h = 0; h < s.num_kv_heads; ++h) {
        for (uint32_t d = 0; d < s.head_dim; ++d) {
          size_t i = (size_t{t} * s.num_kv_heads + h) * s.head_dim + d;
          // Persistent outlier channels (a RoPE pair per head), at ~12x.
          float channel_scale = (d % 64 == 5 || d % 64 == 6) ? 12.0f : 1.0f;
          float key_value = normal(rng) * channel_scale;
          if (first_block && t == 0) key_value *= 4.0f;  // attention sink
          k[i] = FromFloat(s.source_dtype, key_value);
          v[i] = FromFloat(s.source_dtype, normal(rng) * 0.5f);
        }
      }
    }
  }
  return out;
}

struct CodecRun {
  Codec codec;
  std::string ns;
  uint64_t lookups = 0, hits = 0;
  double err_sq = 0, ref_sq = 0, max_abs = 0;
  uint64_t blocks_written = 0, blocks_read = 0;
  // Every block read is checked to be exactly one of its legal states
  // (kernels/legal_states.h).
  uint64_t as_written = 0, round_trips = 0, wrong = 0, non_finite = 0;
  std::string first_wrong;
};

// Checks one block read back in its source dtype against the legal states
// of what was written for it.
void VerifyRead(const BlockShape& shape, CodecRun* run,
                const std::vector<uint16_t>& original,
                absl::Span<const uint16_t> back) {
  run->non_finite += kvcache::kernels::CountNonFinite(back, shape.source_dtype);
  kvcache::CodecPolicy policy;
  policy.codec = run->codec;
  auto states = kvcache::kernels::LegalStates::Make(shape, policy, original);
  if (!states.ok()) {
    ++run->wrong;
    if (run->first_wrong.empty()) run->first_wrong = states.status().ToString();
    return;
  }
  absl::StatusOr<kvcache::kernels::BlockState> state = states->Match(back);
  if (!state.ok()) {
    ++run->wrong;
    if (run->first_wrong.empty()) run->first_wrong = state.status().ToString();
  } else if (*state == kvcache::kernels::BlockState::kSource) {
    ++run->as_written;
  } else {
    ++run->round_trips;
  }
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "kvcache-demo: %s: %s\n", what.c_str(),
               s.ToString().c_str());
  return 1;
}

bool ParseArgs(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (absl::ConsumePrefix(&a, "--node=")) {
      args->node = std::string(a);
    } else if (absl::ConsumePrefix(&a, "--metrics=")) {
      args->metrics = std::string(a);
    } else if (absl::ConsumePrefix(&a, "--conversations=")) {
      if (!absl::SimpleAtoi(a, &args->conversations)) return false;
    } else if (absl::ConsumePrefix(&a, "--turns=")) {
      if (!absl::SimpleAtoi(a, &args->turns)) return false;
    } else if (absl::ConsumePrefix(&a, "--seed=")) {
      if (!absl::SimpleAtoi(a, &args->seed)) return false;
    } else if (absl::ConsumePrefix(&a, "--token-file=")) {
      args->token_file = std::string(a);
    } else if (absl::ConsumePrefix(&a, "--dtype=")) {
      std::optional<SourceDtype> d = kvcache::SourceDtypeFromName(a);
      if (!d) return false;
      args->dtype = *d;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr,
                 "usage: kvcache-demo [--node=HOST:PORT] [--metrics=HOST:PORT]"
                 " [--conversations=N] [--turns=N] [--seed=N]"
                 " [--token-file=FILE] [--dtype=fp16|bf16]\n");
    return 2;
  }
  kvcache::ClientOptions options;
  options.target = args.node;
  if (!args.token_file.empty()) {
    auto token = kvcache::ReadBearerTokenFile(args.token_file);
    if (!token.ok()) return Fail("--token-file", token.status());
    options.bearer_token = *std::move(token);
  }
  auto client = kvcache::Client::Connect(options);
  if (!client.ok()) return Fail("connect", client.status());

  // A Llama-style layout, scaled down in layers so the demo runs in seconds:
  // 16 layers, 8 KV heads, head_dim 128, 32 tokens per block (2 MiB fp16
  // or bf16).
  const BlockShape shape{16, 8, 128, 32, args.dtype};
  const std::string dtype(kvcache::SourceDtypeName(args.dtype));
  std::vector<CodecRun> runs;
  for (Codec codec : args.codecs) {
    CodecRun run;
    run.codec = codec;
    // The dtype is part of a namespace's layout: bf16 gets its own names.
    run.ns = absl::StrCat("demo-llama/", kvcache::kernels::CodecName(codec),
                          args.dtype == SourceDtype::kBf16 ? "/bf16" : "");
    kvcache::NamespaceSpec spec;
    spec.name = run.ns;
    spec.model = "demo-llama-16L";
    spec.revision = "1";
    spec.shape = shape;
    kvcache::CodecPolicy policy;
    policy.codec = codec;
    spec.policy = policy;
    auto info = (*client)->RegisterNamespace(spec);
    if (!info.ok()) return Fail("register " + run.ns, info.status());
    runs.push_back(run);
  }

  std::mt19937_64 rng(args.seed);
  const int kSystemPrompts = 3;
  std::vector<std::vector<uint32_t>> system_prompts(kSystemPrompts);
  for (auto& p : system_prompts) {
    p.resize(384 + rng() % 256);
    for (uint32_t& t : p) t = static_cast<uint32_t>(rng() % 128000);
  }
  struct Conversation {
    std::vector<uint32_t> tokens;
  };
  std::vector<Conversation> conversations(args.conversations);
  for (int i = 0; i < args.conversations; ++i) {
    conversations[i].tokens = system_prompts[rng() % kSystemPrompts];
  }

  // What the prefill side wrote, by key, to check every read against.
  std::unordered_map<std::string, std::vector<uint16_t>> written;
  auto original_kv = [&](const std::string& key,
                         bool first) -> const std::vector<uint16_t>& {
    auto it = written.find(key);
    if (it == written.end()) {
      it = written.emplace(key, BlockKv(shape, key, first)).first;
    }
    return it->second;
  };
  const size_t T = shape.tokens_per_block;
  uint64_t total_turns = 0;
  for (int turn = 0; turn < args.turns; ++turn) {
    for (Conversation& c : conversations) {
      // The user's message and the model's answer of this turn.
      size_t added = 60 + rng() % 300;
      for (size_t i = 0; i < added; ++i) {
        c.tokens.push_back(static_cast<uint32_t>(rng() % 128000));
      }
      ++total_turns;
      size_t full_blocks = c.tokens.size() / T;  // partial tail: not cached
      std::vector<std::string> keys;
      std::string parent;
      for (size_t b = 0; b < full_blocks; ++b) {
        parent = ChainKey(parent, c.tokens.data() + b * T, T);
        keys.push_back(parent);
      }
      for (CodecRun& run : runs) {
        auto hit = (*client)->Lookup(run.ns, keys);
        if (!hit.ok()) return Fail("lookup", hit.status());
        run.lookups += keys.size();
        run.hits += hit->prefix_blocks;
        // Prefill: compute and store the blocks after the cached prefix.
        std::vector<kvcache::BlockWrite> writes;
        for (size_t b = hit->prefix_blocks; b < keys.size(); ++b) {
          kvcache::BlockWrite w;
          w.key = keys[b];
          w.parent_key = b > 0 ? keys[b - 1] : "";
          w.fp16 = original_kv(keys[b], b == 0);
          writes.push_back(w);
        }
        if (!writes.empty()) {
          auto put = (*client)->Put(run.ns, writes);
          if (!put.ok()) return Fail("put", put.status());
          run.blocks_written += put->stored;
        }
        // Decode: load the whole prefix and check it against what was
        // written (the synthetic KV is a function of the key).
        auto got = (*client)->Get(run.ns, keys);
        if (!got.ok()) return Fail("get", got.status());
        for (size_t b = 0; b < keys.size(); ++b) {
          const std::vector<uint16_t>& original = original_kv(keys[b], b == 0);
          const uint16_t* back =
              reinterpret_cast<const uint16_t*>(got->blocks[b].bytes.data());
          VerifyRead(
              shape, &run, original,
              absl::MakeConstSpan(back, got->blocks[b].bytes.size() / 2));
          for (size_t i = 0; i < original.size(); ++i) {
            float x = ToFloat(shape.source_dtype, original[i]);
            float y = ToFloat(shape.source_dtype, back[i]);
            run.err_sq += double(x - y) * double(x - y);
            run.ref_sq += double(x) * double(x);
            run.max_abs = std::max(run.max_abs, double(std::fabs(x - y)));
          }
        }
        run.blocks_read += keys.size();
      }
    }
  }

  auto stats = (*client)->Stats();
  if (!stats.ok()) return Fail("stats", stats.status());
  const double mib = 1024.0 * 1024.0;
  std::printf(
      "\n== kvcache demo: %d conversations x %d turns over %d shared "
      "system prompts ==\n",
      args.conversations, args.turns, kSystemPrompts);
  std::printf(
      "layout: %u layers, %u kv heads, head_dim %u, %u tokens/block "
      "(%.1f MiB %s per block)\n",
      shape.num_layers, shape.num_kv_heads, shape.head_dim,
      shape.tokens_per_block, kvcache::kernels::Fp16BlockBytes(shape) / mib,
      dtype.c_str());
  std::printf(
      "node: %.0f MiB pool, %.0f MiB used (%.1f%%), %llu evictions, "
      "%.2f MiB fragmentation\n\n",
      stats->capacity_bytes / mib, stats->used_bytes / mib,
      100.0 * stats->used_bytes / stats->capacity_bytes,
      static_cast<unsigned long long>(stats->evictions),
      stats->fragmentation_bytes / mib);
  std::printf("%-10s %8s %9s %10s %11s %13s %9s %10s %10s\n", "namespace",
              "blocks", "tokens", "pool MiB", (dtype + " MiB").c_str(),
              "compression", "hit rate", "rel RMSE", "max |err|");
  uint64_t residual_total = 0;
  for (const CodecRun& run : runs) {
    std::string name(kvcache::kernels::CodecName(run.codec));
    const kvcache::NamespaceUsage& u = stats->namespaces[run.ns];
    residual_total += u.residual_blocks;
    std::printf(
        "%-10s %8llu %9llu %10.1f %11.1f %12.2fx %8.1f%% %9.3f%% %10.4f\n",
        name.c_str(), static_cast<unsigned long long>(u.blocks),
        static_cast<unsigned long long>(u.tokens), u.stored_bytes / mib,
        u.logical_bytes / mib,
        u.stored_bytes ? double(u.logical_bytes) / u.stored_bytes : 0,
        run.lookups ? 100.0 * run.hits / run.lookups : 0.0,
        run.ref_sq > 0 ? 100.0 * std::sqrt(run.err_sq / run.ref_sq) : 0.0,
        run.max_abs);
  }
  if (residual_total > 0) {
    std::printf(
        "(the kivi rows include each chain's newest 128 tokens, kept %s by "
        "KIVI's residual window: %llu blocks now)\n",
        dtype.c_str(), static_cast<unsigned long long>(residual_total));
  }
  std::printf(
      "\ntokens that still fit in the free pool, by codec (layout "
      "above):\n");
  const kvcache::NamespaceUsage& any = stats->namespaces.begin()->second;
  for (const auto& [codec, tokens] : any.tokens_that_fit) {
    std::printf("  %-10s %10llu tokens\n", codec.c_str(),
                static_cast<unsigned long long>(tokens));
  }
  auto fit = [&](const char* codec) {
    auto it = any.tokens_that_fit.find(codec);
    return it == any.tokens_that_fit.end() ? 0.0 : double(it->second);
  };
  if (fit("none") > 0) {
    std::printf(
        "  quantization buys: fp8_e4m3 %.2fx, kivi4 %.2fx, kivi2 "
        "%.2fx the tokens of %s\n",
        fit("fp8_e4m3") / fit("none"), fit("kivi4") / fit("none"),
        fit("kivi2") / fit("none"), dtype.c_str());
  }
  std::printf(
      "\nprefix lookups: %llu blocks hit, %llu missed over %llu "
      "turns per codec\n",
      static_cast<unsigned long long>(stats->lookup_hits),
      static_cast<unsigned long long>(stats->lookup_misses),
      static_cast<unsigned long long>(total_turns));
  std::printf("metrics: http://%s/metrics\n", args.metrics.c_str());
  std::printf(
      "\nevery block read checked against its legal states (as written; its "
      "codec's round trip):\n");
  uint64_t wrong = 0;
  for (const CodecRun& run : runs) {
    std::printf(
        "  %-10s %8llu reads: %llu as written, %llu round trips, %llu "
        "wrong, %llu non-finite elements\n",
        std::string(kvcache::kernels::CodecName(run.codec)).c_str(),
        static_cast<unsigned long long>(run.blocks_read),
        static_cast<unsigned long long>(run.as_written),
        static_cast<unsigned long long>(run.round_trips),
        static_cast<unsigned long long>(run.wrong),
        static_cast<unsigned long long>(run.non_finite));
    if (!run.first_wrong.empty()) {
      std::fprintf(stderr, "kvcache-demo: %s: first wrong read: %s\n",
                   run.ns.c_str(), run.first_wrong.c_str());
    }
    wrong += run.wrong + run.non_finite;
  }
  std::printf("wrong reads: %llu\n", static_cast<unsigned long long>(wrong));
  return wrong == 0 ? 0 : 1;
}
