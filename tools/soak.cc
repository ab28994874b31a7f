// kvcache-soak: a verifying soak of nodes and clients under concurrent use.
//
// The parent starts three kvcache-node processes (or uses --nodes), then
// several client processes (this binary again, --worker=K), each running
// several threads of random operations on every codec's namespaces:
// cluster and direct Puts, Gets (fp16 and raw), GetInto (into DataBuffers
// and plain memory), layer-wise reads over the cluster, deletes and
// rewrites of deleted keys, pins, and, in the "chaos" workers, short
// deadlines and cancellations. Pools are small, so eviction runs all the
// time, and KIVI's residual window re-encodes blocks under the readers.
//
// Worker K's role is K % 4: UCX over tcp; UCX over shared memory; gRPC
// only with chaos; UCX over tcp with chaos. Every block read is checked bit
// for bit against its legal states (tools/soak_content.h). Expected codes:
// OK, NOT_FOUND (a miss), RESOURCE_EXHAUSTED (a full pool); in chaos
// workers also DEADLINE_EXCEEDED, CANCELLED and UNAVAILABLE (a transfer cut
// short closes the process's connection, which fails its other transfers).
// Anything else is unexpected. The parent prints operations, bytes, errors
// by code and "wrong reads: N", and exits 1 on any wrong read, unexpected
// code, node data-loss event or worker failure.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kernels/codec.h"
#include "kvcache/client.h"
#include "kvcache/cluster_client.h"
#include "tools/soak_content.h"
#include "tools/soak_process.h"

namespace kvcache::soak {
namespace {

constexpr uint32_t kChains = 6;
constexpr uint32_t kBlocksPerChain = 6;

struct Args {
  int duration_s = 60;
  int processes = 4;
  int threads = 2;
  uint64_t seed = 1;
  std::vector<std::string> nodes;  // empty: start three
  std::string node_bin;
  std::string node_memory = "host:24MiB";
  int worker = -1;  // >= 0: this process is worker K
  // A tenant's bearer token for --nodes run with --tenants (the tenant must
  // own the soak/ namespaces); empty: none.
  std::string token_file;
  std::string token;  // read from token_file
};

struct Role {
  const char* name;
  const char* ucx_tls;  // nullptr: no UCX
  bool chaos;
};

constexpr Role kRoles[] = {{"ucx-tcp", "tcp", false},
                           {"ucx-shm", "posix,sysv,self,tcp", false},
                           {"grpc+chaos", nullptr, true},
                           {"ucx-tcp+chaos", "tcp", true}};

// One thread's (then one process's) counts.
struct Tally {
  std::map<std::string, uint64_t> ops;    // by operation
  std::map<std::string, uint64_t> codes;  // by status code, errors only
  // By operation: the longest one (ms) and how many took over a second.
  std::map<std::string, uint64_t> max_ms, slow;
  uint64_t bytes_read = 0, bytes_written = 0, blocks_checked = 0;
  uint64_t wrong = 0, unexpected = 0;
  std::string first_problem;

  void Merge(const Tally& t) {
    for (const auto& [k, v] : t.ops) ops[k] += v;
    for (const auto& [k, v] : t.codes) codes[k] += v;
    for (const auto& [k, v] : t.max_ms) max_ms[k] = std::max(max_ms[k], v);
    for (const auto& [k, v] : t.slow) slow[k] += v;
    bytes_read += t.bytes_read;
    bytes_written += t.bytes_written;
    blocks_checked += t.blocks_checked;
    wrong += t.wrong;
    unexpected += t.unexpected;
    if (first_problem.empty()) first_problem = t.first_problem;
  }
};

// One worker thread: its clients, its random source and its counts.
class Worker {
 public:
  Worker(const Role& role, std::vector<Client*> direct, ClusterClient* cluster,
         Verifier* verifier, uint64_t seed)
      : role_(role),
        direct_(std::move(direct)),
        cluster_(cluster),
        verifier_(verifier),
        rng_(seed),
        namespaces_(SoakNamespaces()) {}

