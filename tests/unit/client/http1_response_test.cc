// The plain HTTP transport's response parser: framing by RFC 9112 §6.3, responses
// split at every byte, and hostile responses refused within the limits.
#include "client/sdk/http1_response.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace mha::client::http1 {
namespace {

using Event = ResponseParser::Event;

struct Parsed {
  Event event = Event::kNeedMore;
  size_t used = 0;  // bytes of the input the response took
};

// Feeds `bytes` in pieces of `step` bytes (0: all at once), then Finish() if `closed`.
Parsed Parse(ResponseParser& parser, const std::string& bytes, size_t step = 0,
             bool closed = false) {
  Parsed parsed;
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t n = step == 0 ? bytes.size() - pos : std::min(step, bytes.size() - pos);
    size_t used = 0;
    parsed.event = parser.Feed(absl::string_view(bytes).substr(pos, n), &used);
    pos += used;
    parsed.used = pos;
    if (parsed.event != Event::kNeedMore) return parsed;
    EXPECT_EQ(used, n);  // more was needed: all of it was taken
  }
  if (closed) parsed.event = parser.Finish();
  return parsed;
}

TEST(Http1ResponseTest, ContentLengthBodyAtOnceAndByteByByte) {
  const std::string response =
      "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nInference-Header-Content-Length:  3 \r\n\r\n"
      "hello";
  for (size_t step : {size_t{0}, size_t{1}, size_t{7}}) {
    ResponseParser parser;
    parser.Reset();
    const Parsed parsed = Parse(parser, response + "NEXT", step);
    EXPECT_EQ(parsed.event, Event::kDone) << step;
    EXPECT_EQ(parsed.used, response.size()) << step;
    EXPECT_EQ(parser.status(), 200);
    EXPECT_EQ(parser.body(), "hello");
    EXPECT_EQ(parser.Find("inference-header-content-length").value_or(""), "3");
    EXPECT_TRUE(parser.keep_alive());
  }
}

TEST(Http1ResponseTest, ChunkedBodyWithExtensionsAndTrailers) {
  const std::string response =
      "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
      "5;name=value\r\nhello\r\nA\r\n, chunked!\r\n0\r\nTrailer: x\r\n\r\n";
  for (size_t step : {size_t{0}, size_t{1}, size_t{3}}) {
    ResponseParser parser;
    parser.Reset();
    const Parsed parsed = Parse(parser, response, step);
    EXPECT_EQ(parsed.event, Event::kDone) << step;
    EXPECT_EQ(parsed.used, response.size());
    EXPECT_EQ(parser.body(), "hello, chunked!");
    EXPECT_TRUE(parser.keep_alive());
  }
}

TEST(Http1ResponseTest, NoLengthRunsToTheCloseAndEndsTheConnection) {
  ResponseParser parser;
  parser.Reset();
  EXPECT_EQ(Parse(parser, "HTTP/1.1 200 OK\r\n\r\nall of it", 4).event, Event::kNeedMore);
  EXPECT_EQ(parser.Finish(), Event::kDone);
  EXPECT_EQ(parser.body(), "all of it");
  EXPECT_FALSE(parser.keep_alive());
  // A Transfer-Encoding that does not end in chunked: to the close as well.
  parser.Reset();
  EXPECT_EQ(Parse(parser, "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxyz", 0, true).event,
            Event::kDone);
  EXPECT_EQ(parser.body(), "xyz");
}

