// The server's log on stderr: one line per event, as text (the lines as they have
// always read) or as JSON objects, one a line, for a log collector. gRPC's and
// civetweb's own messages are routed here too (server/app/main.cc).
//
//   mha::log::Configure(mha::log::Format::kJson, /*verbosity=*/0);
//   mha::log::Info("model m: warm-up, 2 pass(es) in 30ms");
//     text: model m: warm-up, 2 pass(es) in 30ms
//     json: {"time":"2026-11-26T02:40:00.123456Z","level":"info","msg":"model m: ..."}
//   mha::log::Error("cannot listen on ...");       text: "error: cannot listen on ..."
//   mha::log::Verbose(1, "grpc", "...");           only with verbosity >= 1
//   mha::log::Access({{"front", "kserve_http"}, {"queue_us", int64_t{12}}});
//     text: access time=2026-...Z front=kserve_http queue_us=12
//     json: {"time":"...","level":"info","log":"access","front":"kserve_http","queue_us":12}
//
// Thread-safe: each line is written with one write(2).
#ifndef MHA_BASE_LOG_H_
#define MHA_BASE_LOG_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <variant>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha::log {

enum class Format { kText, kJson };
// "text" or "json"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<Format> ParseFormat(absl::string_view name);

void Configure(Format format, int verbosity);
Format format();
int verbosity();

void Info(absl::string_view message);
void Warning(absl::string_view message);  // text: "warning: ..."
void Error(absl::string_view message);    // text: "error: ..."
// A library's message ("grpc", "civetweb"), shown when verbosity() >= level.
// text: "grpc: message"; json adds "source".
void Verbose(int level, absl::string_view source, absl::string_view message);

using Value = std::variant<std::string, int64_t>;
using Field = std::pair<absl::string_view, Value>;
// One access-log line (time first); text values with a space or quote are quoted.
void Access(std::initializer_list<Field> fields);

// The JSON string literal of `text` (quotes included).
std::string JsonString(absl::string_view text);

}  // namespace mha::log

#endif  // MHA_BASE_LOG_H_
