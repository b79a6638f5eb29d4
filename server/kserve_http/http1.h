// HTTP/1.1 request framing (RFC 9112) for the event-driven HTTP front: where a
// request's head ends, what its body is, and which requests are refused before
// their body is read. Pure and incremental: the transport feeds it the bytes as
// they arrive (any split), and it never holds more than the limits allow.
//
// Rules, each refusal answered with its status and then the connection closed:
//   - empty lines before a request line are skipped (RFC 9112 §2.2);
//   - request line: token SP origin-form-or-"*" SP "HTTP/1.1" or "HTTP/1.0"; else
//     400 (505 for another version); lines end with CRLF or a bare LF;
//   - header lines: token ":" OWS value OWS; whitespace before the colon, a folded
//     line or a control character in a value: 400;
//   - head (request line and header lines, or a chunked body's trailer lines) over
//     Limits::max_head_bytes, or more than Limits::max_headers lines: 431;
//   - HTTP/1.1 without exactly one Host: 400;
//   - Transfer-Encoding: only "chunked" (400 for anything else), never with
//     Content-Length (400), never in HTTP/1.0 (400) (§6.1);
//   - Content-Length: digits, every value (repeated headers, comma lists) the same,
//     else 400 (§6.3); over Limits::max_body_bytes: 413 at once, before any body
//     byte is read (with or without Expect: 100-continue);
//   - no Content-Length and no Transfer-Encoding: the body is empty (§6.3), for
//     every method;
//   - chunked: hex sizes (16 digits at most), extensions skipped, the sum of the
//     chunks over max_body_bytes is 413 as soon as a size line says so;
//   - Expect: "100-continue" is reported (RequestHead::expect_continue; the
//     transport answers 100 after the head passed these checks); any other
//     expectation: 417.
// Pipelined requests: Feed stops at the end of each request; the bytes after it are
// the next request's, never this one's body.
//
// Thread safety: one parser per connection, used by one thread at a time.
#ifndef MHA_SERVER_KSERVE_HTTP_HTTP1_H_
#define MHA_SERVER_KSERVE_HTTP_HTTP1_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace mha::server::http1 {

struct Limits {
  int64_t max_head_bytes = int64_t{64} << 10;  // request line + headers, and trailers
  int64_t max_headers = 256;                   // header lines, and trailer lines
  int64_t max_body_bytes = int64_t{64} << 20;  // as framed (Content-Length or chunks)
};

using Headers = std::vector<std::pair<std::string, std::string>>;  // in order, names as sent

// The first header of that name (case-insensitive), or nullopt.
std::optional<absl::string_view> FindHeader(const Headers& headers, absl::string_view name);

struct RequestHead {
  std::string method;  // as sent (methods are case-sensitive)
  std::string target;  // "/path?query" or "*"
  int minor_version = 1;
  Headers headers;
  bool keep_alive = true;        // HTTP/1.1 unless "Connection: close"; 1.0 only with keep-alive
  bool expect_continue = false;  // "Expect: 100-continue"
  bool chunked = false;
  int64_t content_length = 0;  // when not chunked

  std::optional<absl::string_view> Find(absl::string_view name) const {
    return FindHeader(headers, name);
  }
};

// A refusal: the status to answer and a message for {"error": ...}.
struct Refusal {
  int status = 400;
  std::string message;
};

class RequestParser {
 public:
  enum class Event {
    kNeedMore,  // every byte given was consumed; feed more
    kHead,      // the head is complete and accepted: head() is set; feed the body next
    kRequest,   // the request is complete: head() and body() are set
    kRefused,   // refusal() is set: answer it and close the connection
  };

  explicit RequestParser(const Limits& limits) : limits_(limits) {}

  // Consumes a prefix of `data` (its length in *consumed), up to the next event.
  // After kRequest, call Next() before feeding the following request's bytes.
  Event Feed(absl::string_view data, size_t* consumed);

  // Starts the next request on the same connection.
  void Next();

  // Whether any byte of the current request has been seen (the header deadline runs
  // from the first one), and whether its head is complete.
  bool started() const { return started_; }
  bool head_done() const { return state_ != State::kHead && state_ != State::kSkipEmpty; }

  // Content-Length body bytes still to come (0 outside such a body). A caller that
  // can read them straight from its socket does so into ReserveBody's space and
  // gives back what it did not fill with CommitBody, instead of feeding a copy:
  //   char* at = parser.ReserveBody(n);  got = recv(fd, at, n, ...);
  //   parser.CommitBody(n, got > 0 ? got : 0);   // then Feed({}) reports kRequest
  int64_t body_remaining() const { return state_ == State::kBody ? remaining_ : 0; }
  // Space for `n` <= body_remaining() more body bytes (valid until the next call).
  char* ReserveBody(size_t n);
  // `used` of the `reserved` bytes were written.
  void CommitBody(size_t reserved, size_t used);

  const RequestHead& head() const { return head_; }
  std::string& body() { return body_; }
  const Refusal& refusal() const { return refusal_; }

 private:
  enum class State {
    kSkipEmpty,
    kHead,
    kBody,
    kChunkSize,
    kChunkData,
    kChunkDataEnd,
    kTrailer,
    kDone,
    kRefused
  };

  Event Refuse(int status, std::string message);
  // The head's text (without its final empty line) parsed into head_: the request
  // line, the field lines, then what they say of the connection and the body's
  // framing. Each part returns its refusal, or nothing when it accepts.
  Event ParseHead();
  std::optional<Event> ParseRequestLine(absl::string_view line);
  std::optional<Event> ParseFields(absl::Span<const absl::string_view> lines);
  std::optional<Event> ParseFraming();
  std::optional<Event> ParseContentLength();
  // Feed in one state, from data[*pos] on (advancing *pos): the event to return, or
  // nothing to go on in the state it leaves.
  std::optional<Event> FeedHead(absl::string_view data, size_t* pos);
  std::optional<Event> FeedChunkSize(absl::string_view data, size_t* pos);
  std::optional<Event> FeedChunkDataEnd(absl::string_view data, size_t* pos);
  std::optional<Event> FeedTrailer(absl::string_view data, size_t* pos);
  // Up to remaining_ bytes of data into body_; true when none remain.
  bool TakeBody(absl::string_view data, size_t* pos);
  // A line from `data` into line_ (which keeps partial lines across calls, at most
  // budget + 1 bytes of them); true when a whole line (without its LF/CRLF) is in
  // line_. *over: the line's bytes so far, its CR included, exceed `budget`; the same
  // whether the line arrived in one read or in many.
  bool TakeLine(absl::string_view data, size_t* pos, int64_t budget, bool* over = nullptr);

  Limits limits_;
  State state_ = State::kSkipEmpty;
  bool started_ = false;
  std::string head_text_;  // the head so far
  size_t scanned_ = 0;     // head_text_ bytes searched for the empty line
  std::string line_;       // a chunk-size or trailer line so far
  int64_t trailer_bytes_ = 0, trailer_lines_ = 0;
  int64_t remaining_ = 0;  // body or chunk bytes still to read
  RequestHead head_;
  std::string body_;
  Refusal refusal_;
};

}  // namespace mha::server::http1

#endif  // MHA_SERVER_KSERVE_HTTP_HTTP1_H_
