// ModelRepository and its config resolution in-process: the embedded default, a
// repository directory, name resolution, and errors naming the model and file.
#include "server/models/model_repository.h"

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace mha::server {
namespace {

using ::mha::testing::TempDir;

TEST(ModelRepositoryTest, NoPathServesTheEmbeddedToyModel) {
  auto models = ModelRepository::Create({.default_limits = {.max_batch_size = 7}}).value();
  ASSERT_EQ(models->models().size(), 1u);
  const std::shared_ptr<const Model> model = models->Find("").value();
  EXPECT_EQ(model->name, kDefaultModelName);
  EXPECT_EQ(model->config.num_hiddens, 100);
  EXPECT_EQ(model->config.num_heads, 5);
  EXPECT_EQ(model->limits.max_batch_size, 7);
  EXPECT_EQ(model->batching.max_batch_size, 7);  // clamped to the model's limit
  EXPECT_EQ(model->weights_source, "seeded (seed 0)");
  EXPECT_EQ(models->Find("default").value(), model);
}

TEST(ModelRepositoryTest, LoadsEveryDirectoryWithOverridesAndSortsByName) {
  TempDir dir;
  dir.Write("b/config.pbtxt",
            "num_hiddens: 8 num_heads: 2 query_size: 4 seeded { seed: 1 } "
            "limits { max_sequence_length: 32 } batching { max_queue_delay_us: 250 }");
  dir.Write("a/config.pbtxt", "num_hiddens: 16 num_heads: 4 seeded { seed: 2 }");
  dir.Write(".hidden/config.pbtxt", "not a config");
  auto models = ModelRepository::Create({.path = dir.path()}).value();
  ASSERT_EQ(models->models().size(), 2u);
  EXPECT_EQ(models->models()[0]->name, "a");
  const std::shared_ptr<const Model> b = models->Find("b").value();
  EXPECT_EQ(b->config.query_size, 4);
  EXPECT_EQ(b->config.key_size, 8);  // 0 means num_hiddens
  EXPECT_EQ(b->limits.max_sequence_length, 32);
  EXPECT_EQ(b->limits.max_batch_size, ModelLimits{}.max_batch_size);
  EXPECT_EQ(b->batching.max_queue_delay, absl::Microseconds(250));
  // Two models and none named "default": "" is ambiguous.
  const absl::Status ambiguous = models->Find("").status();
  EXPECT_EQ(ambiguous.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(ambiguous.message(), "model: required")) << ambiguous;
  const absl::Status unknown = models->Find("c").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(unknown.message(), "unknown model \"c\"; served: a, b")) << unknown;
}

TEST(ModelRepositoryTest, BadConfigNamesModelFileAndField) {
  TempDir dir;
  const std::string path =
      dir.Write("bad/config.pbtxt", "num_hiddens: 100 num_heads: 7 seeded { seed: 0 }");
  const absl::Status status = ModelRepository::Create({.path = dir.path()}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "model bad (" + path + ")")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "num_heads")) << status;
}

TEST(ModelRepositoryTest, AdditiveScoringComesFromTheConfig) {
  TempDir dir;
  dir.Write("additive/config.pbtxt",
            "num_hiddens: 16 num_heads: 4 scoring: ADDITIVE additive_hidden: 8 seeded { seed: 1 }");
  const std::string bad =
      dir.Write("no_hidden/config.pbtxt",
                "num_hiddens: 16 num_heads: 4 scoring: ADDITIVE seeded { seed: 1 }");
  const absl::Status status = ModelRepository::Create({.path = dir.path()}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "model no_hidden (" + bad + ")")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "additive_hidden: expected 1 <=")) << status;
  std::filesystem::remove_all(std::filesystem::path(bad).parent_path());
  auto models = ModelRepository::Create({.path = dir.path()}).value();
  const std::shared_ptr<const Model> model = models->Find("additive").value();
  EXPECT_EQ(model->config.scoring, core::Scoring::kAdditive);
  EXPECT_EQ(model->config.additive_hidden, 8);
  EXPECT_EQ(model->attention->config().scoring, core::Scoring::kAdditive);
}

