#include "service/tenants.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "kvcache/v1/tenants.pb.h"

namespace kvcache::service {
namespace {

constexpr char kBearer[] = "Bearer ";

// Collects the text parser's errors: the first one names line and column.
class ParseErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first_.empty()) {
      first_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ",
                            message);
    }
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' &&
        c != '_' && c != '-') {
      return false;
    }
  }
  return name != "open" && name != "unauthenticated";
}

absl::StatusOr<TokenHash> HashFromHex(absl::string_view hex) {
  TokenHash hash;
  if (hex.size() != 64) {
    return absl::InvalidArgumentError("a token_sha256 is not 64 hex digits");
  }
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError("a token_sha256 is not 64 hex digits");
    }
  }
  const std::string bytes = absl::HexStringToBytes(hex);
  std::copy(bytes.begin(), bytes.end(), hash.begin());
  return hash;
}

absl::StatusOr<Role> RoleFromProto(v1::Role role) {
  switch (role) {
    case v1::ROLE_READ:
      return Role::kRead;
    case v1::ROLE_WRITE:
      return Role::kWrite;
    case v1::ROLE_ADMIN:
      return Role::kAdmin;
    default:
      return absl::InvalidArgumentError(
          "role must be ROLE_READ, ROLE_WRITE or ROLE_ADMIN");
  }
}

// One tenant of the file, checked on its own.
absl::StatusOr<Tenant> TenantFromProto(const v1::Tenant& t) {
  Tenant tenant;
  tenant.name = t.name();
  if (!ValidName(t.name())) {
    return absl::InvalidArgumentError(
        "name must be 1 to 64 of [A-Za-z0-9._-] and not 'open' or "
        "'unauthenticated'");
  }
  absl::StatusOr<Role> role = RoleFromProto(t.role());
  if (!role.ok()) return role.status();
  tenant.role = *role;
  for (const std::string& hex : t.token_sha256()) {
    absl::StatusOr<TokenHash> hash = HashFromHex(hex);
    if (!hash.ok()) return hash.status();
    tenant.token_hashes.push_back(*hash);
  }
  for (const std::string& identity : t.identities()) {
    if (identity.empty()) {
      return absl::InvalidArgumentError("an identity is empty");
    }
    tenant.identities.push_back(identity);
  }
  if (tenant.token_hashes.empty() && tenant.identities.empty()) {
    return absl::InvalidArgumentError(
        "no credential: give token_sha256 or identities");
  }
  for (const std::string& prefix : t.namespace_prefixes()) {
    if (prefix.empty()) {
      return absl::InvalidArgumentError(
          "a namespace prefix is empty (an admin owns every namespace)");
    }
    tenant.prefixes.push_back(prefix);
  }
  if (tenant.prefixes.empty() && !tenant.admin()) {
    return absl::InvalidArgumentError(
        "no namespace_prefixes (only an admin may have none)");
  }
  tenant.pool_bytes = t.pool_bytes();
  tenant.max_namespaces = t.max_namespaces();
  return tenant;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tenants=", path, ": cannot read the file"));
  }
  return text.str();
}

// The identity a certificate value stands for: URIs as they are, DNS names
// without case.
bool SameIdentity(absl::string_view configured, absl::string_view peer) {
  if (absl::StrContains(configured, "://")) return configured == peer;
  return absl::EqualsIgnoreCase(configured, peer);
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kRead:
      return "read";
    case Role::kWrite:
      return "write";
    case Role::kAdmin:
      return "admin";
  }
  return "read";
}

TokenHash HashToken(absl::string_view token) {
  TokenHash hash;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(),
         hash.data());
  return hash;
}

std::string TokenHashHex(const TokenHash& hash) {
  return absl::BytesToHexString(absl::string_view(
      reinterpret_cast<const char*>(hash.data()), hash.size()));
}

int Tenant::Match(absl::string_view name) const {
  int best = -1;
  for (const std::string& prefix : prefixes) {
    if (absl::StartsWith(name, prefix)) {
      best = std::max(best, static_cast<int>(prefix.size()));
    }
  }
  return best;
}

bool Tenant::Owns(absl::string_view name) const {
  return admin() || Match(name) >= 0;
}

absl::StatusOr<TenantSet> ParseTenants(absl::string_view text) {
  v1::TenantsFile file;
  google::protobuf::TextFormat::Parser parser;
  ParseErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &file)) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a tenants file: ", errors.first()));
  }
  if (file.tenants().empty()) {
    return absl::InvalidArgumentError("no tenants");
  }
  TenantSet set;
  absl::flat_hash_set<std::string> names, tokens, identities;
  for (int i = 0; i < file.tenants_size(); ++i) {
    absl::StatusOr<Tenant> tenant = TenantFromProto(file.tenants(i));
    if (!tenant.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant ", i + 1, " ('", file.tenants(i).name(),
                       "'): ", tenant.status().message()));
    }
    auto duplicate = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant ", i + 1, " ('", tenant->name, "'): ", what,
                       " is another tenant's too"));
    };
    if (!names.insert(tenant->name).second) return duplicate("its name");
    for (const TokenHash& hash : tenant->token_hashes) {
      if (!tokens.insert(TokenHashHex(hash)).second) {
        return duplicate("a token_sha256");
      }
    }
    for (const std::string& identity : tenant->identities) {
      if (!identities.insert(absl::AsciiStrToLower(identity)).second) {
        return duplicate("an identity");
      }
    }
    set.tenants.push_back(*std::move(tenant));
  }
  return set;
}

