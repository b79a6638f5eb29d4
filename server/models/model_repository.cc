#include "server/models/model_repository.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "core/weights.h"
#include "server/serving/abbreviate.h"

namespace mha::server {
namespace {

namespace fs = std::filesystem;

class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (!errors_.empty()) errors_ += "; ";
    absl::StrAppend(&errors_, "line ", line + 1, " column ", column + 1, ": ", message);
  }
  const std::string& errors() const { return errors_; }

 private:
  std::string errors_;
};

absl::StatusOr<ModelLimits> ResolveLimits(const attention::v1::ModelLimitsConfig& config,
                                          const ModelLimits& defaults) {
  ModelLimits limits = defaults;
  const std::pair<const char*, std::pair<int64_t, int64_t*>> fields[] = {
      {"max_batch_size", {config.max_batch_size(), &limits.max_batch_size}},
      {"max_sequence_length", {config.max_sequence_length(), &limits.max_sequence_length}},
      {"max_request_bytes", {config.max_request_bytes(), &limits.max_request_bytes}},
      {"max_attention_elements", {config.max_attention_elements(), &limits.max_attention_elements}},
      {"max_session_tokens", {config.max_session_tokens(), &limits.max_session_tokens}},
  };
  for (const auto& [name, value] : fields) {
    if (value.first < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "limits.", name, ": expected >= 0 (0 = the server default), got ", value.first));
    }
    if (value.first > 0) *value.second = value.first;
  }
  return limits;
}

absl::StatusOr<BatchingPolicy> ResolveBatching(const attention::v1::BatchingConfig& config,
                                               const BatchingPolicy& defaults,
                                               const ModelLimits& limits) {
  BatchingPolicy policy = defaults;
  if (config.disabled()) policy.enabled = false;
  const std::pair<const char*, std::pair<int64_t, int64_t*>> fields[] = {
      {"max_batch_size", {config.max_batch_size(), &policy.max_batch_size}},
      {"max_queue_size", {config.max_queue_size(), &policy.max_queue_size}},
      {"max_batch_tokens", {config.max_batch_tokens(), &policy.max_batch_tokens}},
  };
  for (const auto& [name, value] : fields) {
    if (value.first < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batching.", name, ": expected >= 0 (0 = the server default), got ", value.first));
    }
    if (value.first > 0) *value.second = value.first;
  }
  // Durations in microseconds, applied when set (0 is a value of its own).
  struct DurationField {
    const char* name;
    bool set;
    int64_t us;
    absl::Duration* field;
    const char* zero;  // what 0 means
  };
  const DurationField durations[] = {
      {"max_queue_delay_us", config.has_max_queue_delay_us(), config.max_queue_delay_us(),
       &policy.max_queue_delay, "no waiting"},
      {"max_queue_wait_us", config.has_max_queue_wait_us(), config.max_queue_wait_us(),
       &policy.max_queue_wait, "no bound"},
      {"session_gather_us", config.has_session_gather_us(), config.session_gather_us(),
       &policy.session_gather, "no waiting"},
  };
  for (const DurationField& d : durations) {
    if (!d.set) continue;
    if (d.us < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("batching.", d.name, ": expected >= 0 (0 = ", d.zero, "), got ", d.us));
    }
    *d.field = absl::Microseconds(d.us);
  }
  policy.max_batch_size = std::min(policy.max_batch_size, limits.max_batch_size);
  return policy;
}

