// kvcache::DeviceClient — CUDA device memory for kvcache::Client (target
// kvcache_client_device): Put from device memory, reads into device memory
// layer by layer, and dequantization of raw reads on the GPU.
//
// Contract:
//  * Works in every build and on every machine. Without CUDA (a build with
//    KVCACHE_HAVE_CUDA off, no driver, no device) nothing is device memory:
//    host pointers take the host paths (the CPU codec for client-side
//    dequantization), and what needs a device answers FAILED_PRECONDITION
//    naming the reason (CudaDeviceStatus()).
//  * Debian's UCX has no CUDA transports, so device memory is always staged
//    through pinned host memory: Put copies device blocks device-to-host
//    before Client::Put; reads land in a pinned host staging buffer
//    (Client::GetInto) and each layer is copied host-to-device as soon as it
//    has landed.
//  * Every wait here is bounded: the Client's own deadline for the transfer,
//    and DeviceClientOptions::timeout for the GPU and for DeviceRead's waits
//    (events are polled). The one exception is inside the kernel library:
//    kernels::cuda::DecodeBlocksCuda synchronizes its stream itself.
//  * Device pointers must be memory of DeviceClientOptions::device (or
//    managed memory). Layouts are those of client.h: a block is layer-major,
//    for each layer K then V, each [tokens_per_block][num_kv_heads][head_dim]
//    fp16.
//  * A DeviceClient is thread-safe. The Client it wraps must outlive it and
//    every DeviceRead it made (staging buffers come from
//    Client::AllocateBuffer).
#ifndef KVCACHE_CLIENT_DEVICE_H_
#define KVCACHE_CLIENT_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvcache/client.h"

namespace kvcache {

// OK when this process can use a CUDA device; FAILED_PRECONDITION otherwise,
// with the reason ("built without CUDA", "CUDA reports cudaErrorNoDevice:
// ..."). Computed once per process.
absl::Status CudaDeviceStatus();
// Number of usable CUDA devices; 0 exactly when CudaDeviceStatus() is not OK.
int CudaDeviceCount();

// True when `p` points into CUDA device memory (cudaMalloc, stream-ordered
// pools) or managed memory, by cudaPointerGetAttributes. False for host
// memory (pinned or not) and null, and always without CUDA or a device.
bool IsDeviceMemory(const void* p);

struct DeviceClientOptions {
  // The CUDA device of the staging copies, internal streams and kernels.
  int device = 0;
  // Create answers FAILED_PRECONDITION when no device can be used (instead
  // of a DeviceClient limited to host memory).
  bool require_device = false;
  // Bound on each wait for the GPU (staging copies of a Put, the copies and
  // decodes of a read) and on DeviceRead's waits, counted from the start of
  // the read: keep it above ClientOptions::timeout.
  absl::Duration timeout = absl::Seconds(30);
  // Staging memory (pinned host buffers, registered read buffers, device
  // scratch for GPU decoding) is kept for reuse up to this many idle bytes;
  // beyond it a returned buffer is freed.
  size_t max_idle_staging_bytes = size_t{1} << 30;
};

// What a read moves and what lands in the destination.
enum class DeviceReadMode {
  // The node decodes; fp16 travels and lands (Client's ReadFormat::kFp16).
  kFp16,
  // The stored encoding travels and lands as it is (ReadFormat::kRaw), e.g.
  // fp8 blocks with static scales for an engine running an fp8 KV cache.
  kRaw,
  // The stored encoding travels (fewer bytes) and is decoded here into fp16:
  // by kernels::cuda::DecodeBlocksCuda when the destination is device
  // memory, by the CPU codec (as kvcache::DecodeRaw) when it is host memory.
  // The bytes are the same either way, and the same as kFp16's. A block in
  // KIVI's residual window (stored fp16) and fp16 layers are copied.
  kDecodeHere,
};

struct DeviceReadOptions {
  DeviceReadMode mode = DeviceReadMode::kFp16;
  // A cudaStream_t of the client's device for the copies and kernels into
  // device memory; it must outlive the DeviceRead. nullptr: the read creates
  // its own. FAILED_PRECONDITION when given without a device.
  void* stream = nullptr;
  // A Lookup pin that this read takes over (Client::GetInto).
  uint64_t pin_lease = 0;
};

// A read into a destination in progress (DeviceClient::GetInto).
//
// Device destination: a worker thread of the read waits for each layer to
// land in host staging (PendingRead::WaitLayer) and then queues that layer's
// work on the read's stream — copies (cudaMemcpy2DAsync), and for kDecodeHere
// the copy of the encoding into device scratch followed by the decode kernel
// (which the kernel library completes before returning) — and records the
// layer's event after it. So layer l's copies overlap the transfer of layer
// l+1.
//
// Host destination: kFp16 and kRaw go straight into the destination
// (Client::GetInto); kDecodeHere lands in host staging and the worker thread
// decodes each layer on the CPU as it lands.
//
// Thread-safe. Destroying a DeviceRead stops queuing work, waits for its
// worker (which may wait for the transfer up to the Client's deadline) and
// for the work it queued (up to DeviceClientOptions::timeout), then returns
// its staging. Staging the GPU still might touch after that bound is
// deliberately leaked, never freed under a copy.
class DeviceRead {
 public:
  struct Impl;
  explicit DeviceRead(std::unique_ptr<Impl> impl);
  ~DeviceRead();
  DeviceRead(const DeviceRead&) = delete;
  DeviceRead& operator=(const DeviceRead&) = delete;

