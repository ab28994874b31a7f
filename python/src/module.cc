// kvcache._kvcache: the native module of the `kvcache` package. The
// vocabulary types (namespace spec, results) live here; the clients in
// client_bind.cc and cluster_bind.cc; hashing in hash_bind.cc.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "bind.h"
#include "kvcache/client.h"
#include "kvcache/cluster_results.h"
#include "kvcache/codec.h"

namespace kvcache::python {
namespace {

Codec CodecOf(const std::string& name) {
  std::optional<Codec> codec = CodecFromName(name);
  if (!codec) {
    Throw(absl::InvalidArgumentError(
        absl::StrCat("unknown codec '", name,
                     "' (none, fp8_e4m3, fp8_e5m2, kivi2, kivi4)")));
  }
  return *codec;
}

SourceDtype DtypeOf(const std::string& name) {
  std::optional<SourceDtype> d = SourceDtypeFromName(name);
  if (!d) {
    Throw(absl::InvalidArgumentError(
        absl::StrCat("unknown dtype '", name, "' (fp16, bf16)")));
  }
  return *d;
}

uint64_t BlockElements(const NamespaceSpec& s) {
  return uint64_t{s.shape.num_layers} * 2 * s.shape.tokens_per_block *
         s.shape.num_kv_heads * s.shape.head_dim;
}

void InitSpec(NamespaceSpec* self, std::string name, uint32_t num_layers,
              uint32_t num_kv_heads, uint32_t head_dim,
              uint32_t tokens_per_block, std::optional<std::string> codec,
              const std::string& dtype, std::string model, std::string revision,
              uint32_t tp_rank, std::optional<uint32_t> residual_tokens,
              std::vector<uint32_t> fp16_layers, uint32_t kivi_group_size) {
  auto* spec = new (self) NamespaceSpec();
  spec->name = std::move(name);
  spec->model = std::move(model);
  spec->revision = std::move(revision);
  spec->tp_rank = tp_rank;
  spec->shape = {num_layers, num_kv_heads, head_dim, tokens_per_block,
                 DtypeOf(dtype)};
  if (codec.has_value()) {
    CodecPolicy policy;
    policy.codec = CodecOf(*codec);
    policy.fp16_layers = std::move(fp16_layers);
    policy.kivi_group_size = kivi_group_size;
    spec->policy = std::move(policy);
  } else if (!fp16_layers.empty()) {
    Throw(absl::InvalidArgumentError("fp16_layers needs a codec"));
  }
  spec->residual_tokens = residual_tokens;
}

void BindSpec(nb::module_& m) {
  nb::class_<NamespaceSpec>(m, "NamespaceSpec",
                            "A namespace's name, model and block layout, "
                            "and how the node stores it (codec).")
      .def("__init__", &InitSpec, nb::arg("name"), nb::kw_only(),
           nb::arg("num_layers"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
           nb::arg("tokens_per_block"), nb::arg("codec") = nb::none(),
           nb::arg("dtype") = "fp16", nb::arg("model") = "",
           nb::arg("revision") = "", nb::arg("tp_rank") = 0,
           nb::arg("residual_tokens") = nb::none(),
           nb::arg("fp16_layers") = std::vector<uint32_t>{},
           nb::arg("kivi_group_size") = 32,
           "codec None: the node's default (a ClusterClient needs one).")
      .def_ro("name", &NamespaceSpec::name)
      .def_ro("model", &NamespaceSpec::model)
      .def_ro("revision", &NamespaceSpec::revision)
      .def_ro("tp_rank", &NamespaceSpec::tp_rank)
      .def_prop_ro("num_layers",
                   [](const NamespaceSpec& s) { return s.shape.num_layers; })
      .def_prop_ro("num_kv_heads",
                   [](const NamespaceSpec& s) { return s.shape.num_kv_heads; })
      .def_prop_ro("head_dim",
                   [](const NamespaceSpec& s) { return s.shape.head_dim; })
      .def_prop_ro(
          "tokens_per_block",
          [](const NamespaceSpec& s) { return s.shape.tokens_per_block; })
      .def_prop_ro("dtype",
                   [](const NamespaceSpec& s) {
                     return std::string(SourceDtypeName(s.shape.source_dtype));
                   })
      .def_prop_ro("codec",
                   [](const NamespaceSpec& s) -> std::optional<std::string> {
                     if (!s.policy) return std::nullopt;
                     return std::string(CodecName(s.policy->codec));
                   })
      .def_prop_ro("block_elements", &BlockElements,
                   "16-bit values of one block: layers x (K, V) x tokens x "
                   "heads x head_dim.")
      .def_prop_ro("block_bytes",
                   [](const NamespaceSpec& s) { return BlockElements(s) * 2; })
      .def("__repr__", [](const NamespaceSpec& s) {
        return absl::StrCat(
            "NamespaceSpec('", s.name, "', num_layers=", s.shape.num_layers,
            ", num_kv_heads=", s.shape.num_kv_heads,
            ", head_dim=", s.shape.head_dim,
            ", tokens_per_block=", s.shape.tokens_per_block, ", dtype='",
            SourceDtypeName(s.shape.source_dtype), "', codec=",
            s.policy ? absl::StrCat("'", CodecName(s.policy->codec), "'")
                     : "None",
            ")");
      });
}

void BindResults(nb::module_& m) {
  nb::class_<NamespaceInfo>(m, "NamespaceInfo")
      .def_ro("fingerprint", &NamespaceInfo::fingerprint)
      .def_ro("already_registered", &NamespaceInfo::already_registered)
      .def_prop_ro("codec",
                   [](const NamespaceInfo& i) {
                     return std::string(CodecName(i.codec));
                   })
      .def_ro("fp16_block_bytes", &NamespaceInfo::fp16_block_bytes)
      .def_ro("encoded_block_bytes", &NamespaceInfo::encoded_block_bytes);
  nb::class_<LookupResult>(m, "LookupResult")
      .def_ro("prefix_blocks", &LookupResult::prefix_blocks)
      .def_ro("pin_lease", &LookupResult::pin_lease);
  nb::class_<PutResult>(m, "PutResult")
      .def_ro("stored", &PutResult::stored)
      .def_ro("skipped", &PutResult::skipped)
      .def_ro("stored_bytes", &PutResult::stored_bytes);
  nb::class_<ClusterLookupResult>(m, "ClusterLookupResult")
      .def_ro("prefix_blocks", &ClusterLookupResult::prefix_blocks)
      .def_ro("unavailable_keys", &ClusterLookupResult::unavailable_keys)
      .def("__int__",
           [](const ClusterLookupResult& r) { return r.prefix_blocks; });
  nb::class_<ClusterPutResult>(m, "ClusterPutResult")
      .def_ro("stored", &ClusterPutResult::stored)
      .def_ro("skipped", &ClusterPutResult::skipped)
      .def_ro("unavailable", &ClusterPutResult::unavailable)
      .def_ro("rejected", &ClusterPutResult::rejected)
      .def_prop_ro(
          "why_not_stored",
          [](const ClusterPutResult& r) {
            return r.why_not_stored.ok() ? std::string()
                                         : r.why_not_stored.ToString();
          },
          "'' when every block was stored or skipped.");
  nb::class_<PyCancelToken>(m, "CancelToken",
                            "Cancels every call that carries it "
                            "(cancel=...), now and later.")
      .def(nb::init<>())
      .def("cancel", [](PyCancelToken& t) { t.token->Cancel(); })
      .def_prop_ro("cancelled",
                   [](const PyCancelToken& t) { return t.token->cancelled(); });
}

}  // namespace

void BindTypes(nb::module_& m) {
  BindSpec(m);
  BindResults(m);
}

}  // namespace kvcache::python

NB_MODULE(_kvcache, m) {
  m.doc() = "Native module of the kvcache package (use `import kvcache`).";
  kvcache::python::RegisterErrors(m);
  kvcache::python::BindHashing(m);
  kvcache::python::BindTypes(m);
  kvcache::python::BindClient(m);
  kvcache::python::BindClusterClient(m);
}
