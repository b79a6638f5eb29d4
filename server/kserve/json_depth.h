// The guard both KServe JSON readers (the HTTP infer and repository bodies,
// server/kserve_http/http_codec.h; the shared-memory register body,
// shared_memory_answers.h) run before parsing: nlohmann's parser recurses as deep
// as the text nests, so nesting is bounded first. Pure; call from any thread.
#ifndef MHA_SERVER_KSERVE_JSON_DEPTH_H_
#define MHA_SERVER_KSERVE_JSON_DEPTH_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mha::server {

inline constexpr int kMaxJsonDepth = 32;

// INVALID_ARGUMENT "JSON nesting deeper than 32" when arrays and objects opened and
// not yet closed (outside strings) ever number more than kMaxJsonDepth; else OK.
absl::Status CheckJsonDepth(absl::string_view text);

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_JSON_DEPTH_H_
