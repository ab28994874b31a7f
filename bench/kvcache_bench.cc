// kvcache-bench: put and get throughput and latency of a kvcache node over
// its UCX data plane, side by side with ucx_perftest on the same transport
// and message size.
//
//   kvcache-bench                       1 MiB blocks, the transport UCX_TLS
//                                       selects; last line:
//                                       ratio get=<x> put=<y>
//   kvcache-bench --sizes=64KiB,1MiB,16MiB --streams=1,4,16 [--node=H:P]
//
// What is measured:
//  * put: Client::Put of `batch` fp16 blocks per call (fresh keys), stored
//    as --put-codec (default fp8_e4m3): begin, the blocks as active
//    messages, commit (encode on the node). Bytes = fp16 bytes sent.
//  * get: Client::GetInto of `batch` blocks per call into registered
//    caller memory (the zero-copy path a decode worker uses), fp16 from a
//    codec-none namespace, so the bytes moved equal the block size.
//  * ucx_perftest: ucp_am_bw (what puts use) and ucp_put_bw (what gets
//    use) between two spawned processes on loopback, same size, same
//    UCX_TLS; MiB/s of its "overall" column, median of --runs runs (rows
//    pt-put and pt-am).
//  * ratio = kvcache MiB/s / ucx_perftest MiB/s (get vs ucp_put_bw, put vs
//    ucp_am_bw), for the first size and stream count given.
//  * cpu-s/GiB: CPU seconds (user + system) spent per GiB moved. Ours: this
//    process over the measurement (client and, without --node, the node:
//    both ends, as ucx_perftest's); ucx_perftest's: its two processes
//    (wait4), warm-up included in the bytes. cpu ratio = perftest's / ours,
//    a machine-independent view of how close to the transport's own cost a
//    transfer is (on a CPU-bound machine it caps the MiB/s ratio).
// Without --node the node runs in this process (--data-plane=ucx on
// 127.0.0.1), with --memory bytes of host arena.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/codec.h"
#include "kernels/half.h"
#include "kvcache/client.h"
#include "service/node.h"
#include "store/arena.h"

namespace {

struct Config {
  std::vector<uint64_t> sizes = {1 << 20};
  std::vector<int> streams = {4};
  std::string node;  // empty: in process
  uint64_t memory = 1ull << 30;
  absl::Duration seconds = absl::Seconds(3);
  int runs = 3;  // repetitions per configuration; the median is reported
  uint64_t batch_bytes = 8 << 20;  // bytes per call, at least one block
  kvcache::Codec put_codec = kvcache::Codec::kFp8E4M3;
  bool perftest = true;
  bool warmup = true;
  bool get_copy = false;  // Client::Get (copies out) instead of GetInto
  bool get_heap = false;  // GetInto heap memory (registered per read)
  bool run_get = true, run_put = true;  // --ops
  bool put_heap = false;       // Put from heap memory instead of a DataBuffer
  bool layer_by_layer = true;  // --read (ReadOptions::layer_by_layer)
};

std::string Usage() {
  return R"(Usage: kvcache-bench [--flag=value ...]
  --sizes=LIST        fp16 block sizes, e.g. 64KiB,1MiB,16MiB (default 1MiB)
  --streams=LIST      concurrent client threads, e.g. 1,4,16 (default 4)
  --node=HOST:PORT    a running node with --data-plane=ucx (default: one
                      in this process)
  --memory=BYTES      in-process node's arena (default 1GiB)
  --seconds=S         per measurement (default 3)
  --runs=N            measurements per configuration, median reported
                      (default 3)
  --batch-bytes=BYTES bytes per Put/GetInto call (default 8MiB, at least
                      one block)
  --put-codec=CODEC   codec of the put namespace (default fp8_e4m3)
  --no-perftest       skip ucx_perftest
  --no-warmup         skip writing through the arena once before measuring
  --put-source=SRC    buffer (default): Put from a DataBuffer
                      (Client::AllocateBuffer); heap: from heap memory
  --ops=LIST          get,put (default both); e.g. --ops=put to profile
                      one path
  --get-api=API       into (default): Client::GetInto into a DataBuffer
                      (Client::AllocateBuffer: UCX memory, registered
                      once); heap: Client::GetInto into heap memory,
                      registered per read; copy: Client::Get, copied out
                      into strings
  --read=MODE         layers (default): GetInto reads layer by layer, as a
                      decode engine does; blocks: whole blocks, as a
                      caller that waits for the whole read
                      (ReadOptions::layer_by_layer = false)
UCX_TLS / UCX_NET_DEVICES select the transport for both sides.
)";
}