  void Run(absl::Time until) {
    while (absl::Now() < until) {
      const absl::Time start = absl::Now();
      const int pick = static_cast<int>(rng_() % 100);
      if (pick < 30) {
        Put();
      } else if (pick < 52) {
        Get();
      } else if (pick < 67) {
        GetInto();
      } else if (pick < 79) {
        Layerwise();
      } else if (pick < 87) {
        Delete();
      } else if (pick < 95) {
        Pin();
      } else {
        Stats();
      }
      // Attributed to the operation counted last (an operation's first
      // step may be counted under another name, e.g. allocate_buffer).
      const uint64_t ms = absl::ToInt64Milliseconds(absl::Now() - start);
      uint64_t& max = tally_.max_ms[last_op_];
      max = std::max(max, ms);
      if (ms > 1000) ++tally_.slow[last_op_];
    }
  }
  const Tally& tally() const { return tally_; }

 private:
  const SoakNamespace& AnyNamespace() {
    return namespaces_[rng_() % namespaces_.size()];
  }
  Client* AnyNode() { return direct_[rng_() % direct_.size()]; }

  // Chaos workers: now and then a deadline too short to make, or a cancel
  // that fires while the call runs (a thread cancels it).
  CallOptions Call(std::unique_ptr<std::thread>* canceller) {
    CallOptions call;
    if (!role_.chaos) return call;
    const int pick = static_cast<int>(rng_() % 100);
    if (pick < 12) {
      call.timeout = absl::Milliseconds(1 + rng_() % 20);
    } else if (pick < 22) {
      call.cancel = std::make_shared<CancelToken>();
      const absl::Duration after = absl::Microseconds(rng_() % 20000);
      *canceller = std::make_unique<std::thread>([token = call.cancel, after] {
        absl::SleepFor(after);
        token->Cancel();
      });
    }
    return call;
  }
  static void Join(std::unique_ptr<std::thread>* canceller) {
    if (*canceller) (*canceller)->join();
  }

  // Counts a call's status; false when it is not OK.
  bool Count(const std::string& op, const absl::Status& status) {
    ++tally_.ops[op];
    last_op_ = op;
    if (status.ok()) return true;
    const std::string code = absl::StatusCodeToString(status.code());
    ++tally_.codes[code];
    const absl::StatusCode c = status.code();
    bool expected = c == absl::StatusCode::kNotFound ||
                    c == absl::StatusCode::kResourceExhausted;
    if (role_.chaos) {
      expected = expected || c == absl::StatusCode::kDeadlineExceeded ||
                 c == absl::StatusCode::kCancelled ||
                 c == absl::StatusCode::kUnavailable;
      // A pin whose TTL ran out while its node was paused is a stale lease.
      expected = expected || (c == absl::StatusCode::kFailedPrecondition &&
                              (op == "release" || op == "get.pinned"));
    }
    if (!expected) {
      ++tally_.unexpected;
      Problem(absl::StrCat(op, ": unexpected ", status.ToString()));
    }
    return false;
  }
  void Problem(const std::string& what) {
    if (tally_.first_problem.empty()) tally_.first_problem = what;
    if (++problems_ <= 5)
      std::fprintf(stderr, "soak problem: %s\n", what.c_str());
  }
  // Checks a whole fp16 block read back as block `block` of `chain`.
  void CheckBlock(const std::string& op, const SoakNamespace& ns,
                  uint32_t chain, uint32_t block,
                  absl::Span<const uint16_t> fp16) {
    ++tally_.blocks_checked;
    tally_.bytes_read += fp16.size() * 2;
    absl::Status s = verifier_->CheckBlock(ns, chain, block, fp16);
    if (!s.ok()) {
      ++tally_.wrong;
      Problem(absl::StrCat(op, " ", ns.name, " ", BlockKey(chain, block), ": ",
                           s.message()));
    }
  }
  // A block of a Get or GetInto result, raw or fp16, as fp16.
  void CheckData(const std::string& op, const SoakNamespace& ns, uint32_t chain,
                 uint32_t first, const GetResult& result,
                 const BlockData& block) {
    std::vector<uint16_t> fp16(kernels::Fp16BlockBytes(ns.shape) / 2);
    if (block.format == ReadFormat::kRaw) {
      absl::Status s = DecodeRaw(result, block, absl::MakeSpan(fp16));
      if (!s.ok()) {
        ++tally_.wrong;
        Problem(absl::StrCat(op, " decode: ", s.ToString()));
        return;
      }
    } else if (block.bytes.size() == fp16.size() * 2) {
      std::memcpy(fp16.data(), block.bytes.data(), block.bytes.size());
    } else {
      ++tally_.wrong;
      Problem(absl::StrCat(op, ": a block of ", block.bytes.size(), " bytes"));
      return;
    }
    CheckBlock(op, ns, chain, first + block.index, fp16);
  }

