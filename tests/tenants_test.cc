// Tenants: the file's validation, and a node run with --tenants driven
// through the client library and the raw stub: who is refused with which
// code, namespaces and leases kept apart, roles, quotas, DropNamespace, and
// a reload of the file without a restart. (mTLS identities: tls_test.cc.)
#include "service/tenants.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvcache/client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/metrics.h"
#include "service/node.h"
#include "tests/test_tenants.h"
#include "tests/test_util.h"

namespace kvcache {
namespace {

using kvcache::testing::AdminTenants;
using kvcache::testing::kAdminToken;
using kvcache::testing::Key;
using kvcache::testing::RandomBlock;
using kvcache::testing::SmallShape;
using kvcache::testing::TenantEntry;
using kvcache::testing::TestTenantsFile;
using kvcache::testing::TokenSha256;

// ------------------------------------------------------------ the file

TEST(TenantsFileTest, AValidFileParsesWithEveryField) {
  const std::string text = absl::StrCat(
      AdminTenants(), "tenants { name: \"team-a\" token_sha256: \"",
      TokenSha256("a"), "\" token_sha256: \"", TokenSha256("a2"),
      "\" identities: \"spiffe://kvcache/a\" namespace_prefixes: \"a/\" "
      "namespace_prefixes: \"shared/a\" role: ROLE_WRITE pool_bytes: 1048576 "
      "max_namespaces: 3 }\n",
      "tenants { name: \"reader\" identities: \"reader.example.com\" "
      "namespace_prefixes: \"a/\" role: ROLE_READ }\n");
  auto set = service::ParseTenants(text);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->tenants.size(), 3u);
  const service::Tenant& a = set->tenants[1];
  EXPECT_EQ(a.name, "team-a");
  EXPECT_EQ(a.role, service::Role::kWrite);
  EXPECT_EQ(a.token_hashes.size(), 2u);
  EXPECT_EQ(a.pool_bytes, 1048576u);
  EXPECT_EQ(a.max_namespaces, 3u);
  EXPECT_TRUE(a.Owns("a/llama"));
  EXPECT_TRUE(a.Owns("shared/a1"));
  EXPECT_FALSE(a.Owns("b/llama"));
  EXPECT_FALSE(a.Owns("shared/b"));
  EXPECT_TRUE(set->tenants[0].Owns("anything"));  // the admin
}

TEST(TenantsFileTest, EveryMistakeIsRefusedNamingTheTenant) {
  const std::string token = TokenSha256("t");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "no tenants"},
      {"tenants { name: \"a\" bogus: 1 }", "bogus"},
      {"tenants { name: \"a\" token_sha256: \"abc\" namespace_prefixes: "
       "\"a/\" role: ROLE_WRITE }",
       "64 hex"},
      {absl::StrCat("tenants { name: \"a\" token_sha256: \"", token,
                    "\" namespace_prefixes: \"a/\" }"),
       "role"},
      {"tenants { name: \"a\" namespace_prefixes: \"a/\" role: ROLE_READ }",
       "no credential"},
      {absl::StrCat("tenants { name: \"a\" token_sha256: \"", token,
                    "\" role: ROLE_WRITE }"),
       "namespace_prefixes"},
      {absl::StrCat("tenants { name: \"a\" token_sha256: \"", token,
                    "\" namespace_prefixes: \"\" role: ROLE_WRITE }"),
       "prefix is empty"},
      {absl::StrCat("tenants { name: \"open\" token_sha256: \"", token,
                    "\" role: ROLE_ADMIN }"),
       "name"},
      {absl::StrCat(TenantEntry("a", "t", "a/", "ROLE_WRITE"),
                    TenantEntry("a", "u", "b/", "ROLE_WRITE")),
       "its name is another tenant's"},
      {absl::StrCat(TenantEntry("a", "t", "a/", "ROLE_WRITE"),
                    TenantEntry("b", "t", "b/", "ROLE_WRITE")),
       "token_sha256 is another tenant's"},
  };
  for (const auto& [text, why] : bad) {
    auto set = service::ParseTenants(text);
    ASSERT_FALSE(set.ok()) << text;
    EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(set.status().message().find(why), std::string::npos)
        << set.status() << " should say " << why;
  }
}

