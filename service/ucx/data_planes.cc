#include "service/ucx/data_planes.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvcache::ucx {
namespace {

// Clients remembered at most; beyond it a new client is placed like any
// other but not remembered (a flood of peers costs no memory).
constexpr size_t kMaxClients = 1 << 16;

}  // namespace

absl::Status CheckTcpPortRange(const DataPlaneOptions& options, int shards,
                               absl::string_view port_range) {
  port_range = absl::StripAsciiWhitespace(port_range);
  if (!options.tcp_trusted_network || port_range.empty()) {
    return absl::OkStatus();
  }
  std::vector<absl::string_view> ends = absl::StrSplit(port_range, '-');
  uint32_t low = 0;
  uint32_t high = 0;
  if (ends.size() != 2 || !absl::SimpleAtoi(ends[0], &low) ||
      !absl::SimpleAtoi(ends[1], &high) || low > high || high > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX_TCP_PORT_RANGE=", port_range, " is not MIN-MAX"));
  }
  if (high - low + 1 < static_cast<uint32_t>(shards)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--ucx-progress-threads=", shards,
                     " needs a UCX TCP interface port "
                     "per thread, and UCX_TCP_PORT_RANGE=",
                     port_range, " holds ", high - low + 1,
                     ": widen the range (and the ports a NetworkPolicy "
                     "admits) or run fewer threads"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DataPlanes>> DataPlanes::Start(
    DataPlaneOptions options, store::Store* store, DataPlane::Executor executor,
    DataPlane::Executor background, DataPlane::TransferObserver observer) {
  const int count = std::max(options.progress_threads, 1);
  const char* port_range = std::getenv("UCX_TCP_PORT_RANGE");
  if (absl::Status s =
          CheckTcpPortRange(options, count, port_range ? port_range : "");
      !s.ok()) {
    return s;
  }
  auto budget = std::make_shared<StagingBudget>(options.staging_bytes);
  std::vector<std::unique_ptr<DataPlane>> shards;
  for (int i = 0; i < count; ++i) {
    DataPlaneOptions shard_options = options;
    if (i > 0) {
      shard_options.listen.clear();
      shard_options.ucx_name = absl::StrCat(options.ucx_name, "-", i);
    }
    absl::StatusOr<std::unique_ptr<DataPlane>> shard =
        DataPlane::Start(std::move(shard_options), store, executor, background,
                         observer, budget);
    if (!shard.ok()) return shard.status();  // started shards stop as they go
    shards.push_back(*std::move(shard));
  }
  return absl::WrapUnique(new DataPlanes(std::move(shards)));
}

DataPlanes::DataPlanes(std::vector<std::unique_ptr<DataPlane>> shards)
    : shards_(std::move(shards)), clients_per_shard_(shards_.size(), 0) {}

DataPlanes::~DataPlanes() { Stop(); }

DataPlane& DataPlanes::ForClient(absl::string_view client) {
  if (shards_.size() == 1) return *shards_[0];
  const absl::Time now = absl::Now();
  MutexLock lock(&mu_);
  auto it = clients_.find(client);
  if (it != clients_.end()) {
    it->second.last_seen = now;
    return *shards_[it->second.shard];
  }
  const size_t least = static_cast<size_t>(
      std::min_element(clients_per_shard_.begin(), clients_per_shard_.end()) -
      clients_per_shard_.begin());
  if (clients_.size() < kMaxClients) {
    clients_.emplace(std::string(client), Client{least, now});
    ++clients_per_shard_[least];
  }
  return *shards_[least];
}

template <typename Has>
DataPlane& DataPlanes::Holder(Has has) {
  if (shards_.size() == 1) return *shards_[0];  // no lookup to pay for
  for (const std::unique_ptr<DataPlane>& shard : shards_) {
    if (has(*shard)) return *shard;
  }
  return *shards_[0];
}

bool DataPlanes::Commit(uint64_t write_id, absl::Time deadline,
                        DataPlane::CommitDone done) {
  return Holder([&](const DataPlane& s) { return s.HasWrite(write_id); })
      .Commit(write_id, deadline, std::move(done));
}

store::WriteClaim DataPlanes::TakeWrite(uint64_t write_id) {
  return Holder([&](const DataPlane& s) { return s.HasWrite(write_id); })
      .TakeWrite(write_id);
}

std::optional<store::ReadClaim> DataPlanes::EndRead(uint64_t lease_id) {
  return Holder([&](const DataPlane& s) { return s.HasRead(lease_id); })
      .EndRead(lease_id);
}

absl::StatusOr<StagingReservation> DataPlanes::ReserveStaging(uint64_t bytes) {
  return shards_[0]->ReserveStaging(bytes);
}

void DataPlanes::Expire(absl::Time now) {
  for (const std::unique_ptr<DataPlane>& shard : shards_) shard->Expire(now);
  if (shards_.size() == 1) return;
  MutexLock lock(&mu_);
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (now - it->second.last_seen < kClientIdle) {
      ++it;
      continue;
    }
    --clients_per_shard_[it->second.shard];
    clients_.erase(it++);
  }
}

void DataPlanes::BeginDrain(absl::Time deadline) {
  for (const std::unique_ptr<DataPlane>& shard : shards_) {
    shard->BeginDrain(deadline);
  }
}

void DataPlanes::Stop() {
  for (const std::unique_ptr<DataPlane>& shard : shards_) shard->Stop();
}

DataPlaneStats DataPlanes::Stats() const {
  DataPlaneStats sum = shards_[0]->Stats();
  for (size_t i = 1; i < shards_.size(); ++i) {
    const DataPlaneStats s = shards_[i]->Stats();
    sum.connections += s.connections;
    sum.write_sessions += s.write_sessions;
    sum.read_sessions += s.read_sessions;
    sum.write_blocks_unlanded += s.write_blocks_unlanded;
    sum.rejected_connections += s.rejected_connections;
    sum.buffer_keys += s.buffer_keys;
    sum.pulled_blocks += s.pulled_blocks;
    sum.blocks_received_in_place += s.blocks_received_in_place;
    sum.message_reads += s.message_reads;
    sum.copied_reads += s.copied_reads;
    sum.blocks_decoded_into_destination += s.blocks_decoded_into_destination;
    sum.blocks_decoded_at_read_start += s.blocks_decoded_at_read_start;
    sum.reads_checked_while_copying += s.reads_checked_while_copying;
    sum.reads_checked_before_sending += s.reads_checked_before_sending;
    sum.read_slices_posted += s.read_slices_posted;
    sum.prefaulted_buffer_bytes += s.prefaulted_buffer_bytes;
    sum.buffer_bytes_populated_by_reads += s.buffer_bytes_populated_by_reads;
  }
  return sum;
}

}  // namespace kvcache::ucx