  // Returns once layer `layer` of every block is ready in the destination's
  // terms (layers are handled in order, so earlier layers are ready too):
  //  * host destination: the bytes are in place;
  //  * device destination: the layer's work is queued on stream() and
  //    LayerEvent(layer) is recorded after it. Work queued afterwards on
  //    stream(), or on a stream made to wait for LayerEvent(layer)
  //    (cudaStreamWaitEvent), sees the layer; the host must not assume the
  //    bytes are there (SyncLayer does).
  // The read's failure (the transfer's status, e.g. the Client's
  // DEADLINE_EXCEEDED; INTERNAL for a CUDA error) for a layer not ready when
  // it happened; INVALID_ARGUMENT for a layer out of range;
  // DEADLINE_EXCEEDED past DeviceClientOptions::timeout from the start of
  // the read.
  absl::Status WaitLayer(uint32_t layer);
  // WaitLayer, then (device destination) waits on the host until the
  // layer's work has completed on the GPU, bounded by the same deadline:
  // the layer's bytes are in device memory.
  absl::Status SyncLayer(uint32_t layer);
  // SyncLayer of the last layer: everything is in place.
  absl::Status Wait();

  // The cudaEvent_t recorded after layer `layer`'s work; valid once
  // WaitLayer(layer) has returned OK, until the DeviceRead is destroyed.
  // nullptr for a host destination or a layer not ready.
  void* LayerEvent(uint32_t layer) const;
  // The cudaStream_t of a device destination (the caller's or the read's
  // own); nullptr for a host destination.
  void* stream() const;

  uint32_t num_layers() const;
  // Keys and codecs (as stored) of the blocks, with the shape and policy of
  // the namespace; format is what lands in the destination (kFp16 for
  // kDecodeHere).
  const GetResult& metadata() const;
  // Where block i lies in the destination and where each of its layers ends
  // there: offset i * stride; for fp16 (kFp16, kDecodeHere) the fp16 block
  // size and L equal layer ends; for kRaw the encoded sizes.
  const std::vector<BlockPlacement>& placements() const;
  bool on_device() const;
  // True when the bytes travelled over the UCX data plane.
  bool over_data_plane() const;

 private:
  std::unique_ptr<Impl> impl_;
};

class DeviceClient {
 public:
  // Wraps `client` (not owned; see the contract above). INVALID_ARGUMENT for
  // a device index the process does not have; FAILED_PRECONDITION without a
  // device when options.require_device; otherwise a client that serves host
  // memory only when there is no device (has_device() false).
  static absl::StatusOr<std::unique_ptr<DeviceClient>> Create(
      Client* client, const DeviceClientOptions& options = {});
  ~DeviceClient();
  DeviceClient(const DeviceClient&) = delete;
  DeviceClient& operator=(const DeviceClient&) = delete;

  bool has_device() const;
  Client* client() const;

  // Client::Put where each BlockWrite::fp16 may point to device memory.
  // Device blocks are copied into pinned host staging on `stream` (a
  // cudaStream_t; queue the copies after the kernels that produce the KV by
  // passing their stream) or, with nullptr, on an internal stream (the
  // caller has then synchronized its producers), waited for (bounded by
  // options.timeout: DEADLINE_EXCEEDED), then put; host blocks go to the
  // Client as they are. When Put returns, the caller's memory is no longer
  // read. INVALID_ARGUMENT for device memory of another device;
  // FAILED_PRECONDITION for a stream without a device.
  absl::StatusOr<PutResult> Put(const std::string& ns,
                                absl::Span<const BlockWrite> blocks,
                                void* stream = nullptr);

  // Reads `keys` into `dest` (host or device memory, by IsDeviceMemory):
  // block i at dest + i * stride, in the form options.mode says, layer by
  // layer (DeviceRead). `dest` must hold keys.size() slots of `stride`
  // bytes, and a slot must hold the block's output (fp16 for kFp16 and
  // kDecodeHere) and, for a device destination or kDecodeHere, its
  // encoding as it travels (staging slots are `stride` bytes):
  // INVALID_ARGUMENT otherwise, for an odd address or stride with fp16
  // output, and for device memory of another device. DATA_LOSS when a
  // block's size or layer ends differ from its namespace's layout. NOT_FOUND
  // and the Client's other statuses as Client::GetInto.
  // FAILED_PRECONDITION for a stream without a device. `dest` must outlive
  // the DeviceRead.
  absl::StatusOr<std::unique_ptr<DeviceRead>> GetInto(
      const std::string& ns, const std::vector<std::string>& keys, void* dest,
      size_t dest_bytes, size_t stride, const DeviceReadOptions& options = {});

  // Staging memory currently idle in the pool (for tests and metrics).
  size_t idle_staging_bytes() const;

  struct Impl;

 private:
  explicit DeviceClient(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvcache

#endif  // KVCACHE_CLIENT_DEVICE_H_
