// Restricted API groups (Triton's --grpc-restricted-protocol / --http-restricted-api):
// a call of a restricted group must carry a header (HTTP) or metadata (gRPC) KEY
// whose value is the rule's secret, else it gets PERMISSION_DENIED (HTTP 403) and is
// counted in mha_restricted_refusals_total{group}. Every front asks the one submit
// path (RequestPath::Allow, server/serving/submit.h), which asks this.
//
//   --restricted_api="model-repository,shared-memory:admin-key=@/run/secrets/admin;
//                     inference:infer-key=$INFER_KEY"
//
// Rules are separated by ';', each "GROUP[,GROUP]:KEY=VALUE" (spaces around the parts
// are ignored). A VALUE of @FILE reads
// the secret from FILE (one trailing newline dropped), $ENV from that environment
// variable, so it need not appear in `ps`; anything else is the secret itself. A
// group may be named by one rule only. KEY is matched case-insensitively (HTTP header
// names are, gRPC metadata keys are lower case); gRPC also accepts
// triton-grpc-protocol-KEY, as Triton's clients send it. Groups:
//   inference         Attend, AttendStream, AttendSession, ModelInfer, ModelStreamInfer,
//                     POST .../infer
//   metadata          GetModel, ListModels, ServerMetadata, ModelMetadata, ModelConfig,
//                     GET /v2, /v2/models/{m}, .../config
//   health            ServerLive, ServerReady, ModelReady, /v2/health/*, .../ready
//                     (grpc.health.v1.Health is never restricted: Kubernetes probes
//                     it, and it tells no more than ServerReady)
//   statistics        ModelStatistics, .../stats
//   model-repository  RepositoryIndex, RepositoryModelLoad/Unload, /v2/repository/...
//   shared-memory     Triton's system shared memory calls (status, register, unregister)
//
// Thread safety: Allow is thread-safe; Parse and Create build it once at start.
#ifndef MHA_SERVER_SERVING_RESTRICTED_API_H_
#define MHA_SERVER_SERVING_RESTRICTED_API_H_

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha::server {

enum class ApiGroup {
  kInference = 0,
  kMetadata,
  kHealth,
  kStatistics,
  kModelRepository,
  kSharedMemory,
};
inline constexpr int kNumApiGroups = 6;
const char* ApiGroupName(ApiGroup group);  // "inference", ..., "model-repository"

// A call's header or metadata value by key (lower case), nullopt when absent.
using HeaderLookup = absl::FunctionRef<std::optional<std::string>(absl::string_view key)>;

class RestrictedApis {
 public:
  // The flag's value parsed, secrets read; INVALID_ARGUMENT starting
  // "restricted_api: " naming the rule and what is wrong. "" restricts nothing.
  // Refusals are counted in `registry` (nullptr: not counted).
  static absl::StatusOr<std::unique_ptr<RestrictedApis>> Create(absl::string_view spec,
                                                                prometheus::Registry* registry);

  bool restricted(ApiGroup group) const { return rules_[static_cast<int>(group)].has_value(); }

  // OK when `group` is not restricted or `header` gives its key (as is, or with
  // the `key_prefix` a transport also accepts) the rule's value; else
  // PERMISSION_DENIED naming the group and the key (never the value), counted.
  absl::Status Allow(ApiGroup group, HeaderLookup header, absl::string_view key_prefix = "") const;

 private:
  struct Rule {
    std::string key;  // lower case
    std::string value;
  };
  RestrictedApis() = default;
  std::array<std::optional<Rule>, kNumApiGroups> rules_;
  std::array<prometheus::Counter*, kNumApiGroups> refusals_{};
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_RESTRICTED_API_H_
