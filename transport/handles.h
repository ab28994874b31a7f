// RAII owners of UCX handles, shared by the node's data plane and the client.
//
// Invariants:
//  * Every UCX handle the project creates is owned by exactly one object of
//    this file; the destructor releases it (ucp_cleanup, ucp_worker_destroy,
//    ucp_listener_destroy, ucp_ep_close_nbx, ucp_mem_unmap,
//    ucp_rkey_buffer_release, ucp_rkey_destroy, ucp_request_free,
//    ucp_listener_reject).
//  * Objects that need a worker (Listener, Endpoint, RemoteKey, Request) are
//    created, used and destroyed on the thread that progresses that worker
//    (the worker runs in UCS_THREAD_MODE_SINGLE). Context and MemoryRegion
//    may be used from any thread (the context is created with
//    mt_workers_shared, which makes mapping and key packing thread-safe).
//  * Owners of worker-bound objects destroy them before the worker; a
//    Context outlives every worker and region made from it.
//  * No C++ exception crosses a UCX callback: every function UCX calls back
//    is declared noexcept, so a throw inside one terminates the process at
//    that frame instead of unwinding through C code.
#ifndef KVCACHE_TRANSPORT_HANDLES_H_
#define KVCACHE_TRANSPORT_HANDLES_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache::ucx {

// ucp_context_h with the AM, RMA and WAKEUP features.
class Context {
 public:
  // Settings of every context of this product, each unless the
  // environment sets it (name without the UCX_ prefix):
  //  * KEEPALIVE_INTERVAL=1s (UCX: 20 s). Endpoints of one peer worker
  //    share its transport connection; after a peer closed one endpoint
  //    (an abandoned read), a new endpoint to it could stay silently dead
  //    until keepalive found the old one broken, so a read over it hung
  //    until its deadline. Keepalive checks the transport, not the peer's
  //    responsiveness, so a node that pauses is not declared dead by it.
  //
  // `settings` (name without the UCX_ prefix, value) are applied after
  // those and override the environment.
  using Settings = std::vector<std::pair<std::string, std::string>>;
  static absl::StatusOr<std::unique_ptr<Context>> Create(
      absl::string_view name, const Settings& settings = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ucp_context_h get() const { return context_; }
  // ucp_context_print_info as text: its "resource" lines name the
  // transports in use (UCX 1.13 has no query for them).
  absl::StatusOr<std::string> Describe() const;

 private:
  explicit Context(ucp_context_h context) : context_(context) {}
  ucp_context_h context_;
};

// ucp_worker_h, single-threaded, with its wakeup file descriptor.
class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const Context& context);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ucp_worker_h get() const { return worker_; }
  int event_fd() const { return event_fd_; }
  // The worker's packed address, for peers to connect to it directly.
  absl::StatusOr<std::string> Address() const;

 private:
  Worker(ucp_worker_h worker, int event_fd)
      : worker_(worker), event_fd_(event_fd) {}
  ucp_worker_h worker_;
  int event_fd_;
};

// A connection request the listener handed over; rejected on destruction
// unless Take() consumed it into an endpoint.
class ConnRequest {
 public:
  ConnRequest(ucp_listener_h listener, ucp_conn_request_h request)
      : listener_(listener), request_(request) {}
  ~ConnRequest();
  ConnRequest(const ConnRequest&) = delete;
  ConnRequest& operator=(const ConnRequest&) = delete;
  // The peer's address as "ip:port" (empty when UCX cannot tell).
  std::string PeerAddress() const;
  ucp_conn_request_h Take();

 private:
  ucp_listener_h listener_;
  ucp_conn_request_h request_;
};

using ConnHandler = void (*)(ucp_conn_request_h request, void* arg);

// ucp_listener_h on HOST:PORT (port 0: any free port).
class Listener {
 public:
  static absl::StatusOr<std::unique_ptr<Listener>> Create(
      const Worker& worker, absl::string_view host_port, ConnHandler handler,
      void* arg);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  ucp_listener_h get() const { return listener_; }
  int port() const { return port_; }

 private:
  Listener(ucp_listener_h listener, int port)
      : listener_(listener), port_(port) {}
  ucp_listener_h listener_;
  int port_;
};

using EpErrorHandler = void (*)(void* arg, ucp_ep_h ep, ucs_status_t status);