  void Put();
  void Get();
  void GetInto();
  void Layerwise();
  void Delete();
  void Pin();
  void Stats();

  const Role& role_;
  const std::vector<Client*> direct_;
  ClusterClient* const cluster_;
  Verifier* const verifier_;
  std::mt19937_64 rng_;
  const std::vector<SoakNamespace> namespaces_;
  std::string last_op_;
  Tally tally_;
  int problems_ = 0;
};

void Worker::Put() {
  const SoakNamespace& ns = AnyNamespace();
  const uint32_t chain = rng_() % kChains;
  const uint32_t n = 1 + rng_() % kBlocksPerChain;
  const uint32_t generation = rng_() % kGenerations;
  std::vector<std::vector<uint16_t>> data;
  std::vector<BlockWrite> writes;
  for (uint32_t b = 0; b < n; ++b) {
    data.push_back(BlockContent(ns, chain, b, generation));
  }
  for (uint32_t b = 0; b < n; ++b) {
    writes.push_back(
        {BlockKey(chain, b), b ? BlockKey(chain, b - 1) : "", data[b]});
  }
  std::unique_ptr<std::thread> canceller;
  CallOptions call = Call(&canceller);
  const uint64_t block_bytes = kernels::Fp16BlockBytes(ns.shape);
  if (rng_() % 2 == 0) {
    absl::StatusOr<ClusterPutResult> put = cluster_->Put(ns.name, writes, call);
    if (Count("cluster.put", put.status())) {
      tally_.bytes_written += put->stored * block_bytes;
      tally_.ops["cluster.put.unavailable_blocks"] += put->unavailable;
    }
  } else {
    absl::StatusOr<PutResult> put = AnyNode()->Put(ns.name, writes, call);
    if (Count("put", put.status())) {
      tally_.bytes_written += put->stored * block_bytes;
      if (put->stored + put->skipped != n) {
        ++tally_.unexpected;
        Problem(absl::StrCat("put of ", n, " blocks: stored ", put->stored,
                             ", skipped ", put->skipped));
      }
    }
  }
  Join(&canceller);
}

void Worker::Get() {
  const SoakNamespace& ns = AnyNamespace();
  const uint32_t chain = rng_() % kChains;
  const uint32_t first = rng_() % kBlocksPerChain;
  const uint32_t n = 1 + rng_() % (kBlocksPerChain - first);
  std::vector<std::string> keys;
  for (uint32_t b = first; b < first + n; ++b)
    keys.push_back(BlockKey(chain, b));
  const ReadFormat format = rng_() % 2 ? ReadFormat::kRaw : ReadFormat::kFp16;
  const char* fmt = format == ReadFormat::kRaw ? "raw" : "fp16";
  std::unique_ptr<std::thread> canceller;
  CallOptions call = Call(&canceller);
  if (rng_() % 2 == 0) {
    const std::string op = absl::StrCat("cluster.get.", fmt);
    absl::StatusOr<ClusterGetResult> got =
        cluster_->Get(ns.name, keys, format, call);
    if (Count(op, got.status())) {
      for (const BlockData& b : got->read.blocks) {
        CheckData(op, ns, chain, first, got->read, b);
      }
    }
  } else {
    const std::string op = absl::StrCat("get.", fmt);
    ReadOptions read;
    read.format = format;
    read.allow_missing = rng_() % 2 == 0;
    absl::StatusOr<GetResult> got = AnyNode()->Get(ns.name, keys, read, call);
    if (Count(op, got.status())) {
      for (const BlockData& b : got->blocks) {
        CheckData(op, ns, chain, first, *got, b);
      }
    }
  }
  Join(&canceller);
}

void Worker::GetInto() {
  const SoakNamespace& ns = AnyNamespace();
  const uint32_t chain = rng_() % kChains;
  const uint32_t n = 1 + rng_() % kBlocksPerChain;
  std::vector<std::string> keys;
  for (uint32_t b = 0; b < n; ++b) keys.push_back(BlockKey(chain, b));
  ReadOptions read;
  read.format = rng_() % 2 ? ReadFormat::kRaw : ReadFormat::kFp16;
  read.allow_missing = true;
  const size_t stride = kernels::Fp16BlockBytes(ns.shape);
  Client* node = AnyNode();
  std::unique_ptr<DataBuffer> buffer;
  std::vector<uint8_t> heap;
  absl::Span<uint8_t> dest;
  if (rng_() % 2 == 0) {
    absl::StatusOr<std::unique_ptr<DataBuffer>> b =
        node->AllocateBuffer(n * stride);
    if (!Count("allocate_buffer", b.status())) return;
    buffer = *std::move(b);
    dest = buffer->span();
  } else {
    heap.resize(n * stride);
    dest = absl::MakeSpan(heap);
  }
  const std::string op =
      absl::StrCat("get_into.", buffer ? "buffer." : "heap.",
                   read.format == ReadFormat::kRaw ? "raw" : "fp16");
  std::unique_ptr<std::thread> canceller;
  CallOptions call = Call(&canceller);
  absl::StatusOr<std::unique_ptr<PendingRead>> pending =
      node->GetInto(ns.name, keys, read, dest, stride, call);
  absl::Status status = pending.status();
  if (status.ok()) status = (*pending)->Wait();
  if (Count(op, status)) {
    const GetResult& meta = (*pending)->metadata();
    for (size_t i = 0; i < meta.blocks.size(); ++i) {
      const BlockPlacement& at = (*pending)->placements()[i];
      BlockData block = meta.blocks[i];
      block.bytes.assign(reinterpret_cast<const char*>(dest.data()) + at.offset,
                         at.length);
      CheckData(op, ns, chain, 0, meta, block);
    }
  }
  // `pending` goes before `buffer` and `heap`: a read that has not ended
  // is stopped before its memory does.
  Join(&canceller);
}

void Worker::Layerwise() {
  const SoakNamespace& ns = AnyNamespace();
  const uint32_t chain = rng_() % kChains;
  const uint32_t n = 1 + rng_() % kBlocksPerChain;
  std::vector<std::string> keys;
  for (uint32_t b = 0; b < n; ++b) keys.push_back(BlockKey(chain, b));
  LayerwiseOptions options;
  options.format = rng_() % 2 ? ReadFormat::kRaw : ReadFormat::kFp16;
  const std::string op = absl::StrCat(
      "layerwise.", options.format == ReadFormat::kRaw ? "raw" : "fp16");
  std::unique_ptr<std::thread> canceller;
  options.call = Call(&canceller);
  std::unique_ptr<LayerStream> stream =
      cluster_->GetLayerwise(ns.name, keys, std::move(options));
  // Each block in one legal state (generation and state) for all layers.
  std::vector<int> state(n, -1);
  absl::Status status;
  for (uint32_t l = 0; l < ns.shape.num_layers && status.ok(); ++l) {
    absl::StatusOr<uint32_t> prefix = stream->WaitLayer(l);
    status = prefix.status();
    for (uint32_t b = 0; status.ok() && b < *prefix; ++b) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        absl::Span<const uint16_t> s = kv ? stream->V(b, l) : stream->K(b, l);
        int matched = -1;
        absl::Status c =
            verifier_->CheckSection(ns, chain, b, l, kv, s, &matched);
        tally_.bytes_read += s.size() * 2;
        if (c.ok() && state[b] >= 0 && state[b] != matched) {
          c = absl::DataLossError("the block mixes legal states across layers");
        }
        if (!c.ok()) {
          ++tally_.wrong;
          Problem(absl::StrCat(
              op, " ", ns.name, " ", BlockKey(chain, b), " layer ", l, ": ",
              c.message(), "; it holds ",
              verifier_->Identify(ns, kChains, kBlocksPerChain, s)));
        }
        state[b] = matched;
      }
      if (l + 1 == ns.shape.num_layers) ++tally_.blocks_checked;
    }
  }
  Count(op, status);
  stream.reset();
  Join(&canceller);
}

