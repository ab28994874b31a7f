// Gather/scatter over StridedKvView, checked without the strides: every
// element of an engine cache is tagged with a hash of its logical
// coordinates (layer, physical block, slot, head, K/V, channel), found by
// walking the physical tensor in memory order. A gathered store block must
// hold, at each (layer, K/V, token, head, channel), the tag of the element
// the block table names; a scatter must change exactly the block's elements.
// Covers vLLM's six KVCacheLayout orders (logical [L][B][H][N][2D]), kernel
// blocks that differ from the store block, padded strides, SGLang's
// layer_first and page_first host pools, bf16 and the errors.
#include <cstdint>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kvcache/paged_layout.h"

namespace kvcache {
namespace {

constexpr uint32_t kLayers = 3, kHeads = 2, kDim = 8;

struct Logical {
  uint32_t layer, block, slot, head, kv, channel;
};

uint16_t Tag(const Logical& c) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t v : {c.layer, c.block, c.slot, c.head, c.kv, c.channel}) {
    x ^= v + 0x9E3779B97F4A7C15ull + (x << 6) + (x >> 2);
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 31;
  }
  return static_cast<uint16_t>(x);
}

// A dense tensor of `extents` (memory order, last fastest) whose elements
// are tagged by `logical` (nullopt: padding, tagged 0x7E7E).
struct Physical {
  std::vector<uint32_t> extents;
  std::vector<uint16_t> data;

  int64_t Stride(size_t axis) const {
    int64_t s = 1;
    for (size_t i = axis + 1; i < extents.size(); ++i) s *= extents[i];
    return s;
  }
};

using LogicalOf =
    std::function<std::optional<Logical>(const std::vector<uint32_t>&)>;

Physical Tagged(std::vector<uint32_t> extents, const LogicalOf& logical) {
  Physical p{std::move(extents), {}};
  const size_t n = std::accumulate(p.extents.begin(), p.extents.end(),
                                   size_t{1}, std::multiplies<size_t>());
  p.data.resize(n);
  std::vector<uint32_t> coords(p.extents.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    std::optional<Logical> c = logical(coords);
    p.data[i] = c ? Tag(*c) : 0x7E7E;
    for (size_t a = coords.size(); a-- > 0;) {  // odometer, last axis fastest
      if (++coords[a] < p.extents[a]) break;
      coords[a] = 0;
    }
  }
  return p;
}

struct Engine {
  Physical tensor;
  StridedKvView view;
  uint32_t block_size = 0;
  uint32_t num_blocks = 0;
};

// vLLM: axes named by `order` (a permutation of "LBHNC"), each padded by
// `pad` elements beyond its logical extent except L.
Engine Vllm(const std::string& order, uint32_t blocks, uint32_t block_size,
            uint32_t pad, SourceDtype dtype) {
  const std::string names = "LBHNC";
  const uint32_t logical[] = {kLayers, blocks, kHeads, block_size, 2 * kDim};
  std::vector<uint32_t> extents;
  std::vector<int> axis_of(5);  // physical position of each named axis
  for (size_t i = 0; i < order.size(); ++i) {
    const int a = static_cast<int>(names.find(order[i]));
    axis_of[a] = static_cast<int>(i);
    extents.push_back(logical[a] + (a == 0 ? 0 : pad));
  }
  Engine e;
  e.block_size = block_size;
  e.num_blocks = blocks;
  e.tensor = Tagged(extents, [&](const std::vector<uint32_t>& c) {
    uint32_t v[5];
    for (int a = 0; a < 5; ++a) v[a] = c[axis_of[a]];
    for (int a = 0; a < 5; ++a) {
      if (v[a] >= logical[a]) return std::optional<Logical>();
    }
    return std::optional<Logical>(
        Logical{v[0], v[1], v[3], v[2], v[4] / kDim, v[4] % kDim});
  });
  std::vector<int64_t> shape, strides;
  for (int a = 1; a < 5; ++a) {
    shape.push_back(logical[a]);
    strides.push_back(e.tensor.Stride(axis_of[a]));
  }
  absl::StatusOr<StridedKvLayout> layout =
      VllmLayerLayout(kLayers, shape, strides, dtype);
  EXPECT_TRUE(layout.ok()) << layout.status();
  e.view.layout = *layout;
  for (uint32_t l = 0; l < kLayers; ++l) {
    e.view.layers.push_back(e.tensor.data.data() +
                            l * e.tensor.Stride(axis_of[0]));
  }
  return e;
}

