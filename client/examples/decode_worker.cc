// kvcache-decode_worker: an example decode worker.
//
// It hashes the same synthetic prompt as kvcache-prefill_worker, finds the
// longest cached prefix across the cluster, and loads it layer by layer
// into its own paged cache (its own layout and block table: --layout and
// --engine-block-size may differ from the prefill's), "computing" on layer
// l (here: measuring it) as soon as layer l is in place. Then it checks
// every loaded block bit for bit: it must be exactly one of its legal
// states (kernels/legal_states.h: the prefill's KV, or for a quantized codec
// the local encode->decode of it; KIVI blocks may be either). Any block in
// no legal state, or any non-finite element, makes it exit 1. With a
// quantized codec it also reports the reconstruction error.
#include <cmath>
#include <cstdio>

#include "absl/time/clock.h"
#include "kernels/codec.h"
#include "kernels/legal_states.h"
#include "worker_common.h"

namespace kvcache::examples {
namespace {

// One function on purpose (longer than the usual ~80 lines): the example
// reads top to bottom as the steps a decode worker takes, in order.
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
  auto keys = BlockHashChain(HashConfig(a), tokens);
  if (!keys.ok()) {
    std::fprintf(stderr, "hash: %s\n", keys.status().ToString().c_str());
    return 1;
  }
  const absl::Time start = absl::Now();
  auto hit = cc.Lookup(spec.name, *keys);
  if (!hit.ok()) {
    std::fprintf(stderr, "lookup: %s\n", hit.status().ToString().c_str());
    return 1;
  }
  std::vector<std::string> prefix(keys->begin(),
                                  keys->begin() + hit->prefix_blocks);

  // Load the prefix layer by layer into this engine's paged cache.
  EngineCache engine = MakeEngineCache(a, a.prompt_tokens, a.prompt_seed + 7);
  const PagedKvView view = engine.View();
  LayerwiseOptions options;
  options.format = a.format;
  options.on_layer = [&](uint32_t layer, absl::Span<const LayerSlice> blocks) {
    for (const LayerSlice& s : blocks) {
      absl::Status st = ScatterStoreBlockLayer(
          s.k, s.v, spec.shape, layer, s.block, engine.block_table, view);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  };
  std::unique_ptr<LayerStream> stream =
      cc.GetLayerwise(spec.name, prefix, std::move(options));

  uint64_t mismatches = 0, checked = 0;
  double err_sq = 0, ref_sq = 0;
  uint32_t loaded = 0;
  std::vector<double> ready_ms;
  for (uint32_t l = 0; l < a.layers; ++l) {
    absl::StatusOr<uint32_t> r = stream->WaitLayer(l);
    if (!r.ok()) {
      std::fprintf(stderr, "layer %u: %s\n", l, r.status().ToString().c_str());
      return 1;
    }
    ready_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    loaded = *r;
    // "Compute" on layer l: here, check it against the prefill's KV.
    const uint64_t tokens_loaded = uint64_t{loaded} * a.tokens_per_block;
    for (uint64_t p = 0; p < tokens_loaded; ++p) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        for (uint32_t h = 0; h < a.kv_heads; ++h) {
          const uint16_t* row =
              engine.tensors[l].data() + EngineOffset(engine, kv, p, h);
          for (uint32_t d = 0; d < a.head_dim; ++d) {
            const uint16_t want = SyntheticKv(a, p, tokens[p], l, kv, h, d);
            ++checked;
            if (a.codec == Codec::kNone) {
              mismatches += row[d] != want;
            } else {
              const double w = KvValue(a, want);
              const double g = KvValue(a, row[d]);
              err_sq += (g - w) * (g - w);
              ref_sq += w * w;
            }
          }
        }
      }
    }
  }

  // Every loaded block, bit for bit, against its legal states.
  uint64_t as_written = 0, round_trips = 0, wrong = 0, non_finite = 0;
  for (uint32_t b = 0; b < loaded; ++b) {
    const std::vector<uint16_t> got = EngineBlock(a, engine, b);
    non_finite += kernels::CountNonFinite(got, a.dtype);
    auto states = kernels::LegalStates::Make(spec.shape, *spec.policy,
                                             SourceBlock(a, tokens, b));
    absl::StatusOr<kernels::BlockState> state =
        states.ok() ? states->Match(got) : states.status();
    if (!state.ok()) {
      if (wrong++ == 0) {
        std::fprintf(stderr, "decode: block %u is wrong: %s\n", b,
                     state.status().ToString().c_str());
      }
    } else if (*state == kernels::BlockState::kSource) {
      ++as_written;
    } else {
      ++round_trips;
    }
  }

  std::printf(
      "decode: namespace %s, %zu full blocks, cached prefix %u "
      "(%u keys on unavailable nodes), loaded %u blocks = %u tokens\n",
      spec.name.c_str(), keys->size(), hit->prefix_blocks,
      hit->unavailable_keys, loaded, loaded * a.tokens_per_block);
  std::printf("decode: layer ready at (ms since lookup):");
  for (double ms : ready_ms) std::printf(" %.1f", ms);
  std::printf("\n");
  if (a.codec == Codec::kNone) {
    std::printf(
        "decode: verified %llu elements bit for bit against the "
        "prefill's KV: %llu mismatches\n",
        static_cast<unsigned long long>(checked),
        static_cast<unsigned long long>(mismatches));
  } else {
    std::printf("decode: codec %s, %llu elements, relative RMSE %.4f%%\n",
                std::string(kernels::CodecName(a.codec)).c_str(),
                static_cast<unsigned long long>(checked),
                ref_sq > 0 ? 100.0 * std::sqrt(err_sq / ref_sq) : 0.0);
  }
  std::printf(
      "decode: legal states: %llu blocks as written, %llu as their codec's "
      "round trip, %llu wrong; %llu non-finite elements\n",
      static_cast<unsigned long long>(as_written),
      static_cast<unsigned long long>(round_trips),
      static_cast<unsigned long long>(wrong),
      static_cast<unsigned long long>(non_finite));
  return mismatches == 0 && wrong == 0 && non_finite == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvcache::examples

int main(int argc, char** argv) {
  kvcache::examples::WorkerArgs args;
  if (!kvcache::examples::ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr, "usage: kvcache-decode_worker\n%s",
                 kvcache::examples::kCommonUsage);
    return 64;
  }
  return kvcache::examples::Run(args);
}
