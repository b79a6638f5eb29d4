// Status helpers for the client: absl::Status inside, gRPC's status converted in
// exactly one place (FromGrpcStatus), and the one-line form every error is printed in.
#ifndef MHA_CLIENT_STATUS_H_
#define MHA_CLIENT_STATUS_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"

namespace mha::client {

// gRPC's codes and absl's are the same numbers; the message is kept as sent.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The canonical name, e.g. "INVALID_ARGUMENT" (as Prometheus labels and gRPC docs spell it).
std::string CodeName(grpc::StatusCode code);

// "INVALID_ARGUMENT: keys: expected shape (2, 6, 100), got (2, 6, 99)", on one line.
std::string OneLine(const absl::Status& status);

}  // namespace mha::client

#endif  // MHA_CLIENT_STATUS_H_