void Worker::Delete() {
  const SoakNamespace& ns = AnyNamespace();
  const uint32_t chain = rng_() % kChains;
  const uint32_t b = rng_() % kBlocksPerChain;
  std::vector<std::string> keys = {BlockKey(chain, b)};
  if (rng_() % 2 == 0) {
    Count("cluster.delete", cluster_->Delete(ns.name, keys).status());
  } else {
    Count("delete", AnyNode()->Delete(ns.name, keys).status());
  }
}

void Worker::Pin() {
  const SoakNamespace& ns = AnyNamespace();
  const uint32_t chain = rng_() % kChains;
  std::vector<std::string> keys;
  for (uint32_t b = 0; b < kBlocksPerChain; ++b) {
    keys.push_back(BlockKey(chain, b));
  }
  Client* node = AnyNode();
  absl::StatusOr<LookupResult> hit = node->Lookup(ns.name, keys, true);
  if (!Count("lookup.pin", hit.status()) || hit->pin_lease == 0) return;
  if (rng_() % 4 == 0) {
    Count("release", node->Release(hit->pin_lease));
    return;
  }
  keys.resize(hit->prefix_blocks);
  ReadOptions read;
  read.pin_lease = hit->pin_lease;
  read.format = rng_() % 2 ? ReadFormat::kRaw : ReadFormat::kFp16;
  absl::StatusOr<GetResult> got = node->Get(ns.name, keys, read);
  // The pinned prefix cannot be evicted or dropped: every key reads.
  if (Count("get.pinned", got.status())) {
    for (const BlockData& b : got->blocks) {
      CheckData("get.pinned", ns, chain, 0, *got, b);
    }
  }
}

