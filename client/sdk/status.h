// Status helpers for the client: absl::Status inside, gRPC's status converted in
// exactly one place (FromGrpcStatus), the one-line form every error is printed in,
// and usage errors kept apart from the errors of calls and files.
//
//   return UsageError("--batch: must be >= 1, got 0");   // exit 2, "error: --batch: ..."
//   return absl::NotFoundError("GetModel: ...");         // exit 1, "error: NOT_FOUND: ..."
#ifndef MHA_CLIENT_SDK_STATUS_H_
#define MHA_CLIENT_SDK_STATUS_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/status_macros.h"

namespace mha::client {

// gRPC's codes and absl's are the same numbers; the message is kept as sent.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The canonical name, e.g. "INVALID_ARGUMENT" (as Prometheus labels and gRPC docs spell it).
std::string CodeName(grpc::StatusCode code);
// The code a canonical name spells ("RESOURCE_EXHAUSTED"), or nullopt.
std::optional<absl::StatusCode> CodeFromName(absl::string_view name);

// "INVALID_ARGUMENT: keys: expected shape (2, 6, 100), got (2, 6, 99)", on one line.
std::string OneLine(const absl::Status& status);

// A usage error: a flag's value, or flags that disagree, found by the client itself
// before or without a call. `message` starts with the flag it is about. An
// INVALID_ARGUMENT status marked as such (IsUsageError), so that it passes through
// MHA_RETURN_IF_ERROR like any other.
absl::Status UsageError(absl::string_view message);
bool IsUsageError(const absl::Status& status);

// What main prints for a failed verb: "error: MESSAGE" for a usage error, else
// "error: " + OneLine(status).
std::string ErrorLine(const absl::Status& status);
// The exit status for `status`: 0 OK, 2 a usage error, 1 any other error.
int ExitCode(const absl::Status& status);

// Usage errors naming `flag` (without its dashes): "--batch: must be >= 1, got 0".
absl::Status CheckAtLeast(absl::string_view flag, int64_t value, int64_t min);
absl::Status CheckPositive(absl::string_view flag, absl::Duration value);

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_STATUS_H_
