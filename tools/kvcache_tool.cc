// kvcache-tool: the codecs from the command line, for operators and
// researchers.
//
//   kvcache-tool roundtrip --codec C --tensor key|value [--group-size G]
//                          [--scale dynamic|FLOAT] [--dtype fp16|bf16]
//                          IN.npy OUT.npy
//   kvcache-tool eval [--synthetic SEED | K.npy V.npy Q.npy]
//                     [--tokens-per-block N]
//   kvcache-tool hash-token [--token-file FILE]
//   kvcache-tool node-roundtrip --node HOST:PORT --codec C ... K V OUTK OUTV
//
// roundtrip: IN is [tokens, kv_heads, head_dim], one layer's keys or values
// of one block, in the namespace's source dtype: float16 for --dtype fp16
// (the default), uint16 bf16 bit patterns for --dtype bf16 (NumPy has no
// bf16; torch's `t.view(torch.uint16).numpy()` gives them); OUT is what the
// store would hand back after storing it with the codec (dequantized into
// the same dtype and shape). eval: the quality report
// of every codec: elementwise relative RMSE of K and V, relative error of
// the attention output softmax(q K^T / sqrt(d)) V and the KL divergence of
// the attention probabilities, on synthetic KV or on given tensors.
// hash-token: the token_sha256 a tenants file (kvcache-node --tenants)
// holds for a bearer token: the SHA-256, in lowercase hex, of the token read
// from FILE or standard input (its first line, surrounding whitespace
// removed, as the clients' --token-file reads it).
// Errors print one line on stderr and exit 1 (2 for usage errors).
#include <openssl/sha.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/codec.h"
#include "kernels/half.h"
#include "kernels/quality.h"
#include "tools/node_roundtrip.h"
#include "tools/npy.h"

namespace kvcache::tools {
namespace {

using kernels::Codec;
using kernels::CodecPolicy;
using kernels::SourceDtype;
using kernels::SourceDtypeName;

constexpr char kUsage[] =
    "usage:\n"
    "  kvcache-tool roundtrip --codec {none,fp8_e4m3,fp8_e5m2,kivi2,kivi4}\n"
    "      --tensor {key,value} [--group-size G] [--scale dynamic|FLOAT]\n"
    "      [--dtype fp16|bf16] IN.npy OUT.npy\n"
    "  kvcache-tool eval [--synthetic SEED | K.npy V.npy Q.npy]\n"
    "      [--tokens-per-block N]\n"
    "  kvcache-tool hash-token [--token-file FILE]   (else standard input)\n"
    "  kvcache-tool node-roundtrip (the whole prefix through a real node;\n"
    "      tools/node_roundtrip.h)\n";

int Error(const std::string& message) {
  std::fprintf(stderr, "kvcache-tool: error: %s\n", message.c_str());
  return 1;
}

int Usage(const std::string& message) {
  std::fprintf(stderr, "kvcache-tool: %s\n%s", message.c_str(), kUsage);
  return 2;
}

bool IsFp8(Codec c) { return c == Codec::kFp8E4M3 || c == Codec::kFp8E5M2; }
bool IsKivi(Codec c) { return c == Codec::kKivi2 || c == Codec::kKivi4; }

// The .npy dtype that holds `dtype`'s bit patterns.
const char* NpyDescr(SourceDtype dtype) {
  return dtype == SourceDtype::kBf16 ? "<u2" : "<f2";
}

absl::Status CheckKvShape(const NpyArray& a, const std::string& what,
                          SourceDtype dtype = SourceDtype::kFp16) {
  if (a.descr != NpyDescr(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": dtype ", a.descr, "; expected ",
        dtype == SourceDtype::kBf16 ? "uint16 bf16 bit patterns (<u2)"
                                    : "float16 (<f2)",
        " for --dtype ", SourceDtypeName(dtype)));
  }
  if (a.shape.size() != 3 || a.elements() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": expected a non-empty 3-d array [tokens, "
                     "kv_heads, head_dim]"));
  }
  for (uint64_t d : a.shape) {
    if (d > (1u << 20)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": too large"));
    }
  }
  return absl::OkStatus();
}

