// The data plane's default is safe on an untrusted network (BRIEF section 5,
// docs/operations.md "Security"): without --ucx-tcp-trusted-network the
// node's UCX uses no TCP transport and opens no listener, so UCX 1.13's TCP
// crash and write inputs have no port to reach; clients on the same host
// still move their bytes over shared memory through the worker address the
// control plane hands out. A UCX_TLS that asks for TCP without the opt-in
// is refused at start.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "kvcache/client.h"
#include "service/node.h"
#include "service/ucx/data_plane.h"
#include "service/ucx/data_planes.h"
#include "tests/test_util.h"

namespace kvcache {
namespace {

using kvcache::testing::Key;
using kvcache::testing::RandomBlock;
using kvcache::testing::ScopedEnv;
using kvcache::testing::SmallShape;

// Inodes of the sockets this process has open.
std::set<std::string> OwnSocketInodes() {
  std::set<std::string> inodes;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target =
        std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) {
      inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  return inodes;
}

// TCP ports this process listens on (IPv4 and IPv6, any address).
std::set<int> ListeningTcpPorts() {
  const std::set<std::string> own = OwnSocketInodes();
  std::set<int> ports;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::vector<std::string> f =
          absl::StrSplit(line, ' ', absl::SkipWhitespace());
      // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout
      // inode
      if (f.size() < 10 || f[3] != "0A" || !own.count(f[9])) continue;
      const std::string local = f[1];
      uint32_t port = 0;
      if (absl::SimpleHexAtoi(local.substr(local.find(':') + 1), &port)) {
        ports.insert(static_cast<int>(port));
      }
    }
  }
  return ports;
}

// Sends `bytes` to 127.0.0.1:`port` and closes; false when no connection
// could be made.
bool SendRaw(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  bool sent =
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  if (sent) {
    sent = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }
  close(fd);
  return sent;
}

void AppendLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>(v >> 8 * i));
}

// The inputs that crash or write into a UCX 1.13 node that speaks TCP
// (issue 16): zeros to a sockcm listener; UCT TCP's magic followed by an
// active-message header longer than any segment; the magic followed by a
// PUT_REQ naming an address and a length.
std::vector<std::string> CrashInputs() {
  constexpr uint64_t kUctTcpMagic = 0xCAFEBABE12345678ull;
  std::vector<std::string> inputs;
  inputs.push_back(std::string(64, '\0'));
  for (uint64_t length : {uint64_t{65537}, uint64_t{0xFFFFFFFF}}) {
    std::string m;
    AppendLe(&m, kUctTcpMagic, 8);
    AppendLe(&m, 0, 1);  // am_id
    AppendLe(&m, length, 4);
    m += std::string(64, 'x');
    inputs.push_back(m);
  }
  std::string put;
  AppendLe(&put, kUctTcpMagic, 8);
  AppendLe(&put, 33, 1);  // UCT_TCP_EP_PUT_REQ_AM_ID
  AppendLe(&put, 24, 4);
  AppendLe(&put, 0x1000, 8);  // address
  AppendLe(&put, 8, 8);       // length
  AppendLe(&put, 0, 8);       // sequence
  put += std::string(8, '\xff');
  inputs.push_back(put);
  return inputs;
}

service::NodeOptions DefaultUcxNode() {
  service::NodeOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.memory = {store::MemoryKind::kHost, 0, 64ull << 20};
  options.store.page_size = 16384;
  options.worker_threads = 2;
  options.drain_timeout = absl::Seconds(2);
  options.data_plane = service::DataPlaneMode::kUcx;
  return options;  // options.ucx as by default
}

// A codec-none namespace, so that what is read back is what was written.
NamespaceSpec PlainSpec(const std::string& name) {
  NamespaceSpec spec;
  spec.name = name;
  spec.model = "default-test";
  spec.shape = SmallShape();
  CodecPolicy policy;
  policy.codec = Codec::kNone;
  spec.policy = policy;
  return spec;
}

absl::StatusOr<std::unique_ptr<Client>> ConnectTo(const service::Node& node,
                                                  DataPlane plane) {
  ClientOptions copts;
  copts.target = absl::StrCat("127.0.0.1:", node.port());
  copts.timeout = absl::Seconds(20);
  copts.data_plane = plane;
  return Client::Connect(copts);
}

