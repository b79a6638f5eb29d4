#include "server/kserve_http/http_front.h"

#include <google/protobuf/util/json_util.h>

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
#include "server/kserve/shared_memory_answers.h"
#include "server/kserve_http/http_codec.h"
#include "server/kserve_http/http_routes.h"
#include "server/serving/abbreviate.h"
#include "server/serving/submit.h"

namespace mha::server {
namespace {

using nlohmann::json;

HttpResponse Error(const absl::Status& status) {
  return {.status = HttpStatusOf(status.code()), .body = ErrorBody(status.message())};
}

HttpResponse Body(std::string body) { return {.body = std::move(body)}; }

HttpResponse Json(const json& body) { return {.body = body.dump()}; }

HttpResponse Proto(const google::protobuf::Message& message) {
  std::string text;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(message, &text, options).ok()) {
    return Error(absl::InternalError("cannot print the answer as JSON"));
  }
  return Body(std::move(text));
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

absl::StatusOr<std::optional<int64_t>> HeaderLength(const HttpRequest& req) {
  constexpr char kHeader[] = "Inference-Header-Content-Length";
  const std::optional<absl::string_view> value = req.Header(kHeader);
  if (!value) return std::nullopt;
  int64_t length = -1;
  const auto [end, error] = std::from_chars(value->data(), value->data() + value->size(), length);
  if (error != std::errc() || end != value->data() + value->size() || length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kHeader, ": expected a byte count, got \"", Abbreviate(*value), "\""));
  }
  return length;
}

// What an infer request holds from its parse to its answer.
struct InferState {
  inference::ModelInferRequest request;
  InferDecoded decoded;
  inference::ModelInferResponse response;
};

// The health, server and model metadata and statistics routes.
HttpResponse HealthOrMetadata(const HttpFront::Services& s, const RouteMatch& match) {
  auto find = [&]() { return s.models->Find(match.model, match.version); };
  switch (match.route) {
    case HttpRoute::kLive:
      return Json(json::object());
    case HttpRoute::kReady: {
      const absl::Status readiness = s.answers->Readiness();
      return readiness.ok() ? Json(json::object()) : Error(readiness);
    }
    case HttpRoute::kServer: {
      const inference::ServerMetadataResponse m =
          ToServerMetadata(s.path->shared_memory() != nullptr);
      return Json(
          {{"name", m.name()},
           {"version", m.version()},
           {"extensions", std::vector<std::string>(m.extensions().begin(), m.extensions().end())}});
    }
    case HttpRoute::kAllStats:
    case HttpRoute::kModelStats: {
      absl::StatusOr<inference::ModelStatisticsResponse> stats =
          CollectStatistics(*s.models, *s.metrics, match.model, match.version);
      return stats.ok() ? Body(StatisticsBody(*stats)) : Error(stats.status());
    }
    case HttpRoute::kModel: {
      absl::StatusOr<std::shared_ptr<const Model>> model = find();
      if (!model.ok()) return Error(model.status());
      const inference::ModelMetadataResponse m = ToModelMetadata(**model);
      return Json({{"name", m.name()},
                   {"versions", std::vector<std::string>(m.versions().begin(), m.versions().end())},
                   {"platform", m.platform()},
                   {"inputs", TensorsJson(m.inputs())},
                   {"outputs", TensorsJson(m.outputs())}});
    }
    case HttpRoute::kModelReady: {
      absl::StatusOr<std::shared_ptr<const Model>> model = find();
      if (!model.ok()) return Error(model.status());
      const absl::Status readiness = s.answers->Readiness(model->get());
      return readiness.ok() ? Json(json::object()) : Error(readiness);
    }
    case HttpRoute::kModelConfig: {
      absl::StatusOr<std::shared_ptr<const Model>> model = find();
      if (!model.ok()) return Error(model.status());
      return Proto(ToTritonConfig(**model));
    }
    default:
      return Error(absl::InternalError("HealthOrMetadata: not a metadata route"));
  }
}

