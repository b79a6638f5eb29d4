// libFuzzer target: raw bytes -> inference.ModelInferRequest::ParseFromArray ->
// ModelRepository::Find + DecodeInferRequest (the Open Inference Protocol decoder) against
// the fuzzers' model repository, as the gRPC and HTTP fronts do. A request that
// decodes must satisfy the limits it was checked against; when small enough it is
// computed into its prepared response, whose outputs must match their shapes.
#include <cstddef>
#include <cstdint>

#include "proto/inference/grpc_service.pb.h"
#include "server/kserve/inference_codec.h"
#include "tests/fuzz/fuzz_models.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  mha::fuzzing::InitializeRequestFuzzer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  inference::ModelInferRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<std::shared_ptr<const mha::server::Model>> model =
      mha::fuzzing::Repository().Find(request.model_name(), request.model_version());
  mha::server::InferDecoded decoded;
  absl::StatusOr<mha::server::ValidatedRequest> validated =
      model.ok() ? mha::server::DecodeInferRequest(request, **model, &decoded)
                 : absl::StatusOr<mha::server::ValidatedRequest>(model.status());
  if (!validated.ok()) {
    MHA_FUZZ_CHECK(mha::fuzzing::IsInputError(validated.status()), "%s\n",
                   validated.status().ToString().c_str());
    return 0;
  }
  const mha::server::ValidatedRequest& v = *validated;
  if (!mha::fuzzing::CheckValidated(v, static_cast<int64_t>(request.ByteSizeLong()))) return 0;
  inference::ModelInferResponse response;
  const mha::server::OutputViews views =
      mha::server::PrepareInferResponse(request, v, decoded, &response);
  const absl::Status status =
      v.model->attention->Forward(v.inputs, views.output, views.attention, 0, views.lse);
  MHA_FUZZ_CHECK(status.ok(), "%s\n", status.ToString().c_str());
  MHA_FUZZ_CHECK(response.outputs_size() == 1 + v.return_attention + v.return_lse);
  MHA_FUZZ_CHECK(response.raw_output_contents_size() == response.outputs_size());
  for (int i = 0; i < response.outputs_size(); ++i) {
    int64_t elements = 1;
    for (int64_t d : response.outputs(i).shape()) elements *= d;
    MHA_FUZZ_CHECK(static_cast<int64_t>(response.raw_output_contents(i).size()) == elements * 4);
  }
  return 0;
}