void Worker::Stats() { Count("stats", AnyNode()->Stats().status()); }

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "kvcache-soak: %s: %s\n", what.c_str(),
               status.ToString().c_str());
  return 1;
}

std::string FormatTally(const Tally& t) {
  std::vector<std::string> parts = {
      absl::StrCat("bytes_read=", t.bytes_read),
      absl::StrCat("bytes_written=", t.bytes_written),
      absl::StrCat("blocks_checked=", t.blocks_checked),
      absl::StrCat("wrong=", t.wrong),
      absl::StrCat("unexpected=", t.unexpected)};
  for (const auto& [k, v] : t.ops)
    parts.push_back(absl::StrCat("op.", k, "=", v));
  for (const auto& [k, v] : t.codes) {
    parts.push_back(absl::StrCat("code.", k, "=", v));
  }
  for (const auto& [k, v] : t.max_ms) {
    parts.push_back(absl::StrCat("max_ms.", k, "=", v));
  }
  for (const auto& [k, v] : t.slow) {
    parts.push_back(absl::StrCat("slow.", k, "=", v));
  }
  return absl::StrJoin(parts, " ");
}

int WorkerMain(const Args& a) {
  const Role& role = kRoles[a.worker % 4];
  const DataPlane plane = role.ucx_tls ? DataPlane::kUcx : DataPlane::kGrpc;
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<Client*> direct;
  for (const std::string& node : a.nodes) {
    ClientOptions o;
    o.target = node;
    o.data_plane = plane;
    o.bearer_token = a.token;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    if (!c.ok()) return Fail("connect", c.status());
    direct.push_back(c->get());
    clients.push_back(*std::move(c));
  }
  ClusterOptions co;
  co.nodes = a.nodes;
  co.data_plane = plane;
  co.bearer_token = a.token;
  co.default_timeout = absl::Seconds(10);
  co.rpc_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<ClusterClient>> cluster =
      ClusterClient::Create(co);
  if (!cluster.ok()) return Fail("cluster", cluster.status());
  for (const SoakNamespace& ns : SoakNamespaces()) {
    NamespaceSpec spec;
    spec.name = ns.name;
    spec.model = "soak";
    spec.shape = ns.shape;
    spec.policy = ns.policy;
    if (auto info = (*cluster)->RegisterNamespace(spec); !info.ok()) {
      return Fail("register " + ns.name, info.status());
    }
  }
  Verifier verifier(512);
  std::vector<std::unique_ptr<Worker>> workers;
  for (int t = 0; t < a.threads; ++t) {
    workers.push_back(
        std::make_unique<Worker>(role, direct, cluster->get(), &verifier,
                                 a.seed * 1000003 + a.worker * 101 + t));
  }
  const absl::Time until = absl::Now() + absl::Seconds(a.duration_s);
  std::vector<std::thread> threads;
  for (auto& w : workers) threads.emplace_back([&w, until] { w->Run(until); });
  for (std::thread& t : threads) t.join();
  Tally total;
  for (auto& w : workers) total.Merge(w->tally());
  std::printf("tally %s\n", FormatTally(total).c_str());
  if (!total.first_problem.empty()) {
    std::printf("problem %s\n", total.first_problem.c_str());
  }
  std::fflush(stdout);
  return 0;
}

