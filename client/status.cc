#include "client/status.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace mha::client {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

std::string OneLine(const absl::Status& status) {
  return absl::StrReplaceAll(
      absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()),
      {{"\r\n", " "}, {"\n", " "}});
}

}  // namespace mha::client
