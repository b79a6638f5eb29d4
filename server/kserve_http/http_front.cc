#include "server/kserve_http/http_front.h"

#include <google/protobuf/util/json_util.h>
#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "server/kserve/inference_codec.h"
#include "server/kserve_http/http_codec.h"
#include "server/serving/abbreviate.h"
#include "server/serving/submit.h"

namespace mha::server {
namespace {

using nlohmann::json;

constexpr char kJson[] = "application/json";
// /v2/models/{name}[/versions/{version}], then the route's suffix.
constexpr char kModelPath[] = R"(/v2/models/([^/]+)(?:/versions/([^/]+))?)";

void SendError(const absl::Status& status, httplib::Response& res) {
  res.status = HttpStatusOf(status.code());
  res.set_content(ErrorBody(status.message()), kJson);
}

void SendBody(std::string body, httplib::Response& res) {
  res.status = 200;
  res.set_content(std::move(body), kJson);
}

void SendJson(const json& body, httplib::Response& res) {
  res.status = 200;
  res.set_content(body.dump(), kJson);
}

void SendProto(const google::protobuf::Message& message, httplib::Response& res) {
  std::string text;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(message, &text, options).ok()) {
    SendError(absl::InternalError("cannot print the answer as JSON"), res);
    return;
  }
  res.status = 200;
  res.set_content(text, kJson);
}

json TensorsJson(
    const google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>&
        tensors) {
  json out = json::array();
  for (const auto& t : tensors) {
    out.push_back({{"name", t.name()},
                   {"datatype", t.datatype()},
                   {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}});
  }
  return out;
}

absl::StatusOr<std::optional<int64_t>> HeaderLength(const httplib::Request& req) {
  constexpr char kHeader[] = "Inference-Header-Content-Length";
  if (!req.has_header(kHeader)) return std::nullopt;
  const std::string value = req.get_header_value(kHeader);
  int64_t length = -1;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), length);
  if (error != std::errc() || end != value.data() + value.size() || length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kHeader, ": expected a byte count, got \"", value.substr(0, 32), "\""));
  }
  return length;
}

// POST .../models/{name}[/versions/{v}]/infer: parses the body, submits the
// request (server/serving/submit.h), waits on the HTTP thread for its answer, and
// fills `res` with it.
absl::Status Infer(const RequestPath& path, const Call& call, const httplib::Request& req,
                   httplib::Response& res) {
  absl::StatusOr<inference::ModelInferRequest> request;
  if (absl::StatusOr<std::optional<int64_t>> header_length = HeaderLength(req);
      !header_length.ok()) {
    request = header_length.status();
  } else {
    request = ParseInferRequest(call.model, call.version, req.body, *header_length);
  }
  if (!request.ok()) {
    path.Refused(call, request.status());
    return request.status();
  }
  InferDecoded decoded;
  inference::ModelInferResponse response;
  response.set_id(request->id());
  Completion completion;
  path.Submit(
      call, [&](const Model& model) { return DecodeInfer(*request, model, &decoded, &response); },
      completion.Callback());
  MHA_RETURN_IF_ERROR(completion.Wait());
  MHA_ASSIGN_OR_RETURN(HttpBody body, EncodeInferResponse(*request, response));
  res.status = 200;
  if (body.header_length >= 0) {
    res.set_header("Inference-Header-Content-Length", std::to_string(body.header_length));
  }
  res.body = std::move(body.body);
  res.set_header("Content-Type", body.content_type);
  return absl::OkStatus();
}

}  // namespace

ApiGroup ApiGroupOfPath(absl::string_view path) {
  if (absl::StartsWith(path, "/v2/health/")) return ApiGroup::kHealth;
  if (absl::StartsWith(path, "/v2/repository")) return ApiGroup::kModelRepository;
  if (absl::StartsWith(path, "/v2/systemsharedmemory") ||
      absl::StartsWith(path, "/v2/cudasharedmemory")) {
    return ApiGroup::kSharedMemory;
  }
  if (absl::StartsWith(path, "/v2/models/")) {
    if (absl::EndsWith(path, "/infer")) return ApiGroup::kInference;
    if (absl::EndsWith(path, "/ready")) return ApiGroup::kHealth;
    if (absl::EndsWith(path, "/stats")) return ApiGroup::kStatistics;
  }
  return ApiGroup::kMetadata;
}

