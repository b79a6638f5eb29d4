// Scrapes a server's /metrics over plain HTTP/1.0 (loopback) and reads series
// out of the Prometheus text format, for tests.
//
//   std::string text = ScrapeMetrics(server->metrics_port()).value();
//   double ok = MetricValue(text, R"(mha_requests_total{code="OK",model="default"})");
#ifndef MHA_TESTS_INTEGRATION_METRICS_SCRAPE_H_
#define MHA_TESTS_INTEGRATION_METRICS_SCRAPE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace mha::testing {

// The body of GET http://127.0.0.1:port/metrics.
inline absl::StatusOr<std::string> ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  timeval timeout{.tv_sec = 10, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to metrics port ", port));
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("write failed");
  }
  std::string reply;
  char buffer[8192];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) reply.append(buffer, static_cast<size_t>(n));
  close(fd);
  const size_t body = reply.find("\r\n\r\n");
  if (reply.rfind("HTTP/1.", 0) != 0 || reply.find(" 200 ") == std::string::npos ||
      body == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("bad /metrics reply: ", reply.substr(0, 200)));
  }
  return reply.substr(body + 4);
}

// The value of one series, written exactly as the server prints it (labels in
// alphabetical order); nullopt if absent.
inline std::optional<double> FindMetric(const std::string& text, const std::string& series) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ') {
      return std::strtod(line.c_str() + series.size() + 1, nullptr);
    }
  }
  return std::nullopt;
}

// Like FindMetric, with an absent series read as 0 (counters by code appear on
// first use).
inline double MetricValue(const std::string& text, const std::string& series) {
  return FindMetric(text, series).value_or(0.0);
}

}  // namespace mha::testing

#endif  // MHA_TESTS_INTEGRATION_METRICS_SCRAPE_H_
