// TestTenantsFile: a tenants file (kvcache/v1/tenants.proto, text format) in
// a temporary directory that the object removes, for nodes started with
// NodeOptions::tenants_file; and the tenant entries the tests use.
#ifndef KVCACHE_TESTS_TEST_TENANTS_H_
#define KVCACHE_TESTS_TEST_TENANTS_H_

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "service/tenants.h"

namespace kvcache::testing {

// The token_sha256 a tenants file holds for `token`.
inline std::string TokenSha256(const std::string& token) {
  return service::TokenHashHex(service::HashToken(token));
}

// One `tenants { ... }` entry with a bearer token (and no quotas unless
// `extra` adds fields, e.g. "pool_bytes: 65536 max_namespaces: 2").
inline std::string TenantEntry(const std::string& name,
                               const std::string& token,
                               const std::string& prefix,
                               const std::string& role,
                               const std::string& extra = "") {
  return absl::StrCat(
      "tenants {\n  name: \"", name, "\"\n  token_sha256: \"",
      TokenSha256(token), "\"\n",
      prefix.empty() ? std::string()
                     : absl::StrCat("  namespace_prefixes: \"", prefix, "\"\n"),
      "  role: ", role, "\n  ", extra, "\n}\n");
}

// The admin every integration fixture run with tenants uses.
inline constexpr char kAdminToken[] = "admin-token-for-tests";
inline std::string AdminTenants() {
  return TenantEntry("admin", kAdminToken, "", "ROLE_ADMIN");
}

class TestTenantsFile {
 public:
  TestTenantsFile() {
    char pattern[] = "/tmp/kvcache-tenants-XXXXXX";
    const char* made = mkdtemp(pattern);
    dir_ = made != nullptr ? made : "/tmp";
    path_ = dir_ + "/tenants.textproto";
  }
  ~TestTenantsFile() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  TestTenantsFile(const TestTenantsFile&) = delete;
  TestTenantsFile& operator=(const TestTenantsFile&) = delete;

  // Replaces the file's contents at once (a rename, as a Secret update
  // does), so that a reader never sees half of it.
  void Write(const std::string& text) {
    const std::string next = path_ + ".next";
    std::ofstream(next) << text;
    std::filesystem::rename(next, path_);
  }
  const std::string& path() const { return path_; }

 private:
  std::string dir_;
  std::string path_;
};

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_TEST_TENANTS_H_
