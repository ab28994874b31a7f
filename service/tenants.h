// Tenants: who may use a node's control plane, and what each may do
// (kvcache-node --tenants=FILE; the file's format is
// proto/kvcache/v1/tenants.proto, in protobuf text format).
//
// Contract:
//  * A caller is one tenant: the one whose token hash matches the bearer
//    token of its call, or, without a token, the one naming an identity of
//    its mTLS client certificate (a URI or DNS SAN). A token that matches no
//    tenant is refused even when the certificate would match one: a wrong
//    credential never falls back to another. No credential, or one no tenant
//    has: UNAUTHENTICATED.
//  * A tenant owns the namespaces whose names start with one of its
//    prefixes; an admin owns every namespace. Calls need a role (read <
//    write < admin) and, when they name a namespace, to own it:
//    PERMISSION_DENIED otherwise, before anything is looked up (so a
//    tenant cannot tell whether another's namespace exists).
//  * Every tenant has an id, stable for the life of the process (a reload
//    that keeps a name keeps its id): the store's owner index of the
//    namespaces it registers and the holder of the leases it makes. Ids are
//    1 .. store::kMaxOwners - 1, never reused; 0 is the open node.
//  * The file is validated as a whole (Parse): a file that does not parse
//    or validate is refused at start (INVALID_ARGUMENT naming the problem),
//    and on a reload it keeps the last good set serving (Reload says why).
//    A reload applies each tenant's quotas to the store; a tenant removed
//    from the file authenticates no more, and its namespaces keep their
//    blocks without a share of the pool.
//
// Thread safety: every method may be called from any thread. A caller's
// Tenant stays valid while its shared_ptr lives, across reloads.
#ifndef KVCACHE_SERVICE_TENANTS_H_
#define KVCACHE_SERVICE_TENANTS_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "store/store.h"

namespace kvcache::service {

enum class Role { kRead = 1, kWrite = 2, kAdmin = 3 };
const char* RoleName(Role role);

using TokenHash = std::array<uint8_t, 32>;  // SHA-256

// SHA-256 of `token` (OpenSSL libcrypto).
TokenHash HashToken(absl::string_view token);
// Lowercase hex of a hash, as the tenants file holds it.
std::string TokenHashHex(const TokenHash& hash);

struct Tenant {
  std::string name;
  uint16_t id = 0;
  std::vector<TokenHash> token_hashes;
  std::vector<std::string> identities;
  std::vector<std::string> prefixes;
  Role role = Role::kRead;
  uint64_t pool_bytes = 0;
  uint32_t max_namespaces = 0;

  bool admin() const { return role == Role::kAdmin; }
  // True when namespace `name` is this tenant's (an admin's: any).
  bool Owns(absl::string_view name) const;
  // The length of the longest prefix of this tenant that `name` starts
  // with; -1 when none.
  int Match(absl::string_view name) const;
};

// The tenants of one version of the file, validated; ids are 0 until
// Tenants assigns them.
struct TenantSet {
  std::vector<Tenant> tenants;
};

// Parses and validates the text of a tenants file: at least one tenant;
// unique names of [A-Za-z0-9._-]{1,64} (not "open" or "unauthenticated",
// which metrics use); a known role; at least one credential; tokens as 64
// hex digits, unique across tenants, as are identities; non-empty
// prefixes, at least one unless admin. INVALID_ARGUMENT names the tenant
// and the problem.
absl::StatusOr<TenantSet> ParseTenants(absl::string_view text);

class Tenants {
 public:
  // Reads and validates `path` and applies its quotas to `store` (which
  // must outlive this object). INVALID_ARGUMENT naming the file when it is
  // unreadable or invalid.
  static absl::StatusOr<std::unique_ptr<Tenants>> Load(std::string path,
                                                       store::Store* store);

  // Reads the file again; when its contents changed and are valid, serves
  // them from now on and answers true; false when unchanged. On an error
  // the last good set keeps serving.
  absl::StatusOr<bool> Reload();

  // The tenant of a call with `authorization` metadata (empty: none; else
  // "Bearer TOKEN") and the identities of its mTLS peer. UNAUTHENTICATED
  // as the contract says.
  absl::StatusOr<std::shared_ptr<const Tenant>> Authenticate(
      absl::string_view authorization,
      absl::Span<const std::string> peer_identities) const;

  // The tenant of `id` in the current set; null when removed.
  std::shared_ptr<const Tenant> ById(uint16_t id) const;
  // Among the current tenants that are not admins, the one with the
  // longest prefix `name` starts with; null when none.
  std::shared_ptr<const Tenant> PrefixOwner(absl::string_view name) const;
  // The names of the current tenants (the metrics' closed set).
  std::vector<std::string> Names() const;
  const std::string& path() const { return path_; }

 private:
  Tenants(std::string path, store::Store* store)
      : path_(std::move(path)), store_(store) {}
  // Gives every tenant of `set` its id (new names get new ones).
  absl::Status AssignIds(TenantSet* set) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<const TenantSet> Current() const;

  const std::string path_;
  store::Store* const store_;
  Mutex reload_mu_;  // one Reload at a time
  mutable Mutex mu_;
  std::string text_ ABSL_GUARDED_BY(reload_mu_);
  std::shared_ptr<const TenantSet> set_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint16_t> ids_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcache::service

#endif  // KVCACHE_SERVICE_TENANTS_H_
