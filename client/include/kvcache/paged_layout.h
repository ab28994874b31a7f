// Gather / scatter between an inference engine's paged KV cache and store
// blocks.
//
// Engine side (one tensor per layer, fp16 halves, host memory):
//   kNHD (vLLM's FlashAttention layout):
//     [2][num_blocks][block_size][num_kv_heads][head_dim]
//     element (kv, b, s, h, d) at ((kv*num_blocks + b)*block_size + s)*H*D
//                                 + h*D + d
//   kHND (heads before slots, as FlashInfer's HND or vLLM's XFormers-style):
//     [2][num_blocks][num_kv_heads][block_size][head_dim]
//     element (kv, b, s, h, d) at ((kv*num_blocks + b)*H + h)*block_size*D
//                                 + s*D + d
//   kv = 0 for K, 1 for V; b a physical block id; s a slot in the block.
//
// A sequence's token p lives in physical block block_table[p / block_size]
// at slot p % block_size (vLLM's block table: logical block -> physical id).
//
// Store side (kvcache::Client's block tensor): store block j of a sequence
// holds tokens [j*T, (j+1)*T), T = BlockShape::tokens_per_block, laid out
// for each layer l, K then V, each [T][H][D]:
//   element (l, kv, t, h, d) at ((l*2 + kv)*T + t)*H*D + h*D + d
// T and block_size are independent: a store block may cover part of one
// engine block (T < block_size), exactly one (T == block_size) or several
// (T > block_size, including spans that are not whole engine blocks).
//
// The functions copy runs of head_dim halves (NHD: a whole token row of H*D
// halves); they never allocate, touch only the elements of the tokens they
// are asked for, and are safe to call concurrently on disjoint targets.
//
// StridedKvView (below) is the general form: any per-layer strides, K and V
// at any offsets, and the dtype; the kNHD/kHND functions are that form with
// dense strides.
//
// Device memory: these are host-memory routines. A CUDA engine gathers into
// / scatters from a pinned host staging buffer with its own copy kernels
// (see docs/client.md); device-pointer overloads are not provided yet.
#ifndef KVCACHE_CLIENT_PAGED_LAYOUT_H_
#define KVCACHE_CLIENT_PAGED_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcache/codec.h"

