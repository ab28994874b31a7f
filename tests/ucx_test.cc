// UCX data-plane tests: a node with --data-plane=ucx on loopback, driven by
// clients that move the bytes over UCX (ClientOptions::data_plane = kUcx),
// over tcp and over shared memory (UCX_TLS set before any UCX context is
// created; every context of this process and of its children reads it).
//
// Also: a connection without a valid token is closed, a full staging area
// answers RESOURCE_EXHAUSTED with a retry hint, and a client process killed
// mid-transfer leaves no lease, pin or staging byte behind after the lease
// TTL. The killed client is this binary, re-executed in child mode.
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/notification.h"
#include "client/client_test_access.h"
#include "client/read_decode.h"
#include "client/ucx/client_plane.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kvcache/client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/flags.h"
#include "service/metrics.h"
#include "service/node.h"
#include "tests/black_hole.h"
#include "tests/test_util.h"
#include "transport/handles.h"
#include "transport/tcp_segments.h"
#include "transport/wire.h"
#include "transport/worker_loop.h"

namespace kvcache {
namespace {

using kvcache::testing::Key;
using kvcache::testing::RandomBlock;
using kvcache::testing::ScopedEnv;
using kvcache::testing::SmallShape;

// 512 KiB fp16 blocks: large enough for rendezvous sends.
kernels::BlockShape LargeShape() { return {4, 8, 128, 32}; }

struct Transport {
  const char* name;
  const char* tls;
  // The node's read delivery: tcp_puts makes tcp reads go by (emulated)
  // puts, the path RDMA takes, which tcp's default (data messages) skips.
  ucx::ReadDelivery delivery = ucx::ReadDelivery::kAuto;
  // The node's data-plane shards (DataPlaneOptions::progress_threads).
  int progress_threads = 1;
  bool tcp() const { return std::string(tls) == "tcp"; }
};

void PrintTo(const Transport& t, std::ostream* os) { *os << t.name; }

void UseTransport(const Transport& t) {
  setenv("UCX_TLS", t.tls, 1);
  setenv("UCX_NET_DEVICES", "lo", 1);
}

class UcxTest : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    UseTransport(GetParam());
    StartNode(256ull << 20, 64ull << 20, absl::Seconds(30));
  }

  void StartNode(uint64_t memory, uint64_t staging, absl::Duration ttl,
                 int worker_threads = 2) {
    client_.reset();
    grpc_client_.reset();
    node_.reset();
    service::NodeOptions options;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "";
    options.memory = {store::MemoryKind::kHost, 0, memory};
    options.store.page_size = 16384;
    options.store.max_blocks_per_request = 64;
    options.store.default_lease_ttl = ttl;
    options.max_request_bytes = 64 << 20;
    options.drain_timeout = absl::Seconds(5);
    options.worker_threads = worker_threads;
    options.reaper_interval = absl::Milliseconds(50);
    options.data_plane = service::DataPlaneMode::kUcx;
    // Loopback is a trusted network; over shared memory the node runs as
    // it does by default: no TCP, no listener.
    options.ucx.tcp_trusted_network = GetParam().tcp();
    options.ucx.listen = GetParam().tcp() ? "127.0.0.1:0" : "";
    options.ucx.staging_bytes = staging;
    options.ucx.handshake_timeout = absl::Seconds(1);
    options.ucx.read_delivery = GetParam().delivery;
    options.ucx.progress_threads = GetParam().progress_threads;
    node_ = std::make_unique<service::Node>(options);
    absl::Status started = node_->Start();
    ASSERT_TRUE(started.ok()) << started;
    ASSERT_EQ(node_->ucx_port() != 0, GetParam().tcp());
    client_ = NewClient(DataPlane::kUcx);
    grpc_client_ = NewClient(DataPlane::kGrpc);
  }

  std::string Target() const {
    return absl::StrCat("127.0.0.1:", node_->port());
  }

  std::unique_ptr<Client> NewClient(DataPlane plane,
                                    bool decode_on_client = true) {
    ClientOptions copts;
    copts.target = Target();
    copts.timeout = absl::Seconds(20);
    copts.max_message_bytes = 64 << 20;
    copts.data_plane = plane;
    copts.decode_on_client = decode_on_client;
    auto client = Client::Connect(copts);
    EXPECT_TRUE(client.ok());
    return client.ok() ? *std::move(client) : nullptr;
  }

  // A node with one worker thread, block 0 (LargeShape, codec none) put
  // under `ns`, and a fresh DataBuffer of `bytes` to read it into: the
  // prefault tests' start. Null on a failure (reported).
  std::unique_ptr<DataBuffer> OneBlockAndAFreshBuffer(const std::string& ns,
                                                      size_t bytes) {
    StartNode(256ull << 20, 64ull << 20, absl::Seconds(30),
              /*worker_threads=*/1);
    const kernels::BlockShape shape = LargeShape();
    EXPECT_TRUE(client_->RegisterNamespace(Spec(ns, Codec::kNone, shape)).ok());
    EXPECT_TRUE(PutChain(client_.get(), ns, shape, 0, 1).ok());
    auto buffer = client_->AllocateBuffer(bytes);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    return buffer.ok() ? *std::move(buffer) : nullptr;
  }

  NamespaceSpec Spec(const std::string& name, Codec codec,
                     kernels::BlockShape shape) {
    NamespaceSpec spec;
    spec.name = name;
    spec.model = "ucx-test";
    spec.shape = shape;
    CodecPolicy policy;
    policy.codec = codec;
    spec.policy = policy;
    spec.residual_tokens = 0;  // every block in the namespace codec
    return spec;
  }

  absl::StatusOr<PutResult> PutChain(Client* client, const std::string& ns,
                                     kernels::BlockShape shape, int first,
                                     int n) {
    std::vector<BlockWrite> writes;
    for (int i = first; i < first + n; ++i) {
      data_[i] = RandomBlock(shape, i);
    }
    for (int i = first; i < first + n; ++i) {
      writes.push_back({Key(i), "", data_[i]});
    }
    return client->Put(ns, writes);
  }

  // Puts blocks 0..n-1 of random data (seeds seed..) as one chain, then
  // waits (bounded) until the node has re-encoded what left a KIVI residual
  // window in the background, so that every later read sees the same
  // blocks. False when the put failed.
  bool PutSettledChain(const std::string& ns, kernels::BlockShape shape, int n,
                       int seed) {
    std::vector<BlockWrite> writes;
    for (int i = 0; i < n; ++i) {
      data_[i] = RandomBlock(shape, seed + i);
      writes.push_back({Key(i), i == 0 ? "" : Key(i - 1), data_[i]});
    }
    if (!client_->Put(ns, writes).ok()) return false;
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (node_->store()->Stats().pending_reencodes > 0 &&
           absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }

  // How a client reaches the node's data plane (as Client does it), for
  // tests that drive ucx::ClientPlane themselves.
  static ucx::NodeAddress AddressOf(const kvcache::v1::DataPlaneInfo& info) {
    ucx::NodeAddress address;
    address.listener = info.ucx_address();
    if (!address.listener.empty() && address.listener.front() == ':') {
      address.listener = "127.0.0.1" + address.listener;
    }
    address.worker = info.worker_address();
    address.bounded_reads = info.bounded_reads();
    address.pull_writes = info.pull_writes();
    address.message_reads = info.message_reads();
    address.sequenced_data = info.sequenced_data();
    address.decodes_into_destination = info.decodes_into_destination();
    return address;
  }

  static std::vector<std::string> Keys(int first, int n) {
    std::vector<std::string> k;
    for (int i = first; i < first + n; ++i) k.push_back(Key(i));
    return k;
  }

  // BeginRead over the data plane by hand, for tests that drive the read's
  // transfer themselves: the answer must name the data plane.
  kvcache::v1::BeginReadResponse BeginPlaneRead(
      const std::string& ns, int first, int n, kvcache::v1::ReadFormat format,
      bool decode_into_destination = false) {
    auto stub = kvcache::v1::KvCache::NewStub(
        grpc::CreateChannel(Target(), grpc::InsecureChannelCredentials()));
    kvcache::v1::BeginReadRequest request;
    request.set_namespace_name(ns);
    for (const std::string& k : Keys(first, n)) request.add_keys(k);
    request.set_format(format);
    request.set_decode_into_destination(decode_into_destination);
    kvcache::v1::BeginReadResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status rpc = stub->BeginRead(&ctx, request, &response);
    EXPECT_TRUE(rpc.ok()) << rpc.error_message();
    EXPECT_TRUE(response.has_data_plane());
    return response;
  }

  // Starts, through `plane` and by hand, the read `response` began: its
  // blocks land one after another in `heap`, `block_bytes` apart.
  static absl::StatusOr<std::unique_ptr<ucx::ClientPlane::Read>>
  StartReadByHand(ucx::ClientPlane& plane,
                  const kvcache::v1::BeginReadResponse& response,
                  std::vector<uint8_t>& heap, size_t block_bytes,
                  uint32_t num_layers, bool per_layer) {
    auto region = plane.Register(heap.data(), heap.size());
    if (!region.ok()) return region.status();
    std::vector<uint64_t> destinations;
    for (int b = 0; b < response.blocks_size(); ++b) {
      destinations.push_back(reinterpret_cast<uint64_t>(heap.data()) +
                             b * block_bytes);
    }
    auto token = ucx::TokenFromBytes(response.data_plane().token());
    if (!token.ok()) return token.status();
    return plane.StartRead(AddressOf(response.data_plane()), response.read_id(),
                           *token, *std::move(region), destinations, num_layers,
                           per_layer);
  }

  // Waits (bounded) until the node holds no data-plane state at all.
  void ExpectNothingHeld(absl::Duration within) {
    absl::Time deadline = absl::Now() + within;
    ucx::DataPlaneStats dp;
    store::StoreStats st;
    do {
      dp = node_->data_plane()->Stats();
      st = node_->store()->Stats();
      if (dp.staging_used_bytes == 0 && dp.write_sessions == 0 &&
          dp.read_sessions == 0 && st.active_read_leases == 0 &&
          st.active_write_leases == 0 && st.pinned_bytes == 0 &&
          st.reserved_bytes == 0) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    } while (absl::Now() < deadline);
    EXPECT_EQ(dp.staging_used_bytes, 0u);
    EXPECT_EQ(dp.write_sessions, 0u);
    EXPECT_EQ(dp.read_sessions, 0u);
    EXPECT_EQ(st.active_read_leases, 0u);
    EXPECT_EQ(st.active_write_leases, 0u);
    EXPECT_EQ(st.pinned_bytes, 0u);
    EXPECT_EQ(st.reserved_bytes, 0u);
  }

  // After a read of a chain of fp16 blocks 0.. that hit corrupt block
  // `bad` (of `stride` bytes each): the node counted one data loss and
  // dropped that block, and still reads blocks [0, bad) exact.
  void ExpectDroppedAndTheRestExact(const std::string& ns, int bad,
                                    size_t stride) {
    EXPECT_EQ(node_->store()->Stats().data_loss_events, 1u);
    EXPECT_EQ(client_->Get(ns, Keys(bad, 1), ReadFormat::kRaw).status().code(),
              absl::StatusCode::kNotFound);
    auto rest = client_->Get(ns, Keys(0, bad), ReadFormat::kFp16);
    ASSERT_TRUE(rest.ok()) << rest.status();
    for (int b = 0; b < bad; ++b) {
      ASSERT_EQ(rest->blocks[b].bytes.size(), stride);
      EXPECT_EQ(
          std::memcmp(rest->blocks[b].bytes.data(), data_[b].data(), stride), 0)
          << "block " << b;
    }
  }

  std::unique_ptr<service::Node> node_;
  std::unique_ptr<Client> client_;       // kUcx
  std::unique_ptr<Client> grpc_client_;  // kGrpc
  std::map<int, std::vector<uint16_t>> data_;
};

// Client processes (here: clients with gRPC connections of their own) are
// spread over the node's progress threads, and each keeps the one it was
// given: its later sessions open no connection on another.
TEST_P(UcxTest, ClientsSpreadOverTheProgressThreadsAndEachKeepsItsOwn) {
  ucx::DataPlanes* planes = node_->data_plane();
  ASSERT_EQ(planes->size(), static_cast<size_t>(GetParam().progress_threads));
  if (planes->size() < 2) GTEST_SKIP() << "one progress thread";
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("spread", Codec::kFp8E4M3, shape)).ok());
  std::vector<std::unique_ptr<Client>> others;
  for (int i = 0; i < 3; ++i) others.push_back(NewClient(DataPlane::kUcx));
  std::vector<Client*> clients = {client_.get()};
  for (auto& c : others) clients.push_back(c.get());
  auto connections = [&] {
    std::vector<uint32_t> per_shard;
    for (size_t s = 0; s < planes->size(); ++s) {
      per_shard.push_back(planes->shard(s).Stats().connections);
    }
    return per_shard;
  };
  int next_key = 0;
  auto round = [&] {
    for (Client* c : clients) {
      const int first = next_key;
      next_key += 2;
      auto put = PutChain(c, "spread", shape, first, 2);
      ASSERT_TRUE(put.ok()) << put.status();
      ASSERT_EQ(put->stored, 2u);
      auto got = c->Get("spread", Keys(first, 2), ReadFormat::kRaw);
      auto want = grpc_client_->Get("spread", Keys(first, 2), ReadFormat::kRaw);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_EQ(got->blocks.size(), 2u);
      for (int b = 0; b < 2; ++b) {
        EXPECT_EQ(got->blocks[b].bytes, want->blocks[b].bytes) << "block " << b;
      }
    }
  };
  round();
  // Four clients, two shards: two on each (the fewest-served shard first).
  EXPECT_EQ(connections(), std::vector<uint32_t>({2, 2}));
  round();
  round();
  EXPECT_EQ(connections(), std::vector<uint32_t>({2, 2}));
  const ucx::DataPlaneStats sum = planes->Stats();
  EXPECT_EQ(sum.connections, 4u);
  EXPECT_EQ(sum.staging_used_bytes, 0u);
}

TEST_P(UcxTest, PutGetRoundTripsOverUcxInBothFormats) {
  for (kernels::BlockShape shape : {SmallShape(), LargeShape()}) {
    for (Codec codec : {Codec::kNone, Codec::kFp8E4M3, Codec::kKivi4}) {
      std::string ns = absl::StrCat("ns-", kernels::CodecName(codec), "-",
                                    kernels::Fp16BlockBytes(shape));
      ASSERT_TRUE(client_->RegisterNamespace(Spec(ns, codec, shape)).ok());
      auto put = PutChain(client_.get(), ns, shape, 0, 4);
      ASSERT_TRUE(put.ok()) << put.status();
      EXPECT_EQ(put->stored, 4u);
      auto again = PutChain(client_.get(), ns, shape, 0, 6);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_EQ(again->stored, 2u);
      EXPECT_EQ(again->skipped, 4u);

      for (ReadFormat format : {ReadFormat::kFp16, ReadFormat::kRaw}) {
        auto ucx = client_->Get(ns, Keys(0, 6), format);
        auto inline_read = grpc_client_->Get(ns, Keys(0, 6), format);
        ASSERT_TRUE(ucx.ok()) << ucx.status();
        ASSERT_TRUE(inline_read.ok()) << inline_read.status();
        ASSERT_EQ(ucx->blocks.size(), 6u);
        for (int i = 0; i < 6; ++i) {
          EXPECT_EQ(ucx->blocks[i].key, Key(i));
          EXPECT_EQ(ucx->blocks[i].codec, codec);
          EXPECT_EQ(ucx->blocks[i].bytes, inline_read->blocks[i].bytes)
              << ns << " block " << i << " differs between UCX and gRPC";
          std::vector<uint16_t> fp16(data_[i].size());
          if (format == ReadFormat::kRaw) {
            ASSERT_TRUE(
                DecodeRaw(*ucx, ucx->blocks[i], absl::MakeSpan(fp16)).ok());
          } else {
            ASSERT_EQ(ucx->blocks[i].bytes.size(), fp16.size() * 2);
            std::memcpy(fp16.data(), ucx->blocks[i].bytes.data(),
                        fp16.size() * 2);
          }
          if (codec == Codec::kNone) {
            EXPECT_EQ(fp16, data_[i]) << ns << " block " << i;
          }
        }
      }
    }
  }
  // Over tcp the node sends reads as data messages (UCX would emulate puts
  // with active messages there), unless told to put; on shared memory it
  // puts.
  const bool messages =
      GetParam().tcp() && GetParam().delivery == ucx::ReadDelivery::kAuto;
  const uint64_t message_reads = node_->data_plane()->Stats().message_reads;
  if (messages) {
    EXPECT_GT(message_reads, 0u);
  } else {
    EXPECT_EQ(message_reads, 0u);
  }
  // The bytes went over UCX, not gRPC, and nothing is left behind.
  // Where the node maps the client's memory (shared memory) it copies the
  // reads itself, on its worker pool.
  const uint64_t copied_reads = node_->data_plane()->Stats().copied_reads;
  if (GetParam().tcp()) {
    EXPECT_EQ(copied_reads, 0u);
  } else {
    EXPECT_GT(copied_reads, 0u);
  }
  std::string metrics = node_->metrics()->Render();
  EXPECT_NE(metrics.find(absl::StrCat("kvcache_data_plane_message_reads_total ",
                                      message_reads, "\n")),
            std::string::npos);
  EXPECT_NE(metrics.find(absl::StrCat("kvcache_data_plane_copied_reads_total ",
                                      copied_reads, "\n")),
            std::string::npos);
  EXPECT_EQ(metrics.find("kvcache_transfer_bytes_total{direction=\"in\","
                         "transport=\"ucx\"} 0\n"),
            std::string::npos);
  EXPECT_EQ(metrics.find("kvcache_transfer_bytes_total{direction=\"out\","
                         "transport=\"ucx\"} 0\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("kvcache_transfer_bytes_total{direction=\"in\","
                         "transport=\"grpc\"} 0\n"),
            std::string::npos)
      << "no put may have travelled inline";
  EXPECT_NE(metrics.find("kvcache_data_plane_staging_capacity_bytes"),
            std::string::npos);
  ExpectNothingHeld(absl::Seconds(5));
  // The exposition, data-plane series included, is promtool-clean.
  if (std::system("command -v promtool >/dev/null 2>&1") == 0) {
    // One file per process: ctest runs the transports' cases side by side,
    // and a shared name let one case remove the file another was reading.
    std::string path =
        absl::StrCat(::testing::TempDir(), "/ucx_metrics.", getpid(), ".txt");
    {
      std::ofstream out(path);
      out << node_->metrics()->Render();
    }
    std::string check = "promtool check metrics < " + path + " 2>&1";
    FILE* pipe = popen(check.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string findings;
    char line[512];
    while (std::fgets(line, sizeof(line), pipe) != nullptr) findings += line;
    EXPECT_EQ(pclose(pipe), 0) << findings;
    EXPECT_EQ(findings, "");
    std::remove(path.c_str());
  }
}

TEST_P(UcxTest, GetIntoDeliversLayerByLayerIntoCallerMemory) {
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("layers", Codec::kFp8E4M3, shape)).ok());
  constexpr int kBlocks = 12;
  ASSERT_TRUE(PutChain(client_.get(), "layers", shape, 0, kBlocks).ok());
  auto reference =
      grpc_client_->Get("layers", Keys(0, kBlocks), ReadFormat::kRaw);
  ASSERT_TRUE(reference.ok());
  const size_t stride = kernels::Fp16BlockBytes(shape);
  std::vector<uint8_t> buffer(kBlocks * stride, 0xEE);
  for (ReadFormat format : {ReadFormat::kRaw, ReadFormat::kFp16}) {
    std::fill(buffer.begin(), buffer.end(), 0xEE);
    auto read = client_->GetInto("layers", Keys(0, kBlocks), format,
                                 absl::MakeSpan(buffer), stride);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE((*read)->over_data_plane());
    ASSERT_EQ((*read)->num_layers(), shape.num_layers);
    const auto& placements = (*read)->placements();
    ASSERT_EQ(placements.size(), static_cast<size_t>(kBlocks));
    // Layer by layer: each layer's bytes are in place once WaitLayer(l)
    // returns, whatever of the later layers is still on its way.
    for (uint32_t l = 0; l < shape.num_layers; ++l) {
      ASSERT_TRUE((*read)->WaitLayer(l).ok());
      if (format != ReadFormat::kRaw) continue;
      for (int b = 0; b < kBlocks; ++b) {
        const std::vector<uint64_t>& ends = placements[b].layer_ends;
        ASSERT_EQ(ends.size(), shape.num_layers);
        const uint64_t begin = l == 0 ? 0 : ends[l - 1];
        EXPECT_EQ(std::memcmp(buffer.data() + placements[b].offset + begin,
                              reference->blocks[b].bytes.data() + begin,
                              ends[l] - begin),
                  0)
            << "block " << b << " layer " << l;
      }
    }
    ASSERT_TRUE((*read)->Wait().ok());
    auto full = grpc_client_->Get("layers", Keys(0, kBlocks), format);
    ASSERT_TRUE(full.ok());
    for (int b = 0; b < kBlocks; ++b) {
      ASSERT_EQ(placements[b].length, full->blocks[b].bytes.size());
      EXPECT_EQ(std::memcmp(buffer.data() + placements[b].offset,
                            full->blocks[b].bytes.data(), placements[b].length),
                0)
          << "block " << b;
    }
  }
  // A buffer too small for its slots is refused before anything moves.
  EXPECT_EQ(client_
                ->GetInto("layers", Keys(0, 3), ReadFormat::kFp16,
                          absl::MakeSpan(buffer).subspan(0, stride), stride)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  ExpectNothingHeld(absl::Seconds(5));
}

// The bytes the node has sent over UCX so far (its transfer counter, which
// a read adds to as it ends on the node: read once no read is open and the
// counter has stopped moving).
uint64_t UcxBytesOut(service::Node& node) {
  const std::string series =
      "kvcache_transfer_bytes_total{direction=\"out\",transport=\"ucx\"} ";
  auto read = [&]() -> uint64_t {
    const std::string metrics = node.metrics()->Render();
    size_t at = metrics.find(series);
    if (at == std::string::npos) return uint64_t{0};
    return std::strtoull(metrics.c_str() + at + series.size(), nullptr, 10);
  };
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  uint64_t last = read();
  while (absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(30));
    const uint64_t now = read();
    if (now == last && node.data_plane()->Stats().read_sessions == 0) break;
    last = now;
  }
  return last;
}

