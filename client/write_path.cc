// Client::Put: the write path.
//
// A Put goes in batches that fit one gRPC message (max_message_bytes), one
// BeginWrite / CommitWrite round trip each. BeginWrite says which blocks
// the node holds already (their bytes do not travel) and, when asked for
// and offered, where the node's data plane is. Each batch's route is
// chosen once, from that answer and from where the blocks lie:
//   kInline      the bytes travel in the CommitWrite (no data plane);
//   kSend        sent over UCX (ClientPlane::SendBlocks), then committed;
//   kPull        every block lies in one DataBuffer of this client and the
//                node maps client memory: it pulls them (PullBlocks);
//   kStagedPull  blocks outside one DataBuffer, to a node that maps client
//                memory: copied once into a pooled DataBuffer here, then
//                pulled (where UCX's rendezvous over shared memory would
//                copy each block twice: kvcache-bench --put-source=heap,
//                docs/benchmarks.md).
// Fallbacks (kAuto): a send whose data plane cannot be reached
// (UNAVAILABLE) commits inline on the same lease (the node drops the
// staging then); a pull that fails so, or whose buffer the node cannot map
// (UNIMPLEMENTED at the commit), is not tried with that node again and the
// batch begins again. A pulled write that fails is ended, and waited for,
// before the caller's buffer is given back (Impl::EndPulledWrite).
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client_impl.h"
#include "client/ucx/client_plane.h"
#include "kvcache/client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcache {
namespace {

using internal::CacheLineRound;
using internal::CallerCancelled;
using internal::CallScope;

// Bytes of a CommitWrite beyond its payloads (keys, framing).
constexpr size_t kMessageSlack = 64 << 10;

// The end of the batch that starts at `begin`: as many blocks as fit in
// `budget` bytes, at least one.
size_t BatchEnd(absl::Span<const BlockWrite> blocks, size_t begin,
                size_t budget) {
  size_t end = begin;
  size_t bytes = 0;
  while (end < blocks.size() &&
         (end == begin || bytes + blocks[end].fp16.size() * 2 <= budget)) {
    bytes += blocks[end].fp16.size() * 2;
    ++end;
  }
  return end;
}

}  // namespace

enum class Client::Impl::WriteRoute { kInline, kSend, kPull, kStagedPull };

// One batch of a Put, from its BeginWrite to its CommitWrite.
struct Client::Impl::WriteBatch {
  absl::Span<const BlockWrite> blocks;  // the batch's own
  v1::BeginWriteResponse begun;
  WriteRoute route = WriteRoute::kInline;
  // Not kInline: the node's data plane, and the blocks it lacks (index in
  // the batch, bytes and registration; for pulls, their addresses).
  ucx::NodeAddress node;
  std::vector<ucx::ClientPlane::Block> sends;
  std::vector<ucx::ClientPlane::PullBlock> pulls;
  uint64_t pull_buffer = 0;  // the id of the DataBuffer the node pulls from
  // kStagedPull: the pooled DataBuffer the blocks were copied into;
  // declared before `regions` so that it goes back to the pool after them,
  // when nothing else holds its region.
  std::unique_ptr<DataBuffer> staged;
  // The registrations of the blocks that lie in a DataBuffer (for pulls,
  // regions.front() is the one pulled from), held until the commit has
  // answered: a node that pulls reads the buffer until then.
  std::vector<std::shared_ptr<ucx::MemoryRegion>> regions;
  // A pull request went out: the node may be reading the buffer.
  bool pull_issued = false;

  bool present(size_t local) const {
    return local < static_cast<size_t>(begun.present_size()) &&
           begun.present(static_cast<int>(local));
  }
};

absl::StatusOr<PutResult> Client::Put(const std::string& ns,
                                      absl::Span<const BlockWrite> blocks,
                                      const CallOptions& call) {
  PutResult total;
  if (blocks.empty()) return absl::InvalidArgumentError("no blocks to put");
  const CallScope scope = impl_->Scope(call);
  const size_t budget =
      static_cast<size_t>(impl_->options.max_message_bytes) - kMessageSlack;
  size_t begin = 0;
  while (begin < blocks.size()) {
    const size_t end = BatchEnd(blocks, begin, budget);
    absl::StatusOr<bool> done =
        impl_->PutBatch(this, ns, blocks, begin, end, scope, &total);
    if (!done.ok()) return done.status();
    if (*done) begin = end;  // else the same batch again
  }
  return total;
}

