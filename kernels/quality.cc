#include "kernels/quality.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/half.h"

namespace kvcache::kernels::quality {
namespace {

constexpr double kPi = 3.14159265358979323846;

size_t Index(const KvTensors& kv, size_t t, size_t h, size_t d) {
  return (t * kv.kv_heads + h) * kv.head_dim + d;
}

// RoPE (rotate-half layout, theta 10000): pair (i, i + D/2) at position pos.
void Rope(float* x, uint32_t D, double pos) {
  const uint32_t half = D / 2;
  for (uint32_t i = 0; i < half; ++i) {
    const double theta = std::pow(10000.0, -2.0 * i / D);
    const double c = std::cos(pos * theta), s = std::sin(pos * theta);
    const double a = x[i], b = x[i + half];
    x[i] = static_cast<float>(a * c - b * s);
    x[i + half] = static_cast<float>(a * s + b * c);
  }
}

}  // namespace

absl::StatusOr<KvTensors> MakeSyntheticKv(const SyntheticOptions& o) {
  if (o.tokens == 0 || o.kv_heads == 0 || o.head_dim == 0 || o.queries == 0) {
    return absl::InvalidArgumentError("synthetic KV: sizes must be > 0");
  }
  if (o.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        "synthetic KV: head_dim must be even (RoPE pairs)");
  }
  if (!(o.sink_share_min >= 0 && o.sink_share_min <= o.sink_share_max &&
        o.sink_share_max < 1)) {
    return absl::InvalidArgumentError(
        "synthetic KV: need 0 <= sink_share_min <= sink_share_max < 1");
  }
  if (!(o.outlier_offset_min >= 0 &&
        o.outlier_offset_min <= o.outlier_offset_max)) {
    return absl::InvalidArgumentError(
        "synthetic KV: need 0 <= outlier_offset_min <= outlier_offset_max");
  }
  if (o.outlier_pairs > o.head_dim / 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic KV: at most head_dim/4 = ", o.head_dim / 4,
        " outlier pairs (they are drawn from the low-frequency half)"));
  }
  const uint32_t T = o.tokens, H = o.kv_heads, D = o.head_dim, Q = o.queries;
  const uint32_t half = D / 2;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> gauss(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);

  KvTensors kv;
  kv.tokens = T;
  kv.kv_heads = H;
  kv.head_dim = D;
  kv.queries = Q;
  const size_t n = size_t{T} * H * D;

  // Persistent offsets of the outlier pairs, per head (pre-RoPE).
  std::vector<float> offset(size_t{H} * D, 0.0f);
  for (uint32_t h = 0; h < H; ++h) {
    std::vector<uint32_t> pairs(half - half / 2);
    std::iota(pairs.begin(), pairs.end(), half / 2);  // low frequencies
    std::shuffle(pairs.begin(), pairs.end(), rng);
    for (uint32_t j = 0; j < o.outlier_pairs; ++j) {
      const uint32_t i = pairs[j];
      const double m =
          o.outlier_offset_min +
          (o.outlier_offset_max - o.outlier_offset_min) * uniform(rng);
      const double phi = 2 * kPi * uniform(rng);
      offset[size_t{h} * D + i] = static_cast<float>(m * std::cos(phi));
      offset[size_t{h} * D + i + half] = static_cast<float>(m * std::sin(phi));
    }
  }

  // Keys: pre-RoPE gaussian + offsets, rotated to their positions; then the
  // sink at position 0.
  std::vector<float> pre(n), keys(n);
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t h = 0; h < H; ++h) {
      for (uint32_t d = 0; d < D; ++d) {
        pre[Index(kv, t, h, d)] =
            static_cast<float>(gauss(rng)) + offset[size_t{h} * D + d];
      }
      float* k = &keys[Index(kv, t, h, 0)];
      std::copy(&pre[Index(kv, t, h, 0)], &pre[Index(kv, t, h, 0)] + D, k);
      Rope(k, D, t);
    }
  }
  for (uint32_t h = 0; h < H; ++h) {
    double mean_norm = 0;
    for (uint32_t t = 0; t < T; ++t) {
      double s = 0;
      for (uint32_t d = 0; d < D; ++d) {
        s += double(keys[Index(kv, t, h, d)]) * keys[Index(kv, t, h, d)];
      }
      mean_norm += std::sqrt(s) / T;
    }
    // The sink key: sink_norm times the mean norm, along a random direction
    // outside the outlier channels (queries reach it without leaning on the
    // channels every key shares).
    std::vector<double> u(D);
    double un = 0;
    for (uint32_t d = 0; d < D; ++d) {
      u[d] = offset[size_t{h} * D + d] != 0.0f ||
                     offset[size_t{h} * D + (d + half) % D] != 0.0f
                 ? 0.0
                 : gauss(rng);
      un += u[d] * u[d];
    }
    un = std::sqrt(un);
    for (uint32_t d = 0; d < D; ++d) {
      keys[Index(kv, 0, h, d)] =
          static_cast<float>(o.sink_norm * mean_norm * u[d] / un);
    }
  }
  kv.k.resize(n);
  for (size_t i = 0; i < n; ++i) kv.k[i] = HalfFromFloat(keys[i]);

  // Values: per-token spread, occasional outlier tokens.
  kv.v.resize(n);
  std::normal_distribution<double> log_spread(0.0, 0.3);
  for (uint32_t t = 0; t < T; ++t) {
    double spread = std::exp(log_spread(rng));
    if (uniform(rng) < o.value_outlier_fraction) spread *= 8.0;
    for (uint32_t h = 0; h < H; ++h) {
      for (uint32_t d = 0; d < D; ++d) {
        kv.v[Index(kv, t, h, d)] =
            HalfFromFloat(static_cast<float>(gauss(rng) * spread));
      }
    }
  }

  // Queries: a random token's pre-RoPE key plus noise, at position T, scaled
  // to the requested logit spread over the (fp16) keys of tokens 1..T-1, then
  // moved along the sink key's direction until the sink gets its share.
  kv.q.resize(size_t{Q} * H * D);
  std::uniform_int_distribution<uint32_t> pick(0, T - 1);
  std::vector<double> a(T), b(T);
  const double inv_sqrt_d = 1.0 / std::sqrt(double(D));
  for (uint32_t j = 0; j < Q; ++j) {
    for (uint32_t h = 0; h < H; ++h) {
      float* q = &kv.q[(size_t{j} * H + h) * D];
      const uint32_t u = pick(rng);
      for (uint32_t d = 0; d < D; ++d) {
        const float off = offset[size_t{h} * D + d];
        q[d] = pre[Index(kv, u, h, d)] - off + o.query_outlier_weight * off +
               static_cast<float>(gauss(rng));
      }
      Rope(q, D, T);
      // a_t: logits of q; b_t: logits of the unit sink direction.
      std::vector<double> sink(D);
      double sink_norm = 0;
      for (uint32_t d = 0; d < D; ++d) {
        sink[d] = HalfToFloat(kv.k[Index(kv, 0, h, d)]);
        sink_norm += sink[d] * sink[d];
      }
      sink_norm = std::sqrt(sink_norm);
      for (uint32_t d = 0; d < D; ++d) sink[d] /= std::max(sink_norm, 1e-30);
      for (uint32_t t = 0; t < T; ++t) {
        double la = 0, lb = 0;
        for (uint32_t d = 0; d < D; ++d) {
          const double k = HalfToFloat(kv.k[Index(kv, t, h, d)]);
          la += double(q[d]) * k;
          lb += sink[d] * k;
        }
        a[t] = la * inv_sqrt_d;
        b[t] = lb * inv_sqrt_d;
      }
      double mean = 0, sq = 0;
      for (uint32_t t = 1; t < T; ++t) mean += a[t] / (T - 1);
      for (uint32_t t = 1; t < T; ++t) {
        sq += (a[t] - mean) * (a[t] - mean) / (T - 1);
      }
      const double f = sq > 0 ? o.logit_std / std::sqrt(sq) : 1.0;
      for (uint32_t t = 0; t < T; ++t) a[t] *= f;
      for (uint32_t d = 0; d < D; ++d) q[d] = static_cast<float>(q[d] * f);
      // Sink share s: l_0 - logsumexp(l_1..) = log(s / (1 - s)) with
      // l_t = a_t + delta * b_t; bisection on delta (the left side grows
      // with delta: b_0 = |k_0| / sqrt(D) dominates).
      const double share = o.sink_share_min +
                           (o.sink_share_max - o.sink_share_min) * uniform(rng);
      const double target = std::log(share / (1.0 - share));
      auto gap = [&](double delta) {
        double m = -INFINITY;
        for (uint32_t t = 1; t < T; ++t) m = std::max(m, a[t] + delta * b[t]);
        double z = 0;
        for (uint32_t t = 1; t < T; ++t) z += std::exp(a[t] + delta * b[t] - m);
        return a[0] + delta * b[0] - (m + std::log(z)) - target;
      };
      double lo = -1e4, hi = 1e4;
      const bool adjust = T > 1 && o.sink_share_max > 0;
      for (int it = 0; it < 200 && adjust; ++it) {
        const double mid = 0.5 * (lo + hi);
        (gap(mid) < 0 ? lo : hi) = mid;
      }
      const double delta = adjust ? 0.5 * (lo + hi) : 0.0;
      for (uint32_t d = 0; d < D; ++d) {
        q[d] = static_cast<float>(q[d] + delta * sink[d]);
      }
    }
  }
  return kv;
}

