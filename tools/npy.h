// Minimal .npy (NumPy format 1.0/2.0/3.0) reading and writing for fp16,
// fp32 and uint16 (bf16 bit patterns) arrays in C order, little-endian — what
// kvcache-tool exchanges with Python. Anything else (other dtypes, Fortran
// order, big-endian, truncated data) is an INVALID_ARGUMENT that names the
// problem.
#ifndef KVCACHE_TOOLS_NPY_H_
#define KVCACHE_TOOLS_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache::tools {

struct NpyArray {
  std::string descr;  // "<f2", "<f4" or "<u2"
  std::vector<uint64_t> shape;
  std::vector<uint8_t> data;  // raw little-endian elements
  uint64_t elements() const;
};

absl::StatusOr<NpyArray> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const NpyArray& array);

// ReadNpy and WriteNpy without the file: the bytes of a .npy file (errors
// are prefixed with `name`), and the bytes WriteNpy writes.
absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes,
                                  absl::string_view name);
std::string NpyBytes(const NpyArray& array);

}  // namespace kvcache::tools

#endif  // KVCACHE_TOOLS_NPY_H_
