#include "client/grpc_status.h"

#include <optional>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "kvcache/client.h"

namespace kvcache {
namespace {

// The trailer a node sets on RESOURCE_EXHAUSTED (service/), and the payload
// it becomes here.
constexpr char kRetryAfterKey[] = "kvcache-retry-after-ms";
constexpr char kRetryPayloadUrl[] = "type.kvcache.dev/retry-after-ms";

}  // namespace

absl::Status internal::FromGrpc(const grpc::Status& status,
                                const grpc::ClientContext& ctx) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()),
                   status.error_message());
  const auto& trailers = ctx.GetServerTrailingMetadata();
  if (auto it = trailers.find(kRetryAfterKey); it != trailers.end()) {
    out.SetPayload(
        kRetryPayloadUrl,
        absl::Cord(std::string(it->second.data(), it->second.size())));
  }
  return out;
}

std::chrono::system_clock::time_point internal::GrpcDeadline(absl::Time t) {
  if (t == absl::InfiniteFuture()) {
    return std::chrono::system_clock::time_point::max();
  }
  return absl::ToChronoTime(t);
}

std::optional<int> RetryAfterMs(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kResourceExhausted) {
    return std::nullopt;
  }
  absl::optional<absl::Cord> payload = status.GetPayload(kRetryPayloadUrl);
  int ms = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &ms)) {
    return std::nullopt;
  }
  return ms;
}

}  // namespace kvcache