absl::StatusOr<QualityReport> Compare(const KvTensors& kv,
                                      const std::vector<uint16_t>& k2,
                                      const std::vector<uint16_t>& v2) {
  const size_t T = kv.tokens, H = kv.kv_heads, D = kv.head_dim, Q = kv.queries;
  const size_t n = T * H * D;
  if (T == 0 || H == 0 || D == 0 || kv.k.size() != n || kv.v.size() != n ||
      k2.size() != n || v2.size() != n || kv.q.size() != Q * H * D) {
    return absl::InvalidArgumentError(
        absl::StrCat("quality: tensor sizes disagree with T=", T, " H=", H,
                     " D=", D, " Q=", Q));
  }
  QualityReport r;
  double kn = 0, kd = 0, vn = 0, vd = 0;
  for (size_t i = 0; i < n; ++i) {
    const double k = HalfToFloat(kv.k[i]), kq = HalfToFloat(k2[i]);
    const double v = HalfToFloat(kv.v[i]), vq = HalfToFloat(v2[i]);
    kn += (kq - k) * (kq - k);
    kd += k * k;
    vn += (vq - v) * (vq - v);
    vd += v * v;
  }
  r.k_rel_rmse = kd > 0 ? std::sqrt(kn / kd) : std::sqrt(kn);
  r.v_rel_rmse = vd > 0 ? std::sqrt(vn / vd) : std::sqrt(vn);

  // fp16 to float once (exact), not in the Q x T x D loops below.
  auto widen = [](const std::vector<uint16_t>& h) {
    std::vector<float> f(h.size());
    for (size_t i = 0; i < h.size(); ++i) f[i] = HalfToFloat(h[i]);
    return f;
  };
  const std::vector<float> ka = widen(kv.k), kb = widen(k2);
  const std::vector<float> va = widen(kv.v), vb = widen(v2);
  std::vector<double> la(T), lb(T);
  std::vector<double> out_a(D), out_b(D);
  double err = 0, norm = 0, kl = 0;
  const double inv_sqrt_d = 1.0 / std::sqrt(double(D));
  for (size_t j = 0; j < Q; ++j) {
    for (size_t h = 0; h < H; ++h) {
      const float* q = &kv.q[(j * H + h) * D];
      for (size_t t = 0; t < T; ++t) {
        double a = 0, b = 0;
        for (size_t d = 0; d < D; ++d) {
          const size_t i = (t * H + h) * D + d;
          a += double(q[d]) * ka[i];
          b += double(q[d]) * kb[i];
        }
        la[t] = a * inv_sqrt_d;
        lb[t] = b * inv_sqrt_d;
      }
      // log-softmax of both.
      const double ma = *std::max_element(la.begin(), la.end());
      const double mb = *std::max_element(lb.begin(), lb.end());
      double za = 0, zb = 0;
      for (size_t t = 0; t < T; ++t) {
        za += std::exp(la[t] - ma);
        zb += std::exp(lb[t] - mb);
      }
      const double lza = ma + std::log(za), lzb = mb + std::log(zb);
      std::fill(out_a.begin(), out_a.end(), 0.0);
      std::fill(out_b.begin(), out_b.end(), 0.0);
      double kl_q = 0;
      for (size_t t = 0; t < T; ++t) {
        const double lpa = la[t] - lza, lpb = lb[t] - lzb;
        const double pa = std::exp(lpa), pb = std::exp(lpb);
        kl_q += pa * (lpa - lpb);
        for (size_t d = 0; d < D; ++d) {
          const size_t i = (t * H + h) * D + d;
          out_a[d] += pa * va[i];
          out_b[d] += pb * vb[i];
        }
      }
      kl += kl_q;
      for (size_t d = 0; d < D; ++d) {
        err += (out_b[d] - out_a[d]) * (out_b[d] - out_a[d]);
        norm += out_a[d] * out_a[d];
      }
    }
  }
  r.attn_out_rel_err = norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
  r.attn_kl = Q * H > 0 ? kl / double(Q * H) : 0;
  return r;
}

