#include "client/verbs.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/output_rows.h"
#include "client/load/report.h"
#include "client/sdk/connection.h"
#include "client/sdk/status.h"
#include "client/sdk/tensor_io.h"
#include "nlohmann/json.hpp"
#include "proto/attention.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace mha::client {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::AttentionService;
using attention::v1::ModelInfo;
using attention::v1::Tensor;

// Rows of infer's output printed with their first values.
constexpr int64_t kRowsShown = 8;

struct Timed {
  AttendResponse response;
  double round_trip_ms = 0;
};

absl::StatusOr<Timed> Attend(Connection& connection, const AttendRequest& request) {
  Timed timed;
  const auto start = std::chrono::steady_clock::now();
  MHA_ASSIGN_OR_RETURN(timed.response, connection.Attend(request));
  timed.round_trip_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return timed;
}

// A connection and the model's sizes: what every verb that sends requests needs first.
struct Session {
  std::unique_ptr<Connection> connection;
  ModelInfo model;
};

absl::StatusOr<Session> Open(const ChannelOptions& options, const std::string& model) {
  Session session;
  MHA_ASSIGN_OR_RETURN(session.connection, Connection::Open(options));
  MHA_ASSIGN_OR_RETURN(session.model, session.connection->GetModel(model));
  return session;
}

// Models described by Open Inference Protocol metadata have no bias or precision
// (and h only when the metadata gives it).
std::string ModelLine(const ModelInfo& m) {
  std::string line =
      absl::StrFormat("model %s: p_o %d, h %s, d_q %d, d_k %d, d_v %d", m.name(), m.num_hiddens(),
                      m.num_heads() > 0 ? absl::StrCat(m.num_heads()) : "?", m.query_size(),
                      m.key_size(), m.value_size());
  if (!m.precision().empty()) {
    absl::StrAppend(&line, ", bias ", m.bias() ? "on" : "off", ", ", m.precision());
  }
  return line;
}

std::string RequestLine(const AttendRequest& r) {
  std::string line = absl::StrCat("request: queries ", ShapeString(r.queries()));
  if (r.has_keys()) {
    absl::StrAppend(&line, ", keys ", ShapeString(r.keys()), ", values ", ShapeString(r.values()));
  } else {
    absl::StrAppend(&line, " (self-attention)");
  }
  absl::StrAppend(&line, ", valid_lens [", absl::StrJoin(r.valid_lens(), ", "), "]");
  if (r.causal()) absl::StrAppend(&line, ", causal");
  return line;
}

double L2(absl::Span<const float> a) {
  double sum = 0;
  for (float v : a) sum += static_cast<double>(v) * v;
  return std::sqrt(sum);
}

double RelativeChange(absl::Span<const float> changed, absl::Span<const float> base) {
  double diff = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    const double d = static_cast<double>(changed[i]) - base[i];
    diff += d * d;
  }
  const double norm = L2(base);
  return norm > 0 ? std::sqrt(diff) / norm : std::sqrt(diff);
}

std::vector<int64_t> Shape(const Tensor& t) { return {t.shape().begin(), t.shape().end()}; }

// A usage error unless `path` is empty, .npy or .safetensors.
absl::Status CheckOutputPath(const std::string& path) {
  if (path.empty() || absl::EndsWith(path, ".npy") || absl::EndsWith(path, ".safetensors")) {
    return absl::OkStatus();
  }
  return UsageError(absl::StrCat("--output: expected a .npy or .safetensors file, got ", path));
}

absl::Status WriteOutput(const std::string& path, const AttendRequest& request,
                         const AttendResponse& response) {
  MHA_RETURN_IF_ERROR(CheckOutputPath(path));
  if (absl::EndsWith(path, ".npy")) {
    return WriteNpy(path, Shape(response.output()), response.output().data());
  }
  std::vector<SafetensorsEntry> entries = {
      F32Entry("queries", Shape(request.queries()), request.queries().data())};
  if (request.has_keys()) {
    entries.push_back(F32Entry("keys", Shape(request.keys()), request.keys().data()));
    entries.push_back(F32Entry("values", Shape(request.values()), request.values().data()));
  }
  if (request.valid_lens_size() > 0) {
    entries.push_back(I32Entry("valid_lens", {request.valid_lens_size()}, request.valid_lens()));
  }
  entries.push_back(F32Entry("output", Shape(response.output()), response.output().data()));
  if (response.attention().shape_size() > 0) {
    entries.push_back(
        F32Entry("attention", Shape(response.attention()), response.attention().data()));
  }
  return WriteSafetensors(path, entries);
}

