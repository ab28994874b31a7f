// TLS on the control plane: the node's gRPC server credentials.
//
// Contract:
//  * Without cert_file and key_file the server speaks plaintext (a node
//    that does says so at start). With both it speaks TLS; with
//    client_ca_file as well it requires a client certificate signed by that
//    CA (mTLS) and the caller's identity (its certificate's SANs) reaches
//    the handlers through the call's auth context.
//  * The files are read again every refresh_interval (gRPC's file watcher):
//    a certificate rotated in place (cert-manager) is served to new
//    connections without a restart; a rotation that leaves the files
//    unreadable or mismatched keeps the last good pair.
//  * Start fails with INVALID_ARGUMENT naming the flag when a file is
//    missing or unreadable, when only one of cert and key is given, or
//    when a client CA is given without them.
#ifndef KVCACHE_SERVICE_TLS_H_
#define KVCACHE_SERVICE_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace grpc {
class ServerCredentials;
}

namespace kvcache::service {

struct TlsOptions {
  std::string cert_file;       // PEM certificate chain (--tls-cert)
  std::string key_file;        // PEM private key (--tls-key)
  std::string client_ca_file;  // PEM CA bundle: mTLS (--tls-client-ca)
  absl::Duration refresh_interval = absl::Seconds(10);  // --tls-refresh

  bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
};

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsOptions& options);

}  // namespace kvcache::service

#endif  // KVCACHE_SERVICE_TLS_H_
