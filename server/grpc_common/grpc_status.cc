#include "server/grpc_common/grpc_status.h"

#include <string>

#include "server/serving/abbreviate.h"

namespace mha::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), CapMessage(status.message()));
}

}  // namespace mha::server
