#include "transport/status.h"

#include "absl/strings/str_cat.h"

namespace kvcache::ucx {

absl::Status UcxStatus(ucs_status_t status, absl::string_view what) {
  if (status == UCS_OK) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_CANCELED:
      return absl::CancelledError(message);
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      return absl::DeadlineExceededError(message);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_BUSY:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_SOME_CONNECTS_FAILED:
      return absl::UnavailableError(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
    case UCS_ERR_OUT_OF_RANGE:
      return absl::ResourceExhaustedError(message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_MESSAGE_TRUNCATED:
      return absl::InvalidArgumentError(message);
    case UCS_ERR_UNSUPPORTED:
      return absl::UnimplementedError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace kvcache::ucx
