// Codec quality: a synthetic KV generator modelled on what is published about
// real KV caches, and the error metrics that matter for attention.
//
// Used by the codec tests, by kvcache_quality_report (docs/quality.md) and by
// `kvcache-tool eval`.
#ifndef KVCACHE_KERNELS_QUALITY_H_
#define KVCACHE_KERNELS_QUALITY_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace kvcache::kernels::quality {

// One layer's keys, values and queries.
struct KvTensors {
  uint32_t tokens = 0;      // T
  uint32_t kv_heads = 0;    // H
  uint32_t head_dim = 0;    // D
  uint32_t queries = 0;     // Q queries per kv head
  std::vector<uint16_t> k;  // fp16 bits, [T][H][D]
  std::vector<uint16_t> v;  // fp16 bits, [T][H][D]
  std::vector<float> q;     // [Q][H][D]
};

struct SyntheticOptions {
  uint32_t tokens = 1024;
  uint32_t kv_heads = 8;
  uint32_t head_dim = 128;
  uint32_t queries = 16;
  uint64_t seed = 1;
  // The defaults follow SmolLM2-135M's real cache (docs/quality.md, "What
  // real keys look like"): 1-7 outlier channels per layer with an RMS of
  // 5-13x the median channel's, in slowly rotating RoPE pairs; in the
  // layers where the sink draws attention (12-29: 12-100%, mean 68%) its
  // key has 0.15-0.56x the mean key norm.
  // Keys: this many RoPE channel pairs per head carry a persistent offset
  // drawn from [outlier_offset_min, outlier_offset_max] times the other
  // channels' spread (among the slowly rotating pairs).
  uint32_t outlier_pairs = 2;
  float outlier_offset_min = 7.0f;
  float outlier_offset_max = 14.0f;
  // Token 0 is an attention sink: its key has this many times the mean key
  // norm, and each query gives it a share of the attention drawn uniformly
  // from [sink_share_min, sink_share_max] (no adjustment when the maximum
  // is 0: then token 0 is an ordinary key).
  float sink_norm = 0.3f;
  float sink_share_min = 0.4f;
  float sink_share_max = 0.9f;
  // Values: N(0, s_t) per token, s_t log-normal; this fraction of tokens is
  // an outlier token with 8x the spread.
  float value_outlier_fraction = 0.01f;
  // Queries are noisy copies of keys that carry this fraction of the keys'
  // outlier offsets (1 would make every logit lean on the outlier channels),
  // scaled so that the attention logits of
  // each query have this standard deviation over the tokens other than the
  // sink.
  float logit_std = 2.5f;
  float query_outlier_weight = 0.0f;
};

// Keys: N(0, 1) per channel plus, in `outlier_pairs` channel pairs
// (d, d + D/2) per head chosen among the low-frequency half, a constant
// offset (outlier_offset_min..max) in a random direction; then RoPE (theta
// 10000) at each token's position, so the offsets persist across tokens in
// those channels. Token 0's key is `sink_norm` times the mean key norm along a
// random direction outside the outlier channels. Values: see SyntheticOptions.
// Queries: for each head, a random key's pre-RoPE direction (with
// query_outlier_weight of its outlier offset) plus noise,
// rotated to position T, scaled to `logit_std`, then moved along the sink
// key's direction until the sink gets its share of the attention.
// Deterministic for a seed. INVALID_ARGUMENT for zero sizes or an odd D.
absl::StatusOr<KvTensors> MakeSyntheticKv(const SyntheticOptions& options);

struct QualityReport {
  double k_rel_rmse = 0;  // sqrt(sum (k' - k)^2 / sum k^2)
  double v_rel_rmse = 0;
  // Attention out = softmax(q K^T / sqrt(D)) V per query and head:
  // sqrt(sum |out' - out|^2 / sum |out|^2).
  double attn_out_rel_err = 0;
  // KL(p || p') of the attention probabilities, mean over queries and heads
  // (nats).
  double attn_kl = 0;
  // Encoded bits per element, metadata included (dynamic fp8 scales, KIVI
  // zero points and scales), over all T tokens (fp16 residual blocks count
  // 16).
  double bits_per_element = 0;
};

struct EvalOptions {
  uint32_t tokens_per_block = 32;
  // Ablation: quantize the keys per token (groups of G channels, like the
  // values) instead of per channel. KIVI codecs only.
  bool keys_per_token = false;
  // KIVI's residual window: the blocks holding the last `residual_tokens`
  // tokens stay fp16 (as the store keeps them); 0: every block quantized.
  uint32_t residual_tokens = 0;
};

// Splits the tokens into blocks of tokens_per_block (T must be a multiple),
// encodes and decodes each block (one layer) with `policy` (except the
// residual window's), and measures
// the errors against the original tensors. INVALID_ARGUMENT when the policy
// does not fit the block shape, when the sizes disagree, or for non-finite
// input.
absl::StatusOr<QualityReport> Evaluate(const KvTensors& kv,
                                       const CodecPolicy& policy,
                                       const EvalOptions& options = {});

// The error metrics on their own, for tensors decoded elsewhere: k2 and v2
// are the decoded keys and values, same layout as kv.k and kv.v.
// bits_per_element is left 0.
absl::StatusOr<QualityReport> Compare(const KvTensors& kv,
                                      const std::vector<uint16_t>& k2,
                                      const std::vector<uint16_t>& v2);

}  // namespace kvcache::kernels::quality

#endif  // KVCACHE_KERNELS_QUALITY_H_