absl::StatusOr<Config> ParseArgs(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    size_t eq = arg.find('=');
    absl::string_view name = arg.substr(0, eq);
    absl::string_view value =
        eq == absl::string_view::npos ? "" : arg.substr(eq + 1);
    if (name == "--sizes") {
      c.sizes.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        absl::StatusOr<uint64_t> bytes = kvcache::store::ParseByteSize(s);
        if (!bytes.ok()) return bytes.status();
        if (*bytes < (64 << 10) || *bytes % (64 << 10) != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("size ", s, ": a multiple of 64KiB"));
        }
        c.sizes.push_back(*bytes);
      }
    } else if (name == "--streams") {
      c.streams.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(s, &n) || n < 1 || n > 64) {
          return absl::InvalidArgumentError(absl::StrCat("streams ", s));
        }
        c.streams.push_back(n);
      }
    } else if (name == "--node") {
      c.node = std::string(value);
    } else if (name == "--memory") {
      absl::StatusOr<uint64_t> bytes = kvcache::store::ParseByteSize(value);
      if (!bytes.ok()) return bytes.status();
      c.memory = *bytes;
    } else if (name == "--batch-bytes") {
      absl::StatusOr<uint64_t> bytes = kvcache::store::ParseByteSize(value);
      if (!bytes.ok()) return bytes.status();
      c.batch_bytes = *bytes;
    } else if (name == "--seconds") {
      double s = 0;
      if (!absl::SimpleAtod(value, &s) || s <= 0) {
        return absl::InvalidArgumentError("--seconds");
      }
      c.seconds = absl::Seconds(s);
    } else if (name == "--runs") {
      if (!absl::SimpleAtoi(value, &c.runs) || c.runs < 1) {
        return absl::InvalidArgumentError("--runs");
      }
    } else if (name == "--put-codec") {
      std::optional<kvcache::Codec> codec =
          kvcache::kernels::CodecFromName(value);
      if (!codec) return absl::InvalidArgumentError("--put-codec");
      c.put_codec = *codec;
    } else if (name == "--no-perftest") {
      c.perftest = false;
    } else if (name == "--no-warmup") {
      c.warmup = false;
    } else if (name == "--put-source") {
      if (value != "buffer" && value != "heap") {
        return absl::InvalidArgumentError("--put-source: buffer or heap");
      }
      c.put_heap = value == "heap";
    } else if (name == "--ops") {
      c.run_get = c.run_put = false;
      for (absl::string_view op : absl::StrSplit(value, ',')) {
        if (op == "get") {
          c.run_get = true;
        } else if (op == "put") {
          c.run_put = true;
        } else {
          return absl::InvalidArgumentError("--ops: get and/or put");
        }
      }
    } else if (name == "--read") {
      if (value != "layers" && value != "blocks") {
        return absl::InvalidArgumentError("--read: layers or blocks");
      }
      c.layer_by_layer = value == "layers";
    } else if (name == "--get-api") {
      if (value != "into" && value != "heap" && value != "copy") {
        return absl::InvalidArgumentError("--get-api: into, heap or copy");
      }
      c.get_copy = value == "copy";
      c.get_heap = value == "heap";
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", arg));
    }
  }
  return c;
}

// A layout whose fp16 block is `bytes`: 16 tokens x 8 heads x 128 dims,
// 64 KiB per layer (K + V), bytes / 64 KiB layers.
kvcache::BlockShape ShapeFor(uint64_t bytes) {
  return {static_cast<uint32_t>(bytes / (64 << 10)), 8, 128, 16};
}