// ClientOptions::decode_on_client: an fp16 read of encoded blocks travels
// raw and is decoded by the client into the same bytes the node's decoder
// gives (Get and GetInto, over UCX and inline; fp16 and bf16 sources; a
// KIVI read that mixes encoded blocks with residual-window fp16 ones), layer
// by layer for GetInto, at the raw encoding's bytes on the wire.
TEST_P(UcxTest, Fp16ReadsDecodedOnTheClientEqualTheNodesAndMoveRawBytes) {
  std::unique_ptr<Client> node_decodes = NewClient(DataPlane::kUcx, false);
  const kernels::BlockShape fp16 = LargeShape();
  kernels::BlockShape bf16 = fp16;
  bf16.source_dtype = kernels::SourceDtype::kBf16;
  for (const kernels::BlockShape& shape : {fp16, bf16}) {
    for (Codec codec : kernels::kAllCodecs) {
      const bool bf = shape.source_dtype == kernels::SourceDtype::kBf16;
      const std::string ns =
          absl::StrCat("decode-", kernels::CodecName(codec), bf ? "-bf16" : "");
      NamespaceSpec spec = Spec(ns, codec, shape);
      spec.residual_tokens = 64;  // KIVI: the last 2 blocks of a chain fp16
      ASSERT_TRUE(client_->RegisterNamespace(spec).ok());
      ASSERT_TRUE(PutSettledChain(ns, shape, 6, 100));
      auto want = node_decodes->Get(ns, Keys(0, 6), ReadFormat::kFp16);
      ASSERT_TRUE(want.ok()) << ns << ": " << want.status();
      const uint64_t sent_before = UcxBytesOut(*node_);
      auto got = client_->Get(ns, Keys(0, 6), ReadFormat::kFp16);
      const uint64_t sent = UcxBytesOut(*node_) - sent_before;
      auto got_inline = grpc_client_->Get(ns, Keys(0, 6), ReadFormat::kFp16);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(got_inline.ok()) << got_inline.status();
      uint64_t raw_bytes = 0;
      for (int b = 0; b < 6; ++b) {
        EXPECT_EQ(got->blocks[b].format, ReadFormat::kFp16);
        EXPECT_EQ(got->blocks[b].bytes, want->blocks[b].bytes)
            << ns << " block " << b;
        EXPECT_EQ(got_inline->blocks[b].bytes, want->blocks[b].bytes)
            << ns << " block " << b << " (inline)";
        raw_bytes += kernels::EncodedBlockBytes(
            shape, internal::StoredPolicy(want->policy, want->blocks[b].codec)
                       .value_or(CodecPolicy{}));
      }
      EXPECT_EQ(sent, raw_bytes) << ns;
      if (codec != Codec::kNone) {
        EXPECT_LT(sent, 6 * kernels::Fp16BlockBytes(shape)) << ns;
      }
      // GetInto, with slots wider than a block: layer 0 of every block is
      // decoded in place once WaitLayer(0) returns, the rest by Wait.
      const size_t block_bytes = kernels::Fp16BlockBytes(shape);
      const size_t layer_bytes = block_bytes / shape.num_layers;
      const size_t stride = block_bytes + 128;
      std::vector<uint8_t> buffer(6 * stride, 0xEE);
      auto read = client_->GetInto(ns, Keys(0, 6), ReadFormat::kFp16,
                                   absl::MakeSpan(buffer), stride);
      ASSERT_TRUE(read.ok()) << read.status();
      ASSERT_TRUE((*read)->WaitLayer(0).ok());
      const auto& placements = (*read)->placements();
      ASSERT_EQ(placements.size(), 6u);
      for (int b = 0; b < 6; ++b) {
        EXPECT_EQ((*read)->metadata().blocks[b].format, ReadFormat::kFp16);
        EXPECT_EQ(placements[b].length, block_bytes);
        ASSERT_EQ(placements[b].layer_ends.size(), shape.num_layers);
        EXPECT_EQ(placements[b].layer_ends[0], layer_bytes);
        EXPECT_EQ(std::memcmp(buffer.data() + placements[b].offset,
                              want->blocks[b].bytes.data(), layer_bytes),
                  0)
            << ns << " block " << b << " layer 0";
      }
      ASSERT_TRUE((*read)->Wait().ok());
      for (int b = 0; b < 6; ++b) {
        EXPECT_EQ(std::memcmp(buffer.data() + placements[b].offset,
                              want->blocks[b].bytes.data(), block_bytes),
                  0)
            << ns << " block " << b;
        EXPECT_EQ(buffer[placements[b].offset + block_bytes], 0xEE)
            << "past block " << b;
      }
    }
  }
  ExpectNothingHeld(absl::Seconds(5));
}

// The first read into a large DataBuffer has the node fault in its mapping
// of the whole buffer (PrefaultClientBuffer), in 2 MiB steps with a pause
// between them. That runs beside the reads, not on the worker pool ahead
// of their copies: with one worker thread, the read into a 2 GiB buffer
// completes while the prefault still runs (it sleeps 51 ms at the least),
// where it used to wait for all of it (and so did every other client's
// read queued behind it; with 8 client processes a batch waited 330 to
// 660 ms in the peers benchmark).
TEST_P(UcxTest, AReadDoesNotWaitForItsBuffersPrefault) {
  if (GetParam().tcp()) GTEST_SKIP() << "the node maps no buffer over tcp";
  const size_t block_bytes = kernels::Fp16BlockBytes(LargeShape());
  constexpr size_t kBufferBytes = size_t{2} << 30;
  std::unique_ptr<DataBuffer> buffer =
      OneBlockAndAFreshBuffer("prefault", kBufferBytes);
  ASSERT_NE(buffer, nullptr);
  auto read = client_->GetInto("prefault", Keys(0, 1), ReadFormat::kFp16,
                               buffer->span(), block_bytes);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE((*read)->Wait().ok());
  EXPECT_EQ(node_->data_plane()->Stats().prefaulted_buffer_bytes, 0u)
      << "the read waited for the prefault of its whole buffer";
  EXPECT_EQ(std::memcmp(buffer->data(), data_[0].data(), block_bytes), 0);
  // The prefault does end.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (node_->data_plane()->Stats().prefaulted_buffer_bytes == 0 &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(node_->data_plane()->Stats().prefaulted_buffer_bytes, kBufferBytes);
}

// A read into a fresh buffer that comes to a part of it before the
// node's background prefault does faults that part of the node's mapping
// in itself (PopulateAhead), the part it writes and no more; once the
// prefault has ended, reads into the buffer populate nothing.
TEST_P(UcxTest, AReadAheadOfItsBuffersPrefaultFaultsInItsOwnDestination) {
  if (GetParam().tcp()) GTEST_SKIP() << "the node maps no buffer over tcp";
  const size_t block_bytes = kernels::Fp16BlockBytes(LargeShape());
  constexpr size_t kBufferBytes = size_t{2} << 30;
  std::unique_ptr<DataBuffer> buffer =
      OneBlockAndAFreshBuffer("ahead", kBufferBytes);
  ASSERT_NE(buffer, nullptr);
  // The last block of the buffer, which the prefault reaches last.
  const absl::Span<uint8_t> last =
      buffer->span().subspan(kBufferBytes - block_bytes);
  auto read_last = [&] {
    auto read = client_->GetInto("ahead", Keys(0, 1), ReadFormat::kFp16, last,
                                 block_bytes);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE((*read)->Wait().ok());
    EXPECT_EQ(std::memcmp(last.data(), data_[0].data(), block_bytes), 0);
  };
  read_last();
  ucx::DataPlaneStats stats = node_->data_plane()->Stats();
  if (stats.prefaulted_buffer_bytes != 0) {
    GTEST_SKIP() << "the prefault of 2 GiB ended before a read of one "
                    "block (a machine far too loaded): nothing to show";
  }
  EXPECT_EQ(stats.buffer_bytes_populated_by_reads, block_bytes);
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (node_->data_plane()->Stats().prefaulted_buffer_bytes == 0 &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(node_->data_plane()->Stats().prefaulted_buffer_bytes, kBufferBytes);
  read_last();
  EXPECT_EQ(node_->data_plane()->Stats().buffer_bytes_populated_by_reads,
            block_bytes)
      << "a read into a buffer already faulted in populated it again";
  const std::string metrics = node_->metrics()->Render();
  EXPECT_NE(metrics.find(absl::StrCat(
                "kvcache_data_plane_buffer_bytes_populated_by_reads_total ",
                block_bytes, "\n")),
            std::string::npos);
  EXPECT_NE(metrics.find(absl::StrCat(
                "kvcache_data_plane_prefaulted_buffer_bytes_total ",
                kBufferBytes, "\n")),
            std::string::npos);
}

// A read that the client decodes itself lands in a pooled buffer and names
// the DataBuffer it is decoded into: the node keeps that buffer's key and,
// where it maps it (shared memory), faults its mapping in before any read
// lands there, so the reads that the node then decodes into the buffer
// find it warm and populate nothing themselves. Over tcp the node keeps
// the key and maps nothing.
TEST_P(UcxTest, AReadTheClientDecodesNamesItsBufferToTheNode) {
  const kernels::BlockShape shape = LargeShape();
  const size_t block_bytes = kernels::Fp16BlockBytes(shape);
  constexpr int kBlocks = 2;
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("named", Codec::kFp8E4M3, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "named", shape, 0, kBlocks).ok());
  constexpr size_t kBufferBytes = size_t{64} << 20;
  auto buffer = client_->AllocateBuffer(kBufferBytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto read = [&](ReadFormat format) -> std::vector<uint8_t> {
    std::fill((*buffer)->data(), (*buffer)->data() + kBlocks * block_bytes, 0);
    auto pending = client_->GetInto("named", Keys(0, kBlocks), format,
                                    (*buffer)->span(), block_bytes);
    EXPECT_TRUE(pending.ok()) << pending.status();
    if (!pending.ok()) return {};
    EXPECT_TRUE((*pending)->Wait().ok());
    return std::vector<uint8_t>((*buffer)->data(),
                                (*buffer)->data() + kBlocks * block_bytes);
  };
  const ucx::DataPlaneStats before = node_->data_plane()->Stats();
  // The client has heard nothing of this node's mappings: it decodes.
  const std::vector<uint8_t> first = read(ReadFormat::kFp16);
  const ucx::DataPlaneStats named = node_->data_plane()->Stats();
  EXPECT_EQ(named.blocks_decoded_into_destination, 0u);
  if (!GetParam().tcp()) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (node_->data_plane()->Stats().prefaulted_buffer_bytes -
                   before.prefaulted_buffer_bytes <
               kBufferBytes &&
           absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_GE(node_->data_plane()->Stats().prefaulted_buffer_bytes -
                  before.prefaulted_buffer_bytes,
              kBufferBytes)
        << "the node never faulted in the named buffer";
  }
  // Over shared memory the node decodes the next read into the buffer,
  // mapped already; over tcp the client decodes it again.
  EXPECT_EQ(read(ReadFormat::kFp16), first);
  ucx::DataPlaneStats after = node_->data_plane()->Stats();
  EXPECT_EQ(after.blocks_decoded_into_destination,
            GetParam().tcp() ? 0u : uint64_t{kBlocks});
  EXPECT_EQ(after.buffer_bytes_populated_by_reads,
            named.buffer_bytes_populated_by_reads);
  // A raw read lands in the buffer itself, whose key the node has.
  read(ReadFormat::kRaw);
  after = node_->data_plane()->Stats();
  EXPECT_EQ(after.buffer_keys, named.buffer_keys)
      << "the node had not kept the named buffer's key";
  // A read decoded into another buffer: over tcp, where the node has said
  // that it does not map this client's buffers, the client no longer names
  // it (the node would keep a key it never uses); over shared memory the
  // node decodes into it, and keeps its key as the read's own.
  // (Larger than the pooled landing buffer, so not that buffer again.)
  auto other = client_->AllocateBuffer(size_t{16} << 20);
  ASSERT_TRUE(other.ok()) << other.status();
  auto pending = client_->GetInto("named", Keys(0, kBlocks), ReadFormat::kFp16,
                                  (*other)->span(), block_bytes);
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_TRUE((*pending)->Wait().ok());
  EXPECT_EQ(std::memcmp((*other)->data(), first.data(), first.size()), 0);
  EXPECT_EQ(node_->data_plane()->Stats().buffer_keys,
            named.buffer_keys + (GetParam().tcp() ? 0 : 1));
}

// What the client learns about the node mapping its buffers comes from
// reads into DataBuffers only: a read into memory registered for that read
// alone (which UCX's shared memory does not map) neither asks nor counts,
// so the next fp16 read into a DataBuffer is still decoded by the node
// into it.
TEST_P(UcxTest, AReadIntoMemoryRegisteredForItDoesNotUnteachTheClient) {
  if (GetParam().tcp()) GTEST_SKIP() << "the node maps no buffer over tcp";
  const kernels::BlockShape shape = LargeShape();
  const size_t block_bytes = kernels::Fp16BlockBytes(shape);
  constexpr int kBlocks = 3;
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("learn", Codec::kFp8E4M3, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "learn", shape, 0, kBlocks).ok());
  auto buffer = client_->AllocateBuffer(kBlocks * block_bytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto into_buffer = [&]() -> uint64_t {
    const uint64_t before =
        node_->data_plane()->Stats().blocks_decoded_into_destination;
    auto read = client_->GetInto("learn", Keys(0, kBlocks), ReadFormat::kFp16,
                                 (*buffer)->span(), block_bytes);
    EXPECT_TRUE(read.ok()) << read.status();
    if (read.ok()) {
      EXPECT_TRUE((*read)->Wait().ok());
    }
    return node_->data_plane()->Stats().blocks_decoded_into_destination -
           before;
  };
  into_buffer();  // learns, if no read has taught it yet
  EXPECT_EQ(into_buffer(), uint64_t{kBlocks});
  // The raw encoding into heap memory, registered for this read.
  std::vector<uint8_t> heap(kBlocks * block_bytes);
  auto raw = client_->GetInto("learn", Keys(0, kBlocks), ReadFormat::kRaw,
                              absl::MakeSpan(heap), block_bytes);
  ASSERT_TRUE(raw.ok()) << raw.status();
  ASSERT_TRUE((*raw)->Wait().ok());
  EXPECT_EQ(into_buffer(), uint64_t{kBlocks})
      << "a read into memory the node does not map untaught the client";
}

// An fp16 read into a DataBuffer by a client that decodes reads itself
// (decode_on_client): once a read's status has said that the node maps
// this client's buffers (shared memory), the client asks the node to decode
// there (decode_into_destination), and the node decodes each block straight
// into the buffer, checked in the same pass, with the bytes its decoder
// gives in BeginRead (every codec, fp16 and bf16 sources, KIVI mixed with
// its fp16 residual window; whole blocks and layer by layer). Over tcp the
// node says that it does not map them, and the client goes on reading raw.
TEST_P(UcxTest, ANodeThatMapsTheDestinationDecodesIntoIt) {
  std::unique_ptr<Client> node_decodes = NewClient(DataPlane::kUcx, false);
  const bool shm = !GetParam().tcp();
  const kernels::BlockShape fp16 = LargeShape();
  kernels::BlockShape bf16 = fp16;
  bf16.source_dtype = kernels::SourceDtype::kBf16;
  constexpr int kBlocks = 6;
  for (const kernels::BlockShape& shape : {fp16, bf16}) {
    const size_t block_bytes = kernels::Fp16BlockBytes(shape);
    const size_t layer_bytes = block_bytes / shape.num_layers;
    auto buffer = client_->AllocateBuffer(kBlocks * block_bytes);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    for (Codec codec : kernels::kAllCodecs) {
      const bool bf = shape.source_dtype == kernels::SourceDtype::kBf16;
      const std::string ns =
          absl::StrCat("into-", kernels::CodecName(codec), bf ? "-bf16" : "");
      NamespaceSpec spec = Spec(ns, codec, shape);
      spec.residual_tokens = 64;  // KIVI: the last 2 blocks of a chain fp16
      ASSERT_TRUE(client_->RegisterNamespace(spec).ok());
      ASSERT_TRUE(PutSettledChain(ns, shape, kBlocks, 300));
      auto want = node_decodes->Get(ns, Keys(0, kBlocks), ReadFormat::kFp16);
      ASSERT_TRUE(want.ok()) << ns << ": " << want.status();
      uint64_t encoded = 0;
      for (const BlockData& b : want->blocks) {
        encoded += b.codec != Codec::kNone ? 1 : 0;
      }
      // Round 0 may be the one that tells the client; 1 and 2 are decoded
      // by the node over shared memory.
      for (int round = 0; round < 3; ++round) {
        SCOPED_TRACE(absl::StrCat(ns, " round ", round));
        std::memset((*buffer)->data(), 0xEE, (*buffer)->size());
        const ucx::DataPlaneStats before = node_->data_plane()->Stats();
        ReadOptions options;
        options.format = ReadFormat::kFp16;
        options.layer_by_layer = round == 2;
        auto read = client_->GetInto(ns, Keys(0, kBlocks), options,
                                     (*buffer)->span(), block_bytes);
        ASSERT_TRUE(read.ok()) << read.status();
        if (options.layer_by_layer) {
          ASSERT_TRUE((*read)->WaitLayer(0).ok());
          for (int b = 0; b < kBlocks; ++b) {
            ASSERT_EQ(std::memcmp((*buffer)->data() + b * block_bytes,
                                  want->blocks[b].bytes.data(), layer_bytes),
                      0)
                << "layer 0 of block " << b;
          }
        }
        ASSERT_TRUE((*read)->Wait().ok());
        for (int b = 0; b < kBlocks; ++b) {
          EXPECT_EQ((*read)->metadata().blocks[b].format, ReadFormat::kFp16);
          ASSERT_EQ(std::memcmp((*buffer)->data() + b * block_bytes,
                                want->blocks[b].bytes.data(), block_bytes),
                    0)
              << "block " << b;
        }
        const ucx::DataPlaneStats after = node_->data_plane()->Stats();
        const uint64_t into = after.blocks_decoded_into_destination -
                              before.blocks_decoded_into_destination;
        EXPECT_EQ(after.blocks_decoded_at_read_start,
                  before.blocks_decoded_at_read_start);
        if (round > 0) {
          EXPECT_EQ(into, shm ? encoded : 0);
        }
      }
    }
  }
  ExpectNothingHeld(absl::Seconds(5));
}

// A read destroyed before the client's progress thread has sent it (a
// loaded client: StartRead only queues the ReadStart there) is never sent,
// and its destructor does not wait for that thread: no byte of it lands
// after the destructor. The destructor used to take the read for one on a
// connection where closing stops the node (kSettleGrace, then close); the
// ReadStart went out before the close and, over shared memory, the node's
// puts landed after the destructor (CI and a loaded rerun of
// PausedNodeEndsCalls...: "block 0 was not all there when the read ended",
// then SEGFAULT in ucp_put_handler, a put into freed memory).
TEST_P(UcxTest, AReadDestroyedBeforeItIsSentLandsNothing) {
  const kernels::BlockShape shape = LargeShape();
  const size_t block_bytes = kernels::Fp16BlockBytes(shape);
  constexpr int kBlocks = 4;
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("unsent", Codec::kNone, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "unsent", shape, 0, kBlocks).ok());
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  // Starts a read of blocks [0, kBlocks) by hand into `heap`.
  auto start_read = [&](std::vector<uint8_t>& heap) {
    return StartReadByHand(
        **plane,
        BeginPlaneRead("unsent", 0, kBlocks, kvcache::v1::READ_FORMAT_FP16),
        heap, block_bytes, shape.num_layers, /*per_layer=*/false);
  };
  std::vector<uint8_t> unsent(kBlocks * block_bytes, 0xEE);
  Notification go;
  ASSERT_TRUE((*plane)->PostForTest(
      [&go] { go.WaitForNotificationWithTimeout(absl::Seconds(30)); }));
  auto read = start_read(unsent);
  ASSERT_TRUE(read.ok()) << read.status();
  Notification destroyed;
  std::thread destroyer([&] {
    read->reset();
    destroyed.Notify();
  });
  EXPECT_TRUE(destroyed.WaitForNotificationWithTimeout(absl::Seconds(2)))
      << "the destructor waited for the progress thread";
  go.Notify();
  destroyer.join();

  // A read after it, on the same plane, lands; the first one's memory
  // stays as it was.
  std::vector<uint8_t> sent(kBlocks * block_bytes, 0);
  auto next = start_read(sent);
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(
      (*next)
          ->WaitLayers(shape.num_layers, absl::Now() + absl::Seconds(20))
          .ok());
  for (int b = 0; b < kBlocks; ++b) {
    EXPECT_EQ(std::memcmp(sent.data() + b * block_bytes, data_[b].data(),
                          block_bytes),
              0)
        << "block " << b;
  }
  EXPECT_TRUE(std::all_of(unsent.begin(), unsent.end(), [](uint8_t v) {
    return v == 0xEE;
  })) << "a read destroyed before it was sent landed";
}

