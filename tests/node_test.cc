// Integration tests: a node on loopback (port 0) driven through the client
// library and, for malformed messages the client cannot produce, the raw
// gRPC stub. Each NodeTest runs twice: on an open node, and on a node with
// tenants, as their admin (tests/tenants_test.cc has the tenants' own).
#include "service/node.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/notification.h"
#include "client/cleanup_calls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/half.h"
#include "kernels/legal_states.h"
#include "kvcache/client.h"
#include "kvcache/testing/reflection_list.pb.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "tests/black_hole.h"
#include "tests/http_get.h"
#include "tests/test_tenants.h"
#include "tests/test_util.h"

namespace kvcache {
namespace {

using kvcache::testing::Key;
using kvcache::testing::RandomBlock;
using kvcache::testing::SmallShape;

// The parameter: whether the node runs with tenants.
class NodeTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam()) tenants_.Write(kvcache::testing::AdminTenants());
    StartNode(64 << 20);
  }

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
    if (GetParam()) options.tenants_file = tenants_.path();
    node_ = std::make_unique<service::Node>(options);
    ASSERT_TRUE(node_->Start().ok());
    ClientOptions copts;
    copts.target = absl::StrCat("127.0.0.1:", node_->port());
    copts.timeout = absl::Seconds(10);
    copts.max_message_bytes = 1 << 20;
    if (GetParam()) copts.bearer_token = kvcache::testing::kAdminToken;
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
    if (GetParam()) {
      ctx.AddMetadata("authorization",
                      absl::StrCat("Bearer ", kvcache::testing::kAdminToken));
    }
    return call(&ctx);
  }

  kvcache::testing::TestTenantsFile tenants_;
  std::unique_ptr<service::Node> node_;
  std::unique_ptr<Client> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::map<int, std::vector<uint16_t>> data_;
};