// Reads a worker's "tally k=v ..." and "problem ..." lines into *t.
bool ParseTally(const std::string& log, Tally* t) {
  bool found = false;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::ConsumePrefix(&line, "problem ")) {
      if (t->first_problem.empty()) t->first_problem = std::string(line);
      continue;
    }
    if (!absl::ConsumePrefix(&line, "tally ")) continue;
    found = true;
    for (absl::string_view field : absl::StrSplit(line, ' ')) {
      std::pair<std::string, std::string> kv = absl::StrSplit(field, '=');
      uint64_t v = 0;
      if (!absl::SimpleAtoi(kv.second, &v)) continue;
      absl::string_view k = kv.first;
      if (absl::ConsumePrefix(&k, "op.")) {
        t->ops[std::string(k)] += v;
      } else if (absl::ConsumePrefix(&k, "code.")) {
        t->codes[std::string(k)] += v;
      } else if (absl::ConsumePrefix(&k, "max_ms.")) {
        uint64_t& max = t->max_ms[std::string(k)];
        max = std::max(max, v);
      } else if (absl::ConsumePrefix(&k, "slow.")) {
        t->slow[std::string(k)] += v;
      } else if (k == "bytes_read") {
        t->bytes_read += v;
      } else if (k == "bytes_written") {
        t->bytes_written += v;
      } else if (k == "blocks_checked") {
        t->blocks_checked += v;
      } else if (k == "wrong") {
        t->wrong += v;
      } else if (k == "unexpected") {
        t->unexpected += v;
      }
    }
  }
  return found;
}

// Operations in `t` (its "...unavailable_blocks" entries count blocks).
uint64_t OpCount(const Tally& t) {
  uint64_t ops = 0;
  for (const auto& [k, v] : t.ops) {
    if (!absl::StrContains(k, "unavailable_blocks")) ops += v;
  }
  return ops;
}

void PrintReport(const Tally& t, double seconds) {
  const double mib = 1024.0 * 1024.0;
  const uint64_t ops = OpCount(t);
  std::printf("operations: %llu in %.0f s (%.0f/s)\n",
              static_cast<unsigned long long>(ops), seconds, ops / seconds);
  std::printf("  %-30s %10s %10s %8s\n", "", "count", "max ms", ">1 s");
  for (const auto& [k, v] : t.ops) {
    auto max = t.max_ms.find(k);
    auto slow = t.slow.find(k);
    std::printf("  %-30s %10llu %10llu %8llu\n", k.c_str(),
                static_cast<unsigned long long>(v),
                static_cast<unsigned long long>(
                    max == t.max_ms.end() ? 0 : max->second),
                static_cast<unsigned long long>(
                    slow == t.slow.end() ? 0 : slow->second));
  }
  std::printf(
      "bytes: %.1f MiB read and verified (%llu blocks), %.1f MiB "
      "written\n",
      t.bytes_read / mib, static_cast<unsigned long long>(t.blocks_checked),
      t.bytes_written / mib);
  std::printf("errors by code:%s\n", t.codes.empty() ? " none" : "");
  for (const auto& [k, v] : t.codes) {
    std::printf("  %-28s %10llu\n", k.c_str(),
                static_cast<unsigned long long>(v));
  }
  std::printf("unexpected codes: %llu\n",
              static_cast<unsigned long long>(t.unexpected));
  std::printf("wrong reads: %llu\n", static_cast<unsigned long long>(t.wrong));
  if (!t.first_problem.empty()) {
    std::printf("first problem: %s\n", t.first_problem.c_str());
  }
}

