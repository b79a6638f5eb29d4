#include "client/sdk/http.h"

#include <httplib.h>

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "client/sdk/status.h"

namespace mha::client {
namespace {

constexpr char kHeaderLength[] = "Inference-Header-Content-Length";

// A transport failure (no HTTP response) after `elapsed` of a `timeout`.
absl::Status TransportError(httplib::Error error, absl::Duration elapsed, absl::Duration timeout,
                            const HttpEndpoint& endpoint) {
  const std::string what =
      absl::StrFormat("HTTP %s error with %s after %.1f ms", httplib::to_string(error),
                      HttpTargetString(endpoint), absl::ToDoubleMilliseconds(elapsed));
  const bool slow = elapsed >= timeout * 0.99;
  if (error == httplib::Error::ConnectionTimeout ||
      (slow && (error == httplib::Error::Read || error == httplib::Error::Write))) {
    return absl::DeadlineExceededError(what);
  }
  return absl::UnavailableError(what);
}

absl::Status Prefixed(absl::string_view method, absl::string_view path, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(method, " ", path, ": ", s.message()));
}

void SetTimeout(httplib::Client& client, absl::Duration timeout) {
  const int64_t us = std::max<int64_t>(1, absl::ToInt64Microseconds(timeout));
  const time_t sec = static_cast<time_t>(us / 1000000);
  const time_t usec = static_cast<time_t>(us % 1000000);
  client.set_connection_timeout(sec, usec);
  client.set_read_timeout(sec, usec);
  client.set_write_timeout(sec, usec);
}

}  // namespace

absl::StatusOr<HttpEndpoint> ParseHttpTarget(absl::string_view target) {
  auto bad = [&] {
    return UsageError(absl::StrCat(
        "--target: expected HOST[:PORT] of the HTTP server with --protocol=http, got \"", target,
        "\""));
  };
  HttpEndpoint endpoint;
  absl::string_view port;
  if (absl::ConsumePrefix(&target, "[")) {
    const size_t close = target.find(']');
    if (close == absl::string_view::npos) return bad();
    endpoint.host = std::string(target.substr(0, close));
    absl::string_view rest = target.substr(close + 1);
    if (!rest.empty() && !absl::ConsumePrefix(&rest, ":")) return bad();
    port = rest;
  } else {
    const size_t colon = target.rfind(':');
    if (colon != absl::string_view::npos && target.find(':') != colon) return bad();
    endpoint.host = std::string(target.substr(0, colon));
    if (colon != absl::string_view::npos) port = target.substr(colon + 1);
  }
  if (endpoint.host.empty() || endpoint.host.find('/') != std::string::npos) return bad();
  if (!port.empty() &&
      (!absl::SimpleAtoi(port, &endpoint.port) || endpoint.port < 1 || endpoint.port > 65535)) {
    return bad();
  }
  return endpoint;
}

std::string HttpTargetString(const HttpEndpoint& endpoint) {
  const bool v6 = endpoint.host.find(':') != std::string::npos;
  return absl::StrCat(v6 ? "[" : "", endpoint.host, v6 ? "]" : "", ":", endpoint.port);
}

namespace {

std::unique_ptr<httplib::Client> MakeClient(const HttpEndpoint& endpoint) {
  if (!endpoint.tls) return std::make_unique<httplib::Client>(endpoint.host, endpoint.port);
  // The scheme-less constructor makes a plain client; an https:// base URL makes an
  // SSL one that takes the client certificate files.
  const bool v6 = endpoint.host.find(':') != std::string::npos;
  auto client = std::make_unique<httplib::Client>(
      absl::StrCat("https://", v6 ? "[" : "", endpoint.host, v6 ? "]" : "", ":", endpoint.port),
      endpoint.tls_cert, endpoint.tls_key);
  client->enable_server_certificate_verification(true);
  if (!endpoint.tls_ca.empty()) client->set_ca_cert_path(endpoint.tls_ca);
  return client;
}

}  // namespace

HttpConnection::HttpConnection(const HttpEndpoint& endpoint, absl::Duration timeout)
    : endpoint_(endpoint), timeout_(timeout), client_(MakeClient(endpoint)) {
  client_->set_keep_alive(true);
  client_->set_tcp_nodelay(true);
  // Bodies are tensors: no compression either way.
  client_->set_default_headers({{"Accept-Encoding", "identity"}});
  SetTimeout(*client_, timeout);
}

HttpConnection::~HttpConnection() = default;

absl::StatusOr<inference::ModelInferResponse> HttpConnection::Infer(const HttpRequest& request) {
  const httplib::Headers headers = {{kHeaderLength, absl::StrCat(request.header_length)}};
  const absl::Time start = absl::Now();
  const httplib::Result result = client_->Post(request.path, headers, request.body.data(),
                                               request.body.size(), "application/octet-stream");
  if (!result) {
    return Prefixed("POST", request.path,
                    TransportError(result.error(), absl::Now() - start, timeout_, endpoint_));
  }
  std::optional<int64_t> header_length;
  if (result->has_header(kHeaderLength)) {
    int64_t length = 0;
    if (!absl::SimpleAtoi(result->get_header_value(kHeaderLength), &length)) {
      return Prefixed(
          "POST", request.path,
          absl::InternalError(absl::StrCat("HTTP response: bad ", kHeaderLength, " \"",
                                           result->get_header_value(kHeaderLength), "\"")));
    }
    header_length = length;
  }
  auto response = ParseHttpInferResponse(result->status, header_length, result->body);
  if (!response.ok()) return Prefixed("POST", request.path, response.status());
  return response;
}

absl::StatusOr<inference::ModelMetadataResponse> HttpConnection::ModelMetadata(
    const std::string& model) {
  const std::string path = ModelPath(model, "");
  const absl::Time start = absl::Now();
  const httplib::Result result = client_->Get(path);
  if (!result) {
    return Prefixed("GET", path,
                    TransportError(result.error(), absl::Now() - start, timeout_, endpoint_));
  }
  if (result->status != 200) return Prefixed("GET", path, HttpError(result->status, result->body));
  auto metadata = ParseHttpModelMetadata(result->body);
  if (!metadata.ok()) return Prefixed("GET", path, metadata.status());
  return metadata;
}

absl::StatusOr<std::vector<std::string>> HttpConnection::ReadyModels() {
  constexpr char kPath[] = "/v2/repository/index";
  const absl::Time start = absl::Now();
  const httplib::Result result = client_->Post(kPath, R"({"ready": true})", "application/json");
  if (!result) {
    return Prefixed("POST", kPath,
                    TransportError(result.error(), absl::Now() - start, timeout_, endpoint_));
  }
  if (result->status != 200) {
    return Prefixed("POST", kPath, HttpError(result->status, result->body));
  }
  auto names = ParseHttpIndexNames(result->body);
  if (!names.ok()) return Prefixed("POST", kPath, names.status());
  return names;
}

absl::Status HttpConnection::Ready() {
  constexpr char kPath[] = "/v2/health/ready";
  const absl::Time start = absl::Now();
  const httplib::Result result = client_->Get(kPath);
  if (!result) {
    return Prefixed("GET", kPath,
                    TransportError(result.error(), absl::Now() - start, timeout_, endpoint_));
  }
  if (result->status != 200) return Prefixed("GET", kPath, HttpError(result->status, result->body));
  return absl::OkStatus();
}

}  // namespace mha::client
