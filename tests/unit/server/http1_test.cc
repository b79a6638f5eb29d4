// HTTP/1.1 request framing (server/kserve_http/http1.h) and the route table
// (http_routes.h), without sockets: what a request's bytes frame into, whatever
// their split, and what a path routes to. The raw-socket behaviour of the same
// rules is tests/integration/http_framing_test.py.
#include "server/kserve_http/http1.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "server/kserve_http/http_routes.h"

namespace mha::server {
namespace {

using http1::Limits;
using http1::RequestParser;

// Every request ("METHOD target body") and the refusal ("refused STATUS") of `data`
// fed in pieces of `piece` bytes.
std::vector<std::string> Frame(const std::string& data, size_t piece, const Limits& limits = {}) {
  std::vector<std::string> out;
  RequestParser parser(limits);
  size_t offset = 0;
  while (true) {
    const absl::string_view chunk = absl::string_view(data).substr(offset, piece);
    size_t used = 0;
    const RequestParser::Event event = parser.Feed(chunk, &used);
    offset += used;
    if (event == RequestParser::Event::kNeedMore && offset >= data.size()) return out;
    if (event == RequestParser::Event::kRequest) {
      out.push_back(parser.head().method + " " + parser.head().target + " " + parser.body());
      parser.Next();
    } else if (event == RequestParser::Event::kRefused) {
      out.push_back("refused " + std::to_string(parser.refusal().status));
      return out;
    }
  }
}

// Frames `data` whole and byte by byte, expects both to agree, returns the result.
std::vector<std::string> FrameAnySplit(const std::string& data, const Limits& limits = {}) {
  std::vector<std::string> whole = Frame(data, data.size() + 1, limits);
  EXPECT_EQ(whole, Frame(data, 1, limits)) << data;
  EXPECT_EQ(whole, Frame(data, 7, limits)) << data;
  return whole;
}

TEST(Http1Test, PipelinedRequestsFrameInOrderWithTheirBodies) {
  const std::string data =
      "GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
      "POST /b?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
      "POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
      "2;x=y\r\nde\r\n1\r\nf\r\n0\r\nT: 1\r\n\r\n"
      "\r\nGET /d HTTP/1.0\n\n";
  EXPECT_EQ(FrameAnySplit(data), (std::vector<std::string>{"GET /a ", "POST /b?q=1 abc",
                                                           "POST /c def", "GET /d "}));
}

TEST(Http1Test, NoLengthAndNoChunksIsAnEmptyBody) {
  EXPECT_EQ(FrameAnySplit("POST /p HTTP/1.1\r\nHost: x\r\n\r\nGET /q HTTP/1.1\r\nHost: x\r\n\r\n"),
            (std::vector<std::string>{"POST /p ", "GET /q "}));
}

TEST(Http1Test, AGetBodyIsNeverARequest) {
  EXPECT_EQ(FrameAnySplit("GET /a HTTP/1.1\r\nHost: x\r\nContent-Length: 28\r\n\r\n"
                          "GET /b HTTP/1.1\r\nHost: x\r\n\r\n"),
            (std::vector<std::string>{"GET /a GET /b HTTP/1.1\r\nHost: x\r\n\r\n"}));
}

TEST(Http1Test, FramingRefusals) {
  const std::vector<std::pair<std::string, int>> cases = {
      {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400},
      {"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\x01\r\n\r\n", 400},
      {"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET relative HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505},
      {"GET / HTTP/1.1\r\nHost: a\r\nExpect: x\r\n\r\n", 417},
      {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1025\r\n\r\n", 413},
      {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n", 413},
      {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n401\r\n", 413},
      {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: x\r\nX: " + std::string(600, 'y') + "\r\n\r\n", 431},
      {"GET / HTTP/1.1\r\nHost: x\r\nX: " + std::string(600, 'y'), 431},
      // A chunk-size line over the limit, whole or cut, and one whose CR is its 513th byte.
      {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1;" +
           std::string(600, 'e') + "\r\n",
       431},
      {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1;" +
           std::string(600, 'e'),
       431},
      {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1;" +
           std::string(510, 'e') + "\r\n",
       431},
  };
  const Limits limits{.max_head_bytes = 512, .max_headers = 16, .max_body_bytes = 1024};
  for (const auto& [data, status] : cases) {
    EXPECT_EQ(FrameAnySplit(data, limits), (std::vector<std::string>{
                                               "refused " + std::to_string(status)}))
        << data;
  }
}

TEST(Http1Test, TheHeadIsAcceptedBeforeItsBodyArrives) {
  RequestParser parser(Limits{.max_body_bytes = 100});
  const std::string head =
      "POST /p HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n";
  size_t used = 0;
  EXPECT_EQ(parser.Feed(head, &used), RequestParser::Event::kHead);
  EXPECT_EQ(used, head.size());
  EXPECT_TRUE(parser.head().expect_continue);
  EXPECT_TRUE(parser.head().keep_alive);
  EXPECT_EQ(parser.Feed("abc", &used), RequestParser::Event::kNeedMore);
  EXPECT_EQ(parser.Feed("deGET", &used), RequestParser::Event::kRequest);
  EXPECT_EQ(used, 2u);
  EXPECT_EQ(parser.body(), "abcde");
}

// What the event server does on plain TCP: the rest of a Content-Length body is
// written into ReserveBody's space (as recv would), the unused part given back.
TEST(Http1Test, ABodyReadStraightIntoItsBufferIsTheSameRequest) {
  RequestParser parser(Limits{.max_body_bytes = 100});
  size_t used = 0;
  const std::string head = "POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n";
  ASSERT_EQ(parser.Feed(head + "ab", &used), RequestParser::Event::kHead);
  EXPECT_EQ(parser.body_remaining(), 10);
  ASSERT_EQ(parser.Feed("ab", &used), RequestParser::Event::kNeedMore);
  EXPECT_EQ(parser.body_remaining(), 8);
  char* at = parser.ReserveBody(50);  // capped at what remains
  std::memcpy(at, "cde", 3);          // a short read
  parser.CommitBody(8, 3);
  EXPECT_EQ(parser.body_remaining(), 5);
  at = parser.ReserveBody(5);
  std::memcpy(at, "fghij", 5);
  parser.CommitBody(5, 5);
  EXPECT_EQ(parser.body_remaining(), 0);
  ASSERT_EQ(parser.Feed({}, &used), RequestParser::Event::kRequest);
  EXPECT_EQ(parser.body(), "abcdefghij");
  parser.Next();
  EXPECT_EQ(parser.body_remaining(), 0);  // outside a body
  ASSERT_EQ(parser.Feed("GET / HTTP/1.1\r\nHost: x\r\n\r\n", &used),
            RequestParser::Event::kHead);
  EXPECT_EQ(parser.body_remaining(), 0);  // GET: no body
}

TEST(Http1Test, KeepAliveFollowsTheVersionAndConnection) {
  RequestParser parser(Limits{});
  size_t used = 0;
  ASSERT_EQ(parser.Feed("GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &used),
            RequestParser::Event::kHead);
  EXPECT_FALSE(parser.head().keep_alive);
  parser.Next();
  ASSERT_EQ(parser.Feed("GET / HTTP/1.0\r\n\r\n", &used), RequestParser::Event::kHead);
  EXPECT_FALSE(parser.head().keep_alive);
  parser.Next();
  ASSERT_EQ(parser.Feed("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", &used),
            RequestParser::Event::kHead);
  EXPECT_TRUE(parser.head().keep_alive);
}

TEST(HttpRoutesTest, PathsRouteAsTheHeaderSays) {
  struct Case {
    std::string path;
    HttpRoute route;
    std::string model, version, region;
  };
  const std::vector<Case> cases = {
      {"/v2", HttpRoute::kServer, "", "", ""},
      {"/v2/health/live", HttpRoute::kLive, "", "", ""},
      {"/v2/models/stats", HttpRoute::kAllStats, "", "", ""},
      {"/v2/models/a%20b", HttpRoute::kModel, "a b", "", ""},
      {"/v2/models/m/versions/2/infer", HttpRoute::kInfer, "m", "2", ""},
      {"/v2/models/stats/ready", HttpRoute::kModelReady, "stats", "", ""},
      {"/v2/models/m/config", HttpRoute::kModelConfig, "m", "", ""},
      {"/v2/models/m/versions/1/stats", HttpRoute::kModelStats, "m", "1", ""},
      {"/v2/models/m/trace/setting", HttpRoute::kModelTrace, "m", "", ""},
      {"/v2/repository/index", HttpRoute::kIndex, "", "", ""},
      {"/v2/repository/models/m/unload", HttpRoute::kUnload, "m", "", ""},
      {"/v2/systemsharedmemory/status", HttpRoute::kSharedMemoryStatus, "", "", ""},
      {"/v2/systemsharedmemory/region/r/register", HttpRoute::kSharedMemoryRegister, "", "", "r"},
      {"/v2/systemsharedmemory/region/r/unregister", HttpRoute::kSharedMemoryUnregister, "", "",
       "r"},
      {"/v2/cudasharedmemory/region/r/status", HttpRoute::kCudaSharedMemory, "", "", "r"},
      {"/v2/logging", HttpRoute::kLogging, "", "", ""},
  };
  for (const Case& c : cases) {
    const std::optional<RouteMatch> match = MatchRoute(c.path);
    ASSERT_TRUE(match.has_value()) << c.path;
    EXPECT_EQ(match->route, c.route) << c.path;
    EXPECT_EQ(match->model, c.model) << c.path;
    EXPECT_EQ(match->version, c.version) << c.path;
    EXPECT_EQ(match->region, c.region) << c.path;
  }
  for (const char* path : {"", "v2", "/", "/v1", "/v2/", "/v2/models", "/v2/models/",
                           "/v2/models//ready", "/v2/models/m/versions", "/v2/models/m/x",
                           "/v2/models/%zz", "/v2/models/m%2", "/v2/health/dead",
                           "/v2/systemsharedmemory/register", "/v2/repository/models/m/x"}) {
    EXPECT_FALSE(MatchRoute(path).has_value()) << path;
  }
}

}  // namespace
}  // namespace mha::server