// ucp_ep_h with peer error handling. The destructor force-closes it: every
// operation still outstanding on it completes with an error.
class Endpoint {
 public:
  // Client side: connects to HOST:PORT through the listener there.
  static absl::StatusOr<std::unique_ptr<Endpoint>> Connect(
      const Worker& worker, absl::string_view host_port,
      EpErrorHandler on_error, void* arg);
  // Connects to a worker by its packed address. With peer error handling
  // when the transports the two workers share support it; otherwise (UCX
  // 1.13's shared-memory transports) without, and *peer_errors says which.
  static absl::StatusOr<std::unique_ptr<Endpoint>> ConnectToWorker(
      const Worker& worker, absl::string_view worker_address,
      EpErrorHandler on_error, void* arg, bool* peer_errors);
  // Server side: accepts a connection request.
  static absl::StatusOr<std::unique_ptr<Endpoint>> Accept(
      const Worker& worker, ConnRequest* request, EpErrorHandler on_error,
      void* arg);
  // Server side: takes ownership of an endpoint UCX created for a peer that
  // connected to this worker's address (an active message's reply_ep).
  static std::unique_ptr<Endpoint> Adopt(ucp_ep_h ep);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  ucp_ep_h get() const { return ep_; }
  // ucp_ep_print_info as text: one "lane[N]: ..." line per lane, naming
  // its transport (UCX 1.13 has no query for them).
  absl::StatusOr<std::string> Describe() const;

 private:
  explicit Endpoint(ucp_ep_h ep) : ep_(ep) {}
  ucp_ep_h ep_;
};

// Memory mapped for RMA (ucp_mem_map): registered caller memory, or memory
// UCX allocates (shared memory where a transport offers it, so that peers on
// the same host copy into it directly).
class MemoryRegion {
 public:
  static absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(
      const Context& context, void* address, size_t length);
  static absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(
      const Context& context, size_t length);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  ucp_mem_h memh() const { return memh_; }
  // The packed remote key that lets a peer put into this region.
  absl::StatusOr<std::string> PackRemoteKey() const;

 private:
  MemoryRegion(ucp_context_h context, ucp_mem_h memh, uint8_t* data,
               size_t size)
      : context_(context), memh_(memh), data_(data), size_(size) {}
  ucp_context_h context_;
  ucp_mem_h memh_;
  uint8_t* data_;
  size_t size_;
};

// A peer's unpacked remote key, bound to the endpoint it was unpacked on.
class RemoteKey {
 public:
  static absl::StatusOr<std::unique_ptr<RemoteKey>> Unpack(
      const Endpoint& ep, absl::string_view packed);
  ~RemoteKey();
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;
  ucp_rkey_h get() const { return rkey_; }

 private:
  explicit RemoteKey(ucp_rkey_h rkey) : rkey_(rkey) {}
  ucp_rkey_h rkey_;
};

// A request handle returned by a ucp_*_nbx call; freed on destruction.
class Request {
 public:
  explicit Request(void* request) : request_(request) {}
  ~Request();
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

 private:
  void* request_;
};

using Done = absl::AnyInvocable<void(absl::Status)>;

// One non-blocking operation and its completion. Start() issues it with a
// request parameter whose callback delivers `done` exactly once, on the
// worker's thread: immediately when the call completes inline (or fails),
// otherwise from the UCX callback, which also frees the request. `keep`
// holds bytes (an AM header) that must live as long as the operation; the
// issuing function sees them at their final address.
class Operation {
 public:
  enum class Kind { kSend, kRecvAm };
  using Issue = absl::AnyInvocable<ucs_status_ptr_t(
      const ucp_request_param_t& param, absl::string_view keep)>;

  static void Start(Kind kind, Issue issue, Done done,
                    std::string keep = std::string());

 private:
  Operation(Done done, std::string keep)
      : done_(std::move(done)), keep_(std::move(keep)) {}
  static void OnSend(void* request, ucs_status_t status,
                     void* user_data) noexcept;
  static void OnRecvAm(void* request, ucs_status_t status, size_t length,
                       void* user_data) noexcept;
  static void Finish(void* request, ucs_status_t status,
                     void* user_data) noexcept;

  Done done_;
  std::string keep_;
};

// Sends `message` (its first `header_size` bytes are the AM header, the
// rest the data) as one eager active message `am_id` on `ep`, naming this
// worker as its sender (UCP_AM_SEND_FLAG_REPLY, so that the peer knows the
// connection). The operation keeps `message` until it completes; `done`
// runs then, on the worker's thread.
void SendEagerAm(ucp_ep_h ep, unsigned am_id, std::string message,
                 size_t header_size, Done done);

}  // namespace kvcache::ucx

#endif  // KVCACHE_TRANSPORT_HANDLES_H_
