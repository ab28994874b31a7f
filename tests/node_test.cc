// Integration tests: a node on loopback (port 0) driven through the client
// library and, for malformed messages the client cannot produce, the raw
// gRPC stub.
#include "service/node.h"

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvcache/client.h"
#include "kvcache/testing/reflection_list.pb.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "tests/http_get.h"
#include "tests/test_util.h"

namespace kvcache {
namespace {

using kvcache::testing::Key;
using kvcache::testing::RandomBlock;
using kvcache::testing::SmallShape;

class NodeTest : public ::testing::Test {
 protected:
  void SetUp() override { StartNode(64 << 20); }

  void StartNode(uint64_t memory_bytes) {
    service::NodeOptions options;
    options.listen = "127.0.0.1:0";
    options.health_listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    options.memory = {store::MemoryKind::kHost, 0, memory_bytes};
    options.store.page_size = 4096;
    options.store.max_blocks_per_request = 64;
    options.max_request_bytes = 1 << 20;
    options.drain_timeout = absl::Seconds(5);
    options.worker_threads = 2;
    node_ = std::make_unique<service::Node>(options);
    ASSERT_TRUE(node_->Start().ok());
    ClientOptions copts;
    copts.target = absl::StrCat("127.0.0.1:", node_->port());
    copts.timeout = absl::Seconds(10);
    copts.max_message_bytes = 1 << 20;
    auto client = Client::Connect(copts);
    ASSERT_TRUE(client.ok());
    client_ = *std::move(client);
    channel_ =
        grpc::CreateChannel(copts.target, grpc::InsecureChannelCredentials());
    stub_ = v1::KvCache::NewStub(channel_);
  }

  // KIVI's residual window is off unless asked for, so that every block
  // is stored with the namespace codec at once.
  NamespaceSpec Spec(const std::string& name, Codec codec,
                     uint32_t residual_tokens = 0) {
    NamespaceSpec spec;
    spec.name = name;
    spec.model = "test";
    spec.shape = SmallShape();
    CodecPolicy policy;
    policy.codec = codec;
    spec.policy = policy;
    spec.residual_tokens = residual_tokens;
    return spec;
  }

  // Puts blocks [first, first+n) as a chain; keeps their data alive.
  absl::StatusOr<PutResult> PutChain(const std::string& ns, int first, int n) {
    std::vector<BlockWrite> writes;
    for (int i = first; i < first + n; ++i) {
      data_[i] = RandomBlock(SmallShape(), i);
      writes.push_back({Key(i), "", data_[i]});
    }
    return client_->Put(ns, writes);
  }

  std::vector<std::string> Keys(int first, int n) {
    std::vector<std::string> k;
    for (int i = first; i < first + n; ++i) k.push_back(Key(i));
    return k;
  }

  // True when blocks [first, first+n) read back exactly (codec none).
  void ExpectIntact(const std::string& ns, int first, int n) {
    auto got = client_->Get(ns, Keys(first, n));
    ASSERT_TRUE(got.ok()) << got.status();
    for (int i = 0; i < n; ++i) {
      std::vector<uint16_t> want = RandomBlock(SmallShape(), first + i);
      ASSERT_EQ(got->blocks[i].bytes.size(), want.size() * 2);
      EXPECT_EQ(std::memcmp(got->blocks[i].bytes.data(), want.data(),
                            want.size() * 2),
                0);
    }
  }

  grpc::Status RawCall(
      const std::function<grpc::Status(grpc::ClientContext*)>& call) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    return call(&ctx);
  }