TEST(ModelRepositoryTest, MissingWeightsAndEmptyRepositoryAreNotFound) {
  TempDir dir;
  dir.Write("real/config.pbtxt", "num_hiddens: 100 num_heads: 5");
  const absl::Status weights = ModelRepository::Create({.path = dir.path()}).status();
  EXPECT_EQ(weights.code(), absl::StatusCode::kNotFound) << weights;
  EXPECT_TRUE(absl::StrContains(weights.message(), "/real/weights.safetensors")) << weights;
  TempDir empty;
  const absl::Status none = ModelRepository::Create({.path = empty.path()}).status();
  EXPECT_EQ(none.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(none.message(), "no model directories")) << none;
}

TEST(ModelRepositoryTest, ResolveNamesTheBatchingField) {
  const auto config =
      ParseModelConfig("num_hiddens: 100 num_heads: 5 batching { max_queue_wait_us: -1 }", "test")
          .value();
  const absl::Status status = ResolveModelConfig(config, "m", {}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "batching.max_queue_wait_us: expected >= 0"))
      << status;
  const auto gather =
      ParseModelConfig("num_hiddens: 100 num_heads: 5 batching { session_gather_us: -2 }", "test")
          .value();
  const absl::Status gather_status = ResolveModelConfig(gather, "m", {}).status();
  EXPECT_EQ(gather_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      absl::StrContains(gather_status.message(),
                        "batching.session_gather_us: expected >= 0 (0 = no waiting), got -2"))
      << gather_status;
  const auto set =
      ParseModelConfig("num_hiddens: 100 num_heads: 5 batching { session_gather_us: 0 }", "test")
          .value();
  EXPECT_EQ(ResolveModelConfig(set, "m", {}).value().batching.session_gather, absl::ZeroDuration());
  const absl::Status parse = ParseModelConfig("num_hiddens: x", "f.pbtxt").status();
  EXPECT_EQ(parse.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(parse.message(), "f.pbtxt: ")) << parse;
}

