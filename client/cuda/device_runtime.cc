// Built only with CUDA (KVCACHE_HAVE_CUDA); device_runtime_none.cc otherwise.
#include "client/cuda/device_runtime.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cuda/codec_cuda.h"

namespace kvcache::device_internal {
namespace {

// The one cudaError_t -> absl::Status edge. Clears the runtime's last error
// so that a non-sticky failure does not resurface in an unrelated call.
absl::Status FromCuda(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error), ": ",
                                     cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

// Makes `device` current for the scope and restores the previous one.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (device != previous_) {
      status_ = FromCuda(cudaSetDevice(device), "cudaSetDevice");
      changed_ = status_.ok();
    }
  }
  ~ScopedDevice() {
    if (changed_ && previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) {
      cudaGetLastError();
    }
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  bool changed_ = false;
  absl::Status status_;
};

struct Discovery {
  int count = 0;
  std::string why;
};

const Discovery& Discover() {
  static const Discovery* const discovery = [] {
    auto* d = new Discovery;
    int count = 0;
    cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess) {
      cudaGetLastError();
      d->why = absl::StrCat("CUDA reports ", cudaGetErrorName(error), ": ",
                            cudaGetErrorString(error));
    } else if (count == 0) {
      d->why = "CUDA reports no device";
    } else {
      d->count = count;
    }
    return d;
  }();
  return *discovery;
}

}  // namespace

int DeviceCount(std::string* why) {
  const Discovery& d = Discover();
  if (why != nullptr) *why = d.why;
  return d.count;
}

bool QueryDevicePointer(const void* p, int* device) {
  if (p == nullptr || DeviceCount() == 0) return false;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (attributes.type == cudaMemoryTypeDevice) {
    *device = attributes.device;
    return true;
  }
  if (attributes.type == cudaMemoryTypeManaged) {
    *device = -1;
    return true;
  }
  return false;  // cudaMemoryTypeHost (pinned) or unregistered host memory
}

