#include "results.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcache::python {

std::vector<BlockWrite> Writes(const std::vector<std::string>& keys,
                               absl::Span<const uint8_t> blocks,
                               const std::vector<std::string>& parents) {
  const size_t n = keys.size();
  if (n == 0) return {};
  if (blocks.size() % (2 * n) != 0) {
    Throw(absl::InvalidArgumentError(
        absl::StrCat("blocks hold ", blocks.size(), " bytes: not ", n,
                     " blocks of 16-bit values (one row per key)")));
  }
  const size_t block_bytes = blocks.size() / n;
  std::vector<BlockWrite> writes(n);
  for (size_t i = 0; i < n; ++i) {
    writes[i].key = keys[i];
    writes[i].parent_key = parents[i];
    writes[i].fp16 = absl::MakeConstSpan(
        reinterpret_cast<const uint16_t*>(blocks.data() + i * block_bytes),
        block_bytes / 2);
  }
  return writes;
}

std::vector<std::string> Parents(nb::handle parent_keys, size_t n) {
  if (parent_keys.is_none()) return std::vector<std::string>(n);
  std::vector<std::string> parents = Keys(parent_keys);
  if (parents.size() != n) {
    Throw(absl::InvalidArgumentError(absl::StrCat(
        "parent_keys has ", parents.size(), " entries for ", n, " keys")));
  }
  return parents;
}

nb::dict StatsDict(const NodeStats& s) {
  nb::dict d;
  d["capacity_bytes"] = s.capacity_bytes;
  d["used_bytes"] = s.used_bytes;
  d["reserved_bytes"] = s.reserved_bytes;
  d["pinned_bytes"] = s.pinned_bytes;
  d["fragmentation_bytes"] = s.fragmentation_bytes;
  d["evictions"] = s.evictions;
  d["data_loss_events"] = s.data_loss_events;
  d["lookup_hits"] = s.lookup_hits;
  d["lookup_misses"] = s.lookup_misses;
  nb::dict namespaces;
  for (const auto& [name, u] : s.namespaces) {
    nb::dict n;
    n["codec"] = std::string(CodecName(u.codec));
    n["blocks"] = u.blocks;
    n["tokens"] = u.tokens;
    n["stored_bytes"] = u.stored_bytes;
    n["logical_bytes"] = u.logical_bytes;
    n["residual_blocks"] = u.residual_blocks;
    namespaces[nb::str(name.c_str(), name.size())] = n;
  }
  d["namespaces"] = namespaces;
  if (s.tenant) {
    nb::dict t;
    t["name"] = s.tenant->name;
    t["pool_bytes_used"] = s.tenant->pool_bytes_used;
    t["pool_bytes_quota"] = s.tenant->pool_bytes_quota;
    t["namespaces"] = s.tenant->namespaces;
    t["max_namespaces"] = s.tenant->max_namespaces;
    d["tenant"] = t;
  } else {
    d["tenant"] = nb::none();
  }
  return d;
}

namespace {

// The dtype a block's 16-bit values have in numpy: float16 for an fp16
// namespace; uint16 bit patterns for bf16, which numpy lacks (view them with
// torch: torch.from_numpy(a).view(torch.bfloat16)).
const char* NumpyDtype(const GetResult& r) {
  return r.shape.source_dtype == SourceDtype::kBf16 ? "uint16" : "float16";
}

nb::object Array(const PyGetResult& self) {
  const GetResult& r = self.result;
  for (const BlockData& b : r.blocks) {
    if (b.format != ReadFormat::kFp16) {
      Throw(absl::FailedPreconditionError(
          "array() needs a read in format 'fp16'; decode(i) decodes a raw "
          "block"));
    }
  }
  size_t elements = 0;
  if (!r.blocks.empty()) elements = r.blocks[0].bytes.size() / 2;
  auto [array, data] = NewNumpy({r.blocks.size(), elements}, NumpyDtype(r));
  for (size_t i = 0; i < r.blocks.size(); ++i) {
    const std::string& bytes = r.blocks[i].bytes;
    if (bytes.size() != elements * 2) {
      Throw(absl::DataLossError("blocks of one read differ in size"));
    }
    std::memcpy(data + i * elements * 2, bytes.data(), bytes.size());
  }
  return array;
}

const BlockData& At(const PyGetResult& self, size_t i) {
  if (i >= self.result.blocks.size()) {
    Throw(absl::OutOfRangeError(absl::StrCat("block ", i, " of a read of ",
                                             self.result.blocks.size())));
  }
  return self.result.blocks[i];
}

nb::object Decode(const PyGetResult& self, size_t i) {
  const GetResult& r = self.result;
  const BlockData& block = At(self, i);
  const BlockShape& s = r.shape;
  size_t elements = size_t{s.num_layers} * 2 * s.tokens_per_block *
                    s.num_kv_heads * s.head_dim;
  auto [array, data] = NewNumpy({elements}, NumpyDtype(r));
  if (block.format == ReadFormat::kFp16) {
    std::memcpy(data, block.bytes.data(),
                std::min(block.bytes.size(), elements * 2));
    return array;
  }
  Check(DecodeRaw(r, block,
                  absl::MakeSpan(reinterpret_cast<uint16_t*>(data), elements)));
  return array;
}

}  // namespace

void BindGetResult(nb::module_& m) {
  nb::class_<PyGetResult>(m, "GetResult",
                          "Blocks read, in the order of the keys asked for.")
      .def("__len__",
           [](const PyGetResult& r) { return r.result.blocks.size(); })
      .def_prop_ro(
          "prefix_blocks",
          [](const PyGetResult& r) { return r.result.prefix_blocks(); },
          "keys[0, prefix_blocks) were all read.")
      .def_prop_ro("indices",
                   [](const PyGetResult& r) {
                     std::vector<uint32_t> out;
                     for (const BlockData& b : r.result.blocks) {
                       out.push_back(b.index);
                     }
                     return out;
                   })
      .def_prop_ro("missing",
                   [](const PyGetResult& r) { return r.result.missing; })
      .def_prop_ro(
          "codecs",
          [](const PyGetResult& r) {
            std::vector<std::string> out;
            for (const BlockData& b : r.result.blocks) {
              out.emplace_back(CodecName(b.codec));
            }
            return out;
          },
          "Each block's codec as stored ('none' for a KIVI block "
          "still in the fp16 residual window).")
      .def_ro("unavailable_keys", &PyGetResult::unavailable_keys)
      .def("array", &Array,
           "The blocks as one [blocks, block_elements] numpy array (format "
           "'fp16' reads): float16, or uint16 bit patterns for bf16.")
      .def(
          "raw",
          [](const PyGetResult& r, size_t i) {
            const std::string& b = At(r, i).bytes;
            return nb::bytes(b.data(), b.size());
          },
          nb::arg("i"), "Block i's bytes as read (the encoding for 'raw').")
      .def("decode", &Decode, nb::arg("i"),
           "Block i dequantized here into the source dtype (a copy for "
           "'fp16' reads).");
}

}  // namespace kvcache::python
