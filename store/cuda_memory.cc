// Built only with CUDA (KVCACHE_HAVE_CUDA); cuda_memory_none.cc otherwise.
#include "store/cuda_memory.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace kvcache::store {
namespace internal {
namespace {

absl::Status FromCuda(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error),
                                          ": ", cudaGetErrorString(error)));
}

// Owns one cudaMalloc allocation on one device.
class DeviceArena final : public Arena {
 public:
  DeviceArena(int device, void* base, uint64_t size)
      : device_(device), base_(static_cast<uint8_t*>(base)), size_(size) {}
  ~DeviceArena() override {
    cudaSetDevice(device_);
    cudaFree(base_);
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  uint64_t size() const override { return size_; }
  MemoryKind kind() const override { return MemoryKind::kGpu; }
  std::string Describe() const override {
    return absl::StrCat("GPU ", device_, " memory, ", size_, " bytes");
  }
  absl::Status Write(uint64_t offset, const void* src, size_t n) override {
    if (absl::Status s = FromCuda(cudaSetDevice(device_), "cudaSetDevice");
        !s.ok()) {
      return s;
    }
    return FromCuda(cudaMemcpy(base_ + offset, src, n, cudaMemcpyHostToDevice),
                    "cudaMemcpy to the device arena");
  }
  absl::Status Read(uint64_t offset, void* dst, size_t n) const override {
    if (absl::Status s = FromCuda(cudaSetDevice(device_), "cudaSetDevice");
        !s.ok()) {
      return s;
    }
    return FromCuda(cudaMemcpy(dst, base_ + offset, n, cudaMemcpyDeviceToHost),
                    "cudaMemcpy from the device arena");
  }

 private:
  int device_;
  uint8_t* base_;
  uint64_t size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Arena>> CreateDeviceArena(int device,
                                                         uint64_t bytes) {
  if (absl::Status s = FromCuda(cudaSetDevice(device), "cudaSetDevice");
      !s.ok()) {
    return s;
  }
  void* base = nullptr;
  cudaError_t error = cudaMalloc(&base, bytes);
  if (error != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " bytes on GPU ", device, ": ",
                     cudaGetErrorString(error)));
  }
  return std::unique_ptr<Arena>(
      std::make_unique<DeviceArena>(device, base, bytes));
}

}  // namespace internal

int CudaDeviceCount(std::string* why) {
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    *why = absl::StrCat("CUDA reports ", cudaGetErrorName(error), ": ",
                        cudaGetErrorString(error));
    return 0;
  }
  if (count == 0) *why = "CUDA reports no device";
  return count;
}

}  // namespace kvcache::store
