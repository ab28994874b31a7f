#include "kvcache/paged_layout.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/codec.h"

namespace kvcache {
namespace {

using kernels::BlockShape;

absl::Status CheckArgs(const PagedKvView& cache,
                       absl::Span<const uint32_t> block_table,
                       const BlockShape& shape, uint32_t store_block) {
  if (absl::Status s = ValidateView(cache); !s.ok()) return s;
  const PagedKvLayout& l = cache.layout;
  if (shape.num_layers != l.num_layers ||
      shape.num_kv_heads != l.num_kv_heads || shape.head_dim != l.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("store shape (layers ", shape.num_layers, ", kv heads ",
                     shape.num_kv_heads, ", head_dim ", shape.head_dim,
                     ") differs from the engine layout (", l.num_layers, ", ",
                     l.num_kv_heads, ", ", l.head_dim, ")"));
  }
  if (shape.tokens_per_block == 0) {
    return absl::InvalidArgumentError("tokens_per_block is 0");
  }
  const uint64_t first = uint64_t{store_block} * shape.tokens_per_block;
  const uint64_t last = first + shape.tokens_per_block - 1;
  const uint64_t last_logical = last / l.block_size;
  if (last_logical >= block_table.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block table has ", block_table.size(), " entries; store block ",
        store_block, " needs ", last_logical + 1));
  }
  for (uint64_t b = first / l.block_size; b <= last_logical; ++b) {
    if (block_table[b] >= l.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("block table entry ", b, " is ", block_table[b],
                       "; the cache has ", l.num_blocks, " blocks"));
    }
  }
  return absl::OkStatus();
}

// Offset in a layer tensor of element (kv, token p of the sequence, head h,
// channel 0).
size_t EngineOffset(const PagedKvLayout& l,
                    absl::Span<const uint32_t> block_table, uint32_t kv,
                    uint64_t p, uint32_t h) {
  const size_t b = block_table[p / l.block_size];
  const size_t s = p % l.block_size;
  const size_t hd = size_t{l.num_kv_heads} * l.head_dim;
  if (l.order == PagedOrder::kNHD) {
    return ((kv * size_t{l.num_blocks} + b) * l.block_size + s) * hd +
           size_t{h} * l.head_dim;
  }
  return ((kv * size_t{l.num_blocks} + b) * l.num_kv_heads + h) *
             size_t{l.block_size} * l.head_dim +
         s * l.head_dim;
}

// Copies one layer's K and V between the store tensors (`store_k`,
// `store_v`, [T][H][D] each) and the engine tensor `engine`.
// kToEngine: store -> engine (StoreT is const uint16_t); else engine ->
// store (StoreT is uint16_t).
template <bool kToEngine, typename StoreT>
void CopyLayer(const PagedKvLayout& l, absl::Span<const uint32_t> block_table,
               const BlockShape& shape, uint32_t store_block, uint16_t* engine,
               StoreT* store_k, StoreT* store_v) {
  const size_t hd = size_t{l.num_kv_heads} * l.head_dim;
  const uint64_t first = uint64_t{store_block} * shape.tokens_per_block;
  for (uint32_t kv = 0; kv < 2; ++kv) {
    StoreT* store = kv == 0 ? store_k : store_v;
    for (uint32_t t = 0; t < shape.tokens_per_block; ++t) {
      StoreT* row = store + t * hd;
      if (l.order == PagedOrder::kNHD) {
        uint16_t* e = engine + EngineOffset(l, block_table, kv, first + t, 0);
        if constexpr (kToEngine) {
          std::memcpy(e, row, hd * sizeof(uint16_t));
        } else {
          std::memcpy(row, e, hd * sizeof(uint16_t));
        }
        continue;
      }
      for (uint32_t h = 0; h < l.num_kv_heads; ++h) {
        uint16_t* e = engine + EngineOffset(l, block_table, kv, first + t, h);
        StoreT* s = row + size_t{h} * l.head_dim;
        if constexpr (kToEngine) {
          std::memcpy(e, s, l.head_dim * sizeof(uint16_t));
        } else {
          std::memcpy(s, e, l.head_dim * sizeof(uint16_t));
        }
      }
    }
  }
}

