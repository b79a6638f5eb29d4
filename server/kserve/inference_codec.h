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
//
// Triton's system shared memory (server/serving/shared_memory.h; on with
// attention_server --shared_memory=system): an input or a requested output whose
// parameters carry shared_memory_region (a string: a registered region),
// shared_memory_byte_size (an integer) and optionally shared_memory_offset (an
// integer, default 0, from the region's start) is read from / written into that
// region. raw_input_contents then holds entries only for the inline inputs (a
// shared-memory input has none, and no contents); every output still gets a
// raw_output_contents entry, empty for a shared-memory output, whose response
// tensor carries the request's three parameters. The rules, each INVALID_ARGUMENT
// naming the field (inputs[i] ("name").parameters.shared_memory_byte_size, ...)
// unless said:
//   - the parameters' types; shared_memory_byte_size without shared_memory_region
//   - the server has no registry (--shared_memory=none)
//   - the region is not registered: NOT_FOUND naming the field and the region
//   - offset + byte_size beyond the region's byte_size (as registered)
//   - an input's byte_size must equal its tensor's bytes; an output's must be >= its
//     tensor's bytes (FP32), of which only the tensor's bytes are written
//   - a byte range an output writes (offset, the tensor's bytes) that shares a
//     byte of the same file (st_dev, st_ino: two regions may name one file) with an
//     input's or another output's range: naming both
//   - a region whose file the client truncated below the region, or whose mapping
//     faulted while the request used it (server/serving/shared_memory.h):
//     FAILED_PRECONDITION naming the field and the region, at decode and again
//     when the request is computed
// Inputs are read in place from the region's mapping (FP32 with (region offset +
// tensor offset) % 4 == 0; else converted or copied like raw_input_contents): their
// values are checked at decode and read again when computed, so a client that
// rewrites the region meanwhile changes only its own answer. Their bytes count in the
// request's bytes against max_request_bytes (a merged call copies them). An output is
// computed into the region (offset % 4 == 0; else into a buffer of the request,
// copied in once computed, before the answer: Prepared::finish,
// FinishSharedMemory below); a request that fails still may have written part of
// an in-place output.
//
// Errors are INVALID_ARGUMENT naming the input by index and name, e.g.
//   inputs[1] ("keys"): expected datatype FP32, FP16 or BF16, got INT8
// then whatever Validate answers (shapes against the model, limits, values).
#ifndef MHA_SERVER_KSERVE_INFERENCE_CODEC_H_
#define MHA_SERVER_KSERVE_INFERENCE_CODEC_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/inference/grpc_service.pb.h"
#include "server/serving/model.h"
#include "server/serving/request.h"
#include "server/serving/shared_memory.h"

namespace mha::server {

// An output the request asked to have written into a shared-memory region.
struct SharedMemoryOutput {
  std::string name;                                  // "output", "attention" or "lse"
  std::string field;                                 // outputs[i] ("name"), for messages
  std::shared_ptr<const SharedMemoryRegion> region;  // held until written
  uint64_t offset = 0;                               // from the region's start
  uint64_t byte_size = 0;                            // as the request gave it
  float* in_place = nullptr;                         // computed here when aligned
  std::shared_ptr<std::vector<float>> values;        // else here, then copied in
  uint64_t faults_seen = 0;                          // region->faults() at decode
};

// A shared-memory input: its field (inputs[i] ("name")) and region, held until the
// request is computed.
struct SharedMemoryInput {
  std::string field;
  std::shared_ptr<const SharedMemoryRegion> region;
  uint64_t faults_seen = 0;  // region->faults() at decode
};

// What a decoded request owns: inputs converted to f32 or int32, and which
// outputs it asked for. Decoded views point into it (or into the request).
struct InferDecoded {
  std::vector<float> queries, keys, values, head_mask;  // used when converted
  std::vector<int32_t> valid_lens;
  std::vector<SharedMemoryInput> shared_memory_inputs;  // read in place
  std::vector<SharedMemoryOutput> shared_memory_outputs;
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
// raw_output_contents, zeroed (empty for a shared-memory output, whose view is its
// SharedMemoryOutput::values); returns views of them for the core.
OutputViews PrepareInferResponse(const inference::ModelInferRequest& request,
                                 const ValidatedRequest& validated, const InferDecoded& decoded,
                                 inference::ModelInferResponse* response);

// What ends a request that named shared memory once it computed (Prepared::finish;
// nullptr when it named none): copies in the outputs not computed in place, then
// fails the request (FAILED_PRECONDITION naming the field) if any of its regions
// faulted while it ran. Holds the regions.
std::function<absl::Status()> FinishSharedMemory(const InferDecoded& decoded);

// An IEEE half-precision value as the float it is (exactly).
float HalfToFloat(uint16_t h);

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_INFERENCE_CODEC_H_
