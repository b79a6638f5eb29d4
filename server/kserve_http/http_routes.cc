#include "server/kserve_http/http_routes.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"

namespace mha::server {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  c = absl::ascii_tolower(c);
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

std::optional<std::string> Decode(absl::string_view segment) {
  std::string out;
  out.reserve(segment.size());
  for (size_t i = 0; i < segment.size(); ++i) {
    if (segment[i] != '%') {
      out.push_back(segment[i]);
      continue;
    }
    if (i + 2 >= segment.size()) return std::nullopt;
    const int hi = HexValue(segment[i + 1]), lo = HexValue(segment[i + 2]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return out;
}

const std::vector<const char*> kGet = {"GET"};
const std::vector<const char*> kPost = {"POST"};
const std::vector<const char*> kBoth = {"GET", "POST"};

// /v2/{system,cuda}sharedmemory[/region/{r}]/{status,register,unregister}, from
// the segment after "v2".
std::optional<RouteMatch> SharedMemory(const std::vector<std::string>& s) {
  const bool system = s[1] == "systemsharedmemory";
  RouteMatch m{.route = HttpRoute::kCudaSharedMemory, .methods = kBoth};
  size_t op = 2;
  if (s.size() == 5 && s[2] == "region") {
    m.region = s[3];
    op = 4;
  } else if (s.size() != 3) {
    return std::nullopt;
  }
  if (s[op] != "status" && s[op] != "register" && s[op] != "unregister") return std::nullopt;
  if (!system) return m;
  if (s[op] == "status") return RouteMatch{.route = HttpRoute::kSharedMemoryStatus,
                                           .region = m.region, .methods = kGet};
  if (s[op] == "unregister") return RouteMatch{.route = HttpRoute::kSharedMemoryUnregister,
                                               .region = m.region, .methods = kPost};
  if (m.region.empty()) return std::nullopt;  // register names its region
  return RouteMatch{.route = HttpRoute::kSharedMemoryRegister, .region = m.region,
                    .methods = kPost};
}

}  // namespace

std::optional<RouteMatch> MatchRoute(absl::string_view path) {
  if (path.empty() || path.front() != '/') return std::nullopt;
  std::vector<std::string> s;
  for (absl::string_view raw : absl::StrSplit(path.substr(1), '/')) {
    std::optional<std::string> segment = Decode(raw);
    if (!segment || segment->empty()) return std::nullopt;
    s.push_back(*std::move(segment));
  }
  if (s.empty() || s[0] != "v2") return std::nullopt;
  const size_t n = s.size();
  if (n == 1) return RouteMatch{.route = HttpRoute::kServer, .methods = kGet};
  if (s[1] == "health" && n == 3) {
    if (s[2] == "live") return RouteMatch{.route = HttpRoute::kLive, .methods = kGet};
    if (s[2] == "ready") return RouteMatch{.route = HttpRoute::kReady, .methods = kGet};
    return std::nullopt;
  }
  if (s[1] == "systemsharedmemory" || s[1] == "cudasharedmemory") return SharedMemory(s);
  if (s[1] == "trace" && n == 3 && s[2] == "setting") {
    return RouteMatch{.route = HttpRoute::kTrace, .methods = kBoth};
  }
  if (s[1] == "logging" && n == 2) return RouteMatch{.route = HttpRoute::kLogging, .methods = kBoth};
  if (s[1] == "repository") {
    if (n == 3 && s[2] == "index") return RouteMatch{.route = HttpRoute::kIndex, .methods = kPost};
    if (n == 5 && s[2] == "models" && (s[4] == "load" || s[4] == "unload")) {
      return RouteMatch{.route = s[4] == "load" ? HttpRoute::kLoad : HttpRoute::kUnload,
                        .model = s[3], .methods = kPost};
    }
    return std::nullopt;
  }
  if (s[1] != "models" || n < 3) return std::nullopt;
  // Before {m}, which would take "stats" for a model's name (as in Triton).
  if (n == 3 && s[2] == "stats") return RouteMatch{.route = HttpRoute::kAllStats, .methods = kGet};
  RouteMatch m{.route = HttpRoute::kModel, .model = s[2], .methods = kGet};
  size_t rest = 3;
  if (n >= 5 && s[3] == "versions") {
    m.version = s[4];
    rest = 5;
  }
  const size_t tail = n - rest;
  if (tail == 0) return m;
  if (tail == 2 && s[rest] == "trace" && s[rest + 1] == "setting") {
    m.route = HttpRoute::kModelTrace;
    m.methods = kBoth;
    return m;
  }
  if (tail != 1) return std::nullopt;
  const std::string& op = s[rest];
  if (op == "ready") {
    m.route = HttpRoute::kModelReady;
  } else if (op == "config") {
    m.route = HttpRoute::kModelConfig;
  } else if (op == "stats") {
    m.route = HttpRoute::kModelStats;
  } else if (op == "infer") {
    m.route = HttpRoute::kInfer;
    m.methods = kPost;
  } else {
    return std::nullopt;
  }
  return m;
}

}  // namespace mha::server
