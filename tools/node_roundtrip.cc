#include "tools/node_roundtrip.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvcache/client.h"
#include "kvcache/codec.h"
#include "tools/npy.h"

namespace kvcache::tools {
namespace {

struct Options {
  std::string node;
  std::string codec_name;
  std::string ns;
  uint32_t tokens_per_block = 32;
  std::optional<uint32_t> residual_tokens;
  std::vector<uint32_t> fp16_layers;
  std::vector<std::string> files;
};

// [layers, tokens, heads, dim] of an fp16 array.
absl::Status CheckShape(const NpyArray& a, const std::string& what) {
  if (a.descr != "<f2" || a.shape.size() != 4 || a.elements() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": expected a non-empty float16 array [layers, tokens, "
                     "kv_heads, head_dim]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Options> ParseArgs(const std::vector<std::string>& args) {
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      o.files.push_back(a);
      continue;
    }
    std::string name = a, value;
    if (size_t eq = a.find('='); eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return absl::InvalidArgumentError(a + " needs a value");
    }
    uint32_t n = 0;
    if (name == "--node") {
      o.node = value;
    } else if (name == "--codec") {
      o.codec_name = value;
    } else if (name == "--namespace") {
      o.ns = value;
    } else if (name == "--tokens-per-block" || name == "--residual-tokens") {
      if (!absl::SimpleAtoi(value, &n)) {
        return absl::InvalidArgumentError(name + " needs an integer");
      }
      if (name == "--tokens-per-block") o.tokens_per_block = n;
      if (name == "--residual-tokens") o.residual_tokens = n;
    } else if (name == "--fp16-layers") {
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        if (s.empty()) continue;
        if (!absl::SimpleAtoi(s, &n)) {
          return absl::InvalidArgumentError("--fp16-layers: " + value);
        }
        o.fp16_layers.push_back(n);
      }
    } else {
      return absl::InvalidArgumentError("unknown flag " + name);
    }
  }
  if (o.node.empty() || o.codec_name.empty() || o.files.size() != 4 ||
      o.tokens_per_block == 0) {
    return absl::InvalidArgumentError(
        "node-roundtrip needs --node, --codec, K.npy V.npy OUTK.npy OUTV.npy");
  }
  if (o.ns.empty()) o.ns = "real-kv/" + o.codec_name;
  return o;
}

// Block b's fp16 layout (kernels/codec.h): per layer, K [T][H][D] then
// V [T][H][D], cut from the [L][tokens][H][D] arrays; `back` copies the
// other way.
void CopyBlock(const BlockShape& s, uint32_t b, NpyArray& k, NpyArray& v,
               std::vector<uint16_t>& block, bool back) {
  const size_t section =
      size_t{s.tokens_per_block} * s.num_kv_heads * s.head_dim;
  const size_t tokens = k.shape[1];
  const size_t row = size_t{s.num_kv_heads} * s.head_dim;
  for (uint32_t l = 0; l < s.num_layers; ++l) {
    for (int t = 0; t < 2; ++t) {
      uint8_t* src = (t == 0 ? k : v).data.data() +
                     2 * (l * tokens * row + size_t{b} * section);
      uint16_t* dst = block.data() + (2 * l + t) * section;
      if (back) {
        std::memcpy(src, dst, 2 * section);
      } else {
        std::memcpy(dst, src, 2 * section);
      }
    }
  }
}

struct RoundtripResult {
  std::vector<std::string> stored_codecs;
  NamespaceInfo info;
  NamespaceUsage usage;
};