absl::StatusOr<std::unique_ptr<PinnedHostMemory>> PinnedHostMemory::Allocate(
    int device, size_t bytes) {
  ScopedDevice scope(device);
  if (!scope.status().ok()) return scope.status();
  void* data = nullptr;
  if (absl::Status s = FromCuda(
          cudaHostAlloc(&data, bytes, cudaHostAllocPortable), "cudaHostAlloc");
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<PinnedHostMemory>(
      new PinnedHostMemory(static_cast<uint8_t*>(data), bytes));
}

PinnedHostMemory::~PinnedHostMemory() {
  if (cudaFreeHost(data_) != cudaSuccess) cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<HostRegistration>> HostRegistration::Register(
    int device, void* data, size_t bytes) {
  ScopedDevice scope(device);
  if (!scope.status().ok()) return scope.status();
  if (absl::Status s =
          FromCuda(cudaHostRegister(data, bytes, cudaHostRegisterPortable),
                   "cudaHostRegister");
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<HostRegistration>(new HostRegistration(device, data));
}

HostRegistration::~HostRegistration() {
  ScopedDevice scope(device_);
  if (cudaHostUnregister(data_) != cudaSuccess) cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> DeviceMemory::Allocate(
    int device, size_t bytes) {
  ScopedDevice scope(device);
  if (!scope.status().ok()) return scope.status();
  void* data = nullptr;
  if (absl::Status s = FromCuda(cudaMalloc(&data, bytes), "cudaMalloc");
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<DeviceMemory>(
      new DeviceMemory(device, static_cast<uint8_t*>(data), bytes));
}

DeviceMemory::~DeviceMemory() {
  ScopedDevice scope(device_);
  if (cudaFree(data_) != cudaSuccess) cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<Stream>> Stream::Create(int device) {
  ScopedDevice scope(device);
  if (!scope.status().ok()) return scope.status();
  cudaStream_t stream = nullptr;
  if (absl::Status s =
          FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                   "cudaStreamCreateWithFlags");
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<Stream>(new Stream(device, stream, /*owned=*/true));
}

std::unique_ptr<Stream> Stream::Borrow(int device, void* stream) {
  return std::unique_ptr<Stream>(new Stream(device, stream, /*owned=*/false));
}

Stream::~Stream() {
  if (!owned_) return;
  ScopedDevice scope(device_);
  // Destroying a stream with queued work is allowed: CUDA releases it once
  // that work has completed.
  if (cudaStreamDestroy(static_cast<cudaStream_t>(stream_)) != cudaSuccess) {
    cudaGetLastError();
  }
}

absl::StatusOr<std::unique_ptr<Event>> Event::Create(int device) {
  ScopedDevice scope(device);
  if (!scope.status().ok()) return scope.status();
  cudaEvent_t event = nullptr;
  if (absl::Status s =
          FromCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                   "cudaEventCreateWithFlags");
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<Event>(new Event(device, event));
}

Event::~Event() {
  ScopedDevice scope(device_);
  if (cudaEventDestroy(static_cast<cudaEvent_t>(event_)) != cudaSuccess) {
    cudaGetLastError();
  }
}

absl::Status Event::Record(const Stream& stream) {
  ScopedDevice scope(stream.device());
  if (!scope.status().ok()) return scope.status();
  return FromCuda(cudaEventRecord(static_cast<cudaEvent_t>(event_),
                                  static_cast<cudaStream_t>(stream.get())),
                  "cudaEventRecord");
}

absl::Status Event::WaitUntil(absl::Time deadline) const {
  ScopedDevice scope(device_);
  if (!scope.status().ok()) return scope.status();
  // Poll (never an unbounded cudaEventSynchronize): yield for the first
  // 100 us, then sleep with a doubling interval up to 1 ms.
  const absl::Time start = absl::Now();
  absl::Duration nap = absl::Microseconds(20);
  for (;;) {
    cudaError_t error = cudaEventQuery(static_cast<cudaEvent_t>(event_));
    if (error == cudaSuccess) return absl::OkStatus();
    if (error != cudaErrorNotReady) return FromCuda(error, "cudaEventQuery");
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          "the GPU did not finish the queued copies or kernels in time");
    }
    if (now - start < absl::Microseconds(100)) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(std::min(nap, deadline - now));
      nap = std::min(nap * 2, absl::Milliseconds(1));
    }
  }
}

absl::Status CopyAsync(void* dst, const void* src, size_t bytes,
                       const Stream& stream) {
  if (bytes == 0) return absl::OkStatus();
  ScopedDevice scope(stream.device());
  if (!scope.status().ok()) return scope.status();
  return FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                  static_cast<cudaStream_t>(stream.get())),
                  "cudaMemcpyAsync");
}

absl::Status Copy2DAsync(void* dst, size_t dst_pitch, const void* src,
                         size_t src_pitch, size_t width, size_t rows,
                         const Stream& stream) {
  if (width == 0 || rows == 0) return absl::OkStatus();
  if (rows == 1) return CopyAsync(dst, src, width, stream);
  ScopedDevice scope(stream.device());
  if (!scope.status().ok()) return scope.status();
  return FromCuda(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows,
                                    cudaMemcpyDefault,
                                    static_cast<cudaStream_t>(stream.get())),
                  "cudaMemcpy2DAsync");
}

absl::Status DecodeBlocks(const kernels::BlockShape& shape,
                          const kernels::CodecPolicy& policy,
                          absl::Span<const uint8_t* const> encoded,
                          absl::Span<uint16_t* const> fp16,
                          const Stream& stream) {
  ScopedDevice scope(stream.device());
  if (!scope.status().ok()) return scope.status();
  return kernels::cuda::DecodeBlocksCuda(shape, policy, encoded, fp16,
                                         stream.get());
}

}  // namespace kvcache::device_internal
