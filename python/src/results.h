// Read results as Python sees them, shared by Client and ClusterClient.
#ifndef KVCACHE_PYTHON_RESULTS_H_
#define KVCACHE_PYTHON_RESULTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "bind.h"
#include "kvcache/client.h"

namespace kvcache::python {

// A finished read: the blocks (in the order of the keys asked for) and
// what was missing. For a cluster read, blocks are the prefix read.
struct PyGetResult {
  GetResult result;
  uint32_t unavailable_keys = 0;
};

// The blocks of `keys` as BlockWrites over `blocks` (n equal, even-sized
// slices of one contiguous array) with their parents (None or b"": the
// previous block of the call).
std::vector<BlockWrite> Writes(const std::vector<std::string>& keys,
                               absl::Span<const uint8_t> blocks,
                               const std::vector<std::string>& parents);

// parent_keys as strings: None -> all empty.
std::vector<std::string> Parents(nb::handle parent_keys, size_t n);

nb::dict StatsDict(const NodeStats& stats);

void BindGetResult(nb::module_& m);

}  // namespace kvcache::python

#endif  // KVCACHE_PYTHON_RESULTS_H_