int Roundtrip(const std::vector<std::string>& args) {
  std::string codec_name, tensor, scale = "dynamic", dtype_name = "fp16";
  uint32_t group_size = 0;
  std::vector<std::string> files;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string* {
      return i + 1 < args.size() ? &args[++i] : nullptr;
    };
    if (a == "--codec" || a == "--tensor" || a == "--scale" ||
        a == "--group-size" || a == "--dtype") {
      const std::string* v = value();
      if (v == nullptr) return Usage(a + " needs a value");
      if (a == "--codec") codec_name = *v;
      if (a == "--dtype") dtype_name = *v;
      if (a == "--tensor") tensor = *v;
      if (a == "--scale") scale = *v;
      if (a == "--group-size" &&
          (!absl::SimpleAtoi(*v, &group_size) || group_size == 0)) {
        return Usage("--group-size needs a positive integer");
      }
    } else if (a.rfind("--", 0) == 0) {
      return Usage("unknown flag " + a);
    } else {
      files.push_back(a);
    }
  }
  if (files.size() != 2) return Usage("roundtrip needs IN.npy and OUT.npy");
  std::optional<Codec> codec = kernels::CodecFromName(codec_name);
  if (!codec) return Usage("unknown --codec '" + codec_name + "'");
  if (tensor != "key" && tensor != "value") {
    return Usage("--tensor must be key or value");
  }
  std::optional<SourceDtype> dtype = kernels::SourceDtypeFromName(dtype_name);
  if (!dtype) return Usage("--dtype must be fp16 or bf16");
  CodecPolicy policy;
  policy.codec = *codec;
  if (group_size != 0) {
    if (!IsKivi(*codec)) return Usage("--group-size applies to kivi codecs");
    policy.kivi_group_size = group_size;
  }
  if (scale != "dynamic") {
    float s;
    if (!IsFp8(*codec)) return Usage("--scale applies to fp8 codecs");
    if (!absl::SimpleAtof(scale, &s) || !std::isfinite(s) || s <= 0) {
      return Usage("--scale must be 'dynamic' or a positive number");
    }
    policy.scale_mode = kernels::ScaleMode::kStaticPerLayer;
    policy.static_k_scales = {s};
    policy.static_v_scales = {s};
  }

  absl::StatusOr<NpyArray> in = ReadNpy(files[0]);
  if (!in.ok()) return Error(std::string(in.status().message()));
  if (absl::Status s = CheckKvShape(*in, files[0], *dtype); !s.ok()) {
    return Error(std::string(s.message()));
  }
  // One layer, this tensor in its K or V slot; the other slot is zeros.
  const kernels::BlockShape shape{1, static_cast<uint32_t>(in->shape[1]),
                                  static_cast<uint32_t>(in->shape[2]),
                                  static_cast<uint32_t>(in->shape[0]), *dtype};
  if (absl::Status s = kernels::ValidatePolicy(shape, policy); !s.ok()) {
    return Error(absl::StrCat(files[0], ": ", s.message()));
  }
  const size_t n = in->elements();
  const size_t slot = tensor == "key" ? 0 : n;
  std::vector<uint16_t> block(2 * n, 0);
  std::memcpy(block.data() + slot, in->data.data(), n * 2);
  std::vector<uint8_t> encoded(kernels::EncodedBlockBytes(shape, policy));
  if (absl::Status s =
          kernels::EncodeBlock(shape, policy, block, absl::MakeSpan(encoded));
      !s.ok()) {
    return Error(absl::StrCat(files[0], ": ", s.message()));
  }
  std::vector<uint16_t> decoded(2 * n);
  if (absl::Status s =
          kernels::DecodeBlock(shape, policy, encoded, absl::MakeSpan(decoded));
      !s.ok()) {
    return Error(std::string(s.message()));
  }
  NpyArray out;
  out.descr = NpyDescr(*dtype);
  out.shape = in->shape;
  out.data.resize(n * 2);
  std::memcpy(out.data.data(), decoded.data() + slot, n * 2);
  if (absl::Status s = WriteNpy(files[1], out); !s.ok()) {
    return Error(std::string(s.message()));
  }
  return 0;
}