absl::StatusOr<core::ModelConfig> ToCoreConfig(const attention::v1::ModelConfig& proto) {
  core::ModelConfig config{
      .num_hiddens = proto.num_hiddens(),
      .num_heads = proto.num_heads(),
      .query_size = proto.query_size() != 0 ? proto.query_size() : proto.num_hiddens(),
      .key_size = proto.key_size() != 0 ? proto.key_size() : proto.num_hiddens(),
      .value_size = proto.value_size() != 0 ? proto.value_size() : proto.num_hiddens(),
      .bias = proto.bias(),
      .scoring = proto.scoring() == attention::v1::ADDITIVE ? core::Scoring::kAdditive
                                                            : core::Scoring::kDotProduct,
      .additive_hidden = proto.additive_hidden(),
      .dropout = proto.dropout(),
  };
  if (!proto.precision().empty()) {
    MHA_ASSIGN_OR_RETURN(config.precision, core::ParsePrecision(proto.precision()));
  }
  config.num_kv_heads = proto.num_kv_heads();
  if (proto.has_rope()) {
    config.rope = core::RotaryConfig{.theta = proto.rope().theta(),
                                     .rotary_dim = proto.rope().rotary_dim(),
                                     .interleaved = proto.rope().interleaved()};
  }
  if (proto.projections() == attention::v1::NONE) {
    // The attention-only worker (issue 35): inputs already projected, so each size is
    // fixed by the heads; 0 means that size, any other value is refused naming it.
    config.projections = core::Projections::kNone;
    // Sizes left to Validate (which names num_hiddens / num_heads) when the heads do
    // not divide.
    const bool heads_ok = config.num_heads > 0 && config.num_hiddens % config.num_heads == 0 &&
                          config.num_kv_heads >= 0;
    const int64_t kv_hiddens = heads_ok ? config.kv_hiddens() : 0;
    const std::pair<const char*, std::pair<int64_t, int64_t*>> sizes[] = {
        {"query_size", {proto.query_size(), &config.query_size}},
        {"key_size", {proto.key_size(), &config.key_size}},
        {"value_size", {proto.value_size(), &config.value_size}},
    };
    for (const auto& [field, size] : sizes) {
      const int64_t expected = field[0] == 'q' ? proto.num_hiddens() : kv_hiddens;
      if (heads_ok && size.first != 0 && size.first != expected) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": projections NONE takes ",
            field[0] == 'q' ? "queries of h * d_h = num_hiddens = " : "G * d_h = ", expected,
            " features (0 means that), got ", size.first));
      }
      *size.second = expected;
    }
    if (proto.has_rope()) {
      return absl::InvalidArgumentError(
          "projections: NONE takes q and k already rotated; remove `rope`");
    }
    if (proto.has_file() || proto.has_seeded()) {
      return absl::InvalidArgumentError(absl::StrCat("projections: NONE has no weights; remove `",
                                                     proto.has_file() ? "file" : "seeded", "`"));
    }
  } else if (proto.projections() != attention::v1::FULL) {
    return absl::InvalidArgumentError(absl::StrCat("projections: expected FULL or NONE, got ",
                                                   static_cast<int>(proto.projections())));
  }
  const std::string& cache = proto.kv_cache_precision();
  if (cache == "bf16") {
    config.kv_cache_precision = core::Precision::kBf16;
  } else if (cache == "f32") {
    config.kv_cache_precision = core::Precision::kF32;
  } else if (!cache.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_cache_precision: expected \"\", \"f32\" or \"bf16\", got \"", cache, "\""));
  }
  MHA_RETURN_IF_ERROR(config.Validate());
  return config;
}

absl::StatusOr<std::unique_ptr<core::MultiHeadAttention>> MakeAttention(
    const core::ModelConfig& config, const core::Weights& weights, int num_threads) {
  core::MultiHeadAttention::Options options;
  options.num_threads = num_threads;
  return core::MultiHeadAttention::Create(config, weights, options);
}

absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

// `warmup` blocks: every dimension within the model's limits; K 0 only for a model
// that can self-attend.
absl::StatusOr<std::vector<WarmupShape>> ResolveWarmup(const attention::v1::ModelConfig& proto,
                                                       const core::ModelConfig& config,
                                                       const ModelLimits& limits,
                                                       const BatchingPolicy& batching,
                                                       bool default_warmup) {
  if (proto.warmup_size() == 0) {
    if (!default_warmup) return std::vector<WarmupShape>{};
    return DefaultWarmup(config, limits, batching);
  }
  std::vector<WarmupShape> shapes;
  for (int i = 0; i < proto.warmup_size(); ++i) {
    const attention::v1::WarmupConfig& w = proto.warmup(i);
    const std::string field = absl::StrCat("warmup[", i, "]");
    const auto in_range = [&](absl::string_view name, int64_t value, int64_t low, int64_t high,
                              absl::string_view limit) -> absl::Status {
      if (value >= low && value <= high) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(field, ".", name, ": expected ", low, " to ",
                                                     high, " (", limit, "), got ", value));
    };
    MHA_RETURN_IF_ERROR(in_range("batch", w.batch(), 1, limits.max_batch_size, "max_batch_size"));
    MHA_RETURN_IF_ERROR(in_range("num_queries", w.num_queries(), 1, limits.max_sequence_length,
                                 "max_sequence_length"));
    MHA_RETURN_IF_ERROR(
        in_range("num_keys", w.num_keys(), 0, limits.max_sequence_length, "max_sequence_length"));
    if (w.num_keys() == 0 && !config.SupportsSelfAttention()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".num_keys: 0 (self-attention) needs d_k = d_v = d_q; give keys"));
    }
    shapes.push_back(
        {.batch = w.batch(), .num_queries = w.num_queries(), .num_keys = w.num_keys()});
  }
  return shapes;
}

}  // namespace