// A PendingRead destroyed while its ReadStart is still queued for the
// client's progress thread is never sent (AReadDestroyedBeforeItIsSent...):
// the node, which leased the blocks at BeginRead, hears of it from the
// client's EndRead, at once, not when the lease's TTL runs out. Both reads
// into caller memory: fp16 blocks straight into it, fp8 ones into a landing
// buffer to be decoded from.
TEST_P(UcxTest, AGetIntoAbandonedBeforeItIsSentEndsItsLease) {
  StartNode(256ull << 20, 64ull << 20, /*ttl=*/absl::Seconds(120));
  const kernels::BlockShape shape = LargeShape();
  constexpr int kBlocks = 4;
  const size_t stride = kernels::Fp16BlockBytes(shape);
  std::vector<uint8_t> dest(kBlocks * stride, 0xEE);
  // The node's read leases once none is left, or at `within`.
  auto read_leases_within = [&](absl::Duration within) {
    uint32_t leases = 0;
    const absl::Time give_up = absl::Now() + within;
    while ((leases = node_->store()->Stats().active_read_leases) != 0 &&
           absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return leases;
  };
  for (Codec codec : {Codec::kNone, Codec::kFp8E4M3}) {
    const std::string ns = absl::StrCat("abandoned-", static_cast<int>(codec));
    SCOPED_TRACE(ns);
    ASSERT_TRUE(client_->RegisterNamespace(Spec(ns, codec, shape)).ok());
    ASSERT_TRUE(PutChain(client_.get(), ns, shape, 0, kBlocks).ok());
    // The last iteration's read ends its lease as its transfer ends.
    ASSERT_EQ(read_leases_within(absl::Seconds(10)), 0u);
    auto plane = internal::ClientTestAccess::Plane(*client_);
    ASSERT_TRUE(plane.ok()) << plane.status();
    // Shared with the held task, and let go on every way out of this
    // iteration, a failed ASSERT included.
    auto go = std::make_shared<Notification>();
    absl::Cleanup let_go = [go] {
      if (!go->HasBeenNotified()) go->Notify();
    };
    ASSERT_TRUE((*plane)->PostForTest(
        [go] { go->WaitForNotificationWithTimeout(absl::Seconds(30)); }));
    auto read = client_->GetInto(ns, Keys(0, kBlocks), ReadFormat::kFp16,
                                 absl::MakeSpan(dest), stride);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE((*read)->over_data_plane());
    EXPECT_EQ(node_->store()->Stats().active_read_leases, 1u);
    read->reset();
    const uint32_t leases = read_leases_within(absl::Seconds(10));
    go->Notify();
    EXPECT_EQ(leases, 0u) << "the node still holds the abandoned read's lease";
    // The plane goes on: the same blocks read through it land.
    auto again = client_->Get(ns, Keys(0, kBlocks), ReadFormat::kRaw);
    ASSERT_TRUE(again.ok()) << again.status();
  }
}

// decode_into_destination where the node cannot map the destination (tcp;
// memory a client registered for one read, which UCX's shared memory does
// not map): the node decodes the encoded blocks into staging when the
// transfer starts, then sends them as it sends other copies, with the same
// bytes. A block whose stored bytes were corrupted fails such a read with
// DATA_LOSS, on either path, and is dropped; nothing is held after.
TEST_P(UcxTest, ADecodeTheNodeCannotMapGoesThroughStagingAndIsChecked) {
  const kernels::BlockShape shape = LargeShape();
  const size_t block_bytes = kernels::Fp16BlockBytes(shape);
  constexpr int kBlocks = 4;
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("unmapped", Codec::kFp8E4M3, shape))
          .ok());
  ASSERT_TRUE(PutChain(client_.get(), "unmapped", shape, 0, kBlocks).ok());
  std::unique_ptr<Client> node_decodes = NewClient(DataPlane::kUcx, false);
  auto want = node_decodes->Get("unmapped", Keys(0, kBlocks));
  ASSERT_TRUE(want.ok()) << want.status();
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  // Reads blocks [0, kBlocks) by hand into heap memory, asking the node to
  // decode into it.
  auto read_by_hand = [&](std::vector<uint8_t>& heap) -> absl::Status {
    const kvcache::v1::BeginReadResponse response =
        BeginPlaneRead("unmapped", 0, kBlocks, kvcache::v1::READ_FORMAT_FP16,
                       /*decode_into_destination=*/true);
    EXPECT_TRUE(response.data_plane().decodes_into_destination());
    for (const auto& b : response.blocks()) EXPECT_EQ(b.length(), block_bytes);
    auto read = StartReadByHand(**plane, response, heap, block_bytes,
                                shape.num_layers, /*per_layer=*/true);
    if (!read.ok()) return read.status();
    return (*read)->WaitLayers(shape.num_layers,
                               absl::Now() + absl::Seconds(20));
  };
  std::vector<uint8_t> heap(kBlocks * block_bytes, 0xEE);
  const ucx::DataPlaneStats before = node_->data_plane()->Stats();
  ASSERT_TRUE(read_by_hand(heap).ok());
  for (int b = 0; b < kBlocks; ++b) {
    ASSERT_EQ(std::memcmp(heap.data() + b * block_bytes,
                          want->blocks[b].bytes.data(), block_bytes),
              0)
        << "block " << b;
  }
  const ucx::DataPlaneStats after = node_->data_plane()->Stats();
  EXPECT_EQ(
      after.blocks_decoded_at_read_start - before.blocks_decoded_at_read_start,
      uint64_t{kBlocks});
  EXPECT_EQ(after.blocks_decoded_into_destination,
            before.blocks_decoded_into_destination);
  ExpectNothingHeld(absl::Seconds(5));

  ASSERT_TRUE(node_->store()
                  ->CorruptBlockForTest("unmapped", Key(2), /*header=*/false,
                                        block_bytes / 8)
                  .ok());
  const absl::Status failed = read_by_hand(heap);
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), "block 2")) << failed;
  EXPECT_EQ(node_->store()->Stats().data_loss_events, 1u);
  EXPECT_EQ(client_->Get("unmapped", Keys(2, 1)).status().code(),
            absl::StatusCode::kNotFound);
  ExpectNothingHeld(absl::Seconds(5));
}

// Over shared memory, a block that fails its check as the node decodes it
// into the client's buffer fails the read with DATA_LOSS before that
// block's layer is reported, and is dropped.
TEST_P(UcxTest, ACorruptBlockDecodedIntoTheDestinationFailsTheRead) {
  if (GetParam().tcp()) GTEST_SKIP() << "the node maps no buffer over tcp";
  const kernels::BlockShape shape = LargeShape();
  const size_t block_bytes = kernels::Fp16BlockBytes(shape);
  constexpr int kBlocks = 4;
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("mapped", Codec::kFp8E4M3, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "mapped", shape, 0, kBlocks).ok());
  auto buffer = client_->AllocateBuffer(kBlocks * block_bytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  // The first read tells the client that the node maps its buffers.
  auto first = client_->GetInto("mapped", Keys(0, kBlocks), ReadFormat::kFp16,
                                (*buffer)->span(), block_bytes);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->Wait().ok());
  first->reset();
  ASSERT_TRUE(node_->store()
                  ->CorruptBlockForTest("mapped", Key(1), /*header=*/false,
                                        block_bytes / 4)
                  .ok());
  const uint64_t into_before =
      node_->data_plane()->Stats().blocks_decoded_into_destination;
  auto read = client_->GetInto("mapped", Keys(0, kBlocks), ReadFormat::kFp16,
                               (*buffer)->span(), block_bytes);
  ASSERT_TRUE(read.ok()) << read.status();
  const absl::Status failed = (*read)->Wait();
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), "block 1")) << failed;
  EXPECT_GT(node_->data_plane()->Stats().blocks_decoded_into_destination,
            into_before);
  EXPECT_EQ(node_->store()->Stats().data_loss_events, 1u);
  EXPECT_EQ(client_->Get("mapped", Keys(1, 1)).status().code(),
            absl::StatusCode::kNotFound);
  read->reset();
  ExpectNothingHeld(absl::Seconds(5));
}

// A DataBuffer comes faulted in, as a registration for RDMA would leave it:
// every page is resident when AllocateBuffer returns, so the first read into
// it costs no page fault per page of the destination (measured over tcp
// before: a first read into a fresh 512 MiB buffer ran at 360 MiB/s, the
// next ones at 2000). Residency is asked of the kernel (mincore) rather than
// counted in faults, which a sanitizer's shadow memory adds to.
TEST_P(UcxTest, AnAllocatedBufferIsResidentAtOnce) {
  constexpr size_t kBytes = 64 << 20;
  constexpr size_t kPage = 4096;
  auto buffer = client_->AllocateBuffer(kBytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  ASSERT_TRUE((*buffer)->registered());
  ASSERT_EQ(reinterpret_cast<uintptr_t>((*buffer)->data()) % kPage, 0u);
  std::vector<unsigned char> pages(kBytes / kPage);
  ASSERT_EQ(mincore((*buffer)->data(), kBytes, pages.data()), 0)
      << std::strerror(errno);
  const size_t resident = static_cast<size_t>(std::count_if(
      pages.begin(), pages.end(), [](unsigned char c) { return c & 1; }));
  EXPECT_EQ(resident, pages.size())
      << resident << " of " << pages.size() << " pages resident";
}

// Layer by layer into a DataBuffer: where the node copies the read itself
// (shared memory), several pool threads copy a read's layers at once and
// finish in any order; a layer is reported only once it and every layer
// before it are in the buffer. 48 blocks of 16 layers (a layer of every
// block is 6 MiB, two copy tasks), read 8 times, by a node with 8 worker
// threads on however few cores, so that copies overtake each other.
TEST_P(UcxTest, EachLayerIsThereWhenItIsReportedHoweverTheCopiesFinish) {
  StartNode(256ull << 20, 64ull << 20, absl::Seconds(30), /*worker_threads=*/8);
  const kernels::BlockShape shape{16, 8, 128, 32};
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("ordered", Codec::kNone, shape)).ok());
  constexpr int kBlocks = 48;
  for (int first = 0; first < kBlocks; first += 8) {
    ASSERT_TRUE(PutChain(client_.get(), "ordered", shape, first, 8).ok());
  }
  const size_t stride = kernels::Fp16BlockBytes(shape);
  const size_t layer = stride / shape.num_layers;
  auto buffer = client_->AllocateBuffer(kBlocks * stride);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  for (int round = 0; round < 8; ++round) {
    std::memset((*buffer)->data(), 0xEE, (*buffer)->size());
    auto read = client_->GetInto("ordered", Keys(0, kBlocks), ReadFormat::kFp16,
                                 (*buffer)->span(), stride);
    ASSERT_TRUE(read.ok()) << read.status();
    for (uint32_t l = 0; l < shape.num_layers; ++l) {
      const absl::Status landed = (*read)->WaitLayer(l);
      ASSERT_TRUE(landed.ok())
          << "round " << round << " layer " << l << ": " << landed;
      for (int b = 0; b < kBlocks; ++b) {
        const uint8_t* want =
            reinterpret_cast<const uint8_t*>(data_[b].data()) + l * layer;
        ASSERT_EQ(std::memcmp((*buffer)->data() + b * stride + l * layer, want,
                              layer),
                  0)
            << "round " << round << ": layer " << l << " of block " << b
            << " was reported before it was there";
      }
    }
    ASSERT_TRUE((*read)->Wait().ok());
  }
  if (!GetParam().tcp()) {
    EXPECT_GT(node_->data_plane()->Stats().copied_reads, 0u);
  }
}

// The node checks each layer of a block it reads in place as it copies it
// (shared memory) or before it sends it (tcp), not in BeginRead: a corrupt
// layer fails the read with DATA_LOSS before that layer is reported, the
// layers reported before it are exact, and the block is dropped.
TEST_P(UcxTest, ACorruptLayerFailsTheReadBeforeItIsReported) {
  const kernels::BlockShape shape{4, 8, 128, 32};
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("checked", Codec::kNone, shape)).ok());
  constexpr int kBlocks = 8;
  ASSERT_TRUE(PutChain(client_.get(), "checked", shape, 0, kBlocks).ok());
  const size_t stride = kernels::Fp16BlockBytes(shape);
  const size_t layer = stride / shape.num_layers;
  constexpr uint32_t kCorruptLayer = 2;
  ASSERT_TRUE(node_->store()
                  ->CorruptBlockForTest("checked", Key(5), /*header=*/false,
                                        kCorruptLayer * layer + 3)
                  .ok());
  auto buffer = client_->AllocateBuffer(kBlocks * stride);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memset((*buffer)->data(), 0xEE, (*buffer)->size());
  auto read = client_->GetInto("checked", Keys(0, kBlocks), ReadFormat::kFp16,
                               (*buffer)->span(), stride);
  ASSERT_TRUE(read.ok()) << read.status();
  absl::Status failed;
  for (uint32_t l = 0; l < shape.num_layers && failed.ok(); ++l) {
    failed = (*read)->WaitLayer(l);
    if (!failed.ok()) break;
    ASSERT_LT(l, kCorruptLayer) << "the corrupt layer was reported";
    for (int b = 0; b < kBlocks; ++b) {
      const uint8_t* want =
          reinterpret_cast<const uint8_t*>(data_[b].data()) + l * layer;
      ASSERT_EQ(
          std::memcmp((*buffer)->data() + b * stride + l * layer, want, layer),
          0)
          << "layer " << l << " of block " << b << " was reported wrong";
    }
  }
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), "block 5")) << failed;
  EXPECT_EQ((*read)->Wait().code(), absl::StatusCode::kDataLoss);
  ExpectDroppedAndTheRestExact("checked", 5, stride);
  const ucx::DataPlaneStats stats = node_->data_plane()->Stats();
  if (GetParam().tcp()) {
    EXPECT_GT(stats.reads_checked_before_sending, 0u);
    EXPECT_EQ(stats.reads_checked_while_copying, 0u);
  } else {
    EXPECT_GT(stats.reads_checked_while_copying, 0u);
  }
  ExpectNothingHeld(absl::Seconds(5));
}

// A read that is not layer by layer (ReadOptions::layer_by_layer = false)
// goes as whole blocks, a slice each, lands exact, and decodes on the
// client to the same bytes as a layer-wise read; a layer-wise read posts a
// slice per layer. Several clients, so that a node with several progress
// threads serves them on different shards and its stats add them all up.
TEST_P(UcxTest, AReadThatIsNotLayerByLayerGoesAsWholeBlocks) {
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("whole", Codec::kNone, shape)).ok());
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("whole8", Codec::kFp8E4M3, shape)).ok());
  constexpr int kBlocks = 6;
  ASSERT_TRUE(PutChain(client_.get(), "whole8", shape, 0, kBlocks).ok());
  ASSERT_TRUE(PutChain(client_.get(), "whole", shape, 0, kBlocks).ok());
  const size_t stride = kernels::Fp16BlockBytes(shape);
  std::vector<std::unique_ptr<Client>> others;
  for (int i = 0; i < 3; ++i) others.push_back(NewClient(DataPlane::kUcx));
  std::vector<Client*> clients = {client_.get()};
  for (auto& c : others) clients.push_back(c.get());
  auto slices = [&] { return node_->data_plane()->Stats().read_slices_posted; };
  // Reads `ns` into a fresh buffer; returns its bytes and the slices the
  // node posted for it.
  auto read = [&](Client* client, const std::string& ns, bool layer_by_layer,
                  std::string* bytes) -> absl::StatusOr<uint64_t> {
    auto buffer = client->AllocateBuffer(kBlocks * stride);
    if (!buffer.ok()) return buffer.status();
    std::memset((*buffer)->data(), 0xEE, (*buffer)->size());
    ReadOptions options;
    options.layer_by_layer = layer_by_layer;
    const uint64_t before = slices();
    auto pending = client->GetInto(ns, Keys(0, kBlocks), options,
                                   (*buffer)->span(), stride);
    if (!pending.ok()) return pending.status();
    if (absl::Status s = (*pending)->WaitLayer(0); !s.ok()) return s;
    if (absl::Status s = (*pending)->Wait(); !s.ok()) return s;
    if (!(*pending)->over_data_plane()) {
      return absl::InternalError("read inline");
    }
    bytes->assign(reinterpret_cast<const char*>((*buffer)->data()),
                  kBlocks * stride);
    return slices() - before;
  };
  for (size_t c = 0; c < clients.size(); ++c) {
    SCOPED_TRACE(absl::StrCat("client ", c));
    std::string whole, layered;
    absl::StatusOr<uint64_t> posted = read(clients[c], "whole", false, &whole);
    ASSERT_TRUE(posted.ok()) << posted.status();
    EXPECT_EQ(*posted, static_cast<uint64_t>(kBlocks));
    for (int b = 0; b < kBlocks; ++b) {
      EXPECT_EQ(std::memcmp(whole.data() + b * stride, data_[b].data(), stride),
                0)
          << "block " << b;
    }
    posted = read(clients[c], "whole", true, &layered);
    ASSERT_TRUE(posted.ok()) << posted.status();
    EXPECT_EQ(*posted, shape.num_layers);
    EXPECT_TRUE(layered == whole);
    // fp8 blocks travel raw and are decoded here, layer by layer or not;
    // or, once the node has said that it maps this client's buffers
    // (shared memory), the node decodes them into the buffer.
    posted = read(clients[c], "whole8", false, &whole);
    ASSERT_TRUE(posted.ok()) << posted.status();
    EXPECT_EQ(*posted, static_cast<uint64_t>(kBlocks));
    posted = read(clients[c], "whole8", true, &layered);
    ASSERT_TRUE(posted.ok()) << posted.status();
    EXPECT_EQ(*posted, shape.num_layers);
    EXPECT_TRUE(layered == whole) << "fp8 decoded differently";
  }
  const ucx::DataPlaneStats stats = node_->data_plane()->Stats();
  // Every read above handed its checks to the data plane.
  EXPECT_EQ(
      stats.reads_checked_while_copying + stats.reads_checked_before_sending,
      clients.size() * 4);
  // And the metrics say what the stats say.
  const std::string metrics = node_->metrics()->Render();
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, uint64_t>>{
           {"reads_checked_while_copying", stats.reads_checked_while_copying},
           {"reads_checked_before_sending", stats.reads_checked_before_sending},
           {"read_slices_posted", stats.read_slices_posted}}) {
    EXPECT_NE(metrics.find(absl::StrCat("kvcache_data_plane_", name, "_total ",
                                        value, "\n")),
              std::string::npos)
        << name;
  }
  ExpectNothingHeld(absl::Seconds(5));
}

// A whole-block read (not layer by layer) of a corrupt block fails
// DATA_LOSS naming it, reports no layer before that, drops the block and
// holds nothing afterwards; the other blocks read exact.
TEST_P(UcxTest, ACorruptBlockFailsAWholeBlockRead) {
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("whole-bad", Codec::kNone, shape)).ok());
  constexpr int kBlocks = 8;
  ASSERT_TRUE(PutChain(client_.get(), "whole-bad", shape, 0, kBlocks).ok());
  const size_t stride = kernels::Fp16BlockBytes(shape);
  const size_t layer = stride / shape.num_layers;
  ASSERT_TRUE(node_->store()
                  ->CorruptBlockForTest("whole-bad", Key(5), /*header=*/false,
                                        2 * layer + 3)
                  .ok());
  auto buffer = client_->AllocateBuffer(kBlocks * stride);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  ReadOptions options;
  options.layer_by_layer = false;
  auto read = client_->GetInto("whole-bad", Keys(0, kBlocks), options,
                               (*buffer)->span(), stride);
  ASSERT_TRUE(read.ok()) << read.status();
  const absl::Status first = (*read)->WaitLayer(0);
  EXPECT_EQ(first.code(), absl::StatusCode::kDataLoss) << first;
  EXPECT_TRUE(absl::StrContains(first.message(), "block 5")) << first;
  EXPECT_EQ((*read)->Wait().code(), absl::StatusCode::kDataLoss);
  ExpectDroppedAndTheRestExact("whole-bad", 5, stride);
  ExpectNothingHeld(absl::Seconds(5));
}

// Where the node maps a client's long-lived buffer (shared memory), it
// faults the whole mapping in when it first keeps the buffer's key, on a
// background thread, and the reads into it stay exact; over tcp it maps
// nothing.
TEST_P(UcxTest, ALongLivedBufferIsFaultedInWhereTheNodeMapsIt) {
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("mapped", Codec::kNone, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "mapped", shape, 0, 4).ok());
  const size_t stride = kernels::Fp16BlockBytes(shape);
  constexpr size_t kBufferBytes = 16 << 20;
  auto buffer = client_->AllocateBuffer(kBufferBytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  ASSERT_TRUE((*buffer)->registered());
  for (int round = 0; round < 2; ++round) {
    std::memset((*buffer)->data(), 0xEE, 4 * stride);
    auto read = client_->GetInto(
        "mapped", Keys(0, 4), ReadFormat::kFp16,
        absl::MakeSpan((*buffer)->data(), kBufferBytes), stride);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE((*read)->Wait().ok());
    for (int b = 0; b < 4; ++b) {
      EXPECT_EQ(
          std::memcmp((*buffer)->data() + b * stride, data_[b].data(), stride),
          0)
          << "round " << round << " block " << b;
    }
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  uint64_t prefaulted = 0;
  while ((prefaulted = node_->data_plane()->Stats().prefaulted_buffer_bytes) <
             kBufferBytes &&
         !GetParam().tcp() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (GetParam().tcp()) {
    EXPECT_EQ(prefaulted, 0u);
  } else {
    // Once: the second read reuses the key.
    EXPECT_GE(prefaulted, kBufferBytes);
    EXPECT_LT(prefaulted, 2 * kBufferBytes);
  }
  ExpectNothingHeld(absl::Seconds(5));
}

TEST_P(UcxTest, DataBuffersKeepTheirKeyUntilTheClientLetsThemGo) {
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("buffers", Codec::kNone, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "buffers", shape, 0, 4).ok());
  const size_t stride = kernels::Fp16BlockBytes(shape);
  auto waits_for_keys = [&](uint32_t want) {
    absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (node_->data_plane()->Stats().buffer_keys != want &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return node_->data_plane()->Stats().buffer_keys;
  };
  {
    auto buffer = client_->AllocateBuffer(4 * stride);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    ASSERT_TRUE((*buffer)->registered());
    ASSERT_EQ((*buffer)->size(), 4 * stride);
    // Reads at different offsets of one buffer, fp16 (in place) and raw.
    for (int round = 0; round < 3; ++round) {
      const int first = round % 2;
      const int n = 4 - first;
      std::memset((*buffer)->data(), 0xEE, (*buffer)->size());
      auto dest = (*buffer)->span().subspan(first * stride);
      auto read = client_->GetInto("buffers", Keys(first, n), ReadFormat::kFp16,
                                   dest, stride);
      ASSERT_TRUE(read.ok()) << read.status();
      EXPECT_TRUE((*read)->over_data_plane());
      ASSERT_TRUE((*read)->Wait().ok());
      for (int b = 0; b < n; ++b) {
        EXPECT_EQ(std::memcmp(dest.data() + b * stride, data_[first + b].data(),
                              stride),
                  0)
            << "round " << round << " block " << b;
      }
    }
    EXPECT_EQ(waits_for_keys(1), 1u) << "one key kept for the buffer";
  }
  // A freed buffer stays registered for reuse: the next one of its size
  // gets its memory, and the node still has one key for it.
  {
    auto again = client_->AllocateBuffer(4 * stride);
    ASSERT_TRUE(again.ok()) << again.status();
    auto read = client_->GetInto("buffers", Keys(0, 1), ReadFormat::kFp16,
                                 (*again)->span(), stride);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE((*read)->Wait().ok());
    EXPECT_EQ(std::memcmp((*again)->data(), data_[0].data(), stride), 0);
    EXPECT_EQ(node_->data_plane()->Stats().buffer_keys, 1u);
  }
  // With no idle memory allowed, freeing a buffer tells the node to drop
  // its key.
  {
    ClientOptions copts;
    copts.target = Target();
    copts.timeout = absl::Seconds(20);
    copts.data_plane = DataPlane::kUcx;
    copts.max_idle_buffer_bytes = 0;
    auto strict = Client::Connect(copts);
    ASSERT_TRUE(strict.ok());
    auto buffer = (*strict)->AllocateBuffer(stride);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    auto read = (*strict)->GetInto("buffers", Keys(0, 1), ReadFormat::kFp16,
                                   (*buffer)->span(), stride);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE((*read)->Wait().ok());
    read->reset();
    EXPECT_EQ(waits_for_keys(2), 2u);
    buffer->reset();
    EXPECT_EQ(waits_for_keys(1), 1u);
  }
  // Plain memory is registered per read and leaves no key behind (the one
  // key is the pooled buffer's).
  std::vector<uint8_t> heap(2 * stride);
  auto read = client_->GetInto("buffers", Keys(0, 2), ReadFormat::kRaw,
                               absl::MakeSpan(heap), stride);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE((*read)->Wait().ok());
  EXPECT_EQ(std::memcmp(heap.data(), data_[0].data(), stride), 0);
  EXPECT_EQ(node_->data_plane()->Stats().buffer_keys, 1u);
  // Puts from a buffer send from its registration: the bytes arrive intact.
  {
    auto source = client_->AllocateBuffer(2 * stride);
    ASSERT_TRUE(source.ok()) << source.status();
    std::vector<BlockWrite> writes;
    for (int i = 0; i < 2; ++i) {
      std::vector<uint16_t> block = RandomBlock(shape, 500 + i);
      auto* at = reinterpret_cast<uint16_t*>((*source)->data() + i * stride);
      std::memcpy(at, block.data(), stride);
      writes.push_back({Key(500 + i), "", absl::MakeConstSpan(at, stride / 2)});
    }
    auto put = client_->Put("buffers", writes);
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->stored, 2u);
    auto back = grpc_client_->Get("buffers", Keys(500, 2), ReadFormat::kFp16);
    ASSERT_TRUE(back.ok()) << back.status();
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(std::memcmp(back->blocks[i].bytes.data(),
                            (*source)->data() + i * stride, stride),
                0);
    }
  }
  // A client without a data plane hands out plain memory.
  auto plain = grpc_client_->AllocateBuffer(stride);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE((*plain)->registered());
  EXPECT_EQ(client_->AllocateBuffer(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  ExpectNothingHeld(absl::Seconds(5));
}

// Get over the data plane lands in a pooled, registered region: repeated
// reads reuse it, so the node keeps one key for it instead of mapping a
// fresh region per read.
TEST_P(UcxTest, GetReusesItsLandingZone) {
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("landing", Codec::kNone, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "landing", shape, 0, 3).ok());
  for (int round = 0; round < 4; ++round) {
    auto got = client_->Get("landing", Keys(0, 3), ReadFormat::kFp16);
    ASSERT_TRUE(got.ok()) << got.status();
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(got->blocks[i].bytes.size(), data_[i].size() * 2);
      EXPECT_EQ(std::memcmp(got->blocks[i].bytes.data(), data_[i].data(),
                            data_[i].size() * 2),
                0)
          << "round " << round << " block " << i;
    }
  }
  EXPECT_EQ(node_->data_plane()->Stats().buffer_keys, 1u);
  ExpectNothingHeld(absl::Seconds(5));
}

