// libFuzzer target (h): the HTTP/1.1 responses attention_client's plain transport reads
// (client/sdk/http1_response.h), as a hostile or broken server could send them. Input:
// byte 0 picks the split (pieces of 1 + byte0 % 64) and bit 7 of byte 1 a HEAD request;
// the rest is what the server sends, ending in its close. Checks: the same bytes give
// the same outcome (status, body, keep-alive, error) fed whole and in pieces; each
// call consumes only what it was given; the head and body stay within their limits;
// an error is INTERNAL, says what, and never keeps the connection.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "client/sdk/http1_response.h"

namespace {

using mha::client::http1::ResponseLimits;
using mha::client::http1::ResponseParser;

constexpr ResponseLimits kLimits = {.max_head_bytes = 512, .max_body_bytes = 1024};

void Check(bool ok) {
  if (!ok) std::abort();
}

// The outcome of `data` fed in pieces of `piece` bytes, then the close.
std::string Read(absl::string_view data, size_t piece, bool head_request) {
  ResponseParser parser(kLimits);
  parser.Reset(head_request);
  size_t offset = 0;
  ResponseParser::Event event = ResponseParser::Event::kNeedMore;
  while (offset < data.size() && event == ResponseParser::Event::kNeedMore) {
    const absl::string_view chunk = data.substr(offset, piece);
    size_t used = 0;
    event = parser.Feed(chunk, &used);
    Check(used <= chunk.size());
    Check(event != ResponseParser::Event::kNeedMore || used == chunk.size());
    offset += used;
    Check(static_cast<int64_t>(parser.body().size()) <= kLimits.max_body_bytes);
  }
  if (event == ResponseParser::Event::kNeedMore) event = parser.Finish();
  if (event == ResponseParser::Event::kError) {
    Check(parser.error().code() == absl::StatusCode::kInternal);
    Check(!parser.error().message().empty());
    Check(!parser.keep_alive());
    return absl::StrCat("error ", parser.error().message());
  }
  Check(event == ResponseParser::Event::kDone);
  Check(parser.status() >= 200 && parser.status() <= 999);
  return absl::StrCat(parser.status(), " ", parser.keep_alive(), " ", offset, " ", parser.body());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 2) return 0;
  const size_t piece = 1 + bytes[0] % 64;
  const bool head_request = (bytes[1] & 0x80) != 0;
  const absl::string_view data(reinterpret_cast<const char*>(bytes + 2), size - 2);
  Check(Read(data, data.size() + 1, head_request) == Read(data, piece, head_request));
  return 0;
}
