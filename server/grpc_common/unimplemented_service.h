// Answers every gRPC method no registered service declares (Triton's CUDA shared
// memory, trace and log settings RPCs, or a typo) with UNIMPLEMENTED and a message
// naming the method, where gRPC itself would answer with an empty message:
//
//   /inference.GRPCInferenceService/CudaSharedMemoryRegister -> UNIMPLEMENTED
//   "inference.GRPCInferenceService/CudaSharedMemoryRegister is not served by
//    mha-serve: no CUDA shared-memory extension (a CPU server); send tensors in the
//    request"
// The KServe service answers its SystemSharedMemory* RPCs with the same message
// when the extension is off (--shared_memory=none).
//
// Registered with ServerBuilder::RegisterCallbackGenericService; registered services
// (and gRPC's health and reflection services) keep their methods.
//
// Thread safety: stateless; gRPC calls it from any thread.
#ifndef MHA_SERVER_GRPC_COMMON_UNIMPLEMENTED_SERVICE_H_
#define MHA_SERVER_GRPC_COMMON_UNIMPLEMENTED_SERVICE_H_

#include <grpcpp/generic/async_generic_service.h>

#include <string>

#include "absl/strings/string_view.h"

namespace mha::server {

// The message answering `method` ("/package.Service/Method").
std::string UnimplementedMessage(absl::string_view method);

class UnimplementedService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;
};

}  // namespace mha::server

#endif  // MHA_SERVER_GRPC_COMMON_UNIMPLEMENTED_SERVICE_H_