// allow_missing over the data plane: the blocks that are there travel over
// UCX into their keys' slots; the missing ones are listed; a read with
// nothing to move needs no data-plane session at all.
TEST_P(UcxTest, AllowMissingMovesWhatIsThereOverTheDataPlane) {
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("partial", Codec::kFp8E4M3, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "partial", shape, 0, 3).ok());
  ASSERT_TRUE(PutChain(client_.get(), "partial", shape, 5, 1).ok());
  const std::vector<uint32_t> missing = {3, 4};
  const std::vector<uint32_t> found = {0, 1, 2, 5};
  ReadOptions partial;
  partial.allow_missing = true;
  const size_t stride = kernels::Fp16BlockBytes(shape);
  for (ReadFormat format : {ReadFormat::kRaw, ReadFormat::kFp16}) {
    partial.format = format;
    auto ucx = client_->Get("partial", Keys(0, 6), partial);
    auto inline_read = grpc_client_->Get("partial", Keys(0, 6), partial);
    ASSERT_TRUE(ucx.ok()) << ucx.status();
    ASSERT_TRUE(inline_read.ok()) << inline_read.status();
    EXPECT_EQ(ucx->missing, missing);
    EXPECT_EQ(inline_read->missing, missing);
    ASSERT_EQ(ucx->blocks.size(), found.size());
    for (size_t j = 0; j < found.size(); ++j) {
      EXPECT_EQ(ucx->blocks[j].index, found[j]);
      EXPECT_EQ(ucx->blocks[j].bytes, inline_read->blocks[j].bytes);
    }
    std::vector<uint8_t> buffer(6 * stride, 0xEE);
    auto read = client_->GetInto("partial", Keys(0, 6), partial,
                                 absl::MakeSpan(buffer), stride);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE((*read)->over_data_plane());
    ASSERT_TRUE((*read)->Wait().ok());
    EXPECT_EQ((*read)->metadata().missing, missing);
    ASSERT_EQ((*read)->placements().size(), found.size());
    for (size_t j = 0; j < found.size(); ++j) {
      const BlockPlacement& p = (*read)->placements()[j];
      EXPECT_EQ(p.offset, found[j] * stride);
      ASSERT_EQ(p.length, inline_read->blocks[j].bytes.size());
      EXPECT_EQ(std::memcmp(buffer.data() + p.offset,
                            inline_read->blocks[j].bytes.data(), p.length),
                0)
          << "block " << found[j];
    }
    for (uint32_t m : missing) {
      EXPECT_EQ(std::count(buffer.begin() + m * stride,
                           buffer.begin() + (m + 1) * stride, 0xEE),
                static_cast<std::ptrdiff_t>(stride));
    }
  }
  // Nothing there: no session, and a UCX-only client does not mind.
  auto none = client_->Get("partial", Keys(10, 2), partial);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->blocks.empty());
  std::vector<uint8_t> buffer(2 * stride);
  auto none_into = client_->GetInto("partial", Keys(10, 2), partial,
                                    absl::MakeSpan(buffer), stride);
  ASSERT_TRUE(none_into.ok()) << none_into.status();
  EXPECT_FALSE((*none_into)->over_data_plane());
  EXPECT_TRUE((*none_into)->Wait().ok());
  ExpectNothingHeld(absl::Seconds(5));
}

TEST_P(UcxTest, ConnectionsWithoutAValidTokenAreClosed) {
  auto loop = ucx::WorkerLoop::Start({});
  ASSERT_TRUE(loop.ok()) << loop.status();
  const std::string listener = absl::StrCat("127.0.0.1:", node_->ucx_port());
  const std::string worker_address = node_->data_plane()->worker_address();
  const bool tcp = GetParam().tcp();
  auto run = [&](std::function<void()> fn) {
    std::promise<void> done;
    ASSERT_TRUE((*loop)->Post([&] {
      fn();
      done.set_value();
    }));
    done.get_future().wait();
  };
  auto wait_rejected = [&](uint64_t want) {
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (node_->data_plane()->Stats().rejected_connections < want &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    return node_->data_plane()->Stats().rejected_connections;
  };
  auto on_error = [](void*, ucp_ep_h, ucs_status_t) noexcept {};
  std::unique_ptr<ucx::Endpoint> ep;
  auto send_forged_block = [&] {
    ucx::WriteBlockHeader h;
    h.write_id = 1;
    h.token = *ucx::NewToken();
    h.index = 0;
    h.length = 16;
    static const char kPayload[16] = {};
    ucx::Operation::Start(
        ucx::Operation::Kind::kSend,
        [raw = ep->get()](const ucp_request_param_t& param,
                          absl::string_view kept) {
          ucp_request_param_t p = param;
          p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
          p.flags = UCP_AM_SEND_FLAG_REPLY;
          return ucp_am_send_nbx(raw, ucx::kAmWriteBlock, kept.data(),
                                 kept.size(), kPayload, sizeof(kPayload), &p);
        },
        [](absl::Status) {}, ucx::Encode(h));
  };
  uint64_t rejected = 0;
  // A forged token in the first message, to the worker address (any
  // transport) and to the listener (tcp: UCX 1.13 cannot run a listener
  // connection over shared memory alone): closed at once.
  run([&] {
    bool peer_errors = false;
    auto e = ucx::Endpoint::ConnectToWorker((*loop)->worker(), worker_address,
                                            on_error, nullptr, &peer_errors);
    ASSERT_TRUE(e.ok()) << e.status();
    ep = *std::move(e);
    send_forged_block();
  });
  EXPECT_EQ(wait_rejected(++rejected), rejected);
  if (tcp) {
    run([&] {
      ep.reset();
      auto e = ucx::Endpoint::Connect((*loop)->worker(), listener, on_error,
                                      nullptr);
      ASSERT_TRUE(e.ok()) << e.status();
      ep = *std::move(e);
      send_forged_block();
    });
    EXPECT_EQ(wait_rejected(++rejected), rejected);
    // No message at all: closed after the handshake timeout.
    run([&] {
      ep.reset();
      auto e = ucx::Endpoint::Connect((*loop)->worker(), listener, on_error,
                                      nullptr);
      ASSERT_TRUE(e.ok());
      ep = *std::move(e);
    });
    EXPECT_EQ(wait_rejected(++rejected), rejected);
  }
  run([&] { ep.reset(); });
  (*loop)->Stop(nullptr);
  // Legitimate clients are unaffected.
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("ok", Codec::kNone, SmallShape())).ok());
  ASSERT_TRUE(PutChain(client_.get(), "ok", SmallShape(), 0, 2).ok());
  auto got = client_->Get("ok", Keys(0, 2));
  ASSERT_TRUE(got.ok()) << got.status();
}

// The client side of data messages (kAmReadData), against a fake node: a
// piece outside the read's region fails the read and is never written; a
// status that counts messages still in flight waits for them, so a read
// reports its layers only once their bytes are in place.
class FakeNode {
 public:
  // Called on the fake node's progress thread for each ReadStart, with the
  // endpoint back to the client.
  using OnRead =
      std::function<void(ucp_ep_h reply, const ucx::ReadStartHeader& h)>;

  FakeNode() {
    auto loop = ucx::WorkerLoop::Start({});
    EXPECT_TRUE(loop.ok()) << loop.status();
    if (!loop.ok()) return;
    loop_ = *std::move(loop);
    std::promise<void> ready;
    EXPECT_TRUE(loop_->Post([&] {
      ucp_am_handler_param_t param;
      std::memset(&param, 0, sizeof(param));
      param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                         UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG;
      param.id = ucx::kAmReadStart;
      param.cb = &FakeNode::OnReadStart;
      param.arg = this;
      EXPECT_EQ(ucp_worker_set_am_recv_handler(loop_->worker().get(), &param),
                UCS_OK);
      address_ = *loop_->worker().Address();
      ready.set_value();
    }));
    ready.get_future().wait();
  }
  ~FakeNode() {
    if (loop_ != nullptr) loop_->Stop(nullptr);
  }

  // Runs `task` on the fake node's progress thread (outside any callback).
  void Post(std::function<void()> task) { loop_->Post(std::move(task)); }

  void set_on_read(OnRead on_read) {
    std::lock_guard<std::mutex> lock(mu_);
    on_read_ = std::move(on_read);
  }
  const std::string& address() const { return address_; }
  // How a client plane reaches this fake node: by its worker address, with
  // data messages accepted (numbered by the node when `sequenced`).
  ucx::NodeAddress NodeAddress(bool sequenced = false) const {
    ucx::NodeAddress a;
    a.listener = "127.0.0.1:1";  // unused: the worker address is set
    a.worker = address_;
    a.message_reads = true;
    a.sequenced_data = sequenced;
    return a;
  }

  // Sends one message; `header` and `data` must outlive it (data: static
  // or owned by the test).
  static void Send(ucp_ep_h ep, unsigned id, std::string header,
                   const void* data, size_t length) {
    ucx::Operation::Start(
        ucx::Operation::Kind::kSend,
        [ep, id, data, length](const ucp_request_param_t& param,
                               absl::string_view kept) {
          ucp_request_param_t p = param;
          if (length >= ucx::kRendezvousBytes) {
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_AM_SEND_FLAG_RNDV;
          }
          return ucp_am_send_nbx(ep, id, kept.data(), kept.size(), data, length,
                                 &p);
        },
        [](absl::Status) {}, std::move(header));
  }
  // `sequence` >= 0: the message's place in the send order, for a read
  // that asked for it (kReadFlagSequenced).
  static void SendData(ucp_ep_h ep, const ucx::ReadStartHeader& h,
                       uint32_t block, uint64_t offset, const void* data,
                       size_t length, int64_t sequence = -1) {
    ucx::ReadDataHeader d;
    d.read_id = h.read_id;
    d.token = h.token;
    d.block = block;
    d.offset = offset;
    if (sequence >= 0) {
      EXPECT_NE(h.flags & ucx::kReadFlagSequenced, 0);
      d.has_sequence = true;
      d.sequence = static_cast<uint32_t>(sequence);
    }
    Send(ep, ucx::kAmReadData, ucx::Encode(d), data, length);
  }
  static void SendStatus(ucp_ep_h ep, const ucx::ReadStartHeader& h,
                         uint32_t data_messages, uint32_t layers_done = 1,
                         uint32_t num_layers = 1) {
    ucx::ReadStatusHeader s;
    s.read_id = h.read_id;
    s.token = h.token;
    s.layers_done = layers_done;
    s.num_layers = num_layers;
    s.has_data_messages = true;
    s.data_messages = data_messages;
    Send(ep, ucx::kAmReadStatus, ucx::Encode(s), nullptr, 0);
  }

 private:
  static ucs_status_t OnReadStart(void* arg, const void* header,
                                  size_t header_length, void*, size_t,
                                  const ucp_am_recv_param_t* param) noexcept {
    auto* self = static_cast<FakeNode*>(arg);
    auto h = ucx::DecodeReadStart(
        absl::string_view(static_cast<const char*>(header), header_length));
    EXPECT_TRUE(h.ok()) << h.status();
    EXPECT_NE(h->flags & ucx::kReadFlagMessages, 0);
    OnRead on_read;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      on_read = self->on_read_;
    }
    if (h.ok() && on_read &&
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
      on_read(param->reply_ep, *h);
    }
    return UCS_OK;
  }

  std::unique_ptr<ucx::WorkerLoop> loop_;
  std::string address_;
  std::mutex mu_;
  OnRead on_read_;
};

TEST_P(UcxTest, DataMessagesLandOnlyInsideTheReadsRegion) {
  FakeNode fake;
  ASSERT_FALSE(fake.address().empty());
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  const ucx::NodeAddress address = fake.NodeAddress();
  // Two blocks of 256 KiB in a region with 64 KiB of guard bytes after
  // them: a rendezvous-sized piece and a small (eager) one per block.
  constexpr size_t kBlock = 256 << 10;
  constexpr size_t kGuard = 64 << 10;
  static std::vector<uint8_t> payload(kBlock);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = i * 7 + 3;
  auto read_with = [&](uint64_t read_id, FakeNode::OnRead on_read,
                       std::vector<uint8_t>* landed) -> absl::Status {
    fake.set_on_read(std::move(on_read));
    auto region = (*plane)->Allocate(2 * kBlock + kGuard);
    if (!region.ok()) return region.status();
    std::shared_ptr<ucx::MemoryRegion> shared = *std::move(region);
    std::memset(shared->data(), 0xEE, shared->size());
    const uint64_t base = reinterpret_cast<uint64_t>(shared->data());
    auto read = (*plane)->StartRead(address, read_id, *ucx::NewToken(), shared,
                                    {base, base + kBlock}, 1,
                                    /*per_layer=*/false);
    if (!read.ok()) return read.status();
    absl::Status st = (*read)->WaitLayers(1, absl::Now() + absl::Seconds(10));
    read->reset();
    landed->assign(shared->data(), shared->data() + shared->size());
    return st;
  };
  std::vector<uint8_t> landed;
  const uint8_t* data = payload.data();

  // In place: block 1 as one rendezvous piece, block 0 as an eager piece of
  // 1 KiB at offset 4 KiB; the status comes first and counts both.
  absl::Status st = read_with(
      1,
      [data](ucp_ep_h ep, const ucx::ReadStartHeader& h) {
        FakeNode::SendStatus(ep, h, 2);
        FakeNode::SendData(ep, h, 1, 0, data, kBlock);
        FakeNode::SendData(ep, h, 0, 4096, data, 1024);
      },
      &landed);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(std::equal(data, data + kBlock, landed.begin() + kBlock));
  EXPECT_TRUE(std::equal(data, data + 1024, landed.begin() + 4096));
  EXPECT_EQ(landed[4095], 0xEE);
  EXPECT_EQ(landed[4096 + 1024], 0xEE);

  // Outside the region, eager and by rendezvous, and a block the read does
  // not have: each fails the read and writes nothing.
  struct Bad {
    uint32_t block;
    uint64_t offset;
    size_t length;
  };
  for (const Bad& bad :
       {Bad{1, kBlock + kGuard - 512, 1024}, Bad{1, kBlock + kGuard, kBlock},
        Bad{2, 0, 1024}, Bad{0, UINT64_MAX - 100, 1024}}) {
    st = read_with(
        2,
        [data, bad](ucp_ep_h ep, const ucx::ReadStartHeader& h) {
          FakeNode::SendData(ep, h, bad.block, bad.offset, data, bad.length);
          FakeNode::SendStatus(ep, h, 1);
        },
        &landed);
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
    EXPECT_TRUE(std::all_of(landed.begin(), landed.end(),
                            [](uint8_t b) { return b == 0xEE; }))
        << "block " << bad.block << " offset " << bad.offset;
  }
}

// The client side of a read written out by hand, which keeps back the
// rendezvous pieces of data messages (kAmReadData): their descriptors are
// held (UCS_INPROGRESS) and received only when the test says so. Between
// the node's report of the read and the client's receive, the node's send
// still reads the blocks from its arena, so their pages must stay pinned.
class HeldReader {
 public:
  HeldReader() {
    auto loop = ucx::WorkerLoop::Start({});
    EXPECT_TRUE(loop.ok()) << loop.status();
    if (!loop.ok()) return;
    loop_ = *std::move(loop);
    RunOnLoop([this] {
      for (unsigned id : {ucx::kAmReadData, ucx::kAmReadStatus}) {
        ucp_am_handler_param_t param;
        std::memset(&param, 0, sizeof(param));
        param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                           UCP_AM_HANDLER_PARAM_FIELD_CB |
                           UCP_AM_HANDLER_PARAM_FIELD_ARG;
        param.id = id;
        param.cb = id == ucx::kAmReadData ? &HeldReader::OnData
                                          : &HeldReader::OnStatus;
        param.arg = this;
        EXPECT_EQ(ucp_worker_set_am_recv_handler(loop_->worker().get(), &param),
                  UCS_OK);
      }
      address_ = *loop_->worker().Address();
    });
  }
  ~HeldReader() {
    if (loop_ == nullptr) return;
    RunOnLoop([this] {
      ep_.reset();
      region_.reset();
    });
    loop_->Stop(nullptr);
  }

  // Sends ReadStart for `read_id` over a connection to the node's worker,
  // asking for data messages into a fresh region of `bytes`; with
  // `named_id`, naming that buffer id for the region as well
  // (kReadFlagNamesBuffer).
  absl::Status Start(const std::string& node_worker, uint64_t read_id,
                     const ucx::Token& token, uint32_t blocks,
                     uint64_t block_bytes,
                     std::optional<uint64_t> named_id = std::nullopt) {
    absl::Status status;
    RunOnLoop([&] {
      bool peer_errors = false;
      auto ep = ucx::Endpoint::ConnectToWorker(
          loop_->worker(), node_worker, [](void*, ucp_ep_h, ucs_status_t) {},
          nullptr, &peer_errors);
      auto region =
          ucx::MemoryRegion::Allocate(loop_->context(), blocks * block_bytes);
      if (!ep.ok() || !region.ok()) {
        status = !ep.ok() ? ep.status() : region.status();
        return;
      }
      ep_ = *std::move(ep);
      region_ = *std::move(region);
      std::memset(region_->data(), 0, region_->size());
      absl::StatusOr<std::string> rkey = region_->PackRemoteKey();
      if (!rkey.ok()) {
        status = rkey.status();
        return;
      }
      ucx::ReadStartHeader h;
      h.read_id = read_id;
      h.token = token;
      h.num_blocks = blocks;
      h.rkey_length = static_cast<uint32_t>(rkey->size());
      h.client_address_length = static_cast<uint32_t>(address_.size());
      h.flags = ucx::kReadFlagBounded | ucx::kReadFlagMessages |
                (named_id ? ucx::kReadFlagNamesBuffer : 0);
      std::string header = ucx::Encode(h);
      std::string message = header + *rkey;
      const uint64_t base = reinterpret_cast<uint64_t>(region_->data());
      for (uint32_t b = 0; b < blocks; ++b) {
        AppendLe(&message, base + b * block_bytes);
      }
      message += address_;
      AppendLe(&message, base);
      AppendLe(&message, region_->size());
      if (named_id) {
        AppendLe(&message, *named_id);
        AppendLe(&message, base);
        AppendLe(&message, region_->size());
        const auto key_length = static_cast<uint32_t>(rkey->size());
        for (int i = 0; i < 4; ++i) {
          message.push_back(static_cast<char>(key_length >> (8 * i)));
        }
        message += *rkey;
      }
      ucx::SendEagerAm(ep_->get(), ucx::kAmReadStart, std::move(message),
                       header.size(), [](absl::Status) {});
      loop_->AddBusy(1);  // keep progressing: the node is waiting on us
    });
    return status;
  }

