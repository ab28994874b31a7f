// kvcache::DeviceClient (kvcache/device.h) against an in-process node with
// the UCX data plane on loopback (tcp and shared memory, as ucx_test.cc),
// read by a UCX client and by a gRPC-only client.
//
// Host behaviour runs everywhere: host pointers through the device API give
// the plain Client's bytes (Put, reads in each mode, layer by layer, CPU
// decoding of raw reads, KIVI residual blocks, fp16 layers, static scales),
// staging is pooled, bad arguments are refused, and a process without a
// device gets FAILED_PRECONDITION. The Device* tests need a CUDA device and
// GTEST_SKIP without one.
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cuda/device_runtime.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kvcache/client.h"
#include "kvcache/device.h"
#include "service/node.h"
#include "tests/test_util.h"

namespace kvcache {
namespace {

namespace di = device_internal;
using kvcache::testing::Key;
using kvcache::testing::RandomBlock;

// 4 layers (so that layer-wise order is visible), 32 KiB of fp16 per block,
// valid for every codec at G = 32.
kernels::BlockShape Shape() { return {4, 2, 32, 32}; }
constexpr int kBlocks = 6;
// Slots larger than a block: padding that must stay untouched.
const size_t kStride = kernels::Fp16BlockBytes(Shape()) + 256;
constexpr uint8_t kFill = 0xEE;

struct Transport {
  const char* name;
  const char* tls;
};

void PrintTo(const Transport& t, std::ostream* os) { *os << t.name; }

std::vector<std::string> Keys(int n) {
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(Key(i));
  return keys;
}

// The namespaces every test reads: each exercises another decode path.
struct NsCase {
  const char* name;
  CodecPolicy policy;
  std::optional<uint32_t> residual_tokens;
};

std::vector<NsCase> Namespaces() {
  std::vector<NsCase> all;
  all.push_back({"none", CodecPolicy{}, std::nullopt});
  CodecPolicy e5m2;
  e5m2.codec = Codec::kFp8E5M2;
  all.push_back({"fp8-dynamic", e5m2, std::nullopt});
  // Static per-layer-head scales and an fp16 layer: per-layer policies.
  CodecPolicy fixed;
  fixed.codec = Codec::kFp8E4M3;
  fixed.scale_mode = ScaleMode::kStaticPerLayerHead;
  fixed.fp16_layers = {1};
  for (int i = 0; i < 8; ++i) {
    fixed.static_k_scales.push_back(0.01f * (i + 1));
    fixed.static_v_scales.push_back(0.02f * (i + 1));
  }
  all.push_back({"fp8-static", fixed, std::nullopt});
  // KIVI with a residual window of two blocks: blocks 4 and 5 stay fp16
  // (codec none), 0 to 3 are re-encoded.
  CodecPolicy kivi;
  kivi.codec = Codec::kKivi2;
  all.push_back({"kivi2", kivi, 64u});
  return all;
}

class DeviceClientTest : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", GetParam().tls, 1);
    setenv("UCX_NET_DEVICES", "lo", 1);
    service::NodeOptions options;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "";
    options.memory = {store::MemoryKind::kHost, 0, 128ull << 20};
    options.store.page_size = 16384;
    options.store.max_blocks_per_request = 64;
    options.max_request_bytes = 64 << 20;
    options.drain_timeout = absl::Seconds(5);
    options.worker_threads = 2;
    options.reaper_interval = absl::Milliseconds(50);
    options.data_plane = service::DataPlaneMode::kUcx;
    options.ucx.tcp_trusted_network = true;  // loopback
    options.ucx.listen = "127.0.0.1:0";
    options.ucx.staging_bytes = 64ull << 20;
    node_ = std::make_unique<service::Node>(options);
    absl::Status started = node_->Start();
    ASSERT_TRUE(started.ok()) << started;
    ucx_ = NewClient(DataPlane::kUcx);
    grpc_ = NewClient(DataPlane::kGrpc);
    ASSERT_NE(ucx_, nullptr);
    ASSERT_NE(grpc_, nullptr);
    for (int i = 0; i < kBlocks; ++i) data_.push_back(RandomBlock(Shape(), i));
  }

