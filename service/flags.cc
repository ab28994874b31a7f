#include "service/flags.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kernels/codec.h"

namespace kvcache::service {
namespace {

absl::Status Bad(absl::string_view flag, absl::string_view value,
                 absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", value, ": ", why));
}

absl::Status ApplyFlag(absl::string_view name, absl::string_view value,
                       ParsedFlags* out, int depth);

absl::Status ApplyConfigFile(absl::string_view path, ParsedFlags* out,
                             int depth) {
  if (depth > 2) return Bad("config", path, "config files nest too deep");
  std::ifstream in{std::string(path)};
  if (!in) return Bad("config", path, "cannot open file");
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    if (!absl::ConsumePrefix(&text, "--")) {
      return Bad("config", path,
                 absl::StrCat("line ", line_no, " is not --flag=value"));
    }
    size_t eq = text.find('=');
    absl::string_view name = text.substr(0, eq);
    absl::string_view value =
        eq == absl::string_view::npos ? "" : text.substr(eq + 1);
    if (absl::Status s = ApplyFlag(name, value, out, depth + 1); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_no, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyFlag(absl::string_view name, absl::string_view value,
                       ParsedFlags* out, int depth) {
  NodeOptions& o = out->options;
  auto parse_uint = [&](uint64_t* dst) -> absl::Status {
    if (!absl::SimpleAtoi(value, dst)) return Bad(name, value, "not a number");
    return absl::OkStatus();
  };
  auto parse_seconds = [&](absl::Duration* dst) -> absl::Status {
    double seconds = 0;
    if (!absl::SimpleAtod(value, &seconds) || seconds < 0) {
      return Bad(name, value, "expected seconds, e.g. 30 or 0.5");
    }
    *dst = absl::Seconds(seconds);
    return absl::OkStatus();
  };
  if (name == "help") {
    out->help = true;
  } else if (name == "listen") {
    o.listen = std::string(value);
  } else if (name == "health-listen") {
    o.health_listen = std::string(value);
  } else if (name == "metrics-listen") {
    o.metrics_listen = std::string(value);
  } else if (name == "memory") {
    absl::StatusOr<store::MemorySpec> spec = store::ParseMemorySpec(value);
    if (!spec.ok()) return spec.status();
    o.memory = *spec;
  } else if (name == "page-size") {
    absl::StatusOr<uint64_t> bytes = store::ParseByteSize(value);
    if (!bytes.ok()) return bytes.status();
    if (*bytes > UINT32_MAX) return Bad(name, value, "too large");
    o.store.page_size = static_cast<uint32_t>(*bytes);
  } else if (name == "default-codec") {
    std::optional<kernels::Codec> codec = kernels::CodecFromName(value);
    if (!codec) {
      return Bad(name, value,
                 "unknown codec (none, fp8_e4m3, fp8_e5m2, kivi2, kivi4)");
    }
    o.store.default_codec = *codec;
  } else if (name == "lease-ttl") {
    return parse_seconds(&o.store.default_lease_ttl);
  } else if (name == "max-namespaces") {
    uint64_t v = 0;
    if (absl::Status s = parse_uint(&v); !s.ok()) return s;
    o.store.max_namespaces = v;
  } else if (name == "max-blocks-per-request") {
    uint64_t v = 0;
    if (absl::Status s = parse_uint(&v); !s.ok()) return s;
    if (v == 0) return Bad(name, value, "must be positive");
    o.store.max_blocks_per_request = v;
  } else if (name == "max-request-bytes") {
    absl::StatusOr<uint64_t> bytes = store::ParseByteSize(value);
    if (!bytes.ok()) return bytes.status();
    if (*bytes > INT32_MAX) return Bad(name, value, "at most 2GiB-1");
    o.max_request_bytes = static_cast<int>(*bytes);
  } else if (name == "high-watermark" || name == "low-watermark") {
    double v = 0;
    if (!absl::SimpleAtod(value, &v) || v <= 0 || v > 1) {
      return Bad(name, value, "expected a fraction in (0, 1]");
    }
    (name == "high-watermark" ? o.store.high_watermark
                              : o.store.low_watermark) = v;
  } else if (name == "data-plane") {
    if (value == "ucx") {
      o.data_plane = DataPlaneMode::kUcx;
    } else if (value == "none") {
      o.data_plane = DataPlaneMode::kNone;
    } else {
      return Bad(name, value, "expected ucx or none");
    }
  } else if (name == "ucx-listen") {
    if (value.rfind(':') == absl::string_view::npos) {
      return Bad(name, value, "expected HOST:PORT");
    }
    o.ucx.listen = std::string(value);
  } else if (name == "prefault-memory") {
    if (value == "true") {
      o.prefault_memory = true;
    } else if (value == "false") {
      o.prefault_memory = false;
    } else {
      return Bad(name, value, "expected true or false");
    }
  } else if (name == "ucx-tcp-trusted-network") {
    if (value == "true") {
      o.ucx.tcp_trusted_network = true;
    } else if (value == "false") {
      o.ucx.tcp_trusted_network = false;
    } else {
      return Bad(name, value, "expected true or false");
    }
  } else if (name == "ucx-advertise") {
    o.ucx.advertise_host = std::string(value);
  } else if (name == "ucx-read-delivery") {
    if (value == "auto") {
      o.ucx.read_delivery = ucx::ReadDelivery::kAuto;
    } else if (value == "puts") {
      o.ucx.read_delivery = ucx::ReadDelivery::kPuts;
    } else {
      return Bad(name, value, "expected auto or puts");
    }
  } else if (name == "ucx-progress-threads") {
    uint64_t v = 0;
    if (absl::Status s = parse_uint(&v); !s.ok()) return s;
    if (v == 0 || v > 64) return Bad(name, value, "1 to 64");
    o.ucx.progress_threads = static_cast<int>(v);
  } else if (name == "staging-bytes") {
    absl::StatusOr<uint64_t> bytes = store::ParseByteSize(value);
    if (!bytes.ok()) return bytes.status();
    if (*bytes == 0) return Bad(name, value, "must be positive");
    o.ucx.staging_bytes = *bytes;
  } else if (name == "drain-timeout") {
    return parse_seconds(&o.drain_timeout);
  } else if (name == "tls-cert") {
    o.tls.cert_file = std::string(value);
  } else if (name == "tls-key") {
    o.tls.key_file = std::string(value);
  } else if (name == "tls-client-ca") {
    o.tls.client_ca_file = std::string(value);
  } else if (name == "tls-refresh") {
    return parse_seconds(&o.tls.refresh_interval);
  } else if (name == "tenants") {
    o.tenants_file = std::string(value);
  } else if (name == "tenants-refresh") {
    return parse_seconds(&o.tenants_refresh);
  } else if (name == "drain-notice") {
    return parse_seconds(&out->drain_notice);
  } else if (name == "workers") {
    uint64_t v = 0;
    if (absl::Status s = parse_uint(&v); !s.ok()) return s;
    o.worker_threads = static_cast<int>(v);
  } else if (name == "config") {
    return ApplyConfigFile(value, out, depth);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown flag --", name, " (see --help)"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string NodeUsage() {
  return R"(kvcache-node: a cache node of the disaggregated KV-cache store.

Usage: kvcache-node [--flag=value ...]

  --listen=HOST:PORT            gRPC control plane (default 0.0.0.0:50051)
  --health-listen=HOST:PORT     plaintext grpc.health.v1 only, for probes
                                (default: none; health is also on --listen)
  --metrics-listen=HOST:PORT    Prometheus /metrics (default 0.0.0.0:9464;
                                empty disables)
  --memory=TIER:SIZE            where blocks live: host:SIZE (e.g. host:1GiB)
                                or gpu:INDEX:SIZE (e.g. gpu:0:60GiB, memory
                                of CUDA device INDEX; the node does not start
                                when CUDA does not reach that device)
  --page-size=BYTES             pool page size, power of two (default 16KiB)
  --prefault-memory=BOOL        true (default): fault the host memory in on
                                a background thread from the start, so the
                                first writes run at full speed (the node's
                                RSS is the whole --memory at once)
  --default-codec=CODEC         codec of namespaces that name none:
                                none, fp8_e4m3 (default), fp8_e5m2, kivi2, kivi4
  --lease-ttl=SECONDS           default read/write lease TTL (default 30)
  --max-namespaces=N            namespaces a node holds (default 16)
  --max-blocks-per-request=N    keys in one request (default 1024)
  --max-request-bytes=BYTES     largest gRPC message accepted (default 256MiB)
  --high-watermark=FRACTION     above this pool usage, evict in the background
                                (default 0.95; 1 turns it off) ...
  --low-watermark=FRACTION      ... down to this usage (default 0.90)
  --data-plane=MODE             ucx: KV bytes travel over UCX when the
                                client offers it; none (default): inline
                                in gRPC messages only
  --ucx-tcp-trusted-network=BOOL  false (default): UCX runs over shared
                                memory and RDMA only and opens no port;
                                clients on other hosts without RDMA move
                                their bytes over gRPC. true: UCX may use
                                TCP too. For trusted networks only: any
                                peer that reaches UCX's TCP ports can crash
                                the node or write into its memory
                                (docs/operations.md, "Security")
  --ucx-listen=HOST:PORT        a UCX listener (TCP) for clients without
                                the node's worker address (default: none;
                                needs --ucx-tcp-trusted-network=true)
  --ucx-advertise=HOST          host clients dial for the data plane
                                (default: the --ucx-listen host; a wildcard
                                host makes clients use their gRPC host)
  --ucx-read-delivery=MODE      how reads reach clients: auto (default:
                                puts on shared memory and RDMA, data
                                messages where UCX would emulate puts,
                                as on TCP) or puts (always)
  --ucx-progress-threads=N      UCX workers of the data plane, each with
                                its own progress thread; each client
                                process is served by one (default 1;
                                at most 64)
  --staging-bytes=BYTES         bound on data-plane staging: write blocks
                                to encode (codec none lands in the
                                store's pages instead), read copies
                                until sent (default 256MiB)
  --tls-cert=FILE --tls-key=FILE  TLS on --listen (PEM certificate chain
                                and key; re-read when they change)
  --tls-client-ca=FILE          with --tls-cert: require client
                                certificates signed by this CA (mTLS)
  --tls-refresh=SECONDS         how often the TLS files are re-read
                                (default 10)
  --tenants=FILE                tenants (kvcache/v1/tenants.proto, text
                                format): every call then needs a bearer
                                token or client certificate of a tenant
                                (default: none, the node runs open)
  --tenants-refresh=SECONDS     how often the tenants file is re-read
                                (default 10)
  --drain-timeout=SECONDS       on SIGTERM, how long in-flight calls may
                                finish, notice included (default 20)
  --drain-notice=SECONDS        on SIGTERM, how long every port answers
                                health NOT_SERVING (and still serves)
                                before it closes (default 1)
  --workers=N                   threads for encode/decode (default: cores)
  --config=FILE                 read more flags, one --flag=value per line
  --help                        this text

SIGTERM or SIGINT: health turns NOT_SERVING, in-flight calls drain, exit 0.
)";
}

absl::StatusOr<ParsedFlags> ParseNodeFlags(
    const std::vector<std::string>& args) {
  ParsedFlags out;
  for (const std::string& arg : args) {
    absl::string_view text = arg;
    if (!absl::ConsumePrefix(&text, "--")) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (flags are --x=y)"));
    }
    size_t eq = text.find('=');
    absl::string_view name = text.substr(0, eq);
    absl::string_view value =
        eq == absl::string_view::npos ? "" : text.substr(eq + 1);
    if (eq == absl::string_view::npos && name != "help") {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", name, " needs a value: --", name, "=..."));
    }
    if (absl::Status s = ApplyFlag(name, value, &out, 0); !s.ok()) return s;
  }
  return out;
}

}  // namespace kvcache::service
