// Prints the codec quality tables of docs/quality.md (markdown) for the
// synthetic KV of kernels/quality.h.
//
//   kvcache_quality_report [--seeds 1,2,3] [--tokens 1024]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/codec.h"
#include "kernels/half.h"
#include "kernels/quality.h"

namespace kvcache::kernels::quality {
namespace {

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "error: %s\n", std::string(st.message()).c_str());
  return 1;
}

int Main(int argc, char** argv) {
  std::vector<uint64_t> seeds = {1, 2, 3};
  SyntheticOptions base;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--seeds") {
      seeds.clear();
      for (absl::string_view s : absl::StrSplit(argv[i + 1], ',')) {
        uint64_t v;
        if (!absl::SimpleAtoi(s, &v)) {
          std::fprintf(stderr, "bad seed %s\n", std::string(s).c_str());
          return 2;
        }
        seeds.push_back(v);
      }
    } else if (flag == "--tokens") {
      if (!absl::SimpleAtoi(argv[i + 1], &base.tokens)) return 2;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  std::printf(
      "Synthetic KV: T=%u tokens, H=%u kv heads, D=%u, %u queries "
      "per head, %u outlier RoPE pairs per head, sink norm %.2gx, "
      "logit std %.1f; blocks of 32 tokens, KIVI G=32; every block "
      "quantized unless a table says otherwise.\n\n",
      base.tokens, base.kv_heads, base.head_dim, base.queries,
      base.outlier_pairs, base.sink_norm, base.logit_std);

  std::printf("### Every codec\n\n");
  std::printf(
      "| seed | codec | bits/elem | K rel RMSE | V rel RMSE | attn "
      "out rel err | attn KL (nats) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (uint64_t seed : seeds) {
    SyntheticOptions o = base;
    o.seed = seed;
    absl::StatusOr<KvTensors> kv = MakeSyntheticKv(o);
    if (!kv.ok()) return Fail(kv.status());
    for (Codec c : kAllCodecs) {
      CodecPolicy p;
      p.codec = c;
      absl::StatusOr<QualityReport> r = Evaluate(*kv, p);
      if (!r.ok()) return Fail(r.status());
      std::printf("| %llu | %s | %.2f | %.4f | %.4f | %.4f | %.2e |\n",
                  static_cast<unsigned long long>(seed),
                  std::string(CodecName(c)).c_str(), r->bits_per_element,
                  r->k_rel_rmse, r->v_rel_rmse, r->attn_out_rel_err,
                  r->attn_kl);
    }
  }

  std::printf("\n### Without the sink (token 0 an ordinary key)\n\n");
  std::printf(
      "| seed | codec | K rel RMSE | V rel RMSE | attn out rel err | attn KL "
      "(nats) |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (uint64_t seed : seeds) {
    SyntheticOptions o = base;
    o.seed = seed;
    o.sink_norm = 1.0f;
    o.sink_share_min = o.sink_share_max = 0.0f;
    absl::StatusOr<KvTensors> kv = MakeSyntheticKv(o);
    if (!kv.ok()) return Fail(kv.status());
    for (Codec c : kAllCodecs) {
      if (c == Codec::kNone) continue;
      CodecPolicy p;
      p.codec = c;
      absl::StatusOr<QualityReport> r = Evaluate(*kv, p);
      if (!r.ok()) return Fail(r.status());
      std::printf("| %llu | %s | %.4f | %.4f | %.4f | %.2e |\n",
                  static_cast<unsigned long long>(seed),
                  std::string(CodecName(c)).c_str(), r->k_rel_rmse,
                  r->v_rel_rmse, r->attn_out_rel_err, r->attn_kl);
    }
  }

  std::printf(
      "\n### KIVI keys: per channel (the codec) vs per token "
      "(ablation)\n\n");
  std::printf(
      "| seed | codec | keys | K rel RMSE | attn out rel err | attn "
      "KL (nats) |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (uint64_t seed : seeds) {
    SyntheticOptions o = base;
    o.seed = seed;
    absl::StatusOr<KvTensors> kv = MakeSyntheticKv(o);
    if (!kv.ok()) return Fail(kv.status());
    for (Codec c : {Codec::kKivi2, Codec::kKivi4}) {
      for (bool per_token : {false, true}) {
        CodecPolicy p;
        p.codec = c;
        EvalOptions e;
        e.keys_per_token = per_token;
        absl::StatusOr<QualityReport> r = Evaluate(*kv, p, e);
        if (!r.ok()) return Fail(r.status());
        std::printf("| %llu | %s | %s | %.4f | %.4f | %.2e |\n",
                    static_cast<unsigned long long>(seed),
                    std::string(CodecName(c)).c_str(),
                    per_token ? "per token" : "per channel", r->k_rel_rmse,
                    r->attn_out_rel_err, r->attn_kl);
      }
    }
  }

  std::printf(
      "\n### KIVI with its fp16 residual window (the last 128 tokens)\n\n");
  std::printf(
      "| seed | codec | bits/elem | K rel RMSE | V rel RMSE | attn out rel "
      "err | attn KL (nats) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (uint64_t seed : seeds) {
    SyntheticOptions o = base;
    o.seed = seed;
    absl::StatusOr<KvTensors> kv = MakeSyntheticKv(o);
    if (!kv.ok()) return Fail(kv.status());
    for (Codec c : {Codec::kKivi2, Codec::kKivi4}) {
      CodecPolicy p;
      p.codec = c;
      EvalOptions e;
      e.residual_tokens = 128;
      absl::StatusOr<QualityReport> r = Evaluate(*kv, p, e);
      if (!r.ok()) return Fail(r.status());
      std::printf("| %llu | %s | %.2f | %.4f | %.4f | %.4f | %.2e |\n",
                  static_cast<unsigned long long>(seed),
                  std::string(CodecName(c)).c_str(), r->bits_per_element,
                  r->k_rel_rmse, r->v_rel_rmse, r->attn_out_rel_err,
                  r->attn_kl);
    }
  }

  std::printf("\n### FP8 scales: dynamic per block and head vs static 1.0\n\n");
  std::printf(
      "| seed | codec | scales | K rel RMSE | V rel RMSE | attn out "
      "rel err | attn KL (nats) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (uint64_t seed : seeds) {
    SyntheticOptions o = base;
    o.seed = seed;
    absl::StatusOr<KvTensors> kv = MakeSyntheticKv(o);
    if (!kv.ok()) return Fail(kv.status());
    for (Codec c : {Codec::kFp8E4M3, Codec::kFp8E5M2}) {
      for (bool dynamic : {true, false}) {
        CodecPolicy p;
        p.codec = c;
        if (!dynamic) {
          p.scale_mode = ScaleMode::kStaticPerLayer;
          p.static_k_scales = {1.0f};
          p.static_v_scales = {1.0f};
        }
        absl::StatusOr<QualityReport> r = Evaluate(*kv, p);
        if (!r.ok()) return Fail(r.status());
        std::printf("| %llu | %s | %s | %.4f | %.4f | %.4f | %.2e |\n",
                    static_cast<unsigned long long>(seed),
                    std::string(CodecName(c)).c_str(),
                    dynamic ? "dynamic" : "static 1.0", r->k_rel_rmse,
                    r->v_rel_rmse, r->attn_out_rel_err, r->attn_kl);
      }
    }
  }

  std::printf(
      "\n### FP8 scales and magnitude: K and V scaled by a constant "
      "(seed %llu)\n\n",
      static_cast<unsigned long long>(seeds.front()));
  std::printf("| factor | codec | scales | K rel RMSE | V rel RMSE |\n");
  std::printf("|---|---|---|---|---|\n");
  {
    SyntheticOptions o = base;
    o.seed = seeds.front();
    absl::StatusOr<KvTensors> kv = MakeSyntheticKv(o);
    if (!kv.ok()) return Fail(kv.status());
    for (float factor : {1e-4f, 1e-2f, 1.0f, 100.0f}) {
      KvTensors scaled = *kv;
      for (auto* t : {&scaled.k, &scaled.v}) {
        for (auto& x : *t) x = HalfFromFloat(HalfToFloat(x) * factor);
      }
      for (Codec c : {Codec::kFp8E4M3, Codec::kFp8E5M2}) {
        for (bool dynamic : {true, false}) {
          CodecPolicy p;
          p.codec = c;
          if (!dynamic) {
            p.scale_mode = ScaleMode::kStaticPerLayer;
            p.static_k_scales = {1.0f};
            p.static_v_scales = {1.0f};
          }
          absl::StatusOr<QualityReport> r = Evaluate(scaled, p);
          if (!r.ok()) return Fail(r.status());
          std::printf("| %g | %s | %s | %.4f | %.4f |\n", factor,
                      std::string(CodecName(c)).c_str(),
                      dynamic ? "dynamic" : "static 1.0", r->k_rel_rmse,
                      r->v_rel_rmse);
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvcache::kernels::quality

int main(int argc, char** argv) {
  return kvcache::kernels::quality::Main(argc, argv);
}