absl::StatusOr<kernels::quality::KvTensors> LoadKvq(const std::string& k_path,
                                                    const std::string& v_path,
                                                    const std::string& q_path) {
  absl::StatusOr<NpyArray> k = ReadNpy(k_path);
  if (!k.ok()) return k.status();
  absl::StatusOr<NpyArray> v = ReadNpy(v_path);
  if (!v.ok()) return v.status();
  absl::StatusOr<NpyArray> q = ReadNpy(q_path);
  if (!q.ok()) return q.status();
  if (absl::Status s = CheckKvShape(*k, k_path); !s.ok()) return s;
  if (absl::Status s = CheckKvShape(*v, v_path); !s.ok()) return s;
  if (k->shape != v->shape) {
    return absl::InvalidArgumentError("K and V must have the same shape");
  }
  if (q->shape.size() != 3 || q->shape[1] != k->shape[1] ||
      q->shape[2] != k->shape[2] || q->shape[0] == 0) {
    return absl::InvalidArgumentError(
        "Q must be [queries, kv_heads, head_dim] with K's kv_heads and "
        "head_dim");
  }
  kernels::quality::KvTensors kv;
  kv.tokens = static_cast<uint32_t>(k->shape[0]);
  kv.kv_heads = static_cast<uint32_t>(k->shape[1]);
  kv.head_dim = static_cast<uint32_t>(k->shape[2]);
  kv.queries = static_cast<uint32_t>(q->shape[0]);
  kv.k.resize(k->elements());
  kv.v.resize(v->elements());
  std::memcpy(kv.k.data(), k->data.data(), k->data.size());
  std::memcpy(kv.v.data(), v->data.data(), v->data.size());
  kv.q.resize(q->elements());
  for (size_t i = 0; i < kv.q.size(); ++i) {
    if (q->descr == "<f2") {
      uint16_t h;
      std::memcpy(&h, q->data.data() + 2 * i, 2);
      kv.q[i] = kernels::HalfToFloat(h);
    } else {
      std::memcpy(&kv.q[i], q->data.data() + 4 * i, 4);
    }
  }
  return kv;
}