// Where `png`'s maps and colour bar are, for scripts that read its pixels.
nlohmann::json LayoutJson(const HeatmapLayout& layout, HeatmapScale scale, const std::string& png,
                          int64_t batch_index) {
  nlohmann::json json = {{"png", png},
                         {"scale", HeatmapScaleName(scale)},
                         {"min_weight", layout.min_weight},
                         {"width", layout.width},
                         {"height", layout.height},
                         {"cell_size", layout.cell_size},
                         {"rows", layout.rows},
                         {"cols", layout.cols},
                         {"batch_index", batch_index},
                         {"max_weight", layout.max_weight},
                         {"colour_bar",
                          {{"x", layout.bar_x},
                           {"y", layout.bar_y},
                           {"width", layout.bar_width},
                           {"height", layout.bar_height}}},
                         {"heads", nlohmann::json::array()}};
  for (const HeatmapLayout::Map& map : layout.heads) {
    json["heads"].push_back({{"head", map.head}, {"x", map.x}, {"y", map.y}});
  }
  return json;
}

// The "output" tensor of infer's input, when it is one .safetensors that has one.
absl::StatusOr<std::optional<Array>> StoredOutput(const RequestOptions& request) {
  if (request.input_files.size() != 1 || !absl::EndsWith(request.input_files[0], ".safetensors")) {
    return std::nullopt;
  }
  MHA_ASSIGN_OR_RETURN(auto tensors, ReadSafetensors(request.input_files[0]));
  auto it = tensors.find("output");
  if (it == tensors.end()) return std::nullopt;
  return std::move(it->second);
}

// "stored output (FILE): max abs difference 2.4e-06 over 1000 values".
absl::StatusOr<std::string> CompareWithStored(const std::string& file, const Array& stored,
                                              const Tensor& output) {
  if (stored.shape != Shape(output)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": the stored output has shape (", absl::StrJoin(stored.shape, ", "),
                     "), the server's ", ShapeString(output), ": not the same request?"));
  }
  double max_diff = 0;
  for (int i = 0; i < output.data_size(); ++i) {
    const double diff = std::abs(static_cast<double>(output.data(i)) - stored.values[i]);
    max_diff = std::isnan(diff) ? diff : std::max(max_diff, diff);
    if (std::isnan(max_diff)) break;
  }
  return absl::StrFormat("stored output (%s): max abs difference %.3g over %d values", file,
                         max_diff, output.data_size());
}

}  // namespace

absl::StatusOr<HeatmapScale> ParseHeatmapScale(const std::string& text) {
  for (HeatmapScale scale : {HeatmapScale::kLinear, HeatmapScale::kLog, HeatmapScale::kRow}) {
    if (text == HeatmapScaleName(scale)) return scale;
  }
  return UsageError(absl::StrCat("--scale: expected linear, log or row, got ", text));
}

