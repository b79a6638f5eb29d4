// libFuzzer target (g): HTTP/1.1 request framing (server/kserve_http/http1.h) and
// the route table (http_routes.h), as the event-driven front feeds them. Input:
// byte 0 picks the split (the bytes arrive in pieces of 1 + byte0 % 64), the rest is
// what a client sends on one connection (pipelined requests included). Checks: the
// same bytes give the same requests and refusal fed whole and in pieces; each event
// consumes only what it was given; a body never exceeds the body limit, a head never
// the head limit; a refusal is a 4xx/5xx with a message; every accepted target's path
// matches a route or none without crashing, and a matched route names its methods.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "server/kserve_http/http1.h"
#include "server/kserve_http/http_routes.h"

namespace {

using mha::server::http1::Limits;
using mha::server::http1::RequestParser;

constexpr Limits kLimits = {.max_head_bytes = 512, .max_headers = 16, .max_body_bytes = 1024};

void Check(bool ok) {
  if (!ok) std::abort();
}

// The requests (method, target, body) and the final refusal status (0: none) of
// `data` fed in pieces of `piece` bytes.
std::vector<std::string> Frame(absl::string_view data, size_t piece) {
  std::vector<std::string> out;
  RequestParser parser(kLimits);
  size_t offset = 0;
  while (true) {
    const absl::string_view chunk = data.substr(offset, piece);
    size_t used = 0;
    const RequestParser::Event event = parser.Feed(chunk, &used);
    Check(used <= chunk.size());
    offset += used;
    switch (event) {
      case RequestParser::Event::kNeedMore:
        Check(used == chunk.size());
        if (offset >= data.size()) return out;
        break;
      case RequestParser::Event::kHead:
        Check(parser.head_done());
        break;
      case RequestParser::Event::kRequest: {
        const auto& head = parser.head();
        Check(static_cast<int64_t>(parser.body().size()) <= kLimits.max_body_bytes);
        Check(static_cast<int64_t>(head.headers.size()) <= kLimits.max_headers);
        Check(!head.chunked || head.content_length == 0);
        const std::string path = head.target.substr(0, head.target.find('?'));
        if (auto match = mha::server::MatchRoute(path)) Check(!match->methods.empty());
        out.push_back(head.method + " " + head.target + " " + parser.body());
        parser.Next();
        break;
      }
      case RequestParser::Event::kRefused:
        Check(parser.refusal().status >= 400 && parser.refusal().status < 600);
        Check(!parser.refusal().message.empty());
        out.push_back("refused " + std::to_string(parser.refusal().status));
        return out;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 1) return 0;
  const size_t piece = 1 + bytes[0] % 64;
  const absl::string_view data(reinterpret_cast<const char*>(bytes + 1), size - 1);
  Check(Frame(data, data.size() + 1) == Frame(data, piece));
  mha::server::MatchRoute(data.substr(0, 256));
  return 0;
}
