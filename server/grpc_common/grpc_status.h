// The one place where absl::Status becomes grpc::Status (TF Serving's ToGRPCStatus).
#ifndef MHA_SERVER_GRPC_COMMON_GRPC_STATUS_H_
#define MHA_SERVER_GRPC_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace mha::server {

// Same canonical code, same message (abbreviated past kMaxStatusMessageBytes, see
// server/serving/abbreviate.h). Codes absl has that gRPC lacks do not exist (both use the
// canonical google.rpc.Code space), so the mapping is exact.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace mha::server

#endif  // MHA_SERVER_GRPC_COMMON_GRPC_STATUS_H_