  std::unique_ptr<Client> NewClient(DataPlane plane) {
    ClientOptions copts;
    copts.target = absl::StrCat("127.0.0.1:", node_->port());
    copts.timeout = absl::Seconds(20);
    copts.max_message_bytes = 64 << 20;
    copts.data_plane = plane;
    auto client = Client::Connect(copts);
    return client.ok() ? *std::move(client) : nullptr;
  }

  std::unique_ptr<DeviceClient> NewDeviceClient(
      Client* client, DeviceClientOptions options = {}) {
    auto device = DeviceClient::Create(client, options);
    EXPECT_TRUE(device.ok()) << device.status();
    return device.ok() ? *std::move(device) : nullptr;
  }

  std::vector<BlockWrite> Writes() const {
    std::vector<BlockWrite> writes;
    for (int i = 0; i < kBlocks; ++i) writes.push_back({Key(i), "", data_[i]});
    return writes;
  }

  void Register(const NsCase& c) {
    NamespaceSpec spec;
    spec.name = c.name;
    spec.model = "device-test";
    spec.shape = Shape();
    spec.policy = c.policy;
    spec.residual_tokens = c.residual_tokens.value_or(0);
    auto info = ucx_->RegisterNamespace(spec);
    ASSERT_TRUE(info.ok()) << info.status();
  }

  // Registers every namespace and stores the blocks through `device` (host
  // pointers); waits until KIVI's window has re-encoded what left it.
  void Populate(DeviceClient* device) {
    for (const NsCase& c : Namespaces()) {
      Register(c);
      auto put = device->Put(c.name, Writes());
      ASSERT_TRUE(put.ok()) << c.name << ": " << put.status();
      ASSERT_EQ(put->stored, static_cast<uint32_t>(kBlocks)) << c.name;
    }
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    uint64_t residual = 0;
    do {
      auto stats = ucx_->Stats();
      ASSERT_TRUE(stats.ok()) << stats.status();
      residual = stats->namespaces["kivi2"].residual_blocks;
      if (residual == 2) break;
      absl::SleepFor(absl::Milliseconds(20));
    } while (absl::Now() < deadline);
    ASSERT_EQ(residual, 2u) << "KIVI's window did not re-encode in time";
  }

  // The plain Client's answer (gRPC inline), the reference for every read.
  GetResult Reference(const std::string& ns, ReadFormat format) {
    auto got = grpc_->Get(ns, Keys(kBlocks), format);
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? *std::move(got) : GetResult{};
  }

  // Layer `l` of block `b` as `mode` must leave it in the destination.
  static std::string ExpectedLayer(const GetResult& fp16, const GetResult& raw,
                                   DeviceReadMode mode,
                                   const BlockPlacement& placement, int b,
                                   uint32_t l) {
    const uint64_t begin = l == 0 ? 0 : placement.layer_ends[l - 1];
    const uint64_t end = placement.layer_ends[l];
    const GetResult& ref = mode == DeviceReadMode::kRaw ? raw : fp16;
    return ref.blocks[b].bytes.substr(begin, end - begin);
  }

  // Checks one layer of every block of `dest` (host bytes of the
  // destination), and when `whole`, every byte of every slot.
  void CheckLayer(const std::vector<uint8_t>& dest, const DeviceRead& read,
                  const GetResult& fp16, const GetResult& raw,
                  DeviceReadMode mode, uint32_t l, const std::string& what) {
    for (int b = 0; b < kBlocks; ++b) {
      const BlockPlacement& p = read.placements()[b];
      const uint64_t begin = l == 0 ? 0 : p.layer_ends[l - 1];
      std::string want = ExpectedLayer(fp16, raw, mode, p, b, l);
      ASSERT_EQ(
          std::memcmp(dest.data() + p.offset + begin, want.data(), want.size()),
          0)
          << what << ": block " << b << " layer " << l;
    }
  }

