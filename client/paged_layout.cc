// Every copy goes through the strided form (StridedKvView): the kNHD and
// kHND layouts are converted to it first, so one loop serves all layouts.
#include "kvcache/paged_layout.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/codec.h"

namespace kvcache {
namespace {

using kernels::BlockShape;

absl::Status CheckArgs(const StridedKvView& cache,
                       absl::Span<const uint32_t> block_table,
                       const BlockShape& shape, uint32_t store_block) {
  if (absl::Status s = ValidateView(cache); !s.ok()) return s;
  const StridedKvLayout& l = cache.layout;
  if (shape.num_layers != l.num_layers ||
      shape.num_kv_heads != l.num_kv_heads || shape.head_dim != l.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("store shape (layers ", shape.num_layers, ", kv heads ",
                     shape.num_kv_heads, ", head_dim ", shape.head_dim,
                     ") differs from the engine layout (", l.num_layers, ", ",
                     l.num_kv_heads, ", ", l.head_dim, ")"));
  }
  if (shape.source_dtype != l.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("store shape holds ", SourceDtypeName(shape.source_dtype),
                     "; the engine cache holds ", SourceDtypeName(l.dtype)));
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

// Copies one layer's K and V between the store tensors (`store_k`,
// `store_v`, [T][H][D] each) and the engine region `engine`.
// kToEngine: store -> engine (StoreT is const uint16_t); else engine ->
// store (StoreT is uint16_t). A token's heads are one run when they are
// adjacent (head_stride == head_dim), else one run per head.
template <bool kToEngine, typename StoreT>
void CopyLayer(const StridedKvLayout& l, absl::Span<const uint32_t> block_table,
               const BlockShape& shape, uint32_t store_block, uint16_t* engine,
               StoreT* store_k, StoreT* store_v) {
  const size_t hd = size_t{l.num_kv_heads} * l.head_dim;
  const bool rows = l.head_stride == static_cast<int64_t>(l.head_dim);
  const size_t run = rows ? hd : l.head_dim;
  const uint32_t runs = rows ? 1 : l.num_kv_heads;
  const uint64_t first = uint64_t{store_block} * shape.tokens_per_block;
  for (uint32_t kv = 0; kv < 2; ++kv) {
    StoreT* store = kv == 0 ? store_k : store_v;
    for (uint32_t t = 0; t < shape.tokens_per_block; ++t) {
      const uint64_t p = first + t;
      const int64_t token =
          l.kv_offset[kv] +
          int64_t{block_table[p / l.block_size]} * l.block_stride +
          static_cast<int64_t>(p % l.block_size) * l.token_stride;
      for (uint32_t h = 0; h < runs; ++h) {
        uint16_t* e = engine + token + h * l.head_stride;
        StoreT* s = store + t * hd + size_t{h} * l.head_dim;
        if constexpr (kToEngine) {
          std::memcpy(e, s, run * sizeof(uint16_t));
        } else {
          std::memcpy(s, e, run * sizeof(uint16_t));
        }
      }
    }
  }
}

size_t SectionElements(const BlockShape& s) {
  return size_t{s.tokens_per_block} * s.num_kv_heads * s.head_dim;
}

// The kNHD/kHND entry points predate the dtype field: they copy 16-bit
// elements of whatever source dtype the store shape names.
StridedKvView Strided(const PagedKvView& view, SourceDtype dtype) {
  StridedKvView strided{StridedLayout(view.layout), view.layers};
  strided.layout.dtype = dtype;
  return strided;
}

}  // namespace

size_t PagedLayerElements(const PagedKvLayout& l) {
  return 2 * size_t{l.num_blocks} * l.block_size * l.num_kv_heads * l.head_dim;
}

StridedKvLayout StridedLayout(const PagedKvLayout& l) {
  StridedKvLayout s;
  s.num_layers = l.num_layers;
  s.num_blocks = l.num_blocks;
  s.block_size = l.block_size;
  s.num_kv_heads = l.num_kv_heads;
  s.head_dim = l.head_dim;
  const int64_t d = l.head_dim;
  const int64_t block = int64_t{l.block_size} * l.num_kv_heads * d;
  s.block_stride = block;
  if (l.order == PagedOrder::kNHD) {  // [2][B][N][H][D]
    s.token_stride = int64_t{l.num_kv_heads} * d;
    s.head_stride = d;
  } else {  // [2][B][H][N][D]
    s.token_stride = d;
    s.head_stride = int64_t{l.block_size} * d;
  }
  s.kv_offset[1] = int64_t{l.num_blocks} * block;
  return s;
}

absl::StatusOr<StridedKvLayout> VllmLayerLayout(
    uint32_t num_layers, absl::Span<const int64_t> shape,
    absl::Span<const int64_t> strides, SourceDtype dtype) {
  if (shape.size() != 4 || strides.size() != 4) {
    return absl::InvalidArgumentError(
        "a vLLM layer view is 4-D: [blocks][kv heads][block size][2*head_dim]");
  }
  for (int i = 0; i < 4; ++i) {
    if (shape[i] <= 0 || shape[i] > 0xFFFFFFFFll || strides[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "axis ", i, " has extent ", shape[i], " and stride ", strides[i]));
    }
  }
  if (strides[3] != 1 || shape[3] % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the K|V axis must be contiguous and even (extent ",
                     shape[3], ", stride ", strides[3], ")"));
  }
  StridedKvLayout l;
  l.num_layers = num_layers;
  l.num_blocks = static_cast<uint32_t>(shape[0]);
  l.num_kv_heads = static_cast<uint32_t>(shape[1]);
  l.block_size = static_cast<uint32_t>(shape[2]);
  l.head_dim = static_cast<uint32_t>(shape[3] / 2);
  l.block_stride = strides[0];
  l.head_stride = strides[1];
  l.token_stride = strides[2];
  l.kv_offset[1] = l.head_dim;
  l.dtype = dtype;
  return l;
}