absl::StatusOr<bool> Client::Impl::PutBatch(
    Client* client, const std::string& ns, absl::Span<const BlockWrite> blocks,
    size_t begin, size_t end, const CallScope& scope, PutResult* total) {
  WriteBatch batch;
  batch.blocks = blocks.subspan(begin, end - begin);
  if (absl::Status st = BeginWrite(ns, blocks, begin, end, scope, &batch.begun);
      !st.ok()) {
    return st;
  }
  ChooseRoute(client, batch);
  if (batch.route == WriteRoute::kInline &&
      options.data_plane == DataPlane::kUcx) {
    AbortWriteAsync(batch.begun.write_id());
    return absl::FailedPreconditionError(
        "the node offers no UCX data plane and the client requires one");
  }
  if (batch.route != WriteRoute::kInline) {
    if (absl::Status st = Transfer(batch, scope); !st.ok()) {
      absl::StatusOr<bool> commit_inline = AfterFailedTransfer(batch, st);
      if (!commit_inline.ok()) return commit_inline.status();
      if (!*commit_inline) return false;  // begin the batch again
      batch.route = WriteRoute::kInline;  // the fallback: same lease, inline
    }
  }
  return Commit(batch, scope, total);
}

absl::Status Client::Impl::BeginWrite(const std::string& ns,
                                      absl::Span<const BlockWrite> blocks,
                                      size_t begin, size_t end,
                                      const CallScope& scope,
                                      v1::BeginWriteResponse* response) {
  v1::BeginWriteRequest request;
  request.set_namespace_name(ns);
  request.set_namespace_fingerprint(FingerprintOf(ns));
  request.set_use_data_plane(AskForDataPlane());
  request.set_data_plane_client(data_plane_client);
  for (size_t i = begin; i < end; ++i) {
    v1::BlockRef* ref = request.add_blocks();
    ref->set_key(blocks[i].key);
    std::string parent = blocks[i].parent_key;
    if (parent.empty() && i == begin && i > 0) parent = blocks[i - 1].key;
    ref->set_parent_key(parent);
  }
  return Rpc(scope, [&](grpc::ClientContext* ctx) {
    return stub->BeginWrite(ctx, request, response);
  });
}

// Copies the blocks of `sends` into one DataBuffer from `client`'s pool,
// points `pulls` (same order) at the copies, and returns its region (its
// id in *buffer_id, the buffer in *staged), or null when no registered
// memory could be had.
std::shared_ptr<ucx::MemoryRegion> Client::Impl::StageForPull(
    Client* client, absl::Span<const ucx::ClientPlane::Block> sends,
    absl::Span<ucx::ClientPlane::PullBlock> pulls,
    std::unique_ptr<DataBuffer>* staged, uint64_t* buffer_id) {
  uint64_t total = 0;
  for (const ucx::ClientPlane::Block& b : sends) {
    total += CacheLineRound(b.bytes.size());
  }
  absl::StatusOr<std::unique_ptr<DataBuffer>> buffer =
      client->AllocateBuffer(total);
  if (!buffer.ok()) return nullptr;
  std::shared_ptr<ucx::MemoryRegion> region =
      buffers.Holding((*buffer)->data(), (*buffer)->size(), buffer_id);
  if (region == nullptr) return nullptr;
  uint8_t* at = (*buffer)->data();
  for (size_t j = 0; j < sends.size(); ++j) {
    std::memcpy(at, sends[j].bytes.data(), sends[j].bytes.size());
    pulls[j].address = reinterpret_cast<uintptr_t>(at);
    at += CacheLineRound(sends[j].bytes.size());
  }
  *staged = *std::move(buffer);
  return region;
}

void Client::Impl::ChooseRoute(Client* client, WriteBatch& batch) {
  if (!batch.begun.has_data_plane() ||
      !internal::OffersDataPlane(batch.begun.data_plane())) {
    batch.route = WriteRoute::kInline;
    return;
  }
  batch.node = Resolve(batch.begun.data_plane());
  // Pulls need every block in one DataBuffer.
  bool pullable = batch.node.pull_writes && !PullRefused(batch.node.key());
  for (size_t local = 0; local < batch.blocks.size(); ++local) {
    if (batch.present(local)) continue;
    const BlockWrite& block = batch.blocks[local];
    const auto* data = reinterpret_cast<const uint8_t*>(block.fp16.data());
    const size_t size = block.fp16.size() * sizeof(uint16_t);
    uint64_t buffer_id = 0;
    std::shared_ptr<ucx::MemoryRegion> region =
        buffers.Holding(data, size, &buffer_id);
    ucp_mem_h memh = nullptr;
    if (region != nullptr) {
      memh = region->memh();
      if (batch.pulls.empty()) batch.pull_buffer = buffer_id;
      pullable = pullable && buffer_id == batch.pull_buffer;
      batch.regions.push_back(std::move(region));
    } else {
      pullable = false;
    }
    batch.sends.push_back(
        {static_cast<uint32_t>(local), absl::MakeConstSpan(data, size), memh});
    batch.pulls.push_back(
        {static_cast<uint32_t>(local), reinterpret_cast<uintptr_t>(data)});
  }
  if (pullable && !batch.pulls.empty()) {
    batch.route = WriteRoute::kPull;
    return;
  }
  batch.route = WriteRoute::kSend;
  if (batch.pulls.empty() || !batch.node.pull_writes ||
      PullRefused(batch.node.key())) {
    return;
  }
  // A node that cannot map the staged buffer refuses once (see Commit).
  uint64_t staged_id = 0;
  std::shared_ptr<ucx::MemoryRegion> region =
      StageForPull(client, batch.sends, absl::MakeSpan(batch.pulls),
                   &batch.staged, &staged_id);
  if (region != nullptr) {
    batch.regions.insert(batch.regions.begin(), std::move(region));
    batch.pull_buffer = staged_id;
    batch.route = WriteRoute::kStagedPull;
  }
}