int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

absl::StatusOr<std::unique_ptr<HttpFront>> HttpFront::Start(const Options& options,
                                                            const Services& services) {
  std::unique_ptr<HttpFront> front(new HttpFront());
  front->services_ = services;
  if (options.tls_cert.empty()) {
    front->server_ = std::make_unique<httplib::Server>();
  } else {
    auto tls = std::make_unique<httplib::SSLServer>(
        options.tls_cert.c_str(), options.tls_key.c_str(),
        options.tls_client_ca.empty() ? nullptr : options.tls_client_ca.c_str());
    if (!tls->is_valid()) {
      return absl::InvalidArgumentError(
          "http_port: cannot serve HTTPS with --tls_cert/--tls_key (or --tls_client_ca)");
    }
    front->server_ = std::move(tls);
  }
  httplib::Server& server = *front->server_;
  // cpp-httplib sets SO_REUSEPORT by default, which would let a second server share
  // a busy port; only SO_REUSEADDR here, so a port in use fails start-up. Its listen
  // backlog is 5: the socket is kept to listen again with a full one once bound.
  int* listener = &front->listener_;
  server.set_socket_options([listener](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    *listener = sock;
  });
  // A response is written as headers then body: without TCP_NODELAY the body
  // waits for the client's delayed ACK (~40 ms).
  server.set_tcp_nodelay(true);
  const int threads = options.threads;
  server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  server.set_payload_max_length(static_cast<size_t>(options.max_body_bytes));
  // A connection hands its thread back after 100 requests (or 5 s idle), so more
  // keep-alive clients than threads take turns instead of waiting forever.
  server.set_keep_alive_max_count(100);
  server.set_keep_alive_timeout(5);
  front->Route();
  front->RouteErrors(options.max_body_bytes);
  const std::string address = absl::StrCat(
      options.host.find(':') == std::string::npos ? options.host : "[" + options.host + "]", ":",
      options.port);
  if (options.port == 0) {
    front->port_ = server.bind_to_any_port(options.host);
  } else if (server.bind_to_port(options.host, options.port)) {
    front->port_ = options.port;
  }
  if (front->port_ <= 0) {
    return absl::UnavailableError(absl::StrCat(address, " (--http_port)"));
  }
  if (front->listener_ >= 0) ::listen(front->listener_, SOMAXCONN);
  front->thread_ = std::thread([&server] { server.listen_after_bind(); });
  return front;
}

HttpFront::~HttpFront() { Stop(); }

void HttpFront::Stop() {
  if (!thread_.joinable()) return;
  server_->stop();
  thread_.join();
}

void HttpFront::Route() {
  // cpp-httplib parses a body labelled as a form (x-www-form-urlencoded, curl -d's
  // default: 413 past 8 KiB) or as multipart before any handler sees it. Every body
  // here is JSON or JSON + binary whatever its label, as Triton reads it: the label
  // is set aside before routing. The Request is the server's own, non-const object.
  // Then the restricted API groups (server/serving/restricted_api.h), before any
  // route reads a body.
  const RequestPath* path = services_.path;
  server_->set_pre_routing_handler([path](const httplib::Request& req, httplib::Response& res) {
    auto& headers = const_cast<httplib::Headers&>(req.headers);
    for (auto& [name, value] : headers) {
      if (absl::EqualsIgnoreCase(name, "Content-Type") &&
          (absl::StartsWithIgnoreCase(value, "application/x-www-form-urlencoded") ||
           absl::StartsWithIgnoreCase(value, "multipart/form-data"))) {
        value = "application/octet-stream";
      }
    }
    const absl::Status allowed =
        path->Allow(ApiGroupOfPath(req.path), [&req](absl::string_view key) {
          const std::string name(key);
          return req.has_header(name) ? std::optional(req.get_header_value(name)) : std::nullopt;
        });
    if (allowed.ok()) return httplib::Server::HandlerResponse::Unhandled;
    SendError(allowed, res);
    return httplib::Server::HandlerResponse::Handled;
  });
  RouteUnimplemented();
  RouteMetadata();
  RouteRepository();
  RouteInfer();
}

