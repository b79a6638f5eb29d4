#include "server/grpc_common/restricted.h"

#include <optional>
#include <string>

namespace mha::server {

absl::Status AllowGrpc(const RequestPath& path, ApiGroup group,
                       const grpc::CallbackServerContext* context) {
  return path.Allow(
      group,
      [context](absl::string_view key) -> std::optional<std::string> {
        const auto& metadata = context->client_metadata();
        const auto found = metadata.find(grpc::string_ref(key.data(), key.size()));
        if (found == metadata.end()) return std::nullopt;
        return std::string(found->second.data(), found->second.size());
      },
      kTritonKeyPrefix);
}

}  // namespace mha::server
