// The store's CUDA edge: device discovery and the device arena. cudaError_t
// becomes absl::Status here and nowhere else. In a build without CUDA these
// report "built without CUDA" (no device, nothing pinned).
#ifndef KVCACHE_STORE_CUDA_MEMORY_H_
#define KVCACHE_STORE_CUDA_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "store/arena.h"

namespace kvcache::store::internal {

// cudaMalloc of `bytes` on `device`, owned by the returned Arena.
absl::StatusOr<std::unique_ptr<Arena>> CreateDeviceArena(int device,
                                                         uint64_t bytes);

}  // namespace kvcache::store::internal

#endif  // KVCACHE_STORE_CUDA_MEMORY_H_