  std::unique_ptr<service::Node> node_;
  std::unique_ptr<Client> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::map<int, std::vector<uint16_t>> data_;
};

TEST_F(NodeTest, PutLookupGetAcrossCodecsAndFormats) {
  for (Codec codec : kernels::kAllCodecs) {
    std::string ns = absl::StrCat("ns-", kernels::CodecName(codec));
    auto info = client_->RegisterNamespace(Spec(ns, codec));
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->codec, codec);
    auto put = PutChain(ns, 0, 4);
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->stored, 4u);
    auto again = PutChain(ns, 0, 5);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->stored, 1u);
    EXPECT_EQ(again->skipped, 4u);

    std::vector<std::string> keys = Keys(0, 5);
    keys.push_back(Key(99));
    keys.push_back(Key(3));  // after a miss: not part of the prefix
    auto hit = client_->Lookup(ns, keys);
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->prefix_blocks, 5u);

    auto fp16 = client_->Get(ns, Keys(0, 5), ReadFormat::kFp16);
    auto raw = client_->Get(ns, Keys(0, 5), ReadFormat::kRaw);
    ASSERT_TRUE(fp16.ok() && raw.ok());
    for (int i = 0; i < 5; ++i) {
      std::vector<uint16_t> decoded(data_[i].size());
      ASSERT_TRUE(
          DecodeRaw(*raw, raw->blocks[i], absl::MakeSpan(decoded)).ok());
      ASSERT_EQ(fp16->blocks[i].bytes.size(), decoded.size() * 2);
      EXPECT_EQ(std::memcmp(fp16->blocks[i].bytes.data(), decoded.data(),
                            decoded.size() * 2),
                0)
          << "client-side decode of raw equals node-side fp16, " << ns;
      if (codec == Codec::kNone) {
        EXPECT_EQ(decoded, data_[i]);
      }
    }
  }
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  for (Codec codec : kernels::kAllCodecs) {
    EXPECT_EQ(stats->codecs[std::string(kernels::CodecName(codec))].blocks, 5u);
  }
  EXPECT_EQ(stats->namespaces.size(), 5u);
}

TEST_F(NodeTest, KiviResidualWindowReencodesInTheBackground) {
  // 64 tokens of window = the 2 newest blocks of a chain stay fp16.
  ASSERT_TRUE(client_->RegisterNamespace(Spec("kivi", Codec::kKivi4, 64)).ok());
  ASSERT_TRUE(PutChain("kivi", 0, 5).ok());
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<NodeStats> stats;
  do {
    absl::SleepFor(absl::Milliseconds(50));
    stats = client_->Stats();
    ASSERT_TRUE(stats.ok());
  } while (stats->codecs["kivi4"].blocks < 3 && absl::Now() < deadline);
  EXPECT_EQ(stats->codecs["kivi4"].blocks, 3u);
  EXPECT_EQ(stats->codecs["none"].blocks, 2u);
  auto raw = client_->Get("kivi", Keys(0, 5), ReadFormat::kRaw);
  auto fp16 = client_->Get("kivi", Keys(0, 5), ReadFormat::kFp16);
  ASSERT_TRUE(raw.ok() && fp16.ok());
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(raw->blocks[i].codec, i < 3 ? Codec::kKivi4 : Codec::kNone);
    std::vector<uint16_t> decoded(data_[i].size());
    ASSERT_TRUE(DecodeRaw(*raw, raw->blocks[i], absl::MakeSpan(decoded)).ok());
    EXPECT_EQ(std::memcmp(fp16->blocks[i].bytes.data(), decoded.data(),
                          decoded.size() * 2),
              0);
    if (i >= 3) {
      EXPECT_EQ(decoded, data_[i]) << "fp16 in the window";
    }
  }
}