size_t SectionElements(const BlockShape& s) {
  return size_t{s.tokens_per_block} * s.num_kv_heads * s.head_dim;
}

}  // namespace

size_t PagedLayerElements(const PagedKvLayout& l) {
  return 2 * size_t{l.num_blocks} * l.block_size * l.num_kv_heads * l.head_dim;
}

absl::Status ValidateView(const PagedKvView& view) {
  const PagedKvLayout& l = view.layout;
  if (l.num_layers == 0 || l.num_blocks == 0 || l.block_size == 0 ||
      l.num_kv_heads == 0 || l.head_dim == 0) {
    return absl::InvalidArgumentError(
        "paged layout has a zero dimension (layers, blocks, block_size, kv "
        "heads, head_dim must all be > 0)");
  }
  if (view.layers.size() != l.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged view has ", view.layers.size(),
                     " layer pointers; the layout has ", l.num_layers));
  }
  for (size_t i = 0; i < view.layers.size(); ++i) {
    if (view.layers[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", i, " pointer is null"));
    }
  }
  return absl::OkStatus();
}

absl::Status GatherStoreBlock(const PagedKvView& cache,
                              absl::Span<const uint32_t> block_table,
                              const BlockShape& shape, uint32_t store_block,
                              absl::Span<uint16_t> out) {
  if (absl::Status s = CheckArgs(cache, block_table, shape, store_block);
      !s.ok()) {
    return s;
  }
  const size_t section = SectionElements(shape);
  if (out.size() != 2 * section * shape.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("output has ", out.size(), " halves; a block has ",
                     2 * section * shape.num_layers));
  }
  for (uint32_t l = 0; l < shape.num_layers; ++l) {
    uint16_t* k = out.data() + size_t{l} * 2 * section;
    CopyLayer<false>(cache.layout, block_table, shape, store_block,
                     cache.layers[l], k, k + section);
  }
  return absl::OkStatus();
}

absl::Status ScatterStoreBlock(absl::Span<const uint16_t> in,
                               const BlockShape& shape, uint32_t store_block,
                               absl::Span<const uint32_t> block_table,
                               const PagedKvView& cache) {
  if (absl::Status s = CheckArgs(cache, block_table, shape, store_block);
      !s.ok()) {
    return s;
  }
  const size_t section = SectionElements(shape);
  if (in.size() != 2 * section * shape.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("input has ", in.size(), " halves; a block has ",
                     2 * section * shape.num_layers));
  }
  for (uint32_t l = 0; l < shape.num_layers; ++l) {
    const uint16_t* k = in.data() + size_t{l} * 2 * section;
    CopyLayer<true>(cache.layout, block_table, shape, store_block,
                    cache.layers[l], k, k + section);
  }
  return absl::OkStatus();
}

absl::Status ScatterStoreBlockLayer(absl::Span<const uint16_t> k,
                                    absl::Span<const uint16_t> v,
                                    const BlockShape& shape, uint32_t layer,
                                    uint32_t store_block,
                                    absl::Span<const uint32_t> block_table,
                                    const PagedKvView& cache) {
  if (absl::Status s = CheckArgs(cache, block_table, shape, store_block);
      !s.ok()) {
    return s;
  }
  if (layer >= shape.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, " is out of range (", shape.num_layers, " layers)"));
  }
  const size_t section = SectionElements(shape);
  if (k.size() != section || v.size() != section) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer tensors have ", k.size(), " and ", v.size(),
                     " halves; a layer's K or V has ", section));
  }
  CopyLayer<true>(cache.layout, block_table, shape, store_block,
                  cache.layers[layer], k.data(), v.data());
  return absl::OkStatus();
}

}  // namespace kvcache