// CPU seconds (user + system) of `u`.
double CpuSeconds(const rusage& u) {
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec * 1e-6;
}

double ProcessCpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return CpuSeconds(u);
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Measurement {
  double mib_per_s = 0;
  double cpu_s_per_gib = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0;
  uint64_t calls = 0;
  absl::Status status;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// Runs `call` on `streams` threads for `seconds`; call(stream, round)
// returns the bytes it moved or an error (which stops the measurement).
template <typename Fn>
Measurement Measure(int streams, absl::Duration seconds, Fn call) {
  std::vector<std::vector<double>> latencies(streams);
  std::vector<uint64_t> bytes(streams, 0);
  std::vector<absl::Status> errors(streams);
  std::atomic<bool> stop{false};
  const double cpu_start = ProcessCpuSeconds();
  absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      for (uint64_t round = 0; !stop.load(); ++round) {
        absl::Time t0 = absl::Now();
        absl::StatusOr<uint64_t> moved = call(s, round);
        if (!moved.ok()) {
          errors[s] = moved.status();
          stop.store(true);
          return;
        }
        latencies[s].push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
        bytes[s] += *moved;
        if (absl::Now() - start >= seconds) return;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  const double cpu = ProcessCpuSeconds() - cpu_start;
  Measurement m;
  std::vector<double> all;
  uint64_t total = 0;
  for (int s = 0; s < streams; ++s) {
    if (!errors[s].ok() && m.status.ok()) m.status = errors[s];
    all.insert(all.end(), latencies[s].begin(), latencies[s].end());
    total += bytes[s];
  }
  m.calls = all.size();
  m.mib_per_s = total / elapsed / (1 << 20);
  m.cpu_s_per_gib = total > 0 ? cpu / (total / kGiB) : 0;
  m.p50_ms = Percentile(all, 0.50);
  m.p90_ms = Percentile(all, 0.90);
  m.p99_ms = Percentile(all, 0.99);
  return m;
}

// Median by throughput, with the min and max throughput of the runs.
struct Summary {
  Measurement median;
  double min_mib = 0, max_mib = 0;
};

template <typename Fn>
Summary Repeat(int runs, Fn once) {
  std::vector<Measurement> all;
  for (int r = 0; r < runs; ++r) {
    all.push_back(once());
    if (!all.back().status.ok()) return {all.back(), 0, 0};
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return a.mib_per_s < b.mib_per_s;
  });
  return {all[all.size() / 2], all.front().mib_per_s, all.back().mib_per_s};
}

struct PerftestResult {
  double mib_per_s = 0;      // the "overall" bandwidth column
  double cpu_s_per_gib = 0;  // both processes, warm-up bytes included
};

// ucx_perftest between two spawned processes on loopback, or an error.
absl::StatusOr<PerftestResult> Perftest(const std::string& test, uint64_t size,
                                        int port) {
  const std::string sz = absl::StrCat(size);
  const uint64_t iters =
      std::max<uint64_t>(200, std::min<uint64_t>(20000, (4ull << 30) / size));
  const uint64_t warmup = std::max<uint64_t>(20, iters / 10);
  const std::string n = absl::StrCat(iters);
  const std::string w = absl::StrCat(warmup);
  const std::string p = absl::StrCat(port);
  pid_t server = fork();
  if (server == 0) {
    int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execlp("ucx_perftest", "ucx_perftest", "-p", p.c_str(), "-t", test.c_str(),
           "-s", sz.c_str(), "-n", n.c_str(), "-w", w.c_str(), "-f",
           static_cast<char*>(nullptr));
    _exit(127);
  }
  if (server < 0) return absl::InternalError("fork failed");
  std::string output;
  double cpu = 0;  // of the client run that succeeded, then of the server
  absl::Status status = absl::UnavailableError("ucx_perftest client failed");
  for (int attempt = 0; attempt < 50 && !status.ok(); ++attempt) {
    absl::SleepFor(absl::Milliseconds(100));
    int fds[2];
    if (pipe(fds) != 0) break;
    pid_t client = fork();
    if (client == 0) {
      dup2(fds[1], 1);
      int null = open("/dev/null", O_WRONLY);
      dup2(null, 2);
      close(fds[0]);
      execlp("ucx_perftest", "ucx_perftest", "127.0.0.1", "-p", p.c_str(), "-t",
             test.c_str(), "-s", sz.c_str(), "-n", n.c_str(), "-w", w.c_str(),
             "-f", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    output.clear();
    char buf[4096];
    ssize_t r;
    while ((r = read(fds[0], buf, sizeof(buf))) > 0) output.append(buf, r);
    close(fds[0]);
    int wstatus = 0;
    rusage usage;
    wait4(client, &wstatus, 0, &usage);
    if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0 && !output.empty()) {
      status = absl::OkStatus();
      cpu = CpuSeconds(usage);
    }
  }
  // The server ends with its test; SIGTERM only for one that did not.
  kill(server, SIGTERM);
  rusage server_usage;
  wait4(server, nullptr, 0, &server_usage);
  cpu += CpuSeconds(server_usage);
  if (!status.ok()) return status;
  // The last line of numbers: iterations, lat 50%, lat avg, lat overall,
  // bw avg, bw overall (MB/s = 2^20 B/s), msg rate avg, msg rate overall.
  std::vector<double> numbers;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    std::vector<double> row;
    for (absl::string_view field :
         absl::StrSplit(line, ' ', absl::SkipWhitespace())) {
      double v = 0;
      if (!absl::SimpleAtod(field, &v)) {
        row.clear();
        break;
      }
      row.push_back(v);
    }
    if (row.size() >= 6) numbers = row;
  }
  if (numbers.size() < 6) {
    return absl::InternalError(
        absl::StrCat("cannot parse ucx_perftest output: ", output));
  }
  PerftestResult result;
  result.mib_per_s = numbers[5];
  const double bytes =
      static_cast<double>(iters + warmup) * static_cast<double>(size);
  result.cpu_s_per_gib = cpu / (bytes / kGiB);
  return result;
}

std::vector<uint16_t> Block(const kvcache::BlockShape& shape, uint64_t seed) {
  std::vector<uint16_t> out(kvcache::kernels::Fp16BlockBytes(shape) / 2);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint16_t& h : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    float v = static_cast<float>(static_cast<int64_t>(x % 2001) - 1000) / 500;
    h = kvcache::kernels::HalfFromFloat(v);
  }
  return out;
}

