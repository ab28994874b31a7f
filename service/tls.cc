#include "service/tls.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace kvcache::service {
namespace {

absl::Status CheckReadable(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in.good()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": cannot read the file"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsOptions& options) {
  if (!options.enabled()) {
    if (!options.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.cert_file.empty() || options.key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  for (const auto& [path, flag] :
       {std::pair{options.cert_file, "tls-cert"},
        std::pair{options.key_file, "tls-key"},
        std::pair{options.client_ca_file, "tls-client-ca"}}) {
    if (path.empty()) continue;
    if (absl::Status s = CheckReadable(path, flag); !s.ok()) return s;
  }
  const unsigned refresh_seconds = static_cast<unsigned>(
      std::max<int64_t>(1, absl::ToInt64Seconds(options.refresh_interval)));
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          options.key_file, options.cert_file, options.client_ca_file,
          refresh_seconds);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (!options.client_ca_file.empty()) {
    tls.watch_root_certs();
    tls.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace kvcache::service