// Data-loss events the nodes counted (a stored block that failed its
// checksum): none may happen.
uint64_t NodeDataLoss(const std::vector<std::string>& nodes,
                      const std::string& token) {
  uint64_t total = 0;
  for (const std::string& node : nodes) {
    ClientOptions o;
    o.target = node;
    o.bearer_token = token;
    o.data_plane = DataPlane::kGrpc;
    // Generous: the node has just been under the whole soak's load on a
    // small machine; a node that cannot answer in this long still fails.
    o.timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    if (!c.ok()) continue;
    const absl::Time asked = absl::Now();
    absl::StatusOr<NodeStats> s = (*c)->Stats();
    const absl::Duration took = absl::Now() - asked;
    if (took > absl::Seconds(2)) {
      std::printf("node %s: stats took %s\n", node.c_str(),
                  absl::FormatDuration(took).c_str());
    }
    if (!s.ok()) {
      std::printf("node %s: stats %s\n", node.c_str(),
                  s.status().ToString().c_str());
      ++total;
      continue;
    }
    std::printf(
        "node %s: %llu evictions, %llu data-loss events, %.1f of "
        "%.1f MiB used\n",
        node.c_str(), static_cast<unsigned long long>(s->evictions),
        static_cast<unsigned long long>(s->data_loss_events),
        s->used_bytes / 1048576.0, s->capacity_bytes / 1048576.0);
    total += s->data_loss_events;
  }
  return total;
}

// The last 2000 bytes of `text`.
std::string Tail(const std::string& text) {
  return text.size() > 2000 ? text.substr(text.size() - 2000) : text;
}

std::string SelfPath(const char* argv0) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string(argv0);
}

// Waits for every worker (bounded by `deadline`), prints a line for each,
// and adds their tallies to *total; returns how many failed (did not exit
// 0, or printed no tally).
int CollectWorkers(std::vector<Child>* workers,
                   const std::vector<std::string>& logs, absl::Time deadline,
                   Tally* total) {
  int failed = 0;
  for (size_t k = 0; k < workers->size(); ++k) {
    absl::StatusOr<int> rc = (*workers)[k].Wait(deadline);
    Tally t;
    const bool parsed = ParseTally(ReadFile(logs[k]), &t);
    std::printf("worker %zu (%s): %s, %llu ops, %llu wrong, %llu unexpected\n",
                k, kRoles[k % 4].name,
                rc.ok() ? absl::StrCat("exit ", *rc).c_str()
                        : rc.status().ToString().c_str(),
                static_cast<unsigned long long>(OpCount(t)),
                static_cast<unsigned long long>(t.wrong),
                static_cast<unsigned long long>(t.unexpected));
    if (!rc.ok() || *rc != 0 || !parsed) {
      ++failed;
      std::printf("  worker %zu failed; its log %s ends:\n%s\n", k,
                  logs[k].c_str(), Tail(ReadFile(logs[k])).c_str());
    }
    total->Merge(t);
  }
  return failed;
}

// Stops the nodes this soak started; returns how many did not exit 0.
int StopNodes(std::vector<NodeProcess>* nodes) {
  // A node must drain and exit 0 (under a sanitizer, a finding at exit
  // makes its status non-zero).
  int nodes_failed = 0;
  for (NodeProcess& n : *nodes) {
    absl::StatusOr<int> rc = n.child.Stop(absl::Now() + absl::Seconds(30));
    if (!rc.ok() || *rc != 0) {
      ++nodes_failed;
      std::printf("node %s did not exit 0 (%s); its log %s ends:\n%s\n",
                  n.address.c_str(),
                  rc.ok() ? absl::StrCat("exit ", *rc).c_str()
                          : rc.status().ToString().c_str(),
                  n.log_path.c_str(), Tail(ReadFile(n.log_path)).c_str());
    }
  }
  return nodes_failed;
}