size_t StoreIndex(uint32_t T, uint32_t l, uint32_t kv, uint32_t t, uint32_t h,
                  uint32_t d) {
  return ((size_t{l} * 2 + kv) * T + t) * kHeads * kDim + size_t{h} * kDim + d;
}

kernels::BlockShape Shape(uint32_t tokens_per_block, SourceDtype dtype) {
  kernels::BlockShape s{kLayers, kHeads, kDim, tokens_per_block};
  s.source_dtype = dtype;
  return s;
}

std::vector<uint32_t> ShuffledTable(uint32_t entries, uint32_t blocks,
                                    uint64_t seed) {
  std::vector<uint32_t> perm(blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  perm.resize(entries);
  return perm;
}

// Gathers every store block of a `store_blocks`-block sequence and checks
// each element's tag; then scatters the complement of each and checks that
// exactly the block's elements changed and read back.
void CheckEngine(Engine& e, uint32_t T, uint32_t store_blocks,
                 SourceDtype dtype) {
  const kernels::BlockShape shape = Shape(T, dtype);
  const uint32_t tokens = store_blocks * T;
  const std::vector<uint32_t> table = ShuffledTable(
      (tokens + e.block_size - 1) / e.block_size, e.num_blocks, T);
  const size_t block_elems = 2 * size_t{kLayers} * T * kHeads * kDim;
  std::vector<uint16_t> out(block_elems);
  for (uint32_t j = 0; j < store_blocks; ++j) {
    ASSERT_TRUE(
        GatherStoreBlock(e.view, table, shape, j, absl::MakeSpan(out)).ok());
    for (uint32_t l = 0; l < kLayers; ++l)
      for (uint32_t kv = 0; kv < 2; ++kv)
        for (uint32_t t = 0; t < T; ++t)
          for (uint32_t h = 0; h < kHeads; ++h)
            for (uint32_t d = 0; d < kDim; ++d) {
              const uint32_t p = j * T + t;
              const Logical c{
                  l, table[p / e.block_size], p % e.block_size, h, kv, d};
              ASSERT_EQ(out[StoreIndex(T, l, kv, t, h, d)], Tag(c))
                  << "block " << j << " layer " << l << " kv " << kv
                  << " token " << t << " head " << h << " channel " << d;
            }
  }
  for (uint32_t j = 0; j < store_blocks; ++j) {
    const std::vector<uint16_t> before = e.tensor.data;
    ASSERT_TRUE(
        GatherStoreBlock(e.view, table, shape, j, absl::MakeSpan(out)).ok());
    std::vector<uint16_t> in(out);
    for (uint16_t& x : in) x = static_cast<uint16_t>(~x);
    ASSERT_TRUE(ScatterStoreBlock(in, shape, j, table, e.view).ok());
    size_t changed = 0;
    for (size_t i = 0; i < before.size(); ++i) {
      changed += before[i] != e.tensor.data[i];
    }
    EXPECT_EQ(changed, block_elems) << "store block " << j;
    ASSERT_TRUE(
        GatherStoreBlock(e.view, table, shape, j, absl::MakeSpan(out)).ok());
    EXPECT_EQ(out, in) << "store block " << j;
  }
}

struct VllmCase {
  std::string order;
  uint32_t block_size;  // kernel block (the view's N)
  uint32_t tokens_per_block;
  uint32_t pad;
};

class VllmOrders : public ::testing::TestWithParam<VllmCase> {};

TEST_P(VllmOrders, GatherAndScatterMatchTheLogicalElements) {
  const VllmCase& c = GetParam();
  for (SourceDtype dtype : {SourceDtype::kFp16, SourceDtype::kBf16}) {
    Engine e = Vllm(c.order, 24, c.block_size, c.pad, dtype);
    CheckEngine(e, c.tokens_per_block, 4, dtype);
  }
}

std::vector<VllmCase> VllmCases() {
  std::vector<VllmCase> cases;
  for (const char* order :
       {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}) {
    // Kernel block == store block, kernel blocks of half and a third of a
    // store block, a store block inside a kernel block, and padding.
    for (auto [n, t, pad] : {std::tuple{16u, 16u, 0u},
                             {8u, 16u, 0u},
                             {4u, 12u, 0u},
                             {32u, 16u, 0u},
                             {16u, 16u, 3u},
                             {8u, 12u, 1u}}) {
      cases.push_back({order, n, t, pad});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllOrders, VllmOrders,
                         ::testing::ValuesIn(VllmCases()),
                         [](const ::testing::TestParamInfo<VllmCase>& info) {
                           return info.param.order + "_N" +
                                  std::to_string(info.param.block_size) + "_T" +
                                  std::to_string(info.param.tokens_per_block) +
                                  "_pad" + std::to_string(info.param.pad);
                         });

// SGLang's host pools: K/V first, then layers and tokens in either order.
Engine Sglang(bool page_first, uint32_t pages, uint32_t page_size) {
  const uint32_t tokens = pages * page_size;
  std::vector<uint32_t> extents =
      page_first ? std::vector<uint32_t>{2, tokens, kLayers, kHeads, kDim}
                 : std::vector<uint32_t>{2, kLayers, tokens, kHeads, kDim};
  Engine e;
  e.block_size = page_size;
  e.num_blocks = pages;
  e.tensor = Tagged(extents, [&](const std::vector<uint32_t>& c) {
    const uint32_t layer = page_first ? c[2] : c[1];
    const uint32_t token = page_first ? c[1] : c[2];
    return std::optional<Logical>(
        Logical{layer, token / page_size, token % page_size, c[3], c[0], c[4]});
  });
  const int64_t hd = int64_t{kHeads} * kDim;
  StridedKvLayout& l = e.view.layout;
  l = {kLayers, pages, page_size, kHeads, kDim, 0, 0, kDim, {0, 0}};
  l.kv_offset[1] = int64_t{kLayers} * tokens * hd;
  l.token_stride = page_first ? kLayers * hd : hd;
  l.block_stride = page_size * l.token_stride;
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    e.view.layers.push_back(e.tensor.data.data() +
                            layer * (page_first ? hd : tokens * hd));
  }
  return e;
}

TEST(SglangPools, LayerFirst) {
  Engine e = Sglang(false, 20, 4);
  CheckEngine(e, 4, 5, SourceDtype::kFp16);
}

TEST(SglangPools, PageFirst) {
  Engine e = Sglang(true, 20, 4);
  CheckEngine(e, 4, 5, SourceDtype::kFp16);
}

TEST(StridedLayout, ScatterOneLayerWritesOnlyThatLayer) {
  Engine e = Vllm("BLNHC", 24, 8, 1, SourceDtype::kFp16);
  const kernels::BlockShape shape = Shape(16, SourceDtype::kFp16);
  const std::vector<uint32_t> table = ShuffledTable(4, 24, 7);
  const size_t section = size_t{16} * kHeads * kDim;
  std::vector<uint16_t> k(section), v(section);
  for (size_t i = 0; i < section; ++i) {
    k[i] = static_cast<uint16_t>(i * 3 + 1);
    v[i] = static_cast<uint16_t>(i * 5 + 2);
  }
  const std::vector<uint16_t> before = e.tensor.data;
  ASSERT_TRUE(ScatterStoreBlockLayer(k, v, shape, 1, 1, table, e.view).ok());
  std::vector<uint16_t> out(2 * kLayers * section);
  ASSERT_TRUE(
      GatherStoreBlock(e.view, table, shape, 1, absl::MakeSpan(out)).ok());
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < section; ++i) {
      const size_t ki = l * 2 * section + i, vi = ki + section;
      if (l == 1) {
        ASSERT_EQ(out[ki], k[i]);
        ASSERT_EQ(out[vi], v[i]);
      }
    }
  }
  size_t changed = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    changed += before[i] != e.tensor.data[i];
  }
  EXPECT_LE(changed, 2 * section);
  EXPECT_GT(changed, 0u);
}

