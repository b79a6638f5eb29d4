// An HTTP/1.1 response parser for the client's plain-TCP transport (client/sdk/http.h):
// status line, header fields, and the body framed as RFC 9112 §6.3 says (no body for
// a HEAD request, 1xx, 204 and 304; chunked when Transfer-Encoding ends in chunked;
// Content-Length; otherwise until the server closes). Interim 1xx responses are
// skipped. Bounded: the head and each chunk line by limits.max_head_bytes, the body
// (however framed) by limits.max_body_bytes; past either the parse fails.
//
//   ResponseParser parser;
//   size_t used = 0;
//   switch (parser.Feed(bytes, &used)) { kNeedMore: read more; kDone: parser.status(),
//                                         parser.body(); kError: parser.error() }
//   // The server closed: parser.Finish() completes a body that runs to the close.
#ifndef MHA_CLIENT_SDK_HTTP1_RESPONSE_H_
#define MHA_CLIENT_SDK_HTTP1_RESPONSE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mha::client::http1 {

struct ResponseLimits {
  size_t max_head_bytes = 64 * 1024;
  int64_t max_body_bytes = int64_t{1} << 31;
};

class ResponseParser {
 public:
  enum class Event { kNeedMore, kDone, kError };

  explicit ResponseParser(ResponseLimits limits = {}) : limits_(limits) {}

  // Starts a new response; `head_request`: the request was HEAD (never a body).
  void Reset(bool head_request = false);

  // Parses from `data`; *consumed says how many bytes it used. kDone: the response is
  // complete (bytes after it are not this response's). kError: error() says why.
  Event Feed(absl::string_view data, size_t* consumed);
  // The peer closed the connection: kDone if the body runs to the close, else kError.
  Event Finish();

  int status() const { return status_; }
  // The first field named `name` (case-insensitive), its value trimmed.
  std::optional<absl::string_view> Find(absl::string_view name) const;
  // Whether the connection can carry the next request.
  bool keep_alive() const { return keep_alive_; }
  std::string& body() { return body_; }
  const absl::Status& error() const { return error_; }

 private:
  enum class State {
    kHead,
    kLength,
    kChunkLine,
    kChunkData,
    kChunkEnd,
    kTrailers,
    kToClose,
    kDone,
    kError
  };

  Event Fail(std::string message);
  // Parses the head in head_ (status line through the empty line).
  bool ParseHead();
  // Feed in one state, from data[*pos] on (advancing *pos): the event to return, or
  // nothing to go on in the state it leaves.
  std::optional<Event> FeedHead(absl::string_view data, size_t* pos);
  std::optional<Event> FeedChunkLine(absl::string_view data, size_t* pos);
  std::optional<Event> FeedTrailers(absl::string_view data, size_t* pos);
  // After a final response's head: how its body is framed (the next state), or the
  // error of a framing this parser refuses.
  std::optional<Event> StartBody();
  // Appends up to `limit` bytes of `data` at `pos` to the body.
  size_t TakeBody(absl::string_view data, size_t pos, int64_t limit);
  // Up to remaining_ bytes of data into the body; true when none remain.
  bool TakeRemaining(absl::string_view data, size_t* pos);
  // Takes a line (CRLF or LF) into line_; false when the line is not complete yet.
  bool TakeLine(absl::string_view data, size_t* pos);

  ResponseLimits limits_;
  State state_ = State::kHead;
  bool head_request_ = false;
  std::string head_;
  std::string line_;
  size_t trailer_bytes_ = 0;
  int status_ = 0;
  bool keep_alive_ = false;
  std::vector<std::pair<std::string, std::string>> fields_;
  int64_t remaining_ = 0;
  std::string body_;
  absl::Status error_;
};

}  // namespace mha::client::http1

#endif  // MHA_CLIENT_SDK_HTTP1_RESPONSE_H_
