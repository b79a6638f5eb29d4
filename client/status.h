// Status helpers for the client: absl::Status inside, gRPC's status converted in
// exactly one place (FromGrpcStatus), and the one-line form every error is printed in.
#ifndef MHA_CLIENT_STATUS_H_
#define MHA_CLIENT_STATUS_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mha::client {

// gRPC's codes and absl's are the same numbers; the message is kept as sent.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The canonical name, e.g. "INVALID_ARGUMENT" (as Prometheus labels and gRPC docs spell it).
std::string CodeName(grpc::StatusCode code);

// "INVALID_ARGUMENT: keys: expected shape (2, 6, 100), got (2, 6, 99)", on one line.
std::string OneLine(const absl::Status& status);

}  // namespace mha::client

// Abseil 20220623 has neither macro; the client keeps its own copy (it does not
// depend on core/).
#define MHA_CLIENT_RETURN_IF_ERROR(expr)       \
  do {                                         \
    const ::absl::Status mha_status_ = (expr); \
    if (!mha_status_.ok()) return mha_status_; \
  } while (false)

#define MHA_CLIENT_CONCAT_INNER_(a, b) a##b
#define MHA_CLIENT_CONCAT_(a, b) MHA_CLIENT_CONCAT_INNER_(a, b)

// MHA_CLIENT_ASSIGN_OR_RETURN(auto x, MakeX());
#define MHA_CLIENT_ASSIGN_OR_RETURN(lhs, expr) \
  MHA_CLIENT_ASSIGN_OR_RETURN_IMPL_(MHA_CLIENT_CONCAT_(mha_client_statusor_, __LINE__), lhs, expr)
#define MHA_CLIENT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                      \
  if (!statusor.ok()) return std::move(statusor).status();     \
  lhs = *std::move(statusor)

#endif  // MHA_CLIENT_STATUS_H_
