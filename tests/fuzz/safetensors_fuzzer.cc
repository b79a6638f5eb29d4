// libFuzzer target (b): bytes -> SafetensorsFile::FromBuffer (the safetensors
// header and offsets) -> every tensor converted to float32 -> the weights loader
// for three small layer configurations (PyTorch packed, PyTorch kdim/vdim, d2l).
// Parsed tensors must describe exactly their bytes; loaded weights must match the
// configuration.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "core/config.h"
#include "core/safetensors.h"
#include "core/weights.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using mha::core::ModelConfig;
  auto file = mha::core::SafetensorsFile::FromBuffer(
      absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) {
    MHA_FUZZ_CHECK(file.status().code() == absl::StatusCode::kInvalidArgument, "%s\n",
                   file.status().ToString().c_str());
    return 0;
  }
  for (const auto& [name, view] : (*file)->tensors()) {
    MHA_FUZZ_CHECK(view.num_bytes <= size);
    MHA_FUZZ_CHECK(static_cast<uint64_t>(view.num_elements()) * DTypeSize(view.dtype) ==
                   view.num_bytes);
    auto floats = view.ToFloat(name);
    if (floats.ok()) {
      MHA_FUZZ_CHECK(static_cast<int64_t>(floats->size()) == view.num_elements());
    } else {
      MHA_FUZZ_CHECK(floats.status().code() == absl::StatusCode::kInvalidArgument);
    }
  }
  static const ModelConfig kConfigs[] = {
      {.num_hiddens = 4,
       .num_heads = 2,
       .query_size = 4,
       .key_size = 4,
       .value_size = 4,
       .bias = true},
      {.num_hiddens = 4, .num_heads = 2, .query_size = 4, .key_size = 3, .value_size = 2},
      {.num_hiddens = 4,
       .num_heads = 1,
       .query_size = 3,
       .key_size = 5,
       .value_size = 2,
       .bias = true},
      {.num_hiddens = 4,
       .num_heads = 2,
       .query_size = 4,
       .key_size = 4,
       .value_size = 4,
       .scoring = mha::core::Scoring::kAdditive,
       .additive_hidden = 3},
  };
  for (const ModelConfig& config : kConfigs) {
    auto weights = mha::core::WeightsFromSafetensors(**file, config);
    if (weights.ok()) {
      const absl::Status valid = weights->Validate(config);
      MHA_FUZZ_CHECK(valid.ok(), "%s\n", valid.ToString().c_str());
    } else {
      MHA_FUZZ_CHECK(weights.status().code() == absl::StatusCode::kInvalidArgument ||
                         weights.status().code() == absl::StatusCode::kNotFound,
                     "%s\n", weights.status().ToString().c_str());
    }
  }
  return 0;
}