int Run(const Config& config) {
  std::unique_ptr<kvcache::service::Node> node;
  std::string target = config.node;
  if (target.empty()) {
    kvcache::service::NodeOptions options;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "";
    options.memory = {kvcache::store::MemoryKind::kHost, 0, config.memory};
    options.store.page_size = 64 << 10;
    options.store.max_blocks_per_request = 1024;
    options.max_request_bytes = 512 << 20;
    options.data_plane = kvcache::service::DataPlaneMode::kUcx;
    options.ucx.tcp_trusted_network = true;  // loopback, UCX_TLS as given
    options.ucx.listen = "127.0.0.1:0";
    options.ucx.staging_bytes = 1ull << 30;
    node = std::make_unique<kvcache::service::Node>(options);
    if (absl::Status s = node->Start(); !s.ok()) {
      std::fprintf(stderr, "cannot start the node: %s\n",
                   std::string(s.message()).c_str());
      return 1;
    }
    target = absl::StrCat("127.0.0.1:", node->port());
  }
  const char* tls = std::getenv("UCX_TLS");
  std::printf("kvcache-bench: node %s%s, UCX_TLS=%s, %d run(s) of %.1f s\n",
              target.c_str(), node ? " (in process)" : "", tls ? tls : "(all)",
              config.runs, absl::ToDoubleSeconds(config.seconds));
  std::printf("%-6s %8s %7s %5s %10s %18s %8s %8s %8s %12s %7s %9s %9s %9s\n",
              "op", "size", "streams", "batch", "MiB/s", "(min..max)", "p50 ms",
              "p90 ms", "p99 ms", "perftest", "ratio", "cpu-s/GiB", "pt cpu",
              "cpu ratio");

  kvcache::ClientOptions copts;
  copts.target = target;
  copts.timeout = absl::Seconds(60);
  copts.max_message_bytes = 512 << 20;
  copts.data_plane = kvcache::DataPlane::kUcx;
  absl::StatusOr<std::unique_ptr<kvcache::Client>> client =
      kvcache::Client::Connect(copts);
  if (!client.ok()) {
    std::fprintf(stderr, "cannot connect: %s\n",
                 std::string(client.status().message()).c_str());
    return 1;
  }
  double first_get_ratio = -1, first_put_ratio = -1;
  int port = 20000 + static_cast<int>(getpid() % 20000);
  for (uint64_t size : config.sizes) {
    const kvcache::BlockShape shape = ShapeFor(size);
    const int batch = static_cast<int>(
        std::clamp<uint64_t>(config.batch_bytes / size, 1, 64));
    const std::string tag = absl::StrCat(size >> 10, "KiB");
    // Namespaces: fp16 for gets, the put codec for puts.
    kvcache::NamespaceSpec get_spec;
    get_spec.name = absl::StrCat("bench-get-", tag);
    get_spec.shape = shape;
    get_spec.policy = kvcache::CodecPolicy{};
    kvcache::NamespaceSpec put_spec = get_spec;
    put_spec.name = absl::StrCat("bench-put-", tag);
    kvcache::CodecPolicy put_policy;
    put_policy.codec = config.put_codec;
    put_spec.policy = put_policy;
    put_spec.residual_tokens = 0;
    for (const auto& spec : {get_spec, put_spec}) {
      absl::StatusOr<kvcache::NamespaceInfo> info =
          (*client)->RegisterNamespace(spec);
      if (!info.ok()) {
        std::fprintf(stderr, "register %s: %s\n", spec.name.c_str(),
                     std::string(info.status().message()).c_str());
        return 1;
      }
    }
    // Source data (shared, read-only) and the blocks gets read. Puts send
    // from a DataBuffer (registered once, like ucx_perftest's buffers)
    // unless --put-source=heap.
    std::vector<std::vector<uint16_t>> source_heap;
    std::unique_ptr<kvcache::DataBuffer> source_buffer;
    std::vector<absl::Span<const uint16_t>> source;
    for (int i = 0; i < batch; ++i) source_heap.push_back(Block(shape, i + 1));
    if (!config.put_heap) {
      auto buffer =
          (*client)->AllocateBuffer(static_cast<size_t>(batch) * size);
      if (!buffer.ok()) {
        std::fprintf(stderr, "AllocateBuffer: %s\n",
                     std::string(buffer.status().message()).c_str());
        return 1;
      }
      source_buffer = *std::move(buffer);
    }
    for (int i = 0; i < batch; ++i) {
      if (source_buffer == nullptr) {
        source.push_back(source_heap[i]);
        continue;
      }
      auto* at = reinterpret_cast<uint16_t*>(source_buffer->data() + i * size);
      std::memcpy(at, source_heap[i].data(), size);
      source.push_back(absl::MakeConstSpan(at, size / 2));
    }
    std::vector<kvcache::BlockWrite> seed;
    std::vector<std::string> get_keys;
    for (int i = 0; i < batch; ++i) {
      get_keys.push_back(absl::StrCat("get-", tag, "-", i));
      seed.push_back({get_keys.back(), "", source[i]});
    }
    if (auto put = (*client)->Put(get_spec.name, seed); !put.ok()) {
      std::fprintf(stderr, "seeding gets: %s\n",
                   std::string(put.status().message()).c_str());
      return 1;
    }

    // Warm-up: write through the whole arena once (until the node evicts),
    // so that first-touch page faults of a fresh arena are not measured: a
    // serving node's arena is warm.
    for (uint64_t round = 0; config.warmup; ++round) {
      std::vector<std::string> keys;
      std::vector<kvcache::BlockWrite> writes;
      for (int i = 0; i < batch; ++i) {
        keys.push_back(absl::StrCat("warm-", tag, "-", round, "-", i));
      }
      for (int i = 0; i < batch; ++i) {
        writes.push_back({keys[i], "", source[i]});
      }
      auto put = (*client)->Put(get_spec.name, writes);
      if (!put.ok()) {
        std::fprintf(stderr, "warm-up: %s\n",
                     std::string(put.status().message()).c_str());
        return 1;
      }
      absl::StatusOr<kvcache::NodeStats> stats = (*client)->Stats();
      if (!stats.ok() || stats->evictions > 0 ||
          round * batch * size > 4 * config.memory) {
        break;
      }
    }
    // The blocks gets read (the warm-up may have evicted the first copy).
    if (auto put = (*client)->Put(get_spec.name, seed); !put.ok()) {
      std::fprintf(stderr, "seeding gets: %s\n",
                   std::string(put.status().message()).c_str());
      return 1;
    }

    // ucx_perftest, as many runs as ours; the median.
    double perf_am = 0, perf_put = 0;
    double perf_am_cpu = 0, perf_put_cpu = 0;  // CPU-s per GiB, medians
    if (config.perftest) {
      std::vector<double> am_runs, put_runs, am_cpu, put_cpu;
      for (int r = 0; r < config.runs; ++r) {
        absl::StatusOr<PerftestResult> am = Perftest("ucp_am_bw", size, port++);
        absl::StatusOr<PerftestResult> put =
            Perftest("ucp_put_bw", size, port++);
        if (!am.ok() || !put.ok()) {
          std::fprintf(
              stderr, "ucx_perftest: %s\n",
              std::string((!am.ok() ? am : put).status().message()).c_str());
          return 1;
        }
        am_runs.push_back(am->mib_per_s);
        put_runs.push_back(put->mib_per_s);
        am_cpu.push_back(am->cpu_s_per_gib);
        put_cpu.push_back(put->cpu_s_per_gib);
      }
      for (auto* v : {&am_runs, &put_runs, &am_cpu, &put_cpu}) {
        std::sort(v->begin(), v->end());
      }
      perf_am = am_runs[am_runs.size() / 2];
      perf_put = put_runs[put_runs.size() / 2];
      perf_am_cpu = am_cpu[am_cpu.size() / 2];
      perf_put_cpu = put_cpu[put_cpu.size() / 2];
      for (const auto& [name, runs, cpu] :
           {std::tuple<const char*, const std::vector<double>&, double>{
                "pt-put", put_runs, perf_put_cpu},
            {"pt-am", am_runs, perf_am_cpu}}) {
        std::string range =
            absl::StrCat("(", static_cast<int>(runs.front()), "..",
                         static_cast<int>(runs.back()), ")");
        std::printf("%-6s %8s %7s %5s %10.0f %18s %8s %8s %8s %12s %7s %9.3f\n",
                    name, tag.c_str(), "-", "-", runs[runs.size() / 2],
                    range.c_str(), "", "", "", "", "", cpu);
      }
    }

    for (int streams : config.streams) {
      // Per-stream destination buffers for GetInto.
      std::vector<std::vector<uint8_t>> heap;
      std::vector<std::unique_ptr<kvcache::DataBuffer>> buffers;
      std::vector<absl::Span<uint8_t>> dest;
      for (int s = 0; s < streams; ++s) {
        const size_t bytes = static_cast<size_t>(batch) * size;
        if (config.get_heap) {
          heap.emplace_back(bytes);
          dest.push_back(absl::MakeSpan(heap.back()));
          continue;
        }
        auto buffer = (*client)->AllocateBuffer(bytes);
        if (!buffer.ok()) {
          std::fprintf(stderr, "AllocateBuffer: %s\n",
                       std::string(buffer.status().message()).c_str());
          return 1;
        }
        buffers.push_back(*std::move(buffer));
        dest.push_back(buffers.back()->span());
      }
      // Gets first, of blocks put again now (puts evict the least recently
      // used blocks, and earlier rounds may have taken these).
      if (auto again = (*client)->Put(get_spec.name, seed); !again.ok()) {
        std::fprintf(stderr, "seeding gets: %s\n",
                     std::string(again.status().message()).c_str());
        return 1;
      }
      Summary get;
      if (config.run_get)
        get = Repeat(config.runs, [&] {
          return Measure(streams, config.seconds,
                         [&](int s, uint64_t) -> absl::StatusOr<uint64_t> {
                           if (config.get_copy) {
                             auto got =
                                 (*client)->Get(get_spec.name, get_keys,
                                                kvcache::ReadFormat::kFp16);
                             if (!got.ok()) return got.status();
                             return static_cast<uint64_t>(batch) * size;
                           }
                           kvcache::ReadOptions options;
                           options.layer_by_layer = config.layer_by_layer;
                           auto read = (*client)->GetInto(
                               get_spec.name, get_keys, options, dest[s], size);
                           if (!read.ok()) return read.status();
                           if (absl::Status w = (*read)->Wait(); !w.ok()) {
                             return w;
                           }
                           return static_cast<uint64_t>(batch) * size;
                         });
        });
      std::atomic<uint64_t> put_serial{0};
      Summary put;
      if (config.run_put)
        put = Repeat(config.runs, [&] {
          return Measure(streams, config.seconds,
                         [&](int s, uint64_t) -> absl::StatusOr<uint64_t> {
                           uint64_t id = put_serial.fetch_add(1);
                           std::vector<std::string> keys;
                           std::vector<kvcache::BlockWrite> writes;
                           for (int i = 0; i < batch; ++i) {
                             keys.push_back(absl::StrCat("put-", id, "-", i));
                           }
                           for (int i = 0; i < batch; ++i) {
                             writes.push_back({keys[i], "", source[i]});
                           }
                           auto r = (*client)->Put(put_spec.name, writes);
                           if (!r.ok()) return r.status();
                           return static_cast<uint64_t>(batch) * size;
                         });
        });
      for (const auto& [op, summary, perf, perf_cpu] :
           {std::tuple<const char*, const Summary&, double, double>{
                "get", get, perf_put, perf_put_cpu},
            {"put", put, perf_am, perf_am_cpu}}) {
        if (std::string(op) == "get" ? !config.run_get : !config.run_put) {
          continue;
        }
        if (!summary.median.status.ok()) {
          std::fprintf(stderr, "%s failed: %s\n", op,
                       std::string(summary.median.status.message()).c_str());
          return 1;
        }
        double ratio = perf > 0 ? summary.median.mib_per_s / perf : 0;
        const double cpu = summary.median.cpu_s_per_gib;
        double cpu_ratio = perf_cpu > 0 && cpu > 0 ? perf_cpu / cpu : 0;
        std::string range =
            absl::StrCat("(", static_cast<int>(summary.min_mib), "..",
                         static_cast<int>(summary.max_mib), ")");
        std::printf(
            "%-6s %8s %7d %5d %10.0f %18s %8.3f %8.3f %8.3f %12.0f "
            "%7.2f %9.3f %9.3f %9.2f\n",
            op, tag.c_str(), streams, batch, summary.median.mib_per_s,
            range.c_str(), summary.median.p50_ms, summary.median.p90_ms,
            summary.median.p99_ms, perf, ratio, cpu, perf_cpu, cpu_ratio);
        double& first =
            std::string(op) == "get" ? first_get_ratio : first_put_ratio;
        if (first < 0) first = ratio;
      }
      std::fflush(stdout);
    }
  }
  // UCX logs to stdout, its teardown included: the client and the node end
  // before the last lines, so that `ratio ...` stays the last line.
  std::fflush(stdout);
  client->reset();
  node.reset();
  std::printf("perftest: ucp_put_bw (vs get) and ucp_am_bw (vs put), MiB/s\n");
  std::printf("ratio get=%.2f put=%.2f\n", std::max(0.0, first_get_ratio),
              std::max(0.0, first_put_ratio));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0) {
      std::fputs(Usage().c_str(), stdout);
      return 0;
    }
  }
  absl::StatusOr<Config> config = ParseArgs(argc, argv);
  if (!config.ok()) {
    std::fprintf(stderr, "kvcache-bench: %s\n%s",
                 std::string(config.status().message()).c_str(),
                 Usage().c_str());
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  return Run(*config);
}