TEST(DataPlaneDefaultTest, TransportsLeaveTcpOutOrAreRefused) {
  EXPECT_EQ(*ucx::TransportsWithoutTcp(""), "^tcp");
  EXPECT_EQ(*ucx::TransportsWithoutTcp("posix,sysv,self"), "posix,sysv,self");
  EXPECT_EQ(*ucx::TransportsWithoutTcp("rc,sm"), "rc,sm");
  EXPECT_EQ(*ucx::TransportsWithoutTcp("^ud"), "^ud,tcp");
  EXPECT_EQ(*ucx::TransportsWithoutTcp("^ud,tcp"), "^ud,tcp");
  for (const char* asks_for_tcp : {"tcp", "posix,tcp", "all", "TCP,sm"}) {
    absl::StatusOr<std::string> refused =
        ucx::TransportsWithoutTcp(asks_for_tcp);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
        << asks_for_tcp;
    EXPECT_NE(refused.status().message().find("--ucx-tcp-trusted-network"),
              std::string::npos)
        << refused.status();
  }
}

// Each progress thread's UCX context binds a TCP interface port of its own,
// so a node with TCP checks at start that UCX_TCP_PORT_RANGE (which
// deployments set so that a NetworkPolicy can name the port) has room.
TEST(DataPlaneDefaultTest, ProgressThreadsNeedAPortEachInTheTcpPortRange) {
  ucx::DataPlaneOptions tcp;
  tcp.tcp_trusted_network = true;
  EXPECT_TRUE(ucx::CheckTcpPortRange(tcp, 4, "").ok());
  EXPECT_TRUE(ucx::CheckTcpPortRange(tcp, 1, "7704-7704").ok());
  EXPECT_TRUE(ucx::CheckTcpPortRange(tcp, 2, " 7704-7705 ").ok());
  absl::Status narrow = ucx::CheckTcpPortRange(tcp, 2, "7704-7704");
  EXPECT_EQ(narrow.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(narrow.message().find("UCX_TCP_PORT_RANGE=7704-7704 holds 1"),
            std::string::npos)
      << narrow;
  for (const char* bad : {"7704", "7705-7704", "a-b", "1-70000", "1-2-3"}) {
    EXPECT_EQ(ucx::CheckTcpPortRange(tcp, 1, bad).code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  // Without TCP the range binds nothing of ours.
  EXPECT_TRUE(ucx::CheckTcpPortRange({}, 2, "7704-7704").ok());

  ScopedEnv range("UCX_TCP_PORT_RANGE", "47704-47704");
  ScopedEnv tls("UCX_TLS", "tcp");
  service::NodeOptions options = DefaultUcxNode();
  options.ucx.tcp_trusted_network = true;
  options.ucx.progress_threads = 2;
  service::Node node(options);
  absl::Status started = node.Start();
  EXPECT_EQ(started.code(), absl::StatusCode::kFailedPrecondition) << started;
}

TEST(DataPlaneDefaultTest,
     ADefaultNodeOpensNoUcxPortAndSurvivesTheCrashInputs) {
  ScopedEnv unset("UCX_TLS", nullptr);
  const std::set<int> before = ListeningTcpPorts();
  service::Node node(DefaultUcxNode());
  ASSERT_TRUE(node.Start().ok());
  EXPECT_EQ(node.ucx_port(), 0);
  ASSERT_NE(node.data_plane(), nullptr);
  EXPECT_FALSE(node.data_plane()->tcp_segments().in_use());
  std::set<int> opened;
  for (int port : ListeningTcpPorts()) {
    if (!before.count(port)) opened.insert(port);
  }
  // The gRPC port and nothing else: no UCX listener, no UCX TCP interface.
  EXPECT_EQ(opened, std::set<int>{node.port()});

  for (int port : opened) {
    for (const std::string& input : CrashInputs()) {
      EXPECT_TRUE(SendRaw(port, input)) << "port " << port;
    }
  }
  // Alive and serving, the data plane included: a client on this host
  // moves its bytes over shared memory.
  ScopedEnv shm("UCX_TLS", "posix,sysv,self");
  absl::StatusOr<std::unique_ptr<Client>> client =
      ConnectTo(node, DataPlane::kUcx);
  ASSERT_TRUE(client.ok()) << client.status();
  const NamespaceSpec spec = PlainSpec("safe");
  ASSERT_TRUE((*client)->RegisterNamespace(spec).ok());
  const std::vector<uint16_t> data = RandomBlock(spec.shape, 1);
  const BlockWrite write{Key(1), "", data};
  absl::StatusOr<PutResult> put =
      (*client)->Put("safe", absl::MakeConstSpan(&write, 1));
  ASSERT_TRUE(put.ok()) << put.status();
  absl::StatusOr<GetResult> got = (*client)->Get("safe", {Key(1)});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->blocks.size(), 1u);
  ASSERT_EQ(got->blocks[0].bytes.size(), data.size() * 2);
  EXPECT_EQ(
      std::memcmp(got->blocks[0].bytes.data(), data.data(), data.size() * 2),
      0);
  EXPECT_GE(node.data_plane()->Stats().connections, 1u)
      << "the bytes did not travel over the data plane";
}

// A client that shares no transport with a default node (here: one that
// may use only TCP, as on another host without RDMA) moves its bytes over
// gRPC with kAuto, and kUcx says UNAVAILABLE, both at once.
TEST(DataPlaneDefaultTest, AClientWithoutASharedTransportUsesGrpc) {
  std::unique_ptr<service::Node> node;
  {
    ScopedEnv unset("UCX_TLS", nullptr);
    node = std::make_unique<service::Node>(DefaultUcxNode());
    ASSERT_TRUE(node->Start().ok());
  }
  ScopedEnv tcp_only("UCX_TLS", "tcp");
  ScopedEnv loopback("UCX_NET_DEVICES", "lo");
  const NamespaceSpec spec = PlainSpec("remote");
  const std::vector<uint16_t> data = RandomBlock(spec.shape, 2);
  for (DataPlane plane : {DataPlane::kAuto, DataPlane::kUcx}) {
    const std::string key = Key(plane == DataPlane::kAuto ? 2 : 3);
    const BlockWrite write{key, "", data};
    absl::StatusOr<std::unique_ptr<Client>> client = ConnectTo(*node, plane);
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->RegisterNamespace(spec).ok());
    const absl::Time start = absl::Now();
    absl::StatusOr<PutResult> put =
        (*client)->Put("remote", absl::MakeConstSpan(&write, 1));
    // kUcx reads the block kAuto stored.
    absl::StatusOr<GetResult> got = (*client)->Get("remote", {Key(2)});
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    if (plane == DataPlane::kAuto) {
      ASSERT_TRUE(put.ok()) << put.status();
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->blocks.size(), 1u);
      EXPECT_EQ(std::memcmp(got->blocks[0].bytes.data(), data.data(),
                            data.size() * 2),
                0);
    } else {
      EXPECT_EQ(put.status().code(), absl::StatusCode::kUnavailable)
          << put.status();
      EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable)
          << got.status();
    }
  }
  EXPECT_EQ(node->data_plane()->Stats().connections, 0u);
}

