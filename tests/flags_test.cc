#include "service/flags.h"

#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"
#include "kernels/codec.h"

namespace kvcache::service {
namespace {

TEST(FlagsTest, ParsesEveryFlag) {
  auto f = ParseNodeFlags(
      {"--listen=127.0.0.1:1234", "--memory=host:2GiB",
       "--metrics-listen=", "--page-size=16KiB", "--default-codec=kivi2",
       "--drain-timeout=3.5", "--health-listen=0.0.0.0:8081",
       "--prefault-memory=false", "--ucx-progress-threads=3"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->options.listen, "127.0.0.1:1234");
  EXPECT_EQ(f->options.memory.bytes, 2ull << 30);
  EXPECT_EQ(f->options.metrics_listen, "");
  EXPECT_EQ(f->options.store.page_size, 16384u);
  EXPECT_EQ(f->options.store.default_codec, kernels::Codec::kKivi2);
  EXPECT_EQ(f->options.drain_timeout, absl::Seconds(3.5));
  EXPECT_EQ(f->options.health_listen, "0.0.0.0:8081");
  EXPECT_FALSE(f->options.prefault_memory);
  EXPECT_TRUE(ParseNodeFlags({})->options.prefault_memory);
  EXPECT_EQ(f->options.ucx.progress_threads, 3);
  EXPECT_EQ(ParseNodeFlags({})->options.ucx.progress_threads, 1);
  EXPECT_FALSE(f->help);
}

TEST(FlagsTest, ParsesTheTenantsFlags) {
  auto f = ParseNodeFlags({"--tenants=/etc/kvcache-tenants/tenants.textproto",
                           "--tenants-refresh=2.5"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->options.tenants_file, "/etc/kvcache-tenants/tenants.textproto");
  EXPECT_EQ(f->options.tenants_refresh, absl::Seconds(2.5));
  auto open = ParseNodeFlags({});
  ASSERT_TRUE(open.ok());
  EXPECT_TRUE(open->options.tenants_file.empty());
  EXPECT_EQ(ParseNodeFlags({"--tenants-refresh=soon"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(NodeUsage().find("--tenants=FILE"), std::string::npos);
}

TEST(FlagsTest, RejectsBadInputNamingTheFlag) {
  for (const char* bad :
       {"--memory=host:lots", "--default-codec=int3", "--bogus=1", "listen",
        "--listen", "--drain-timeout=-1", "--page-size=huge",
        "--prefault-memory=yes", "--ucx-progress-threads=65",
        "--ucx-progress-threads=-1", "--ucx-progress-threads=0"}) {
    auto f = ParseNodeFlags({bad});
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(ParseNodeFlags({"--help"})->help);
  EXPECT_NE(NodeUsage().find("--memory"), std::string::npos);
}

// The GPU tier exists (store/cuda_memory.cc): the usage offers it and says
// what happens without a device, instead of calling it refused.
TEST(FlagsTest, UsageOffersTheGpuTier) {
  const std::string usage = NodeUsage();
  EXPECT_NE(usage.find("gpu:INDEX:SIZE"), std::string::npos);
  EXPECT_EQ(usage.find("no GPU tier"), std::string::npos) << usage;
  EXPECT_EQ(usage.find("is refused"), std::string::npos) << usage;
}

TEST(FlagsTest, ReadsAConfigFile) {
  std::string path = ::testing::TempDir() + "/node.flags";
  {
    std::ofstream out(path);
    out << "# a ConfigMap's flags file\n--memory=host:256MiB\n\n"
        << "--default-codec=fp8_e5m2\n";
  }
  auto f = ParseNodeFlags({"--config=" + path, "--listen=:9"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->options.memory.bytes, 256ull << 20);
  EXPECT_EQ(f->options.store.default_codec, kernels::Codec::kFp8E5M2);
  {
    std::ofstream out(path);
    out << "--memory=host:1GiB\nnot-a-flag\n";
  }
  auto bad = ParseNodeFlags({"--config=" + path});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("line 2"), std::string::npos)
      << bad.status();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvcache::service
