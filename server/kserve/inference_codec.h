// The Open Inference Protocol codec (KServe v2 / Triton; proto/inference/): a
// ModelInferRequest decoded into the views every front validates the same way
// (server/serving/request.h: Validate), and the ModelInferResponse encoded from what
// the core computed. The gRPC front (server/kserve_grpc/inference_service.h) and the
// HTTP front (server/kserve_http/http_front.h, whose bodies
// server/kserve_http/http_codec.h turns into the same messages) both go through here.
//
// Tensor names (docs/service.md):
//   inputs   queries     FP32, FP16 or BF16  [B, Q, d_q]   required
//            keys        FP32, FP16 or BF16  [B, K, d_k]   optional, with values
//            values      FP32, FP16 or BF16  [B, K, d_v]   optional, with keys
//            valid_lens  INT32 or INT64      [B] or [B, Q] optional
//            head_mask   FP32, FP16 or BF16  [h]           optional
//   outputs  output      FP32  [B, Q, p_o]   always (the default when none is named)
//            attention   FP32  [B, h, Q, K]  only when named in `outputs`
//            lse         FP32  [B, h, Q]     only when named, and only for attention-only
//                                            models (projections NONE; else INVALID_ARGUMENT
//                                            naming return_lse); over HTTP always binary
//   parameters  causal (bool), timeout (int64 microseconds: the request's
//               deadline), binary_data_output (HTTP); others are ignored.
// Inputs come either all as raw_input_contents (little-endian, row-major) or all as
// typed contents (fp32_contents, int_contents, int64_contents); FP16 and BF16 only
// raw. They are converted to f32 exactly, once; raw FP32 is read in place.
// Answers go in raw_output_contents, in the order of the requested outputs; `id`
// is echoed; model_version is the version that computed it.
//
// Errors are INVALID_ARGUMENT naming the input by index and name, e.g.
//   inputs[1] ("keys"): expected datatype FP32, FP16 or BF16, got INT8
// then whatever Validate answers (shapes against the model, limits, values).
#ifndef MHA_SERVER_KSERVE_INFERENCE_CODEC_H_
#define MHA_SERVER_KSERVE_INFERENCE_CODEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/inference/grpc_service.pb.h"
#include "server/serving/model.h"
#include "server/serving/request.h"

namespace mha::server {

// What a decoded request owns: inputs converted to f32 or int32, and which
// outputs it asked for. Decoded views point into it (or into the request).
struct InferDecoded {
  std::vector<float> queries, keys, values, head_mask;  // used when converted
  std::vector<int32_t> valid_lens;
  bool want_attention = false;
  bool want_lse = false;
  // The outputs in the order `outputs` named them ("output" last when not named).
  std::vector<std::string> order;
  absl::Duration timeout = absl::InfiniteDuration();  // the `timeout` parameter
};

// Decodes `request` for `model`. The result points into `request` and `decoded`,
// which must outlive it.
absl::StatusOr<ValidatedRequest> DecodeInferRequest(const inference::ModelInferRequest& request,
                                                    const Model& model, InferDecoded* decoded);

// Fills `response`'s model, id and output tensors (FP32, shapes) and sizes their
// raw_output_contents, zeroed; returns views of them for the core.
OutputViews PrepareInferResponse(const inference::ModelInferRequest& request,
                                 const ValidatedRequest& validated, const InferDecoded& decoded,
                                 inference::ModelInferResponse* response);

// An IEEE half-precision value as the float it is (exactly).
float HalfToFloat(uint16_t h);

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_INFERENCE_CODEC_H_