  // Waits (bounded) until the node reported the read done.
  bool WaitReported(absl::Duration within) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoSeconds(within),
                        [&] { return reported_; });
  }
  // Rendezvous pieces received so far and held back.
  size_t held() {
    size_t n = 0;
    RunOnLoop([&] { n = held_.size(); });
    return n;
  }
  // Receives every held piece into the region and waits for them to land.
  absl::Status ReceiveHeld(absl::Duration within) {
    auto pending = std::make_shared<std::atomic<int>>(0);
    auto failed = std::make_shared<std::atomic<bool>>(false);
    RunOnLoop([&] {
      for (const Piece& piece : held_) {
        ++*pending;
        uint8_t* dst = region_->data() + piece.at;
        ucx::Operation::Start(
            ucx::Operation::Kind::kRecvAm,
            [worker = loop_->worker().get(), piece, dst](
                const ucp_request_param_t& param, absl::string_view) {
              return ucp_am_recv_data_nbx(worker, piece.descriptor, dst,
                                          piece.length, &param);
            },
            [pending, failed](absl::Status s) {
              if (!s.ok()) *failed = true;
              --*pending;
            });
      }
      held_.clear();
    });
    const absl::Time deadline = absl::Now() + within;
    while (*pending > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    if (*pending > 0) return absl::DeadlineExceededError("pieces pending");
    if (*failed) return absl::UnavailableError("a piece failed");
    return absl::OkStatus();
  }
  const uint8_t* data() const { return region_->data(); }

 private:
  struct Piece {
    void* descriptor;
    uint64_t at;  // offset in the region
    size_t length;
  };
  static void AppendLe(std::string* out, uint64_t v) {
    for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> 8 * i));
  }
  // Runs `task` on the loop thread and waits for it.
  void RunOnLoop(std::function<void()> task) {
    std::promise<void> done;
    ASSERT_TRUE(loop_->Post([&] {
      task();
      done.set_value();
    }));
    done.get_future().wait();
  }
  static ucs_status_t OnData(void* arg, const void* header,
                             size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param) noexcept {
    auto* self = static_cast<HeldReader*>(arg);
    auto h = ucx::DecodeReadData(
        absl::string_view(static_cast<const char*>(header), header_length));
    if (!h.ok()) return UCS_OK;
    const uint64_t at = h->block * self->block_bytes() + h->offset;
    if (at + length > self->region_->size()) return UCS_OK;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
      std::memcpy(self->region_->data() + at, data, length);
      return UCS_OK;
    }
    self->held_.push_back({data, at, length});
    return UCS_INPROGRESS;
  }
  static ucs_status_t OnStatus(void* arg, const void* header,
                               size_t header_length, void*, size_t,
                               const ucp_am_recv_param_t*) noexcept {
    auto* self = static_cast<HeldReader*>(arg);
    auto h = ucx::DecodeReadStatus(
        absl::string_view(static_cast<const char*>(header), header_length));
    if (h.ok() && (h->layers_done >= h->num_layers || h->code != 0)) {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->reported_ = true;
      self->code_ = h->code;
      self->cv_.notify_all();
    }
    return UCS_OK;
  }

 public:
  // The reported read's absl::StatusCode (0: it succeeded).
  int code() {
    std::lock_guard<std::mutex> lock(mu_);
    return code_;
  }

 private:
  uint64_t block_bytes() const { return block_bytes_; }

 public:
  void set_block_bytes(uint64_t b) { block_bytes_ = b; }

 private:
  std::unique_ptr<ucx::WorkerLoop> loop_;
  std::string address_;
  std::unique_ptr<ucx::Endpoint> ep_;
  std::unique_ptr<ucx::MemoryRegion> region_;
  uint64_t block_bytes_ = 0;
  std::vector<Piece> held_;  // loop thread only
  std::mutex mu_;
  std::condition_variable cv_;
  bool reported_ = false;  // guarded by mu_
  int code_ = 0;           // guarded by mu_
};

// Over tcp a read goes as data messages, and a rendezvous piece is sent
// only when the client receives it: until then the node's send reads the
// block where it lies in the arena. The node may report the read before
// that (its flush does not wait for rendezvous sends), but the blocks stay
// pinned until every send has ended, so a delete and a write that reuses
// pages in the meantime cannot change the bytes the client gets.
TEST_P(UcxTest, BlocksStayPinnedUntilEveryDataMessageIsSent) {
  if (!GetParam().tcp() || GetParam().delivery != ucx::ReadDelivery::kAuto) {
    GTEST_SKIP() << "data messages are a tcp read's delivery";
  }
  const kernels::BlockShape shape = LargeShape();
  const uint64_t block_bytes = kernels::Fp16BlockBytes(shape);
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("held", Codec::kNone, shape)).ok());
  absl::StatusOr<PutResult> put =
      PutChain(grpc_client_.get(), "held", shape, 0, 2);
  ASSERT_TRUE(put.ok()) << put.status();
  const kvcache::v1::BeginReadResponse response =
      BeginPlaneRead("held", 0, 2, kvcache::v1::READ_FORMAT_RAW);
  ASSERT_TRUE(response.has_data_plane());
  auto token = ucx::TokenFromBytes(response.data_plane().token());
  ASSERT_TRUE(token.ok());

  HeldReader reader;
  reader.set_block_bytes(block_bytes);
  ASSERT_TRUE(reader
                  .Start(response.data_plane().worker_address(),
                         response.read_id(), *token, 2, block_bytes)
                  .ok());
  // The node sends each block as rendezvous pieces and reports the read.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (reader.held() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GT(reader.held(), 0u) << "no rendezvous piece arrived";
  reader.WaitReported(absl::Seconds(2));
  // The sends still read the pinned pages: the blocks' pins are held.
  EXPECT_GE(node_->store()->Stats().pinned_bytes, 2 * block_bytes)
      << "the node let the blocks go with their sends in flight";
  // Delete them and write others, which take any page freed.
  ASSERT_TRUE(grpc_client_->Delete("held", Keys(0, 2)).ok());
  ASSERT_TRUE(PutChain(grpc_client_.get(), "held", shape, 10, 4).ok());
  ASSERT_TRUE(reader.ReceiveHeld(absl::Seconds(10)).ok());
  for (int b = 0; b < 2; ++b) {
    EXPECT_EQ(std::memcmp(reader.data() + b * block_bytes, data_[b].data(),
                          block_bytes),
              0)
        << "block " << b << " is not the bytes that were read";
  }
  ExpectNothingHeld(absl::Seconds(5));
}

// A read that names a buffer (kReadFlagNamesBuffer) of id 0, which no
// long-lived buffer has, fails INVALID_ARGUMENT, the node keeps nothing of
// it, and the blocks it asked for can still be read.
TEST_P(UcxTest, AReadNamingABufferOfIdZeroFailsAndKeepsNothing) {
  const kernels::BlockShape shape = LargeShape();
  const uint64_t block_bytes = kernels::Fp16BlockBytes(shape);
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("badname", Codec::kNone, shape)).ok());
  ASSERT_TRUE(PutChain(grpc_client_.get(), "badname", shape, 0, 1).ok());
  const kvcache::v1::BeginReadResponse response =
      BeginPlaneRead("badname", 0, 1, kvcache::v1::READ_FORMAT_RAW);
  ASSERT_TRUE(response.has_data_plane());
  ASSERT_TRUE(response.data_plane().keeps_named_buffers());
  auto token = ucx::TokenFromBytes(response.data_plane().token());
  ASSERT_TRUE(token.ok());
  const uint32_t keys_before = node_->data_plane()->Stats().buffer_keys;
  HeldReader reader;
  reader.set_block_bytes(block_bytes);
  ASSERT_TRUE(reader
                  .Start(response.data_plane().worker_address(),
                         response.read_id(), *token, 1, block_bytes,
                         uint64_t{0})
                  .ok());
  ASSERT_TRUE(reader.WaitReported(absl::Seconds(10)));
  EXPECT_EQ(reader.code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(node_->data_plane()->Stats().buffer_keys, keys_before);
  ExpectNothingHeld(absl::Seconds(5));
  std::vector<uint8_t> out(block_bytes);
  auto again = client_->GetInto("badname", Keys(0, 1), ReadFormat::kFp16,
                                absl::MakeSpan(out), block_bytes);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*again)->Wait().ok());
  EXPECT_EQ(std::memcmp(out.data(), data_[0].data(), block_bytes), 0);
}

// A layer is reported only once the data messages sent before its status
// have landed, not once as many messages have landed: over tcp a later
// eager piece (layer 2) lands at once while an earlier rendezvous piece
// (layer 1) is still on its way, and counting it would report layer 1 with
// its bytes missing. The fake node sends layer 1 as one rendezvous piece,
// reports it, sends layer 2 as an eager piece and reports that, then
// stops progressing for a while, so the rendezvous bytes cannot flow yet.
TEST_P(UcxTest, ALayerIsReportedOnlyOnceTheMessagesBeforeItHaveLanded) {
  if (!GetParam().tcp() || GetParam().delivery != ucx::ReadDelivery::kAuto) {
    GTEST_SKIP() << "data messages are a tcp read's delivery";
  }
  FakeNode fake;
  ASSERT_FALSE(fake.address().empty());
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  const ucx::NodeAddress address = fake.NodeAddress();
  constexpr size_t kLayer = 256 << 10;
  static std::vector<uint8_t> payload(kLayer);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = i * 13 + 5;
  const uint8_t* data = payload.data();
  fake.set_on_read([data](ucp_ep_h ep, const ucx::ReadStartHeader& h) {
    FakeNode::SendData(ep, h, 0, 0, data, kLayer);  // layer 1: rendezvous
    FakeNode::SendStatus(ep, h, 1, 1, 2);
    FakeNode::SendData(ep, h, 0, kLayer, data, 1024);  // layer 2: eager
    FakeNode::SendStatus(ep, h, 2, 2, 2);
    absl::SleepFor(absl::Milliseconds(300));  // no progress: no rendezvous
  });
  auto region = (*plane)->Allocate(kLayer + 1024);
  ASSERT_TRUE(region.ok()) << region.status();
  std::shared_ptr<ucx::MemoryRegion> shared = *std::move(region);
  std::memset(shared->data(), 0, shared->size());
  const uint64_t base = reinterpret_cast<uint64_t>(shared->data());
  auto read = (*plane)->StartRead(address, 7, *ucx::NewToken(), shared, {base},
                                  2, /*per_layer=*/true);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE((*read)->WaitLayers(1, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_TRUE(std::equal(data, data + kLayer, shared->data()))
      << "layer 1 was reported before its bytes landed";
  ASSERT_TRUE((*read)->WaitLayers(2, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_TRUE(std::equal(data, data + 1024, shared->data() + kLayer));
  read->reset();
}

// A layer is reported only once the data messages the node sent before its
// status have landed, whatever order they arrive in: if a later message
// (layer 2's) overtakes an earlier one (layer 1's), counting arrivals would
// report layer 1 with its bytes missing. The fake node sends layer 2's
// piece (numbered 1 in its send order), then layer 1's status, and layer
// 1's piece (numbered 0) only 300 ms later. A number that repeats one the
// read already has fails the read.
TEST_P(UcxTest,
       ALayerWaitsForTheMessagesSentBeforeItInWhateverOrderTheyArrive) {
  if (!GetParam().tcp() || GetParam().delivery != ucx::ReadDelivery::kAuto) {
    GTEST_SKIP() << "data messages are a tcp read's delivery";
  }
  FakeNode fake;
  ASSERT_FALSE(fake.address().empty());
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  constexpr size_t kLayer = 4096;
  static std::vector<uint8_t> payload(2 * kLayer);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = i * 29 + 11;
  const uint8_t* data = payload.data();
  fake.set_on_read([&fake, data](ucp_ep_h ep, const ucx::ReadStartHeader& h) {
    // Node order: layer 1's piece (message 0), status 1, layer 2's piece
    // (message 1), status 2. Delivered: message 1 first.
    FakeNode::SendData(ep, h, 0, kLayer, data + kLayer, kLayer, 1);
    FakeNode::SendStatus(ep, h, 1, 1, 2);
    fake.Post([ep, h, data] {
      absl::SleepFor(absl::Milliseconds(300));
      FakeNode::SendData(ep, h, 0, 0, data, kLayer, 0);
      FakeNode::SendStatus(ep, h, 2, 2, 2);
    });
  });
  auto region = (*plane)->Allocate(2 * kLayer);
  ASSERT_TRUE(region.ok()) << region.status();
  std::shared_ptr<ucx::MemoryRegion> shared = *std::move(region);
  std::memset(shared->data(), 0, shared->size());
  const uint64_t base = reinterpret_cast<uint64_t>(shared->data());
  auto read = (*plane)->StartRead(fake.NodeAddress(/*sequenced=*/true), 9,
                                  *ucx::NewToken(), shared, {base}, 2,
                                  /*per_layer=*/true);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE((*read)->WaitLayers(1, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_TRUE(std::equal(data, data + kLayer, shared->data()))
      << "layer 1 was reported before its bytes landed";
  ASSERT_TRUE((*read)->WaitLayers(2, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_TRUE(std::equal(data, data + 2 * kLayer, shared->data()));
  read->reset();

  fake.set_on_read([data](ucp_ep_h ep, const ucx::ReadStartHeader& h) {
    FakeNode::SendData(ep, h, 0, 0, data, kLayer, 0);
    FakeNode::SendData(ep, h, 0, kLayer, data + kLayer, kLayer, 0);
    FakeNode::SendStatus(ep, h, 2, 2, 2);
  });
  read = (*plane)->StartRead(fake.NodeAddress(/*sequenced=*/true), 10,
                             *ucx::NewToken(), shared, {base}, 2,
                             /*per_layer=*/true);
  ASSERT_TRUE(read.ok()) << read.status();
  const absl::Status twice =
      (*read)->WaitLayers(2, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(twice.code(), absl::StatusCode::kInternal) << twice;
  EXPECT_NE(twice.message().find("twice"), std::string::npos) << twice;
  read->reset();
}

// A status that reports no more layers than an earlier one of the read says
// nothing new: it is dropped, not held, so a misbehaving node cannot make
// the client hold statuses without bound (here the same one 1,000 times
// before any data lands; the client held all of them before). Statuses
// sent after flushes can also arrive out of order (a node putting over
// emulated puts: a later layer's, then an earlier one's), and the read
// goes on. A status for another count of layers than the read's earlier
// ones fails the read.
TEST_P(UcxTest, AStatusThatReportsNothingNewIsDropped) {
  if (!GetParam().tcp() || GetParam().delivery != ucx::ReadDelivery::kAuto) {
    GTEST_SKIP() << "data messages are a tcp read's delivery";
  }
  FakeNode fake;
  ASSERT_FALSE(fake.address().empty());
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  constexpr size_t kLayer = 4096;
  static std::vector<uint8_t> payload(2 * kLayer, 0x3C);
  const uint8_t* data = payload.data();
  std::atomic<int> mode{0};
  fake.set_on_read([data, &mode](ucp_ep_h ep, const ucx::ReadStartHeader& h) {
    if (mode == 0) {
      for (int i = 0; i < 1000; ++i) FakeNode::SendStatus(ep, h, 1, 1, 2);
      FakeNode::SendData(ep, h, 0, 0, data, kLayer, 0);
      FakeNode::SendData(ep, h, 0, kLayer, data + kLayer, kLayer, 1);
      FakeNode::SendStatus(ep, h, 2, 2, 2);
    } else if (mode == 1) {
      FakeNode::SendData(ep, h, 0, 0, data, kLayer, 0);
      FakeNode::SendData(ep, h, 0, kLayer, data + kLayer, kLayer, 1);
      FakeNode::SendStatus(ep, h, 2, 2, 3);
      FakeNode::SendStatus(ep, h, 1, 1, 3);
      FakeNode::SendStatus(ep, h, 2, 3, 3);
    } else {
      FakeNode::SendData(ep, h, 0, 0, data, kLayer, 0);
      FakeNode::SendStatus(ep, h, 1, 1, 2);
      FakeNode::SendData(ep, h, 0, kLayer, data + kLayer, kLayer, 1);
      FakeNode::SendStatus(ep, h, 2, 2, 3);
    }
  });
  auto region = (*plane)->Allocate(2 * kLayer);
  ASSERT_TRUE(region.ok()) << region.status();
  std::shared_ptr<ucx::MemoryRegion> shared = *std::move(region);
  const uint64_t base = reinterpret_cast<uint64_t>(shared->data());
  for (int m = 0; m < 3; ++m) {
    mode = m;
    auto read = (*plane)->StartRead(fake.NodeAddress(/*sequenced=*/true),
                                    11 + m, *ucx::NewToken(), shared, {base}, 2,
                                    /*per_layer=*/true);
    ASSERT_TRUE(read.ok()) << read.status();
    const absl::Status done =
        (*read)->WaitLayers(m == 1 ? 3 : 2, absl::Now() + absl::Seconds(10));
    if (m < 2) {
      ASSERT_TRUE(done.ok()) << "mode " << m << ": " << done;
      EXPECT_LE((*read)->most_statuses_held(), 1u) << "mode " << m;
      EXPECT_TRUE(std::equal(data, data + 2 * kLayer, shared->data()));
    } else {
      EXPECT_EQ(done.code(), absl::StatusCode::kInternal) << done;
    }
    read->reset();
  }
}

// A connection that fails before any transfer on it completed carried no
// call to its end: its failure says so (IsFreshConnectionReset), and
// Client::Get tries such a read once more on a new connection (a node
// resuming from a pause resets connections so). Once a transfer has
// completed on a connection, its failure is an ordinary UNAVAILABLE.
TEST_P(UcxTest, AConnectionResetBeforeItsFirstTransferSaysSo) {
  if (!GetParam().tcp()) GTEST_SKIP() << "shared memory has no peer errors";
  FakeNode fake;
  ASSERT_FALSE(fake.address().empty());
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  const ucx::NodeAddress address = fake.NodeAddress();
  static std::vector<uint8_t> payload(1024, 0x5A);
  const uint8_t* data = payload.data();
  std::atomic<bool> reset{true};
  fake.set_on_read([&](ucp_ep_h ep, const ucx::ReadStartHeader& h) {
    if (!reset) {
      FakeNode::SendData(ep, h, 0, 0, data, payload.size());
      FakeNode::SendStatus(ep, h, 1);
      return;
    }
    // Force-closing the endpoint resets the client's TCP connection.
    fake.Post([ep] { ucx::Endpoint::Adopt(ep).reset(); });
  });
  auto read_once = [&](uint64_t id) {
    auto region = (*plane)->Allocate(4096);
    if (!region.ok()) return region.status();
    std::shared_ptr<ucx::MemoryRegion> shared = *std::move(region);
    const uint64_t base = reinterpret_cast<uint64_t>(shared->data());
    auto read = (*plane)->StartRead(address, id, *ucx::NewToken(), shared,
                                    {base}, 1, /*per_layer=*/false);
    if (!read.ok()) return read.status();
    return (*read)->WaitLayers(1, absl::Now() + absl::Seconds(10));
  };
  absl::Status first = read_once(1);
  EXPECT_EQ(first.code(), absl::StatusCode::kUnavailable) << first;
  EXPECT_TRUE(ucx::IsFreshConnectionReset(first)) << first;
  reset = false;
  absl::Status second = read_once(2);
  ASSERT_TRUE(second.ok()) << second;
  reset = true;
  absl::Status third = read_once(3);
  EXPECT_EQ(third.code(), absl::StatusCode::kUnavailable) << third;
  EXPECT_FALSE(ucx::IsFreshConnectionReset(third)) << third;
}

// A read whose destinations do not lie inside the region it registered is
// refused before anything is put (over shared memory such a put would be a
// memcpy outside the node's mapping of the client's segment): below the
// region, past its end, and straddling its end. The lease is released, the
// region untouched, and the node serves the next read.
TEST_P(UcxTest, ReadDestinationsOutsideTheRegionAreRefused) {
  const kernels::BlockShape shape = SmallShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("bounds", Codec::kNone, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "bounds", shape, 0, 2).ok());
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  const uint64_t block_bytes = kernels::Fp16BlockBytes(shape);
  for (int trial = 0; trial < 3; ++trial) {
    const kvcache::v1::BeginReadResponse response =
        BeginPlaneRead("bounds", 0, 2, kvcache::v1::READ_FORMAT_FP16);
    ASSERT_TRUE(response.has_data_plane());
    ASSERT_TRUE(response.data_plane().bounded_reads());
    const ucx::NodeAddress address = AddressOf(response.data_plane());
    auto region = (*plane)->Allocate(2 * block_bytes);
    ASSERT_TRUE(region.ok()) << region.status();
    std::memset((*region)->data(), 0xAB, 2 * block_bytes);
    const uint64_t base = reinterpret_cast<uint64_t>((*region)->data());
    const uint64_t starts[] = {base - block_bytes, base + 2 * block_bytes,
                               base + block_bytes + block_bytes / 2};
    std::shared_ptr<ucx::MemoryRegion> held = *std::move(region);
    auto token = ucx::TokenFromBytes(response.data_plane().token());
    ASSERT_TRUE(token.ok());
    auto read = (*plane)->StartRead(address, response.read_id(), *token, held,
                                    {base, starts[trial]}, 1,
                                    /*per_layer=*/false);
    ASSERT_TRUE(read.ok()) << read.status();
    const absl::Status done =
        (*read)->WaitLayers(1, absl::Now() + absl::Seconds(10));
    EXPECT_EQ(done.code(), absl::StatusCode::kInvalidArgument) << done;
    EXPECT_NE(done.message().find("outside the registered region"),
              std::string::npos)
        << done;
    read->reset();
    for (uint64_t i = 0; i < 2 * block_bytes; ++i) {
      ASSERT_EQ(held->data()[i], 0xAB) << "byte " << i << " trial " << trial;
    }
  }
  ExpectNothingHeld(absl::Seconds(10));
  auto got = client_->Get("bounds", Keys(0, 2));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->blocks.size(), 2u);
}

// Puts from a DataBuffer: where the node can map the buffer (shared
// memory) it encodes the blocks straight from it (kAmWritePull, counted in
// pulled_blocks); over tcp it cannot, refuses the pull, and the client
// sends that node blocks from then on. A put from heap memory to a node
// that pulls is copied into a pooled DataBuffer and pulled from there.
// Either way the stored bytes are the encoding of the input, bit for bit.
TEST_P(UcxTest, PutsFromADataBufferArePulledWhereTheNodeCanMapThem) {
  const bool shm = !GetParam().tcp();
  const kernels::BlockShape shape = LargeShape();
  const size_t stride = kernels::Fp16BlockBytes(shape);
  for (Codec codec : {Codec::kNone, Codec::kFp8E4M3}) {
    const std::string ns = absl::StrCat("pull-", kernels::CodecName(codec));
    ASSERT_TRUE(client_->RegisterNamespace(Spec(ns, codec, shape)).ok());
    auto buffer = client_->AllocateBuffer(4 * stride);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    std::vector<BlockWrite> writes;
    std::vector<std::vector<uint16_t>> inputs;
    for (int i = 0; i < 4; ++i) {
      inputs.push_back(RandomBlock(shape, 100 + i));
      std::memcpy((*buffer)->data() + i * stride, inputs.back().data(), stride);
      writes.push_back({Key(100 + i), "",
                        absl::MakeConstSpan(reinterpret_cast<const uint16_t*>(
                                                (*buffer)->data() + i * stride),
                                            stride / 2)});
    }
    const uint64_t pulled_before = node_->data_plane()->Stats().pulled_blocks;
    auto put = client_->Put(ns, writes);
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->stored, 4u);
    EXPECT_EQ(node_->data_plane()->Stats().pulled_blocks - pulled_before,
              shm ? 4u : 0u);
    // A put from heap memory: staged into a pooled DataBuffer and pulled
    // on shared memory, sent as active messages over tcp.
    std::vector<uint16_t> heap = RandomBlock(shape, 200);
    auto heap_put = client_->Put(ns, {{Key(200), Key(103), heap}});
    ASSERT_TRUE(heap_put.ok()) << heap_put.status();
    EXPECT_EQ(node_->data_plane()->Stats().pulled_blocks - pulled_before,
              shm ? 5u : 0u);
    inputs.push_back(heap);
    std::vector<std::string> keys = {Key(100), Key(101), Key(102), Key(103),
                                     Key(200)};
    auto got = client_->Get(ns, keys, ReadFormat::kRaw);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->blocks.size(), keys.size());
    CodecPolicy policy;
    policy.codec = codec;
    for (size_t i = 0; i < keys.size(); ++i) {
      std::vector<uint8_t> want(kernels::EncodedBlockBytes(shape, policy));
      ASSERT_TRUE(
          kernels::EncodeBlock(shape, policy, inputs[i], absl::MakeSpan(want))
              .ok());
      ASSERT_EQ(got->blocks[i].bytes.size(), want.size());
      EXPECT_EQ(
          std::memcmp(got->blocks[i].bytes.data(), want.data(), want.size()), 0)
          << CodecName(codec) << " block " << i;
    }
  }
  // Operators see the pulls.
  EXPECT_NE(node_->metrics()->Render().find(
                absl::StrCat("kvcache_data_plane_pulled_blocks_total ",
                             node_->data_plane()->Stats().pulled_blocks, "\n")),
            std::string::npos);
  EXPECT_EQ(node_->data_plane()->Stats().pulled_blocks, shm ? 10u : 0u);
  // A pulled block the node refuses (an infinity: INVALID_ARGUMENT from the
  // encoder) fails the Put, which returns only once the node has dropped
  // the write; nothing is left behind and the buffer can be used again.
  {
    ASSERT_TRUE(
        client_->RegisterNamespace(Spec("pull-bad", Codec::kFp8E4M3, shape))
            .ok());
    auto buffer = client_->AllocateBuffer(stride);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    std::vector<uint16_t> block = RandomBlock(shape, 300);
    block[17] = 0x7C00;  // +inf
    std::memcpy((*buffer)->data(), block.data(), stride);
    const auto fp16 = absl::MakeConstSpan(
        reinterpret_cast<const uint16_t*>((*buffer)->data()), stride / 2);
    auto put = client_->Put("pull-bad", {{Key(300), "", fp16}});
    EXPECT_EQ(put.status().code(), absl::StatusCode::kInvalidArgument)
        << put.status();
    ExpectNothingHeld(absl::Seconds(10));
    block[17] = 0;
    std::memcpy((*buffer)->data(), block.data(), stride);
    put = client_->Put("pull-bad", {{Key(300), "", fp16}});
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->stored, 1u);
    // The same from heap memory (staged, on shared memory).
    block[17] = 0xFC00;  // -inf
    put = client_->Put("pull-bad", {{Key(301), "", block}});
    EXPECT_EQ(put.status().code(), absl::StatusCode::kInvalidArgument)
        << put.status();
    ExpectNothingHeld(absl::Seconds(10));
    block[17] = 0;
    put = client_->Put("pull-bad", {{Key(301), "", block}});
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->stored, 1u);
  }
  ExpectNothingHeld(absl::Seconds(10));
}

// A pull naming a block outside the region it registered fails the write
// with INVALID_ARGUMENT before anything is read (over shared memory such a
// block would be read from outside the node's mapping of the client's
// segment); the node serves the next write.
TEST_P(UcxTest, WritePullOutsideTheRegionIsRefused) {
  const kernels::BlockShape shape = SmallShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("pull-bounds", Codec::kNone, shape))
          .ok());
  auto stub = kvcache::v1::KvCache::NewStub(
      grpc::CreateChannel(Target(), grpc::InsecureChannelCredentials()));
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  const uint64_t block_bytes = kernels::Fp16BlockBytes(shape);
  auto region = (*plane)->Allocate(block_bytes);
  ASSERT_TRUE(region.ok()) << region.status();
  const uint64_t base = reinterpret_cast<uint64_t>((*region)->data());
  for (uint64_t address :
       {base - block_bytes, base + block_bytes, base + block_bytes / 2}) {
    kvcache::v1::BeginWriteRequest begin;
    begin.set_namespace_name("pull-bounds");
    begin.add_blocks()->set_key(Key(7));
    begin.set_use_data_plane(true);
    kvcache::v1::BeginWriteResponse begun;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      grpc::Status rpc = stub->BeginWrite(&ctx, begin, &begun);
      ASSERT_TRUE(rpc.ok()) << rpc.error_message();
    }
    ASSERT_TRUE(begun.data_plane().pull_writes());
    const ucx::NodeAddress node = AddressOf(begun.data_plane());
    auto token = ucx::TokenFromBytes(begun.data_plane().token());
    ASSERT_TRUE(token.ok());
    const ucx::ClientPlane::PullBlock block{0, address};
    ASSERT_TRUE((*plane)
                    ->PullBlocks(node, begun.write_id(), *token, **region, 0,
                                 absl::MakeConstSpan(&block, 1),
                                 absl::Now() + absl::Seconds(10))
                    .ok());
    kvcache::v1::CommitWriteRequest commit;
    commit.set_write_id(begun.write_id());
    kvcache::v1::CommitWriteResponse committed;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status rpc = stub->CommitWrite(&ctx, commit, &committed);
    EXPECT_EQ(rpc.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << rpc.error_message();
    EXPECT_NE(rpc.error_message().find("outside the registered region"),
              std::string::npos)
        << rpc.error_message();
  }
  ExpectNothingHeld(absl::Seconds(10));
  ASSERT_TRUE(PutChain(client_.get(), "pull-bounds", shape, 0, 2).ok());
  auto got = client_->Get("pull-bounds", Keys(0, 2));
  ASSERT_TRUE(got.ok()) << got.status();
}

// A data-plane connection that closes between a write's sends and its
// commit (another call of the process cut short and force-closed the shared
// connection; seen in the soak as FAILED_PRECONDITION "write lease is
// unknown" on a put nobody cancelled): a write whose blocks had all landed
// needs no connection and commits; one whose blocks had not answers
// UNAVAILABLE (begin again), never the stale-lease code.
TEST_P(UcxTest, AWriteOutlivesItsConnectionOnceItsBlocksHaveLanded) {
  if (!GetParam().tcp()) {
    GTEST_SKIP() << "shared-memory transports report no peer failure: the "
                    "node does not see such a close";
  }
  const kernels::BlockShape shape = SmallShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("conn-gone", Codec::kNone, shape)).ok());
  // Block 9 is read over the connection, so that the node holds an endpoint
  // to this client and sees it close (as when a read's puts fail).
  ASSERT_TRUE(PutChain(grpc_client_.get(), "conn-gone", shape, 9, 1).ok());
  auto stub = kvcache::v1::KvCache::NewStub(
      grpc::CreateChannel(Target(), grpc::InsecureChannelCredentials()));
  auto begin_write = [&](int first) {
    kvcache::v1::BeginWriteRequest begin;
    begin.set_namespace_name("conn-gone");
    begin.add_blocks()->set_key(Key(first));
    begin.add_blocks()->set_key(Key(first + 1));
    begin.set_use_data_plane(true);
    kvcache::v1::BeginWriteResponse begun;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status rpc = stub->BeginWrite(&ctx, begin, &begun);
    EXPECT_TRUE(rpc.ok()) << rpc.error_message();
    return begun;
  };
  auto commit = [&](uint64_t write_id) {
    kvcache::v1::CommitWriteRequest request;
    request.set_write_id(write_id);
    kvcache::v1::CommitWriteResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return stub->CommitWrite(&ctx, request, &response);
  };
  auto wait_for = [&](auto done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!done() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return done();
  };
  for (int first : {0, 2}) {
    data_[first] = RandomBlock(shape, first);
    data_[first + 1] = RandomBlock(shape, first + 1);
  }
  const kvcache::v1::BeginWriteResponse whole = begin_write(0);
  const kvcache::v1::BeginWriteResponse half = begin_write(2);
  ASSERT_TRUE(whole.has_data_plane() && half.has_data_plane());
  {
    auto plane = ucx::ClientPlane::Create();
    ASSERT_TRUE(plane.ok()) << plane.status();
    auto bytes = [&](int i) {
      return absl::MakeConstSpan(
          reinterpret_cast<const uint8_t*>(data_[i].data()),
          data_[i].size() * sizeof(uint16_t));
    };
    const ucx::ClientPlane::Block both[] = {{0, bytes(0), nullptr},
                                            {1, bytes(1), nullptr}};
    const ucx::ClientPlane::Block first_only[] = {{0, bytes(2), nullptr}};
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    ASSERT_TRUE(
        (*plane)
            ->SendBlocks(AddressOf(whole.data_plane()), whole.write_id(),
                         *ucx::TokenFromBytes(whole.data_plane().token()), both,
                         deadline)
            .ok());
    ASSERT_TRUE(
        (*plane)
            ->SendBlocks(AddressOf(half.data_plane()), half.write_id(),
                         *ucx::TokenFromBytes(half.data_plane().token()),
                         first_only, deadline)
            .ok());
    // Three of the four blocks have landed; the fourth never comes.
    ASSERT_TRUE(wait_for([&] {
      return node_->data_plane()->Stats().write_blocks_unlanded == 1;
    }));
    const kvcache::v1::BeginReadResponse read_begun =
        BeginPlaneRead("conn-gone", 9, 1, kvcache::v1::READ_FORMAT_FP16);
    auto region = (*plane)->Allocate(data_[9].size() * sizeof(uint16_t));
    ASSERT_TRUE(region.ok()) << region.status();
    std::shared_ptr<ucx::MemoryRegion> held = *std::move(region);
    const uint64_t base = reinterpret_cast<uint64_t>(held->data());
    auto read = (*plane)->StartRead(
        AddressOf(read_begun.data_plane()), read_begun.read_id(),
        *ucx::TokenFromBytes(read_begun.data_plane().token()), held, {base}, 1,
        /*per_layer=*/false);
    ASSERT_TRUE(read.ok()) << read.status();
    const absl::Status landed = (*read)->WaitLayers(1, deadline);
    ASSERT_TRUE(landed.ok()) << landed;
  }  // the plane and its connection close here
  ASSERT_TRUE(
      wait_for([&] { return node_->data_plane()->Stats().connections == 0; }));
  grpc::Status committed = commit(whole.write_id());
  EXPECT_TRUE(committed.ok()) << committed.error_message();
  grpc::Status refused = commit(half.write_id());
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE)
      << refused.error_message();
  ExpectNothingHeld(absl::Seconds(10));
  auto got = grpc_client_->Get("conn-gone", Keys(0, 2));
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(got->blocks[i].bytes.size(), data_[i].size() * 2);
    EXPECT_EQ(std::memcmp(got->blocks[i].bytes.data(), data_[i].data(),
                          got->blocks[i].bytes.size()),
              0)
        << "block " << i;
  }
  EXPECT_EQ(grpc_client_->Get("conn-gone", Keys(2, 1)).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_P(UcxTest, FullStagingIsResourceExhaustedWithARetryHint) {
  StartNode(256ull << 20, 4 * kernels::Fp16BlockBytes(SmallShape()),
            absl::Seconds(30));
  // fp8 blocks are encoded from staging into their pages: 8 of them need
  // twice the bound.
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("fp8", Codec::kFp8E4M3, SmallShape()))
          .ok());
  absl::Status full =
      PutChain(client_.get(), "fp8", SmallShape(), 0, 8).status();
  ASSERT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  ASSERT_TRUE(RetryAfterMs(full).has_value());
  EXPECT_GT(*RetryAfterMs(full), 0);
  ExpectNothingHeld(absl::Seconds(5));  // the store write was released too
  // Codec-none blocks land in their own pages and need no staging at all.
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("ns", Codec::kNone, SmallShape())).ok());
  ASSERT_TRUE(PutChain(client_.get(), "ns", SmallShape(), 0, 8).ok());
  // What fits, goes; reads that need more copies than the bound (fp8
  // blocks decoded on the node) are refused the same way.
  ASSERT_TRUE(PutChain(client_.get(), "fp8", SmallShape(), 0, 4).ok());
  ASSERT_TRUE(PutChain(client_.get(), "fp8", SmallShape(), 4, 4).ok());
  std::unique_ptr<Client> node_decodes =
      NewClient(DataPlane::kUcx, /*decode_on_client=*/false);
  absl::Status read_full = node_decodes->Get("fp8", Keys(0, 8)).status();
  EXPECT_EQ(read_full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(RetryAfterMs(read_full).has_value());
  EXPECT_TRUE(node_decodes->Get("fp8", Keys(0, 4)).ok());
  ExpectNothingHeld(absl::Seconds(5));
}

