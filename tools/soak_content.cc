#include "tools/soak_content.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/codec.h"
#include "kernels/half.h"

namespace kvcache::soak {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

std::vector<SoakNamespace> SoakNamespaces() {
  const kernels::BlockShape small{2, 2, 64, 32};  // 32 KiB fp16
  const kernels::BlockShape large{8, 4, 64, 32};  // 256 KiB fp16
  kernels::BlockShape small_bf16 = small;
  small_bf16.source_dtype = kernels::SourceDtype::kBf16;
  std::vector<SoakNamespace> out;
  for (kernels::Codec codec : kernels::kAllCodecs) {
    for (const kernels::BlockShape& shape : {small, large, small_bf16}) {
      SoakNamespace ns;
      ns.shape = shape;
      ns.policy.codec = codec;
      ns.name = absl::StrCat("soak/", kernels::CodecName(codec), "/",
                             kernels::SourceDtypeName(shape.source_dtype), "/",
                             kernels::Fp16BlockBytes(shape) >> 10, "k");
      ns.index = static_cast<uint32_t>(out.size());
      out.push_back(std::move(ns));
    }
  }
  return out;
}

std::string BlockKey(uint32_t chain, uint32_t block) {
  return absl::StrCat("c", chain, "b", block);
}

std::vector<uint16_t> BlockContent(const SoakNamespace& ns, uint32_t chain,
                                   uint32_t block, uint32_t generation) {
  std::vector<uint16_t> out(kernels::Fp16BlockBytes(ns.shape) / 2);
  uint64_t state = Mix(uint64_t{ns.index} << 48 ^ uint64_t{chain} << 32 ^
                       uint64_t{block} << 8 ^ generation);
  // Per channel an offset and a scale, so that KIVI's per-channel keys and
  // FP8's per-head scales see structure, not only noise.
  const uint32_t d = ns.shape.head_dim;
  const bool bf16 = ns.shape.source_dtype == kernels::SourceDtype::kBf16;
  for (size_t i = 0; i < out.size(); ++i) {
    state = Mix(state + i);
    const float noise =
        (static_cast<float>(state % 20001) - 10000.0f) / 5000.0f;
    const float channel = static_cast<float>(i % d) / static_cast<float>(d);
    const float x = noise * (0.5f + channel) + channel;
    out[i] = bf16 ? kernels::Bf16FromFloat(x) : kernels::HalfFromFloat(x);
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const Verifier::States>> Verifier::Get(
    const SoakNamespace& ns, uint32_t chain, uint32_t block) {
  const std::string id = absl::StrCat(ns.index, "/", chain, "/", block);
  {
    MutexLock lock(&mu_);
    auto it = cache_.find(id);
    if (it != cache_.end()) {
      order_.splice(order_.begin(), order_, it->second.second);
      return it->second.first;
    }
  }
  auto states = std::make_shared<States>();
  for (uint32_t g = 0; g < kGenerations; ++g) {
    absl::StatusOr<kernels::LegalStates> s = kernels::LegalStates::Make(
        ns.shape, ns.policy, BlockContent(ns, chain, block, g));
    if (!s.ok()) return s.status();
    states->push_back(*std::move(s));
  }
  MutexLock lock(&mu_);
  auto it = cache_.find(id);
  if (it != cache_.end()) return it->second.first;  // another thread won
  order_.push_front(id);
  cache_.emplace(id, std::make_pair(states, order_.begin()));
  while (cache_.size() > max_entries_) {
    cache_.erase(order_.back());
    order_.pop_back();
  }
  return std::shared_ptr<const States>(std::move(states));
}

absl::Status Verifier::CheckBlock(const SoakNamespace& ns, uint32_t chain,
                                  uint32_t block,
                                  absl::Span<const uint16_t> read) {
  absl::StatusOr<std::shared_ptr<const States>> states = Get(ns, chain, block);
  if (!states.ok()) return states.status();
  absl::Status first;
  for (const kernels::LegalStates& s : **states) {
    absl::StatusOr<kernels::BlockState> m = s.Match(read);
    if (m.ok()) return absl::OkStatus();
    if (first.ok()) first = m.status();
  }
  return first;
}

absl::Status Verifier::CheckSection(const SoakNamespace& ns, uint32_t chain,
                                    uint32_t block, uint32_t layer, uint32_t kv,
                                    absl::Span<const uint16_t> read,
                                    int* matched) {
  absl::StatusOr<std::shared_ptr<const States>> states = Get(ns, chain, block);
  if (!states.ok()) return states.status();
  absl::Status first;
  for (uint32_t g = 0; g < (*states)->size(); ++g) {
    absl::StatusOr<kernels::BlockState> m =
        (**states)[g].MatchSection(layer, kv, read);
    if (m.ok()) {
      *matched = static_cast<int>(g * 2 + static_cast<uint32_t>(*m));
      return absl::OkStatus();
    }
    if (first.ok()) first = m.status();
  }
  return first;
}

std::string Verifier::Identify(const SoakNamespace& ns, uint32_t chains,
                               uint32_t blocks,
                               absl::Span<const uint16_t> read) {
  const size_t section = read.size();
  size_t best = 0;
  std::string best_name = "nothing";
  for (uint32_t c = 0; c < chains; ++c) {
    for (uint32_t b = 0; b < blocks; ++b) {
      absl::StatusOr<std::shared_ptr<const States>> states = Get(ns, c, b);
      if (!states.ok()) continue;
      for (uint32_t g = 0; g < (*states)->size(); ++g) {
        const kernels::LegalStates& s = (**states)[g];
        for (int which = 0; which < 2; ++which) {
          const std::vector<uint16_t>& v = which ? s.source() : s.round_trip();
          for (size_t at = 0; at + section <= v.size(); at += section) {
            size_t n = 0;
            while (n < section && v[at + n] == read[n]) ++n;
            if (n <= best) continue;
            best = n;
            const size_t index = at / section;
            best_name = absl::StrCat(BlockKey(c, b), " gen ", g, " layer ",
                                     index / 2, index % 2 ? " V " : " K ",
                                     which ? "source" : "round trip");
            if (n == section) return absl::StrCat("the bytes of ", best_name);
          }
        }
      }
    }
  }
  return absl::StrCat("best match ", best_name, ": ", best, " of ", section,
                      " leading elements");
}

}  // namespace kvcache::soak
