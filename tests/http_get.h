// HttpGet: a minimal blocking HTTP/1.0 GET on loopback for tests, with a
// bounded receive timeout. Returns the body, or an error.
#ifndef KVCACHE_TESTS_HTTP_GET_H_
#define KVCACHE_TESTS_HTTP_GET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvcache::testing {

class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

inline absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  ScopedFd fd(socket(AF_INET, SOCK_STREAM, 0));
  if (fd.get() < 0) return absl::InternalError("socket");
  timeval tv{5, 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
      0) {
    return absl::UnavailableError(absl::StrCat("connect to port ", port));
  }
  std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (send(fd.get(), request.data(), request.size(), 0) !=
      static_cast<ssize_t>(request.size())) {
    return absl::UnavailableError("send");
  }
  std::string response;
  char buf[65536];
  while (true) {
    ssize_t n = recv(fd.get(), buf, sizeof(buf), 0);
    if (n < 0) return absl::DeadlineExceededError("recv timed out");
    if (n == 0) break;
    response.append(buf, static_cast<size_t>(n));
  }
  size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos) return absl::InternalError("no HTTP body");
  return response.substr(body + 4);
}

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_HTTP_GET_H_
