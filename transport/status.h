// The one place where a UCX status becomes an absl::Status.
//
// Every UCX call in service/ucx/ and client/ucx/ reports failure through
// UcxStatus(); nothing else inspects ucs_status_t codes to pick an
// absl::StatusCode.
#ifndef KVCACHE_TRANSPORT_STATUS_H_
#define KVCACHE_TRANSPORT_STATUS_H_

#include <ucs/type/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcache::ucx {

// OK for UCS_OK; otherwise an error whose message is "<what>: <ucs string>".
// Peer failures, unreachable peers, cancellations and timeouts map to
// UNAVAILABLE / CANCELLED / DEADLINE_EXCEEDED, exhausted resources to
// RESOURCE_EXHAUSTED, bad parameters to INVALID_ARGUMENT, anything else to
// INTERNAL.
absl::Status UcxStatus(ucs_status_t status, absl::string_view what);

}  // namespace kvcache::ucx

#endif  // KVCACHE_TRANSPORT_STATUS_H_
