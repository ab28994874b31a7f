// Private to the client library: the registered memory of one Client
// (DataBuffer, and the regions Get lands blocks in).
//
// Invariants:
//  * Every region comes from the Client's UCX plane and carries an id the
//    nodes key their mapping by (ReadStartHeader::buffer_id): a region
//    reused keeps its id, so a node that mapped it once needs no new key.
//  * A live DataBuffer is listed by its first byte, so that a Put source or
//    a GetInto destination inside it is found (Holding) and goes with its
//    registration. Reads in progress hold the region (shared_ptr): a
//    region goes back to the idle pool only when nothing else holds it.
//  * A fresh region is faulted in before it is handed out (base/populate.h),
//    as a registration for RDMA would leave it, so the first read into it
//    runs as fast as the next ones (over tcp here: 360 against 2000 MiB/s
//    into 512 MiB); allocating pays for the pages instead.
//  * At most ClientOptions::max_idle_buffer_bytes are kept idle; past that
//    the node is told to drop the key and the region goes with its last
//    holder.
#ifndef KVCACHE_CLIENT_BUFFER_POOL_H_
#define KVCACHE_CLIENT_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "client/ucx/client_plane.h"
#include "kvcache/client.h"

namespace kvcache::internal {

class BufferPool {
 public:
  explicit BufferPool(size_t max_idle_bytes)
      : max_idle_bytes_(max_idle_bytes) {}
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A DataBuffer of `bytes` (> 0) registered with `plane` (a region of the
  // pool, or a fresh one); it gives its region back when destroyed. The
  // pool and `plane` must outlive it.
  absl::StatusOr<std::unique_ptr<DataBuffer>> Allocate(ucx::ClientPlane* plane,
                                                       size_t bytes);
  // A DataBuffer of plain memory (no data plane).
  static std::unique_ptr<DataBuffer> AllocatePlain(size_t bytes);

  // The registered DataBuffer region holding [data, data + n), if any, and
  // its id in *id.
  std::shared_ptr<ucx::MemoryRegion> Holding(const uint8_t* data, size_t n,
                                             uint64_t* id);

 private:
  struct Landing {
    std::shared_ptr<ucx::MemoryRegion> region;
    uint64_t id = 0;
  };
  struct Listed {  // a live DataBuffer
    size_t size;
    uint64_t id;
    std::weak_ptr<ucx::MemoryRegion> region;
  };

  // An idle region of [bytes, 2 * bytes) or a fresh one.
  absl::StatusOr<Landing> Take(ucx::ClientPlane* plane, size_t bytes);
  // Keeps `landing` for reuse when nothing else holds it and the idle bound
  // allows; otherwise the node is told to drop its key.
  void GiveBack(ucx::ClientPlane* plane, Landing landing);
  void Unlist(uintptr_t start);

  const size_t max_idle_bytes_;
  Mutex mu_;
  std::map<uintptr_t, Listed> listed_ ABSL_GUARDED_BY(mu_);  // by first byte
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::multimap<size_t, Landing> idle_ ABSL_GUARDED_BY(mu_);  // by size
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcache::internal

#endif  // KVCACHE_CLIENT_BUFFER_POOL_H_