namespace kvcache {

enum class PagedOrder { kNHD, kHND };

struct PagedKvLayout {
  PagedOrder order = PagedOrder::kNHD;
  uint32_t num_layers = 0;
  uint32_t num_blocks = 0;  // physical blocks per layer tensor
  uint32_t block_size = 0;  // engine tokens per block
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
};

// Halves in one layer's tensor: 2 * num_blocks * block_size * H * D.
size_t PagedLayerElements(const PagedKvLayout& layout);

// A non-owning view of an engine's paged cache: layers[l] points at layer
// l's tensor of PagedLayerElements(layout) halves. The memory must outlive
// every call that is given the view.
struct PagedKvView {
  PagedKvLayout layout;
  std::vector<uint16_t*> layers;
};

// INVALID_ARGUMENT when a dimension is 0, the layer count differs from
// layout.num_layers or a layer pointer is null.
absl::Status ValidateView(const PagedKvView& view);

// Copies store block `store_block` of a sequence (tokens [j*T, (j+1)*T))
// from the engine cache into `out` (Fp16BlockBytes(shape)/2 halves).
// INVALID_ARGUMENT when shapes disagree (layers, heads, head_dim), `out` has
// the wrong size, the block table is too short for the block's last token,
// or an entry of it is >= num_blocks.
absl::Status GatherStoreBlock(const PagedKvView& cache,
                              absl::Span<const uint32_t> block_table,
                              const BlockShape& shape, uint32_t store_block,
                              absl::Span<uint16_t> out);

// The inverse: writes store block `store_block` (`in`, a whole block) into
// the engine cache. Same errors; nothing is written when it fails.
absl::Status ScatterStoreBlock(absl::Span<const uint16_t> in,
                               const BlockShape& shape, uint32_t store_block,
                               absl::Span<const uint32_t> block_table,
                               const PagedKvView& cache);

// Writes one layer of store block `store_block`: `k` and `v` are that
// layer's [T][H][D] tensors (T*H*D halves each). For layer-wise loading.
absl::Status ScatterStoreBlockLayer(absl::Span<const uint16_t> k,
                                    absl::Span<const uint16_t> v,
                                    const BlockShape& shape, uint32_t layer,
                                    uint32_t store_block,
                                    absl::Span<const uint32_t> block_table,
                                    const PagedKvView& cache);

// The general form of an engine's paged cache, one region per layer:
// element (kv, physical block b, slot s, head h, channel d) of layer l is
//   layers[l][kv_offset[kv] + b*block_stride + s*token_stride
//             + h*head_stride + d]
// in 16-bit elements (channels contiguous; strides >= 0). It describes:
//  * vLLM's per-layer views (>= 0.28): logical [B][H][N][C] with K and V in
//    the last axis (C = 2*head_dim; kv_offset {0, head_dim}) and the
//    strides of any of its six KVCacheLayout orders (LBHNC, LBNHC, LHBNC,
//    BLHNC, BLNHC, BHLNC; VllmLayerLayout below);
//  * kernel blocks smaller than the engine's block: block_size is the
//    kernel block and the block table lists kernel blocks;
//  * padding: strides larger than the dense ones;
//  * the older [2][B][N][H][D] and [2][B][H][N][D] tensors (StridedLayout);
//  * SGLang's host pools, a "block" being a page of page_size tokens:
//    layer_first [2][L][tokens][H][D] (layers[l] = base + l*tokens*H*D,
//    block_stride page_size*H*D, token_stride H*D, head_stride D,
//    kv_offset {0, L*tokens*H*D}) and page_first [2][tokens][L][H][D]
//    (layers[l] = base + l*H*D, block_stride page_size*L*H*D, token_stride
//    L*H*D, head_stride D, kv_offset {0, tokens*L*H*D}).
// `dtype` must equal the store shape's source dtype (both are 2 bytes).
struct StridedKvLayout {
  uint32_t num_layers = 0;
  uint32_t num_blocks = 0;  // physical blocks: b < num_blocks
  uint32_t block_size = 0;  // tokens per physical block
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  int64_t block_stride = 0;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  int64_t kv_offset[2] = {0, 0};  // K, V
  SourceDtype dtype = SourceDtype::kFp16;
};

struct StridedKvView {
  StridedKvLayout layout;
  std::vector<uint16_t*> layers;
};

// The strided form of a kNHD or kHND layout (fp16).
StridedKvLayout StridedLayout(const PagedKvLayout& layout);

// A vLLM per-layer view: `shape` and `strides` (in elements) of its logical
// [num_blocks][num_kv_heads][block_size][2*head_dim] tensor, as
// torch.Tensor.shape and .stride() give them. INVALID_ARGUMENT when the last
// axis is not contiguous or not even, a dimension is 0 or a stride negative.
absl::StatusOr<StridedKvLayout> VllmLayerLayout(
    uint32_t num_layers, absl::Span<const int64_t> shape,
    absl::Span<const int64_t> strides, SourceDtype dtype);

// INVALID_ARGUMENT for a zero dimension, a negative stride or offset, a
// layer count that differs from the layout's, or a null layer pointer.
absl::Status ValidateView(const StridedKvView& view);

// GatherStoreBlock, ScatterStoreBlock and ScatterStoreBlockLayer over a
// strided view; the same contracts, and INVALID_ARGUMENT when the view's
// dtype differs from the shape's.
absl::Status GatherStoreBlock(const StridedKvView& cache,
                              absl::Span<const uint32_t> block_table,
                              const BlockShape& shape, uint32_t store_block,
                              absl::Span<uint16_t> out);
absl::Status ScatterStoreBlock(absl::Span<const uint16_t> in,
                               const BlockShape& shape, uint32_t store_block,
                               absl::Span<const uint32_t> block_table,
                               const StridedKvView& cache);
absl::Status ScatterStoreBlockLayer(absl::Span<const uint16_t> k,
                                    absl::Span<const uint16_t> v,
                                    const BlockShape& shape, uint32_t layer,
                                    uint32_t store_block,
                                    absl::Span<const uint32_t> block_table,
                                    const StridedKvView& cache);

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_PAGED_LAYOUT_H_