std::vector<WarmupShape> DefaultWarmup(const core::ModelConfig& config, const ModelLimits& limits,
                                       const BatchingPolicy& batching) {
  const bool self = config.SupportsSelfAttention();
  const int64_t first = std::min<int64_t>(128, limits.max_sequence_length);
  const int64_t rows = std::clamp<int64_t>(batching.max_batch_size, 1, limits.max_batch_size);
  const int64_t length =
      std::clamp<int64_t>(batching.max_batch_tokens / rows, 1, limits.max_sequence_length);
  const int64_t seq = limits.max_sequence_length;
  // attention_client's default request: B 2, Q 4, K 6, valid_lens [3, 2].
  const int64_t small_rows = std::min<int64_t>(2, limits.max_batch_size);
  const int64_t small_keys = std::min<int64_t>(6, seq);
  std::vector<int32_t> small_lens;
  for (int64_t b = 0; b < small_rows; ++b) {
    small_lens.push_back(static_cast<int32_t>(std::min<int64_t>(3 - b, small_keys)));
  }
  // The client's default request runs last, so that its code and data are the ones a
  // fresh server has in cache (docs/service.md, Warm-up).
  return {{.batch = 1, .num_queries = first, .num_keys = self ? 0 : first},
          {.batch = 1, .num_queries = std::max<int64_t>(1, first / 2), .num_keys = first},
          {.batch = rows, .num_queries = length, .num_keys = self ? 0 : length},
          {.batch = small_rows,
           .num_queries = std::min<int64_t>(4, seq),
           .num_keys = small_keys,
           .valid_lens = std::move(small_lens)}};
}

bool IsModelFolderName(absl::string_view name) {
  return !name.empty() && name[0] != '.' && name.find('/') == absl::string_view::npos &&
         name.find('\0') == absl::string_view::npos;
}

absl::StatusOr<attention::v1::ModelConfig> ParseModelConfig(absl::string_view text,
                                                            absl::string_view source) {
  attention::v1::ModelConfig config;
  google::protobuf::TextFormat::Parser parser;
  CollectErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &config)) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", errors.errors()));
  }
  return config;
}

absl::StatusOr<ResolvedModelConfig> ResolveModelConfig(const attention::v1::ModelConfig& proto,
                                                       absl::string_view name,
                                                       const ModelRepository::Options& options) {
  if (!proto.name().empty() && proto.name() != name) {
    return absl::InvalidArgumentError(
        absl::StrCat("name \"", proto.name(), "\" differs from the directory name \"", name, "\""));
  }
  ResolvedModelConfig resolved;
  MHA_ASSIGN_OR_RETURN(resolved.config, ToCoreConfig(proto));
  MHA_ASSIGN_OR_RETURN(resolved.limits, ResolveLimits(proto.limits(), options.default_limits));
  MHA_ASSIGN_OR_RETURN(
      resolved.batching,
      ResolveBatching(proto.batching(), options.default_batching, resolved.limits));
  MHA_ASSIGN_OR_RETURN(resolved.warmup, ResolveWarmup(proto, resolved.config, resolved.limits,
                                                      resolved.batching, options.default_warmup));
  resolved.default_warmup = proto.warmup_size() == 0 && options.default_warmup;
  return resolved;
}

