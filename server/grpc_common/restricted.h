// The restricted API check (server/serving/restricted_api.h) for a gRPC call: its
// metadata key KEY, or triton-grpc-protocol-KEY, as Triton's clients send it.
//
//   if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kHealth, context); !allowed.ok())
//     return Reply(context, allowed);
//   ... a bidi stream: return new RefusedStream<Request, Response>(allowed);
#ifndef MHA_SERVER_GRPC_COMMON_RESTRICTED_H_
#define MHA_SERVER_GRPC_COMMON_RESTRICTED_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "server/grpc_common/grpc_status.h"
#include "server/serving/restricted_api.h"
#include "server/serving/submit.h"

namespace mha::server {

inline constexpr char kTritonKeyPrefix[] = "triton-grpc-protocol-";

absl::Status AllowGrpc(const RequestPath& path, ApiGroup group,
                       const grpc::CallbackServerContext* context);

// A bidi stream refused before its first read: ends with `status` and deletes itself.
template <class Request, class Response>
class RefusedStream final : public grpc::ServerBidiReactor<Request, Response> {
 public:
  explicit RefusedStream(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace mha::server

#endif  // MHA_SERVER_GRPC_COMMON_RESTRICTED_H_
