// kvcache::LayerStream: a layer-wise read over many nodes in progress
// (ClusterClient::GetLayerwise), and what configures it.
#ifndef KVCACHE_CLIENT_LAYER_STREAM_H_
#define KVCACHE_CLIENT_LAYER_STREAM_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvcache/call_options.h"
#include "kvcache/client.h"

namespace kvcache {

class ClusterClient;

// One layer of one block of a layer-wise read: K and V, [T][H][D] each.
struct LayerSlice {
  uint32_t block = 0;  // index into the keys
  absl::Span<const uint16_t> k;
  absl::Span<const uint16_t> v;
};

// Called once per layer, in layer order, on a client work thread, with the
// layer of every block of the loaded prefix (e.g. to scatter it into the
// engine's paged cache with ScatterStoreBlockLayer). An error stops the
// stream: that layer and later ones fail with it.
using LayerCallback = std::function<absl::Status(
    uint32_t layer, absl::Span<const LayerSlice> blocks)>;

struct LayerwiseOptions {
  // kRaw: the node sends the stored encoding and it is dequantized here,
  // one layer at a time; kFp16: the node dequantizes.
  ReadFormat format = ReadFormat::kFp16;
  LayerCallback on_layer;  // optional
  CallOptions call;
  // How long WaitLayer may wait past the call's deadline for local work
  // (decode, on_layer) on a fetched prefix.
  absl::Duration local_work_budget = absl::Seconds(10);
};

// A layer-wise read in progress (ClusterClient::GetLayerwise).
//
// How it travels: one kvcache::Client::GetInto (allow_missing) per node and
// chunk of at most max_blocks_per_rpc keys, all in parallel, into buffers
// the stream owns. The nodes' answers fix the prefix (the longest run of
// keys found, once every node has answered or at the call's deadline).
// Over the UCX data plane each node then puts its blocks layer by layer
// (all blocks' layer l, then l+1), and layer l is ready as soon as it has
// arrived from every node holding blocks of the prefix: it is decoded
// (kRaw: each block's encoding is cut into per-layer sections, decoded
// bit-identically to the node's own decode), handed to on_layer and
// released to WaitLayer while later layers are still on the wire. Over
// the inline gRPC path every layer of a node's chunk arrives at once; the
// decode and delivery still go layer by layer.
//
// Failures: a node that is down, hung or misses keys shortens the prefix
// (misses, as for Get). A node that fails after the prefix was fixed (its
// transfer breaks) fails the layers not yet delivered with UNAVAILABLE (or
// DEADLINE_EXCEEDED): those layers must be recomputed, the ones delivered
// stay valid. A stopped stream (Cancel, the caller's token, destruction, a
// WaitLayer past its bound) lets its transfers run out before their
// buffers go; only ClusterClient's destructor cuts them short.
class LayerStream {
 public:
  ~LayerStream();  // cancels what is left; waits for a running on_layer
  LayerStream(const LayerStream&) = delete;
  LayerStream& operator=(const LayerStream&) = delete;

  // Blocks until layer `layer` of every block of the loaded prefix is
  // ready (and delivered to on_layer), then returns the prefix length (the
  // same for every layer; 0 when nothing was cached). Errors: CANCELLED,
  // DEADLINE_EXCEEDED (the layer did not arrive in time, or the local work
  // budget ran out), UNAVAILABLE (a node failed mid-transfer),
  // INVALID_ARGUMENT (layer out of range, a bad key), FAILED_PRECONDITION
  // (namespace not registered), DATA_LOSS (a block of the wrong size), or
  // on_layer's error. Bounded by the call's deadline plus
  // local_work_budget.
  absl::StatusOr<uint32_t> WaitLayer(uint32_t layer);

  // Layer `layer` of block `block`; valid once WaitLayer(layer) succeeded,
  // for the stream's lifetime. Empty spans out of range.
  absl::Span<const uint16_t> K(uint32_t block, uint32_t layer) const;
  absl::Span<const uint16_t> V(uint32_t block, uint32_t layer) const;

  // Keys of unavailable nodes (valid once WaitLayer succeeded once).
  uint32_t unavailable_keys() const;

  // Stops the stream: no further on_layer call starts; waiting and future
  // WaitLayer calls fail with CANCELLED (layers ready before stay
  // readable through K and V).
  void Cancel();

  struct State;

 private:
  friend class ClusterClient;
  explicit LayerStream(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_LAYER_STREAM_H_
