#include "transport/handles.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <ucs/debug/log_def.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/memory/memory.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "transport/status.h"

namespace kvcache::ucx {
namespace {

// Parses "host:port" (host may be empty or a name; [v6]:port allowed) into
// a socket address. Port 0 is allowed (a listener picks one).
absl::Status ResolveHostPort(absl::string_view host_port, sockaddr_storage* out,
                             socklen_t* out_len) {
  size_t colon = host_port.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", host_port, "' is not HOST:PORT"));
  }
  std::string host(host_port.substr(0, colon));
  absl::string_view port_text = host_port.substr(colon + 1);
  int port = 0;
  if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad port in '", host_port, "'"));
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) host = "0.0.0.0";
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(result, freeaddrinfo);
  std::memcpy(out, result->ai_addr, result->ai_addrlen);
  *out_len = result->ai_addrlen;
  if (out->ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(out)->sin_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in6*>(out)->sin6_port = htons(port);
  }
  return absl::OkStatus();
}

std::string FormatSockaddr(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    return absl::StrCat(host, ":", port);
  }
  if (addr.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    port = ntohs(in->sin6_port);
    return absl::StrCat("[", host, "]:", port);
  }
  return std::string();
}

int SockaddrPort(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  }
  if (addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  }
  return 0;
}

// What `print` writes to a FILE*, as a string.
absl::StatusOr<std::string> PrintedText(absl::FunctionRef<void(FILE*)> print) {
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&text, &size);
  if (stream == nullptr) return absl::InternalError("open_memstream failed");
  print(stream);
  std::fclose(stream);
  std::string printed(text, size);
  std::free(text);
  return printed;
}

// Frees a status pointer that an immediate-return call handed back: a
// request pointer is released; an error or UCS_OK needs nothing.
void ReleaseStatusPtr(ucs_status_ptr_t ptr) {
  if (UCS_PTR_IS_PTR(ptr)) Request owned(ptr);
}

}  // namespace

// ---------------------------------------------------------------- Context

absl::StatusOr<std::unique_ptr<Context>> Context::Create(
    absl::string_view name, const Settings& settings) {
  ucp_config_t* config = nullptr;
  if (absl::Status s = UcxStatus(ucp_config_read(nullptr, nullptr, &config),
                                 "ucp_config_read");
      !s.ok()) {
    return s;
  }
  static constexpr std::pair<const char*, const char*> kDefaults[] = {
      {"KEEPALIVE_INTERVAL", "1s"},
  };
  for (const auto& [setting, value] : kDefaults) {
    if (std::getenv(absl::StrCat("UCX_", setting).c_str()) != nullptr) continue;
    if (absl::Status s = UcxStatus(ucp_config_modify(config, setting, value),
                                   absl::StrCat("ucp_config_modify ", setting));
        !s.ok()) {
      ucp_config_release(config);
      return s;
    }
  }
  for (const auto& [setting, value] : settings) {
    if (absl::Status s =
            UcxStatus(ucp_config_modify(config, setting.c_str(), value.c_str()),
                      absl::StrCat("ucp_config_modify ", setting));
        !s.ok()) {
      ucp_config_release(config);
      return s;
    }
  }
  std::string owned_name(name);
  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  // Memory mapping and key packing may be called from any thread (clients
  // register their buffers on their own threads): context-level locking.
  params.mt_workers_shared = 1;
  params.name = owned_name.c_str();
  ucp_context_h context = nullptr;
  ucs_status_t status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (absl::Status s = UcxStatus(status, "ucp_init"); !s.ok()) return s;
  return absl::WrapUnique(new Context(context));
}

Context::~Context() { ucp_cleanup(context_); }

absl::StatusOr<std::string> Context::Describe() const {
  return PrintedText(
      [this](FILE* out) { ucp_context_print_info(context_, out); });
}