absl::Status ValidateView(const PagedKvView& view) {
  return ValidateView(Strided(view, SourceDtype::kFp16));
}

absl::Status ValidateView(const StridedKvView& view) {
  const StridedKvLayout& l = view.layout;
  if (l.num_layers == 0 || l.num_blocks == 0 || l.block_size == 0 ||
      l.num_kv_heads == 0 || l.head_dim == 0) {
    return absl::InvalidArgumentError(
        "paged layout has a zero dimension (layers, blocks, block_size, kv "
        "heads, head_dim must all be > 0)");
  }
  if (l.block_stride < 0 || l.token_stride < 0 || l.head_stride < 0 ||
      l.kv_offset[0] < 0 || l.kv_offset[1] < 0) {
    return absl::InvalidArgumentError(
        "paged layout has a negative stride or offset");
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

absl::Status GatherStoreBlock(const StridedKvView& cache,
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
                               const StridedKvView& cache) {
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
                                    const StridedKvView& cache) {
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

absl::Status GatherStoreBlock(const PagedKvView& cache,
                              absl::Span<const uint32_t> block_table,
                              const BlockShape& shape, uint32_t store_block,
                              absl::Span<uint16_t> out) {
  return GatherStoreBlock(Strided(cache, shape.source_dtype), block_table,
                          shape, store_block, out);
}

absl::Status ScatterStoreBlock(absl::Span<const uint16_t> in,
                               const BlockShape& shape, uint32_t store_block,
                               absl::Span<const uint32_t> block_table,
                               const PagedKvView& cache) {
  return ScatterStoreBlock(in, shape, store_block, block_table,
                           Strided(cache, shape.source_dtype));
}

absl::Status ScatterStoreBlockLayer(absl::Span<const uint16_t> k,
                                    absl::Span<const uint16_t> v,
                                    const BlockShape& shape, uint32_t layer,
                                    uint32_t store_block,
                                    absl::Span<const uint32_t> block_table,
                                    const PagedKvView& cache) {
  return ScatterStoreBlockLayer(k, v, shape, layer, store_block, block_table,
                                Strided(cache, shape.source_dtype));
}

}  // namespace kvcache
