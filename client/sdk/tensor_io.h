// Arrays in the files PyTorch and NumPy users already have: .npy (np.save) and
// .safetensors (safetensors.torch.save_file). Little-endian, C (row-major) order.
//
//   auto q = ReadNpy("queries.npy");                // shape (2, 4, 100), any of f4/f8/i4/i8
//   WriteNpy("out.npy", {2, 4, 100}, output);      // float32
//   WriteSafetensors("run.safetensors", {F32Entry("output", {2, 4, 100}, output)});
//
// Reads load the whole file; every fault (short file, bad header, unsupported dtype,
// sizes that disagree) is INVALID_ARGUMENT naming the file (and the tensor).
#ifndef MHA_CLIENT_SDK_TENSOR_IO_H_
#define MHA_CLIENT_SDK_TENSOR_IO_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace mha::client {

// An array read from a file; values converted to double (exact for f32 and i32).
struct Array {
  std::vector<int64_t> shape;
  std::vector<double> values;
};

// Accepts descr <f4, <f8, <i4, <i8 (or their native '=' / '|' spellings), C order.
absl::StatusOr<Array> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const std::vector<int64_t>& shape,
                      absl::Span<const float> data);

// Tensors by name; dtypes F32, F64, I32, I64. "__metadata__" is skipped.
absl::StatusOr<std::map<std::string, Array>> ReadSafetensors(const std::string& path);

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32" or "I32"
  std::vector<int64_t> shape;
  std::string bytes;  // little-endian
};
SafetensorsEntry F32Entry(std::string name, std::vector<int64_t> shape,
                          absl::Span<const float> values);
SafetensorsEntry I32Entry(std::string name, std::vector<int64_t> shape,
                          absl::Span<const int32_t> values);
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsEntry>& entries);

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_TENSOR_IO_H_