// KIVI: the node re-encodes the blocks that left the residual window in
// the background (its maintenance loop). Waits until at most the blocks of
// the last residual_tokens tokens are still fp16, as they stay.
absl::Status AwaitReencodes(Client& client, const Options& o, Codec codec,
                            uint32_t blocks) {
  if (codec != Codec::kKivi2 && codec != Codec::kKivi4) {
    return absl::OkStatus();
  }
  const uint32_t window = o.residual_tokens.value_or(128);
  const uint64_t kept = std::min<uint64_t>(
      blocks, (window + o.tokens_per_block - 1) / o.tokens_per_block);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (true) {
    absl::StatusOr<NodeStats> stats = client.Stats();
    if (!stats.ok()) return stats.status();
    auto it = stats->namespaces.find(o.ns);
    if (it != stats->namespaces.end() && it->second.residual_blocks <= kept) {
      return absl::OkStatus();
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          "the node did not re-encode the blocks that left the residual "
          "window within 30 s");
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::StatusOr<RoundtripResult> Run(const Options& o, NpyArray& k,
                                    NpyArray& v) {
  std::optional<Codec> codec = CodecFromName(o.codec_name);
  if (!codec)
    return absl::InvalidArgumentError("unknown codec " + o.codec_name);
  const BlockShape shape{static_cast<uint32_t>(k.shape[0]),
                         static_cast<uint32_t>(k.shape[2]),
                         static_cast<uint32_t>(k.shape[3]), o.tokens_per_block};
  if (k.shape[1] % o.tokens_per_block != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(k.shape[1], " tokens are not a multiple of ",
                     o.tokens_per_block, " tokens per block"));
  }
  const uint32_t blocks =
      static_cast<uint32_t>(k.shape[1] / o.tokens_per_block);
  ClientOptions copts;
  copts.target = o.node;
  copts.data_plane = DataPlane::kGrpc;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(copts);
  if (!client.ok()) return client.status();
  NamespaceSpec spec;
  spec.name = o.ns;
  spec.model = "real-kv";
  spec.shape = shape;
  spec.policy = CodecPolicy{};
  spec.policy->codec = *codec;
  spec.policy->fp16_layers = o.fp16_layers;
  spec.residual_tokens = o.residual_tokens;
  RoundtripResult out;
  absl::StatusOr<NamespaceInfo> info = (*client)->RegisterNamespace(spec);
  if (!info.ok()) return info.status();
  out.info = *info;

  const size_t block_halves = size_t{2} * shape.num_layers *
                              shape.tokens_per_block * shape.num_kv_heads *
                              shape.head_dim;
  std::vector<std::vector<uint16_t>> data(blocks,
                                          std::vector<uint16_t>(block_halves));
  std::vector<BlockWrite> writes(blocks);
  std::vector<std::string> keys(blocks);
  for (uint32_t b = 0; b < blocks; ++b) {
    CopyBlock(shape, b, k, v, data[b], /*back=*/false);
    keys[b] = absl::StrCat(o.ns, "/block-", b);
    writes[b] = {keys[b], b == 0 ? "" : keys[b - 1], data[b]};
  }
  // One block per Put, in chain order, as a prefill worker streams them:
  // each new block pushes the oldest one out of KIVI's residual window.
  for (uint32_t b = 0; b < blocks; ++b) {
    absl::StatusOr<PutResult> put =
        (*client)->Put(o.ns, absl::MakeConstSpan(&writes[b], 1));
    if (!put.ok()) return put.status();
  }
  if (absl::Status s = AwaitReencodes(**client, o, *codec, blocks); !s.ok()) {
    return s;
  }
  absl::StatusOr<GetResult> got = (*client)->Get(o.ns, keys);
  if (!got.ok()) return got.status();
  for (uint32_t b = 0; b < blocks; ++b) {
    const BlockData& d = got->blocks[b];
    if (d.bytes.size() != 2 * block_halves) {
      return absl::InternalError(
          absl::StrCat("block ", b, ": ", d.bytes.size(), " bytes"));
    }
    std::memcpy(data[b].data(), d.bytes.data(), d.bytes.size());
    CopyBlock(shape, b, k, v, data[b], /*back=*/true);
    out.stored_codecs.emplace_back(CodecName(d.codec));
  }
  absl::StatusOr<NodeStats> stats = (*client)->Stats();
  if (!stats.ok()) return stats.status();
  if (auto it = stats->namespaces.find(o.ns); it != stats->namespaces.end()) {
    out.usage = it->second;
  }
  return out;
}

void PrintJson(const Options& o, const RoundtripResult& r) {
  std::vector<std::string> quoted;
  for (const std::string& c : r.stored_codecs)
    quoted.push_back("\"" + c + "\"");
  std::printf(
      "{\"namespace\": \"%s\", \"codec\": \"%s\", \"tokens_per_block\": %u, "
      "\"blocks\": %zu, \"stored_codecs\": [%s], \"fp16_block_bytes\": %llu, "
      "\"encoded_block_bytes\": %llu, \"node_stored_bytes\": %llu, "
      "\"node_logical_bytes\": %llu, \"node_residual_blocks\": %llu}\n",
      o.ns.c_str(), o.codec_name.c_str(), o.tokens_per_block,
      r.stored_codecs.size(), absl::StrJoin(quoted, ", ").c_str(),
      static_cast<unsigned long long>(r.info.fp16_block_bytes),
      static_cast<unsigned long long>(r.info.encoded_block_bytes),
      static_cast<unsigned long long>(r.usage.stored_bytes),
      static_cast<unsigned long long>(r.usage.logical_bytes),
      static_cast<unsigned long long>(r.usage.residual_blocks));
}

}  // namespace

int NodeRoundtrip(const std::vector<std::string>& args) {
  absl::StatusOr<Options> o = ParseArgs(args);
  if (!o.ok()) {
    std::fprintf(stderr, "kvcache-tool: %s\nusage:\n%s",
                 std::string(o.status().message()).c_str(),
                 kNodeRoundtripUsage);
    return 2;
  }
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "kvcache-tool: error: %s\n", s.ToString().c_str());
    return 1;
  };
  absl::StatusOr<NpyArray> k = ReadNpy(o->files[0]);
  if (!k.ok()) return fail(k.status());
  absl::StatusOr<NpyArray> v = ReadNpy(o->files[1]);
  if (!v.ok()) return fail(v.status());
  if (absl::Status s = CheckShape(*k, o->files[0]); !s.ok()) return fail(s);
  if (absl::Status s = CheckShape(*v, o->files[1]); !s.ok()) return fail(s);
  if (k->shape != v->shape) {
    return fail(absl::InvalidArgumentError("K and V differ in shape"));
  }
  absl::StatusOr<RoundtripResult> r = Run(*o, *k, *v);
  if (!r.ok()) return fail(r.status());
  if (absl::Status s = WriteNpy(o->files[2], *k); !s.ok()) return fail(s);
  if (absl::Status s = WriteNpy(o->files[3], *v); !s.ok()) return fail(s);
  PrintJson(*o, *r);
  return 0;
}

}  // namespace kvcache::tools
