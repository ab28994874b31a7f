// kvcache.Client: one node (kvcache/client.h), with registered buffers and
// reads into caller memory.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bind.h"
#include "kvcache/client.h"
#include "results.h"

namespace kvcache::python {
namespace {

using OptStr = std::optional<std::string>;

struct PyClient {
  std::unique_ptr<Client> client;
  ~PyClient() {
    nb::gil_scoped_release release;
    client.reset();
  }
};

// A GetInto in progress. Holds the client and the destination so neither
// goes while the node may still write; ending it (del, or the garbage
// collector) stops the transfer before the destination is let go.
struct PyPendingRead {
  std::unique_ptr<PendingRead> read;
  nb::object dest;
  nb::object client;
  ~PyPendingRead() {
    nb::gil_scoped_release release;
    read.reset();
  }
};

// Registered memory from Client.allocate_buffer; numpy() views it.
struct PyDataBuffer {
  std::unique_ptr<DataBuffer> buffer;
  nb::object client;
  ~PyDataBuffer() {
    nb::gil_scoped_release release;
    buffer.reset();
  }
};

void InitClient(PyClient* self, const std::string& target, double timeout_s,
                const std::string& data_plane, OptStr bearer_token,
                OptStr bearer_token_file, OptStr tls_ca_file,
                OptStr tls_cert_file, OptStr tls_key_file,
                OptStr tls_server_name, int max_message_bytes,
                bool decode_on_client) {
  ClientOptions options;
  options.target = target;
  if (!(timeout_s > 0))
    Throw(absl::InvalidArgumentError("timeout_s must be > 0"));
  options.timeout = absl::Seconds(timeout_s);
  options.data_plane = DataPlaneFromName(data_plane);
  Credentials c = MakeCredentials(bearer_token, bearer_token_file, tls_ca_file,
                                  tls_cert_file, tls_key_file, tls_server_name);
  options.tls = c.tls;
  options.bearer_token = c.bearer_token;
  options.max_message_bytes = max_message_bytes;
  options.decode_on_client = decode_on_client;
  absl::StatusOr<std::unique_ptr<Client>> client;
  {
    nb::gil_scoped_release release;
    client = Client::Connect(options);
  }
  new (self) PyClient{Value(std::move(client))};
}

PutResult Put(PyClient& self, const std::string& ns, nb::handle py_keys,
              const nb::ndarray<>& blocks, nb::handle parent_keys,
              std::optional<double> timeout_s, const PyCancelToken* cancel) {
  std::vector<std::string> keys = Keys(py_keys);
  std::vector<std::string> parents = Parents(parent_keys, keys.size());
  std::vector<BlockWrite> writes =
      Writes(keys, ContiguousBytes(blocks, "blocks"), parents);
  CallOptions call = MakeCall(timeout_s, cancel);
  absl::StatusOr<PutResult> r;
  {
    nb::gil_scoped_release release;
    r = self.client->Put(ns, writes, call);
  }
  return Value(std::move(r));
}

PyGetResult Get(PyClient& self, const std::string& ns, nb::handle py_keys,
                const std::string& format, uint64_t pin_lease,
                bool allow_missing, std::optional<double> timeout_s,
                const PyCancelToken* cancel) {
  std::vector<std::string> keys = Keys(py_keys);
  ReadOptions read{FormatFromName(format), pin_lease, allow_missing};
  CallOptions call = MakeCall(timeout_s, cancel);
  absl::StatusOr<GetResult> r;
  {
    nb::gil_scoped_release release;
    r = self.client->Get(ns, keys, read, call);
  }
  return PyGetResult{Value(std::move(r))};
}

PyPendingRead* GetInto(nb::handle py_self, const std::string& ns,
                       nb::handle py_keys, nb::handle py_dest,
                       const std::string& format, uint64_t pin_lease,
                       bool allow_missing, bool layer_by_layer,
                       std::optional<size_t> stride,
                       std::optional<double> timeout_s,
                       const PyCancelToken* cancel) {
  PyClient& self = nb::cast<PyClient&>(py_self);
  std::vector<std::string> keys = Keys(py_keys);
  absl::Span<uint8_t> dest =
      ContiguousBytes(nb::cast<nb::ndarray<>>(py_dest), "dest");
  if (keys.empty()) Throw(absl::InvalidArgumentError("no keys"));
  size_t slot = stride.value_or(dest.size() / keys.size());
  ReadOptions read{FormatFromName(format), pin_lease, allow_missing,
                   layer_by_layer};
  CallOptions call = MakeCall(timeout_s, cancel);
  absl::StatusOr<std::unique_ptr<PendingRead>> r;
  {
    nb::gil_scoped_release release;
    r = self.client->GetInto(ns, keys, read, dest, slot, call);
  }
  return new PyPendingRead{Value(std::move(r)), nb::borrow(py_dest),
                           nb::borrow(py_self)};
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

void BindPendingRead(nb::module_& m) {
  nb::class_<PyPendingRead>(m, "PendingRead",
                            "A read into caller memory (Client.get_into).")
      .def(
          "wait_layer",
          [](PyPendingRead& p, uint32_t layer) {
            absl::Status st;
            {
              nb::gil_scoped_release release;
              st = p.read->WaitLayer(layer);
            }
            Check(st);
          },
          nb::arg("layer"),
          "Returns once layer `layer` of every block is in the destination.")
      .def("wait",
           [](PyPendingRead& p) {
             absl::Status st;
             {
               nb::gil_scoped_release release;
               st = p.read->Wait();
             }
             Check(st);
           })
      .def_prop_ro("num_layers",
                   [](const PyPendingRead& p) { return p.read->num_layers(); })
      .def_prop_ro(
          "over_data_plane",
          [](const PyPendingRead& p) { return p.read->over_data_plane(); })
      .def_prop_ro("indices",
                   [](const PyPendingRead& p) {
                     std::vector<uint32_t> out;
                     for (const BlockData& b : p.read->metadata().blocks) {
                       out.push_back(b.index);
                     }
                     return out;
                   })
      .def_prop_ro(
          "missing",
          [](const PyPendingRead& p) { return p.read->metadata().missing; })
      .def_prop_ro("prefix_blocks",
                   [](const PyPendingRead& p) {
                     return p.read->metadata().prefix_blocks();
                   })
      .def_prop_ro("lengths", [](const PyPendingRead& p) {
        std::vector<uint64_t> out;
        for (const BlockPlacement& b : p.read->placements()) {
          out.push_back(b.length);
        }
        return out;
      });
}

void BindDataBuffer(nb::module_& m) {
  nb::class_<PyDataBuffer>(m, "DataBuffer",
                           "Memory the data plane reaches without a "
                           "per-call registration (Client.allocate_buffer).")
      .def("__len__", [](const PyDataBuffer& b) { return b.buffer->size(); })
      .def_prop_ro("registered",
                   [](const PyDataBuffer& b) { return b.buffer->registered(); })
      .def(
          "numpy",
          [](nb::handle self) {
            PyDataBuffer& b = nb::cast<PyDataBuffer&>(self);
            size_t shape[1] = {b.buffer->size()};
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
                b.buffer->data(), 1, shape, self);
          },
          "A uint8 numpy view of the whole buffer (no copy); it keeps the "
          "buffer alive. Reshape or .view() it; torch.from_numpy shares it.");
}

void BindClientMethods(nb::class_<PyClient>& c) {
  c.def(
       "register_namespace",
       [](PyClient& self, const NamespaceSpec& spec,
          std::optional<double> timeout_s, const PyCancelToken* cancel) {
         CallOptions call = MakeCall(timeout_s, cancel);
         return Blocking<NamespaceInfo>(
             [&] { return self.client->RegisterNamespace(spec, call); });
       },
       nb::arg("spec"), nb::kw_only(), nb::arg("timeout_s") = nb::none(),
       nb::arg("cancel") = nb::none())
      .def(
          "lookup",
          [](PyClient& self, const std::string& ns, nb::handle py_keys,
             bool pin, std::optional<double> timeout_s,
             const PyCancelToken* cancel) {
            std::vector<std::string> keys = Keys(py_keys);
            CallOptions call = MakeCall(timeout_s, cancel);
            return Blocking<LookupResult>(
                [&] { return self.client->Lookup(ns, keys, pin, call); });
          },
          nb::arg("ns"), nb::arg("keys"), nb::kw_only(), nb::arg("pin") = false,
          nb::arg("timeout_s") = nb::none(), nb::arg("cancel") = nb::none())
      .def("put", &Put, nb::arg("ns"), nb::arg("keys"), nb::arg("blocks"),
           nb::kw_only(), nb::arg("parent_keys") = nb::none(),
           nb::arg("timeout_s") = nb::none(), nb::arg("cancel") = nb::none(),
           "Stores blocks: `blocks` is one C-contiguous array of len(keys) "
           "rows of 16-bit values (fp16, or bf16 for a bf16 namespace).")
      .def("get", &Get, nb::arg("ns"), nb::arg("keys"), nb::kw_only(),
           nb::arg("format") = "fp16", nb::arg("pin_lease") = 0,
           nb::arg("allow_missing") = false, nb::arg("timeout_s") = nb::none(),
           nb::arg("cancel") = nb::none())
      .def("get_into", &GetInto, nb::arg("ns"), nb::arg("keys"),
           nb::arg("dest"), nb::kw_only(), nb::arg("format") = "fp16",
           nb::arg("pin_lease") = 0, nb::arg("allow_missing") = false,
           nb::arg("layer_by_layer") = true, nb::arg("stride") = nb::none(),
           nb::arg("timeout_s") = nb::none(), nb::arg("cancel") = nb::none(),
           "Reads block i into dest's bytes [i*stride, ...) (stride: "
           "dest.nbytes // len(keys)); returns once the node has answered. "
           "layer_by_layer=True: layers land in order and wait_layer(l) "
           "returns as soon as layer l is in; False: whole blocks, in "
           "fewer messages, for a caller that waits for the whole read.")
      .def(
          "allocate_buffer",
          [](nb::handle py_self, size_t nbytes) {
            PyClient& self = nb::cast<PyClient&>(py_self);
            auto buffer = Blocking<std::unique_ptr<DataBuffer>>(
                [&] { return self.client->AllocateBuffer(nbytes); });
            return new PyDataBuffer{std::move(buffer), nb::borrow(py_self)};
          },
          nb::arg("nbytes"))
      .def(
          "release",
          [](PyClient& self, uint64_t pin_lease, std::optional<double> t) {
            CallOptions call = MakeCall(t, nullptr);
            absl::Status st;
            {
              nb::gil_scoped_release release;
              st = self.client->Release(pin_lease, call);
            }
            Check(st);
          },
          nb::arg("pin_lease"), nb::kw_only(),
          nb::arg("timeout_s") = nb::none())
      .def(
          "delete",
          [](PyClient& self, const std::string& ns, nb::handle py_keys,
             std::optional<double> t) {
            std::vector<std::string> keys = Keys(py_keys);
            CallOptions call = MakeCall(t, nullptr);
            return Blocking<uint32_t>(
                [&] { return self.client->Delete(ns, keys, call); });
          },
          nb::arg("ns"), nb::arg("keys"), nb::kw_only(),
          nb::arg("timeout_s") = nb::none())
      .def(
          "stats",
          [](PyClient& self, std::optional<double> t) {
            CallOptions call = MakeCall(t, nullptr);
            return StatsDict(
                Blocking<NodeStats>([&] { return self.client->Stats(call); }));
          },
          nb::kw_only(), nb::arg("timeout_s") = nb::none())
      .def(
          "drop_namespace",
          [](PyClient& self, const std::string& ns, std::optional<double> t) {
            CallOptions call = MakeCall(t, nullptr);
            return Blocking<uint64_t>(
                [&] { return self.client->DropNamespace(ns, call); });
          },
          nb::arg("ns"), nb::kw_only(), nb::arg("timeout_s") = nb::none());
}

}  // namespace

void BindClient(nb::module_& m) {
  BindGetResult(m);
  BindPendingRead(m);
  BindDataBuffer(m);
  nb::class_<PyClient> c(m, "Client", "The client of one kvcache node.");
  c.def("__init__", &InitClient, nb::arg("target"), nb::kw_only(),
        nb::arg("timeout_s") = 10.0, nb::arg("data_plane") = "auto",
        nb::arg("bearer_token") = nb::none(),
        nb::arg("bearer_token_file") = nb::none(),
        nb::arg("tls_ca_file") = nb::none(),
        nb::arg("tls_cert_file") = nb::none(),
        nb::arg("tls_key_file") = nb::none(),
        nb::arg("tls_server_name") = nb::none(),
        nb::arg("max_message_bytes") = 256 << 20,
        nb::arg("decode_on_client") = true);
  BindClientMethods(c);
}

}  // namespace kvcache::python