void HttpFront::Handle(const std::string& method, const std::string& pattern,
                       std::function<void(const httplib::Request&, httplib::Response&)> handler) {
  routes_.push_back({.method = method, .pattern = std::regex(pattern)});
  if (method == "GET") {
    server_->Get(pattern, std::move(handler));
  } else {
    server_->Post(pattern, std::move(handler));
  }
}

void HttpFront::RouteErrors(int64_t max_body_bytes) {
  const std::vector<RouteEntry>* routes = &routes_;
  server_->set_error_handler(httplib::Server::HandlerWithResponse(
      [routes, max_body_bytes](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // ours
        const std::string path = Abbreviate(req.path);
        std::string message;
        if (res.status == 404) {
          std::vector<std::string> allowed;
          for (const RouteEntry& route : *routes) {
            if (std::regex_match(req.path, route.pattern) &&
                std::find(allowed.begin(), allowed.end(), route.method) == allowed.end()) {
              allowed.push_back(route.method);
            }
          }
          if (allowed.empty()) {
            message = absl::StrCat("no route ", Abbreviate(req.method), " ", path,
                                   " (docs/service.md lists the routes)");
          } else {
            res.status = 405;
            res.set_header("Allow", absl::StrJoin(allowed, ", "));
            message = absl::StrCat(Abbreviate(req.method), " ", path, ": method not allowed; use ",
                                   absl::StrJoin(allowed, " or "));
          }
        } else if (res.status == 413) {
          message = absl::StrCat("request body: over the limit of ", max_body_bytes,
                                 " bytes (the largest max_request_bytes)");
        } else if (res.status == 400) {
          message = "malformed HTTP request";
        } else {
          message = absl::StrCat("HTTP status ", res.status);
        }
        res.set_content(ErrorBody(message), kJson);
        return httplib::Server::HandlerResponse::Handled;
      }));
}

void HttpFront::RouteUnimplemented() {
  struct Unserved {
    std::string pattern;
    const char* why;
  };
  const Unserved unserved[] = {
      {R"(/v2/systemsharedmemory(?:/region/[^/]+)?/(?:status|register|unregister))",
       "no shared-memory extension; send tensors in the request"},
      {R"(/v2/cudasharedmemory(?:/region/[^/]+)?/(?:status|register|unregister))",
       "no CUDA shared-memory extension (a CPU server); send tensors in the request"},
      {"/v2/trace/setting", "no trace extension; /metrics and the statistics report timings"},
      {absl::StrCat(kModelPath, "/trace/setting"),
       "no trace extension; /metrics and the statistics report timings"},
      {"/v2/logging", "no logging extension; logging is set by flags at start"},
  };
  for (const Unserved& route : unserved) {
    const char* why = route.why;
    for (const char* method : {"GET", "POST"}) {
      Handle(method, route.pattern, [why](const httplib::Request& req, httplib::Response& res) {
        SendError(absl::UnimplementedError(absl::StrCat(req.method, " ", Abbreviate(req.path),
                                                        " is not served by mha-serve: ", why)),
                  res);
      });
    }
  }
}