  void CheckWhole(const std::vector<uint8_t>& dest, const DeviceRead& read,
                  const GetResult& fp16, const GetResult& raw,
                  DeviceReadMode mode, const std::string& what) {
    for (int b = 0; b < kBlocks; ++b) {
      const BlockPlacement& p = read.placements()[b];
      const GetResult& ref = mode == DeviceReadMode::kRaw ? raw : fp16;
      ASSERT_EQ(p.offset, b * kStride);
      ASSERT_EQ(p.length, ref.blocks[b].bytes.size()) << what;
      ASSERT_EQ(p.layer_ends.back(), p.length) << what;
      EXPECT_EQ(std::memcmp(dest.data() + p.offset, ref.blocks[b].bytes.data(),
                            p.length),
                0)
          << what << ": block " << b;
      for (uint64_t i = p.offset + p.length; i < (b + 1) * kStride; ++i) {
        ASSERT_EQ(dest[i], kFill) << what << ": padding of block " << b;
      }
    }
  }

  std::unique_ptr<service::Node> node_;
  std::unique_ptr<Client> ucx_;   // DataPlane::kUcx
  std::unique_ptr<Client> grpc_;  // DataPlane::kGrpc (inline reads)
  std::vector<std::vector<uint16_t>> data_;
};

constexpr DeviceReadMode kModes[] = {
    DeviceReadMode::kFp16, DeviceReadMode::kRaw, DeviceReadMode::kDecodeHere};

const char* ModeName(DeviceReadMode mode) {
  switch (mode) {
    case DeviceReadMode::kFp16:
      return "fp16";
    case DeviceReadMode::kRaw:
      return "raw";
    case DeviceReadMode::kDecodeHere:
      return "decode-here";
  }
  return "?";
}

TEST(DeviceDiscoveryTest, StatusAgreesWithTheDeviceCount) {
  const absl::Status status = CudaDeviceStatus();
  if (CudaDeviceCount() > 0) {
    EXPECT_TRUE(status.ok()) << status;
  } else {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_NE(status.message().find("no usable CUDA device: "),
              absl::string_view::npos)
        << status;
    EXPECT_GT(status.message().size(),
              std::string("no usable CUDA device: ").size())
        << "the reason is missing";
  }
  // Host memory is never device memory, with or without a device.
  std::vector<uint8_t> heap(64);
  int stack = 0;
  EXPECT_FALSE(IsDeviceMemory(heap.data()));
  EXPECT_FALSE(IsDeviceMemory(&stack));
  EXPECT_FALSE(IsDeviceMemory(nullptr));
}

TEST(DeviceDiscoveryTest, WithoutADeviceDeviceRequestsAreFailedPrecondition) {
  if (CudaDeviceCount() > 0) {
    GTEST_SKIP() << "a CUDA device is present: this checks the no-device path";
  }
  ClientOptions copts;
  copts.target = "127.0.0.1:1";  // never contacted: each call fails first
  copts.data_plane = DataPlane::kGrpc;
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok()) << client.status();
  DeviceClientOptions required;
  required.require_device = true;
  EXPECT_EQ(DeviceClient::Create(client->get(), required).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto device = DeviceClient::Create(client->get());
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_FALSE((*device)->has_device());
  // A stream can only be a CUDA stream: refused before anything is sent.
  int not_a_stream = 0;
  std::vector<uint16_t> block(kernels::Fp16BlockBytes(Shape()) / 2);
  std::vector<BlockWrite> writes = {{Key(0), "", block}};
  absl::StatusOr<PutResult> put =
      (*device)->Put("ns", writes, /*stream=*/&not_a_stream);
  EXPECT_EQ(put.status().code(), absl::StatusCode::kFailedPrecondition)
      << put.status();
  std::vector<uint8_t> dest(kStride);
  DeviceReadOptions options;
  options.stream = &not_a_stream;
  auto read = (*device)->GetInto("ns", Keys(1), dest.data(), dest.size(),
                                 kStride, options);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition)
      << read.status();
  EXPECT_NE(read.status().message().find("CUDA"), absl::string_view::npos);
}