TEST(StridedLayout, DtypeMismatchIsRefusedAndWritesNothing) {
  Engine e = Vllm("LBHNC", 24, 16, 0, SourceDtype::kBf16);
  const kernels::BlockShape shape = Shape(16, SourceDtype::kFp16);
  const std::vector<uint32_t> table = ShuffledTable(2, 24, 3);
  std::vector<uint16_t> block(2 * kLayers * 16 * kHeads * kDim, 1);
  const std::vector<uint16_t> before = e.tensor.data;
  absl::Status s = ScatterStoreBlock(block, shape, 0, table, e.view);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(e.tensor.data, before);
  s = GatherStoreBlock(e.view, table, shape, 0, absl::MakeSpan(block));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST(StridedLayout, PagedViewsCarryTheShapesDtype) {
  // The kNHD/kHND entry points copy bf16 as they copy fp16.
  std::vector<uint16_t> tensor(2 * 8 * 4 * kHeads * kDim);
  std::iota(tensor.begin(), tensor.end(), uint16_t{0});
  PagedKvView view{{PagedOrder::kNHD, 1, 8, 4, kHeads, kDim}, {tensor.data()}};
  kernels::BlockShape shape{1, kHeads, kDim, 4};
  shape.source_dtype = SourceDtype::kBf16;
  std::vector<uint16_t> out(2 * 4 * kHeads * kDim);
  const std::vector<uint32_t> table = {5};
  ASSERT_TRUE(
      GatherStoreBlock(view, table, shape, 0, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out[0], 5 * 4 * kHeads * kDim);
}

TEST(StridedLayout, VllmLayerLayoutRefusesWhatItCannotDescribe) {
  const int64_t shape[] = {4, 2, 16, 16};
  const int64_t dense[] = {512, 256, 16, 1};
  EXPECT_TRUE(VllmLayerLayout(2, shape, dense, SourceDtype::kFp16).ok());
  const int64_t strided_c[] = {1024, 512, 32, 2};
  EXPECT_EQ(
      VllmLayerLayout(2, shape, strided_c, SourceDtype::kFp16).status().code(),
      absl::StatusCode::kInvalidArgument);
  const int64_t odd[] = {4, 2, 16, 15};
  EXPECT_EQ(VllmLayerLayout(2, odd, dense, SourceDtype::kFp16).status().code(),
            absl::StatusCode::kInvalidArgument);
  const int64_t zero[] = {0, 2, 16, 16};
  EXPECT_EQ(VllmLayerLayout(2, zero, dense, SourceDtype::kFp16).status().code(),
            absl::StatusCode::kInvalidArgument);
  const int64_t three[] = {4, 2, 16};
  EXPECT_EQ(
      VllmLayerLayout(2, three, dense, SourceDtype::kFp16).status().code(),
      absl::StatusCode::kInvalidArgument);
  const int64_t negative[] = {512, -256, 16, 1};
  EXPECT_EQ(
      VllmLayerLayout(2, shape, negative, SourceDtype::kFp16).status().code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcache
