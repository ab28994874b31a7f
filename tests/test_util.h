// Helpers shared by the store, service and client tests.
#ifndef KVCACHE_TESTS_TEST_UTIL_H_
#define KVCACHE_TESTS_TEST_UTIL_H_

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/half.h"

namespace kvcache::testing {

// A small layout: 2 layers, 2 kv heads, head_dim 32, 32 tokens per block
// (16 KiB of fp16), valid for every codec at G = 32.
inline kernels::BlockShape SmallShape() { return {2, 2, 32, 32}; }

inline size_t HalvesPerBlock(const kernels::BlockShape& s) {
  return kernels::Fp16BlockBytes(s) / 2;
}

// Deterministic N(0, 1)-ish fp16 data for a block, seeded by `seed`.
inline std::vector<uint16_t> RandomBlock(const kernels::BlockShape& s,
                                         uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> out(HalvesPerBlock(s));
  for (uint16_t& h : out) h = kernels::HalfFromFloat(normal(rng));
  return out;
}

inline std::string Key(int i) { return "block-" + std::to_string(i); }

// Sets (or, with a null value, unsets) an environment variable for its
// lifetime, then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TEST_UTIL_H_