absl::Status Infer(const ChannelOptions& channel, const RequestOptions& request_options,
                   const InferOptions& options, std::ostream& out) {
  MHA_RETURN_IF_ERROR(CheckOutputPath(options.output));
  MHA_ASSIGN_OR_RETURN(Session session, Open(channel, request_options.model));
  MHA_ASSIGN_OR_RETURN(const AttendRequest request, MakeRequest(request_options, session.model));
  MHA_ASSIGN_OR_RETURN(const std::optional<Array> stored, StoredOutput(request_options));
  out << ModelLine(session.model) << "\n" << RequestLine(request) << "\n";
  MHA_ASSIGN_OR_RETURN(const Timed timed, Attend(*session.connection, request));
  const Tensor& output = timed.response.output();
  const auto& data = output.data();
  double sum = 0, min = INFINITY, max = -INFINITY;
  for (float v : data) {
    sum += v;
    min = std::min<double>(min, v);
    max = std::max<double>(max, v);
  }
  const double n = std::max(1, data.size());
  double var = 0;
  for (float v : data) var += (v - sum / n) * (v - sum / n);
  out << absl::StrFormat("output shape: %s\n", ShapeString(output));
  out << absl::StrFormat("output: mean %.6g, std %.6g, min %.6g, max %.6g, l2 %.6g\n", sum / n,
                         std::sqrt(var / n), min, max, L2(data));
  // The first values of the first rows, as mha_toy_example prints them.
  const bool rank3 = output.shape_size() == 3;
  const int64_t batch = rank3 ? output.shape(0) : 0, num_queries = rank3 ? output.shape(1) : 0;
  const int64_t row_size = rank3 ? output.shape(2) : 0;
  const int64_t rows = std::min<int64_t>(batch * num_queries, kRowsShown);
  for (int64_t row = 0; row < rows; ++row) {
    out << OutputRow(data.data(), num_queries, row_size, row / num_queries, row % num_queries)
        << "\n";
  }
  if (rows < batch * num_queries) out << "... " << batch * num_queries - rows << " more rows\n";
  if (timed.response.attention().shape_size() > 0) {
    out << "attention shape: " << ShapeString(timed.response.attention()) << "\n";
  }
  out << absl::StrFormat("time: %.3f ms round trip", timed.round_trip_ms);
  if (timed.response.has_timing()) {
    const attention::v1::Timing& t = timed.response.timing();
    out << absl::StrFormat("; server: queue %d us, compute %d us, batch rows %d", t.queue_us(),
                           t.compute_us(), t.batch_rows());
  }
  out << "\n";
  if (stored) {
    MHA_ASSIGN_OR_RETURN(const std::string line,
                         CompareWithStored(request_options.input_files[0], *stored, output));
    out << line << "\n";
  }
  if (!options.output.empty()) {
    MHA_RETURN_IF_ERROR(WriteOutput(options.output, request, timed.response));
    out << "wrote " << options.output << "\n";
  }
  return absl::OkStatus();
}

absl::Status Bench(const ChannelOptions& channel, const RequestOptions& request_options,
                   const BenchCommandOptions& options, std::ostream& out, std::ostream& progress) {
  MHA_ASSIGN_OR_RETURN(Session session, Open(channel, request_options.model));
  MHA_ASSIGN_OR_RETURN(const AttendRequest request, MakeRequest(request_options, session.model));
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  if (session.connection->channel() != nullptr) channels.push_back(session.connection->channel());
  for (int i = 1; i < options.bench.channels && !channels.empty(); ++i) {
    MHA_ASSIGN_OR_RETURN(auto extra, MakeChannel(channel, i));
    channels.push_back(std::move(extra));
  }
  BenchOptions bench = options.bench;
  bench.timeout = channel.timeout;
  MHA_ASSIGN_OR_RETURN(BenchReport report, RunBench(bench, *session.connection, channels, request,
                                                    progress, options.interactive));
  report.target = channel.targets.empty() ? channel.target : absl::StrJoin(channel.targets, ",");
  report.model = session.model;
  PrintTable(report, out);
  if (!options.json.empty()) {
    MHA_RETURN_IF_ERROR(WriteText(options.json, ToJson(report)));
    out << "wrote " << options.json << "\n";
  }
  if (!options.csv.empty()) {
    MHA_RETURN_IF_ERROR(WriteText(options.csv, ToCsv(report)));
    out << "wrote " << options.csv << "\n";
  }
  return CheckBenchReport(report);
}