std::vector<int64_t> VersionFolders(const std::string& dir) {
  std::vector<int64_t> versions;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    int64_t version = 0;
    const auto [rest, parsed] = std::from_chars(name.data(), name.data() + name.size(), version);
    std::error_code entry_error;
    // Only canonical numbers ("7", not "07"): the folder is found again by its number.
    if (parsed == std::errc() && rest == name.data() + name.size() && version >= 1 &&
        std::to_string(version) == name && it->is_directory(entry_error)) {
      versions.push_back(version);
    }
  }
  std::sort(versions.begin(), versions.end());
  return versions;
}

absl::StatusOr<std::vector<int64_t>> ServedVersions(const attention::v1::VersionPolicy& policy,
                                                    const std::vector<int64_t>& folders) {
  if (folders.empty()) return std::vector<int64_t>{1};  // unversioned: the model's own folder
  std::vector<int64_t> served;
  switch (policy.policy_choice_case()) {
    case attention::v1::VersionPolicy::kAll:
      served = folders;
      break;
    case attention::v1::VersionPolicy::kSpecific:
      for (int64_t v : folders) {
        if (absl::c_linear_search(policy.specific().versions(), v)) served.push_back(v);
      }
      break;
    default: {
      const size_t n = std::max<size_t>(1, policy.latest().num_versions());
      served.assign(folders.end() - static_cast<ptrdiff_t>(std::min(n, folders.size())),
                    folders.end());
    }
  }
  if (served.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("version_policy: selects none of the version folders (",
                     absl::StrJoin(folders, ", "), ")"));
  }
  return served;
}

absl::StatusOr<std::vector<std::unique_ptr<Model>>> LoadModelVersions(
    const std::string& dir, const std::string& name, const ModelRepository::Options& options) {
  const std::string config_path = (fs::path(dir) / "config.pbtxt").string();
  const std::string context = absl::StrCat("model ", name, " (", config_path, ")");
  std::ifstream file(config_path);
  if (!file) return absl::NotFoundError(absl::StrCat(context, ": cannot read the file"));
  std::stringstream text;
  text << file.rdbuf();
  MHA_ASSIGN_OR_RETURN(const attention::v1::ModelConfig proto,
                       ParseModelConfig(text.str(), context));
  auto resolved = ResolveModelConfig(proto, name, options);
  if (!resolved.ok()) return WithContext(resolved.status(), context);
  const std::vector<int64_t> folders = VersionFolders(dir);
  auto versions = ServedVersions(proto.version_policy(), folders);
  if (!versions.ok()) return WithContext(versions.status(), context);

  std::vector<std::unique_ptr<Model>> models;
  for (const int64_t version : *versions) {
    auto model = std::make_unique<Model>();
    model->name = name;
    model->version = version;
    model->config = resolved->config;
    model->limits = resolved->limits;
    model->batching = resolved->batching;
    model->warmup = resolved->warmup;
    model->default_warmup = resolved->default_warmup;
    const fs::path weights_dir =
        folders.empty() ? fs::path(dir) : fs::path(dir) / std::to_string(version);
    core::Weights weights;
    if (model->config.attention_only()) {
      // No weights; a weights file beside the config is a mistake worth naming.
      const fs::path stray = weights_dir / "weights.safetensors";
      std::error_code exists_error;
      if (fs::exists(stray, exists_error)) {
        return absl::InvalidArgumentError(
            absl::StrCat(context, ": projections: NONE has no weights, but ", stray.string(),
                         " is there; remove it or serve the model with projections FULL"));
      }
      model->weights_source = "none (projections NONE)";
    } else if (proto.has_seeded()) {
      weights = core::SeededWeights(model->config, proto.seeded().seed());
      model->weights_source = absl::StrCat("seeded (seed ", proto.seeded().seed(), ")");
    } else {
      const std::string weights_path =
          (weights_dir / (proto.file().empty() ? "weights.safetensors" : proto.file())).string();
      auto loaded = core::LoadSafetensorsWeights(weights_path, model->config);
      if (!loaded.ok()) {
        return WithContext(loaded.status(), absl::StrCat("model ", name, " (", weights_path, ")"));
      }
      weights = *std::move(loaded);
      model->weights_source = weights_path;
    }
    auto attention = MakeAttention(model->config, weights, options.num_threads);
    if (!attention.ok()) return WithContext(attention.status(), context);
    model->attention = *std::move(attention);
    models.push_back(std::move(model));
  }
  return models;
}

