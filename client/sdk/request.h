// The AttendRequest a verb sends: inputs from a seed in the shapes asked for, or
// inputs read from files, checked against the model's sizes before sending.
//
// Default: the seeds' toy request on the toy model (p_o 100, d = 100): queries
// (2, 4, 100), keys and values (2, 6, 100), valid_lens [3, 2], the values from
// SplitMix64(0) (base/splitmix64.h), the inputs mha_toy_example computes with.
#ifndef MHA_CLIENT_SDK_REQUEST_H_
#define MHA_CLIENT_SDK_REQUEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/splitmix64.h"
#include "proto/attention.pb.h"

namespace mha::client {

struct RequestOptions {
  std::string model;          // "" = the server's default model
  std::string model_version;  // "" = the newest version the server serves
  int64_t batch = 2;          // B
  int64_t num_queries = 4;    // Q
  int64_t num_keys = 6;       // K; 0 = self-attention (keys and values omitted, K = Q)
  std::vector<int32_t> valid_lens = {3, 2};  // empty, B or B*Q entries
  bool causal = false;
  bool return_attention = false;
  // Inputs SplitMix64(seed).Signed() in [-1, 1] (base/splitmix64.h): queries, then
  // keys, then values, each row-major, from one stream.
  uint64_t seed = 0;
  // Instead of generated inputs: one .safetensors (tensors "queries", optional "keys"
  // and "values", optional "valid_lens"; others ignored), or .npy files: one
  // (queries; self-attention) or three (queries, keys, values).
  std::vector<std::string> input_files;
};

// A usage error (status.h) naming the flag when the options contradict themselves:
// B or Q < 1, K < 0, or (without input files) valid_lens not B or B*Q entries.
absl::Status CheckRequestOptions(const RequestOptions& options);

// CheckRequestOptions' errors, then INVALID_ARGUMENT naming the flag or file when
// the inputs disagree with `model`'s sizes or with each other; valid_lens of a count
// that fits neither B nor B*Q of the input files is a usage error naming --valid_lens
// or the file they came from.
absl::StatusOr<attention::v1::AttendRequest> MakeRequest(const RequestOptions& options,
                                                         const attention::v1::ModelInfo& model);

// Appends `shape` to tensor->shape and prod(shape) values inputs.Signed(),
// row-major, to tensor->data: how every generated input is made (decode too).
void FillSigned(SplitMix64& inputs, const std::vector<int64_t>& shape,
                attention::v1::Tensor* tensor);

// "(2, 4, 100)".
std::string ShapeString(const attention::v1::Tensor& tensor);

// Query tokens in a request: B * Q.
int64_t TokenCount(const attention::v1::AttendRequest& request);

// The mask a request implies for batch row b, query q, key j (valid_lens, causal).
bool IsMasked(const attention::v1::AttendRequest& request, int64_t b, int64_t q, int64_t j);

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_REQUEST_H_