TEST(TenantsFileTest, TokenHashesAreSha256InHex) {
  // printf %s test | sha256sum
  EXPECT_EQ(TokenSha256("test"),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08");
}

TEST(TenantsFileTest, AnUnreadableOrInvalidFileStopsTheNodeAtStart) {
  TestTenantsFile file;
  file.Write("tenants { name: \"a\" }");
  service::NodeOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.memory = {store::MemoryKind::kHost, 0, 4 << 20};
  options.store.page_size = 4096;
  options.tenants_file = file.path();
  service::Node node(options);
  absl::Status started = node.Start();
  EXPECT_EQ(started.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(started.message().find("--tenants="), std::string::npos) << started;
  options.tenants_file = "/nonexistent/tenants.textproto";
  service::Node missing(options);
  EXPECT_EQ(missing.Start().code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------ a node

// team-a and team-b write their own prefixes; reader-a reads team-a's; the
// admin does everything. The pool holds `PoolBlocks()` fp16 blocks.
class TenantsTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBlockBytes = 16 << 10;  // SmallShape, fp16

  void SetUp() override {
    file_.Write(Tenants());
    StartNode();
  }

  std::string Tenants(const std::string& b_token = "token-b") const {
    return absl::StrCat(
        AdminTenants(),
        TenantEntry(
            "team-a", "token-a", "a/", "ROLE_WRITE",
            absl::StrCat("max_namespaces: 2 pool_bytes: ", 4 * kBlockBytes)),
        TenantEntry("team-b", b_token, "b/", "ROLE_WRITE"),
        TenantEntry("reader-a", "token-reader-a", "a/", "ROLE_READ"));
  }

  void StartNode() {
    service::NodeOptions options;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "";
    // 24 blocks of 16 KiB and their header slots.
    options.memory = {store::MemoryKind::kHost, 0, 24 * (kBlockBytes + 288)};
    options.store.page_size = 4096;
    options.worker_threads = 2;
    options.drain_timeout = absl::Seconds(2);
    options.tenants_file = file_.path();
    options.tenants_refresh = absl::Milliseconds(100);
    options.reaper_interval = absl::Milliseconds(50);
    // No background (watermark) eviction: the pool holds what the tests put
    // until a write evicts, so that "the pool is full" is true when a test
    // says so (a reaper pass between two calls freed space and made a write
    // over its share succeed: seen under ASan in CI).
    options.store.high_watermark = 1;
    node_ = std::make_unique<service::Node>(options);
    absl::Status started = node_->Start();
    ASSERT_TRUE(started.ok()) << started;
    target_ = absl::StrCat("127.0.0.1:", node_->port());
    stub_ = v1::KvCache::NewStub(
        grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<Client> As(const std::string& token) {
    ClientOptions options;
    options.target = target_;
    options.timeout = absl::Seconds(10);
    options.bearer_token = token;
    auto client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // A raw call with `authorization` metadata (none when empty).
  grpc::StatusCode Raw(
      const std::string& authorization,
      const std::function<grpc::Status(grpc::ClientContext*)>& call) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
    return call(&ctx).error_code();
  }

  static NamespaceSpec Spec(const std::string& name) {
    NamespaceSpec spec;
    spec.name = name;
    spec.model = "tenants-test";
    spec.shape = SmallShape();
    spec.policy = CodecPolicy{};  // codec none: 16 KiB blocks
    return spec;
  }

  absl::Status Put(Client* client, const std::string& ns, int first, int n) {
    std::vector<std::vector<uint16_t>> data;
    std::vector<BlockWrite> writes;
    for (int i = first; i < first + n; ++i) {
      data.push_back(RandomBlock(SmallShape(), i));
    }
    for (int i = 0; i < n; ++i) {
      writes.push_back({Key(first + i), "", data[i]});
    }
    return client->Put(ns, writes).status();
  }

  bool Stored(Client* client, const std::string& ns, int i) {
    auto r = client->Lookup(ns, {Key(i)});
    return r.ok() && r->prefix_blocks == 1;
  }

  TestTenantsFile file_;
  std::unique_ptr<service::Node> node_;
  std::string target_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

TEST_F(TenantsTest, NoCredentialIsUnauthenticatedOnEveryRpc) {
  auto a = As("token-a");
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/m")).ok());
  ASSERT_TRUE(Put(a.get(), "a/m", 0, 1).ok());
  v1::StatsRequest stats;
  v1::StatsResponse stats_response;
  v1::LookupRequest lookup;
  lookup.set_namespace_name("a/m");
  lookup.add_keys(Key(0));
  v1::LookupResponse lookup_response;
  v1::RegisterNamespaceRequest reg;
  reg.mutable_spec()->set_name("a/n");
  v1::RegisterNamespaceResponse reg_response;
  v1::BeginReadRequest read;
  read.set_namespace_name("a/m");
  read.add_keys(Key(0));
  read.set_inline_data(true);
  v1::BeginReadResponse read_response;
  v1::CommitWriteRequest commit;
  commit.set_write_id(1);
  v1::CommitWriteResponse commit_response;
  v1::EndReadRequest end;
  end.set_lease_id(1);
  v1::EndReadResponse end_response;
  v1::DropNamespaceRequest drop;
  drop.set_namespace_name("a/m");
  v1::DropNamespaceResponse drop_response;
  for (const std::string& authorization :
       {std::string(), std::string("Bearer "), std::string("Basic dG9rZW4="),
        std::string("Bearer token-a-but-not-quite"), std::string("token-a")}) {
    SCOPED_TRACE(authorization);
    using C = grpc::ClientContext;
    const grpc::StatusCode want = grpc::StatusCode::UNAUTHENTICATED;
    EXPECT_EQ(
        Raw(authorization,
            [&](C* c) { return stub_->Stats(c, stats, &stats_response); }),
        want);
    EXPECT_EQ(
        Raw(authorization,
            [&](C* c) { return stub_->Lookup(c, lookup, &lookup_response); }),
        want);
    EXPECT_EQ(Raw(authorization,
                  [&](C* c) {
                    return stub_->RegisterNamespace(c, reg, &reg_response);
                  }),
              want);
    EXPECT_EQ(
        Raw(authorization,
            [&](C* c) { return stub_->BeginRead(c, read, &read_response); }),
        want);
    EXPECT_EQ(Raw(authorization,
                  [&](C* c) {
                    return stub_->CommitWrite(c, commit, &commit_response);
                  }),
              want);
    EXPECT_EQ(Raw(authorization,
                  [&](C* c) { return stub_->EndRead(c, end, &end_response); }),
              want);
    EXPECT_EQ(Raw(authorization,
                  [&](C* c) {
                    return stub_->DropNamespace(c, drop, &drop_response);
                  }),
              want);
  }
  // The client library's view of a wrong token.
  auto wrong = As("token-c");
  EXPECT_EQ(wrong->Stats().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong->Get("a/m", {Key(0)}).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(Stored(a.get(), "a/m", 0));  // nothing was touched
  ClientOptions spaced;
  spaced.target = target_;
  spaced.bearer_token = "two words";
  EXPECT_EQ(Client::Connect(spaced).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(TenantsTest, AnotherTenantsNamespaceIsPermissionDenied) {
  auto a = As("token-a");
  auto b = As("token-b");
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/m")).ok());
  ASSERT_TRUE(Put(a.get(), "a/m", 0, 2).ok());
  const auto denied = absl::StatusCode::kPermissionDenied;
  EXPECT_EQ(b->RegisterNamespace(Spec("a/m")).status().code(), denied);
  EXPECT_EQ(b->RegisterNamespace(Spec("c/m")).status().code(), denied);
  EXPECT_EQ(b->Lookup("a/m", {Key(0)}).status().code(), denied);
  EXPECT_EQ(b->Get("a/m", {Key(0)}).status().code(), denied);
  EXPECT_EQ(Put(b.get(), "a/m", 5, 1).code(), denied);
  EXPECT_EQ(b->Delete("a/m", {Key(0)}).status().code(), denied);
  EXPECT_EQ(b->DropNamespace("a/m").status().code(), denied);
  // Whether it exists does not show: a name that does not is refused alike.
  EXPECT_EQ(b->Lookup("a/none", {Key(0)}).status().code(), denied);
  EXPECT_EQ(a->Lookup("a/none", {Key(0)}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(Stored(a.get(), "a/m", 0));
  EXPECT_TRUE(Stored(a.get(), "a/m", 1));
  // The admin reaches every namespace.
  auto admin = As(kAdminToken);
  EXPECT_TRUE(Stored(admin.get(), "a/m", 1));
}

TEST_F(TenantsTest, AnotherTenantsLeaseAndPinAreRefusedAsForgedOnes) {
  auto a = As("token-a");
  auto b = As("token-b");
  auto reader = As("token-reader-a");
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/m")).ok());
  ASSERT_TRUE(b->RegisterNamespace(Spec("b/m")).ok());
  ASSERT_TRUE(Put(a.get(), "a/m", 0, 2).ok());
  ASSERT_TRUE(Put(b.get(), "b/m", 0, 2).ok());
  auto pin = a->Lookup("a/m", {Key(0), Key(1)}, /*pin=*/true);
  ASSERT_TRUE(pin.ok());
  ASSERT_NE(pin->pin_lease, 0u);
  const auto stale = absl::StatusCode::kFailedPrecondition;
  // Ending it, or taking it over, from another tenant: as a forged id.
  EXPECT_EQ(b->Release(pin->pin_lease).code(), stale);
  EXPECT_EQ(reader->Release(pin->pin_lease).code(), stale);
  ReadOptions take;
  take.pin_lease = pin->pin_lease;
  EXPECT_EQ(b->Get("b/m", {Key(0)}, take).status().code(), stale);
  EXPECT_EQ(reader->Get("a/m", {Key(0)}, take).status().code(), stale);
  // A reader of team-a's namespaces reads them, but not with team-a's pin.
  EXPECT_TRUE(reader->Get("a/m", {Key(0)}).ok());
  // Write leases: team-a's write id in team-b's CommitWrite and AbortWrite.
  v1::BeginWriteRequest begin;
  begin.set_namespace_name("a/m");
  begin.add_blocks()->set_key(Key(7));
  v1::BeginWriteResponse begun;
  const std::string bearer_a = "Bearer token-a", bearer_b = "Bearer token-b";
  ASSERT_EQ(Raw(bearer_a,
                [&](grpc::ClientContext* c) {
                  return stub_->BeginWrite(c, begin, &begun);
                }),
            grpc::StatusCode::OK);
  v1::CommitWriteRequest commit;
  commit.set_write_id(begun.write_id());
  v1::CommitWriteResponse committed;
  v1::AbortWriteRequest abort;
  abort.set_write_id(begun.write_id());
  v1::AbortWriteResponse aborted;
  grpc::Status foreign, forged;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", bearer_b);
    foreign = stub_->CommitWrite(&ctx, commit, &committed);
  }
  {
    v1::CommitWriteRequest made_up;
    made_up.set_write_id(begun.write_id() ^ 0x5555);
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", bearer_b);
    forged = stub_->CommitWrite(&ctx, made_up, &committed);
  }
  EXPECT_EQ(foreign.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(foreign.error_code(), forged.error_code());
  EXPECT_EQ(foreign.error_message(), forged.error_message());
  EXPECT_EQ(Raw(bearer_b,
                [&](grpc::ClientContext* c) {
                  return stub_->AbortWrite(c, abort, &aborted);
                }),
            grpc::StatusCode::FAILED_PRECONDITION);
  // Both leases are still team-a's to use.
  EXPECT_EQ(Raw(bearer_a,
                [&](grpc::ClientContext* c) {
                  return stub_->AbortWrite(c, abort, &aborted);
                }),
            grpc::StatusCode::OK);
  EXPECT_TRUE(a->Get("a/m", {Key(0), Key(1)}, take).ok());
}

TEST_F(TenantsTest, ACallOutsideTheRoleIsPermissionDenied) {
  auto a = As("token-a");
  auto reader = As("token-reader-a");
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/m")).ok());
  ASSERT_TRUE(Put(a.get(), "a/m", 0, 2).ok());
  EXPECT_TRUE(reader->Lookup("a/m", {Key(0)}).ok());
  EXPECT_TRUE(reader->Get("a/m", {Key(0), Key(1)}).ok());
  EXPECT_TRUE(reader->Stats().ok());
  const auto denied = absl::StatusCode::kPermissionDenied;
  EXPECT_EQ(reader->RegisterNamespace(Spec("a/n")).status().code(), denied);
  // What exists, with its spec, a reader may "register" (workers do).
  auto existing = reader->RegisterNamespace(Spec("a/m"));
  ASSERT_TRUE(existing.ok()) << existing.status();
  EXPECT_TRUE(existing->already_registered);
  EXPECT_EQ(Put(reader.get(), "a/m", 5, 1).code(), denied);
  EXPECT_EQ(reader->Delete("a/m", {Key(0)}).status().code(), denied);
  EXPECT_EQ(reader->DropNamespace("a/m").status().code(), denied);
  EXPECT_TRUE(Stored(a.get(), "a/m", 0));
}

TEST_F(TenantsTest, StatsShowATenantItsOwnNamespacesAndAnAdminAll) {
  auto a = As("token-a");
  auto b = As("token-b");
  auto admin = As(kAdminToken);
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/m")).ok());
  ASSERT_TRUE(b->RegisterNamespace(Spec("b/m")).ok());
  ASSERT_TRUE(Put(a.get(), "a/m", 0, 2).ok());
  auto mine = a->Stats();
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->namespaces.size(), 1u);
  EXPECT_TRUE(mine->namespaces.count("a/m") == 1);
  ASSERT_TRUE(mine->tenant.has_value());
  EXPECT_EQ(mine->tenant->name, "team-a");
  EXPECT_EQ(mine->tenant->namespaces, 1u);
  EXPECT_EQ(mine->tenant->max_namespaces, 2u);
  EXPECT_EQ(mine->tenant->pool_bytes_used, 2 * kBlockBytes);
  EXPECT_EQ(mine->tenant->pool_bytes_quota, 4 * kBlockBytes);
  auto theirs = b->Stats();
  ASSERT_TRUE(theirs.ok());
  EXPECT_EQ(theirs->namespaces.size(), 1u);
  EXPECT_TRUE(theirs->namespaces.count("b/m") == 1);
  auto all = admin->Stats();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->namespaces.size(), 2u);
  EXPECT_EQ(all->tenant->name, "admin");
}

TEST_F(TenantsTest, QuotasOfNamespacesAndPoolBytesAreKept) {
  auto a = As("token-a");
  auto b = As("token-b");
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/1")).ok());
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/2")).ok());
  EXPECT_EQ(a->RegisterNamespace(Spec("a/3")).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(a->RegisterNamespace(Spec("a/2")).ok());  // exists: fine
  ASSERT_TRUE(b->RegisterNamespace(Spec("b/m")).ok());
  // team-b (no share) fills the pool; team-a takes its share of 4 blocks
  // from team-b's.
  const int pool_blocks =
      static_cast<int>(a->Stats()->capacity_bytes / kBlockBytes);
  for (int i = 0; i < pool_blocks; ++i) {
    ASSERT_TRUE(Put(b.get(), "b/m", i, 1).ok()) << i;
  }
  ASSERT_TRUE(Put(a.get(), "a/1", 0, 4).ok());
  // team-b's writes cannot push team-a below its share.
  for (int i = pool_blocks; i < pool_blocks + 8; ++i) {
    ASSERT_TRUE(Put(b.get(), "b/m", i, 1).ok()) << i;
  }
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(Stored(a.get(), "a/1", i)) << i;
  // Over its share with the pool full, team-a may evict only its own
  // blocks: pinned, they cannot go, and its write is RESOURCE_EXHAUSTED.
  auto pin = a->Lookup("a/1", {Key(0), Key(1), Key(2), Key(3)}, true);
  ASSERT_TRUE(pin.ok());
  absl::Status over = Put(a.get(), "a/2", 10, 1);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  ASSERT_TRUE(a->Release(pin->pin_lease).ok());
  // Unpinned, its own blocks make room: the chain's tip first (eviction
  // is prefix aware).
  EXPECT_TRUE(Put(a.get(), "a/2", 10, 1).ok());
  EXPECT_FALSE(Stored(a.get(), "a/1", 3));
  EXPECT_TRUE(Stored(a.get(), "a/1", 0));
  EXPECT_LE(a->Stats()->tenant->pool_bytes_used, 4 * kBlockBytes);
}

TEST_F(TenantsTest, DropNamespaceFreesTheSpaceForItsOwnerOrAnAdmin) {
  auto a = As("token-a");
  auto b = As("token-b");
  auto admin = As(kAdminToken);
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/1")).ok());
  ASSERT_TRUE(a->RegisterNamespace(Spec("a/2")).ok());
  ASSERT_TRUE(b->RegisterNamespace(Spec("b/m")).ok());
  ASSERT_TRUE(Put(a.get(), "a/1", 0, 3).ok());
  ASSERT_TRUE(Put(b.get(), "b/m", 0, 2).ok());
  auto pin = a->Lookup("a/1", {Key(0)}, true);
  ASSERT_TRUE(pin.ok());
  const uint64_t used = admin->Stats()->used_bytes;
  auto dropped = a->DropNamespace("a/1");
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(*dropped, 3u);
  EXPECT_EQ(admin->Stats()->used_bytes, used - 3 * kBlockBytes);
  EXPECT_EQ(a->Release(pin->pin_lease).code(),
            absl::StatusCode::kFailedPrecondition);  // its leases ended
  EXPECT_EQ(a->Lookup("a/1", {Key(0)}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(a->DropNamespace("a/1").status().code(),
            absl::StatusCode::kNotFound);
  // Its quota counts it no more: a third namespace fits.
  EXPECT_TRUE(a->RegisterNamespace(Spec("a/3")).ok());
  // An admin drops anyone's.
  auto by_admin = admin->DropNamespace("b/m");
  ASSERT_TRUE(by_admin.ok()) << by_admin.status();
  EXPECT_EQ(*by_admin, 2u);
  EXPECT_EQ(admin->Stats()->used_bytes, 0u);
}

TEST_F(TenantsTest, TheFileIsReloadedWithoutARestart) {
  auto old_b = As("token-b");
  ASSERT_TRUE(old_b->RegisterNamespace(Spec("b/m")).ok());
  ASSERT_TRUE(Put(old_b.get(), "b/m", 0, 1).ok());
  // Rotate team-b's token and add team-c.
  file_.Write(
      absl::StrCat(Tenants("token-b2"),
                   TenantEntry("team-c", "token-c", "c/", "ROLE_WRITE")));
  auto new_b = As("token-b2");
  auto c = As("token-c");
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (absl::Now() < give_up && !new_b->Stats().ok()) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(new_b->Stats().ok()) << "the new file was not loaded";
  EXPECT_EQ(old_b->Stats().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(Stored(new_b.get(), "b/m", 0));  // same tenant, same data
  EXPECT_TRUE(c->RegisterNamespace(Spec("c/m")).ok());
  // A broken file keeps the last good one serving.
  file_.Write("tenants { name: \"broken\" ");
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(new_b->Stats().ok());
  EXPECT_TRUE(c->Stats().ok());
  // Removed from the file: refused from the next reload on.
  file_.Write(Tenants("token-b2"));
  const absl::Time removed_by = absl::Now() + absl::Seconds(10);
  while (absl::Now() < removed_by && c->Stats().ok()) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(c->Stats().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(new_b->Stats().ok());
}

// The requests' tenant label takes names from the file only: a caller
// cannot make up a series.
TEST_F(TenantsTest, RequestMetricsCarryTheTenantFromTheFile) {
  auto a = As("token-a");
  ASSERT_TRUE(a->Stats().ok());
  EXPECT_FALSE(As("made-up-tenant")->Stats().ok());
  EXPECT_EQ(a->Lookup("b/m", {Key(0)}).status().code(),
            absl::StatusCode::kPermissionDenied);
  const std::string metrics = node_->metrics()->Render();
  for (const char* series :
       {"kvcache_requests_total{code=\"OK\",op=\"stats\",tenant=\"team-a\"} 1",
        "kvcache_requests_total{code=\"UNAUTHENTICATED\",op=\"stats\","
        "tenant=\"unauthenticated\"} 1",
        "kvcache_requests_total{code=\"PERMISSION_DENIED\",op=\"lookup\","
        "tenant=\"team-a\"} 1"}) {
    EXPECT_NE(metrics.find(series), std::string::npos) << series;
  }
  EXPECT_EQ(metrics.find("made-up"), std::string::npos);
}

TEST(OpenNodeTest, WithoutTenantsEveryCallerMayDoEverything) {
  service::NodeOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.memory = {store::MemoryKind::kHost, 0, 4 << 20};
  options.store.page_size = 4096;
  options.worker_threads = 1;
  service::Node node(options);
  ASSERT_TRUE(node.Start().ok());
  EXPECT_EQ(node.tenants(), nullptr);
  ClientOptions copts;
  copts.target = absl::StrCat("127.0.0.1:", node.port());
  copts.bearer_token = "ignored-by-an-open-node";
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok());
  NamespaceSpec spec;
  spec.name = "any/name";
  spec.shape = SmallShape();
  spec.policy = CodecPolicy{};
  ASSERT_TRUE((*client)->RegisterNamespace(spec).ok());
  auto stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_FALSE(stats->tenant.has_value());
  EXPECT_TRUE((*client)->DropNamespace("any/name").ok());
}

}  // namespace
}  // namespace kvcache
