// A read-only view of a .safetensors file (the format PyTorch users export with
// safetensors.torch.save_file): 8 bytes little-endian header length N, N bytes of
// JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {}},
// then the tensor bytes, offsets relative to the end of the header.
//
// The file is memory-mapped, never copied: tensor(...).data points into the map and
// lives as long as the SafetensorsFile. Every structural fault (short file, bad JSON,
// unknown dtype, offsets out of range or overlapping, shape/size mismatch) is an
// INVALID_ARGUMENT naming the file and the tensor. Thread-safe after Open (read-only).
#ifndef MHA_CORE_SAFETENSORS_H_
#define MHA_CORE_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha::core {

enum class DType { kF64, kF32, kF16, kBf16, kI64, kI32, kI16, kI8, kU8, kBool };

absl::string_view DTypeName(DType dtype);  // the safetensors spelling, e.g. "F32"
size_t DTypeSize(DType dtype);

struct TensorView {
  DType dtype;
  std::vector<int64_t> shape;
  const std::byte* data;  // into the mapped file; unaligned in general
  size_t num_bytes;

  int64_t num_elements() const;
  // Copies the tensor into float32. F32, F16, BF16 and F64 convert; any other
  // dtype is INVALID_ARGUMENT naming `name`.
  absl::StatusOr<std::vector<float>> ToFloat(absl::string_view name) const;
};

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Parses an in-memory image (same checks as Open); the bytes are copied once.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBuffer(absl::string_view bytes);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // NOT_FOUND naming the tensor when absent.
  absl::StatusOr<TensorView> Get(absl::string_view name) const;
  const std::string& source() const { return source_; }

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  std::string source_;   // path, or "<buffer>"
  void* map_ = nullptr;  // mmap base, when mapped
  size_t map_size_ = 0;
  std::string owned_;  // the bytes, when built from a buffer
  const std::byte* bytes_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors as a safetensors file (used by tests and tools to make fixtures).
struct NamedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::string bytes;  // raw little-endian data
};
std::string SerializeSafetensors(const std::vector<NamedTensor>& tensors,
                                 const std::map<std::string, std::string>& metadata = {});
NamedTensor F32Tensor(std::string name, std::vector<int64_t> shape,
                      const std::vector<float>& values);

}  // namespace mha::core

#endif  // MHA_CORE_SAFETENSORS_H_