absl::Status Heatmap(const ChannelOptions& channel, const RequestOptions& request_options,
                     const HeatmapOptions& options, std::ostream& out) {
  MHA_ASSIGN_OR_RETURN(Session session, Open(channel, request_options.model));
  RequestOptions with_weights = request_options;
  with_weights.return_attention = true;
  MHA_ASSIGN_OR_RETURN(const AttendRequest request, MakeRequest(with_weights, session.model));
  const int64_t batch = request.queries().shape(0);
  if (options.batch_index < 0 || options.batch_index >= batch) {
    return UsageError(absl::StrCat("--batch_index: must be >= 0 and < B = ", batch, ", got ",
                                   options.batch_index));
  }
  MHA_ASSIGN_OR_RETURN(const Timed timed, Attend(*session.connection, request));
  const Tensor& weights = timed.response.attention();
  if (weights.shape_size() != 4) {
    return absl::InternalError(absl::StrCat("the server returned attention of shape ",
                                            ShapeString(weights), ", expected (B, h, Q, K)"));
  }
  const int64_t heads = weights.shape(1), rows = weights.shape(2), cols = weights.shape(3);
  const size_t row_size = static_cast<size_t>(heads * rows * cols);
  const absl::Span<const float> row =
      absl::MakeConstSpan(weights.data())
          .subspan(static_cast<size_t>(options.batch_index) * row_size, row_size);
  const int64_t b = options.batch_index;
  HeatmapStyle style = options.style;
  if (style.title.empty()) {
    style.title = absl::StrFormat(
        "attention weights: model %s, batch row %d of %d%s", session.model.name(), b, batch,
        request.valid_lens_size() == batch
            ? absl::StrCat(", valid_len ", request.valid_lens(static_cast<int>(b)))
            : "");
  }
  MHA_ASSIGN_OR_RETURN(
      const HeatmapLayout layout,
      RenderHeatmap(
          options.output, row, heads, rows, cols,
          [&](int64_t q, int64_t k) { return IsMasked(request, b, q, k); }, style));
  std::string scale;
  switch (style.scale) {
    case HeatmapScale::kLog:
      scale = absl::StrFormat("log scale %.4g .. %.4g", layout.min_weight, layout.max_weight);
      break;
    case HeatmapScale::kRow:
      scale = "each query row scaled 0 .. its largest weight";
      break;
    default:
      scale = absl::StrFormat("scale 0 .. %.4g", layout.max_weight);
  }
  out << absl::StrFormat("wrote %s (%d x %d pixels): %d heads, %d queries x %d keys, %s\n",
                         options.output, layout.width, layout.height, heads, rows, cols, scale);
  if (!options.json.empty()) {
    MHA_RETURN_IF_ERROR(
        WriteText(options.json, LayoutJson(layout, style.scale, options.output, b).dump(2) + "\n"));
  }
  return absl::OkStatus();
}

absl::Status Heads(const ChannelOptions& channel, const RequestOptions& request_options,
                   const HeadsOptions& options, std::ostream& out) {
  MHA_ASSIGN_OR_RETURN(Session session, Open(channel, request_options.model));
  MHA_ASSIGN_OR_RETURN(AttendRequest request, MakeRequest(request_options, session.model));
  const int64_t h = session.model.num_heads();
  if (options.prune < 0 || options.prune > h) {
    return UsageError(absl::StrCat("--prune: must be >= 0 and <= h = ", h, " (the heads of model ",
                                   session.model.name(), "), got ", options.prune));
  }
  out << ModelLine(session.model) << "\n" << RequestLine(request) << "\n";
  request.clear_head_mask();
  MHA_ASSIGN_OR_RETURN(const Timed base, Attend(*session.connection, request));
  const auto& base_output = base.response.output().data();

  // Output with the heads in `dropped` masked to 0, relative to the full output.
  auto change_without = [&](const std::vector<int64_t>& dropped) -> absl::StatusOr<double> {
    request.clear_head_mask();
    for (int64_t i = 0; i < h; ++i) request.add_head_mask(1.0f);
    for (int64_t i : dropped) request.set_head_mask(static_cast<int>(i), 0.0f);
    MHA_ASSIGN_OR_RETURN(const Timed timed, Attend(*session.connection, request));
    return RelativeChange(timed.response.output().data(), base_output);
  };
  std::vector<double> change(static_cast<size_t>(h));
  for (int64_t i = 0; i < h; ++i) {
    MHA_ASSIGN_OR_RETURN(change[static_cast<size_t>(i)], change_without({i}));
  }
  std::vector<int64_t> ranking(static_cast<size_t>(h));
  std::iota(ranking.begin(), ranking.end(), 0);
  std::stable_sort(ranking.begin(), ranking.end(), [&](int64_t a, int64_t b) {
    return change[static_cast<size_t>(a)] > change[static_cast<size_t>(b)];
  });
  out << "head importance: relative L2 change of the output, ||y(drop head) - y|| / ||y||,\n"
         "most important first\n";
  out << absl::StrFormat("%4s  %4s  %14s\n", "rank", "head", "rel. change");
  for (size_t r = 0; r < ranking.size(); ++r) {
    out << absl::StrFormat("%4d  %4d  %14.6g\n", r + 1, ranking[r],
                           change[static_cast<size_t>(ranking[r])]);
  }
  nlohmann::json json = {{"model", session.model.name()},
                         {"num_heads", h},
                         {"ranking", ranking},
                         {"heads", nlohmann::json::array()}};
  for (int64_t i = 0; i < h; ++i) {
    json["heads"].push_back({{"head", i}, {"relative_change", change[static_cast<size_t>(i)]}});
  }
  if (options.prune > 0) {
    const std::vector<int64_t> dropped(ranking.end() - options.prune, ranking.end());
    MHA_ASSIGN_OR_RETURN(const double pruned, change_without(dropped));
    out << absl::StrFormat("prune %d least important (heads %s): relative L2 change %.6g\n",
                           options.prune, absl::StrJoin(dropped, ", "), pruned);
    json["prune"] = {{"heads", dropped}, {"relative_change", pruned}};
  }
  if (!options.json.empty()) {
    MHA_RETURN_IF_ERROR(WriteText(options.json, json.dump(2) + "\n"));
  }
  return absl::OkStatus();
}

