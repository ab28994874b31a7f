// kvcache.ClusterClient: a fleet of nodes (kvcache/cluster_client.h), with
// layer-wise reads into a caller's array.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bind.h"
#include "kvcache/cluster_client.h"
#include "results.h"

namespace kvcache::python {
namespace {

using OptStr = std::optional<std::string>;

struct PyClusterClient {
  std::unique_ptr<ClusterClient> client;
  ~PyClusterClient() {
    nb::gil_scoped_release release;
    client.reset();
  }
};

// A layer-wise read into `dest`: block i's layer l lands at
// dest + i * stride + l * (K and V bytes of a layer), K then V, [T][H][D]
// each: the block layout of kvcache/client.h. Ending it stops the stream
// (and waits for a copy in progress) before `dest` is let go.
struct PyLayerRead {
  std::unique_ptr<LayerStream> stream;
  nb::object dest;
  nb::object client;
  uint32_t prefix_blocks = 0;
  ~PyLayerRead() {
    nb::gil_scoped_release release;
    stream.reset();
  }
};

ClusterOptions MakeOptions(nb::handle nodes, OptStr dns_name, int dns_port,
                           double timeout_s, double rpc_timeout_s,
                           int max_attempts, uint32_t routing_prefix_bytes,
                           const std::string& data_plane,
                           const Credentials& credentials) {
  ClusterOptions o;
  if (!nodes.is_none()) {
    if (nb::isinstance<nb::str>(nodes)) {
      Throw(absl::InvalidArgumentError(
          "nodes must be a list of 'host:port', not one string"));
    }
    for (nb::handle n : nodes) o.nodes.push_back(nb::cast<std::string>(n));
  }
  o.dns_name = dns_name.value_or("");
  o.dns_port = dns_port;
  if (!(timeout_s > 0) || !(rpc_timeout_s > 0)) {
    Throw(absl::InvalidArgumentError("timeouts must be > 0"));
  }
  o.default_timeout = absl::Seconds(timeout_s);
  o.rpc_timeout = absl::Seconds(rpc_timeout_s);
  o.max_attempts = max_attempts;
  o.routing_prefix_bytes = routing_prefix_bytes;
  o.data_plane = DataPlaneFromName(data_plane);
  o.tls = credentials.tls;
  o.bearer_token = credentials.bearer_token;
  return o;
}

void InitCluster(PyClusterClient* self, nb::handle nodes, OptStr dns_name,
                 int dns_port, double timeout_s, double rpc_timeout_s,
                 int max_attempts, uint32_t routing_prefix_bytes,
                 const std::string& data_plane, OptStr bearer_token,
                 OptStr bearer_token_file, OptStr tls_ca_file,
                 OptStr tls_cert_file, OptStr tls_key_file,
                 OptStr tls_server_name) {
  Credentials c = MakeCredentials(bearer_token, bearer_token_file, tls_ca_file,
                                  tls_cert_file, tls_key_file, tls_server_name);
  ClusterOptions o =
      MakeOptions(nodes, dns_name, dns_port, timeout_s, rpc_timeout_s,
                  max_attempts, routing_prefix_bytes, data_plane, c);
  absl::StatusOr<std::unique_ptr<ClusterClient>> client;
  {
    nb::gil_scoped_release release;
    client = ClusterClient::Create(std::move(o));
  }
  new (self) PyClusterClient{Value(std::move(client))};
}

template <typename T, typename Fn>
T Blocking(Fn&& fn) {
  absl::StatusOr<T> r;
  {
    nb::gil_scoped_release release;
    r = fn();
  }
  return Value(std::move(r));
}

ClusterPutResult Put(PyClusterClient& self, const std::string& ns,
                     nb::handle py_keys, const nb::ndarray<>& blocks,
                     nb::handle parent_keys, std::optional<double> timeout_s,
                     const PyCancelToken* cancel) {
  std::vector<std::string> keys = Keys(py_keys);
  std::vector<std::string> parents = Parents(parent_keys, keys.size());
  std::vector<BlockWrite> writes =
      Writes(keys, ContiguousBytes(blocks, "blocks"), parents);
  CallOptions call = MakeCall(timeout_s, cancel);
  return Blocking<ClusterPutResult>(
      [&] { return self.client->Put(ns, writes, call); });
}

PyGetResult Get(PyClusterClient& self, const std::string& ns,
                nb::handle py_keys, const std::string& format,
                std::optional<double> timeout_s, const PyCancelToken* cancel) {
  std::vector<std::string> keys = Keys(py_keys);
  ReadFormat f = FormatFromName(format);
  CallOptions call = MakeCall(timeout_s, cancel);
  ClusterGetResult r = Blocking<ClusterGetResult>(
      [&] { return self.client->Get(ns, std::move(keys), f, call); });
  return PyGetResult{std::move(r.read), r.unavailable_keys};
}

// Copies each delivered layer into the caller's array (on a client work
// thread; no Python object is touched there).
LayerCallback CopyInto(absl::Span<uint8_t> dest, size_t stride) {
  return [dest, stride](uint32_t layer,
                        absl::Span<const LayerSlice> blocks) -> absl::Status {
    for (const LayerSlice& b : blocks) {
      const size_t half = b.k.size() * 2;
      const size_t at = b.block * stride + size_t{layer} * 2 * half;
      if ((layer + 1) * 2 * half > stride || at + 2 * half > dest.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("dest rows of ", stride, " bytes cannot hold layer ",
                         layer, " of a block (", 2 * half, " bytes a layer)"));
      }
      std::memcpy(dest.data() + at, b.k.data(), half);
      std::memcpy(dest.data() + at + half, b.v.data(), half);
    }
    return absl::OkStatus();
  };
}

PyLayerRead* GetLayerwise(nb::handle py_self, const std::string& ns,
                          nb::handle py_keys, nb::handle py_dest,
                          const std::string& format,
                          std::optional<double> timeout_s,
                          const PyCancelToken* cancel) {
  PyClusterClient& self = nb::cast<PyClusterClient&>(py_self);
  std::vector<std::string> keys = Keys(py_keys);
  absl::Span<uint8_t> dest =
      ContiguousBytes(nb::cast<nb::ndarray<>>(py_dest), "dest");
  if (keys.empty()) Throw(absl::InvalidArgumentError("no keys"));
  LayerwiseOptions options;
  options.format = FormatFromName(format);
  options.call = MakeCall(timeout_s, cancel);
  options.on_layer = CopyInto(dest, dest.size() / keys.size());
  std::unique_ptr<LayerStream> stream;
  {
    nb::gil_scoped_release release;
    stream = self.client->GetLayerwise(ns, std::move(keys), std::move(options));
  }
  return new PyLayerRead{std::move(stream), nb::borrow(py_dest),
                         nb::borrow(py_self)};
}

void BindLayerRead(nb::module_& m) {
  nb::class_<PyLayerRead>(m, "LayerRead",
                          "A layer-wise read over the fleet "
                          "(ClusterClient.get_layerwise).")
      .def(
          "wait_layer",
          [](PyLayerRead& r, uint32_t layer) {
            absl::StatusOr<uint32_t> prefix;
            {
              nb::gil_scoped_release release;
              prefix = r.stream->WaitLayer(layer);
            }
            r.prefix_blocks = Value(std::move(prefix));
            return r.prefix_blocks;
          },
          nb::arg("layer"),
          "Returns the prefix read (blocks) once layer `layer` of each of "
          "its blocks is in dest.")
      .def_ro("prefix_blocks", &PyLayerRead::prefix_blocks,
              "The prefix of the last successful wait_layer.")
      .def_prop_ro(
          "unavailable_keys",
          [](const PyLayerRead& r) { return r.stream->unavailable_keys(); })
      .def("cancel", [](PyLayerRead& r) {
        nb::gil_scoped_release release;
        r.stream->Cancel();
      });
}

void BindMethods(nb::class_<PyClusterClient>& c) {
  c.def(
       "register_namespace",
       [](PyClusterClient& self, const NamespaceSpec& spec,
          std::optional<double> timeout_s, const PyCancelToken* cancel) {
         CallOptions call = MakeCall(timeout_s, cancel);
         return Blocking<NamespaceInfo>(
             [&] { return self.client->RegisterNamespace(spec, call); });
       },
       nb::arg("spec"), nb::kw_only(), nb::arg("timeout_s") = nb::none(),
       nb::arg("cancel") = nb::none())
      .def(
          "lookup",
          [](PyClusterClient& self, const std::string& ns, nb::handle py_keys,
             std::optional<double> timeout_s, const PyCancelToken* cancel) {
            std::vector<std::string> keys = Keys(py_keys);
            CallOptions call = MakeCall(timeout_s, cancel);
            return Blocking<ClusterLookupResult>(
                [&] { return self.client->Lookup(ns, std::move(keys), call); });
          },
          nb::arg("ns"), nb::arg("keys"), nb::kw_only(),
          nb::arg("timeout_s") = nb::none(), nb::arg("cancel") = nb::none())
      .def("put", &Put, nb::arg("ns"), nb::arg("keys"), nb::arg("blocks"),
           nb::kw_only(), nb::arg("parent_keys") = nb::none(),
           nb::arg("timeout_s") = nb::none(), nb::arg("cancel") = nb::none())
      .def("get", &Get, nb::arg("ns"), nb::arg("keys"), nb::kw_only(),
           nb::arg("format") = "fp16", nb::arg("timeout_s") = nb::none(),
           nb::arg("cancel") = nb::none())
      .def("get_layerwise", &GetLayerwise, nb::arg("ns"), nb::arg("keys"),
           nb::arg("dest"), nb::kw_only(), nb::arg("format") = "fp16",
           nb::arg("timeout_s") = nb::none(), nb::arg("cancel") = nb::none(),
           "Reads the longest readable prefix of keys into dest (rows of "
           "dest.nbytes // len(keys) bytes, one per key), layer by layer.")
      .def(
          "delete",
          [](PyClusterClient& self, const std::string& ns, nb::handle py_keys,
             std::optional<double> t) {
            std::vector<std::string> keys = Keys(py_keys);
            CallOptions call = MakeCall(t, nullptr);
            return Blocking<uint32_t>(
                [&] { return self.client->Delete(ns, std::move(keys), call); });
          },
          nb::arg("ns"), nb::arg("keys"), nb::kw_only(),
          nb::arg("timeout_s") = nb::none())
      .def("owner_of",
           [](PyClusterClient& self, const nb::bytes& key) {
             return self.client->OwnerOf(
                 absl::string_view(key.c_str(), key.size()));
           })
      .def("nodes", [](PyClusterClient& self) {
        nb::list out;
        for (const NodeStatus& n : self.client->Nodes()) {
          nb::dict d;
          d["id"] = n.id;
          d["up"] = n.up;
          d["consecutive_failures"] = n.consecutive_failures;
          out.append(d);
        }
        return out;
      });
}

}  // namespace

void BindClusterClient(nb::module_& m) {
  BindLayerRead(m);
  nb::class_<PyClusterClient> c(m, "ClusterClient",
                                "The client of a fleet of kvcache nodes: "
                                "keys sharded by rendezvous hashing; a node "
                                "down or slow is a miss, not an error.");
  c.def("__init__", &InitCluster, nb::arg("nodes") = nb::none(), nb::kw_only(),
        nb::arg("dns_name") = nb::none(), nb::arg("dns_port") = 50051,
        nb::arg("timeout_s") = 5.0, nb::arg("rpc_timeout_s") = 2.0,
        nb::arg("max_attempts") = 3, nb::arg("routing_prefix_bytes") = 0,
        nb::arg("data_plane") = "auto", nb::arg("bearer_token") = nb::none(),
        nb::arg("bearer_token_file") = nb::none(),
        nb::arg("tls_ca_file") = nb::none(),
        nb::arg("tls_cert_file") = nb::none(),
        nb::arg("tls_key_file") = nb::none(),
        nb::arg("tls_server_name") = nb::none());
  BindMethods(c);
}

}  // namespace kvcache::python
