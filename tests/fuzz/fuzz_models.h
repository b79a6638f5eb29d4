// What the request fuzzers (request_fuzzer, inference_request_fuzzer,
// session_request_fuzzer) share: the model repository they validate against (small
// models, made once per process) and the checks every validated request must pass.
#ifndef MHA_TESTS_FUZZ_FUZZ_MODELS_H_
#define MHA_TESTS_FUZZ_FUZZ_MODELS_H_

#include <google/protobuf/stubs/logging.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "server/models/model_repository.h"
#include "server/serving/request.h"
#include "tests/fuzz/fuzz_util.h"

namespace mha::fuzzing {

using mha::server::ModelRepository;

// Nine models: "default" self-attends with d = 4; "cross" has d_q, d_k, d_v all
// different and biases; "tight" has small explicit limits; "short" (self, biases)
// caps a session at 12 tokens (limits.max_session_tokens); "half" computes in bf16;
// "additive" scores additively (sessions refuse it); "rotary" has grouped-query
// heads (4 sharing 2) and interleaved rotary positions on half of each head (Q > K and
// CROSS sessions refused); "mqa" one key/value head, rotate-half rotary positions,
// biases and a bf16 session cache; "worker" is attention-only (projections NONE: q,
// k, v of 4 already projected; CROSS causal sessions; the only one return_lse is
// allowed on).
inline const ModelRepository& Repository() {
  static const ModelRepository* repository = [] {
    std::string dir = (std::filesystem::temp_directory_path() / "mha_request_fuzzer.XXXXXX");
    MHA_FUZZ_CHECK(mkdtemp(dir.data()) != nullptr);
    const std::pair<const char*, const char*> models[] = {
        {"default", "num_hiddens: 4 num_heads: 2 seeded { seed: 1 }"},
        {"cross",
         "num_hiddens: 6 num_heads: 3 query_size: 3 key_size: 5 value_size: 2 bias: true "
         "seeded { seed: 2 }"},
        {"tight",
         "num_hiddens: 4 num_heads: 1 seeded { seed: 3 } limits { max_batch_size: 2 "
         "max_sequence_length: 8 max_request_bytes: 512 max_attention_elements: 32 }"},
        {"short",
         "num_hiddens: 4 num_heads: 1 bias: true seeded { seed: 4 } limits { "
         "max_session_tokens: 12 max_request_bytes: 1024 }"},
        {"half", "num_hiddens: 4 num_heads: 2 precision: \"bf16\" seeded { seed: 5 }"},
        {"additive",
         "num_hiddens: 4 num_heads: 2 scoring: ADDITIVE additive_hidden: 3 seeded { seed: 6 }"},
        {"rotary",
         "num_hiddens: 8 num_heads: 4 num_kv_heads: 2 rope { rotary_dim: 2 interleaved: true } "
         "seeded { seed: 7 }"},
        {"mqa",
         "num_hiddens: 4 num_heads: 2 num_kv_heads: 1 bias: true rope { theta: 500000 } "
         "kv_cache_precision: \"bf16\" seeded { seed: 8 }"},
        {"worker", "num_hiddens: 4 num_heads: 2 projections: NONE"},
    };
    for (const auto& [name, config] : models) {
      std::filesystem::create_directories(std::filesystem::path(dir) / name);
      std::ofstream(std::filesystem::path(dir) / name / "config.pbtxt") << config;
    }
    auto created = ModelRepository::Create({.path = dir, .num_threads = 1});
    MHA_FUZZ_CHECK(created.ok(), "%s\n", created.status().ToString().c_str());
    std::filesystem::remove_all(dir);
    return created->release();
  }();
  return *repository;
}

// LLVMFuzzerInitialize of a request fuzzer: protobuf's log stays quiet (invalid UTF-8
// in string fields is logged on every such input) and the repository is made.
inline void InitializeRequestFuzzer() {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  Repository();
}

// A validated request satisfies the limits it was checked against (`wire_bytes`: its
// serialized size). True when its forward pass is small enough to run: larger ones
// would only slow the search.
inline bool CheckValidated(const mha::server::ValidatedRequest& v, int64_t wire_bytes) {
  constexpr int64_t kMaxForwardWork = int64_t{1} << 16;
  const mha::core::AttentionInputs& in = v.inputs;
  const mha::server::ModelLimits& limits = v.model->limits;
  const mha::core::ModelConfig& c = v.model->config;
  MHA_FUZZ_CHECK(in.batch >= 1 && in.num_queries >= 1 && in.num_keys >= 1);
  MHA_FUZZ_CHECK(in.batch <= limits.max_batch_size);
  MHA_FUZZ_CHECK(in.num_queries <= limits.max_sequence_length &&
                 in.num_keys <= limits.max_sequence_length);
  MHA_FUZZ_CHECK(wire_bytes <= limits.max_request_bytes);
  if (v.return_attention) MHA_FUZZ_CHECK(v.attention_elements() <= limits.max_attention_elements);
  MHA_FUZZ_CHECK(!v.return_lse || c.attention_only());
  const int64_t widest = std::max({c.num_hiddens, c.query_size, c.key_size, c.value_size});
  const int64_t work = std::max(in.batch * c.num_heads * in.num_queries * in.num_keys,
                                in.batch * (in.num_queries + in.num_keys) * widest);
  return work <= kMaxForwardWork;
}

}  // namespace mha::fuzzing

#endif  // MHA_TESTS_FUZZ_FUZZ_MODELS_H_