TEST_P(NodeTest, PutLookupGetAcrossCodecsAndFormats) {
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

// A bf16 namespace stores bf16 values and returns bf16: for every codec, a
// read in the source format is exactly one of its legal states computed
// here from the bf16 bits written, and the client's decode of the raw
// encoding equals the node's. The dtype is part of the layout: the same
// name with fp16 is another layout.
TEST_P(NodeTest, Bf16NamespacesStoreAndReturnBf16) {
  kernels::BlockShape shape = SmallShape();
  shape.source_dtype = kernels::SourceDtype::kBf16;
  std::vector<uint16_t> written(kvcache::testing::HalvesPerBlock(shape));
  for (Codec codec : kernels::kAllCodecs) {
    std::string ns = absl::StrCat("bf16-", kernels::CodecName(codec));
    NamespaceSpec spec = Spec(ns, codec, /*residual_tokens=*/0);
    spec.shape = shape;
    auto info = client_->RegisterNamespace(spec);
    ASSERT_TRUE(info.ok()) << ns << ": " << info.status();
    std::vector<std::vector<uint16_t>> blocks;
    std::vector<BlockWrite> writes;
    for (int i = 0; i < 3; ++i) {
      std::vector<uint16_t> fp16 = RandomBlock(shape, 100 + i);
      std::vector<uint16_t> bf16(fp16.size());
      for (size_t e = 0; e < fp16.size(); ++e) {
        bf16[e] = kernels::Bf16FromFloat(4.0f * kernels::HalfToFloat(fp16[e]));
      }
      blocks.push_back(std::move(bf16));
    }
    for (int i = 0; i < 3; ++i) writes.push_back({Key(i), "", blocks[i]});
    auto put = client_->Put(ns, writes);
    ASSERT_TRUE(put.ok()) << ns << ": " << put.status();
    EXPECT_EQ(put->stored, 3u);
    auto read = client_->Get(ns, Keys(0, 3), ReadFormat::kFp16);
    auto raw = client_->Get(ns, Keys(0, 3), ReadFormat::kRaw);
    ASSERT_TRUE(read.ok() && raw.ok()) << read.status() << raw.status();
    EXPECT_EQ(read->shape.source_dtype, kernels::SourceDtype::kBf16);
    for (int i = 0; i < 3; ++i) {
      auto legal = kernels::LegalStates::Make(shape, *spec.policy, blocks[i]);
      ASSERT_TRUE(legal.ok()) << legal.status();
      const std::string& bytes = read->blocks[i].bytes;
      ASSERT_EQ(bytes.size(), written.size() * 2);
      std::memcpy(written.data(), bytes.data(), bytes.size());
      auto state = legal->Match(written);
      EXPECT_TRUE(state.ok()) << ns << " block " << i << ": " << state.status();
      if (codec == Codec::kNone) {
        EXPECT_EQ(written, blocks[i]);
      }
      std::vector<uint16_t> decoded(written.size());
      ASSERT_TRUE(
          DecodeRaw(*raw, raw->blocks[i], absl::MakeSpan(decoded)).ok());
      EXPECT_EQ(decoded, written) << ns << ": client decode == node decode";
    }
    NamespaceSpec as_fp16 = spec;
    as_fp16.shape.source_dtype = kernels::SourceDtype::kFp16;
    EXPECT_EQ(client_->RegisterNamespace(as_fp16).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  // KIVI's residual window: blocks pushed out are re-encoded from their
  // bf16 bits (a round trip of bf16, not of the bits read as fp16).
  NamespaceSpec window = Spec("bf16-window", Codec::kKivi2, 64);
  window.shape = shape;
  ASSERT_TRUE(client_->RegisterNamespace(window).ok());
  std::vector<std::vector<uint16_t>> chain;
  std::vector<BlockWrite> writes;
  for (int i = 0; i < 5; ++i) {
    std::vector<uint16_t> fp16 = RandomBlock(shape, 200 + i);
    std::vector<uint16_t> bf16(fp16.size());
    for (size_t e = 0; e < fp16.size(); ++e) {
      bf16[e] = kernels::Bf16FromFloat(kernels::HalfToFloat(fp16[e]));
    }
    chain.push_back(std::move(bf16));
  }
  for (int i = 0; i < 5; ++i) writes.push_back({Key(i), "", chain[i]});
  ASSERT_TRUE(client_->Put("bf16-window", writes).ok());
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<NodeStats> stats;
  do {
    absl::SleepFor(absl::Milliseconds(50));
    stats = client_->Stats();
    ASSERT_TRUE(stats.ok());
  } while (stats->namespaces["bf16-window"].residual_blocks > 2 &&
           absl::Now() < deadline);
  auto read = client_->Get("bf16-window", Keys(0, 5), ReadFormat::kFp16);
  ASSERT_TRUE(read.ok()) << read.status();
  for (int i = 0; i < 5; ++i) {
    auto legal = kernels::LegalStates::Make(shape, *window.policy, chain[i]);
    ASSERT_TRUE(legal.ok());
    std::memcpy(written.data(), read->blocks[i].bytes.data(),
                written.size() * 2);
    auto state = legal->Match(written);
    ASSERT_TRUE(state.ok()) << "window block " << i << ": " << state.status();
    EXPECT_EQ(*state, i < 3 ? kernels::BlockState::kRoundTrip
                            : kernels::BlockState::kSource)
        << "window block " << i;
  }
}

TEST_P(NodeTest, KiviResidualWindowReencodesInTheBackground) {
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

TEST_P(NodeTest, LookupPinIsTakenOverByGet) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kNone)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 3).ok());
  auto pin = client_->Lookup("ns", Keys(0, 3), /*pin=*/true);
  ASSERT_TRUE(pin.ok());
  ASSERT_NE(pin->pin_lease, 0u);
  EXPECT_GT(node_->store()->Stats().pinned_bytes, 0u);
  ASSERT_TRUE(
      client_->Get("ns", Keys(0, 3), ReadFormat::kFp16, pin->pin_lease).ok());
  EXPECT_EQ(node_->store()->Stats().pinned_bytes, 0u);
  // Taken over, the pin is a stale lease.
  EXPECT_EQ(client_->Release(pin->pin_lease).code(),
            absl::StatusCode::kFailedPrecondition);
}

