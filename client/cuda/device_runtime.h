// The client's CUDA edge (private to kvcache_client_device): device
// discovery, pointer queries, RAII owners of every CUDA resource the device
// API uses, and the copies and decode it queues. cudaError_t becomes
// absl::Status here and nowhere else in the client.
//
// Two implementations: device_runtime.cc (KVCACHE_HAVE_CUDA; the static CUDA
// runtime, so binaries start where no driver is installed) and
// device_runtime_none.cc (a build without CUDA: no device, and every
// factory answers FAILED_PRECONDITION "built without CUDA").
//
// Every function that takes `device` makes that CUDA device current for the
// call and restores the caller's current device before returning, so the
// calling thread's CUDA state is left as it was. Callers check
// DeviceCount() > 0 before using anything else here.
#ifndef KVCACHE_CLIENT_CUDA_DEVICE_RUNTIME_H_
#define KVCACHE_CLIENT_CUDA_DEVICE_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/codec.h"

namespace kvcache::device_internal {

// Number of CUDA devices this process can use, computed once. 0 when the
// build has no CUDA, there is no driver or no device, or the runtime fails
// to initialize; `why` (when not null) then receives the reason.
int DeviceCount(std::string* why = nullptr);

// True when `p` is device memory (cudaMalloc, stream-ordered pools) or
// managed memory; *device receives the owning device (-1 for managed memory
// that no single device owns). False for host memory (pinned or not), null,
// and whenever DeviceCount() is 0. Never leaves a CUDA error behind.
bool QueryDevicePointer(const void* p, int* device);

// cudaHostAlloc'd (pinned, portable) host memory; cudaFreeHost on
// destruction. The owner must make sure no queued copy still touches it.
class PinnedHostMemory {
 public:
  // RESOURCE_EXHAUSTED when the allocation fails; FAILED_PRECONDITION
  // without CUDA.
  static absl::StatusOr<std::unique_ptr<PinnedHostMemory>> Allocate(
      int device, size_t bytes);
  ~PinnedHostMemory();
  PinnedHostMemory(const PinnedHostMemory&) = delete;
  PinnedHostMemory& operator=(const PinnedHostMemory&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  PinnedHostMemory(uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t* data_;
  size_t size_;
};

// Caller memory page-locked with cudaHostRegister (portable) for the
// object's lifetime; cudaHostUnregister on destruction. The memory must
// outlive the registration.
class HostRegistration {
 public:
  // INTERNAL with CUDA's reason when the memory cannot be registered (e.g.
  // some shared-memory mappings); FAILED_PRECONDITION without CUDA.
  static absl::StatusOr<std::unique_ptr<HostRegistration>> Register(
      int device, void* data, size_t bytes);
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

 private:
  HostRegistration(int device, void* data) : device_(device), data_(data) {}
  // [[maybe_unused]]: read only by device_runtime.cc (the CUDA build).
  [[maybe_unused]] int device_;
  [[maybe_unused]] void* data_;
};

// cudaMalloc'd device memory; cudaFree on destruction (which synchronizes
// the device, so these are pooled, not made per call).
class DeviceMemory {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceMemory>> Allocate(int device,
                                                                size_t bytes);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  DeviceMemory(int device, uint8_t* data, size_t size)
      : device_(device), data_(data), size_(size) {}
  [[maybe_unused]] int device_;  // read only by the CUDA build
  uint8_t* data_;
  size_t size_;
};

// A cudaStream_t: either created here (non-blocking, destroyed with the
// object) or borrowed from the caller (never destroyed here).
class Stream {
 public:
  static absl::StatusOr<std::unique_ptr<Stream>> Create(int device);
  // `stream` is a cudaStream_t of `device` the caller keeps alive.
  static std::unique_ptr<Stream> Borrow(int device, void* stream);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int device() const { return device_; }
  void* get() const { return stream_; }  // a cudaStream_t

 private:
  Stream(int device, void* stream, bool owned)
      : device_(device), stream_(stream), owned_(owned) {}
  int device_;
  void* stream_;
  [[maybe_unused]] bool owned_;  // read only by the CUDA build
};

// A cudaEvent_t without timing; cudaEventDestroy on destruction (CUDA
// defers the release until recorded work completes).
class Event {
 public:
  static absl::StatusOr<std::unique_ptr<Event>> Create(int device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Records the event after the work queued so far on `stream`.
  absl::Status Record(const Stream& stream);
  // Polls until the recorded work has completed: OK; DEADLINE_EXCEEDED when
  // `deadline` passes first (the work may still be running); INTERNAL for a
  // CUDA error (e.g. a failed copy or kernel). OK for an event never
  // recorded.
  absl::Status WaitUntil(absl::Time deadline) const;
  void* get() const { return event_; }  // a cudaEvent_t

 private:
  Event(int device, void* event) : device_(device), event_(event) {}
  [[maybe_unused]] int device_;  // read only by the CUDA build
  void* event_;
};

// Queues a copy of `bytes` bytes on `stream` (cudaMemcpyAsync, direction
// from the pointers: any mix of host and device memory).
absl::Status CopyAsync(void* dst, const void* src, size_t bytes,
                       const Stream& stream);
// Queues `rows` copies of `width` bytes: row r from src + r * src_pitch to
// dst + r * dst_pitch (cudaMemcpy2DAsync); both pitches >= width.
absl::Status Copy2DAsync(void* dst, size_t dst_pitch, const void* src,
                         size_t src_pitch, size_t width, size_t rows,
                         const Stream& stream);

// kernels::cuda::DecodeBlocksCuda on `stream` (device pointers): returns
// when the decode has finished. INVALID_ARGUMENT as DecodeBlocksCuda;
// FAILED_PRECONDITION without CUDA.
absl::Status DecodeBlocks(const kernels::BlockShape& shape,
                          const kernels::CodecPolicy& policy,
                          absl::Span<const uint8_t* const> encoded,
                          absl::Span<uint16_t* const> fp16,
                          const Stream& stream);

}  // namespace kvcache::device_internal

#endif  // KVCACHE_CLIENT_CUDA_DEVICE_RUNTIME_H_