TEST_P(DeviceClientTest, HostPutsPassStraightThrough) {
  auto device = NewDeviceClient(ucx_.get());
  ASSERT_NE(device, nullptr);
  Register(Namespaces()[0]);
  auto put = device->Put("none", Writes());
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->stored, static_cast<uint32_t>(kBlocks));
  auto again = device->Put("none", Writes());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->skipped, static_cast<uint32_t>(kBlocks));
  GetResult stored = Reference("none", ReadFormat::kFp16);
  ASSERT_EQ(stored.blocks.size(), static_cast<size_t>(kBlocks));
  for (int b = 0; b < kBlocks; ++b) {
    ASSERT_EQ(stored.blocks[b].bytes.size(), data_[b].size() * 2);
    EXPECT_EQ(std::memcmp(stored.blocks[b].bytes.data(), data_[b].data(),
                          data_[b].size() * 2),
              0)
        << "block " << b;
  }
  // No device block: no staging was needed.
  EXPECT_EQ(device->idle_staging_bytes(), 0u);
}

TEST_P(DeviceClientTest, HostReadsGiveThePlainClientsBytesLayerByLayer) {
  auto ucx_device = NewDeviceClient(ucx_.get());
  auto grpc_device = NewDeviceClient(grpc_.get());
  ASSERT_NE(ucx_device, nullptr);
  ASSERT_NE(grpc_device, nullptr);
  Populate(ucx_device.get());
  for (const NsCase& c : Namespaces()) {
    const GetResult fp16 = Reference(c.name, ReadFormat::kFp16);
    const GetResult raw = Reference(c.name, ReadFormat::kRaw);
    ASSERT_EQ(raw.blocks.size(), static_cast<size_t>(kBlocks));
    if (c.policy.codec == Codec::kKivi2) {
      // Both decode paths are exercised: encoded blocks and the window's.
      EXPECT_EQ(raw.blocks[0].codec, Codec::kKivi2);
      EXPECT_EQ(raw.blocks[kBlocks - 1].codec, Codec::kNone);
    }
    // The CPU codec on raw reads gives the node's fp16 (kvcache::DecodeRaw).
    for (int b = 0; b < kBlocks; ++b) {
      std::vector<uint16_t> decoded(data_[b].size());
      ASSERT_TRUE(DecodeRaw(raw, raw.blocks[b], absl::MakeSpan(decoded)).ok());
      ASSERT_EQ(std::memcmp(decoded.data(), fp16.blocks[b].bytes.data(),
                            fp16.blocks[b].bytes.size()),
                0);
    }
    for (DeviceClient* device : {ucx_device.get(), grpc_device.get()}) {
      const bool over_ucx = device == ucx_device.get();
      for (DeviceReadMode mode : kModes) {
        const std::string what = absl::StrCat(c.name, " ", ModeName(mode),
                                              over_ucx ? " ucx" : " grpc");
        std::vector<uint8_t> dest(kBlocks * kStride, kFill);
        DeviceReadOptions options;
        options.mode = mode;
        auto read = device->GetInto(c.name, Keys(kBlocks), dest.data(),
                                    dest.size(), kStride, options);
        ASSERT_TRUE(read.ok()) << what << ": " << read.status();
        DeviceRead& r = **read;
        EXPECT_FALSE(r.on_device());
        EXPECT_EQ(r.stream(), nullptr);
        EXPECT_EQ(r.over_data_plane(), over_ucx) << what;
        ASSERT_EQ(r.num_layers(), Shape().num_layers);
        ASSERT_EQ(r.placements().size(), static_cast<size_t>(kBlocks));
        ASSERT_EQ(r.metadata().blocks.size(), static_cast<size_t>(kBlocks));
        for (int b = 0; b < kBlocks; ++b) {
          EXPECT_EQ(r.metadata().blocks[b].codec, raw.blocks[b].codec) << what;
          EXPECT_EQ(r.metadata().blocks[b].format, mode == DeviceReadMode::kRaw
                                                       ? ReadFormat::kRaw
                                                       : ReadFormat::kFp16);
        }
        for (uint32_t l = 0; l < r.num_layers(); ++l) {
          ASSERT_TRUE(r.WaitLayer(l).ok()) << what << " layer " << l;
          EXPECT_EQ(r.LayerEvent(l), nullptr);
          CheckLayer(dest, r, fp16, raw, mode, l, what);
        }
        ASSERT_TRUE(r.Wait().ok()) << what;
        CheckWhole(dest, r, fp16, raw, mode, what);
        EXPECT_EQ(r.WaitLayer(r.num_layers()).code(),
                  absl::StatusCode::kInvalidArgument);
      }
    }
  }
}