TEST(DataPlaneDefaultTest, TcpOrAListenerWithoutTheOptInIsRefusedAtStart) {
  {
    ScopedEnv tcp("UCX_TLS", "tcp");
    service::Node node(DefaultUcxNode());
    absl::Status started = node.Start();
    EXPECT_EQ(started.code(), absl::StatusCode::kFailedPrecondition) << started;
    EXPECT_NE(started.message().find("--ucx-tcp-trusted-network"),
              std::string::npos)
        << started;
  }
  {
    ScopedEnv unset("UCX_TLS", nullptr);
    service::NodeOptions options = DefaultUcxNode();
    options.ucx.listen = "127.0.0.1:0";
    service::Node node(options);
    absl::Status started = node.Start();
    EXPECT_EQ(started.code(), absl::StatusCode::kInvalidArgument) << started;
  }
  {
    // With the opt-in, TCP and the listener are the operator's to have.
    ScopedEnv tcp("UCX_TLS", "tcp");
    service::NodeOptions options = DefaultUcxNode();
    options.ucx.tcp_trusted_network = true;
    options.ucx.listen = "127.0.0.1:0";
    const std::set<int> before = ListeningTcpPorts();
    service::Node node(options);
    ASSERT_TRUE(node.Start().ok());
    EXPECT_NE(node.ucx_port(), 0);
    EXPECT_TRUE(node.data_plane()->tcp_segments().in_use());
    // What the default avoids, seen by the same probe: the listener and
    // UCX's TCP interface port beside the gRPC port.
    std::set<int> opened;
    for (int port : ListeningTcpPorts()) {
      if (!before.count(port)) opened.insert(port);
    }
    EXPECT_TRUE(opened.count(node.ucx_port()));
    EXPECT_GE(opened.size(), 3u);
  }
}

}  // namespace
}  // namespace kvcache