absl::StatusOr<std::unique_ptr<ModelRepository>> ModelRepository::Create(const Options& options) {
  std::unique_ptr<ModelRepository> repository(new ModelRepository(options));
  if (options.path.empty()) {
    auto model = std::make_shared<Model>();
    model->name = kDefaultModelName;
    model->limits = options.default_limits;
    MHA_ASSIGN_OR_RETURN(model->batching,
                         ResolveBatching({}, options.default_batching, model->limits));
    MHA_ASSIGN_OR_RETURN(model->warmup, ResolveWarmup({}, model->config, model->limits,
                                                      model->batching, options.default_warmup));
    model->default_warmup = options.default_warmup;
    model->weights_source = absl::StrCat("seeded (seed ", kDefaultModelSeed, ")");
    MHA_ASSIGN_OR_RETURN(
        model->attention,
        MakeAttention(model->config, core::SeededWeights(model->config, kDefaultModelSeed),
                      options.num_threads));
    repository->Swap({std::move(model)});
    return repository;
  }

  std::error_code error;
  if (!fs::is_directory(options.path, error)) {
    return absl::NotFoundError(
        absl::StrCat("model_repository ", options.path, ": not a directory we can read"));
  }
  std::vector<std::string> names;
  if (options.only.has_value()) {
    names = *options.only;
  } else {
    MHA_ASSIGN_OR_RETURN(names, repository->ListDirectory());
  }
  for (const std::string& name : names) {
    MHA_ASSIGN_OR_RETURN(Versions versions, repository->Load(name));
    repository->Swap(std::move(versions));
  }
  if (!options.only.has_value() && !options.allow_empty && repository->models().empty()) {
    return absl::NotFoundError(absl::StrCat("model_repository ", options.path,
                                            ": no model directories (<name>/config.pbtxt)"));
  }
  return repository;
}

absl::StatusOr<std::vector<std::string>> ModelRepository::ListDirectory() const {
  std::vector<std::string> names;
  if (options_.path.empty()) return names;
  std::error_code error;
  fs::directory_iterator it(options_.path, error);
  for (const fs::directory_iterator end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    std::error_code entry_error;  // a dangling link is skipped, not an end to the listing
    if (it->is_directory(entry_error) && IsModelFolderName(name)) names.push_back(name);
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat("model_repository ", options_.path,
                                               ": cannot list the directory: ", error.message()));
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string ModelRepository::Fingerprint(const std::string& name) const {
  std::vector<std::string> files;
  const fs::path dir = fs::path(options_.path) / name;
  std::error_code error;
  // The model's files and its version folders' (one level down).
  for (fs::recursive_directory_iterator it(dir, error), end; !error && it != end;
       it.increment(error)) {
    if (it.depth() >= 1) it.disable_recursion_pending();
    std::error_code entry_error;  // an unreadable entry is left out, not an end to the walk
    if (!it->is_regular_file(entry_error)) continue;
    const auto size = it->file_size(entry_error);
    const auto time = it->last_write_time(entry_error).time_since_epoch().count();
    files.push_back(
        absl::StrCat(fs::relative(it->path(), dir, entry_error).string(), ":", size, ":", time));
  }
  // A folder that cannot be read fingerprints as such: a change once it reads again.
  if (error) files.push_back(absl::StrCat("error:", error.message()));
  std::sort(files.begin(), files.end());
  return absl::StrJoin(files, ";");
}

bool ModelRepository::Changed(const std::string& name) const {
  const std::string now = Fingerprint(name);
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) return true;
  const Entry& entry = it->second;
  if (!entry.failure.empty()) return now != entry.failed_fingerprint;
  return entry.versions.empty() || now != entry.fingerprint;
}