TEST(Http1ResponseTest, NoBodyForHeadRequests204And304AndInterimResponsesAreSkipped) {
  ResponseParser parser;
  parser.Reset(/*head_request=*/true);
  EXPECT_EQ(Parse(parser, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n").event, Event::kDone);
  EXPECT_EQ(parser.body(), "");
  for (const char* status : {"204 No Content", "304 Not Modified"}) {
    parser.Reset();
    EXPECT_EQ(Parse(parser, absl::StrCat("HTTP/1.1 ", status, "\r\n\r\n")).event, Event::kDone);
  }
  parser.Reset();
  const Parsed parsed = Parse(parser,
                              "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\n"
                              "Content-Length: 2\r\n\r\nno",
                              2);
  EXPECT_EQ(parsed.event, Event::kDone);
  EXPECT_EQ(parser.status(), 404);
  EXPECT_EQ(parser.body(), "no");
}

TEST(Http1ResponseTest, ConnectionFieldDecidesKeepAlive) {
  ResponseParser parser;
  parser.Reset();
  Parse(parser, "HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 0\r\n\r\n");
  EXPECT_FALSE(parser.keep_alive());
  parser.Reset();
  Parse(parser, "HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n");
  EXPECT_FALSE(parser.keep_alive());
  parser.Reset();
  Parse(parser, "HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n");
  EXPECT_TRUE(parser.keep_alive());
}

TEST(Http1ResponseTest, MalformedResponsesAreInternalErrorsThatSayWhat) {
  const struct {
    const char* response;
    const char* says;
  } cases[] = {
      {"HTTP/2 200 OK\r\n\r\n", "bad status line"},
      {"HTTP/1.1 20 OK\r\n\r\n", "bad status line"},
      {"HTTP/1.1 +20 OK\r\n\r\n", "bad status line"},
      {"HTTP/1.1 200OK\r\n\r\n", "bad status line"},
      {"SSH-2.0-OpenSSH\r\n\r\n", "bad status line"},
      {"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "bad header field"},
      {"HTTP/1.1 200 OK\r\n folded: value\r\n\r\n", "bad header field"},
      {"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", "bad Content-Length"},
      {"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n", "bad Content-Length"},
      {"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"},
      {"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n", "bad Content-Length"},
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk-size line"},
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n", "bad chunk-size line"},
      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", "longer than its size"},
      {"HTTP/1.1 101 Switching Protocols\r\n\r\n", "101"},
  };
  for (const auto& c : cases) {
    ResponseParser parser;
    parser.Reset();
    EXPECT_EQ(Parse(parser, c.response).event, Event::kError) << c.response;
    EXPECT_EQ(parser.error().code(), absl::StatusCode::kInternal) << c.response;
    EXPECT_NE(parser.error().message().find(c.says), std::string::npos)
        << c.response << ": " << parser.error();
    EXPECT_FALSE(parser.keep_alive());
  }
}

TEST(Http1ResponseTest, LimitsBoundWhatAHostileServerMakesUsHold) {
  const ResponseLimits limits{.max_head_bytes = 1024, .max_body_bytes = 4096};
  ResponseParser parser(limits);
  // An endless head: refused at the limit, not held on to.
  parser.Reset();
  Parsed parsed = Parse(parser, "HTTP/1.1 200 OK\r\nX: " + std::string(100000, 'a'), 100);
  EXPECT_EQ(parsed.event, Event::kError);
  EXPECT_LE(parsed.used, limits.max_head_bytes);
  // A declared length over the limit: refused before any of the body.
  parser.Reset();
  EXPECT_EQ(Parse(parser, "HTTP/1.1 200 OK\r\nContent-Length: 4097\r\n\r\n").event, Event::kError);
  EXPECT_NE(parser.error().message().find("over the limit"), std::string::npos);
  // Chunks that add up past it, a huge chunk size, an endless chunk line.
  for (const std::string& body :
       {std::string("800\r\n") + std::string(2048, 'x') + "\r\n800\r\n" +
            std::string(2048, 'x') + "\r\n1\r\n",
        std::string("fffffffffffffffffffffffff\r\n"), std::string(10000, '1')}) {
    parser.Reset();
    parsed = Parse(parser, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body, 512);
    EXPECT_EQ(parsed.event, Event::kError) << body.substr(0, 40);
    EXPECT_LE(parser.body().size(), static_cast<size_t>(limits.max_body_bytes));
  }
  // Endless trailers.
  parser.Reset();
  parsed = Parse(parser,
                 "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" +
                     std::string(2000, 'T') + "\r\n",
                 64);
  EXPECT_EQ(parsed.event, Event::kError);
  // A body to the close past the limit.
  parser.Reset();
  EXPECT_EQ(Parse(parser, "HTTP/1.1 200 OK\r\n\r\n" + std::string(5000, 'b'), 1000).event,
            Event::kError);
  EXPECT_LE(parser.body().size(), static_cast<size_t>(limits.max_body_bytes));
}

TEST(Http1ResponseTest, ACloseBeforeTheEndIsAnErrorThatSaysWhere) {
  ResponseParser parser;
  parser.Reset();
  EXPECT_EQ(parser.Finish(), Event::kError);
  EXPECT_NE(parser.error().message().find("without answering"), std::string::npos);
  parser.Reset();
  EXPECT_EQ(Parse(parser, "HTTP/1.1 200 OK\r\nContent-Le", 0, true).event, Event::kError);
  EXPECT_NE(parser.error().message().find("head"), std::string::npos);
  parser.Reset();
  EXPECT_EQ(Parse(parser, "HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", 0, true).event,
            Event::kError);
  EXPECT_NE(parser.error().message().find("body"), std::string::npos);
}

}  // namespace
}  // namespace mha::client::http1