// Codec-none blocks sent as messages land in their own store pages (no
// staging, no copy on the node) and read back as sent, eager and
// rendezvous alike; over shared memory the client's puts are pulled
// instead. A block the node refuses there (an infinity) fails the put,
// leaves nothing behind and can be sent again.
TEST_P(UcxTest, CodecNoneBlocksLandInTheirOwnPages) {
  const bool tcp = GetParam().tcp();
  auto moved = [&] {
    ucx::DataPlaneStats s = node_->data_plane()->Stats();
    return std::make_pair(s.blocks_received_in_place, s.pulled_blocks);
  };
  int ns_number = 0;
  for (const kernels::BlockShape& shape : {SmallShape(), LargeShape()}) {
    const std::string ns = absl::StrCat("in-place-", ns_number++);
    ASSERT_TRUE(client_->RegisterNamespace(Spec(ns, Codec::kNone, shape)).ok());
    const auto before = moved();
    auto put = PutChain(client_.get(), ns, shape, 0, 6);
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->stored, 6u);
    const auto after = moved();
    EXPECT_EQ(after.first - before.first + after.second - before.second, 6u);
    if (tcp) {
      EXPECT_EQ(after.first - before.first, 6u) << ns;
    }
    auto got = client_->Get(ns, Keys(0, 6), ReadFormat::kRaw);
    ASSERT_TRUE(got.ok()) << got.status();
    for (int i = 0; i < 6; ++i) {
      ASSERT_EQ(got->blocks[i].bytes.size(), data_[i].size() * 2);
      EXPECT_EQ(std::memcmp(got->blocks[i].bytes.data(), data_[i].data(),
                            data_[i].size() * 2),
                0)
          << ns << " block " << i;
    }
    std::vector<uint16_t> bad = RandomBlock(shape, 60);
    bad[bad.size() - 3] = 0x7C00;  // +inf
    absl::Status refused = client_->Put(ns, {{Key(60), Key(5), bad}}).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    ExpectNothingHeld(absl::Seconds(5));
    EXPECT_EQ(client_->Lookup(ns, {Key(60)})->prefix_blocks, 0u);
    bad[bad.size() - 3] = 0x3C00;  // 1.0
    ASSERT_TRUE(client_->Put(ns, {{Key(60), Key(5), bad}}).ok());
    auto again = client_->Get(ns, {Key(60)}, ReadFormat::kRaw);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(
        std::memcmp(again->blocks[0].bytes.data(), bad.data(), bad.size() * 2),
        0);
  }
  // An fp8 block is encoded on its way in, from staging.
  ASSERT_TRUE(client_
                  ->RegisterNamespace(
                      Spec("in-place-fp8", Codec::kFp8E4M3, LargeShape()))
                  .ok());
  const uint64_t in_place = moved().first;
  ASSERT_TRUE(PutChain(client_.get(), "in-place-fp8", LargeShape(), 0, 2).ok());
  EXPECT_EQ(moved().first, in_place);
  EXPECT_NE(node_->metrics()->Render().find(absl::StrCat(
                "kvcache_data_plane_blocks_received_in_place_total ", in_place,
                "\n")),
            std::string::npos);
}

// Connecting logs no UCX error. Over shared memory no transport offers peer
// failure handling: both sides ask for it first and fall back without it,
// and UCX logged that first refusal as an ERROR on stdout, once per
// connection, in every client process and in the node.
TEST_P(UcxTest, ConnectingLogsNoUcxError) {
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("quiet", Codec::kNone, SmallShape()))
          .ok());
  std::fflush(stdout);
  char path[] = "/tmp/ucx_log_XXXXXX";
  const int capture = mkstemp(path);
  ASSERT_GE(capture, 0);
  const int saved = dup(STDOUT_FILENO);
  ASSERT_GE(saved, 0);
  ASSERT_GE(dup2(capture, STDOUT_FILENO), 0);
  {
    std::unique_ptr<Client> fresh = NewClient(DataPlane::kUcx);
    absl::Status put =
        PutChain(fresh.get(), "quiet", SmallShape(), 0, 2).status();
    absl::Status get = fresh->Get("quiet", Keys(0, 2)).status();
    std::fflush(stdout);
    dup2(saved, STDOUT_FILENO);
    EXPECT_TRUE(put.ok()) << put;
    EXPECT_TRUE(get.ok()) << get;
  }
  close(saved);
  close(capture);
  std::ifstream in(path);
  std::stringstream logged;
  logged << in.rdbuf();
  unlink(path);
  EXPECT_EQ(logged.str().find("UCX  ERROR"), std::string::npos) << logged.str();
}

// A read the node answers wholly in place (codec none, or raw codes) sends
// straight from the pinned arena pages and holds no staging, so it is not
// refused for want of staging however large it is: here twice the bound.
TEST_P(UcxTest, AReadAnsweredInPlaceNeedsNoStaging) {
  StartNode(256ull << 20, 4 * kernels::Fp16BlockBytes(SmallShape()),
            absl::Seconds(30));
  for (Codec codec : {Codec::kNone, Codec::kFp8E4M3}) {
    const std::string ns(kernels::CodecName(codec));
    ASSERT_TRUE(client_->RegisterNamespace(Spec(ns, codec, SmallShape())).ok());
    ASSERT_TRUE(PutChain(client_.get(), ns, SmallShape(), 0, 4).ok());
    ASSERT_TRUE(PutChain(client_.get(), ns, SmallShape(), 4, 4).ok());
    const ReadFormat format =
        codec == Codec::kNone ? ReadFormat::kFp16 : ReadFormat::kRaw;
    auto got = client_->Get(ns, Keys(0, 8), format);
    ASSERT_TRUE(got.ok()) << ns << ": " << got.status();
    auto want = grpc_client_->Get(ns, Keys(0, 8), format);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(got->blocks.size(), 8u);
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(got->blocks[i].bytes, want->blocks[i].bytes)
          << ns << " block " << i;
    }
  }
  ExpectNothingHeld(absl::Seconds(5));
}

TEST_P(UcxTest, AutoFallsBackToGrpcAndUcxOnlyRefusesANodeWithoutDataPlane) {
  client_.reset();
  grpc_client_.reset();
  node_.reset();
  service::NodeOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.memory = {store::MemoryKind::kHost, 0, 64ull << 20};
  options.store.page_size = 16384;
  options.worker_threads = 2;
  node_ = std::make_unique<service::Node>(options);
  ASSERT_TRUE(node_->Start().ok());
  std::unique_ptr<Client> auto_client = NewClient(DataPlane::kAuto);
  std::unique_ptr<Client> ucx_client = NewClient(DataPlane::kUcx);
  ASSERT_TRUE(
      auto_client->RegisterNamespace(Spec("ns", Codec::kNone, SmallShape()))
          .ok());
  ASSERT_TRUE(PutChain(auto_client.get(), "ns", SmallShape(), 0, 2).ok());
  auto got = auto_client->Get("ns", Keys(0, 2));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::memcmp(got->blocks[1].bytes.data(), data_[1].data(),
                        data_[1].size() * 2),
            0);
  EXPECT_EQ(
      PutChain(ucx_client.get(), "ns", SmallShape(), 2, 1).status().code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ucx_client->Get("ns", Keys(0, 2)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// One environment variable set for a scope (UCX reads its configuration
// when a context is created), restored however the scope ends.

// The value of `series` (name and labels, as rendered) in a /metrics
// exposition; 0 when absent.
uint64_t MetricValue(const std::string& metrics, const std::string& series) {
  const std::string prefix = series + " ";
  size_t at = metrics.find(prefix);
  if (at == std::string::npos) return 0;
  return std::strtoull(metrics.c_str() + at + prefix.size(), nullptr, 10);
}

uint64_t TransferBytes(const std::string& metrics, const char* direction,
                       const char* transport) {
  return MetricValue(
      metrics, absl::StrCat("kvcache_transfer_bytes_total{direction=\"",
                            direction, "\",transport=\"", transport, "\"}"));
}

// UCX 1.13 aborts a process that receives a TCP fragment larger than its
// receive segment: a client with UCX_TCP_RX_SEG_SIZE=1m (16x the node's)
// would kill the node with its first large put, and the node's reads would
// kill it. The client compares the sizes the node advertises with its own
// and keeps off UCX instead: kAuto moves the bytes over gRPC, kUcx fails
// with UNAVAILABLE naming the setting; the node serves on. The read the
// node opened for UCX is dropped when the client ends it over gRPC, not at
// its TTL (ExpectNothingHeld). Without TCP (shared memory) the setting does
// not matter and UCX is used.
TEST_P(UcxTest, MismatchedTcpSegmentSizesKeepTheClientOffUcxNotAbortingAPeer) {
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("seg", Codec::kNone, LargeShape())).ok());
  std::unique_ptr<Client> auto_client;
  std::unique_ptr<Client> ucx_client;
  absl::StatusOr<PutResult> auto_put;
  absl::StatusOr<PutResult> ucx_put;
  {
    // Each client's UCX starts with its first data-plane call.
    ScopedEnv big_segments("UCX_TCP_RX_SEG_SIZE", "1m");
    auto_client = NewClient(DataPlane::kAuto);
    ucx_client = NewClient(DataPlane::kUcx);
    auto_put = PutChain(auto_client.get(), "seg", LargeShape(), 0, 3);
    ucx_put = PutChain(ucx_client.get(), "seg", LargeShape(), 3, 1);
  }
  ASSERT_TRUE(auto_put.ok()) << auto_put.status();
  auto got = auto_client->Get("seg", Keys(0, 3));
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(got->blocks[i].bytes.size(), data_[i].size() * 2);
    EXPECT_EQ(std::memcmp(got->blocks[i].bytes.data(), data_[i].data(),
                          data_[i].size() * 2),
              0)
        << "block " << i;
  }
  // The refusal stands for the kAuto client (the put met it): its reads go
  // inline at once instead of opening a UCX read first and ending it.
  auto end_reads = [&] {
    return MetricValue(node_->metrics()->Render(),
                       "kvcache_requests_total{code=\"OK\",op=\"end_read\","
                       "tenant=\"open\"}");
  };
  for (int i = 0; i < 3; ++i) {
    auto more = auto_client->Get("seg", Keys(0, 3));
    ASSERT_TRUE(more.ok()) << more.status();
    ASSERT_TRUE(
        PutChain(auto_client.get(), "seg", LargeShape(), 20 + i, 1).ok());
  }
  absl::SleepFor(absl::Milliseconds(100));  // EndRead would be sent async
  EXPECT_EQ(end_reads(), 0u);
  // A kUcx read is refused after the node opened it; the client's EndRead
  // drops that read at once, not at its 30 s TTL (ExpectNothingHeld below).
  auto ucx_get = ucx_client->Get("seg", Keys(0, 3));
  if (GetParam().tcp()) {
    EXPECT_EQ(ucx_get.status().code(), absl::StatusCode::kUnavailable);
    for (absl::Time until = absl::Now() + absl::Seconds(5);
         end_reads() < 1 && absl::Now() < until;) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(end_reads(), 1u);
  } else {
    EXPECT_TRUE(ucx_get.ok()) << ucx_get.status();
  }
  std::string metrics = node_->metrics()->Render();
  if (GetParam().tcp()) {
    EXPECT_EQ(ucx_put.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(ucx_put.status().message().find("UCX_TCP_RX_SEG_SIZE"),
              std::string::npos)
        << ucx_put.status();
    EXPECT_EQ(TransferBytes(metrics, "in", "ucx"), 0u);
    EXPECT_EQ(TransferBytes(metrics, "out", "ucx"), 0u);
    EXPECT_GE(TransferBytes(metrics, "in", "grpc"), 3 * data_[0].size() * 2);
    EXPECT_GE(TransferBytes(metrics, "out", "grpc"), 3 * data_[0].size() * 2);
  } else {
    EXPECT_TRUE(ucx_put.ok()) << ucx_put.status();
    EXPECT_GE(TransferBytes(metrics, "in", "ucx"), 4 * data_[0].size() * 2);
    EXPECT_EQ(TransferBytes(metrics, "in", "grpc"), 0u);
  }
  // The node serves on, over UCX, for a client configured like it.
  ASSERT_TRUE(PutChain(client_.get(), "seg", LargeShape(), 10, 2).ok());
  auto again = client_->Get("seg", Keys(10, 2));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(std::memcmp(again->blocks[1].bytes.data(), data_[11].data(),
                        data_[11].size() * 2),
            0);
  EXPECT_GT(TransferBytes(node_->metrics()->Render(), "in", "ucx"), 0u);
  ExpectNothingHeld(absl::Seconds(5));
}

