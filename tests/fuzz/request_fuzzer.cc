// libFuzzer target (a): raw bytes -> AttendRequest::ParseFromArray -> ValidateRequest
// against a small model repository, as the server's handlers do. A request that
// validates must satisfy the limits it was checked against, and when small enough
// it is run through the core (RunForward) and must compute without an error.
#include <google/protobuf/stubs/logging.h>
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "proto/attention.pb.h"
#include "server/batcher.h"
#include "server/codec.h"
#include "server/model_repository.h"
#include "tests/fuzz/fuzz_models.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// Forward passes above this much work are skipped: they would only slow the search.
constexpr int64_t kMaxForwardWork = int64_t{1} << 16;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // Invalid UTF-8 in string fields is logged by protobuf on every such input.
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  mha::fuzzing::Repository();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::v1::AttendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;  // gRPC refuses it
  absl::StatusOr<const mha::server::Model*> model =
      mha::fuzzing::Repository().Find(request.model());
  absl::StatusOr<mha::server::ValidatedRequest> validated =
      model.ok() ? mha::server::ValidateRequest(request, **model)
                 : absl::StatusOr<mha::server::ValidatedRequest>(model.status());
  if (!validated.ok()) {
    MHA_FUZZ_CHECK(mha::fuzzing::IsInputError(validated.status()), "%s\n",
                   validated.status().ToString().c_str());
    return 0;
  }
  const mha::server::ValidatedRequest& v = *validated;
  const mha::core::AttentionInputs& in = v.inputs;
  const mha::server::ModelLimits& limits = v.model->limits;
  const mha::core::ModelConfig& c = v.model->config;
  MHA_FUZZ_CHECK(in.batch >= 1 && in.num_queries >= 1 && in.num_keys >= 1);
  MHA_FUZZ_CHECK(in.batch <= limits.max_batch_size);
  MHA_FUZZ_CHECK(in.num_queries <= limits.max_sequence_length &&
                 in.num_keys <= limits.max_sequence_length);
  // Values in data or in raw, never both.
  const auto values = [](const attention::v1::Tensor& t) {
    MHA_FUZZ_CHECK(t.data_size() == 0 || t.raw().empty());
    return t.data_size() + static_cast<int64_t>(t.raw().size() / sizeof(float));
  };
  MHA_FUZZ_CHECK(values(request.queries()) == in.batch * in.num_queries * c.query_size);
  MHA_FUZZ_CHECK(static_cast<int64_t>(request.ByteSizeLong()) <= limits.max_request_bytes);
  if (v.return_attention) MHA_FUZZ_CHECK(v.attention_elements() <= limits.max_attention_elements);

  const int64_t widest = std::max({c.num_hiddens, c.query_size, c.key_size, c.value_size});
  const int64_t work = std::max(in.batch * c.num_heads * in.num_queries * in.num_keys,
                                in.batch * (in.num_queries + in.num_keys) * widest);
  if (work > kMaxForwardWork) return 0;
  attention::v1::AttendResponse response;
  const bool raw = mha::server::WantsRawResponse(request);
  const absl::Status status = mha::server::RunForward(v, raw, &response);
  MHA_FUZZ_CHECK(status.ok(), "%s\n", status.ToString().c_str());
  MHA_FUZZ_CHECK(values(response.output()) == v.output_elements());
  MHA_FUZZ_CHECK(values(response.attention()) == (v.return_attention ? v.attention_elements() : 0));
  MHA_FUZZ_CHECK(raw == !response.output().raw().empty());
  return 0;
}
