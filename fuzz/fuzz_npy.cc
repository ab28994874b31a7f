// fuzz_npy: the .npy reader of kvcache-tool (tools/npy.h) on arbitrary
// bytes. It must answer OK or INVALID_ARGUMENT; an array it accepts must be
// what its callers assume: a "<f2", "<f4" or "<u2" (bf16 bit patterns)
// dtype, and data of exactly elements() * element size bytes, where the
// product of the shape does not overflow. An accepted array written again
// (NpyBytes) must read back the same.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tools/npy.h"

namespace kvcache::tools {
namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "fuzz_npy: %s\n", what);
  std::abort();
}

void Check(absl::string_view bytes) {
  absl::StatusOr<NpyArray> a = ParseNpy(bytes, "input");
  if (!a.ok()) {
    if (a.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("a code other than INVALID_ARGUMENT");
    }
    return;
  }
  uint64_t element_bytes = 0;
  if (a->descr == "<f2" || a->descr == "<u2") {
    element_bytes = 2;
  } else if (a->descr == "<f4") {
    element_bytes = 4;
  } else {
    Fail("accepted a dtype other than <f2, <f4 and <u2");
  }
  uint64_t elements = 1;
  for (uint64_t d : a->shape) {
    if (__builtin_mul_overflow(elements, d, &elements)) {
      Fail("accepted a shape whose element count overflows");
    }
  }
  uint64_t want = 0;
  if (__builtin_mul_overflow(elements, element_bytes, &want)) {
    Fail("accepted a shape whose byte count overflows");
  }
  if (a->elements() != elements || a->data.size() != want) {
    Fail("accepted data of another size than its shape's");
  }
  absl::StatusOr<NpyArray> again = ParseNpy(NpyBytes(*a), "again");
  if (!again.ok() || again->descr != a->descr || again->shape != a->shape ||
      again->data != a->data) {
    Fail("an accepted array does not read back the same");
  }
}

}  // namespace
}  // namespace kvcache::tools

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcache::tools::Check(
      absl::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
