// What the binding's files share: the status edge (absl::Status -> the
// Python exceptions of kvcache/errors.py), arrays and keys taken from
// Python without copies, and call options built from keyword arguments.
//
// Threading contract of the binding: every call that waits on a node runs
// with the GIL released, after its Python arguments have been converted to
// C++ values (keys copied into strings, arrays pinned by reference); nothing
// that runs without the GIL touches a Python object.
#ifndef KVCACHE_PYTHON_BIND_H_
#define KVCACHE_PYTHON_BIND_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcache/call_options.h"
#include "kvcache/client.h"

namespace kvcache::python {

namespace nb = nanobind;

// A non-OK status on its way to Python; the translator registered by
// RegisterErrors raises it as the exception class of its code.
class StatusError : public std::exception {
 public:
  explicit StatusError(absl::Status status) : status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return "kvcache status"; }

 private:
  absl::Status status_;
};

[[noreturn]] void Throw(const absl::Status& status);
inline void Check(const absl::Status& status) {
  if (!status.ok()) Throw(status);
}
template <typename T>
T Value(absl::StatusOr<T> value) {
  if (!value.ok()) Throw(value.status());
  return *std::move(value);
}

// Registers the status translator and `_register_errors(mapping)`, through
// which kvcache/errors.py hands over its classes by code name.
void RegisterErrors(nb::module_& m);

// A CPU array's bytes, C-contiguous; INVALID_ARGUMENT (a ValueError-derived
// kvcache.InvalidArgument) naming `what` otherwise. Takes numpy arrays,
// torch tensors and anything else with DLPack or the buffer protocol.
absl::Span<uint8_t> ContiguousBytes(const nb::ndarray<>& array,
                                    const char* what);

// Keys from a Python sequence of bytes (or str, UTF-8).
std::vector<std::string> Keys(nb::handle sequence);

// A new numpy array of `dtype` ("float16", "uint16", "uint8") and `shape`,
// and its writable bytes.
std::pair<nb::object, uint8_t*> NewNumpy(const std::vector<size_t>& shape,
                                         const char* dtype);

// Python's cancel token: wraps the C++ one so calls can share it.
struct PyCancelToken {
  std::shared_ptr<CancelToken> token = std::make_shared<CancelToken>();
};

CallOptions MakeCall(std::optional<double> timeout_s,
                     const PyCancelToken* cancel);

ReadFormat FormatFromName(const std::string& name);
DataPlane DataPlaneFromName(const std::string& name);

// The TLS and credential keywords both clients take.
struct Credentials {
  TlsOptions tls;
  std::string bearer_token;
};
Credentials MakeCredentials(std::optional<std::string> bearer_token,
                            std::optional<std::string> bearer_token_file,
                            std::optional<std::string> tls_ca_file,
                            std::optional<std::string> tls_cert_file,
                            std::optional<std::string> tls_key_file,
                            std::optional<std::string> tls_server_name);

void BindHashing(nb::module_& m);
void BindTypes(nb::module_& m);
void BindClient(nb::module_& m);
void BindClusterClient(nb::module_& m);

}  // namespace kvcache::python

#endif  // KVCACHE_PYTHON_BIND_H_