absl::StatusOr<QualityReport> Evaluate(const KvTensors& kv,
                                       const CodecPolicy& policy,
                                       const EvalOptions& options) {
  const uint32_t T = kv.tokens, H = kv.kv_heads, D = kv.head_dim;
  const uint32_t tpb = options.tokens_per_block;
  if (tpb == 0 || T % tpb != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quality: ", T, " tokens are not a whole number of blocks of ", tpb));
  }
  const size_t n = size_t{T} * H * D;
  if (kv.k.size() != n || kv.v.size() != n) {
    return absl::InvalidArgumentError("quality: K or V has the wrong size");
  }
  const bool kivi =
      policy.codec == Codec::kKivi2 || policy.codec == Codec::kKivi4;
  if (options.keys_per_token && !kivi) {
    return absl::InvalidArgumentError(
        "quality: keys_per_token is an ablation of the KIVI codecs");
  }
  const BlockShape shape{1, H, D, tpb};
  if (absl::Status st = ValidatePolicy(shape, policy); !st.ok()) return st;
  const size_t sec = size_t{tpb} * H * D;
  std::vector<uint16_t> block(2 * sec), decoded(2 * sec);
  std::vector<uint8_t> enc(EncodedBlockBytes(shape, policy));
  std::vector<uint16_t> k2(n), v2(n);
  auto roundtrip = [&](const uint16_t* first,
                       const uint16_t* second) -> absl::Status {
    std::copy(first, first + sec, block.begin());
    std::copy(second, second + sec, block.begin() + sec);
    if (absl::Status st =
            EncodeBlock(shape, policy, block, absl::MakeSpan(enc));
        !st.ok()) {
      return st;
    }
    return DecodeBlock(shape, policy, enc, absl::MakeSpan(decoded));
  };
  const uint32_t blocks = T / tpb;
  // Blocks that overlap the last residual_tokens tokens stay fp16.
  const uint32_t residual_blocks =
      std::min(blocks, (options.residual_tokens + tpb - 1) / tpb);
  size_t encoded_bytes = 0;
  for (uint32_t b = 0; b < blocks; ++b) {
    const size_t at = size_t{b} * sec;
    if (b >= blocks - residual_blocks) {
      std::copy(&kv.k[at], &kv.k[at] + sec, k2.begin() + at);
      std::copy(&kv.v[at], &kv.v[at] + sec, v2.begin() + at);
      encoded_bytes += 4 * sec;
      continue;
    }
    encoded_bytes += enc.size();
    if (absl::Status st = roundtrip(&kv.k[at], &kv.v[at]); !st.ok()) return st;
    std::copy(decoded.begin(), decoded.begin() + sec, k2.begin() + at);
    std::copy(decoded.begin() + sec, decoded.end(), v2.begin() + at);
    if (options.keys_per_token) {
      // Keys through the value path: per token, groups of G channels.
      if (absl::Status st = roundtrip(&kv.k[at], &kv.k[at]); !st.ok()) {
        return st;
      }
      std::copy(decoded.begin() + sec, decoded.end(), k2.begin() + at);
    }
  }
  absl::StatusOr<QualityReport> r = Compare(kv, k2, v2);
  if (!r.ok()) return r;
  r->bits_per_element = 8.0 * double(encoded_bytes) / double(2 * n);
  return r;
}

}  // namespace kvcache::kernels::quality
