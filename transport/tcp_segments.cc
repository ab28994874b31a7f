#include "transport/tcp_segments.h"

#include <uct/api/uct.h>

#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "transport/status.h"

namespace kvcache::ucx {
namespace {

constexpr absl::string_view kMismatchPayload =
    "type.kvcache.dev/kvcache.ucx.TcpSegmentsMismatch";

// RAII owners of the UCT objects read here (released in reverse order).
struct ComponentListFree {
  void operator()(uct_component_h* list) const {
    uct_release_component_list(list);
  }
};
struct ConfigFree {
  void operator()(void* config) const { uct_config_release(config); }
};
struct MdClose {
  void operator()(uct_md* md) const { uct_md_close(md); }
};
using ComponentList = std::unique_ptr<uct_component_h, ComponentListFree>;
using MdConfig = std::unique_ptr<uct_md_config_t, ConfigFree>;
using IfaceConfig = std::unique_ptr<uct_iface_config_t, ConfigFree>;
using Md = std::unique_ptr<uct_md, MdClose>;

// Whether one of the context's transport resources is TCP: its described
// resource lines read "... flags -- tcp/<device>".
absl::StatusOr<bool> UsesTcp(const Context& context) {
  absl::StatusOr<std::string> text = context.Describe();
  if (!text.ok()) return text.status();
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    if (absl::StrContains(line, "resource") &&
        absl::StrContains(line, " tcp/")) {
      return true;
    }
  }
  return false;
}

absl::StatusOr<uint64_t> ConfigBytes(uct_iface_config_t* config,
                                     const char* name) {
  char value[64] = {};
  if (absl::Status s =
          UcxStatus(uct_config_get(config, name, value, sizeof(value)),
                    absl::StrCat("uct_config_get TCP_", name));
      !s.ok()) {
    return s;
  }
  absl::StatusOr<uint64_t> bytes = ParseMemoryUnits(value);
  if (!bytes.ok()) {
    return absl::InternalError(absl::StrCat("UCX_TCP_", name, "=", value, ": ",
                                            bytes.status().message()));
  }
  return bytes;
}

}  // namespace

absl::StatusOr<uint64_t> ParseMemoryUnits(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  if (absl::EqualsIgnoreCase(text, "inf")) {
    return std::numeric_limits<uint64_t>::max();
  }
  size_t digits = 0;
  while (digits < text.size() && absl::ascii_isdigit(text[digits])) ++digits;
  uint64_t number = 0;
  if (digits == 0 || !absl::SimpleAtoi(text.substr(0, digits), &number)) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a size in memory units: \"", text, "\""));
  }
  absl::string_view unit = text.substr(digits);
  if (!unit.empty() && (unit.back() == 'b' || unit.back() == 'B')) {
    unit.remove_suffix(1);
  }
  int shift = 0;
  if (unit.empty()) {
    shift = 0;
  } else if (unit.size() == 1 && (unit[0] == 'k' || unit[0] == 'K')) {
    shift = 10;
  } else if (unit.size() == 1 && (unit[0] == 'm' || unit[0] == 'M')) {
    shift = 20;
  } else if (unit.size() == 1 && (unit[0] == 'g' || unit[0] == 'G')) {
    shift = 30;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown unit in memory units: \"", text, "\""));
  }
  if (number > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size out of range: \"", text, "\""));
  }
  return number << shift;
}

absl::StatusOr<TcpSegments> ReadTcpSegments(const Context& context) {
  absl::StatusOr<bool> tcp = UsesTcp(context);
  if (!tcp.ok()) return tcp.status();
  if (!*tcp) return TcpSegments{};
  uct_component_h* components = nullptr;
  unsigned count = 0;
  if (absl::Status s = UcxStatus(uct_query_components(&components, &count),
                                 "uct_query_components");
      !s.ok()) {
    return s;
  }
  ComponentList owned_components(components);
  for (unsigned i = 0; i < count; ++i) {
    uct_component_attr_t attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
    if (uct_component_query(components[i], &attr) != UCS_OK ||
        std::strcmp(attr.name, "tcp") != 0) {
      continue;
    }
    uct_md_config_t* md_config = nullptr;
    if (absl::Status s = UcxStatus(
            uct_md_config_read(components[i], nullptr, nullptr, &md_config),
            "uct_md_config_read tcp");
        !s.ok()) {
      return s;
    }
    MdConfig owned_md_config(md_config);
    uct_md_h md = nullptr;
    if (absl::Status s =
            UcxStatus(uct_md_open(components[i], "tcp", md_config, &md),
                      "uct_md_open tcp");
        !s.ok()) {
      return s;
    }
    Md owned_md(md);
    uct_iface_config_t* iface_config = nullptr;
    if (absl::Status s =
            UcxStatus(uct_md_iface_config_read(md, "tcp", nullptr, nullptr,
                                               &iface_config),
                      "uct_md_iface_config_read tcp");
        !s.ok()) {
      return s;
    }
    IfaceConfig owned_iface_config(iface_config);
    TcpSegments segments;
    absl::StatusOr<uint64_t> tx = ConfigBytes(iface_config, "TX_SEG_SIZE");
    if (!tx.ok()) return tx.status();
    absl::StatusOr<uint64_t> rx = ConfigBytes(iface_config, "RX_SEG_SIZE");
    if (!rx.ok()) return rx.status();
    segments.tx_bytes = *tx;
    segments.rx_bytes = *rx;
    return segments;
  }
  return absl::InternalError(
      "the context uses TCP but UCX lists no tcp component");
}

absl::Status CheckTcpSegments(const TcpSegments& local,
                              const TcpSegments& node) {
  if (!local.in_use() || !node.in_use()) return absl::OkStatus();
  if (local.largest_send() <= node.rx_bytes &&
      node.largest_send() <= local.rx_bytes) {
    return absl::OkStatus();
  }
  absl::Status refused = absl::UnavailableError(absl::StrCat(
      "UCX TCP segment sizes would abort a peer (UCX 1.13 asserts on a "
      "fragment larger than its receive segment): this process has "
      "UCX_TCP_TX_SEG_SIZE=",
      local.tx_bytes, " UCX_TCP_RX_SEG_SIZE=", local.rx_bytes, ", the node TX ",
      node.tx_bytes, " RX ", node.rx_bytes,
      "; set the same UCX_TCP_RX_SEG_SIZE (and a TX_SEG_SIZE no larger) on "
      "every node and client (docs/operations.md, \"UCX over TCP\")"));
  refused.SetPayload(kMismatchPayload, absl::Cord());
  return refused;
}

bool IsTcpSegmentsMismatch(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         status.GetPayload(kMismatchPayload).has_value();
}

}  // namespace kvcache::ucx
