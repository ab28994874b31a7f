// The CUDA kernels' index walkers, checked on the host against the plain
// formulas (they are host and device code).
#include <cstdint>
#include <random>

#include "gtest/gtest.h"
#include "kernels/cuda/codec_cuda_index.h"

namespace kvcache::kernels::cuda::internal {
namespace {

TEST(CudaIndexTest, RowWalkerMatchesDivision) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t cols = 1 + rng() % 300;
    const uint32_t start = rng() % 1000;
    const uint32_t step = 1 + rng() % 700;
    RowWalker w(start, step, cols);
    for (uint32_t k = start; k < 100000; k += step, w.Next()) {
      ASSERT_EQ(w.row, k / cols) << cols << " " << start << " " << step;
      ASSERT_EQ(w.col, k % cols) << cols << " " << start << " " << step;
    }
  }
}

TEST(CudaIndexTest, KiviGroupWalkerMatchesTheLayout) {
  std::mt19937 rng(2);
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t G = 1 + rng() % 64;
    const uint32_t H = 1 + rng() % 6;
    const uint32_t D = G * (1 + rng() % 4);
    const uint32_t T = G * (1 + rng() % 4);
    const uint32_t HD = H * D, n = T * HD;
    const bool key = rng() % 2 == 0;
    const uint32_t e0 = rng() % n;
    KiviGroupWalker w(key, HD, G, e0);
    for (uint32_t e = e0; e < n && e < e0 + 300; ++e, w.Next()) {
      const uint32_t t = e / HD, h = (e / D) % H, d = e % D;
      const uint32_t want =
          key ? ((t / G) * H + h) * D + d : (t * H + h) * (D / G) + d / G;
      ASSERT_EQ(w.group(), want) << "key " << key << " e " << e;
    }
  }
}

}  // namespace
}  // namespace kvcache::kernels::cuda::internal
