// The CUDA edge of a build without CUDA: no device.
#include "store/cuda_memory.h"

namespace kvcache::store {
namespace internal {

absl::StatusOr<std::unique_ptr<Arena>> CreateDeviceArena(int device,
                                                         uint64_t bytes) {
  return absl::FailedPreconditionError(
      "this kvcache-node was built without CUDA (KVCACHE_CUDA=OFF or no "
      "nvcc): no GPU memory tier");
}

}  // namespace internal

int CudaDeviceCount(std::string* why) {
  *why = "built without CUDA";
  return 0;
}

}  // namespace kvcache::store