// allow_missing: Get and GetInto return the blocks the node holds intact,
// list the rest (never stored, or corrupt and dropped), and still refuse
// bad input.
TEST_P(NodeTest, AllowMissingReturnsWhatIsThereAndListsTheRest) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kFp8E4M3)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 4).ok());
  ASSERT_TRUE(PutChain("ns", 6, 1).ok());
  ASSERT_TRUE(node_->store()->CorruptBlockForTest("ns", Key(2)).ok());
  ReadOptions partial;
  partial.allow_missing = true;
  // Keys 0..7: 2 is corrupt, 4, 5 and 7 were never stored.
  const std::vector<uint32_t> missing = {2, 4, 5, 7};
  const std::vector<uint32_t> found = {0, 1, 3, 6};
  for (ReadFormat format : {ReadFormat::kFp16, ReadFormat::kRaw}) {
    partial.format = format;
    auto got = client_->Get("ns", Keys(0, 8), partial);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->missing, missing);
    EXPECT_EQ(got->prefix_blocks(), 2u);
    ASSERT_EQ(got->blocks.size(), found.size());
    // The same bytes as a plain read of each key alone.
    for (size_t j = 0; j < found.size(); ++j) {
      const BlockData& b = got->blocks[j];
      EXPECT_EQ(b.index, found[j]);
      EXPECT_EQ(b.key, Key(found[j]));
      auto alone = client_->Get("ns", Keys(found[j], 1), format);
      ASSERT_TRUE(alone.ok()) << alone.status();
      EXPECT_EQ(b.bytes, alone->blocks[0].bytes) << "key " << found[j];
    }
  }
  EXPECT_EQ(node_->store()->Stats().data_loss_events, 1u);

  // Into caller memory (inline here): found blocks in their keys' slots,
  // missing slots untouched.
  const size_t stride = kernels::Fp16BlockBytes(SmallShape());
  std::vector<uint8_t> buffer(8 * stride, 0xEE);
  partial.format = ReadFormat::kFp16;
  auto into = client_->GetInto("ns", Keys(0, 8), partial,
                               absl::MakeSpan(buffer), stride);
  ASSERT_TRUE(into.ok()) << into.status();
  ASSERT_TRUE((*into)->Wait().ok());
  EXPECT_EQ((*into)->metadata().missing, missing);
  ASSERT_EQ((*into)->placements().size(), found.size());
  auto reference = client_->Get("ns", Keys(0, 2), ReadFormat::kFp16);
  ASSERT_TRUE(reference.ok());
  for (size_t j = 0; j < found.size(); ++j) {
    const BlockPlacement& p = (*into)->placements()[j];
    EXPECT_EQ(p.offset, found[j] * stride);
    EXPECT_EQ(p.length, stride);
    if (j < 2) {
      EXPECT_EQ(std::memcmp(buffer.data() + p.offset,
                            reference->blocks[j].bytes.data(), stride),
                0);
    }
  }
  for (uint32_t m : missing) {
    EXPECT_EQ(std::count(buffer.begin() + m * stride,
                         buffer.begin() + (m + 1) * stride, 0xEE),
              static_cast<std::ptrdiff_t>(stride))
        << "slot " << m;
  }

  // Every key missing: not an error, no blocks.
  auto none = client_->Get("ns", Keys(20, 3), partial);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->blocks.empty());
  EXPECT_EQ(none->missing, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(none->prefix_blocks(), 0u);
  auto none_into = client_->GetInto("ns", Keys(20, 3), partial,
                                    absl::MakeSpan(buffer), stride);
  ASSERT_TRUE(none_into.ok()) << none_into.status();
  EXPECT_TRUE((*none_into)->WaitLayer(0).ok());
  EXPECT_TRUE((*none_into)->placements().empty());

  // Without allow_missing a missing key still fails the whole read.
  EXPECT_EQ(client_->Get("ns", Keys(0, 8)).status().code(),
            absl::StatusCode::kNotFound);
  // Bad input is an error with or without it.
  EXPECT_EQ(client_->Get("nope", Keys(0, 1), partial).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Get("ns", {std::string(65, 'k')}, partial).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Get("ns", {""}, partial).status().code(),
            absl::StatusCode::kInvalidArgument);
  ReadOptions stale_pin = partial;
  stale_pin.pin_lease = 987654321;
  EXPECT_EQ(client_->Get("ns", Keys(0, 2), stale_pin).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(node_->store()->Stats().pinned_bytes, 0u);
}

// Every Client call against a hung node (TCP accepts, nothing answers):
// named by `name`, run with `call`.
struct HungCall {
  const char* name;
  std::function<absl::Status(Client&, const CallOptions&)> run;
};

std::vector<HungCall> EveryCall() {
  static const std::vector<uint16_t>* block =
      new std::vector<uint16_t>(RandomBlock(SmallShape(), 1));
  static std::vector<uint8_t>* buffer =
      new std::vector<uint8_t>(kernels::Fp16BlockBytes(SmallShape()));
  NamespaceSpec spec;
  spec.name = "ns";
  spec.shape = SmallShape();
  return {
      {"RegisterNamespace",
       [spec](Client& c, const CallOptions& o) {
         return c.RegisterNamespace(spec, o).status();
       }},
      {"Lookup",
       [](Client& c, const CallOptions& o) {
         return c.Lookup("ns", {Key(0)}, false, o).status();
       }},
      {"Put",
       [](Client& c, const CallOptions& o) {
         BlockWrite w{Key(0), "", *block};
         return c.Put("ns", {&w, 1}, o).status();
       }},
      {"Get",
       [](Client& c, const CallOptions& o) {
         return c.Get("ns", {Key(0)}, ReadOptions{}, o).status();
       }},
      {"GetInto",
       [](Client& c, const CallOptions& o) {
         return c
             .GetInto("ns", {Key(0)}, ReadOptions{}, absl::MakeSpan(*buffer),
                      buffer->size(), o)
             .status();
       }},
      {"Release",
       [](Client& c, const CallOptions& o) { return c.Release(42, o); }},
      {"Delete",
       [](Client& c, const CallOptions& o) {
         return c.Delete("ns", {Key(0)}, o).status();
       }},
      {"Stats",
       [](Client& c, const CallOptions& o) { return c.Stats(o).status(); }},
  };
}

std::unique_ptr<Client> HungClient(const kvcache::testing::BlackHole& hole,
                                   absl::Duration timeout) {
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", hole.port());
  options.timeout = timeout;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok());
  return client.ok() ? *std::move(client) : nullptr;
}

