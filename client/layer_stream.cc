// Layer-wise Get (ClusterClient::GetLayerwise) and its LayerStream.
//
// One Client::GetInto per node and chunk (allow_missing), into a buffer of
// the stream's own. The node's answers fix the prefix (a fan-out call:
// complete when every chunk has answered, or at the deadline with what has
// answered). Each chunk's task then waits for its layers one by one
// (PendingRead::WaitLayer); once layer l of every chunk of the prefix is
// there, a delivery task on a work thread decodes it (raw reads), hands it
// to on_layer and marks it ready. A chunk's transfer always runs to its end
// (or its deadline) before its buffer is let go, also when the stream has
// stopped: a cancelled stream never closes a data-plane connection that
// other calls share.
#include "kvcache/layer_stream.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "client/cluster_impl.h"
#include "client/executor.h"
#include "client/fan_out.h"
#include "client/node_set.h"
#include "client/read_decode.h"
#include "kernels/codec.h"
#include "kvcache/cluster_client.h"

namespace kvcache {
namespace internal {

// One GetInto: the keys at `indices` (ascending) of one node.
struct StreamChunk {
  std::string node_id;
  std::vector<uint32_t> indices;
  size_t stride = 0;
  // indices.size() * stride bytes, set by the chunk's task before its read:
  // a DataBuffer of the node's Client (registered once and pooled, so that
  // the node keeps its key; `owner` keeps that Client alive meanwhile), or
  // heap memory when the client has no data plane.
  uint8_t* buffer = nullptr;
  std::shared_ptr<NodeState> owner;
  std::unique_ptr<DataBuffer> registered;  // after `owner`: destroyed first
  std::unique_ptr<uint8_t[]> heap;

  // Guarded by LayerStream::State::mu (not annotated: the analysis cannot
  // name the mutex of the state that owns the chunk).
  GetResult metadata;  // blocks: index = position in `indices`
  std::vector<BlockPlacement> placements;
  uint32_t layers_arrived = 0;  // of every block of the chunk
  absl::Status error;           // the transfer failed
  bool needed = false;          // holds blocks of the prefix
};

// Where block b of the prefix is.
struct StreamBlock {
  StreamChunk* chunk = nullptr;
  const uint8_t* bytes = nullptr;  // the block's bytes in the chunk buffer
  uint64_t length = 0;
  ReadFormat format = ReadFormat::kFp16;
  CodecPolicy policy;           // kRaw: the block's own (residual: none)
  std::vector<size_t> offsets;  // kRaw: layer offsets, num_layers + 1
};

struct StreamPrefix {
  uint32_t prefix = 0;
  uint32_t unavailable = 0;
};

}  // namespace internal

using internal::ClusterNamespace;
using internal::NodeSet;
using internal::NodeState;
using internal::StreamBlock;
using internal::StreamChunk;
using internal::StreamPrefix;

struct LayerStream::State {
  Mutex mu;
  // Signalled on every change of stop, in_callback, ready_layers, error.
  CondVar cv;
  // Fixed before the fetch starts.
  BlockShape shape;
  uint32_t num_layers = 0;
  size_t section = 0;  // halves of one layer's K (or V) of one block
  absl::Time wait_bound;
  ReadFormat format = ReadFormat::kFp16;
  LayerCallback on_layer;
  internal::Executor* work = nullptr;
  std::shared_ptr<CancelToken> cancel = std::make_shared<CancelToken>();
  std::shared_ptr<CancelToken> caller_cancel;
  uint64_t caller_cancel_id = 0;
  std::vector<std::shared_ptr<StreamChunk>> chunks;

  bool stop ABSL_GUARDED_BY(mu) = false;
  bool in_callback ABSL_GUARDED_BY(mu) = false;
  bool fetched ABSL_GUARDED_BY(mu) = false;     // the prefix is fixed
  bool delivering ABSL_GUARDED_BY(mu) = false;  // a delivery task is queued
  uint32_t ready_layers ABSL_GUARDED_BY(mu) = 0;
  absl::Status error ABSL_GUARDED_BY(mu);
  uint32_t prefix ABSL_GUARDED_BY(mu) = 0;
  uint32_t unavailable ABSL_GUARDED_BY(mu) = 0;
  // Set with `fetched`, then read-only (the delivery task writes `decoded`
  // layer by layer, each before ready_layers passes it).
  std::vector<StreamBlock> blocks;
  // kRaw: per prefix block, every layer decoded to fp16.
  std::vector<std::vector<uint16_t>> decoded;