absl::Status Health(const ChannelOptions& channel, const HealthOptions& options,
                    std::ostream& out) {
  MHA_ASSIGN_OR_RETURN(auto grpc_channel, MakeChannel(channel));
  std::vector<std::string> services = {options.service};
  if (options.service.empty()) {
    grpc::ClientContext context;
    SetTimeout(&context, channel.timeout);
    attention::v1::ListModelsResponse models;
    const grpc::Status status =
        AttentionService::NewStub(grpc_channel)
            ->ListModels(&context, attention::v1::ListModelsRequest(), &models);
    if (!status.ok()) {
      const absl::Status error = FromGrpcStatus(status);
      return absl::Status(error.code(), absl::StrCat("ListModels: ", error.message()));
    }
    for (const ModelInfo& model : models.models()) services.push_back(model.name());
  }
  auto health = grpc::health::v1::Health::NewStub(grpc_channel);
  std::vector<std::string> not_serving;
  for (const std::string& service : services) {
    grpc::ClientContext context;
    SetTimeout(&context, channel.timeout);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const auto start = std::chrono::steady_clock::now();
    const grpc::Status status = health->Check(&context, request, &response);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const std::string name = service.empty() ? "server" : absl::StrCat("model ", service);
    if (!status.ok()) {
      const absl::Status error = FromGrpcStatus(status);
      return absl::Status(error.code(), absl::StrCat("Health/Check ", name, ": ", error.message()));
    }
    const std::string state =
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    out << absl::StrFormat("%s: %s (%.3f ms)\n", name, state, ms);
    if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
      not_serving.push_back(name);
    }
  }
  if (!not_serving.empty()) {
    return absl::UnavailableError(absl::StrCat("not serving: ", absl::StrJoin(not_serving, ", ")));
  }
  return absl::OkStatus();
}

absl::Status Decode(const ChannelOptions& channel, const DecodeCommandOptions& options,
                    std::ostream& out) {
  DecodeOptions decode = options.decode;
  decode.timeout = channel.timeout;
  MHA_RETURN_IF_ERROR(CheckDecodeOptions(decode));
  MHA_ASSIGN_OR_RETURN(Session session, Open(channel, decode.model));
  MHA_ASSIGN_OR_RETURN(DecodeReport report,
                       RunDecode(decode, session.connection->channel(), session.model));
  report.target = channel.targets.empty() ? channel.target : absl::StrJoin(channel.targets, ",");
  PrintDecodeTable(report, out);
  std::optional<DecodeCheck> check;
  if (options.check) {
    DecodeOptions other = decode;
    other.stateless = !decode.stateless;
    out << "check: the same tokens through "
        << (other.stateless ? "Attend (stateless)" : "AttendSession") << "\n";
    MHA_ASSIGN_OR_RETURN(DecodeReport second,
                         RunDecode(other, session.connection->channel(), session.model));
    second.target = report.target;
    PrintDecodeTable(second, out);
    check = CompareDecodeRuns(report, second, kDecodeCheckTolerance);
    out << DecodeCheckLine(*check) << "\n";
  }
  if (!options.json.empty()) {
    MHA_RETURN_IF_ERROR(WriteText(options.json, DecodeJson(report, check)));
    out << "wrote " << options.json << "\n";
  }
  if (check && !check->match) {
    return absl::FailedPreconditionError(absl::StrCat("decode --", DecodeCheckLine(*check)));
  }
  return absl::OkStatus();
}

}  // namespace mha::client
