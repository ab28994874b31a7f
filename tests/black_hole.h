// A hung node for client tests: a TCP listener on loopback that never
// accepts, so connections succeed and no RPC is ever answered.
#ifndef KVCACHE_TESTS_BLACK_HOLE_H_
#define KVCACHE_TESTS_BLACK_HOLE_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace kvcache::testing {

class BlackHole {
 public:
  BlackHole() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        listen(fd_, 64) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
  }
  ~BlackHole() { close(fd_); }
  BlackHole(const BlackHole&) = delete;
  BlackHole& operator=(const BlackHole&) = delete;
  // 0 when the listener could not be set up.
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace kvcache::testing

#endif  // KVCACHE_TESTS_BLACK_HOLE_H_
