// A gRPC call's deadline as the serving layer's absl::Time.
#ifndef MHA_SERVER_GRPC_COMMON_DEADLINE_H_
#define MHA_SERVER_GRPC_COMMON_DEADLINE_H_

#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"

namespace mha::server {

// The call's deadline; InfiniteFuture when it has none.
absl::Time DeadlineOf(const grpc::CallbackServerContext* context);

}  // namespace mha::server

#endif  // MHA_SERVER_GRPC_COMMON_DEADLINE_H_