TEST_F(NodeTest, LookupPinIsTakenOverByGet) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kNone)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 3).ok());
  auto pin = client_->Lookup("ns", Keys(0, 3), /*pin=*/true);
  ASSERT_TRUE(pin.ok());
  ASSERT_NE(pin->pin_lease, 0u);
  EXPECT_GT(node_->store()->Stats().pinned_bytes, 0u);
  ASSERT_TRUE(
      client_->Get("ns", Keys(0, 3), ReadFormat::kFp16, pin->pin_lease).ok());
  EXPECT_EQ(node_->store()->Stats().pinned_bytes, 0u);
  EXPECT_EQ(client_->Release(pin->pin_lease).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(NodeTest, BadInputGetsExactCodesAndLosesNothing) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kNone)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 3).ok());

  // Unknown namespace.
  EXPECT_EQ(client_->Lookup("nope", Keys(0, 1)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Get("nope", Keys(0, 1)).status().code(),
            absl::StatusCode::kNotFound);
  // A miss.
  EXPECT_EQ(client_->Get("ns", Keys(50, 1)).status().code(),
            absl::StatusCode::kNotFound);
  // Layout mismatch: the same name with another layout.
  NamespaceSpec other = Spec("ns", Codec::kNone);
  other.shape.head_dim = 64;
  EXPECT_EQ(client_->RegisterNamespace(other).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Wrong byte count.
  std::vector<uint16_t> short_block(100);
  BlockWrite bad{Key(10), "", short_block};
  EXPECT_EQ(client_->Put("ns", {&bad, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Non-finite values, in a namespace that quantizes.
  ASSERT_TRUE(client_->RegisterNamespace(Spec("fp8", Codec::kFp8E4M3)).ok());
  std::vector<uint16_t> inf_block = RandomBlock(SmallShape(), 7);
  inf_block[1234] = 0x7C00;  // +inf
  BlockWrite inf{Key(11), "", inf_block};
  absl::Status inf_status = client_->Put("fp8", {&inf, 1}).status();
  EXPECT_EQ(inf_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(inf_status.message().find("layer"), std::string::npos)
      << inf_status;
  // Unknown codec (only a raw message can carry one).
  v1::RegisterNamespaceRequest reg;
  reg.mutable_spec()->set_name("weird");
  reg.mutable_spec()->mutable_layout()->set_num_layers(1);
  reg.mutable_spec()->mutable_layout()->set_num_kv_heads(1);
  reg.mutable_spec()->mutable_layout()->set_head_dim(32);
  reg.mutable_spec()->mutable_layout()->set_tokens_per_block(32);
  reg.mutable_spec()->mutable_codec_policy()->set_codec(
      static_cast<v1::Codec>(99));
  v1::RegisterNamespaceResponse reg_response;
  EXPECT_EQ(RawCall([&](grpc::ClientContext* ctx) {
              return stub_->RegisterNamespace(ctx, reg, &reg_response);
            }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Oversized request: more than the node's 1 MiB message limit.
  v1::CommitWriteRequest huge;
  huge.add_payloads()->set_fp16(std::string(2 << 20, 'x'));
  v1::CommitWriteResponse huge_response;
  EXPECT_EQ(RawCall([&](grpc::ClientContext* ctx) {
              return stub_->CommitWrite(ctx, huge, &huge_response);
            }).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Too many keys in one request.
  EXPECT_EQ(
      client_->Lookup("ns", std::vector<std::string>(65, "k")).status().code(),
      absl::StatusCode::kInvalidArgument);
  // Empty and oversized keys.
  EXPECT_EQ(client_->Lookup("ns", {""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Lookup("ns", {std::string(65, 'k')}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Stale lease.
  v1::CommitWriteRequest stale;
  stale.set_write_id(12345);
  v1::CommitWriteResponse stale_response;
  EXPECT_EQ(RawCall([&](grpc::ClientContext* ctx) {
              return stub_->CommitWrite(ctx, stale, &stale_response);
            }).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // Nothing was lost, nothing half-written became visible, and a valid
  // request still succeeds.
  ExpectIntact("ns", 0, 3);
  EXPECT_EQ(client_->Lookup("ns", Keys(10, 1))->prefix_blocks, 0u);
  EXPECT_EQ(client_->Lookup("fp8", Keys(11, 1))->prefix_blocks, 0u);
  ASSERT_TRUE(PutChain("ns", 3, 1).ok());
  ExpectIntact("ns", 0, 4);
  auto stats = client_->Stats();
  EXPECT_EQ(stats->reserved_bytes, 0u);
}

TEST_F(NodeTest, FullPoolIsResourceExhaustedWithARetryHint) {
  node_.reset();
  StartNode(8 * 4 * 4096 + 8192);  // room for a few fp16 blocks
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kNone)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 2).ok());
  auto pin = client_->Lookup("ns", Keys(0, 2), true);
  ASSERT_TRUE(pin.ok());
  // Everything stored is pinned: a write that needs more room must wait.
  absl::Status full = PutChain("ns", 10, 7).status();
  ASSERT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  ASSERT_TRUE(RetryAfterMs(full).has_value());
  EXPECT_GT(*RetryAfterMs(full), 0);
  ASSERT_TRUE(client_->Release(pin->pin_lease).ok());
  EXPECT_TRUE(PutChain("ns", 10, 7).ok());
}

TEST_F(NodeTest, HealthAndReflectionAreServed) {
  for (int port : {node_->port(), node_->health_port()}) {
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                       grpc::InsecureChannelCredentials());
    auto health = grpc::health::v1::Health::NewStub(channel);
    for (const char* service : {"", "kvcache.v1.KvCache"}) {
      grpc::health::v1::HealthCheckRequest request;
      request.set_service(service);
      grpc::health::v1::HealthCheckResponse response;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(5));
      ASSERT_TRUE(health->Check(&ctx, request, &response).ok());
      EXPECT_EQ(response.status(),
                grpc::health::v1::HealthCheckResponse::SERVING);
    }
  }
  using kvcache::testing::ServerReflectionRequest;
  using kvcache::testing::ServerReflectionResponse;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING, channel_);
  std::unique_ptr<grpc::ClientReaderWriter<ServerReflectionRequest,
                                           ServerReflectionResponse>>
      stream(grpc::internal::ClientReaderWriterFactory<
             ServerReflectionRequest,
             ServerReflectionResponse>::Create(channel_.get(), method, &ctx));
  ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> names;
  for (const auto& s : response.list_services_response().service()) {
    names.push_back(s.name());
  }
  EXPECT_NE(std::find(names.begin(), names.end(), "kvcache.v1.KvCache"),
            names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "grpc.health.v1.Health"),
            names.end());
  while (stream->Read(&response)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(NodeTest, MetricsExposeCapacityRequestsAndCodecs) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kFp8E4M3)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 2).ok());
  ASSERT_TRUE(client_->Lookup("ns", Keys(0, 3)).ok());
  ASSERT_TRUE(client_->Get("ns", Keys(0, 2)).ok());
  auto body = kvcache::testing::HttpGet(node_->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  for (const char* needle : {
           "kvcache_requests_total{code=\"OK\",op=\"commit_write\"} 1",
           "kvcache_request_duration_seconds_bucket",
           "kvcache_lookup_blocks_total{result=\"hit\"} 2",
           "kvcache_lookup_blocks_total{result=\"miss\"} 1",
           "kvcache_pool_capacity_bytes",
           "kvcache_pool_used_ratio",
           "kvcache_blocks{codec=\"fp8_e4m3\"} 2",
           "kvcache_stored_tokens{codec=\"fp8_e4m3\"} 64",
           "kvcache_token_capacity_remaining{codec=\"kivi2\",namespace=\"ns\"}",
           "kvcache_evictions_total{reason=\"capacity\"} 0",
           "kvcache_transfer_bytes_total{direction=\"in\",transport=\"grpc\"}",
           "kvcache_quantize_duration_seconds_count{codec=\"fp8_e4m3\"} 2",
           "kvcache_active_leases{kind=\"read\"} 0",
           "kvcache_build_info{",
           "kvcache_ready 1",
       }) {
    EXPECT_NE(body->find(needle), std::string::npos) << needle;
  }
}

TEST_F(NodeTest, DrainFinishesAndThenRefuses) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kNone)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 1).ok());
  node_->Drain();
  auto after = client_->Lookup("ns", Keys(0, 1));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable)
      << after.status();
}

}  // namespace
}  // namespace kvcache