TEST_P(DeviceClientTest, StagingIsPooledAndBounded) {
  auto device = NewDeviceClient(ucx_.get());
  ASSERT_NE(device, nullptr);
  Populate(device.get());
  DeviceReadOptions decode;
  decode.mode = DeviceReadMode::kDecodeHere;
  std::vector<uint8_t> dest(kBlocks * kStride);
  size_t idle = 0;
  for (int round = 0; round < 3; ++round) {
    auto read = device->GetInto("kivi2", Keys(kBlocks), dest.data(),
                                dest.size(), kStride, decode);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE((*read)->Wait().ok());
    if (round > 0) {
      EXPECT_EQ(device->idle_staging_bytes(), 0u) << "in use";
    }
    read->reset();
    if (round == 0) idle = device->idle_staging_bytes();
    EXPECT_GE(device->idle_staging_bytes(), kBlocks * kStride);
    EXPECT_EQ(device->idle_staging_bytes(), idle) << "reused, not regrown";
  }
  // A pool of 0 bytes frees every buffer when its read ends.
  DeviceClientOptions none;
  none.max_idle_staging_bytes = 0;
  auto unpooled = NewDeviceClient(ucx_.get(), none);
  ASSERT_NE(unpooled, nullptr);
  auto read = unpooled->GetInto("kivi2", Keys(kBlocks), dest.data(),
                                dest.size(), kStride, decode);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE((*read)->Wait().ok());
  read->reset();
  EXPECT_EQ(unpooled->idle_staging_bytes(), 0u);
}

TEST_P(DeviceClientTest, BadArgumentsAreRefused) {
  auto device = NewDeviceClient(ucx_.get());
  ASSERT_NE(device, nullptr);
  Populate(device.get());
  std::vector<uint8_t> dest(kBlocks * kStride);
  DeviceReadOptions decode;
  decode.mode = DeviceReadMode::kDecodeHere;
  // Too small for its slots.
  EXPECT_EQ(device
                ->GetInto("none", Keys(kBlocks), dest.data(), dest.size() - 1,
                          kStride, decode)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device->GetInto("none", {}, dest.data(), dest.size(), kStride)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // fp16 output at an odd stride.
  EXPECT_EQ(device
                ->GetInto("none", Keys(2), dest.data(), dest.size(),
                          kStride - 1, decode)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Slots that hold the fp8 encoding but not its fp16 decode.
  const size_t encoded =
      kernels::EncodedBlockBytes(Shape(), Namespaces()[1].policy);
  ASSERT_LT(encoded, kernels::Fp16BlockBytes(Shape()));
  const size_t small = (encoded + 1) & ~size_t{1};
  auto too_small = device->GetInto("fp8-dynamic", Keys(2), dest.data(),
                                   2 * small, small, decode);
  EXPECT_EQ(too_small.status().code(), absl::StatusCode::kInvalidArgument)
      << too_small.status();
  // The same slots take the raw encoding.
  DeviceReadOptions raw;
  raw.mode = DeviceReadMode::kRaw;
  auto fits = device->GetInto("fp8-dynamic", Keys(2), dest.data(), 2 * small,
                              small, raw);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_TRUE((*fits)->Wait().ok());
  // A miss is the Client's NOT_FOUND, and leaves the staging idle.
  fits->reset();
  const size_t idle = device->idle_staging_bytes();
  auto missing = device->GetInto("none", {Key(0), "absent"}, dest.data(),
                                 dest.size(), kStride, decode);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound)
      << missing.status();
  EXPECT_GE(device->idle_staging_bytes(), idle);
  // A timeout that could never be met, and a device index out of range
  // (only an error where devices exist: without one the client serves host
  // memory whatever the index).
  DeviceClientOptions zero;
  zero.timeout = absl::ZeroDuration();
  EXPECT_EQ(DeviceClient::Create(ucx_.get(), zero).status().code(),
            absl::StatusCode::kInvalidArgument);
  DeviceClientOptions bad;
  bad.device = CudaDeviceCount();
  auto out_of_range = DeviceClient::Create(ucx_.get(), bad);
  if (CudaDeviceCount() > 0) {
    EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kInvalidArgument);
  } else {
    ASSERT_TRUE(out_of_range.ok()) << out_of_range.status();
    EXPECT_FALSE((*out_of_range)->has_device());
  }
}