// Issue 34's fields: num_kv_heads (18), rope (19), projections (20),
// kv_cache_precision (21) reach the core's config; errors name the field.
TEST(ModelRepositoryTest, GroupedRotaryFieldsReachTheCoreConfig) {
  const auto config = ParseModelConfig(
                          "num_hiddens: 64 num_heads: 8 num_kv_heads: 2 "
                          "rope { theta: 500000 rotary_dim: 4 interleaved: true } "
                          "kv_cache_precision: \"bf16\"",
                          "test")
                          .value();
  const core::ModelConfig c = ResolveModelConfig(config, "m", {}).value().config;
  EXPECT_EQ(c.kv_heads(), 2);
  ASSERT_TRUE(c.rope.has_value());
  EXPECT_EQ(c.rope_theta(), 500000);
  EXPECT_EQ(c.rotary_dim(), 4);
  EXPECT_TRUE(c.rope->interleaved);
  EXPECT_TRUE(c.cache_bf16());
  const core::ModelConfig plain =
      ResolveModelConfig(ParseModelConfig("num_hiddens: 64 num_heads: 8 rope {}", "t").value(), "m",
                         {})
          .value()
          .config;
  EXPECT_EQ(plain.kv_heads(), 8);
  EXPECT_EQ(plain.rope_theta(), 10000);  // rope set without a theta
  EXPECT_EQ(plain.rotary_dim(), 8);      // the head size
  EXPECT_FALSE(plain.cache_bf16());
  const struct {
    const char* text;
    const char* field;
  } bad[] = {
      {"num_hiddens: 64 num_heads: 8 num_kv_heads: 3", "num_kv_heads"},
      {"num_hiddens: 64 num_heads: 8 rope { rotary_dim: 5 }", "rotary_dim"},
      {"num_hiddens: 64 num_heads: 8 rope { rotary_dim: 10 }", "rotary_dim"},
      {"num_hiddens: 64 num_heads: 8 kv_cache_precision: \"int8\"", "kv_cache_precision"},
      {"num_hiddens: 64 num_heads: 8 precision: \"bf16\" kv_cache_precision: \"f32\"",
       "kv_cache_precision"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE rope {}", "projections"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE seeded { seed: 1 }", "projections"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE file: \"w.safetensors\"", "projections"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE bias: true", "projections"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE query_size: 8", "query_size"},
      {"num_hiddens: 64 num_heads: 8 num_kv_heads: 2 projections: NONE key_size: 64", "key_size"},
      {"num_hiddens: 64 num_heads: 8 num_kv_heads: 2 projections: NONE value_size: 64",
       "value_size"},
  };
  for (const auto& b : bad) {
    const absl::Status s =
        ResolveModelConfig(ParseModelConfig(b.text, "t").value(), "m", {}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.text;
    EXPECT_TRUE(absl::StrContains(s.message(), b.field)) << s;
  }
}

// Hostile values of issue 34's fields, each loaded from a repository: the load fails
// naming the model, its config file and the field (or the weight tensor).
TEST(ModelRepositoryTest, HostileGroupedRotaryConfigsAreRefusedNamingTheField) {
  const struct {
    const char* text;
    const char* field;
  } bad[] = {
      {"num_kv_heads: -1", "num_kv_heads: expected 0 (= num_heads) or a divisor"},
      {"num_kv_heads: 8", "num_kv_heads: expected 0 (= num_heads) or a divisor"},
      {"num_kv_heads: 9223372036854775807", "num_kv_heads"},
      {"num_kv_heads: 2 scoring: ADDITIVE additive_hidden: 3", "num_kv_heads"},
      {"rope { theta: -1 }", "rope.theta"},
      {"rope { theta: inf }", "rope.theta"},
      {"rope { theta: nan }", "rope.theta"},
      {"rope { rotary_dim: -2 }", "rotary_dim"},
      {"rope { rotary_dim: 9223372036854775806 }", "rotary_dim"},
      {"rope {} scoring: ADDITIVE additive_hidden: 3", "rope"},
      {"kv_cache_precision: \"BF16\"", "kv_cache_precision"},
      {"kv_cache_precision: \"fp16\"", "kv_cache_precision"},
      {"projections: NONE", "projections"},
      {"projections: 7", "projections"},
  };
  for (const auto& b : bad) {
    TempDir dir;
    const std::string path = dir.Write(
        "m/config.pbtxt", absl::StrCat("num_hiddens: 16 num_heads: 4 seeded { seed: 1 } ", b.text));
    const absl::Status s = ModelRepository::Create({.path = dir.path()}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.text;
    EXPECT_TRUE(absl::StrContains(s.message(), "model m (" + path + ")")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), b.field)) << b.text << ": " << s;
  }
  // An odd head size with rope {} (rotary_dim 0 = the head size, 3).
  TempDir odd;
  odd.Write("m/config.pbtxt", "num_hiddens: 12 num_heads: 4 rope {} seeded { seed: 1 }");
  const absl::Status s = ModelRepository::Create({.path = odd.path()}).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "rotary_dim: 0 means the head size, 3")) << s;

  // A grouped model's weights under nn.MultiheadAttention names, and Hugging Face
  // names of the wrong shape: errors name num_kv_heads, and the tensor with its shape.
  const auto weights_error = [](const std::vector<core::NamedTensor>& tensors) {
    TempDir dir;
    dir.Write("m/config.pbtxt", "num_hiddens: 8 num_heads: 4 num_kv_heads: 2");
    dir.Write("m/weights.safetensors", core::SerializeSafetensors(tensors));
    return std::string(ModelRepository::Create({.path = dir.path()}).status().message());
  };
  const std::vector<float> w64(64, 0.5f), w32(32, 0.5f), w192(192, 0.5f);
  EXPECT_TRUE(absl::StrContains(weights_error({core::F32Tensor("in_proj_weight", {24, 8}, w192),
                                               core::F32Tensor("out_proj.weight", {8, 8}, w64)}),
                                "num_kv_heads: a grouped-query model"));
  const std::string shape = weights_error({core::F32Tensor("q_proj.weight", {8, 8}, w64),
                                           core::F32Tensor("k_proj.weight", {8, 8}, w64),
                                           core::F32Tensor("v_proj.weight", {4, 8}, w32),
                                           core::F32Tensor("o_proj.weight", {8, 8}, w64)});
  EXPECT_TRUE(absl::StrContains(shape, "k_proj.weight: expected (G·d_h, d_k) = (4, 8), got (8, 8)"))
      << shape;
}

