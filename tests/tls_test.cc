// TLS and mTLS on the node's control plane, with certificates made at test
// time (tests/test_pki.h): who can connect, what the health port still
// serves in plaintext, and a certificate rotated in place without a restart.
#include "service/tls.h"

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvcache/client.h"
#include "kvcache/cluster_client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/node.h"
#include "tests/test_pki.h"
#include "tests/test_tenants.h"

namespace kvcache {
namespace {

using kvcache::testing::PemPair;
using kvcache::testing::TestPki;

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ca = pki_.MakeCa("ca");
    ASSERT_TRUE(ca.ok()) << ca.status();
    ca_ = *ca;
    auto server = pki_.Issue(ca_, "server", "DNS:localhost,IP:127.0.0.1");
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *server;
  }

  void StartNode(const std::string& client_ca = "") {
    service::NodeOptions options;
    options.listen = "127.0.0.1:0";
    options.health_listen = "127.0.0.1:0";
    options.metrics_listen = "";
    options.memory = {store::MemoryKind::kHost, 0, 16 << 20};
    options.store.page_size = 4096;
    options.worker_threads = 1;
    options.drain_timeout = absl::Seconds(2);
    options.tls.cert_file = server_.cert;
    options.tls.key_file = server_.key;
    options.tls.client_ca_file = client_ca;
    options.tls.refresh_interval = absl::Seconds(1);
    options.tenants_file = tenants_file_;
    node_ = std::make_unique<service::Node>(options);
    absl::Status started = node_->Start();
    ASSERT_TRUE(started.ok()) << started;
  }

  // A Stats call on a fresh channel (so a new handshake) with `creds`.
  grpc::Status Stats(std::shared_ptr<grpc::ChannelCredentials> creds,
                     int port = 0) {
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    auto channel = grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", port ? port : node_->port()), creds, args);
    auto stub = v1::KvCache::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    v1::StatsRequest request;
    v1::StatsResponse response;
    return stub->Stats(&ctx, request, &response);
  }

  std::shared_ptr<grpc::ChannelCredentials> Tls(
      const PemPair& trusted_ca, const PemPair* client = nullptr) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = TestPki::ReadFile(trusted_ca.cert);
    if (client != nullptr) {
      ssl.pem_private_key = TestPki::ReadFile(client->key);
      ssl.pem_cert_chain = TestPki::ReadFile(client->cert);
    }
    return grpc::SslCredentials(ssl);
  }

  TestPki pki_;
  PemPair ca_, server_;
  std::string tenants_file_;  // empty: the node runs open
  std::unique_ptr<service::Node> node_;
};