int ParentMain(const Args& a, const char* argv0) {
  const std::string self = SelfPath(argv0);
  const std::string dir = self.substr(0, self.rfind('/'));
  char tmpl[] = "/tmp/kvcache-soak.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return Fail("mkdtemp", absl::InternalError(""));
  const std::string work = tmpl;
  std::vector<NodeProcess> nodes;
  std::vector<std::string> addresses = a.nodes;
  if (addresses.empty()) {
    const std::string bin =
        a.node_bin.empty() ? dir + "/../service/kvcache-node" : a.node_bin;
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<NodeProcess> n =
          StartNode(bin, a.node_memory, absl::StrCat(work, "/node", i, ".log"));
      if (!n.ok()) return Fail("start node", n.status());
      addresses.push_back(n->address);
      nodes.push_back(*std::move(n));
    }
  }
  std::printf(
      "kvcache-soak: %d processes x %d threads for %d s against %s "
      "(logs in %s)\n",
      a.processes, a.threads, a.duration_s,
      absl::StrJoin(addresses, ",").c_str(), work.c_str());
  std::fflush(stdout);
  const absl::Time start = absl::Now();
  std::vector<Child> workers;
  std::vector<std::string> logs;
  for (int k = 0; k < a.processes; ++k) {
    const Role& role = kRoles[k % 4];
    std::map<std::string, std::string> env = {{"UCX_NET_DEVICES", "lo"}};
    env["UCX_TLS"] = role.ucx_tls ? role.ucx_tls : "";
    logs.push_back(absl::StrCat(work, "/worker", k, ".log"));
    absl::StatusOr<Child> c = Child::Spawn(
        {self, absl::StrCat("--worker=", k),
         absl::StrCat("--nodes=", absl::StrJoin(addresses, ",")),
         absl::StrCat("--duration=", a.duration_s),
         absl::StrCat("--threads=", a.threads), absl::StrCat("--seed=", a.seed),
         absl::StrCat("--token-file=", a.token_file)},
        env, logs.back());
    if (!c.ok()) return Fail("start worker", c.status());
    workers.push_back(*std::move(c));
  }
  Tally total;
  const int failed = CollectWorkers(
      &workers, logs, start + absl::Seconds(a.duration_s + 120), &total);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  PrintReport(total, seconds);
  const uint64_t data_loss = NodeDataLoss(addresses, a.token);
  const int nodes_failed = StopNodes(&nodes);
  const bool ok = failed == 0 && total.wrong == 0 && total.unexpected == 0 &&
                  data_loss == 0 && nodes_failed == 0;
  std::printf("kvcache-soak: %s\n", ok ? "PASSED" : "FAILED");
  return ok ? 0 : 1;
}

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view v = argv[i];
    bool ok = true;
    if (absl::ConsumePrefix(&v, "--duration=")) {
      ok = absl::SimpleAtoi(v, &a->duration_s) && a->duration_s > 0;
    } else if (absl::ConsumePrefix(&v, "--processes=")) {
      ok = absl::SimpleAtoi(v, &a->processes) && a->processes > 0;
    } else if (absl::ConsumePrefix(&v, "--threads=")) {
      ok = absl::SimpleAtoi(v, &a->threads) && a->threads > 0;
    } else if (absl::ConsumePrefix(&v, "--seed=")) {
      ok = absl::SimpleAtoi(v, &a->seed);
    } else if (absl::ConsumePrefix(&v, "--nodes=")) {
      a->nodes = absl::StrSplit(v, ',', absl::SkipEmpty());
    } else if (absl::ConsumePrefix(&v, "--node-bin=")) {
      a->node_bin = std::string(v);
    } else if (absl::ConsumePrefix(&v, "--node-memory=")) {
      a->node_memory = std::string(v);
    } else if (absl::ConsumePrefix(&v, "--worker=")) {
      ok = absl::SimpleAtoi(v, &a->worker) && a->worker >= 0;
    } else if (absl::ConsumePrefix(&v, "--token-file=")) {
      a->token_file = std::string(v);
      if (!a->token_file.empty()) {
        absl::StatusOr<std::string> token = ReadBearerTokenFile(a->token_file);
        ok = token.ok();
        if (ok) a->token = *std::move(token);
      }
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "kvcache-soak: bad argument %s\n", argv[i]);
      return false;
    }
  }
  return a->worker < 0 || !a->nodes.empty();
}

}  // namespace
}  // namespace kvcache::soak

int main(int argc, char** argv) {
  kvcache::soak::Args args;
  if (!kvcache::soak::ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr,
                 "usage: kvcache-soak [--duration=SECONDS] [--processes=N] "
                 "[--threads=N] [--seed=N]\n"
                 "         [--nodes=HOST:PORT,... | --node-bin=PATH "
                 "--node-memory=host:24MiB]\n"
                 "         [--token-file=FILE]\n");
    return 64;
  }
  signal(SIGPIPE, SIG_IGN);
  if (args.worker >= 0) return kvcache::soak::WorkerMain(args);
  return kvcache::soak::ParentMain(args, argv[0]);
}