// ----------------------------------------------------------------- Worker

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const Context& context) {
  ucp_worker_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  if (absl::Status s =
          UcxStatus(ucp_worker_create(context.get(), &params, &worker),
                    "ucp_worker_create");
      !s.ok()) {
    return s;
  }
  int fd = -1;
  if (absl::Status s =
          UcxStatus(ucp_worker_get_efd(worker, &fd), "ucp_worker_get_efd");
      !s.ok()) {
    ucp_worker_destroy(worker);
    return s;
  }
  return absl::WrapUnique(new Worker(worker, fd));
}

Worker::~Worker() { ucp_worker_destroy(worker_); }

absl::StatusOr<std::string> Worker::Address() const {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  if (absl::Status s =
          UcxStatus(ucp_worker_get_address(worker_, &address, &length),
                    "ucp_worker_get_address");
      !s.ok()) {
    return s;
  }
  std::string out(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker_, address);
  return out;
}

// ------------------------------------------------------------ ConnRequest

ConnRequest::~ConnRequest() {
  if (request_ != nullptr) ucp_listener_reject(listener_, request_);
}

std::string ConnRequest::PeerAddress() const {
  if (request_ == nullptr) return std::string();
  ucp_conn_request_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(request_, &attr) != UCS_OK) return std::string();
  return FormatSockaddr(attr.client_address);
}

ucp_conn_request_h ConnRequest::Take() {
  return std::exchange(request_, nullptr);
}

// --------------------------------------------------------------- Listener

absl::StatusOr<std::unique_ptr<Listener>> Listener::Create(
    const Worker& worker, absl::string_view host_port, ConnHandler handler,
    void* arg) {
  sockaddr_storage addr;
  socklen_t addr_len = 0;
  if (absl::Status s = ResolveHostPort(host_port, &addr, &addr_len); !s.ok()) {
    return s;
  }
  ucp_listener_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                      UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  params.sockaddr.addrlen = addr_len;
  params.conn_handler.cb = handler;
  params.conn_handler.arg = arg;
  ucp_listener_h listener = nullptr;
  if (absl::Status s =
          UcxStatus(ucp_listener_create(worker.get(), &params, &listener),
                    absl::StrCat("ucp_listener_create on ", host_port));
      !s.ok()) {
    return s;
  }
  ucp_listener_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (absl::Status s =
          UcxStatus(ucp_listener_query(listener, &attr), "ucp_listener_query");
      !s.ok()) {
    ucp_listener_destroy(listener);
    return s;
  }
  return absl::WrapUnique(new Listener(listener, SockaddrPort(attr.sockaddr)));
}

Listener::~Listener() { ucp_listener_destroy(listener_); }

// --------------------------------------------------------------- Endpoint

absl::StatusOr<std::unique_ptr<Endpoint>> Endpoint::Connect(
    const Worker& worker, absl::string_view host_port, EpErrorHandler on_error,
    void* arg) {
  sockaddr_storage addr;
  socklen_t addr_len = 0;
  if (absl::Status s = ResolveHostPort(host_port, &addr, &addr_len); !s.ok()) {
    return s;
  }
  ucp_ep_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  params.sockaddr.addrlen = addr_len;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = on_error;
  params.err_handler.arg = arg;
  ucp_ep_h ep = nullptr;
  if (absl::Status s = UcxStatus(ucp_ep_create(worker.get(), &params, &ep),
                                 absl::StrCat("ucp_ep_create to ", host_port));
      !s.ok()) {
    return s;
  }
  return absl::WrapUnique(new Endpoint(ep));
}