TEST_F(TlsTest, ServesTlsClientsAndRefusesPlaintextAndUntrustedOnes) {
  StartNode();
  EXPECT_TRUE(Stats(Tls(ca_)).ok());
  EXPECT_EQ(Stats(grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  auto other = pki_.MakeCa("other-ca");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(Stats(Tls(*other)).error_code(), grpc::StatusCode::UNAVAILABLE)
      << "a client that does not trust the node's CA must not connect";
}

TEST_F(TlsTest, MtlsRequiresAClientCertificateFromTheClientCa) {
  auto client_ca = pki_.MakeCa("client-ca");
  ASSERT_TRUE(client_ca.ok()) << client_ca.status();
  auto client =
      pki_.Issue(*client_ca, "tenant-a", "URI:spiffe://kvcache/tenant-a");
  ASSERT_TRUE(client.ok()) << client.status();
  auto stranger = pki_.Issue(ca_, "stranger", "URI:spiffe://kvcache/stranger");
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  StartNode(client_ca->cert);
  EXPECT_TRUE(Stats(Tls(ca_, &*client)).ok());
  EXPECT_EQ(Stats(Tls(ca_)).error_code(), grpc::StatusCode::UNAVAILABLE)
      << "no client certificate";
  EXPECT_EQ(Stats(Tls(ca_, &*stranger)).error_code(),
            grpc::StatusCode::UNAVAILABLE)
      << "a client certificate from another CA";
}

// Probes stay plaintext: the health port answers grpc.health.v1 without TLS
// and serves nothing else.
TEST_F(TlsTest, TheHealthPortIsPlaintextAndServesOnlyHealth) {
  StartNode();
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", node_->health_port()),
                          grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(health->Check(&ctx, request, &response).ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Stats(grpc::InsecureChannelCredentials(), node_->health_port())
                .error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

// cert-manager rewrites the files in place: new connections get the new
// certificate within the refresh interval, and the node never restarts.
TEST_F(TlsTest, ARotatedCertificateIsServedWithoutARestart) {
  StartNode();
  auto next_ca = pki_.MakeCa("next-ca");
  ASSERT_TRUE(next_ca.ok()) << next_ca.status();
  auto next = pki_.Issue(*next_ca, "next", "DNS:localhost,IP:127.0.0.1");
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(Stats(Tls(ca_)).ok());
  ASSERT_FALSE(Stats(Tls(*next_ca)).ok());
  // Replace both files (each by rename, as a writer should).
  for (const auto& [from, to] : {std::pair{next->cert, server_.cert},
                                 std::pair{next->key, server_.key}}) {
    std::filesystem::copy_file(
        from, to + ".new", std::filesystem::copy_options::overwrite_existing);
    std::filesystem::rename(to + ".new", to);
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  bool rotated = false;
  while (!rotated && absl::Now() < give_up) {
    rotated = Stats(Tls(*next_ca)).ok();
    if (!rotated) absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(rotated) << "the node did not serve the rotated certificate";
  EXPECT_FALSE(Stats(Tls(ca_)).ok()) << "the old certificate is still served";
}

// The client library speaks TLS and mTLS: kvcache::Client and the cluster
// client with TlsOptions, and a plaintext client is refused.
TEST_F(TlsTest, TheClientLibrarySpeaksTlsAndMtls) {
  auto client_ca = pki_.MakeCa("client-ca");
  ASSERT_TRUE(client_ca.ok()) << client_ca.status();
  auto me = pki_.Issue(*client_ca, "worker", "URI:spiffe://kvcache/worker");
  ASSERT_TRUE(me.ok()) << me.status();
  StartNode(client_ca->cert);
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", node_->port());
  options.tls.ca_file = ca_.cert;
  options.tls.cert_file = me->cert;
  options.tls.key_file = me->key;
  options.tls.server_name = "localhost";
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  NamespaceSpec spec;
  spec.name = "tls";
  spec.shape = {2, 1, 32, 16};
  spec.policy = CodecPolicy{};
  EXPECT_TRUE((*client)->RegisterNamespace(spec).ok());
  EXPECT_TRUE((*client)->Stats().ok());

  ClusterOptions cluster;
  cluster.nodes = {options.target};
  cluster.tls = options.tls;
  auto cc = ClusterClient::Create(cluster);
  ASSERT_TRUE(cc.ok()) << cc.status();
  EXPECT_TRUE((*cc)->RegisterNamespace(spec).ok());

  ClientOptions plain;
  plain.target = options.target;
  plain.timeout = absl::Seconds(3);
  auto plaintext = Client::Connect(plain);
  ASSERT_TRUE(plaintext.ok());
  EXPECT_EQ((*plaintext)->Stats().status().code(),
            absl::StatusCode::kUnavailable);
  ClientOptions no_cert = options;
  no_cert.tls.cert_file.clear();
  no_cert.tls.key_file.clear();
  no_cert.timeout = absl::Seconds(3);
  auto anonymous = Client::Connect(no_cert);
  ASSERT_TRUE(anonymous.ok());
  EXPECT_EQ((*anonymous)->Stats().status().code(),
            absl::StatusCode::kUnavailable);
  ClientOptions missing = options;
  missing.tls.ca_file = "/nonexistent/ca.pem";
  EXPECT_EQ(Client::Connect(missing).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// With tenants, a client certificate's identity (a URI SAN) is a tenant's
// credential: no token needed; a certificate that names no tenant, or a
// wrong token with a good certificate, is UNAUTHENTICATED.
TEST_F(TlsTest, AClientCertificateIdentityIsATenantsCredential) {
  auto client_ca = pki_.MakeCa("client-ca");
  ASSERT_TRUE(client_ca.ok()) << client_ca.status();
  auto worker = pki_.Issue(*client_ca, "worker", "URI:spiffe://kvcache/m");
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto other = pki_.Issue(*client_ca, "other", "URI:spiffe://kvcache/other");
  ASSERT_TRUE(other.ok()) << other.status();
  kvcache::testing::TestTenantsFile tenants;
  tenants.Write(
      "tenants { name: \"m\" identities: \"spiffe://kvcache/m\" "
      "namespace_prefixes: \"m/\" role: ROLE_WRITE }\n");
  tenants_file_ = tenants.path();
  StartNode(client_ca->cert);
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", node_->port());
  options.timeout = absl::Seconds(5);
  options.tls.ca_file = ca_.cert;
  options.tls.cert_file = worker->cert;
  options.tls.key_file = worker->key;
  options.tls.server_name = "localhost";
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  NamespaceSpec spec;
  spec.name = "m/tls";
  spec.shape = {2, 1, 32, 16};
  spec.policy = CodecPolicy{};
  EXPECT_TRUE((*client)->RegisterNamespace(spec).ok());
  auto stats = (*client)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_TRUE(stats->tenant.has_value());
  EXPECT_EQ(stats->tenant->name, "m");
  spec.name = "x/tls";
  EXPECT_EQ((*client)->RegisterNamespace(spec).status().code(),
            absl::StatusCode::kPermissionDenied);

  ClientOptions stranger = options;
  stranger.tls.cert_file = other->cert;
  stranger.tls.key_file = other->key;
  auto unknown = Client::Connect(stranger);
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ((*unknown)->Stats().status().code(),
            absl::StatusCode::kUnauthenticated);
  ClientOptions wrong_token = options;
  wrong_token.bearer_token = "not-a-tenants-token";
  auto wrong = Client::Connect(wrong_token);
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ((*wrong)->Stats().status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(TlsOptionsTest, MissingOrHalfGivenFilesAreRefusedNamingTheFlag) {
  service::TlsOptions only_cert;
  only_cert.cert_file = "/etc/hostname";
  EXPECT_EQ(service::ServerCredentials(only_cert).status().code(),
            absl::StatusCode::kInvalidArgument);
  service::TlsOptions missing;
  missing.cert_file = "/nonexistent/cert.pem";
  missing.key_file = "/nonexistent/key.pem";
  absl::Status s = service::ServerCredentials(missing).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--tls-cert"), std::string::npos) << s;
  service::TlsOptions ca_alone;
  ca_alone.client_ca_file = "/etc/hostname";
  EXPECT_EQ(service::ServerCredentials(ca_alone).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(service::ServerCredentials(service::TlsOptions{}).ok());
}

}  // namespace
}  // namespace kvcache