// deploy/models_llm/llama_attention, a Llama-3-8B-sized layer, loads as the issue
// describes it: ModelRepository::Create parses it, draws its seeded weights (168 MB)
// and builds the layer; its warm-up passes are the small ones listed.
TEST(ModelRepositoryTest, LlamaAttentionLoads) {
  auto models =
      ModelRepository::Create({.path = std::string(MHA_SOURCE_DIR) + "/deploy/models_llm"});
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ((*models)->models().size(), 3u);
  const std::shared_ptr<const Model> model = (*models)->Find("llama_attention").value();
  const core::ModelConfig& c = model->config;
  EXPECT_EQ(c.num_hiddens, 4096);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.head_size(), 128);
  EXPECT_EQ(c.kv_heads(), 8);
  EXPECT_EQ(c.kv_hiddens(), 1024);
  EXPECT_FALSE(c.bias);
  ASSERT_TRUE(c.rope.has_value());
  EXPECT_EQ(c.rope_theta(), 500000.0);
  EXPECT_EQ(c.rotary_dim(), 128);
  EXPECT_FALSE(c.rope->interleaved);
  EXPECT_FALSE(c.cache_bf16());
  EXPECT_EQ(model->limits.max_sequence_length, 8192);
  EXPECT_EQ(model->weights_source, "seeded (seed 8)");
  ASSERT_EQ(model->warmup.size(), 2u);
  for (const WarmupShape& w : model->warmup) {
    EXPECT_EQ(w.batch, 1);
    EXPECT_LE(w.num_queries, 32);
    EXPECT_EQ(w.num_keys, 0);
  }
}

// projections NONE (issue 35): sizes follow the heads (0 means that size).
TEST(ModelRepositoryTest, AttentionOnlyModelsResolveTheirSizesFromTheHeads) {
  const core::ModelConfig c =
      ResolveModelConfig(
          ParseModelConfig("num_hiddens: 64 num_heads: 8 num_kv_heads: 2 projections: NONE "
                           "query_size: 64 key_size: 16",
                           "t")
              .value(),
          "m", {})
          .value()
          .config;
  EXPECT_TRUE(c.attention_only());
  EXPECT_EQ(c.query_size, 64);
  EXPECT_EQ(c.key_size, 16);
  EXPECT_EQ(c.value_size, 16);
}