// ---- With a CUDA device

#define SKIP_WITHOUT_DEVICE()                                        \
  do {                                                               \
    if (CudaDeviceCount() == 0) {                                    \
      GTEST_SKIP() << "needs a CUDA device: " << CudaDeviceStatus(); \
    }                                                                \
  } while (0)

// Synchronous copies for checking device memory, bounded.
absl::Status CopySync(void* dst, const void* src, size_t bytes) {
  auto stream = di::Stream::Create(0);
  if (!stream.ok()) return stream.status();
  auto event = di::Event::Create(0);
  if (!event.ok()) return event.status();
  if (absl::Status s = di::CopyAsync(dst, src, bytes, **stream); !s.ok()) {
    return s;
  }
  if (absl::Status s = (*event)->Record(**stream); !s.ok()) return s;
  return (*event)->WaitUntil(absl::Now() + absl::Seconds(30));
}

TEST(DeviceMemoryTest, DeviceMemoryIsRecognized) {
  SKIP_WITHOUT_DEVICE();
  auto device = di::DeviceMemory::Allocate(0, 4096);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_TRUE(IsDeviceMemory((*device)->data()));
  EXPECT_TRUE(IsDeviceMemory((*device)->data() + 100));
  auto pinned = di::PinnedHostMemory::Allocate(0, 4096);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_FALSE(IsDeviceMemory((*pinned)->data()));
}

TEST_P(DeviceClientTest, DevicePutsStageThroughPinnedMemory) {
  SKIP_WITHOUT_DEVICE();
  auto device = NewDeviceClient(ucx_.get());
  ASSERT_NE(device, nullptr);
  ASSERT_TRUE(device->has_device());
  Register(Namespaces()[0]);
  const size_t bytes = kernels::Fp16BlockBytes(Shape());
  auto memory = di::DeviceMemory::Allocate(0, kBlocks * bytes);
  ASSERT_TRUE(memory.ok()) << memory.status();
  uint8_t* base = (*memory)->data();
  for (int b = 0; b < kBlocks; ++b) {
    ASSERT_TRUE(CopySync(base + b * bytes, data_[b].data(), bytes).ok());
  }
  auto stream = di::Stream::Create(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  // Blocks 0-2 from device memory on an internal stream, then 3-5 mixing
  // device (3, 5) and host (4) blocks on the caller's stream.
  std::vector<BlockWrite> writes;
  for (int b = 0; b < kBlocks; ++b) {
    const uint16_t* on_device =
        reinterpret_cast<const uint16_t*>(base + b * bytes);
    writes.push_back({Key(b), "",
                      b == 4 ? absl::MakeConstSpan(data_[b])
                             : absl::MakeConstSpan(on_device, bytes / 2)});
  }
  auto first = device->Put("none", absl::MakeConstSpan(writes).subspan(0, 3));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->stored, 3u);
  auto second = device->Put("none", absl::MakeConstSpan(writes).subspan(3),
                            (*stream)->get());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->stored, 3u);
  GetResult stored = Reference("none", ReadFormat::kFp16);
  ASSERT_EQ(stored.blocks.size(), static_cast<size_t>(kBlocks));
  for (int b = 0; b < kBlocks; ++b) {
    EXPECT_EQ(
        std::memcmp(stored.blocks[b].bytes.data(), data_[b].data(), bytes), 0)
        << "block " << b;
  }
  EXPECT_GT(device->idle_staging_bytes(), 0u) << "staging back in the pool";
}

