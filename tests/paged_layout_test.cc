// Gather/scatter between engine paged layouts (NHD, HND) and store blocks,
// checked against index formulas written out here independently, for
// tokens_per_block smaller than, equal to and larger than the engine's
// block size (including store blocks that end inside an engine block).
#include "kvcache/paged_layout.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec.h"

namespace kvcache {
namespace {

struct Case {
  PagedOrder order;
  uint32_t block_size;        // engine
  uint32_t tokens_per_block;  // store
};

constexpr uint32_t kLayers = 3, kHeads = 3, kDim = 8, kPhysical = 40;

// Engine element (kv, physical block pb, slot s, head h, channel d) of one
// layer tensor, written plainly per layout.
size_t EngineIndex(PagedOrder order, uint32_t bs, uint32_t kv, uint32_t pb,
                   uint32_t s, uint32_t h, uint32_t d) {
  if (order == PagedOrder::kNHD) {
    return size_t{kv} * kPhysical * bs * kHeads * kDim +
           size_t{pb} * bs * kHeads * kDim + size_t{s} * kHeads * kDim +
           size_t{h} * kDim + d;
  }
  return size_t{kv} * kPhysical * kHeads * bs * kDim +
         size_t{pb} * kHeads * bs * kDim + size_t{h} * bs * kDim +
         size_t{s} * kDim + d;
}

// Store block element (layer l, kv, token t, head h, channel d).
size_t StoreIndex(uint32_t T, uint32_t l, uint32_t kv, uint32_t t, uint32_t h,
                  uint32_t d) {
  return size_t{l} * 2 * T * kHeads * kDim + size_t{kv} * T * kHeads * kDim +
         size_t{t} * kHeads * kDim + size_t{h} * kDim + d;
}

struct Fixture {
  PagedKvLayout layout;
  std::vector<std::vector<uint16_t>> tensors;
  std::vector<uint32_t> table;
  uint32_t store_blocks = 0;
  kernels::BlockShape shape;

  PagedKvView View() {
    PagedKvView v{layout, {}};
    for (auto& t : tensors) v.layers.push_back(t.data());
    return v;
  }
};

Fixture Make(const Case& c, uint64_t seed) {
  Fixture f;
  f.layout = {c.order, kLayers, kPhysical, c.block_size, kHeads, kDim};
  f.shape = {kLayers, kHeads, kDim, c.tokens_per_block};
  const size_t per_layer = 2 * size_t{kPhysical} * c.block_size * kHeads * kDim;
  std::mt19937_64 rng(seed);
  f.tensors.assign(kLayers, std::vector<uint16_t>(per_layer));
  for (auto& t : f.tensors) {
    for (uint16_t& x : t) x = static_cast<uint16_t>(rng());
  }
  // A sequence of 5 store blocks, its engine blocks scattered.
  f.store_blocks = 5;
  const uint32_t tokens = f.store_blocks * c.tokens_per_block;
  const uint32_t engine_blocks = (tokens + c.block_size - 1) / c.block_size;
  std::vector<uint32_t> perm(kPhysical);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  f.table.assign(perm.begin(), perm.begin() + engine_blocks);
  return f;
}

class PagedLayoutTest : public ::testing::TestWithParam<Case> {};

TEST_P(PagedLayoutTest, GatherMatchesFormula) {
  const Case c = GetParam();
  Fixture f = Make(c, 1);
  ASSERT_LE(f.table.size(), kPhysical);
  const uint32_t T = c.tokens_per_block;
  std::vector<uint16_t> block(size_t{kLayers} * 2 * T * kHeads * kDim);
  for (uint32_t j = 0; j < f.store_blocks; ++j) {
    ASSERT_TRUE(
        GatherStoreBlock(f.View(), f.table, f.shape, j, absl::MakeSpan(block))
            .ok());
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        for (uint32_t t = 0; t < T; ++t) {
          const uint32_t p = j * T + t;
          const uint32_t pb = f.table[p / c.block_size];
          const uint32_t s = p % c.block_size;
          for (uint32_t h = 0; h < kHeads; ++h) {
            for (uint32_t d = 0; d < kDim; ++d) {
              ASSERT_EQ(block[StoreIndex(T, l, kv, t, h, d)],
                        f.tensors[l][EngineIndex(c.order, c.block_size, kv, pb,
                                                 s, h, d)])
                  << "block " << j << " layer " << l << " kv " << kv
                  << " token " << t << " head " << h << " dim " << d;
            }
          }
        }
      }
    }
  }
}