// The model repository's index, load and unload.
HttpResponse Repository(const HttpFront::Services& s, const HttpRequest& req,
                        const RouteMatch& match) {
  const absl::StatusOr<RepositoryBody> body = ParseRepositoryBody(req.body);
  if (!body.ok()) return Error(body.status());
  if (match.route == HttpRoute::kIndex) {
    json models = json::array();
    const inference::RepositoryIndexResponse index = s.answers->Index(body->ready);
    for (const auto& m : index.models()) {
      json entry = {{"name", m.name()}, {"version", m.version()}, {"state", m.state()}};
      if (!m.reason().empty()) entry["reason"] = m.reason();
      models.push_back(std::move(entry));
    }
    return Json(models);
  }
  std::vector<KserveModels::ControlParameter> parameters;
  for (const RepositoryBody::Parameter& p : body->parameters) {
    parameters.push_back({.name = p.name, .is_bool = p.is_bool});
  }
  const absl::Status status =
      s.answers->ControlModel(match.route == HttpRoute::kLoad, "", match.model, parameters);
  return status.ok() ? Json(json::object()) : Error(status);
}

// System shared memory's status, register and unregister (the extension on).
HttpResponse SharedMemory(const HttpFront::Services& s, const HttpRequest& req,
                          const RouteMatch& match) {
  switch (match.route) {
    case HttpRoute::kSharedMemoryStatus: {
      absl::StatusOr<std::string> body =
          SharedMemoryStatusBody(s.path->shared_memory(), match.region);
      return body.ok() ? Body(*std::move(body)) : Error(body.status());
    }
    case HttpRoute::kSharedMemoryRegister: {
      const absl::Status status = SharedMemoryRegisterBody(s.path->shared_memory(), match.region,
                                                           req.body, req.loopback_peer);
      return status.ok() ? Json(json::object()) : Error(status);
    }
    default: {
      const absl::Status status = SharedMemoryUnregister(s.path->shared_memory(), match.region);
      return status.ok() ? Json(json::object()) : Error(status);
    }
  }
}

// 501 for a route of the protocol this server does not serve, saying why.
HttpResponse NotServed(const HttpRequest& req, HttpRoute route) {
  const char* why = "no logging extension; logging is set by flags at start";
  switch (route) {
    case HttpRoute::kSharedMemoryStatus:
    case HttpRoute::kSharedMemoryRegister:
    case HttpRoute::kSharedMemoryUnregister:
      why =
          "system shared memory is off (attention_server --shared_memory=system serves it); "
          "send tensors in the request";
      break;
    case HttpRoute::kCudaSharedMemory:
      why = "no CUDA shared-memory extension (a CPU server); send tensors in the request";
      break;
    case HttpRoute::kTrace:
    case HttpRoute::kModelTrace:
      why = "no trace extension; /metrics and the statistics report timings";
      break;
    default:
      break;
  }
  return Error(absl::UnimplementedError(absl::StrCat(
      Abbreviate(req.method), " ", Abbreviate(req.path), " is not served by mha-serve: ", why)));
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
    case absl::StatusCode::kAlreadyExists:  // as Triton answers a region registered twice
    case absl::StatusCode::kFailedPrecondition:
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
  const HttpFront* raw = front.get();
  MHA_ASSIGN_OR_RETURN(
      front->server_, EventHttpServer::Start({.host = options.host,
                                              .port = options.port,
                                              .loops = options.threads,
                                              .max_body_bytes = options.max_body_bytes,
                                              .header_timeout = options.header_timeout,
                                              .idle_timeout = options.idle_timeout,
                                              .max_connections = options.max_connections,
                                              .drain_timeout = options.drain_timeout,
                                              .tls_cert = options.tls_cert,
                                              .tls_key = options.tls_key,
                                              .tls_client_ca = options.tls_client_ca},
                                             [raw](HttpRequest request, HttpResponder responder) {
                                               raw->Serve(std::move(request), std::move(responder));
                                             }));
  return front;
}

HttpFront::~HttpFront() { Stop(); }

void HttpFront::Stop() {
  if (server_ != nullptr) server_->Stop();
}