namespace {

// ConnectToWorker asks for peer failure handling first and falls back
// without it when no transport to the peer offers it (shared memory). UCX
// logs that refusal as an ERROR on stdout, once per connection in every
// process: on this thread, during that attempt, the expected message is
// swallowed; every other message goes on to UCX's own handler.
thread_local bool expecting_no_peer_transport = false;

ucs_log_func_rc_t SwallowExpectedRefusal(const char*, unsigned, const char*,
                                         ucs_log_level_t level,
                                         const ucs_log_component_config_t*,
                                         const char* format, va_list ap) {
  if (!expecting_no_peer_transport || level != UCS_LOG_LEVEL_ERROR ||
      format == nullptr) {
    return UCS_LOG_FUNC_RC_CONTINUE;
  }
  char text[512];
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(text, sizeof(text), format, copy);
  va_end(copy);
  // "no active messages transport to <peer>: self/memory0 - no peer failure
  // handler, ..."
  return std::strstr(text, "no peer failure handler") != nullptr
             ? UCS_LOG_FUNC_RC_STOP
             : UCS_LOG_FUNC_RC_CONTINUE;
}

// UCX calls the handlers pushed last first.
void InstallRefusalFilterOnce() {
  static std::once_flag once;
  std::call_once(once, [] { ucs_log_push_handler(&SwallowExpectedRefusal); });
}

}  // namespace

absl::StatusOr<std::unique_ptr<Endpoint>> Endpoint::ConnectToWorker(
    const Worker& worker, absl::string_view worker_address,
    EpErrorHandler on_error, void* arg, bool* peer_errors) {
  if (worker_address.empty()) {
    return absl::InvalidArgumentError("empty UCX worker address");
  }
  // ucp_ep_create reads the address; keep an aligned private copy.
  std::string copy(worker_address);
  absl::Status status;
  for (bool peer : {true, false}) {
    ucp_ep_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.address = reinterpret_cast<const ucp_address_t*>(copy.data());
    params.err_mode =
        peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer) {
      params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.err_handler.cb = on_error;
      params.err_handler.arg = arg;
    }
    ucp_ep_h ep = nullptr;
    if (peer) InstallRefusalFilterOnce();
    expecting_no_peer_transport = peer;
    ucs_status_t s = ucp_ep_create(worker.get(), &params, &ep);
    expecting_no_peer_transport = false;
    if (s == UCS_OK) {
      *peer_errors = peer;
      return absl::WrapUnique(new Endpoint(ep));
    }
    status = UcxStatus(s, "ucp_ep_create (worker address)");
    if (s != UCS_ERR_UNREACHABLE) break;  // only a missing handler retries
  }
  return status;
}

std::unique_ptr<Endpoint> Endpoint::Adopt(ucp_ep_h ep) {
  return absl::WrapUnique(new Endpoint(ep));
}

absl::StatusOr<std::unique_ptr<Endpoint>> Endpoint::Accept(
    const Worker& worker, ConnRequest* request, EpErrorHandler on_error,
    void* arg) {
  ucp_ep_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = on_error;
  params.err_handler.arg = arg;
  params.conn_request = request->Take();
  ucp_ep_h ep = nullptr;
  if (absl::Status s = UcxStatus(ucp_ep_create(worker.get(), &params, &ep),
                                 "ucp_ep_create (accept)");
      !s.ok()) {
    return s;
  }
  return absl::WrapUnique(new Endpoint(ep));
}

Endpoint::~Endpoint() {
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ReleaseStatusPtr(ucp_ep_close_nbx(ep_, &param));
}

absl::StatusOr<std::string> Endpoint::Describe() const {
  return PrintedText([this](FILE* out) { ucp_ep_print_info(ep_, out); });
}

// ----------------------------------------------------------- MemoryRegion

