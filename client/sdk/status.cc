#include "client/sdk/status.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace mha::client {
namespace {

// The payload that marks a usage error (its value is unused).
constexpr char kUsagePayload[] = "mha.client/usage_error";

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

std::optional<absl::StatusCode> CodeFromName(absl::string_view name) {
  for (int code = 0; code <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++code) {
    if (absl::StatusCodeToString(static_cast<absl::StatusCode>(code)) == name) {
      return static_cast<absl::StatusCode>(code);
    }
  }
  return std::nullopt;
}

std::string OneLine(const absl::Status& status) {
  return absl::StrReplaceAll(
      absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()),
      {{"\r\n", " "}, {"\n", " "}});
}

absl::Status UsageError(absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kUsagePayload, absl::Cord());
  return status;
}

bool IsUsageError(const absl::Status& status) {
  return status.GetPayload(kUsagePayload).has_value();
}

std::string ErrorLine(const absl::Status& status) {
  return absl::StrCat("error: ", IsUsageError(status) ? status.message() : OneLine(status));
}

int ExitCode(const absl::Status& status) {
  if (status.ok()) return 0;
  return IsUsageError(status) ? 2 : 1;
}

absl::Status CheckAtLeast(absl::string_view flag, int64_t value, int64_t min) {
  if (value >= min) return absl::OkStatus();
  return UsageError(absl::StrCat("--", flag, ": must be >= ", min, ", got ", value));
}

absl::Status CheckPositive(absl::string_view flag, absl::Duration value) {
  if (value > absl::ZeroDuration()) return absl::OkStatus();
  return UsageError(absl::StrCat("--", flag, ": must be > 0, got ", absl::FormatDuration(value)));
}

}  // namespace mha::client
