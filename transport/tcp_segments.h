// The TCP segment sizes of a UCX context, and whether two peers' sizes let
// them talk over UCX without one aborting the other.
//
// Why: UCX 1.13's TCP transport asserts (tcp_ep.c, `hdr->length <=
// rx_seg_size`) and aborts the process that receives a fragment larger than
// its own receive segment (UCX_TCP_RX_SEG_SIZE). A sender's fragments are
// up to its send segment (UCX_TCP_TX_SEG_SIZE, copied sends) or up to its
// *own* receive segment (zero-copy sends: UCX assumes the peer has the same
// one). So one process with a larger UCX_TCP_RX_SEG_SIZE than its peer kills
// the peer on its first large transfer, in either direction (measured:
// docs/operations.md, "UCX over TCP").
//
// Contract: nodes advertise their sizes in DataPlaneInfo; a client compares
// them with its own before it opens a UCX connection to a node, and uses the
// gRPC data path (or fails with UNAVAILABLE, when it requires UCX) where a
// peer would abort. This protects our nodes and clients from each other's
// configuration; it does not protect a node from a client that lies.
#ifndef KVCACHE_TRANSPORT_TCP_SEGMENTS_H_
#define KVCACHE_TRANSPORT_TCP_SEGMENTS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/handles.h"

namespace kvcache::ucx {

// Zero sizes: no TCP transport in use (or a peer that does not say).
struct TcpSegments {
  uint64_t tx_bytes = 0;  // UCX_TCP_TX_SEG_SIZE
  uint64_t rx_bytes = 0;  // UCX_TCP_RX_SEG_SIZE
  bool in_use() const { return rx_bytes != 0; }
  // The largest fragment this side sends over TCP.
  uint64_t largest_send() const {
    return tx_bytes > rx_bytes ? tx_bytes : rx_bytes;
  }
};

// The sizes `context` runs with: zero when none of its transport resources
// is TCP (UCX_TLS without tcp). Read the way UCX reads them (environment and
// UCX's configuration file), so a setting made only through
// ucp_config_modify would not be seen; Context::Create makes none.
absl::StatusOr<TcpSegments> ReadTcpSegments(const Context& context);

// UCX's memory-units text ("64K", "1M", "65536", "inf") in bytes; "inf" is
// UINT64_MAX. INVALID_ARGUMENT for anything else.
absl::StatusOr<uint64_t> ParseMemoryUnits(absl::string_view text);

// OK when each side's largest fragment fits the other's receive segment, or
// either side does not use TCP. Otherwise UNAVAILABLE, naming both sizes and
// the fix, that IsTcpSegmentsMismatch() recognizes; `local` is this
// process, `node` the node it would connect to.
absl::Status CheckTcpSegments(const TcpSegments& local,
                              const TcpSegments& node);

// Whether `status` is CheckTcpSegments' refusal (it carries a payload that
// survives being passed on, where its text may be prefixed).
bool IsTcpSegmentsMismatch(const absl::Status& status);

}  // namespace kvcache::ucx

#endif  // KVCACHE_TRANSPORT_TCP_SEGMENTS_H_