absl::StatusOr<std::unique_ptr<MemoryRegion>> MemoryRegion::Register(
    const Context& context, void* address, size_t length) {
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask =
      UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = address;
  params.length = length;
  ucp_mem_h memh = nullptr;
  if (absl::Status s = UcxStatus(ucp_mem_map(context.get(), &params, &memh),
                                 "ucp_mem_map (register)");
      !s.ok()) {
    return s;
  }
  return absl::WrapUnique(new MemoryRegion(
      context.get(), memh, static_cast<uint8_t*>(address), length));
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> MemoryRegion::Allocate(
    const Context& context, size_t length) {
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                      UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = length;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  if (absl::Status s = UcxStatus(ucp_mem_map(context.get(), &params, &memh),
                                 "ucp_mem_map (allocate)");
      !s.ok()) {
    return s;
  }
  ucp_mem_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if (absl::Status s = UcxStatus(ucp_mem_query(memh, &attr), "ucp_mem_query");
      !s.ok()) {
    ucp_mem_unmap(context.get(), memh);
    return s;
  }
  return absl::WrapUnique(new MemoryRegion(
      context.get(), memh, static_cast<uint8_t*>(attr.address), length));
}

MemoryRegion::~MemoryRegion() { ucp_mem_unmap(context_, memh_); }

absl::StatusOr<std::string> MemoryRegion::PackRemoteKey() const {
  void* buffer = nullptr;
  size_t size = 0;
  if (absl::Status s = UcxStatus(ucp_rkey_pack(context_, memh_, &buffer, &size),
                                 "ucp_rkey_pack");
      !s.ok()) {
    return s;
  }
  std::unique_ptr<void, void (*)(void*)> owned(buffer, ucp_rkey_buffer_release);
  return std::string(static_cast<const char*>(buffer), size);
}

// -------------------------------------------------------------- RemoteKey

absl::StatusOr<std::unique_ptr<RemoteKey>> RemoteKey::Unpack(
    const Endpoint& ep, absl::string_view packed) {
  ucp_rkey_h rkey = nullptr;
  if (absl::Status s =
          UcxStatus(ucp_ep_rkey_unpack(ep.get(), packed.data(), &rkey),
                    "ucp_ep_rkey_unpack");
      !s.ok()) {
    return s;
  }
  return absl::WrapUnique(new RemoteKey(rkey));
}

RemoteKey::~RemoteKey() { ucp_rkey_destroy(rkey_); }

// ---------------------------------------------------------------- Request

Request::~Request() {
  if (request_ != nullptr) ucp_request_free(request_);
}

// -------------------------------------------------------------- Operation

void Operation::Start(Kind kind, Issue issue, Done done, std::string keep) {
  std::unique_ptr<Operation> op =
      absl::WrapUnique(new Operation(std::move(done), std::move(keep)));
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  if (kind == Kind::kSend) {
    param.cb.send = &Operation::OnSend;
  } else {
    param.cb.recv_am = &Operation::OnRecvAm;
  }
  param.user_data = op.get();
  ucs_status_ptr_t result = issue(param, op->keep_);
  if (UCS_PTR_IS_PTR(result)) {
    // In flight: the callback owns the operation from now on.
    op.release();
    return;
  }
  Done finished = std::move(op->done_);
  finished(UcxStatus(UCS_PTR_STATUS(result), "ucx operation"));
}

void Operation::OnSend(void* request, ucs_status_t status,
                       void* user_data) noexcept {
  Finish(request, status, user_data);
}

void Operation::OnRecvAm(void* request, ucs_status_t status, size_t length,
                         void* user_data) noexcept {
  Finish(request, status, user_data);
}

void Operation::Finish(void* request, ucs_status_t status,
                       void* user_data) noexcept {
  Request owned_request(request);
  std::unique_ptr<Operation> op(static_cast<Operation*>(user_data));
  Done finished = std::move(op->done_);
  finished(UcxStatus(status, "ucx operation"));
}

void SendEagerAm(ucp_ep_h ep, unsigned am_id, std::string message,
                 size_t header_size, Done done) {
  Operation::Start(
      Operation::Kind::kSend,
      [ep, am_id, header_size](const ucp_request_param_t& param,
                               absl::string_view kept) {
        ucp_request_param_t p = param;
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
        return ucp_am_send_nbx(ep, am_id, kept.data(), header_size,
                               kept.data() + header_size,
                               kept.size() - header_size, &p);
      },
      std::move(done), std::move(message));
}

}  // namespace kvcache::ucx
