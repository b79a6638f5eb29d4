#include "server/grpc_common/unimplemented_service.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/serving/abbreviate.h"

namespace mha::server {

std::string UnimplementedMessage(absl::string_view method) {
  absl::string_view name = method;
  absl::ConsumePrefix(&name, "/");
  absl::string_view why = "see docs/service.md for the RPCs it serves";
  if (absl::StartsWith(name, "inference.GRPCInferenceService/")) {
    const absl::string_view rpc = name.substr(name.find('/') + 1);
    if (absl::StartsWith(rpc, "SystemSharedMemory")) {
      why =
          "system shared memory is off (attention_server --shared_memory=system serves it); "
          "send tensors in the request";
    } else if (absl::StartsWith(rpc, "CudaSharedMemory")) {
      why = "no CUDA shared-memory extension (a CPU server); send tensors in the request";
    } else if (rpc == "TraceSetting") {
      why = "no trace extension; /metrics and ModelStatistics report timings";
    } else if (rpc == "LogSettings") {
      why = "no logging extension; logging is set by flags at start";
    }
  }
  return absl::StrCat(Abbreviate(name, 2 * kMaxQuotedBytes), " is not served by mha-serve: ", why);
}

grpc::ServerGenericBidiReactor* UnimplementedService::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  class Reactor final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Reactor(const std::string& message) {
      Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, message));
    }
    void OnDone() override { delete this; }
  };
  return new Reactor(UnimplementedMessage(context->method()));
}

}  // namespace mha::server
