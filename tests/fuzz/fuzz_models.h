// The model repository the request fuzzers validate against (request_fuzzer,
// inference_request_fuzzer): small models, made once per process.
#ifndef MHA_TESTS_FUZZ_FUZZ_MODELS_H_
#define MHA_TESTS_FUZZ_FUZZ_MODELS_H_

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "server/model_repository.h"
#include "tests/fuzz/fuzz_util.h"

namespace mha::fuzzing {

using mha::server::ModelRepository;

// Three models: "default" self-attends with d = 4; "cross" has d_q, d_k, d_v all
// different and biases; "tight" has small explicit limits.
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

}  // namespace mha::fuzzing

#endif  // MHA_TESTS_FUZZ_FUZZ_MODELS_H_
