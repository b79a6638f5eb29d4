// libFuzzer target (a): raw bytes -> AttendRequest::ParseFromArray -> ValidateRequest
// against a small model repository, as the server's handlers do. A request that
// validates must satisfy the limits it was checked against, and when small enough
// it is run through the core (RunForward) and must compute without an error.
#include <cstddef>
#include <cstdint>

#include "proto/attention.pb.h"
#include "server/attention_v1/codec.h"
#include "tests/fuzz/fuzz_models.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  mha::fuzzing::InitializeRequestFuzzer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::v1::AttendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;  // gRPC refuses it
  absl::StatusOr<std::shared_ptr<const mha::server::Model>> model =
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
  // Values in data or in raw, never both.
  const auto values = [](const attention::v1::Tensor& t) {
    MHA_FUZZ_CHECK(t.data_size() == 0 || t.raw().empty());
    return t.data_size() + static_cast<int64_t>(t.raw().size() / sizeof(float));
  };
  MHA_FUZZ_CHECK(values(request.queries()) ==
                 v.inputs.batch * v.inputs.num_queries * v.model->config.query_size);
  if (!mha::fuzzing::CheckValidated(v, static_cast<int64_t>(request.ByteSizeLong()))) return 0;
  attention::v1::AttendResponse response;
  const bool raw = mha::server::WantsRawResponse(request);
  const absl::Status status = mha::server::RunForward(v, raw, &response);
  MHA_FUZZ_CHECK(status.ok(), "%s\n", status.ToString().c_str());
  MHA_FUZZ_CHECK(values(response.output()) == v.output_elements());
  MHA_FUZZ_CHECK(values(response.attention()) == (v.return_attention ? v.attention_elements() : 0));
  MHA_FUZZ_CHECK(values(response.lse()) == (v.return_lse ? v.lse_elements() : 0));
  MHA_FUZZ_CHECK(raw == !response.output().raw().empty());
  return 0;
}
