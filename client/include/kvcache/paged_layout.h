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
// Device memory: these are host-memory routines. A CUDA engine gathers into
// / scatters from a pinned host staging buffer with its own copy kernels
// (see docs/client.md); device-pointer overloads are not provided yet.
#ifndef KVCACHE_CLIENT_PAGED_LAYOUT_H_
#define KVCACHE_CLIENT_PAGED_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
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

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_PAGED_LAYOUT_H_
