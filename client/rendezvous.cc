#include "client/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace kvcache::internal {

uint64_t NodeSeed(absl::string_view node_id) {
  return XXH3_64bits(node_id.data(), node_id.size());
}

uint64_t RendezvousScore(uint64_t node_seed, absl::string_view key) {
  return XXH3_64bits_withSeed(key.data(), key.size(), node_seed);
}

size_t RendezvousOwner(absl::Span<const uint64_t> node_seeds,
                       absl::string_view key) {
  size_t best = 0;
  uint64_t best_score = RendezvousScore(node_seeds[0], key);
  for (size_t i = 1; i < node_seeds.size(); ++i) {
    uint64_t score = RendezvousScore(node_seeds[i], key);
    if (score > best_score) {  // strictly: a tie keeps the lower index
      best = i;
      best_score = score;
    }
  }
  return best;
}

absl::StatusOr<std::vector<std::string>> ResolveIpv4(const std::string& name,
                                                     int port) {
  if (name.empty()) return absl::InvalidArgumentError("DNS name is empty");
  if (port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port ", port));
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* raw = nullptr;
  int rc = getaddrinfo(name.c_str(), nullptr, &hints, &raw);
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> list(raw, freeaddrinfo);
  if (rc == EAI_NONAME || rc == EAI_NODATA) {
    return absl::NotFoundError(
        absl::StrCat("DNS name '", name, "' has no A record"));
  }
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("resolving '", name, "': ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET || a->ai_addr == nullptr) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) {
      continue;
    }
    out.push_back(absl::StrCat(text, ":", port));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) {
    return absl::NotFoundError(
        absl::StrCat("DNS name '", name, "' has no A record"));
  }
  return out;
}

}  // namespace kvcache::internal
