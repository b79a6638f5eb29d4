// The KServe v2 HTTP routes (and Triton's extensions) matched from a request path,
// without the transport: the front (http_front.h) answers what this names. Pure.
//
//   /v2                                         server metadata             GET
//   /v2/health/live, /v2/health/ready           health                      GET
//   /v2/models/stats                            every model's statistics    GET
//   /v2/models/{m}[/versions/{v}]               model metadata              GET
//       .../ready, .../config, .../stats        readiness, config, stats    GET
//       .../infer                               inference                   POST
//       .../trace/setting                       not served (501)            GET, POST
//   /v2/repository/index                        the repository's models     POST
//   /v2/repository/models/{m}/load | /unload    model control               POST
//   /v2/systemsharedmemory[/region/{r}]/status | /register | /unregister
//   /v2/cudasharedmemory[/region/{r}]/status | /register | /unregister
//   /v2/trace/setting, /v2/logging              not served (501)            GET, POST
// Segments are percent-decoded ("%20" in a model's name); a path that does not
// start with '/', an empty segment (a trailing or doubled slash) or a malformed
// escape matches nothing. Query strings are the caller's to strip.
#ifndef MHA_SERVER_KSERVE_HTTP_HTTP_ROUTES_H_
#define MHA_SERVER_KSERVE_HTTP_HTTP_ROUTES_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace mha::server {

enum class HttpRoute {
  kServer, kLive, kReady, kAllStats,
  kModel, kModelReady, kModelConfig, kModelStats, kInfer, kModelTrace,
  kIndex, kLoad, kUnload,
  kSharedMemoryStatus, kSharedMemoryRegister, kSharedMemoryUnregister,
  kCudaSharedMemory, kTrace, kLogging,
};

struct RouteMatch {
  HttpRoute route;
  std::string model, version, region;  // decoded; empty when the path has none
  std::vector<const char*> methods;    // the methods it serves ("GET", "POST")
};

std::optional<RouteMatch> MatchRoute(absl::string_view path);

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_HTTP_HTTP_ROUTES_H_