absl::StatusOr<std::unique_ptr<Tenants>> Tenants::Load(std::string path,
                                                       store::Store* store) {
  std::unique_ptr<Tenants> tenants(new Tenants(std::move(path), store));
  if (absl::StatusOr<bool> loaded = tenants->Reload(); !loaded.ok()) {
    return loaded.status();
  }
  return tenants;
}

absl::StatusOr<bool> Tenants::Reload() {
  MutexLock reload_lock(&reload_mu_);
  absl::StatusOr<std::string> text = ReadFile(path_);
  if (!text.ok()) return text.status();
  if (Current() != nullptr && *text == text_) return false;
  absl::StatusOr<TenantSet> set = ParseTenants(*text);
  if (!set.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tenants=", path_, ": ", set.status().message()));
  }
  std::shared_ptr<const TenantSet> previous;
  {
    MutexLock lock(&mu_);
    if (absl::Status s = AssignIds(&*set); !s.ok()) return s;
    previous = set_;
    set_ = std::make_shared<const TenantSet>(*std::move(set));
  }
  // Quotas: the new set's, and none for tenants that left it.
  std::shared_ptr<const TenantSet> current = Current();
  for (const Tenant& t : current->tenants) {
    store_->SetOwnerQuota(t.id, {t.pool_bytes, t.max_namespaces}).IgnoreError();
  }
  if (previous != nullptr) {
    for (const Tenant& t : previous->tenants) {
      if (ById(t.id) == nullptr) {
        store_->SetOwnerQuota(t.id, {}).IgnoreError();
      }
    }
  }
  text_ = *std::move(text);
  return true;
}

absl::Status Tenants::AssignIds(TenantSet* set) {
  size_t fresh = 0;
  for (const Tenant& t : set->tenants) fresh += !ids_.contains(t.name);
  if (ids_.size() + fresh >= store::kMaxOwners) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tenants=", path_, ": more than ", store::kMaxOwners - 1,
        " tenant names since the node started; restart it to forget the "
        "removed ones"));
  }
  for (Tenant& t : set->tenants) {
    auto [it, added] =
        ids_.try_emplace(t.name, static_cast<uint16_t>(ids_.size() + 1));
    t.id = it->second;
  }
  return absl::OkStatus();
}

std::shared_ptr<const TenantSet> Tenants::Current() const {
  MutexLock lock(&mu_);
  return set_;
}

absl::StatusOr<std::shared_ptr<const Tenant>> Tenants::Authenticate(
    absl::string_view authorization,
    absl::Span<const std::string> peer_identities) const {
  std::shared_ptr<const TenantSet> set = Current();
  if (!authorization.empty()) {
    absl::string_view token = authorization;
    if (!absl::ConsumePrefix(&token, kBearer) || token.empty()) {
      return absl::UnauthenticatedError(
          "the authorization metadata is not 'Bearer TOKEN'");
    }
    const TokenHash hash = HashToken(token);
    // Every hash is compared, in constant time each: the time taken does
    // not tell which tenant (or which byte) matched.
    const Tenant* found = nullptr;
    for (const Tenant& t : set->tenants) {
      for (const TokenHash& h : t.token_hashes) {
        if (CRYPTO_memcmp(h.data(), hash.data(), hash.size()) == 0) {
          found = &t;
        }
      }
    }
    if (found == nullptr) {
      return absl::UnauthenticatedError("the bearer token is not valid");
    }
    return std::shared_ptr<const Tenant>(set, found);
  }
  for (const Tenant& t : set->tenants) {
    for (const std::string& identity : t.identities) {
      for (const std::string& peer : peer_identities) {
        if (SameIdentity(identity, peer)) {
          return std::shared_ptr<const Tenant>(set, &t);
        }
      }
    }
  }
  return absl::UnauthenticatedError(
      peer_identities.empty()
          ? "no credential: send 'authorization: Bearer TOKEN' or use a "
            "client certificate of a tenant"
          : "the client certificate names no tenant");
}

std::shared_ptr<const Tenant> Tenants::ById(uint16_t id) const {
  std::shared_ptr<const TenantSet> set = Current();
  for (const Tenant& t : set->tenants) {
    if (t.id == id) return std::shared_ptr<const Tenant>(set, &t);
  }
  return nullptr;
}

std::shared_ptr<const Tenant> Tenants::PrefixOwner(
    absl::string_view name) const {
  std::shared_ptr<const TenantSet> set = Current();
  const Tenant* best = nullptr;
  int best_length = -1;
  for (const Tenant& t : set->tenants) {
    if (t.admin() || t.role == Role::kRead) continue;
    const int length = t.Match(name);
    if (length > best_length) {
      best = &t;
      best_length = length;
    }
  }
  if (best == nullptr) return nullptr;
  return std::shared_ptr<const Tenant>(set, best);
}

std::vector<std::string> Tenants::Names() const {
  std::vector<std::string> names;
  for (const Tenant& t : Current()->tenants) names.push_back(t.name);
  return names;
}

}  // namespace kvcache::service
