#include "kernels/quality.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half.h"

namespace kvcache::kernels::quality {
namespace {

using ::testing::HasSubstr;

SyntheticOptions Small(uint64_t seed) {
  SyntheticOptions o;
  o.tokens = 256;
  o.kv_heads = 4;
  o.head_dim = 64;
  o.queries = 8;
  o.seed = seed;
  // The mechanisms under test, exaggerated (the defaults follow the real
  // cache of docs/quality.md, where they are weaker): 4 outlier pairs with
  // offsets of 10-20, a sink key of 6x the mean norm taking 20-60%.
  o.outlier_pairs = 4;
  o.outlier_offset_min = 10.0f;
  o.outlier_offset_max = 20.0f;
  o.sink_norm = 6.0f;
  o.sink_share_min = 0.2f;
  o.sink_share_max = 0.6f;
  return o;
}

TEST(SyntheticKvTest, DeterministicPerSeed) {
  const KvTensors a = *MakeSyntheticKv(Small(1));
  const KvTensors b = *MakeSyntheticKv(Small(1));
  const KvTensors c = *MakeSyntheticKv(Small(2));
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.q, b.q);
  EXPECT_NE(a.k, c.k);
  EXPECT_EQ(a.k.size(), 256u * 4 * 64);
  EXPECT_EQ(a.q.size(), 8u * 4 * 64);
}

TEST(SyntheticKvTest, HasOutlierChannelsASinkAndOutlierTokens) {
  SyntheticOptions o = Small(3);
  o.value_outlier_fraction = 0.05f;
  const KvTensors kv = *MakeSyntheticKv(o);
  const size_t T = kv.tokens, H = kv.kv_heads, D = kv.head_dim;
  for (size_t h = 0; h < H; ++h) {
    // Per channel RMS over tokens 1..T-1 (the sink excluded), combined per
    // RoPE pair (d, d + D/2): the rotation moves an offset between the two.
    std::vector<double> rms(D, 0);
    for (size_t t = 1; t < T; ++t) {
      for (size_t d = 0; d < D; ++d) {
        const double x = HalfToFloat(kv.k[(t * H + h) * D + d]);
        rms[d] += x * x / (T - 1);
      }
    }
    std::vector<double> pair(D / 2);
    for (size_t i = 0; i < D / 2; ++i)
      pair[i] = std::sqrt(rms[i] + rms[i + D / 2]);
    std::vector<double> sorted = pair;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[D / 4];
    const size_t P = o.outlier_pairs;
    EXPECT_GT(sorted[D / 2 - P], 7.0 * median) << "head " << h;
    EXPECT_LT(sorted[D / 2 - P - 1], 2.0 * median) << "head " << h;
    // The sink: token 0's key norm is far above the others'.
    auto norm = [&](size_t t) {
      double s = 0;
      for (size_t d = 0; d < D; ++d) {
        const double x = HalfToFloat(kv.k[(t * H + h) * D + d]);
        s += x * x;
      }
      return std::sqrt(s);
    };
    for (size_t t = 1; t < T; ++t) EXPECT_GT(norm(0), 3.0 * norm(t));
  }
  // Some value tokens are outliers: per-token RMS well above the median.
  std::vector<double> tok(T, 0);
  for (size_t t = 0; t < T; ++t) {
    for (size_t i = 0; i < H * D; ++i) {
      const double x = HalfToFloat(kv.v[t * H * D + i]);
      tok[t] += x * x / (H * D);
    }
  }
  std::vector<double> sorted = tok;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_GT(sorted.back(), 16.0 * sorted[T / 2]);
}

TEST(SyntheticKvTest, QueriesHaveTheRequestedLogitSpreadAndSinkShare) {
  const KvTensors kv = *MakeSyntheticKv(Small(4));
  const size_t T = kv.tokens, H = kv.kv_heads, D = kv.head_dim;
  for (size_t j = 0; j < kv.queries; ++j) {
    for (size_t h = 0; h < H; ++h) {
      std::vector<double> l(T);
      for (size_t t = 0; t < T; ++t) {
        for (size_t d = 0; d < D; ++d) {
          l[t] += kv.q[(j * H + h) * D + d] *
                  double(HalfToFloat(kv.k[(t * H + h) * D + d]));
        }
        l[t] /= std::sqrt(double(D));
      }
      double mean = 0, sq = 0;
      for (size_t t = 1; t < T; ++t) mean += l[t] / (T - 1);
      for (size_t t = 1; t < T; ++t)
        sq += (l[t] - mean) * (l[t] - mean) / (T - 1);
      // Moving the query towards the sink changes the others a little.
      EXPECT_NEAR(std::sqrt(sq), 2.5, 0.5);
      const double m = *std::max_element(l.begin(), l.end());
      double z = 0;
      for (double x : l) z += std::exp(x - m);
      const double sink_share = std::exp(l[0] - m) / z;
      EXPECT_GE(sink_share, 0.2 - 1e-3);
      EXPECT_LE(sink_share, 0.6 + 1e-3);
    }
  }
}

TEST(SyntheticKvTest, RejectsBadOptions) {
  SyntheticOptions o = Small(1);
  o.head_dim = 63;
  EXPECT_EQ(MakeSyntheticKv(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = Small(1);
  o.tokens = 0;
  EXPECT_FALSE(MakeSyntheticKv(o).ok());
  o = Small(1);
  o.outlier_pairs = 17;
  EXPECT_FALSE(MakeSyntheticKv(o).ok());
}

TEST(QualityEvalTest, NoneIsLossless) {
  const KvTensors kv = *MakeSyntheticKv(Small(5));
  const QualityReport r = *Evaluate(kv, CodecPolicy{});
  EXPECT_EQ(r.k_rel_rmse, 0);
  EXPECT_EQ(r.v_rel_rmse, 0);
  EXPECT_EQ(r.attn_out_rel_err, 0);
  EXPECT_NEAR(r.attn_kl, 0, 1e-12);
  EXPECT_EQ(r.bits_per_element, 16);
}

SyntheticOptions NoSink(uint64_t seed) {
  SyntheticOptions o = Small(seed);
  o.sink_norm = 1.0f;
  o.sink_share_min = o.sink_share_max = 0.0f;
  return o;
}

QualityReport Eval(const KvTensors& kv, Codec c) {
  CodecPolicy p;
  p.codec = c;
  return *Evaluate(kv, p);
}

TEST(QualityEvalTest, ErrorsOrderAndBits) {
  const KvTensors kv = *MakeSyntheticKv(NoSink(6));
  const QualityReport e4 = Eval(kv, Codec::kFp8E4M3),
                      e5 = Eval(kv, Codec::kFp8E5M2),
                      k4 = Eval(kv, Codec::kKivi4),
                      k2 = Eval(kv, Codec::kKivi2);
  EXPECT_LT(e4.attn_out_rel_err, e5.attn_out_rel_err);
  EXPECT_LT(e4.attn_out_rel_err, k4.attn_out_rel_err);
  EXPECT_LT(e5.attn_out_rel_err, k2.attn_out_rel_err);
  EXPECT_LT(k4.attn_out_rel_err, k2.attn_out_rel_err);
  EXPECT_LT(e4.attn_kl, e5.attn_kl);
  EXPECT_LT(k4.attn_kl, k2.attn_kl);
  for (const auto& r : {e4, e5, k4, k2}) {
    EXPECT_GT(r.attn_kl, 1e-9);
    EXPECT_GT(r.k_rel_rmse, 0);
  }
  // Bits per element, metadata included: fp8 carries one fp32 scale per
  // head and block (4*H bytes per T*H*D codes); KIVI at G=32: 2 + 1, 4 + 1.
  EXPECT_NEAR(e4.bits_per_element, 8.0 + 32.0 / (32 * 64), 1e-9);
  EXPECT_NEAR(k2.bits_per_element, 3.0, 1e-9);
  EXPECT_NEAR(k4.bits_per_element, 5.0, 1e-9);
}

// A large-norm sink key: FP8's error is relative, so the sink's logit moves
// by much more than the others'; KIVI keeps a group's extremes nearly exact
// and the sink is the extreme of its channel groups.
TEST(QualityEvalTest, LargeNormSinkHurtsFp8MoreThanKivi) {
  const KvTensors plain = *MakeSyntheticKv(NoSink(10));
  const KvTensors sink = *MakeSyntheticKv(Small(10));
  const double fp8_growth = Eval(sink, Codec::kFp8E4M3).attn_kl /
                            Eval(plain, Codec::kFp8E4M3).attn_kl;
  const double kivi_growth =
      Eval(sink, Codec::kKivi4).attn_kl / Eval(plain, Codec::kKivi4).attn_kl;
  EXPECT_GT(fp8_growth, 3.0);
  EXPECT_LT(kivi_growth, fp8_growth);
}

// KIVI's claim: with outlier key channels, per-channel key quantization
// gives better attention than per-token key quantization. The attention
// probabilities depend on the keys only: their KL divergence is the measure
// (the output error also holds the values' error, the same in both).
TEST(QualityEvalTest, PerChannelKeysBeatPerTokenKeysWithOutliers) {
  for (uint64_t seed : {7, 8}) {
    const KvTensors kv = *MakeSyntheticKv(Small(seed));
    for (Codec c : {Codec::kKivi2, Codec::kKivi4}) {
      CodecPolicy p;
      p.codec = c;
      EvalOptions per_token;
      per_token.keys_per_token = true;
      const QualityReport channel = *Evaluate(kv, p);
      const QualityReport token = *Evaluate(kv, p, per_token);
      EXPECT_LT(channel.k_rel_rmse, token.k_rel_rmse) << CodecName(c);
      EXPECT_LT(channel.attn_kl, token.attn_kl) << CodecName(c);
      EXPECT_EQ(channel.v_rel_rmse, token.v_rel_rmse);  // values unchanged
    }
  }
}

TEST(QualityEvalTest, ResidualWindowStaysExact) {
  const KvTensors kv = *MakeSyntheticKv(NoSink(11));  // 256 tokens
  CodecPolicy p;
  p.codec = Codec::kKivi2;
  EvalOptions e;
  e.residual_tokens = 100;  // 4 blocks of 32 hold the last 100 tokens
  const QualityReport with = *Evaluate(kv, p, e);
  const QualityReport without = *Evaluate(kv, p);
  EXPECT_NEAR(with.bits_per_element, (4 * 3.0 + 4 * 16.0) / 8, 1e-9);
  EXPECT_LT(with.k_rel_rmse, without.k_rel_rmse);
  EXPECT_LT(with.v_rel_rmse, without.v_rel_rmse);
  e.residual_tokens = 1000;  // all of it
  const QualityReport all = *Evaluate(kv, p, e);
  EXPECT_EQ(all.k_rel_rmse, 0);
  EXPECT_EQ(all.attn_out_rel_err, 0);
  EXPECT_EQ(all.bits_per_element, 16);
}

TEST(QualityEvalTest, RejectsBadInput) {
  KvTensors kv = *MakeSyntheticKv(Small(9));
  CodecPolicy p;
  p.codec = Codec::kFp8E4M3;
  EvalOptions e;
  e.tokens_per_block = 48;  // 256 % 48 != 0
  EXPECT_THAT(std::string(Evaluate(kv, p, e).status().message()),
              HasSubstr("whole number of blocks"));
  e = EvalOptions{};
  e.keys_per_token = true;
  EXPECT_THAT(std::string(Evaluate(kv, p, e).status().message()),
              HasSubstr("ablation of the KIVI codecs"));
  KvTensors bad = kv;
  bad.v.pop_back();
  EXPECT_FALSE(Evaluate(bad, p).ok());
  EXPECT_FALSE(Compare(kv, kv.k, bad.v).ok());
  bad = kv;
  bad.k[17] = 0x7E00;  // NaN
  EXPECT_THAT(std::string(Evaluate(bad, p).status().message()),
              HasSubstr("non-finite"));
}

}  // namespace
}  // namespace kvcache::kernels::quality