// Once sent, the bytes travel to the end (bounded by the deadline): a
// cancel does not cut a transfer short.
absl::Status Client::Impl::Transfer(WriteBatch& batch, const CallScope& scope) {
  if (scope.cancelled()) return CallerCancelled();
  absl::StatusOr<ucx::ClientPlane*> ucx_plane = Plane();
  if (!ucx_plane.ok()) return ucx_plane.status();
  absl::StatusOr<ucx::Token> token =
      ucx::TokenFromBytes(batch.begun.data_plane().token());
  if (!token.ok()) return token.status();
  if (batch.route == WriteRoute::kPull ||
      batch.route == WriteRoute::kStagedPull) {
    batch.pull_issued = true;
    return (*ucx_plane)
        ->PullBlocks(batch.node, batch.begun.write_id(), *token,
                     *batch.regions.front(), batch.pull_buffer, batch.pulls,
                     scope.deadline);
  }
  return (*ucx_plane)
      ->SendBlocks(batch.node, batch.begun.write_id(), *token, batch.sends,
                   scope.deadline);
}

absl::StatusOr<bool> Client::Impl::AfterFailedTransfer(WriteBatch& batch,
                                                       const absl::Status& st) {
  const bool unavailable = st.code() == absl::StatusCode::kUnavailable;
  if (batch.pull_issued) {
    // The node may have the request and be reading the buffer.
    if (absl::Status ended = EndPulledWrite(batch.begun.write_id());
        !ended.ok()) {
      return ended;
    }
    if (unavailable && options.data_plane == DataPlane::kAuto) {
      NoteFallback(st);
      RefusePulls(batch.node.key());
      return false;  // again without a pull, which then falls back inline
    }
    return st;
  }
  // kAuto: a data plane this process cannot reach sends inline with the
  // same lease (the node drops the staging then). Anything else ends the
  // write.
  if (options.data_plane == DataPlane::kUcx || !unavailable) {
    AbortWriteAsync(batch.begun.write_id());
    return st;
  }
  NoteFallback(st);
  return true;
}

absl::StatusOr<bool> Client::Impl::Commit(WriteBatch& batch,
                                          const CallScope& scope,
                                          PutResult* total) {
  v1::CommitWriteRequest commit;
  commit.set_write_id(batch.begun.write_id());
  for (size_t local = 0;
       batch.route == WriteRoute::kInline && local < batch.blocks.size();
       ++local) {
    if (batch.present(local)) continue;
    const BlockWrite& block = batch.blocks[local];
    v1::BlockPayload* p = commit.add_payloads();
    p->set_index(static_cast<uint32_t>(local));
    p->set_fp16(reinterpret_cast<const char*>(block.fp16.data()),
                block.fp16.size() * sizeof(uint16_t));
  }
  v1::CommitWriteResponse response;
  absl::Status st = Rpc(scope, [&](grpc::ClientContext* ctx) {
    return stub->CommitWrite(ctx, commit, &response);
  });
  if (!st.ok() && batch.pull_issued &&
      st.code() == absl::StatusCode::kUnimplemented) {
    // The node could not map the buffer (no shared memory between us): it
    // has dropped the write; send this batch again, and from now on.
    RefusePulls(batch.node.key());
    return false;
  }
  if (!st.ok() && batch.pull_issued) {
    // A commit cut short (deadline, cancel) may still be waiting for the
    // node to finish reading the buffer: end the write and wait for that.
    if (absl::Status ended = EndPulledWrite(batch.begun.write_id());
        !ended.ok()) {
      return ended;
    }
    return st;
  }
  if (!st.ok()) {
    // Not committed, or not known to be: a commit cut short may still
    // complete on the node; otherwise the lease ends at its TTL.
    if (st.code() != absl::StatusCode::kDeadlineExceeded &&
        st.code() != absl::StatusCode::kCancelled) {
      AbortWriteAsync(batch.begun.write_id());
    }
    return st;
  }
  total->stored += response.blocks_stored();
  total->skipped += response.blocks_skipped();
  total->stored_bytes += response.stored_bytes();
  return true;
}

}  // namespace kvcache