// A config without `warmup` gets the default passes, inside its limits: B 1 x Q 128
// (or max_sequence_length), cross-attention with K != Q, the largest batch the batcher
// may form, then the client's default request (B 2, Q 4, K 6); a model that cannot
// self-attend warms with keys. Listed passes replace them; default_warmup = false
// leaves such a model cold.
TEST(ModelRepositoryTest, ModelsWithoutWarmupGetTheDefaultPasses) {
  const auto shapes = [](absl::string_view text, bool default_warmup = true) {
    const auto config = ParseModelConfig(text, "test").value();
    return ResolveModelConfig(config, "m", {.default_warmup = default_warmup}).value().warmup;
  };
  const std::vector<WarmupShape> bert = shapes(
      "num_hiddens: 768 num_heads: 12 limits { max_batch_size: 64 max_sequence_length: 512 } "
      "batching { max_batch_size: 32 max_batch_tokens: 8192 }");
  ASSERT_EQ(bert.size(), 4u);
  EXPECT_EQ(bert[0], (WarmupShape{.batch = 1, .num_queries = 128, .num_keys = 0}));
  EXPECT_EQ(bert[1], (WarmupShape{.batch = 1, .num_queries = 64, .num_keys = 128}));
  // 8192 tokens over 32 rows
  EXPECT_EQ(bert[2], (WarmupShape{.batch = 32, .num_queries = 256, .num_keys = 0}));
  EXPECT_EQ(bert[3],
            (WarmupShape{.batch = 2, .num_queries = 4, .num_keys = 6, .valid_lens = {3, 2}}));

  const std::vector<WarmupShape> small = shapes(
      "num_hiddens: 16 num_heads: 2 query_size: 8 limits { max_batch_size: 1 "
      "max_sequence_length: 5 } batching { max_batch_size: 100 max_batch_tokens: 1000000 }");
  ASSERT_EQ(small.size(), 4u);
  // d_q != d_k: cross-attention throughout
  EXPECT_EQ(small[0], (WarmupShape{.batch = 1, .num_queries = 5, .num_keys = 5}));
  EXPECT_EQ(small[1], (WarmupShape{.batch = 1, .num_queries = 2, .num_keys = 5}));
  // the batcher's rows clamped to the model's limit
  EXPECT_EQ(small[2], (WarmupShape{.batch = 1, .num_queries = 5, .num_keys = 5}));
  EXPECT_EQ(small[3],  // clamped
            (WarmupShape{.batch = 1, .num_queries = 4, .num_keys = 5, .valid_lens = {3}}));

  const std::vector<WarmupShape> listed =
      shapes("num_hiddens: 16 num_heads: 2 warmup { batch: 3 num_queries: 5 }");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].batch, 3);
  EXPECT_EQ(listed[0].num_queries, 5);
  EXPECT_TRUE(shapes("num_hiddens: 16 num_heads: 2", /*default_warmup=*/false).empty());

  auto embedded = ModelRepository::Create({}).value();
  EXPECT_EQ(embedded->Find("").value()->warmup.size(), 4u);
  auto cold = ModelRepository::Create({.default_warmup = false}).value();
  EXPECT_TRUE(cold->Find("").value()->warmup.empty());
}

TEST(ModelRepositoryTest, VersionPoliciesPickVersionFolders) {
  const auto versions_of = [](const std::string& policy) -> absl::StatusOr<std::vector<int64_t>> {
    TempDir dir;
    dir.Write("m/config.pbtxt", "num_hiddens: 8 num_heads: 2 seeded { seed: 1 } " + policy);
    for (const char* folder : {"1", "2", "5", "7", "x8", "08"}) {
      dir.Write(std::string("m/") + folder + "/README", "");
    }
    auto models = ModelRepository::Create({.path = dir.path(), .default_warmup = false});
    if (!models.ok()) return models.status();
    std::vector<int64_t> versions;
    for (const auto& model : (*models)->models()) versions.push_back(model->version);
    EXPECT_EQ((*models)->Find("m").value()->version, versions.back());  // "" = the newest
    return versions;
  };
  // "x8" and "08" are not versions (a version folder is named by its number).
  EXPECT_EQ(versions_of("").value(), (std::vector<int64_t>{7}));
  EXPECT_EQ(versions_of("version_policy { latest { num_versions: 2 } }").value(),
            (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(versions_of("version_policy { all {} }").value(), (std::vector<int64_t>{1, 2, 5, 7}));
  EXPECT_EQ(versions_of("version_policy { specific { versions: [2, 3, 5] } }").value(),
            (std::vector<int64_t>{2, 5}));
  const absl::Status none = versions_of("version_policy { specific { versions: [3] } }").status();
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(none.message(),
                                "version_policy: selects none of the version "
                                "folders (1, 2, 5, 7)"))
      << none;
}

}  // namespace
}  // namespace mha::server
