// TestPki: certificate authorities and certificates made at test time with
// the openssl command (no key material is checked in). Each CA and leaf is a
// pair of PEM files in a temporary directory that the object removes.
#ifndef KVCACHE_TESTS_TEST_PKI_H_
#define KVCACHE_TESTS_TEST_PKI_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvcache::testing {

struct PemPair {
  std::string cert;  // path of the PEM certificate
  std::string key;   // path of the PEM private key
};

class TestPki {
 public:
  TestPki() {
    char pattern[] = "/tmp/kvcache-pki-XXXXXX";
    const char* made = mkdtemp(pattern);
    dir_ = made != nullptr ? made : "";
  }
  ~TestPki() {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }
  TestPki(const TestPki&) = delete;
  TestPki& operator=(const TestPki&) = delete;

  const std::string& dir() const { return dir_; }

  // A self-signed P-256 CA named `name`.
  absl::StatusOr<PemPair> MakeCa(const std::string& name) {
    PemPair ca{Path(name + ".pem"), Path(name + ".key")};
    if (absl::Status s = Run(absl::StrCat(
            "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1"
            " -nodes -days 2 -subj /CN=",
            name, " -keyout ", ca.key, " -out ", ca.cert));
        !s.ok()) {
      return s;
    }
    return ca;
  }

  // A leaf certificate for `name`, signed by `ca`, with the given
  // subjectAltName (e.g. "DNS:localhost,IP:127.0.0.1" or
  // "URI:spiffe://kvcache/tenant-a").
  absl::StatusOr<PemPair> Issue(const PemPair& ca, const std::string& name,
                                const std::string& san) {
    PemPair leaf{Path(name + ".pem"), Path(name + ".key")};
    const std::string csr = Path(name + ".csr"), ext = Path(name + ".ext");
    std::ofstream(ext) << "subjectAltName=" << san << "\n";
    if (absl::Status s = Run(absl::StrCat(
            "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1"
            " -nodes -subj /CN=",
            name, " -keyout ", leaf.key, " -out ", csr));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Run(absl::StrCat(
            "openssl x509 -req -days 2 -in ", csr, " -CA ", ca.cert, " -CAkey ",
            ca.key, " -CAcreateserial -extfile ", ext, " -out ", leaf.cert));
        !s.ok()) {
      return s;
    }
    return leaf;
  }

  std::string Path(const std::string& file) const {
    return absl::StrCat(dir_, "/", file);
  }

  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path);
    std::stringstream out;
    out << in.rdbuf();
    return out.str();
  }

 private:
  absl::Status Run(const std::string& command) {
    if (dir_.empty()) return absl::InternalError("no temporary directory");
    const std::string log = Path("openssl.log");
    if (std::system(absl::StrCat(command, " >>", log, " 2>&1").c_str()) != 0) {
      return absl::InternalError(
          absl::StrCat("failed: ", command, "\n", ReadFile(log)));
    }
    return absl::OkStatus();
  }

  std::string dir_;
};

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TEST_PKI_H_