// A gRPC front for a real node that advertises another data-plane address:
// `listener`, and no worker address. What a client sees when the address a
// node advertises takes connections but never answers UCX.
class RedirectingFront final : public v1::KvCache::Service {
 public:
  RedirectingFront(const std::string& node_target, std::string listener)
      : stub_(v1::KvCache::NewStub(grpc::CreateCustomChannel(
            node_target, grpc::InsecureChannelCredentials(), Arguments()))),
        listener_(std::move(listener)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.SetMaxSendMessageSize(64 << 20);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~RedirectingFront() override { server_->Shutdown(); }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

  grpc::Status RegisterNamespace(
      grpc::ServerContext*, const v1::RegisterNamespaceRequest* request,
      v1::RegisterNamespaceResponse* response) override {
    return Forward(&Stub::RegisterNamespace, *request, response);
  }
  grpc::Status BeginWrite(grpc::ServerContext*,
                          const v1::BeginWriteRequest* request,
                          v1::BeginWriteResponse* response) override {
    grpc::Status status = Forward(&Stub::BeginWrite, *request, response);
    if (response->has_data_plane()) Redirect(response->mutable_data_plane());
    return status;
  }
  grpc::Status CommitWrite(grpc::ServerContext*,
                           const v1::CommitWriteRequest* request,
                           v1::CommitWriteResponse* response) override {
    return Forward(&Stub::CommitWrite, *request, response);
  }
  grpc::Status AbortWrite(grpc::ServerContext*,
                          const v1::AbortWriteRequest* request,
                          v1::AbortWriteResponse* response) override {
    return Forward(&Stub::AbortWrite, *request, response);
  }
  grpc::Status BeginRead(grpc::ServerContext*,
                         const v1::BeginReadRequest* request,
                         v1::BeginReadResponse* response) override {
    grpc::Status status = Forward(&Stub::BeginRead, *request, response);
    if (response->has_data_plane()) Redirect(response->mutable_data_plane());
    return status;
  }
  grpc::Status EndRead(grpc::ServerContext*, const v1::EndReadRequest* request,
                       v1::EndReadResponse* response) override {
    return Forward(&Stub::EndRead, *request, response);
  }

 private:
  using Stub = v1::KvCache::Stub;
  static grpc::ChannelArguments Arguments() {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    return args;
  }
  template <typename Request, typename Response>
  grpc::Status Forward(grpc::Status (Stub::*call)(grpc::ClientContext*,
                                                  const Request&, Response*),
                       const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(30));
    return (stub_.get()->*call)(&context, request, response);
  }
  void Redirect(v1::DataPlaneInfo* info) const {
    info->set_ucx_address(listener_);
    info->clear_worker_address();
  }

  std::unique_ptr<Stub> stub_;
  std::string listener_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// The data-plane address a node advertises takes connections but never
// answers UCX (a firewall in front of its UCX ports, a wrong address):
// kAuto puts and gets still succeed, over gRPC, about kConnectTimeout into
// their 20 s timeout; later calls do not try UCX with that node again (no
// wait, no UCX read opened and ended); kUcx fails UNAVAILABLE; the node
// holds nothing afterwards.
TEST_P(UcxTest, AutoUsesGrpcSoonWhenTheDataPlaneAddressDoesNotAnswer) {
  if (!GetParam().tcp()) GTEST_SKIP() << "the black hole is a TCP listener";
  testing::BlackHole hole;
  ASSERT_NE(hole.port(), 0);
  RedirectingFront front(Target(), absl::StrCat("127.0.0.1:", hole.port()));
  ClientOptions copts;
  copts.target = front.target();
  copts.timeout = absl::Seconds(20);
  copts.max_message_bytes = 64 << 20;
  copts.data_plane = DataPlane::kAuto;
  auto auto_client = Client::Connect(copts);
  ASSERT_TRUE(auto_client.ok());
  copts.data_plane = DataPlane::kUcx;
  auto ucx_client = Client::Connect(copts);
  ASSERT_TRUE(ucx_client.ok());
  ASSERT_TRUE((*auto_client)
                  ->RegisterNamespace(Spec("hole", Codec::kNone, LargeShape()))
                  .ok());

  absl::Time started = absl::Now();
  ASSERT_TRUE(PutChain(auto_client->get(), "hole", LargeShape(), 0, 2).ok());
  const absl::Duration first_put = absl::Now() - started;
  EXPECT_GE(first_put, ucx::kConnectTimeout);
  EXPECT_LT(first_put, ucx::kConnectTimeout * 3);

  started = absl::Now();
  auto got = (*auto_client)->Get("hole", Keys(0, 2));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(PutChain(auto_client->get(), "hole", LargeShape(), 2, 2).ok());
  EXPECT_LT(absl::Now() - started, ucx::kConnectTimeout)
      << "the second round tried UCX again";
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(got->blocks[i].bytes.size(), data_[i].size() * 2);
    EXPECT_EQ(std::memcmp(got->blocks[i].bytes.data(), data_[i].data(),
                          data_[i].size() * 2),
              0);
  }

  started = absl::Now();
  auto refused = PutChain(ucx_client->get(), "hole", LargeShape(), 4, 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable)
      << refused.status();
  EXPECT_LT(absl::Now() - started, ucx::kConnectTimeout * 3);

  const std::string metrics = node_->metrics()->Render();
  EXPECT_EQ(TransferBytes(metrics, "in", "ucx"), 0u);
  EXPECT_EQ(TransferBytes(metrics, "out", "ucx"), 0u);
  EXPECT_GE(TransferBytes(metrics, "in", "grpc"), 4 * data_[0].size() * 2);
  ExpectNothingHeld(absl::Seconds(5));
}

// A GetInto decoded on the client with at least kStreamingDecodeBytes of
// fp16 is written with stores that bypass the cache (read_decode.h): fp8
// blocks through DecodeBlock's streaming stores, a block stored fp16 through
// StreamCopy. Decoded a few layers at a time, as WaitLayer does, into a
// 64-byte-aligned destination (so that every SIMD target that streams
// does), each block must equal its cached decode (DecodeRawLayers) or, the
// fp16 one, its stored bytes.
TEST(LayerDecoderTest, AStreamedDecodeEqualsTheCachedOne) {
  const kernels::BlockShape shape{16, 8, 128, 32};  // 2 MiB of fp16
  const size_t fp16_bytes = kernels::Fp16BlockBytes(shape);
  CodecPolicy fp8;
  fp8.codec = Codec::kFp8E4M3;
  const std::vector<CodecPolicy> policies = {fp8, CodecPolicy{}, fp8};
  ASSERT_GE(fp16_bytes * policies.size(), internal::kStreamingDecodeBytes);
  std::vector<std::vector<uint8_t>> raw;
  std::vector<std::string> expected;
  for (size_t b = 0; b < policies.size(); ++b) {
    const std::vector<uint16_t> block = RandomBlock(shape, 90 + b);
    raw.emplace_back(kernels::EncodedBlockBytes(shape, policies[b]));
    ASSERT_TRUE(
        kernels::EncodeBlock(shape, policies[b], block, absl::MakeSpan(raw[b]))
            .ok());
    std::string want(fp16_bytes, '\0');
    ASSERT_TRUE(internal::DecodeRawLayers(
                    shape, policies[b], raw[b], 0, shape.num_layers,
                    absl::MakeSpan(reinterpret_cast<uint8_t*>(want.data()),
                                   want.size()))
                    .ok());
    expected.push_back(std::move(want));
  }
  std::vector<uint8_t> memory(policies.size() * fp16_bytes + 64, 0xEE);
  uint8_t* dest = memory.data() +
                  (64 - reinterpret_cast<uintptr_t>(memory.data()) % 64) % 64;
  std::vector<internal::LayerDecoder::Block> blocks;
  for (size_t b = 0; b < policies.size(); ++b) {
    blocks.push_back({raw[b], policies[b],
                      absl::MakeSpan(dest + b * fp16_bytes, fp16_bytes)});
  }
  internal::LayerDecoder decoder(shape, std::move(blocks));
  for (uint32_t layers : {1u, 5u, 5u, 16u}) {
    ASSERT_TRUE(decoder.DecodeThrough(layers).ok()) << layers;
  }
  for (size_t b = 0; b < policies.size(); ++b) {
    EXPECT_EQ(
        std::memcmp(dest + b * fp16_bytes, expected[b].data(), fp16_bytes), 0)
        << "block " << b;
  }
}

// A data-plane address that accepts TCP connections but never answers UCX
// (what a firewall or a wrong address looks like): sends, pulls and reads
// fail with UNAVAILABLE (IsDataPlaneNotConnected) about kConnectTimeout
// after they start, not at their 20 s deadline, so that kAuto can still
// move the bytes over gRPC within the call.
TEST(UcxConnectTest, AnAddressThatNeverAnswersFailsUnavailableSoon) {
  ScopedEnv tls("UCX_TLS", "tcp");
  ScopedEnv devices("UCX_NET_DEVICES", "lo");
  testing::BlackHole hole;
  ASSERT_NE(hole.port(), 0);
  auto plane = ucx::ClientPlane::Create();
  ASSERT_TRUE(plane.ok()) << plane.status();
  ucx::NodeAddress address;
  address.listener = absl::StrCat("127.0.0.1:", hole.port());
  auto region = (*plane)->Allocate(1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  const absl::Duration bound = ucx::kConnectTimeout * 3;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  auto expect_not_connected = [&](const absl::Status& status,
                                  absl::Time started, const char* what) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable)
        << what << ": " << status;
    EXPECT_TRUE(ucx::IsDataPlaneNotConnected(status)) << what << ": " << status;
    EXPECT_GE(absl::Now() - started, ucx::kConnectTimeout) << what;
    EXPECT_LT(absl::Now() - started, bound) << what;
  };

  std::vector<uint8_t> bytes(256 << 10, 7);
  std::vector<ucx::ClientPlane::Block> blocks = {
      {0, absl::MakeConstSpan(bytes), nullptr},
      {1, absl::MakeConstSpan(bytes), nullptr}};
  absl::Time started = absl::Now();
  expect_not_connected(
      (*plane)->SendBlocks(address, 1, *ucx::NewToken(), blocks, deadline),
      started, "send");

  std::vector<ucx::ClientPlane::PullBlock> pulls = {
      {0, reinterpret_cast<uintptr_t>((*region)->data())}};
  started = absl::Now();
  expect_not_connected((*plane)->PullBlocks(address, 2, *ucx::NewToken(),
                                            **region, 5, pulls, deadline),
                       started, "pull");

  started = absl::Now();
  std::shared_ptr<ucx::MemoryRegion> shared = *std::move(region);
  auto read = (*plane)->StartRead(address, 3, *ucx::NewToken(), shared,
                                  {0, 512 << 10}, /*num_layers=*/1,
                                  /*per_layer=*/false);
  ASSERT_TRUE(read.ok()) << read.status();
  expect_not_connected((*read)->WaitLayers((*read)->num_layers(), deadline),
                       started, "read");
}