  void FailLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (error.ok()) error = std::move(status);
    cv.SignalAll();
  }
  void Fail(absl::Status status) {
    MutexLock lock(&mu);
    FailLocked(std::move(status));
  }
  void Stop(absl::Status status) {
    MutexLock lock(&mu);
    stop = true;
    FailLocked(std::move(status));
  }
  // Ends a delivery task; `status` (when not OK) fails the stream.
  void EndDelivery(absl::Status status) {
    MutexLock lock(&mu);
    delivering = false;
    if (!status.ok()) FailLocked(std::move(status));
  }
  // Until no on_layer call runs.
  void WaitForCallbackLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cv.Wait(&mu, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return !in_callback;
    });
  }
  // The fp16 of layer `l` of prefix block `b` (K then V).
  const uint16_t* Layer(uint32_t b, uint32_t l) const {
    const uint16_t* base =
        format == ReadFormat::kRaw
            ? decoded[b].data()
            : reinterpret_cast<const uint16_t*>(blocks[b].bytes);
    return base + size_t{l} * 2 * section;
  }
};

namespace {

using StreamState = LayerStream::State;

// Decodes layer `l` of one raw block into `out` (2*section halves).
absl::Status DecodeRawLayer(const BlockShape& shape, const StreamBlock& block,
                            uint32_t l, absl::Span<uint16_t> out) {
  BlockShape one = shape;
  one.num_layers = 1;
  return kernels::DecodeBlock(
      one, kernels::LayerPolicy(shape, block.policy, l),
      absl::MakeConstSpan(block.bytes + block.offsets[l],
                          block.offsets[l + 1] - block.offsets[l]),
      out);
}

void Deliver(const std::shared_ptr<StreamState>& s);

// Starts a delivery task when the next layer is ready everywhere (or a
// chunk of the prefix failed) and none runs.
void MaybeDeliver(const std::shared_ptr<StreamState>& s) {
  {
    MutexLock lock(&s->mu);
    if (!s->fetched || s->delivering || s->stop || !s->error.ok() ||
        s->ready_layers >= s->num_layers) {
      return;
    }
    const uint32_t l = s->ready_layers;
    for (const auto& c : s->chunks) {
      if (c->needed && c->layers_arrived <= l && c->error.ok()) return;
    }
    s->delivering = true;
  }
  if (s->work == nullptr || !s->work->Submit([s] { Deliver(s); })) {
    s->EndDelivery(absl::CancelledError("ClusterClient is shutting down"));
  }
}

// The next layer to deliver, once it has arrived from every chunk of the
// prefix; nullopt (and the delivery task ended) when there is none now: the
// stream stopped or failed, every layer is out, a chunk has not delivered
// it yet, or a chunk failed (which fails the stream).
std::optional<uint32_t> NextLayer(StreamState& s) {
  MutexLock lock(&s.mu);
  if (s.stop || !s.error.ok() || s.ready_layers >= s.num_layers) {
    s.delivering = false;
    return std::nullopt;
  }
  const uint32_t l = s.ready_layers;
  for (const auto& c : s.chunks) {
    if (!c->needed || c->layers_arrived > l) continue;
    if (!c->error.ok()) {
      const absl::StatusCode code = c->error.code();
      s.FailLocked(
          code == absl::StatusCode::kDeadlineExceeded ||
                  code == absl::StatusCode::kCancelled
              ? c->error  // the deadline, or shutdown
              : absl::UnavailableError(absl::StrCat(
                    "node ", c->node_id,
                    " failed after the prefix was fixed, before layer ", l,
                    ": ", c->error.message())));
    }
    s.delivering = false;
    return std::nullopt;
  }
  return l;
}

// Layer `l` of every prefix block as slices (decoded first for kRaw).
absl::Status SliceLayer(StreamState& s, uint32_t l,
                        std::vector<LayerSlice>& slices) {
  for (uint32_t b = 0; b < s.blocks.size(); ++b) {
    if (s.format == ReadFormat::kRaw) {
      absl::Span<uint16_t> out =
          absl::MakeSpan(s.decoded[b])
              .subspan(size_t{l} * 2 * s.section, 2 * s.section);
      absl::Status st = DecodeRawLayer(s.shape, s.blocks[b], l, out);
      if (!st.ok()) return st;
    }
    const uint16_t* layer = s.Layer(b, l);
    slices[b] = {b, absl::MakeConstSpan(layer, s.section),
                 absl::MakeConstSpan(layer + s.section, s.section)};
  }
  return absl::OkStatus();
}

// Delivers every layer that is ready, in order.
void Deliver(const std::shared_ptr<StreamState>& s) {
  std::vector<LayerSlice> slices(s->blocks.size());
  while (true) {
    const std::optional<uint32_t> next = NextLayer(*s);
    if (!next.has_value()) return;
    const uint32_t l = *next;
    if (absl::Status st = SliceLayer(*s, l, slices); !st.ok()) {
      return s->EndDelivery(st);
    }
    {
      MutexLock lock(&s->mu);
      if (s->stop) {
        s->delivering = false;
        return;
      }
      s->in_callback = s->on_layer != nullptr;
    }
    absl::Status st = s->on_layer ? s->on_layer(l, absl::MakeConstSpan(slices))
                                  : absl::OkStatus();
    MutexLock lock(&s->mu);
    s->in_callback = false;
    s->cv.SignalAll();
    if (!st.ok()) {
      s->delivering = false;
      s->FailLocked(st);
      return;
    }
    s->ready_layers = l + 1;
  }
}

// Places prefix block `b` (chunk `chunk`, position `position` in it) and,
// for raw reads, cuts its layers.
absl::Status PlaceBlock(StreamState& s, uint32_t b, StreamChunk& chunk,
                        uint32_t position, size_t fp16_bytes) {
  size_t j = 0;
  while (j < chunk.metadata.blocks.size() &&
         chunk.metadata.blocks[j].index != position) {
    ++j;
  }
  if (j == chunk.metadata.blocks.size()) {
    return absl::InternalError("a block of the prefix has no placement");
  }
  const BlockData& meta = chunk.metadata.blocks[j];
  StreamBlock& block = s.blocks[b];
  block.chunk = &chunk;
  block.bytes = chunk.buffer + chunk.placements[j].offset;
  block.length = chunk.placements[j].length;
  block.format = meta.format;
  chunk.needed = true;
  if (meta.format != ReadFormat::kRaw) {
    if (block.length != fp16_bytes) {
      return absl::DataLossError("fp16 block of the wrong size");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<CodecPolicy> policy =
      internal::StoredPolicy(chunk.metadata.policy, meta.codec);
  if (!policy.ok()) return policy.status();
  block.policy = *std::move(policy);
  block.offsets = kernels::EncodedLayerOffsets(s.shape, block.policy);
  if (block.offsets.back() != block.length) {
    return absl::DataLossError(absl::StrCat("raw block ", b, " has ",
                                            block.length, " bytes; expected ",
                                            block.offsets.back()));
  }
  return absl::OkStatus();
}

// Fixes the prefix from the chunks' answers: where each of its blocks is,
// and (raw reads) how its layers are cut. Then starts delivery.
void FixPrefix(const std::shared_ptr<StreamState>& s, const StreamPrefix& p,
               const std::vector<std::pair<uint32_t, uint32_t>>& where) {
  const size_t fp16_bytes = 4 * s->section * s->num_layers;
  absl::Status error;
  {
    MutexLock lock(&s->mu);
    s->prefix = p.prefix;
    s->unavailable = p.unavailable;
    s->blocks.resize(p.prefix);
    for (uint32_t b = 0; b < p.prefix && error.ok(); ++b) {
      error = PlaceBlock(*s, b, *s->chunks[where[b].first], where[b].second,
                         fp16_bytes);
    }
    if (error.ok() && s->format == ReadFormat::kRaw) {
      s->decoded.resize(p.prefix);
      for (auto& d : s->decoded) d.resize(2 * s->section * s->num_layers);
    }
    if (!error.ok()) {
      s->blocks.clear();
      s->prefix = 0;
      s->FailLocked(error);
    } else if (p.prefix == 0) {
      s->ready_layers = s->num_layers;  // nothing cached: trivially ready
      s->cv.SignalAll();
    }
    s->fetched = true;
  }
  MaybeDeliver(s);
}

// ---------------------------------------------------------------------------
// The fetch: which keys each node is asked for, and the prefix they fix.

struct PrefixPartial {
  std::vector<uint8_t> state;  // per key: 0 unknown, 1 found, 2 missing
  std::optional<absl::Status> error;
};
using PrefixCall = internal::FanOutCall<PrefixPartial, StreamPrefix>;
constexpr uint8_t kUnknown = 0;
constexpr uint8_t kFound = 1;
constexpr uint8_t kMiss = 2;

// `where[i]`: key i's chunk and position in it.
using KeyPlaces = std::vector<std::pair<uint32_t, uint32_t>>;

struct ChunkTask {
  std::shared_ptr<NodeState> node;
  uint64_t epoch;
  std::shared_ptr<StreamChunk> chunk;
};

// Chunks per owner of `keys` (recorded in s.chunks and `where`).
std::vector<ChunkTask> PlanChunks(const NodeSet& nodes, StreamState& s,
                                  const std::vector<std::string>& keys,
                                  const ClusterNamespace& space,
                                  KeyPlaces& where) {
  std::vector<ChunkTask> tasks;
  const size_t stride = (space.fp16_block_bytes + 63) / 64 * 64;
  for (internal::NodePlan& plan : nodes.PlanByOwner(
           keys.size(), [&](size_t i) { return absl::string_view(keys[i]); })) {
    for (std::vector<uint32_t>& indices :
         internal::Chunks(plan.indices, space.chunk_blocks)) {
      auto chunk = std::make_shared<StreamChunk>();
      chunk->node_id = plan.node->id;
      for (uint32_t j = 0; j < indices.size(); ++j) {
        where[indices[j]] = {static_cast<uint32_t>(s.chunks.size()), j};
      }
      chunk->indices = std::move(indices);
      chunk->stride = stride;
      s.chunks.push_back(chunk);
      tasks.push_back({plan.node, plan.epoch, std::move(chunk)});
    }
  }
  return tasks;
}

// The call whose delivery fixes the prefix of `state`.
std::shared_ptr<PrefixCall> MakePrefixCall(
    const std::shared_ptr<StreamState>& state,
    std::shared_ptr<const KeyPlaces> where, size_t n, absl::Time deadline,
    std::atomic<uint64_t>* unavailable_keys) {
  return std::make_shared<PrefixCall>(
      deadline, /*wait_for_tasks=*/false,
      PrefixPartial{std::vector<uint8_t>(n, kUnknown), std::nullopt},
      [unavailable_keys](PrefixPartial& p) -> absl::StatusOr<StreamPrefix> {
        if (p.error.has_value()) return *p.error;
        StreamPrefix r;
        while (r.prefix < p.state.size() && p.state[r.prefix] == kFound) {
          ++r.prefix;
        }
        r.unavailable = static_cast<uint32_t>(
            std::count(p.state.begin(), p.state.end(), kUnknown));
        unavailable_keys->fetch_add(r.unavailable);
        return r;
      },
      [state, where](absl::StatusOr<StreamPrefix> r) {
        if (!r.ok()) return state->Fail(r.status());
        FixPrefix(state, *r, *where);
      });
}

// What the GetInto of one chunk answered.
struct ChunkRead {
  absl::Status status;
  std::unique_ptr<PendingRead> read;  // when status is OK and not all_missing
  GetResult metadata;
  bool all_missing = false;
};

// The chunk's GetInto into a buffer of its own (see StreamChunk::buffer).
ChunkRead ReadChunk(NodeSet& nodes, PrefixCall& call,
                    const std::shared_ptr<CancelToken>& shutdown_cancel,
                    StreamState& s, const ClusterNamespace& space,
                    const std::vector<std::string>& sub,
                    const std::shared_ptr<NodeState>& node, uint64_t epoch,
                    StreamChunk& chunk) {
  ChunkRead out;
  absl::StatusOr<std::unique_ptr<PendingRead>> read;
  out.status = absl::CancelledError("node marked down");
  if (nodes.StillUsable(*node, epoch)) {
    const size_t bytes = chunk.indices.size() * chunk.stride;
    absl::StatusOr<std::unique_ptr<DataBuffer>> registered =
        node->client->AllocateBuffer(bytes);
    if (registered.ok() && (*registered)->registered()) {
      chunk.owner = node;
      chunk.registered = *std::move(registered);
      chunk.buffer = chunk.registered->data();
    } else {
      chunk.heap = std::make_unique<uint8_t[]>(bytes);
      chunk.buffer = chunk.heap.get();
    }
    ReadOptions read_options;
    read_options.format = s.format;
    read_options.allow_missing = true;
    // Not the call's cancel: a stopped stream lets its transfers run out
    // (bounded by their deadline) rather than close a connection that other
    // calls share.
    out.status = nodes.RunOnNode(
        *node, epoch, space, call.stop(), call.deadline(), shutdown_cancel,
        NodeSet::RunFlags{true, /*reregister_on_not_found=*/true},
        [&](const CallOptions& rpc) {
          read = node->client->GetInto(space.spec.name, sub, read_options,
                                       absl::MakeSpan(chunk.buffer, bytes),
                                       chunk.stride, rpc);
          return read.status();
        });
  }
  if (internal::IsMiss(out.status.code())) {  // predates allow_missing
    out.all_missing = true;
    out.status = absl::OkStatus();
  } else if (out.status.ok()) {
    out.read = *std::move(read);
    out.metadata = out.read->metadata();
    const BlockShape& got = out.metadata.shape;
    const BlockShape& want = space.spec.shape;
    // Not the layout this client knows: unusable.
    out.all_missing = !out.metadata.blocks.empty() &&
                      (got.num_layers != want.num_layers ||
                       got.tokens_per_block != want.tokens_per_block ||
                       got.num_kv_heads != want.num_kv_heads ||
                       got.head_dim != want.head_dim);
    // Recorded before TaskDone: the prefix may be fixed inside it.
    MutexLock lock(&s.mu);
    chunk.metadata = out.metadata;
    chunk.placements = out.read->placements();
  }
  return out;
}

// Layer by layer until the chunk's transfer ends, also when the stream no
// longer needs it (the buffer must outlive the transfer).
void StreamLayers(NodeSet& nodes, const std::atomic<bool>& shutting_down,
                  const std::shared_ptr<StreamState>& state, PendingRead& read,
                  NodeState& node, uint64_t epoch, StreamChunk& chunk) {
  const uint32_t layers = read.num_layers();
  for (uint32_t l = 0; l < layers; ++l) {
    absl::Status arrived = read.WaitLayer(l);
    {
      MutexLock lock(&state->mu);
      if (arrived.ok()) {
        chunk.layers_arrived = l + 1;
      } else {
        chunk.error = arrived;
      }
    }
    MaybeDeliver(state);
    if (!arrived.ok()) {
      if (internal::IsNodeFailure(arrived.code()) && !shutting_down.load()) {
        nodes.MarkDown(node, epoch);
      }
      return;
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// LayerStream

LayerStream::LayerStream(std::shared_ptr<State> state)
    : state_(std::move(state)) {}

LayerStream::~LayerStream() {
  Cancel();
  if (state_->caller_cancel != nullptr) {
    state_->caller_cancel->RemoveCallback(state_->caller_cancel_id);
  }
  // No on_layer starts after Cancel(); wait for one that runs (it is the
  // caller's own bounded work on memory that may die with this stream).
  MutexLock lock(&state_->mu);
  state_->WaitForCallbackLocked();
}

void LayerStream::Cancel() {
  state_->Stop(absl::CancelledError("stream cancelled"));
  state_->cancel->Cancel();
}

absl::StatusOr<uint32_t> LayerStream::WaitLayer(uint32_t layer) {
  State* s = state_.get();
  MutexLock lock(&s->mu);
  if (layer >= s->num_layers) {
    if (!s->error.ok()) return s->error;
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, " is out of range (", s->num_layers, " layers)"));
  }
  auto ready = [s, layer]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
    return s->ready_layers > layer || !s->error.ok();
  };
  if (!s->cv.WaitUntil(&s->mu, s->wait_bound, ready)) {
    s->stop = true;
    s->FailLocked(absl::DeadlineExceededError(
        absl::StrCat("layer ", layer, " was not ready by the deadline")));
    // No on_layer starts now; let one that runs finish before returning.
    s->WaitForCallbackLocked();
  }
  if (s->ready_layers > layer) return s->prefix;
  return s->error;
}

absl::Span<const uint16_t> LayerStream::K(uint32_t block,
                                          uint32_t layer) const {
  State* s = state_.get();
  MutexLock lock(&s->mu);
  if (layer >= s->ready_layers || block >= s->blocks.size()) return {};
  return absl::MakeConstSpan(s->Layer(block, layer), s->section);
}

absl::Span<const uint16_t> LayerStream::V(uint32_t block,
                                          uint32_t layer) const {
  State* s = state_.get();
  MutexLock lock(&s->mu);
  if (layer >= s->ready_layers || block >= s->blocks.size()) return {};
  return absl::MakeConstSpan(s->Layer(block, layer) + s->section, s->section);
}

uint32_t LayerStream::unavailable_keys() const {
  MutexLock lock(&state_->mu);
  return state_->fetched ? state_->unavailable : 0;
}

// ---------------------------------------------------------------------------
// ClusterClient::GetLayerwise

std::unique_ptr<LayerStream> ClusterClient::GetLayerwise(
    const std::string& ns_name, std::vector<std::string> keys,
    LayerwiseOptions options) {
  auto state = std::make_shared<LayerStream::State>();
  std::unique_ptr<LayerStream> stream(new LayerStream(state));
  absl::StatusOr<std::shared_ptr<const ClusterNamespace>> ns =
      impl_->FindNamespace(ns_name);
  if (!ns.ok()) {
    state->Fail(ns.status());
    return stream;
  }
  std::shared_ptr<const ClusterNamespace> space = *ns;
  const BlockShape& shape = space->spec.shape;
  state->shape = shape;
  state->num_layers = shape.num_layers;
  state->section =
      size_t{shape.tokens_per_block} * shape.num_kv_heads * shape.head_dim;
  state->format = options.format;
  state->on_layer = std::move(options.on_layer);
  state->work = impl_->work.get();
  const absl::Time deadline = impl_->Deadline(options.call);
  state->wait_bound = deadline + options.local_work_budget;
  if (absl::Status s = internal::ValidateKeys(keys); !s.ok()) {
    state->Fail(s);
    return stream;
  }
  if (options.call.cancel != nullptr) {
    std::weak_ptr<LayerStream::State> weak = state;
    state->caller_cancel = options.call.cancel;
    state->caller_cancel_id = options.call.cancel->AddCallback([weak] {
      if (auto s = weak.lock()) {
        s->Stop(absl::CancelledError("cancelled by the caller"));
        s->cancel->Cancel();
      }
    });
  }
  {
    MutexLock lock(&state->mu);
    if (state->stop) return stream;  // cancelled already
  }
  impl_->StartLayerFetch(state, std::move(space), std::move(keys), deadline);
  return stream;
}

void ClusterClient::Impl::StartLayerFetch(
    const std::shared_ptr<LayerStream::State>& state,
    std::shared_ptr<const ClusterNamespace> space,
    std::vector<std::string> keys, absl::Time deadline) {
  const size_t n = keys.size();
  auto shared_keys =
      std::make_shared<const std::vector<std::string>>(std::move(keys));
  auto where = std::make_shared<KeyPlaces>(n, std::make_pair(0u, 0u));
  std::vector<ChunkTask> tasks =
      PlanChunks(nodes, *state, *shared_keys, *space, *where);
  std::shared_ptr<PrefixCall> call =
      MakePrefixCall(state, where, n, deadline, &unavailable_keys);
  Arm(call, state->cancel);
  for (ChunkTask& t : tasks) {
    call->Spawn(SubmitTo(t.node), [this, call, state, space, shared_keys, t] {
      std::vector<std::string> sub;
      for (uint32_t i : t.chunk->indices) sub.push_back((*shared_keys)[i]);
      ChunkRead r = ReadChunk(nodes, *call, shutdown_cancel, *state, *space,
                              sub, t.node, t.epoch, *t.chunk);
      call->TaskDone([&](PrefixPartial& p) {
        if (!r.status.ok()) {
          if (internal::IsCallerError(r.status.code()) &&
              !p.error.has_value()) {
            p.error = r.status;
          }
          return;  // unknown: unavailable
        }
        if (r.all_missing) {
          for (uint32_t i : t.chunk->indices) p.state[i] = kMiss;
          return;
        }
        for (uint32_t j : r.metadata.missing) {
          p.state[t.chunk->indices[j]] = kMiss;
        }
        for (const BlockData& b : r.metadata.blocks) {
          p.state[t.chunk->indices[b.index]] = kFound;
        }
      });
      if (!r.status.ok() || r.all_missing || r.metadata.blocks.empty()) return;
      StreamLayers(nodes, *shutting_down, state, *r.read, *t.node, t.epoch,
                   *t.chunk);
    });
  }
  call->Planned();
}

}  // namespace kvcache