TEST_P(DeviceClientTest, DeviceReadsLandLayerByLayer) {
  SKIP_WITHOUT_DEVICE();
  auto ucx_device = NewDeviceClient(ucx_.get());
  auto grpc_device = NewDeviceClient(grpc_.get());
  ASSERT_NE(ucx_device, nullptr);
  ASSERT_NE(grpc_device, nullptr);
  Populate(ucx_device.get());
  auto memory = di::DeviceMemory::Allocate(0, kBlocks * kStride);
  ASSERT_TRUE(memory.ok()) << memory.status();
  uint8_t* dest = (*memory)->data();
  auto caller_stream = di::Stream::Create(0);
  ASSERT_TRUE(caller_stream.ok()) << caller_stream.status();
  const std::vector<uint8_t> fill(kBlocks * kStride, kFill);
  for (const NsCase& c : Namespaces()) {
    const GetResult fp16 = Reference(c.name, ReadFormat::kFp16);
    const GetResult raw = Reference(c.name, ReadFormat::kRaw);
    for (DeviceClient* device : {ucx_device.get(), grpc_device.get()}) {
      for (DeviceReadMode mode : kModes) {
        for (bool own_stream : {false, true}) {
          const std::string what = absl::StrCat(
              c.name, " ", ModeName(mode),
              device == ucx_device.get() ? " ucx" : " grpc",
              own_stream ? " caller's stream" : " internal stream");
          ASSERT_TRUE(CopySync(dest, fill.data(), fill.size()).ok());
          DeviceReadOptions options;
          options.mode = mode;
          if (own_stream) options.stream = (*caller_stream)->get();
          auto read = device->GetInto(c.name, Keys(kBlocks), dest,
                                      kBlocks * kStride, kStride, options);
          ASSERT_TRUE(read.ok()) << what << ": " << read.status();
          DeviceRead& r = **read;
          ASSERT_TRUE(r.on_device()) << what;
          ASSERT_NE(r.stream(), nullptr);
          if (own_stream) {
            EXPECT_EQ(r.stream(), (*caller_stream)->get());
          }
          std::vector<uint8_t> host(kBlocks * kStride);
          for (uint32_t l = 0; l < r.num_layers(); ++l) {
            ASSERT_TRUE(r.WaitLayer(l).ok()) << what << " layer " << l;
            EXPECT_NE(r.LayerEvent(l), nullptr);
            ASSERT_TRUE(r.SyncLayer(l).ok()) << what << " layer " << l;
            ASSERT_TRUE(CopySync(host.data(), dest, host.size()).ok());
            CheckLayer(host, r, fp16, raw, mode, l, what);
          }
          ASSERT_TRUE(r.Wait().ok()) << what;
          ASSERT_TRUE(CopySync(host.data(), dest, host.size()).ok());
          CheckWhole(host, r, fp16, raw, mode, what);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, DeviceClientTest,
                         ::testing::Values(Transport{"tcp", "tcp"},
                                           Transport{"shm", "posix,sysv,self"}),
                         [](const ::testing::TestParamInfo<Transport>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace kvcache