void HttpFront::RouteMetadata() {
  const Services s = services_;
  Handle("GET", "/v2/health/live",
         [](const httplib::Request&, httplib::Response& res) { SendJson(json::object(), res); });
  Handle("GET", "/v2/health/ready", [s](const httplib::Request&, httplib::Response& res) {
    const absl::Status readiness = s.answers->Readiness();
    if (readiness.ok()) return SendJson(json::object(), res);
    SendError(readiness, res);
  });
  Handle("GET", "/v2", [](const httplib::Request&, httplib::Response& res) {
    const inference::ServerMetadataResponse m = ToServerMetadata();
    SendJson(
        {{"name", m.name()},
         {"version", m.version()},
         {"extensions", std::vector<std::string>(m.extensions().begin(), m.extensions().end())}},
        res);
  });
  // Before kModelPath, which would take "stats" for a model's name (as in Triton).
  Handle("GET", "/v2/models/stats", [s](const httplib::Request&, httplib::Response& res) {
    absl::StatusOr<inference::ModelStatisticsResponse> stats =
        CollectStatistics(*s.models, *s.metrics, "", "");
    if (!stats.ok()) return SendError(stats.status(), res);
    SendBody(StatisticsBody(*stats), res);
  });
  Handle("GET", kModelPath, [s](const httplib::Request& req, httplib::Response& res) {
    absl::StatusOr<std::shared_ptr<const Model>> model =
        s.models->Find(req.matches[1].str(), req.matches[2].str());
    if (!model.ok()) return SendError(model.status(), res);
    const inference::ModelMetadataResponse m = ToModelMetadata(**model);
    SendJson({{"name", m.name()},
              {"versions", std::vector<std::string>(m.versions().begin(), m.versions().end())},
              {"platform", m.platform()},
              {"inputs", TensorsJson(m.inputs())},
              {"outputs", TensorsJson(m.outputs())}},
             res);
  });
  Handle("GET", absl::StrCat(kModelPath, "/ready"),
         [s](const httplib::Request& req, httplib::Response& res) {
           absl::StatusOr<std::shared_ptr<const Model>> model =
               s.models->Find(req.matches[1].str(), req.matches[2].str());
           if (!model.ok()) return SendError(model.status(), res);
           const absl::Status readiness = s.answers->Readiness(model->get());
           if (readiness.ok()) return SendJson(json::object(), res);
           SendError(readiness, res);
         });
  Handle("GET", absl::StrCat(kModelPath, "/config"),
         [s](const httplib::Request& req, httplib::Response& res) {
           absl::StatusOr<std::shared_ptr<const Model>> model =
               s.models->Find(req.matches[1].str(), req.matches[2].str());
           if (!model.ok()) return SendError(model.status(), res);
           SendProto(ToTritonConfig(**model), res);
         });
  Handle("GET", absl::StrCat(kModelPath, "/stats"),
         [s](const httplib::Request& req, httplib::Response& res) {
           absl::StatusOr<inference::ModelStatisticsResponse> stats =
               CollectStatistics(*s.models, *s.metrics, req.matches[1].str(), req.matches[2].str());
           if (!stats.ok()) return SendError(stats.status(), res);
           SendBody(StatisticsBody(*stats), res);
         });
}

void HttpFront::RouteInfer() {
  const Services s = services_;
  Handle(
      "POST", absl::StrCat(kModelPath, "/infer"),
      [s](const httplib::Request& req, httplib::Response& res) {
        const std::string model = req.matches[1].str();
        const std::string version = req.matches[2].str();
        Call call{
            .protocol = Protocol::kKserveHttp, .model = model, .version = version, .peer = [&req] {
              return absl::StrCat(req.remote_addr, ":", req.remote_port);
            }};
        const absl::Status status = Infer(*s.path, call, req, res);
        if (!status.ok()) SendError(status, res);
      });
}

void HttpFront::RouteRepository() {
  const Services s = services_;
  Handle("POST", "/v2/repository/index", [s](const httplib::Request& req, httplib::Response& res) {
    const absl::StatusOr<RepositoryBody> body = ParseRepositoryBody(req.body);
    if (!body.ok()) return SendError(body.status(), res);
    json models = json::array();
    const inference::RepositoryIndexResponse index = s.answers->Index(body->ready);
    for (const auto& m : index.models()) {
      json entry = {{"name", m.name()}, {"version", m.version()}, {"state", m.state()}};
      if (!m.reason().empty()) entry["reason"] = m.reason();
      models.push_back(std::move(entry));
    }
    SendJson(models, res);
  });
  for (const bool load : {true, false}) {
    Handle("POST", absl::StrCat(R"(/v2/repository/models/([^/]+)/)", load ? "load" : "unload"),
           [s, load](const httplib::Request& req, httplib::Response& res) {
             const absl::StatusOr<RepositoryBody> body = ParseRepositoryBody(req.body);
             absl::Status status = body.status();
             if (status.ok()) {
               std::vector<KserveModels::ControlParameter> parameters;
               for (const RepositoryBody::Parameter& p : body->parameters) {
                 parameters.push_back({.name = p.name, .is_bool = p.is_bool});
               }
               status = s.answers->ControlModel(load, "", req.matches[1].str(), parameters);
             }
             if (!status.ok()) return SendError(status, res);
             SendJson(json::object(), res);
           });
  }
}

}  // namespace mha::server