int Eval(const std::vector<std::string>& args) {
  std::vector<std::string> files;
  uint64_t seed = 1;
  bool synthetic = false;
  kernels::quality::EvalOptions eval;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--synthetic") {
      if (i + 1 >= args.size() || !absl::SimpleAtoi(args[++i], &seed)) {
        return Usage("--synthetic needs a seed");
      }
      synthetic = true;
    } else if (a == "--tokens-per-block") {
      if (i + 1 >= args.size() ||
          !absl::SimpleAtoi(args[++i], &eval.tokens_per_block) ||
          eval.tokens_per_block == 0) {
        return Usage("--tokens-per-block needs a positive integer");
      }
    } else if (a.rfind("--", 0) == 0) {
      return Usage("unknown flag " + a);
    } else {
      files.push_back(a);
    }
  }
  if (synthetic == !files.empty() || (!synthetic && files.size() != 3)) {
    return Usage("eval takes --synthetic SEED or K.npy V.npy Q.npy");
  }
  absl::StatusOr<kernels::quality::KvTensors> kv;
  if (synthetic) {
    kernels::quality::SyntheticOptions options;
    options.seed = seed;
    kv = kernels::quality::MakeSyntheticKv(options);
  } else {
    kv = LoadKvq(files[0], files[1], files[2]);
  }
  if (!kv.ok()) return Error(std::string(kv.status().message()));
  if (kv->tokens % eval.tokens_per_block != 0) {
    return Error(absl::StrCat(kv->tokens, " tokens are not a multiple of ",
                              eval.tokens_per_block,
                              " tokens per block (--tokens-per-block)"));
  }
  std::printf(
      "%s: %u tokens, %u kv heads, head_dim %u, %u queries per "
      "head; blocks of %u tokens\n\n",
      synthetic ? absl::StrCat("synthetic KV, seed ", seed).c_str()
                : "given K, V, Q",
      kv->tokens, kv->kv_heads, kv->head_dim, kv->queries,
      eval.tokens_per_block);
  std::printf(
      "| codec | bits/elem | K rel RMSE | V rel RMSE | attn out rel "
      "err | attn KL (nats) |\n|---|---|---|---|---|---|\n");
  struct Row {
    std::string name;
    CodecPolicy policy;
    bool keys_per_token;
  };
  std::vector<Row> rows;
  for (Codec c : kernels::kAllCodecs) {
    CodecPolicy p;
    p.codec = c;
    rows.push_back({std::string(kernels::CodecName(c)), p, false});
  }
  CodecPolicy static_one;
  static_one.codec = Codec::kFp8E4M3;
  static_one.scale_mode = kernels::ScaleMode::kStaticPerLayer;
  static_one.static_k_scales = {1.0f};
  static_one.static_v_scales = {1.0f};
  rows.push_back({"fp8_e4m3, static scale 1.0", static_one, false});
  for (Codec c : {Codec::kKivi2, Codec::kKivi4}) {
    CodecPolicy p;
    p.codec = c;
    rows.push_back(
        {absl::StrCat(kernels::CodecName(c), ", keys per token (ablation)"), p,
         true});
  }
  for (const Row& row : rows) {
    kernels::quality::EvalOptions e = eval;
    e.keys_per_token = row.keys_per_token;
    absl::StatusOr<kernels::quality::QualityReport> r =
        kernels::quality::Evaluate(*kv, row.policy, e);
    if (!r.ok()) {
      std::printf("| %s | n/a: %s | | | | |\n", row.name.c_str(),
                  std::string(r.status().message()).c_str());
      continue;
    }
    std::printf("| %s | %.2f | %.4f | %.4f | %.4f | %.2e |\n", row.name.c_str(),
                r->bits_per_element, r->k_rel_rmse, r->v_rel_rmse,
                r->attn_out_rel_err, r->attn_kl);
  }
  return 0;
}

int HashToken(const std::vector<std::string>& args) {
  std::string path;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--token-file" && i + 1 < args.size()) {
      path = args[++i];
    } else if (absl::StartsWith(args[i], "--token-file=")) {
      path = args[i].substr(std::strlen("--token-file="));
    } else {
      return Usage("unknown flag " + args[i]);
    }
  }
  std::string line;
  if (path.empty()) {
    std::getline(std::cin, line);
  } else {
    std::ifstream in(path);
    if (!in) return Error("cannot read " + path);
    std::getline(in, line);
  }
  const std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) return Error("no token (an empty first line)");
  unsigned char hash[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(),
         hash);
  std::printf("%s\n", absl::BytesToHexString(
                          absl::string_view(reinterpret_cast<char*>(hash),
                                            sizeof(hash)))
                          .c_str());
  return 0;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  std::string command = args[0];
  args.erase(args.begin());
  if (command == "roundtrip") return Roundtrip(args);
  if (command == "eval") return Eval(args);
  if (command == "hash-token") return HashToken(args);
  if (command == "node-roundtrip") return NodeRoundtrip(args);
  return Usage("unknown command '" + command + "'");
}

}  // namespace
}  // namespace kvcache::tools

int main(int argc, char** argv) { return kvcache::tools::Main(argc, argv); }