void HttpFront::Serve(HttpRequest req, HttpResponder res) const {
  const std::string method = req.method == "HEAD" ? "GET" : req.method;
  const std::optional<RouteMatch> match = MatchRoute(req.path);
  if (!match) {
    return res.Send(Error(absl::NotFoundError(
        absl::StrCat("no route ", Abbreviate(req.method), " ", Abbreviate(req.path),
                     " (docs/service.md lists the routes)"))));
  }
  if (std::find(match->methods.begin(), match->methods.end(), method) == match->methods.end()) {
    HttpResponse refusal{.status = 405,
                         .body = ErrorBody(absl::StrCat(
                             Abbreviate(req.method), " ", Abbreviate(req.path),
                             ": method not allowed; use ", absl::StrJoin(match->methods, " or ")))};
    refusal.headers.emplace_back("Allow", absl::StrJoin(match->methods, ", "));
    return res.Send(std::move(refusal));
  }
  // The restricted API groups (server/serving/restricted_api.h), before any body is read.
  const Services& s = services_;
  if (const absl::Status allowed =
          s.path->Allow(ApiGroupOfPath(req.path),
                        [&req](absl::string_view key) -> std::optional<std::string> {
                          const std::optional<absl::string_view> value = req.Header(key);
                          if (!value) return std::nullopt;
                          return std::string(*value);
                        });
      !allowed.ok()) {
    return res.Send(Error(allowed));
  }
  switch (match->route) {
    case HttpRoute::kLive:
    case HttpRoute::kReady:
    case HttpRoute::kServer:
    case HttpRoute::kAllStats:
    case HttpRoute::kModelStats:
    case HttpRoute::kModel:
    case HttpRoute::kModelReady:
    case HttpRoute::kModelConfig:
      return res.Send(HealthOrMetadata(s, *match));
    case HttpRoute::kInfer:
      return Infer(req, match->model, match->version, res);
    case HttpRoute::kIndex:
    case HttpRoute::kLoad:
    case HttpRoute::kUnload:
      return res.Send(Repository(s, req, *match));
    case HttpRoute::kSharedMemoryStatus:
    case HttpRoute::kSharedMemoryRegister:
    case HttpRoute::kSharedMemoryUnregister:
      if (s.path->shared_memory() == nullptr) break;  // off: 501 naming the route, below
      return res.Send(SharedMemory(s, req, *match));
    case HttpRoute::kCudaSharedMemory:
    case HttpRoute::kTrace:
    case HttpRoute::kModelTrace:
    case HttpRoute::kLogging:
      break;
  }
  res.Send(NotServed(req, match->route));
}

// POST .../models/{name}[/versions/{v}]/infer: parses the body on the loop thread,
// submits the request (server/serving/submit.h) and answers from the thread that
// completes it.
void HttpFront::Infer(HttpRequest& req, std::string model, std::string version,
                      const HttpResponder& res) const {
  const RequestPath& path = *services_.path;
  auto state = std::make_shared<InferState>();
  Call call{.protocol = Protocol::kKserveHttp,
            .model = model,
            .version = version,
            .cancelled = [res] { return res.ClientGone(); },
            .peer = [peer = req.peer] { return peer; },
            .run_inline = false,  // an event loop never computes (docs/service.md)
            .cancel_after_compute = true};
  absl::StatusOr<inference::ModelInferRequest> request;
  if (absl::StatusOr<std::optional<int64_t>> header_length = HeaderLength(req);
      !header_length.ok()) {
    request = header_length.status();
  } else {
    request = ParseInferRequest(model, version, &req.body, *header_length);
  }
  if (!request.ok()) {
    path.Refused(call, request.status());
    return res.Send(Error(request.status()));
  }
  state->request = *std::move(request);
  state->response.set_id(state->request.id());
  path.Submit(
      call,
      [&state](const Model& m) {
        return DecodeInfer(state->request, m, &state->decoded, &state->response);
      },
      [state, res](absl::Status status, const ComputeTiming&) {
        if (!status.ok()) return res.Send(Error(status));
        absl::StatusOr<HttpBody> body = EncodeInferResponseHead(state->request, state->response);
        if (!body.ok()) return res.Send(Error(body.status()));
        HttpResponse answer{.content_type = body->content_type, .body = std::move(body->body)};
        for (int i : body->binary_outputs) {  // moved, not copied
          answer.tail.push_back(std::move(*state->response.mutable_raw_output_contents(i)));
        }
        if (body->header_length >= 0) {
          answer.headers.emplace_back("Inference-Header-Content-Length",
                                      std::to_string(body->header_length));
        }
        res.Send(std::move(answer));
      });
}

}  // namespace mha::server