TEST_P(PagedLayoutTest, ScatterWritesExactlyTheSequenceAndRoundTrips) {
  const Case c = GetParam();
  Fixture f = Make(c, 2);
  const uint32_t T = c.tokens_per_block;
  const size_t halves = size_t{kLayers} * 2 * T * kHeads * kDim;
  std::mt19937_64 rng(3);
  std::vector<std::vector<uint16_t>> blocks(f.store_blocks,
                                            std::vector<uint16_t>(halves));
  for (auto& b : blocks) {
    for (uint16_t& x : b) x = static_cast<uint16_t>(rng());
  }
  std::vector<std::vector<uint16_t>> before = f.tensors;
  // Even blocks whole, odd blocks layer by layer.
  for (uint32_t j = 0; j < f.store_blocks; ++j) {
    if (j % 2 == 0) {
      ASSERT_TRUE(
          ScatterStoreBlock(blocks[j], f.shape, j, f.table, f.View()).ok());
      continue;
    }
    const size_t section = size_t{T} * kHeads * kDim;
    for (uint32_t l = 0; l < kLayers; ++l) {
      absl::Span<const uint16_t> k =
          absl::MakeConstSpan(blocks[j]).subspan(2 * l * section, section);
      absl::Span<const uint16_t> v = absl::MakeConstSpan(blocks[j]).subspan(
          (2 * l + 1) * section, section);
      ASSERT_TRUE(
          ScatterStoreBlockLayer(k, v, f.shape, l, j, f.table, f.View()).ok());
    }
  }
  // Expected engine contents: the old ones, overwritten where a token of
  // the sequence lives.
  std::vector<std::vector<uint16_t>> want = before;
  for (uint32_t j = 0; j < f.store_blocks; ++j) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        for (uint32_t t = 0; t < T; ++t) {
          const uint32_t p = j * T + t;
          for (uint32_t h = 0; h < kHeads; ++h) {
            for (uint32_t d = 0; d < kDim; ++d) {
              want[l][EngineIndex(c.order, c.block_size, kv,
                                  f.table[p / c.block_size], p % c.block_size,
                                  h, d)] =
                  blocks[j][StoreIndex(T, l, kv, t, h, d)];
            }
          }
        }
      }
    }
  }
  for (uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_EQ(f.tensors[l], want[l]) << "layer " << l;
  }
  std::vector<uint16_t> back(halves);
  for (uint32_t j = 0; j < f.store_blocks; ++j) {
    ASSERT_TRUE(
        GatherStoreBlock(f.View(), f.table, f.shape, j, absl::MakeSpan(back))
            .ok());
    EXPECT_EQ(back, blocks[j]) << "round trip of block " << j;
  }
}

TEST_P(PagedLayoutTest, RejectsBadArgumentsWithoutWriting) {
  const Case c = GetParam();
  Fixture f = Make(c, 4);
  const uint32_t T = c.tokens_per_block;
  std::vector<uint16_t> block(size_t{kLayers} * 2 * T * kHeads * kDim, 7);
  const std::vector<std::vector<uint16_t>> before = f.tensors;
  auto code = [](const absl::Status& s) { return s.code(); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;

  // The table does not reach the block's last token.
  std::vector<uint32_t> short_table(f.table.begin(), f.table.end() - 1);
  EXPECT_EQ(code(ScatterStoreBlock(block, f.shape, f.store_blocks - 1,
                                   short_table, f.View())),
            kInvalid);
  // A table entry past the cache.
  std::vector<uint32_t> bad_table = f.table;
  bad_table[0] = kPhysical;
  EXPECT_EQ(code(ScatterStoreBlock(block, f.shape, 0, bad_table, f.View())),
            kInvalid);
  // Wrong sizes and shapes.
  std::vector<uint16_t> small(block.size() - 1);
  EXPECT_EQ(code(ScatterStoreBlock(small, f.shape, 0, f.table, f.View())),
            kInvalid);
  EXPECT_EQ(code(GatherStoreBlock(f.View(), f.table, f.shape, 0,
                                  absl::MakeSpan(small))),
            kInvalid);
  kernels::BlockShape other = f.shape;
  other.head_dim = kDim * 2;
  EXPECT_EQ(code(ScatterStoreBlock(block, other, 0, f.table, f.View())),
            kInvalid);
  EXPECT_EQ(
      code(ScatterStoreBlockLayer(absl::MakeConstSpan(block).subspan(0, 1),
                                  absl::MakeConstSpan(block).subspan(0, 1),
                                  f.shape, 0, 0, f.table, f.View())),
      kInvalid);
  EXPECT_EQ(code(ScatterStoreBlockLayer(
                absl::MakeConstSpan(block).subspan(0, T * kHeads * kDim),
                absl::MakeConstSpan(block).subspan(0, T * kHeads * kDim),
                f.shape, kLayers, 0, f.table, f.View())),
            kInvalid);
  PagedKvView missing = f.View();
  missing.layers.pop_back();
  EXPECT_EQ(code(ScatterStoreBlock(block, f.shape, 0, f.table, missing)),
            kInvalid);
  PagedKvView null_layer = f.View();
  null_layer.layers[1] = nullptr;
  EXPECT_EQ(code(ScatterStoreBlock(block, f.shape, 0, f.table, null_layer)),
            kInvalid);
  EXPECT_EQ(f.tensors, before) << "a failed call wrote nothing";
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PagedLayoutTest,
    ::testing::Values(Case{PagedOrder::kNHD, 16, 4},   // T < block_size
                      Case{PagedOrder::kNHD, 16, 16},  // T == block_size
                      Case{PagedOrder::kNHD, 16, 48},  // T = 3 blocks
                      Case{PagedOrder::kNHD, 16, 24},  // T = 1.5 blocks
                      Case{PagedOrder::kNHD, 5, 3},    // odd sizes
                      Case{PagedOrder::kHND, 16, 4},
                      Case{PagedOrder::kHND, 16, 16},
                      Case{PagedOrder::kHND, 16, 48},
                      Case{PagedOrder::kHND, 16, 24},
                      Case{PagedOrder::kHND, 5, 3}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(info.param.order == PagedOrder::kNHD ? "NHD" : "HND") +
             "_bs" + std::to_string(info.param.block_size) + "_T" +
             std::to_string(info.param.tokens_per_block);
    });

}  // namespace
}  // namespace kvcache
