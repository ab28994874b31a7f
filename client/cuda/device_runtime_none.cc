// A build without CUDA (KVCACHE_HAVE_CUDA off): there is no device, nothing
// is device memory, and every factory answers FAILED_PRECONDITION. The
// device API (client/device.cc) checks DeviceCount() first and never reaches
// these factories; they exist so that it links and states why.
#include "client/cuda/device_runtime.h"

namespace kvcache::device_internal {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "this kvcache client was built without CUDA");
}

}  // namespace

int DeviceCount(std::string* why) {
  if (why != nullptr) *why = "this kvcache client was built without CUDA";
  return 0;
}

bool QueryDevicePointer(const void* p, int* device) { return false; }

absl::StatusOr<std::unique_ptr<PinnedHostMemory>> PinnedHostMemory::Allocate(
    int device, size_t bytes) {
  return NoCuda();
}
PinnedHostMemory::~PinnedHostMemory() = default;

absl::StatusOr<std::unique_ptr<HostRegistration>> HostRegistration::Register(
    int device, void* data, size_t bytes) {
  return NoCuda();
}
HostRegistration::~HostRegistration() = default;

absl::StatusOr<std::unique_ptr<DeviceMemory>> DeviceMemory::Allocate(
    int device, size_t bytes) {
  return NoCuda();
}
DeviceMemory::~DeviceMemory() = default;

absl::StatusOr<std::unique_ptr<Stream>> Stream::Create(int device) {
  return NoCuda();
}
std::unique_ptr<Stream> Stream::Borrow(int device, void* stream) {
  return std::unique_ptr<Stream>(new Stream(device, stream, /*owned=*/false));
}
Stream::~Stream() = default;

absl::StatusOr<std::unique_ptr<Event>> Event::Create(int device) {
  return NoCuda();
}
Event::~Event() = default;
absl::Status Event::Record(const Stream& stream) { return NoCuda(); }
absl::Status Event::WaitUntil(absl::Time deadline) const { return NoCuda(); }

absl::Status CopyAsync(void* dst, const void* src, size_t bytes,
                       const Stream& stream) {
  return NoCuda();
}

absl::Status Copy2DAsync(void* dst, size_t dst_pitch, const void* src,
                         size_t src_pitch, size_t width, size_t rows,
                         const Stream& stream) {
  return NoCuda();
}

absl::Status DecodeBlocks(const kernels::BlockShape& shape,
                          const kernels::CodecPolicy& policy,
                          absl::Span<const uint8_t* const> encoded,
                          absl::Span<uint16_t* const> fp16,
                          const Stream& stream) {
  return NoCuda();
}

}  // namespace kvcache::device_internal
