// Arrays and keys from Python, call options from keywords.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bind.h"

namespace kvcache::python {

absl::Span<uint8_t> ContiguousBytes(const nb::ndarray<>& array,
                                    const char* what) {
  if (array.device_type() != nb::device::cpu::value) {
    Throw(absl::InvalidArgumentError(
        absl::StrCat(what, " must be in host memory (a CPU array or tensor)")));
  }
  // C order: the last axis has stride 1, each axis spans the ones after it.
  // Axes of extent 1 may have any stride.
  int64_t expected = 1;
  for (size_t i = array.ndim(); i-- > 0;) {
    if (array.shape(i) != 1 && array.stride(i) != expected) {
      Throw(absl::InvalidArgumentError(
          absl::StrCat(what, " must be C-contiguous (axis ", i, " has stride ",
                       array.stride(i), ", expected ", expected,
                       "); pass a contiguous copy or view")));
    }
    expected *= static_cast<int64_t>(array.shape(i));
  }
  return {static_cast<uint8_t*>(array.data()), array.nbytes()};
}

std::vector<std::string> Keys(nb::handle sequence) {
  std::vector<std::string> keys;
  if (!nb::isinstance<nb::sequence>(sequence) ||
      nb::isinstance<nb::bytes>(sequence) ||
      nb::isinstance<nb::str>(sequence)) {
    Throw(absl::InvalidArgumentError("keys must be a sequence of bytes"));
  }
  keys.reserve(nb::len(sequence));
  for (nb::handle key : sequence) {
    if (nb::isinstance<nb::bytes>(key)) {
      nb::bytes b = nb::borrow<nb::bytes>(key);
      keys.emplace_back(b.c_str(), b.size());
    } else if (nb::isinstance<nb::str>(key)) {
      keys.push_back(nb::cast<std::string>(key));
    } else {
      Throw(absl::InvalidArgumentError(
          "keys must be bytes (or str), e.g. from block_hash_chain"));
    }
  }
  return keys;
}

std::pair<nb::object, uint8_t*> NewNumpy(const std::vector<size_t>& shape,
                                         const char* dtype) {
  nb::object np = nb::module_::import_("numpy");
  nb::object dims = nb::cast(shape);
  nb::object array = np.attr("empty")(dims, nb::arg("dtype") = dtype);
  auto view = nb::cast<nb::ndarray<>>(array);
  return {array, static_cast<uint8_t*>(view.data())};
}

CallOptions MakeCall(std::optional<double> timeout_s,
                     const PyCancelToken* cancel) {
  CallOptions call;
  if (timeout_s.has_value()) {
    if (!(*timeout_s > 0)) {
      Throw(absl::InvalidArgumentError("timeout_s must be > 0"));
    }
    call.timeout = absl::Seconds(*timeout_s);
  }
  if (cancel != nullptr) call.cancel = cancel->token;
  return call;
}

ReadFormat FormatFromName(const std::string& name) {
  if (name == "fp16" || name == "source") return ReadFormat::kFp16;
  if (name == "raw") return ReadFormat::kRaw;
  Throw(absl::InvalidArgumentError(absl::StrCat(
      "format must be 'fp16' (the source dtype) or 'raw', not '", name, "'")));
}

DataPlane DataPlaneFromName(const std::string& name) {
  if (name == "auto") return DataPlane::kAuto;
  if (name == "ucx") return DataPlane::kUcx;
  if (name == "grpc") return DataPlane::kGrpc;
  Throw(absl::InvalidArgumentError(absl::StrCat(
      "data_plane must be 'auto', 'ucx' or 'grpc', not '", name, "'")));
}

Credentials MakeCredentials(std::optional<std::string> bearer_token,
                            std::optional<std::string> bearer_token_file,
                            std::optional<std::string> tls_ca_file,
                            std::optional<std::string> tls_cert_file,
                            std::optional<std::string> tls_key_file,
                            std::optional<std::string> tls_server_name) {
  Credentials c;
  if (bearer_token && bearer_token_file) {
    Throw(absl::InvalidArgumentError(
        "give bearer_token or bearer_token_file, not both"));
  }
  if (bearer_token) c.bearer_token = *bearer_token;
  if (bearer_token_file)
    c.bearer_token = Value(ReadBearerTokenFile(*bearer_token_file));
  c.tls.ca_file = tls_ca_file.value_or("");
  c.tls.cert_file = tls_cert_file.value_or("");
  c.tls.key_file = tls_key_file.value_or("");
  c.tls.server_name = tls_server_name.value_or("");
  if (!c.tls.enabled() &&
      (!c.tls.cert_file.empty() || !c.tls.key_file.empty())) {
    Throw(absl::InvalidArgumentError(
        "tls_cert_file and tls_key_file need tls_ca_file (the node's CA)"));
  }
  return c;
}

}  // namespace kvcache::python