TEST(ClientCallOptionsTest, EveryCallEndsAtItsDeadlineOnAHungNode) {
  kvcache::testing::BlackHole hole;
  ASSERT_GT(hole.port(), 0);
  // The client's default is long: each call's own deadline decides.
  auto client = HungClient(hole, absl::Seconds(30));
  ASSERT_NE(client, nullptr);
  for (const HungCall& c : EveryCall()) {
    SCOPED_TRACE(c.name);
    CallOptions relative;
    relative.timeout = absl::Milliseconds(300);
    absl::Time start = absl::Now();
    absl::Status st = c.run(*client, relative);
    absl::Duration took = absl::Now() - start;
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_GE(took, absl::Milliseconds(250));
    EXPECT_LT(took, absl::Milliseconds(1300));

    CallOptions absolute;
    absolute.deadline = absl::Now() + absl::Milliseconds(200);
    st = c.run(*client, absolute);
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_LT(absl::Now() - absolute.deadline, absl::Seconds(1));
    // Both: the earlier applies.
    CallOptions both;
    both.timeout = absl::Seconds(20);
    both.deadline = absl::Now() + absl::Milliseconds(200);
    st = c.run(*client, both);
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_LT(absl::Now() - both.deadline, absl::Seconds(1));
  }
  // No CallOptions: ClientOptions::timeout.
  auto short_default = HungClient(hole, absl::Milliseconds(200));
  ASSERT_NE(short_default, nullptr);
  absl::Time start = absl::Now();
  EXPECT_EQ(short_default->Stats().status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(ClientCallOptionsTest, CancelFromAnotherThreadEndsEveryCallPromptly) {
  kvcache::testing::BlackHole hole;
  ASSERT_GT(hole.port(), 0);
  auto client = HungClient(hole, absl::Seconds(30));
  ASSERT_NE(client, nullptr);
  for (const HungCall& c : EveryCall()) {
    SCOPED_TRACE(c.name);
    CallOptions call;
    call.timeout = absl::Seconds(20);
    call.cancel = std::make_shared<CancelToken>();
    absl::Time cancelled_at;
    std::thread canceller([&] {
      absl::SleepFor(absl::Milliseconds(150));
      cancelled_at = absl::Now();
      call.cancel->Cancel();
    });
    absl::Status st = c.run(*client, call);
    const absl::Time returned = absl::Now();
    canceller.join();
    EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
    EXPECT_LT(returned - cancelled_at, absl::Milliseconds(500));

    // A token cancelled already: the call fails before sending anything.
    absl::Time start = absl::Now();
    st = c.run(*client, call);
    EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  }
}

// A node that answers every BeginRead with a data-plane read the client
// cannot use (no block for the key it asked: the client abandons the read
// at once, with a best-effort EndRead), and holds each EndRead until the
// caller cancels it or 20 s pass.
class HoldsEndReads final : public v1::KvCache::Service {
 public:
  grpc::Status BeginRead(grpc::ServerContext*, const v1::BeginReadRequest*,
                         v1::BeginReadResponse* response) override {
    response->set_read_id(42);
    response->mutable_data_plane()->set_worker_address("unusable");
    return grpc::Status::OK;
  }
  grpc::Status EndRead(grpc::ServerContext* ctx, const v1::EndReadRequest*,
                       v1::EndReadResponse*) override {
    arrived_.Notify();
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (!ctx->IsCancelled() && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    ended_at_ = absl::Now();
    ended_.Notify();
    return grpc::Status::OK;
  }
  const Notification& arrived() const { return arrived_; }
  const Notification& ended() const { return ended_; }
  // Valid once ended() has been notified.
  absl::Time ended_at() const { return ended_at_; }

 private:
  Notification arrived_;
  Notification ended_;
  absl::Time ended_at_;
};

// A Client destroyed while one of its best-effort cleanup calls (EndRead,
// AbortWrite) is in flight cancels it and returns once it has ended: no call
// of a destroyed Client stays on the wire until its own deadline. Such a
// call used to hold the Client's channel until then, and its callback
// dropped the channel's last reference on a thread of gRPC's own callback
// queue, whose release then shut that queue down and freed it from within
// one of its own polling threads: here the EndRead stayed 5 s, then the
// process died (SIGSEGV in grpc_completion_queue_next); in the TSan
// cluster_client_test, about once in 40 runs, a SEGV inside libgrpc as a
// cluster client dropped a node, or "completion_queue.cc:650 assertion
// failed: found".
TEST(ClientCleanupTest, ADestroyedClientLeavesNoCallInFlight) {
  HoldsEndReads node;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&node);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", port);
  options.data_plane = DataPlane::kGrpc;
  options.timeout = absl::Seconds(30);
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->Get("ns", {Key(0)}).status().code(),
            absl::StatusCode::kInternal);
  ASSERT_TRUE(node.arrived().WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "the client sent no EndRead for the read it abandoned";

  const absl::Time destroying = absl::Now();
  client->reset();
  const absl::Time destroyed = absl::Now();
  EXPECT_LT(destroyed - destroying, absl::Seconds(2));
  ASSERT_TRUE(node.ended().WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_LT(node.ended_at() - destroyed, absl::Seconds(1))
      << "the EndRead stayed in flight for "
      << absl::FormatDuration(node.ended_at() - destroyed)
      << " after its Client was destroyed";
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
}

// CleanupCalls against a fake transport whose callbacks come on another
// thread 300 ms after each call starts, as gRPC's would: CancelAndWait
// returns only once they have come, and later Sends send nothing. Against
// one that never calls back, it gives up at its bound and says so, and a
// callback that comes after the CleanupCalls is gone still finds its state.
TEST(ClientCleanupTest, CancelAndWaitReturnsOnceEveryCallbackHasRun) {
  std::atomic<int> started{0};
  std::vector<std::thread> transport;
  auto later = [&](grpc::ClientContext*, v1::EndReadRequest*,
                   v1::EndReadResponse*,
                   std::function<void(grpc::Status)> done) {
    ++started;
    transport.emplace_back([done = std::move(done)] {
      absl::SleepFor(absl::Milliseconds(300));
      done(grpc::Status::CANCELLED);
    });
  };
  internal::CleanupCalls calls;
  for (int i = 0; i < 3; ++i) {
    calls.Send<v1::EndReadResponse>(absl::Seconds(5), v1::EndReadRequest(),
                                    later);
  }
  const absl::Time waiting = absl::Now();
  EXPECT_TRUE(calls.CancelAndWait(absl::Seconds(10)));
  EXPECT_GE(absl::Now() - waiting, absl::Milliseconds(250));
  calls.Send<v1::EndReadResponse>(absl::Seconds(5), v1::EndReadRequest(),
                                  later);
  EXPECT_EQ(started.load(), 3);
  for (std::thread& t : transport) t.join();

  std::function<void(grpc::Status)> held;
  auto never =
      [&](grpc::ClientContext*, v1::EndReadRequest*, v1::EndReadResponse*,
          std::function<void(grpc::Status)> done) { held = std::move(done); };
  auto stuck = std::make_unique<internal::CleanupCalls>();
  stuck->Send<v1::EndReadResponse>(absl::Seconds(5), v1::EndReadRequest(),
                                   never);
  EXPECT_FALSE(stuck->CancelAndWait(absl::Milliseconds(100)));
  stuck.reset();
  ASSERT_TRUE(held);
  held(grpc::Status::CANCELLED);
}

TEST_P(NodeTest, BadInputGetsExactCodesAndLosesNothing) {
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

// Requests a hostile client can send: the codes are BRIEF section 5's, a
// cheap request costs the node little, and a pin of one namespace cannot be
// taken over (and released) by a read of another.
TEST_P(NodeTest, HostileRequestsGetBriefCodesAndCostLittle) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("a", Codec::kNone)).ok());
  ASSERT_TRUE(client_->RegisterNamespace(Spec("b", Codec::kNone)).ok());
  ASSERT_TRUE(PutChain("a", 0, 2).ok());
  ASSERT_TRUE(PutChain("b", 0, 2).ok());
  auto raw = [&](auto call) {
    return RawCall([&](grpc::ClientContext* ctx) { return call(ctx); });
  };

  // A forged or stale lease id is FAILED_PRECONDITION on every RPC.
  v1::EndReadRequest end;
  end.set_lease_id(0xdeadbeef);
  v1::EndReadResponse end_response;
  EXPECT_EQ(raw([&](grpc::ClientContext* ctx) {
              return stub_->EndRead(ctx, end, &end_response);
            }).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  v1::AbortWriteRequest abort;
  abort.set_write_id(0xdeadbeef);
  v1::AbortWriteResponse abort_response;
  EXPECT_EQ(raw([&](grpc::ClientContext* ctx) {
              return stub_->AbortWrite(ctx, abort, &abort_response);
            }).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // An unknown read format is refused, not read as fp16.
  v1::BeginReadRequest read;
  read.set_namespace_name("a");
  read.add_keys(Key(0));
  read.set_inline_data(true);
  read.set_format(static_cast<v1::ReadFormat>(77));
  v1::BeginReadResponse read_response;
  EXPECT_EQ(raw([&](grpc::ClientContext* ctx) {
              return stub_->BeginRead(ctx, read, &read_response);
            }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  // A Lookup pin of namespace a, named by a read of namespace b: refused,
  // and the pin still holds (its owner can still end it).
  auto pin = client_->Lookup("a", Keys(0, 2), /*pin=*/true);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_NE(pin->pin_lease, 0u);
  read.set_namespace_name("b");
  read.set_format(v1::READ_FORMAT_FP16);
  read.set_pin_lease_id(pin->pin_lease);
  EXPECT_EQ(raw([&](grpc::ClientContext* ctx) {
              return stub_->BeginRead(ctx, read, &read_response);
            }).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(client_->Release(pin->pin_lease).ok());

  // A 512 KiB name is refused with a short message (it must fit a client's
  // metadata limit): the name is not echoed whole.
  NamespaceSpec long_name = Spec(std::string(512 << 10, 'n'), Codec::kNone);
  absl::Status refused = client_->RegisterNamespace(long_name).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_LT(refused.message().size(), 512u);
  absl::Status missing =
      client_->Lookup(std::string(512 << 10, 'n'), Keys(0, 1)).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_LT(missing.message().size(), 512u);

  // Layouts whose blocks could never fit are refused before the node
  // allocates anything for them, whatever the field's width.
  struct rusage before;
  getrusage(RUSAGE_SELF, &before);
  for (uint32_t layers : {uint32_t{1} << 24, uint32_t{1} << 31, UINT32_MAX}) {
    v1::RegisterNamespaceRequest reg;
    reg.mutable_spec()->set_name(absl::StrCat("huge", layers));
    reg.mutable_spec()->mutable_layout()->set_num_layers(layers);
    reg.mutable_spec()->mutable_layout()->set_num_kv_heads(1);
    reg.mutable_spec()->mutable_layout()->set_head_dim(32);
    reg.mutable_spec()->mutable_layout()->set_tokens_per_block(32);
    reg.mutable_spec()->mutable_codec_policy()->set_codec(v1::CODEC_KIVI2);
    v1::RegisterNamespaceResponse reg_response;
    EXPECT_EQ(raw([&](grpc::ClientContext* ctx) {
                return stub_->RegisterNamespace(ctx, reg, &reg_response);
              }).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << layers;
  }
  struct rusage after;
  getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 64 << 10)  // KiB
      << "peak RSS grew by " << (after.ru_maxrss - before.ru_maxrss)
      << " KiB for three refused registrations";

  ExpectIntact("a", 0, 2);
  ExpectIntact("b", 0, 2);
}

TEST_P(NodeTest, FullPoolIsResourceExhaustedWithARetryHint) {
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

TEST_P(NodeTest, HealthAndReflectionAreServed) {
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

TEST_P(NodeTest, MetricsExposeCapacityRequestsAndCodecs) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kFp8E4M3)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 2).ok());
  ASSERT_TRUE(client_->Lookup("ns", Keys(0, 3)).ok());
  ASSERT_TRUE(client_->Get("ns", Keys(0, 2)).ok());
  auto body = kvcache::testing::HttpGet(node_->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  for (const char* needle : {
           GetParam() ? "kvcache_requests_total{code=\"OK\",op=\"commit_"
                        "write\",tenant=\"admin\"} 1"
                      : "kvcache_requests_total{code=\"OK\",op=\"commit_"
                        "write\",tenant=\"open\"} 1",
           "kvcache_request_duration_seconds_bucket",
           "kvcache_lookup_blocks_total{result=\"hit\"} 2",
           "kvcache_lookup_blocks_total{result=\"miss\"} 1",
           "kvcache_pool_capacity_bytes",
           "kvcache_pool_used_ratio",
           "kvcache_blocks{codec=\"fp8_e4m3\"} 2",
           "kvcache_stored_tokens{codec=\"fp8_e4m3\"} 64",
           "kvcache_token_capacity_remaining{codec=\"kivi2\",kv_namespace="
           "\"ns\"}",
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

// Connections that never send a request (a port scanner, a stuck scraper)
// must not stop /metrics: Prometheus would see the node down while it
// serves. HttpGet gives up after 5 s; an idle connection used to hold one of
// the exposer's two threads for 30 s.
TEST_P(NodeTest, MetricsAnswerWithIdleConnectionsOpen) {
  std::vector<std::unique_ptr<kvcache::testing::ScopedFd>> idle;
  for (int i = 0; i < 4; ++i) {
    auto fd = std::make_unique<kvcache::testing::ScopedFd>(
        socket(AF_INET, SOCK_STREAM, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(node_->metrics_port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(
        connect(fd->get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
        0);
    idle.push_back(std::move(fd));
  }
  absl::SleepFor(absl::Milliseconds(200));  // the server has accepted them
  for (int i = 0; i < 3; ++i) {
    auto body = kvcache::testing::HttpGet(node_->metrics_port(), "/metrics");
    ASSERT_TRUE(body.ok()) << "scrape " << i << ": " << body.status();
    EXPECT_NE(body->find("kvcache_ready 1"), std::string::npos);
  }
}

// What a probe polling each port sees while the node drains: NOT_SERVING
// first, on every port, for the notice the node gives, and only then the
// port goes away (UNAVAILABLE). A probe that went from SERVING straight to
// UNAVAILABLE could not tell a drain from a crash.
TEST_P(NodeTest, DrainSaysNotServingOnEveryPortBeforeItStops) {
  struct Poller {
    std::unique_ptr<grpc::health::v1::Health::Stub> health;
    std::vector<std::string> seen;  // distinct answers, in order
  };
  std::vector<Poller> pollers(2);
  const int ports[] = {node_->port(), node_->health_port()};
  for (int i = 0; i < 2; ++i) {
    pollers[i].health = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", ports[i]),
                            grpc::InsecureChannelCredentials()));
  }
  std::atomic<bool> stop{false};
  auto poll = [&](Poller* p) {
    while (!stop.load()) {
      grpc::health::v1::HealthCheckRequest request;
      grpc::health::v1::HealthCheckResponse response;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(500));
      grpc::Status st = p->health->Check(&ctx, request, &response);
      std::string answer =
          st.ok() ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
                        response.status())
                  : "UNAVAILABLE";
      if (p->seen.empty() || p->seen.back() != answer) {
        p->seen.push_back(answer);
      }
      if (answer == "UNAVAILABLE") return;
      absl::SleepFor(absl::Milliseconds(20));
    }
  };
  std::thread main_poller(poll, &pollers[0]);
  std::thread health_poller(poll, &pollers[1]);
  absl::SleepFor(absl::Milliseconds(100));
  node_->Drain(/*notice=*/absl::Milliseconds(400));
  absl::SleepFor(absl::Milliseconds(600));
  stop = true;
  main_poller.join();
  health_poller.join();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(absl::StrJoin(pollers[i].seen, " -> "),
              "SERVING -> NOT_SERVING -> UNAVAILABLE")
        << (i == 0 ? "main port" : "health port");
  }
}

TEST_P(NodeTest, DrainFinishesAndThenRefuses) {
  ASSERT_TRUE(client_->RegisterNamespace(Spec("ns", Codec::kNone)).ok());
  ASSERT_TRUE(PutChain("ns", 0, 1).ok());
  node_->Drain();
  auto after = client_->Lookup("ns", Keys(0, 1));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable)
      << after.status();
}

INSTANTIATE_TEST_SUITE_P(OpenAndTenants, NodeTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Tenants" : "Open";
                         });

}  // namespace
}  // namespace kvcache