absl::StatusOr<ModelRepository::Versions> ModelRepository::Load(const std::string& name) {
  if (!IsModelFolderName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: \"", Abbreviate(name), "\" is not a model directory name in the repository"));
  }
  // Taken before reading: a file written during the load is seen as a change next time.
  const std::string fingerprint = Fingerprint(name);
  auto loaded = LoadModelVersions((fs::path(options_.path) / name).string(), name, options_);
  absl::MutexLock lock(&mu_);
  Entry& entry = models_[name];
  if (!loaded.ok()) {
    entry.failed_fingerprint = fingerprint;
    entry.failure = std::string(loaded.status().message());
    return loaded.status();
  }
  // Every model of the server computes in one pool of workspaces (one per forward
  // call in progress, grown to the largest call): a new model or version costs its
  // weights, not a second set of buffers.
  const Model* pool = nullptr;
  for (const auto& [served_name, served] : models_) {
    if (!served.versions.empty()) {
      pool = served.versions.back().get();
      break;
    }
  }
  Versions versions;
  for (std::unique_ptr<Model>& model : *loaded) {
    model->fingerprint = fingerprint;
    if (pool != nullptr) model->attention->ShareWorkspacesWith(*pool->attention);
    if (pool == nullptr) pool = model.get();
    versions.push_back(std::move(model));
  }
  return versions;
}

void ModelRepository::RecordFailure(const std::string& name, const std::string& fingerprint,
                                    const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  Entry& entry = models_[name];
  entry.failed_fingerprint = fingerprint;
  entry.failure = std::string(status.message());
}

void ModelRepository::ForgetFailures(const std::set<std::string>& present) {
  absl::MutexLock lock(&mu_);
  for (auto it = models_.begin(); it != models_.end();) {
    if (it->second.versions.empty() && !present.contains(it->first)) {
      it = models_.erase(it);
    } else {
      ++it;
    }
  }
}

ModelRepository::Versions ModelRepository::Swap(Versions versions) {
  absl::MutexLock lock(&mu_);
  Entry& entry = models_[versions.front()->name];
  entry.fingerprint = versions.front()->fingerprint;
  entry.failure.clear();
  entry.failed_fingerprint.clear();
  std::swap(entry.versions, versions);
  return versions;
}

ModelRepository::Versions ModelRepository::Remove(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) return {};
  Versions removed = std::move(it->second.versions);
  models_.erase(it);
  return removed;
}

std::map<std::string, std::string> ModelRepository::Failures() const {
  std::map<std::string, std::string> failures;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, entry] : models_) {
    if (!entry.failure.empty()) failures.emplace(name, entry.failure);
  }
  return failures;
}

absl::StatusOr<std::shared_ptr<const Model>> ModelRepository::Find(
    absl::string_view name, absl::string_view version) const {
  std::vector<std::string> names;
  const Versions* versions = nullptr;
  absl::ReaderMutexLock lock(&mu_);
  if (name.empty()) {
    int served = 0;
    for (const auto& [served_name, entry] : models_) {
      if (entry.versions.empty()) continue;
      if (served_name == kDefaultModelName) {
        versions = &entry.versions;
        served = 1;
        break;
      }
      versions = &entry.versions;
      ++served;
    }
    if (served != 1) versions = nullptr;
  } else if (auto it = models_.find(name); it != models_.end() && !it->second.versions.empty()) {
    versions = &it->second.versions;
  }
  if (versions != nullptr) {
    if (version.empty()) return versions->back();
    std::vector<int64_t> numbers;
    for (const auto& model : *versions) {
      if (absl::StrCat(model->version) == version) return model;
      numbers.push_back(model->version);
    }
    return absl::NotFoundError(absl::StrCat("model_version: model ", versions->back()->name,
                                            " serves version(s) ", absl::StrJoin(numbers, ", "),
                                            ", not \"", Abbreviate(version), "\""));
  }
  for (const auto& [served_name, entry] : models_) {
    if (!entry.versions.empty()) names.push_back(served_name);
  }
  if (name.empty() && names.empty()) return absl::NotFoundError("model: no model is loaded");
  if (name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: required, this server has several models and none named \"",
                     kDefaultModelName, "\" (", absl::StrJoin(names, ", "), ")"));
  }
  return absl::NotFoundError(absl::StrCat("model: unknown model \"", Abbreviate(name),
                                          "\"; served: ", absl::StrJoin(names, ", ")));
}

std::vector<std::shared_ptr<const Model>> ModelRepository::models() const {
  std::vector<std::shared_ptr<const Model>> models;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, entry] : models_) {
    models.insert(models.end(), entry.versions.begin(), entry.versions.end());
  }
  return models;
}

}  // namespace mha::server