TEST(TcpSegmentsTest, ParsesUcxMemoryUnits) {
  EXPECT_EQ(*ucx::ParseMemoryUnits("64K"), 65536u);
  EXPECT_EQ(*ucx::ParseMemoryUnits("8kb"), 8192u);
  EXPECT_EQ(*ucx::ParseMemoryUnits("1M"), 1048576u);
  EXPECT_EQ(*ucx::ParseMemoryUnits("2G"), uint64_t{2} << 30);
  EXPECT_EQ(*ucx::ParseMemoryUnits("100000"), 100000u);
  EXPECT_EQ(*ucx::ParseMemoryUnits("inf"), UINT64_MAX);
  for (const char* bad : {"", "1.5m", "12X", "K", "64KK", "99999999999999G"}) {
    EXPECT_EQ(ucx::ParseMemoryUnits(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(TcpSegmentsTest, PeersFitWhenEachSendsNoMoreThanTheOtherReceives) {
  const ucx::TcpSegments defaults{8192, 65536};
  const ucx::TcpSegments big{8192, 1 << 20};
  const ucx::TcpSegments big_tx{65536, 65536};
  const ucx::TcpSegments too_big_tx{1 << 20, 65536};
  const ucx::TcpSegments none{};
  EXPECT_TRUE(ucx::CheckTcpSegments(defaults, defaults).ok());
  EXPECT_TRUE(ucx::CheckTcpSegments(big, big).ok());
  EXPECT_TRUE(ucx::CheckTcpSegments(big_tx, defaults).ok());
  EXPECT_TRUE(ucx::CheckTcpSegments(defaults, big_tx).ok());
  EXPECT_TRUE(ucx::CheckTcpSegments(none, big).ok());
  EXPECT_TRUE(ucx::CheckTcpSegments(big, none).ok());
  for (auto [local, node] :
       {std::pair{big, defaults}, std::pair{defaults, big},
        std::pair{too_big_tx, defaults}, std::pair{defaults, too_big_tx}}) {
    absl::Status fits = ucx::CheckTcpSegments(local, node);
    EXPECT_EQ(fits.code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(fits.message().find("UCX_TCP_RX_SEG_SIZE"), std::string::npos);
    EXPECT_TRUE(ucx::IsTcpSegmentsMismatch(fits));
  }
  EXPECT_FALSE(ucx::IsTcpSegmentsMismatch(
      absl::UnavailableError("UCX_TCP_RX_SEG_SIZE in another error")));
  EXPECT_FALSE(ucx::IsTcpSegmentsMismatch(absl::OkStatus()));
}

// The sizes come from the environment, as UCX reads them; a context without
// TCP has none.
TEST(TcpSegmentsTest, ReadsTheSizesAContextRunsWith) {
  ScopedEnv devices("UCX_NET_DEVICES", "lo");
  {
    ScopedEnv tls("UCX_TLS", "tcp");
    auto context = ucx::Context::Create("tcp-segments-test");
    ASSERT_TRUE(context.ok()) << context.status();
    auto segments = ucx::ReadTcpSegments(**context);
    ASSERT_TRUE(segments.ok()) << segments.status();
    EXPECT_GT(segments->tx_bytes, 0u);
    EXPECT_GT(segments->rx_bytes, 0u);
    ScopedEnv rx("UCX_TCP_RX_SEG_SIZE", "1m");
    ScopedEnv tx("UCX_TCP_TX_SEG_SIZE", "16k");
    auto configured = ucx::Context::Create("tcp-segments-test");
    ASSERT_TRUE(configured.ok()) << configured.status();
    segments = ucx::ReadTcpSegments(**configured);
    ASSERT_TRUE(segments.ok()) << segments.status();
    EXPECT_EQ(segments->rx_bytes, 1u << 20);
    EXPECT_EQ(segments->tx_bytes, 16u << 10);
  }
  ScopedEnv tls("UCX_TLS", "posix,sysv,self");
  auto context = ucx::Context::Create("tcp-segments-test");
  ASSERT_TRUE(context.ok()) << context.status();
  auto segments = ucx::ReadTcpSegments(**context);
  ASSERT_TRUE(segments.ok()) << segments.status();
  EXPECT_FALSE(segments->in_use());
}

TEST(UcxFlagsTest, ParsesAndChecksTheDataPlaneFlags) {
  auto f = service::ParseNodeFlags(
      {"--data-plane=ucx", "--ucx-listen=127.0.0.1:0",
       "--ucx-advertise=node-0.kvcache", "--staging-bytes=64MiB",
       "--ucx-read-delivery=puts", "--ucx-tcp-trusted-network=true"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->options.ucx.tcp_trusted_network);
  EXPECT_FALSE(service::ParseNodeFlags({})->options.ucx.tcp_trusted_network);
  EXPECT_EQ(service::ParseNodeFlags({})->options.ucx.listen, "");
  EXPECT_EQ(f->options.data_plane, service::DataPlaneMode::kUcx);
  EXPECT_EQ(f->options.ucx.listen, "127.0.0.1:0");
  EXPECT_EQ(f->options.ucx.advertise_host, "node-0.kvcache");
  EXPECT_EQ(f->options.ucx.staging_bytes, 64ull << 20);
  EXPECT_EQ(f->options.ucx.read_delivery, ucx::ReadDelivery::kPuts);
  EXPECT_EQ(service::ParseNodeFlags({})->options.data_plane,
            service::DataPlaneMode::kNone);
  EXPECT_EQ(service::ParseNodeFlags({})->options.ucx.read_delivery,
            ucx::ReadDelivery::kAuto);
  for (const char* bad :
       {"--data-plane=rdma", "--ucx-listen=nohostport", "--staging-bytes=0",
        "--staging-bytes=lots", "--ucx-read-delivery=messages",
        "--ucx-tcp-trusted-network=yes"}) {
    EXPECT_EQ(service::ParseNodeFlags({bad}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_NE(service::NodeUsage().find("--data-plane"), std::string::npos);
}

// --- a client process killed mid-transfer ---------------------------------

constexpr char kChildFlag[] = "--ucx-child";

// Runs this binary as a client that puts (or gets) large blocks in a loop
// until it is killed.
// In a freshly forked child: die with the test process, so that a failed
// or killed test never leaves a spinning child behind.
void DieWithParent(pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(1);  // the parent died before prctl
}

pid_t SpawnChild(const std::string& mode, const std::string& target) {
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    DieWithParent(parent);
    std::string self = "/proc/self/exe";
    execl(self.c_str(), self.c_str(), kChildFlag, mode.c_str(), target.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

TEST_P(UcxTest, ClientKilledMidTransferLeavesNothingAfterTheTtl) {
  const absl::Duration ttl = absl::Seconds(2);
  StartNode(512ull << 20, 256ull << 20, ttl);
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("victim", Codec::kFp8E4M3, shape)).ok());
  ASSERT_TRUE(PutChain(client_.get(), "victim", shape, 0, 32).ok());
  for (const std::string mode : {"put", "get"}) {
    pid_t child = SpawnChild(mode, Target());
    ASSERT_GT(child, 0);
    // Kill it while the node holds a session for it: a write with bytes
    // staged, or a read with its blocks pinned (a raw read is sent in place
    // and holds no staging).
    absl::Time deadline = absl::Now() + absl::Seconds(30);
    bool caught = false;
    while (absl::Now() < deadline && !caught) {
      ucx::DataPlaneStats s = node_->data_plane()->Stats();
      caught = mode == "put" ? s.staging_used_bytes > 0 && s.write_sessions > 0
                             : s.read_sessions > 0 &&
                                   node_->store()->Stats().pinned_bytes > 0;
      if (!caught) absl::SleepFor(absl::Microseconds(200));
    }
    kill(child, SIGKILL);
    int wstatus = 0;
    waitpid(child, &wstatus, 0);
    ASSERT_TRUE(caught) << mode << ": the child never had a transfer open";
    EXPECT_TRUE(WIFSIGNALED(wstatus)) << mode;
    // Everything the dead client held is reclaimed by the TTL (plus the
    // reaper's period and slack).
    ExpectNothingHeld(ttl + absl::Seconds(3));
  }
  // And the node still serves.
  auto got = client_->Get("victim", Keys(0, 4), ReadFormat::kRaw);
  ASSERT_TRUE(got.ok()) << got.status();
}

// A client process stopped (not killed) mid-put keeps its connection
// open: a receive into a block's own pages (codec none) may stall there,
// and its claim holds the write's lease. The node still takes everything
// back by the lease's deadline, closing the stalled connection.
TEST_P(UcxTest, ClientStoppedMidPutLeavesNothingAfterTheTtl) {
  const absl::Duration ttl = absl::Seconds(2);
  StartNode(512ull << 20, 256ull << 20, ttl);
  ASSERT_TRUE(
      client_
          ->RegisterNamespace(Spec("victim-none", Codec::kNone, LargeShape()))
          .ok());
  pid_t child = SpawnChild("put-none", Target());
  ASSERT_GT(child, 0);
  absl::Time deadline = absl::Now() + absl::Seconds(30);
  bool caught = false;
  while (absl::Now() < deadline && !caught) {
    caught = node_->data_plane()->Stats().write_blocks_unlanded > 0 &&
             node_->store()->Stats().reserved_bytes > 0;
    if (!caught) absl::SleepFor(absl::Microseconds(200));
  }
  kill(child, SIGSTOP);
  ASSERT_TRUE(caught) << "the child never had a write open";
  ExpectNothingHeld(ttl + absl::Seconds(3));
  kill(child, SIGKILL);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  auto put = PutChain(client_.get(), "victim-none", LargeShape(), 0, 4);
  EXPECT_TRUE(put.ok()) << put.status();
}

// A sender that stops progressing after its block's rendezvous began: the
// node's receive into the block's pages stalls, and its claim holds the
// write's lease. At the lease's deadline the node closes the connection,
// whether a commit is waiting on the write (it then fails UNAVAILABLE, not
// at its own, later deadline) or the write has failed already (a bad
// block; the commit answered at once), and nothing stays held. Over
// shared memory the node fetches the bytes without the sender, so only
// tcp stalls.
TEST_P(UcxTest, AStalledReceiveEndsByTheLeasesDeadline) {
  if (!GetParam().tcp()) GTEST_SKIP() << "shared memory does not stall here";
  const absl::Duration ttl = absl::Seconds(2);
  StartNode(1ull << 30, 256ull << 20, ttl);
  // 64 MiB: far more than loopback's socket buffers take at once, so the
  // rendezvous does not end within the progress calls that start it (16
  // MiB did, once in a few runs with 2 progress threads).
  const kernels::BlockShape shape{32, 8, 128, 512};
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("stalled", Codec::kNone, shape)).ok());
  auto stub = kvcache::v1::KvCache::NewStub(
      grpc::CreateChannel(Target(), grpc::InsecureChannelCredentials()));
  const std::vector<uint16_t> block = RandomBlock(shape, 0);
  const std::vector<uint16_t> short_block(16);
  for (bool failed_first : {false, true}) {
    SCOPED_TRACE(failed_first ? "the write failed first" : "a commit waits");
    kvcache::v1::BeginWriteRequest begin;
    begin.set_namespace_name("stalled");
    begin.add_blocks()->set_key(Key(failed_first ? 2 : 0));
    begin.add_blocks()->set_key(Key(failed_first ? 3 : 1));
    begin.set_use_data_plane(true);
    kvcache::v1::BeginWriteResponse begun;
    {
      grpc::ClientContext ctx;
      grpc::Status rpc = stub->BeginWrite(&ctx, begin, &begun);
      ASSERT_TRUE(rpc.ok()) << rpc.error_message();
    }
    ASSERT_TRUE(begun.has_data_plane());
    // A sender progressed by hand, on this thread only.
    auto context = ucx::Context::Create("stalled-sender");
    ASSERT_TRUE(context.ok()) << context.status();
    auto worker = ucx::Worker::Create(**context);
    ASSERT_TRUE(worker.ok()) << worker.status();
    bool peer_errors = false;
    auto ep = ucx::Endpoint::ConnectToWorker(
        **worker, begun.data_plane().worker_address(),
        [](void*, ucp_ep_h, ucs_status_t) noexcept {}, nullptr, &peer_errors);
    ASSERT_TRUE(ep.ok()) << ep.status();
    // Wired up first (a flush, then 200 ms more of progress with nothing in
    // flight, for the node's wire-up reply that names its endpoint): then
    // block 0's rendezvous request normally leaves from within
    // ucp_am_send_nbx, and the sender need not progress after it.
    std::optional<absl::Status> flushed;
    ucx::Operation::Start(
        ucx::Operation::Kind::kSend,
        [raw = (*ep)->get()](const ucp_request_param_t& param,
                             absl::string_view) {
          return ucp_ep_flush_nbx(raw, &param);
        },
        [&flushed](absl::Status s) { flushed = s; });
    for (const absl::Time until = absl::Now() + absl::Seconds(10);
         !flushed.has_value() && absl::Now() < until;) {
      ucp_worker_progress((*worker)->get());
    }
    ASSERT_TRUE(flushed.has_value()) << "the sender never connected";
    ASSERT_TRUE(flushed->ok()) << *flushed;
    for (const absl::Time idle = absl::Now() + absl::Milliseconds(200);
         absl::Now() < idle;) {
      ucp_worker_progress((*worker)->get());
    }
    int sent = 0;
    bool block_sent = false;
    auto send = [&](uint32_t index, const std::vector<uint16_t>& bytes,
                    uint32_t flags) {
      ucx::WriteBlockHeader h;
      h.write_id = begun.write_id();
      h.token = *ucx::TokenFromBytes(begun.data_plane().token());
      h.index = index;
      h.length = bytes.size() * sizeof(uint16_t);
      ucx::Operation::Start(
          ucx::Operation::Kind::kSend,
          [raw = (*ep)->get(), &bytes, flags](const ucp_request_param_t& param,
                                              absl::string_view kept) {
            ucp_request_param_t p = param;
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_AM_SEND_FLAG_REPLY | flags;
            return ucp_am_send_nbx(raw, ucx::kAmWriteBlock, kept.data(),
                                   kept.size(), bytes.data(),
                                   bytes.size() * sizeof(uint16_t), &p);
          },
          [&sent, &block_sent, index](absl::Status) {
            ++sent;
            block_sent = block_sent || index == 0;
          },
          ucx::Encode(h));
    };
    // Block 0 by rendezvous; where the write is to fail first, block 1 of
    // the wrong length, which the node refuses as it arrives.
    const uint64_t in_place =
        node_->data_plane()->Stats().blocks_received_in_place;
    send(0, block, UCP_AM_SEND_FLAG_RNDV);
    if (failed_first) send(1, short_block, UCP_AM_SEND_FLAG_EAGER);
    // Wait, not progressing, for the node to post its receive into block
    // 0's pages. A progress call that overlaps the node's post can carry
    // the whole block (CI, once, when this loop progressed without pause:
    // "the rendezvous ended"). Should the request not have left within the
    // send, the sender progresses once per 100 ms until it is seen.
    auto posted = [&] {
      return node_->data_plane()->Stats().blocks_received_in_place != in_place;
    };
    for (const absl::Time until = absl::Now() + absl::Seconds(10);
         !posted() && absl::Now() < until;) {
      const absl::Time look = absl::Now() + absl::Milliseconds(100);
      while (!posted() && absl::Now() < look) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      if (!posted()) ucp_worker_progress((*worker)->get());
    }
    ASSERT_EQ(node_->data_plane()->Stats().blocks_received_in_place,
              in_place + 1);
    ASSERT_FALSE(block_sent) << "the rendezvous ended";
    kvcache::v1::CommitWriteRequest commit;
    commit.set_write_id(begun.write_id());
    kvcache::v1::CommitWriteResponse committed;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    const absl::Time started = absl::Now();
    grpc::Status rpc = stub->CommitWrite(&ctx, commit, &committed);
    EXPECT_EQ(rpc.error_code(), failed_first
                                    ? grpc::StatusCode::INVALID_ARGUMENT
                                    : grpc::StatusCode::UNAVAILABLE)
        << rpc.error_message();
    EXPECT_LT(absl::Now() - started, ttl + absl::Seconds(3));
    ExpectNothingHeld(ttl + absl::Seconds(3));
    // The sender's end: its send fails once its endpoint is closed.
    ep->reset();
    for (int i = 0; i < 1000 && sent < (failed_first ? 2 : 1); ++i) {
      ucp_worker_progress((*worker)->get());
    }
    EXPECT_EQ(sent, failed_first ? 2 : 1);
  }
}

// A node process killed while a client streams to and from it: every call
// in flight ends, UNAVAILABLE (or DEADLINE_EXCEEDED where the transport
// cannot notice a dead peer), within its deadline.
TEST_P(UcxTest, NodeKilledMidTransferFailsCallsWithinTheirDeadline) {
  client_.reset();
  grpc_client_.reset();
  node_.reset();
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t parent = getpid();
  pid_t node = fork();
  if (node == 0) {
    DieWithParent(parent);
    dup2(fds[1], 1);
    close(fds[0]);
    execl("/proc/self/exe", "/proc/self/exe", kChildFlag, "node", "-",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  ASSERT_GT(node, 0);
  close(fds[1]);
  char buf[32] = {};
  ssize_t n = read(fds[0], buf, sizeof(buf) - 1);
  close(fds[0]);
  ASSERT_GT(n, 0);
  const std::string target = absl::StrCat("127.0.0.1:", std::atoi(buf));
  ClientOptions copts;
  copts.target = target;
  copts.timeout = absl::Seconds(5);
  copts.data_plane = DataPlane::kUcx;
  copts.max_message_bytes = 64 << 20;
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok());
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      (*client)->RegisterNamespace(Spec("far", Codec::kNone, shape)).ok());
  ASSERT_TRUE(PutChain(client->get(), "far", shape, 0, 8).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> ok_calls{0};
  absl::Status last;
  absl::Duration longest_failure;
  std::thread traffic([&] {
    for (int round = 0; !stop.load(); ++round) {
      absl::Time start = absl::Now();
      absl::Status st =
          round % 2 == 0
              ? PutChain(client->get(), "far", shape, 100 + round * 8, 8)
                    .status()
              : (*client)->Get("far", Keys(0, 8)).status();
      if (st.ok()) {
        ++ok_calls;
        continue;
      }
      if (ok_calls.load() < 4) ADD_FAILURE() << "before the kill: " << st;
      last = st;
      longest_failure = std::max(longest_failure, absl::Now() - start);
      if (st.code() == absl::StatusCode::kUnavailable ||
          st.code() == absl::StatusCode::kDeadlineExceeded) {
        return;
      }
    }
  });
  absl::Time wait_until = absl::Now() + absl::Seconds(30);
  while (ok_calls.load() < 4 && absl::Now() < wait_until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  kill(node, SIGKILL);
  waitpid(node, nullptr, 0);
  absl::Time killed = absl::Now();
  traffic.join();  // returns at the first failed call
  stop.store(true);
  EXPECT_GE(ok_calls.load(), 4);
  EXPECT_TRUE(last.code() == absl::StatusCode::kUnavailable ||
              last.code() == absl::StatusCode::kDeadlineExceeded)
      << last;
  EXPECT_LE(absl::Now() - killed, copts.timeout + absl::Seconds(3));
  EXPECT_LE(longest_failure, copts.timeout + absl::Seconds(3));
}

// A node in a child process (this binary in child mode "node"), killed
// when this goes out of scope.
class ChildNode {
 public:
  ChildNode() {
    int fds[2];
    if (pipe(fds) != 0) return;
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      DieWithParent(parent);
      dup2(fds[1], 1);
      close(fds[0]);
      execl("/proc/self/exe", "/proc/self/exe", kChildFlag, "node", "-",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    char buf[32] = {};
    if (pid_ > 0 && read(fds[0], buf, sizeof(buf) - 1) > 0) {
      target_ = absl::StrCat("127.0.0.1:", std::atoi(buf));
    }
    close(fds[0]);
  }
  ~ChildNode() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  ChildNode(const ChildNode&) = delete;
  ChildNode& operator=(const ChildNode&) = delete;

  // Empty when the node did not start.
  const std::string& target() const { return target_; }
  // Returns once every thread of the node has stopped (bounded).
  void Pause() {
    kill(pid_, SIGSTOP);
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (!Stopped() && absl::Now() < give_up) {
      absl::SleepFor(absl::Microseconds(100));
    }
    EXPECT_TRUE(Stopped());
  }
  void Resume() { kill(pid_, SIGCONT); }

 private:
  // Every thread's state in /proc is 'T' (stopped).
  bool Stopped() const {
    const std::string tasks = absl::StrCat("/proc/", pid_, "/task");
    std::error_code error;
    for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      // "tid (comm) S ...": the state follows the last ')'.
      const size_t paren = line.rfind(')');
      if (paren == std::string::npos || paren + 2 >= line.size() ||
          line[paren + 2] != 'T') {
        return false;
      }
    }
    return !error;
  }

  pid_t pid_ = -1;
  std::string target_;
};

// A paused node (SIGSTOP) is a hung node for both planes: a control RPC
// and a data-plane wait end at the call's deadline, or at once when the
// call is cancelled from another thread.
TEST_P(UcxTest, PausedNodeEndsCallsAtTheirDeadlineOrWhenCancelled) {
  client_.reset();
  grpc_client_.reset();
  node_.reset();
  ChildNode node;
  ASSERT_FALSE(node.target().empty());
  ClientOptions copts;
  copts.target = node.target();
  copts.timeout = absl::Seconds(20);
  copts.data_plane = DataPlane::kUcx;
  copts.max_message_bytes = 64 << 20;
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok());
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      (*client)->RegisterNamespace(Spec("paused", Codec::kNone, shape)).ok());
  constexpr int kBlocks = 32;  // 16 MiB: a read takes a while to land
  ASSERT_TRUE(PutChain(client->get(), "paused", shape, 0, kBlocks).ok());
  const size_t stride = kernels::Fp16BlockBytes(shape);
  std::vector<uint8_t> buffer(kBlocks * stride);

  // Starts a read, pauses the node, and waits for every layer. A read that
  // landed before the pause took effect tells nothing: tried again.
  auto paused_read = [&](const CallOptions& call,
                         const std::function<void()>& meanwhile,
                         absl::Status* status, absl::Time* returned) {
    for (int attempt = 0; attempt < 10; ++attempt) {
      auto read = (*client)->GetInto("paused", Keys(0, kBlocks), ReadOptions{},
                                     absl::MakeSpan(buffer), stride, call);
      if (!read.ok()) {
        *status = read.status();
        return false;
      }
      node.Pause();
      std::thread side(meanwhile);
      *status = (*read)->Wait();
      *returned = absl::Now();
      side.join();
      // Destroying an unfinished read closes its connection: at once, even
      // with the node paused.
      const absl::Time destroy = absl::Now();
      read->reset();
      EXPECT_LT(absl::Now() - destroy, absl::Seconds(1));
      node.Resume();
      if (!status->ok()) return true;
    }
    return false;
  };

  // The data-plane waits. Only where UCX has peer failure handling (tcp):
  // over UCX 1.13's shared memory a read abandoned mid-transfer cannot stop
  // the node, whose puts would land in `buffer` after the node resumes.
  const bool peer_failures = GetParam().tcp();
  // Cancelled from another thread while the bytes are not coming.
  if (peer_failures) {
    CallOptions call;
    call.timeout = absl::Seconds(20);
    call.cancel = std::make_shared<CancelToken>();
    absl::Time cancelled_at = absl::InfiniteFuture();
    absl::Status st;
    absl::Time returned;
    bool caught = false;
    for (int i = 0; i < 5 && !caught; ++i) {
      call.cancel = std::make_shared<CancelToken>();
      caught = paused_read(
          call,
          [&] {
            absl::SleepFor(absl::Milliseconds(200));
            cancelled_at = absl::Now();
            call.cancel->Cancel();
          },
          &st, &returned);
    }
    ASSERT_TRUE(caught) << st;
    EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
    EXPECT_LT(returned - cancelled_at, absl::Milliseconds(500));
  }
  // The call's deadline.
  if (peer_failures) {
    CallOptions call;
    absl::Status st;
    absl::Time returned;
    absl::Time deadline;
    bool caught = false;
    for (int i = 0; i < 5 && !caught; ++i) {
      call.deadline = deadline = absl::Now() + absl::Seconds(1);
      caught = paused_read(
          call, [] {}, &st, &returned);
    }
    ASSERT_TRUE(caught) << st;
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_LT(returned - deadline, absl::Seconds(1));
  }
  // Shared memory: destroying an unfinished read waits (bounded) for the
  // node's final report, so that no put lands after the destructor.
  if (!peer_failures) {
    bool caught = false;
    absl::Duration took;
    for (int attempt = 0; attempt < 10 && !caught; ++attempt) {
      std::fill(buffer.begin(), buffer.end(), 0);
      auto read = (*client)->GetInto("paused", Keys(0, kBlocks), ReadOptions{},
                                     absl::MakeSpan(buffer), stride);
      ASSERT_TRUE(read.ok()) << read.status();
      node.Pause();
      std::thread resumer([&] {
        absl::SleepFor(absl::Milliseconds(300));
        node.Resume();
      });
      const absl::Time start = absl::Now();
      read->reset();
      took = absl::Now() - start;
      resumer.join();
      // A read that had landed before the pause returns at once: again.
      caught = took >= absl::Milliseconds(250);
    }
    ASSERT_TRUE(caught) << "every read landed before the node was paused";
    EXPECT_LT(took, absl::Seconds(5));
    for (int b = 0; b < kBlocks; ++b) {
      EXPECT_EQ(
          std::memcmp(buffer.data() + b * stride, data_[b].data(), stride), 0)
          << "block " << b << " was not all there when the read ended";
    }
  }
  // Control-plane calls to the paused node.
  node.Pause();
  CallOptions short_call;
  short_call.timeout = absl::Milliseconds(300);
  absl::Time start = absl::Now();
  EXPECT_EQ((*client)
                ->Lookup("paused", Keys(0, 1), false, short_call)
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1300));
  for (bool put : {false, true}) {
    CallOptions call;
    call.timeout = absl::Seconds(20);
    call.cancel = std::make_shared<CancelToken>();
    std::thread canceller([&] {
      absl::SleepFor(absl::Milliseconds(150));
      call.cancel->Cancel();
    });
    start = absl::Now();
    absl::Status st;
    if (put) {
      std::vector<uint16_t> block = RandomBlock(shape, 99);
      BlockWrite w{Key(99), "", block};
      st = (*client)->Put("paused", {&w, 1}, call).status();
    } else {
      st = (*client)->Get("paused", Keys(0, 2), ReadOptions{}, call).status();
    }
    canceller.join();
    EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(800));
  }
  node.Resume();
  // Resumed, the node serves the client again, at the first call. The
  // node's teardown of the connections force-closed while it was paused
  // can reset the TCP connection UCX shares between endpoints of the same
  // two workers; the client then tries the read once more on a new
  // connection (IsFreshConnectionReset).
  absl::StatusOr<GetResult> got = (*client)->Get("paused", Keys(0, kBlocks));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->blocks.size(), static_cast<size_t>(kBlocks));
}

// A read that passes its deadline on a node that is answering lets its
// transfer finish (briefly) rather than force-closing the connection that
// the process's other calls share: a neighbour read on that connection
// still succeeds. (Over TCP, UCX shares one TCP connection between the
// endpoints of two workers, and a force-close could also lose the messages
// of the connections made after it.)
TEST_P(UcxTest, AReadPastItsDeadlineLeavesItsNeighboursAlone) {
  // Over shared memory a late read never closes its connection (closing
  // would not stop the node's puts), and a 4 MiB read often lands before
  // even a 1 ms deadline, so the case cannot be made there.
  if (!GetParam().tcp()) {
    GTEST_SKIP() << "shared memory: a late read does not close its connection";
  }
  const kernels::BlockShape shape = LargeShape();
  ASSERT_TRUE(
      client_->RegisterNamespace(Spec("neighbours", Codec::kNone, shape)).ok());
  constexpr int kBlocks = 8;  // 4 MiB: milliseconds to land
  ASSERT_TRUE(PutChain(client_.get(), "neighbours", shape, 0, kBlocks).ok());
  const size_t stride = kernels::Fp16BlockBytes(shape);
  std::vector<uint8_t> neighbour_buffer(kBlocks * stride);
  std::vector<uint8_t> hasty_buffer(kBlocks * stride);
  int hasty_late = 0;
  for (int round = 0; round < 12; ++round) {
    auto neighbour =
        client_->GetInto("neighbours", Keys(0, kBlocks), ReadOptions{},
                         absl::MakeSpan(neighbour_buffer), stride);
    ASSERT_TRUE(neighbour.ok()) << neighbour.status();
    CallOptions hasty_call;
    hasty_call.timeout = absl::Milliseconds(1 + round);
    auto hasty =
        client_->GetInto("neighbours", Keys(0, kBlocks), ReadOptions{},
                         absl::MakeSpan(hasty_buffer), stride, hasty_call);
    if (hasty.ok()) {
      const absl::Status st = (*hasty)->Wait();
      EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kDeadlineExceeded)
          << st;
      if (!st.ok()) ++hasty_late;
    }
    const absl::Status st = (*neighbour)->Wait();
    ASSERT_TRUE(st.ok()) << "round " << round << ": " << st;
    for (int b = 0; b < kBlocks; ++b) {
      ASSERT_EQ(std::memcmp(neighbour_buffer.data() + b * stride,
                            data_[b].data(), stride),
                0)
          << "block " << b;
    }
  }
  // The test means something only where reads passed their deadline on
  // the data plane.
  EXPECT_GT(hasty_late, 0);
  // Not checked here: a hasty read that did not settle in time was
  // force-closed, and the node may hold its session until the lease's TTL
  // (it does not always see a client's force-close over TCP).
}

INSTANTIATE_TEST_SUITE_P(
    Transports, UcxTest,
    ::testing::Values(Transport{"tcp", "tcp"},
                      Transport{"tcp_puts", "tcp", ucx::ReadDelivery::kPuts},
                      Transport{"shm", "posix,sysv,self"},
                      Transport{"tcp_2threads", "tcp", ucx::ReadDelivery::kAuto,
                                2},
                      Transport{"shm_2threads", "posix,sysv,self",
                                ucx::ReadDelivery::kAuto, 2}),
    [](const ::testing::TestParamInfo<Transport>& info) {
      return std::string(info.param.name);
    });

// Child mode "node": a node with the UCX data plane on loopback; prints its
// gRPC port on stdout and serves until killed.
int NodeChildMain() {
  service::NodeOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.memory = {store::MemoryKind::kHost, 0, 256ull << 20};
  options.store.page_size = 16384;
  options.max_request_bytes = 64 << 20;
  options.worker_threads = 2;
  options.data_plane = service::DataPlaneMode::kUcx;
  options.ucx.tcp_trusted_network = true;  // loopback
  options.ucx.listen = "127.0.0.1:0";
  signal(SIGPIPE, SIG_IGN);
  service::Node node(options);
  if (!node.Start().ok()) return 2;
  std::printf("%d\n", node.port());
  std::fflush(stdout);
  // The parent stops reading after the port; UCX logs to stdout.
  if (std::freopen("/dev/null", "w", stdout) == nullptr) return 2;
  for (;;) absl::SleepFor(absl::Seconds(60));
}

int ChildMain(const std::string& mode, const std::string& target) {
  if (mode == "node") return NodeChildMain();
  ClientOptions copts;
  copts.target = target;
  copts.timeout = absl::Seconds(30);
  copts.max_message_bytes = 64 << 20;
  copts.data_plane = DataPlane::kUcx;
  auto client = Client::Connect(copts);
  if (!client.ok()) return 2;
  const kernels::BlockShape shape = LargeShape();
  std::vector<std::vector<uint16_t>> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(RandomBlock(shape, 1000 + i));
  for (uint64_t round = 0;; ++round) {
    if (mode == "put" || mode == "put-none") {
      std::vector<BlockWrite> writes;
      for (int i = 0; i < 16; ++i) {
        writes.push_back(
            {absl::StrCat("child-", round, "-", i), "", blocks[i]});
      }
      (*client)
          ->Put(mode == "put" ? "victim" : "victim-none", writes)
          .IgnoreError();
    } else {
      std::vector<std::string> keys;
      for (int i = 0; i < 32; ++i) keys.push_back(Key(i));
      (*client)->Get("victim", keys, ReadFormat::kFp16).IgnoreError();
    }
  }
}

}  // namespace
}  // namespace kvcache

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], kvcache::kChildFlag) == 0) {
    return kvcache::ChildMain(argv[2], argv[3]);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
