#include "client/sdk/tensor_io.h"

#include <bit>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/sdk/status.h"
#include "nlohmann/json.hpp"

namespace mha::client {
namespace {

static_assert(std::endian::native == std::endian::little, "little-endian hosts only");

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open the file"));
  std::stringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

absl::Status WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  file.close();
  if (!file) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot write the file"));
  return absl::OkStatus();
}

// Element count of `shape`, or -1 if a dimension is negative or the product overflows.
int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > (int64_t{1} << 62) / d)) return -1;
    n *= d;
  }
  return n;
}

template <typename T>
void Convert(const char* bytes, int64_t n, std::vector<double>* out) {
  out->resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    T value;
    std::memcpy(&value, bytes + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
    (*out)[static_cast<size_t>(i)] = static_cast<double>(value);
  }
}

// Decodes `n` values of `dtype` ("F32", "F64", "I32", "I64"); false if unknown.
bool Decode(absl::string_view dtype, const char* bytes, int64_t n, std::vector<double>* out) {
  if (dtype == "F32") {
    Convert<float>(bytes, n, out);
  } else if (dtype == "F64") {
    Convert<double>(bytes, n, out);
  } else if (dtype == "I32") {
    Convert<int32_t>(bytes, n, out);
  } else if (dtype == "I64") {
    Convert<int64_t>(bytes, n, out);
  } else {
    return false;
  }
  return true;
}

size_t DTypeSize(absl::string_view dtype) {
  return dtype == "F64" || dtype == "I64" ? 8 : dtype == "F32" || dtype == "I32" ? 4 : 0;
}

// The value text after 'key': in a .npy header dict.
absl::StatusOr<std::string> NpyField(absl::string_view header, absl::string_view key,
                                     const std::string& path) {
  const std::string quoted = absl::StrCat("'", key, "':");
  const size_t at = header.find(quoted);
  if (at == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": .npy header has no '", key, "'"));
  }
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(header.substr(at + quoted.size()));
  size_t end = 0;
  if (absl::StartsWith(rest, "(")) {
    end = rest.find(')') + 1;
  } else if (absl::StartsWith(rest, "'")) {
    end = rest.find('\'', 1) + 1;
  } else {
    end = rest.find_first_of(",}");
  }
  if (end == 0 || end == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad .npy header field '", key, "'"));
  }
  return std::string(rest.substr(0, end));
}

}  // namespace

absl::StatusOr<Array> ReadNpy(const std::string& path) {
  MHA_ASSIGN_OR_RETURN(const std::string bytes, ReadFile(path));
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a .npy file (bad magic)"));
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) |
                 (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    offset = 10;
  } else if ((major == 2 || major == 3) && bytes.size() >= 12) {
    uint32_t len;
    std::memcpy(&len, bytes.data() + 8, 4);
    header_len = len;
    offset = 12;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported .npy version ", major));
  }
  if (offset + header_len > bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated .npy header"));
  }
  const absl::string_view header(bytes.data() + offset, header_len);
  MHA_ASSIGN_OR_RETURN(std::string descr, NpyField(header, "descr", path));
  MHA_ASSIGN_OR_RETURN(std::string fortran, NpyField(header, "fortran_order", path));
  MHA_ASSIGN_OR_RETURN(std::string shape_text, NpyField(header, "shape", path));
  descr = std::string(absl::StripSuffix(absl::StripPrefix(descr, "'"), "'"));
  const std::map<std::string, std::string> dtypes = {{"<f4", "F32"}, {"=f4", "F32"}, {"<f8", "F64"},
                                                     {"=f8", "F64"}, {"<i4", "I32"}, {"=i4", "I32"},
                                                     {"<i8", "I64"}, {"=i8", "I64"}};
  const auto dtype = dtypes.find(descr);
  if (dtype == dtypes.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": dtype ", descr, " not supported (expected float32, float64, int32 or int64)"));
  }
  if (fortran != "False") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": Fortran-order array; save a C-order one (np.ascontiguousarray)"));
  }
  Array array;
  for (absl::string_view part :
       absl::StrSplit(absl::StripSuffix(absl::StripPrefix(shape_text, "("), ")"), ',',
                      absl::SkipWhitespace())) {
    int64_t dim = 0;
    if (!absl::SimpleAtoi(part, &dim)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad shape ", shape_text));
    }
    array.shape.push_back(dim);
  }
  const int64_t n = NumElements(array.shape);
  const size_t data_offset = offset + header_len;
  if (n < 0 || static_cast<size_t>(n) * DTypeSize(dtype->second) != bytes.size() - data_offset) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": shape ", shape_text, " needs ", n,
                                                   " values, the file holds ",
                                                   bytes.size() - data_offset, " bytes of data"));
  }
  Decode(dtype->second, bytes.data() + data_offset, n, &array.values);
  return array;
}

absl::Status WriteNpy(const std::string& path, const std::vector<int64_t>& shape,
                      absl::Span<const float> data) {
  const int64_t n = NumElements(shape);
  if (n < 0 || static_cast<size_t>(n) != data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": shape needs ", n, " values, got ", data.size()));
  }
  std::string dims = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) dims += ",";
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  // The data starts at a multiple of 64 bytes; the header ends with '\n'.
  const size_t total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.append(total - 10 - header.size() - 1, ' ');
  header += '\n';
  std::string bytes = "\x93NUMPY\x01";
  bytes += '\0';
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>((header.size() >> 8) & 0xff);
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
  return WriteFile(path, bytes);
}

absl::StatusOr<std::map<std::string, Array>> ReadSafetensors(const std::string& path) {
  MHA_ASSIGN_OR_RETURN(const std::string bytes, ReadFile(path));
  uint64_t header_len = 0;
  if (bytes.size() < 8) return absl::InvalidArgumentError(absl::StrCat(path, ": file too short"));
  std::memcpy(&header_len, bytes.data(), 8);
  if (header_len > bytes.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_len,
                                                   " exceeds the file size ", bytes.size()));
  }
  const nlohmann::json header =
      nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_len),
                            nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not a JSON object"));
  }
  const size_t data_start = 8 + header_len;
  const size_t data_size = bytes.size() - data_start;
  std::map<std::string, Array> tensors;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = absl::StrCat(path, ": tensor ", name);
    if (!info.is_object() || !info.contains("dtype") || !info["dtype"].is_string() ||
        !info.contains("shape") || !info["shape"].is_array() || !info.contains("data_offsets") ||
        !info["data_offsets"].is_array() || info["data_offsets"].size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected {dtype, shape, data_offsets}"));
    }
    const std::string dtype = info["dtype"].get<std::string>();
    if (DTypeSize(dtype) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": dtype ", dtype, " not supported (F32, F64, I32, I64)"));
    }
    Array array;
    for (const auto& dim : info["shape"]) {
      if (!dim.is_number_integer()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": bad shape"));
      }
      array.shape.push_back(dim.get<int64_t>());
    }
    const auto& offsets = info["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": bad data_offsets"));
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    const int64_t n = NumElements(array.shape);
    if (begin > end || end > data_size || n < 0 ||
        static_cast<uint64_t>(n) * DTypeSize(dtype) != end - begin) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": data_offsets [", begin, ", ", end, ") do not hold shape (",
          absl::StrJoin(array.shape, ", "), ") of ", dtype, " within ", data_size, " data bytes"));
    }
    Decode(dtype, bytes.data() + data_start + begin, n, &array.values);
    tensors.emplace(name, std::move(array));
  }
  return tensors;
}

SafetensorsEntry F32Entry(std::string name, std::vector<int64_t> shape,
                          absl::Span<const float> values) {
  return {std::move(name), "F32", std::move(shape),
          std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float))};
}

SafetensorsEntry I32Entry(std::string name, std::vector<int64_t> shape,
                          absl::Span<const int32_t> values) {
  return {
      std::move(name), "I32", std::move(shape),
      std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int32_t))};
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsEntry>& entries) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const SafetensorsEntry& entry : entries) {
    const int64_t n = NumElements(entry.shape);
    if (n < 0 || static_cast<uint64_t>(n) * DTypeSize(entry.dtype) != entry.bytes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", entry.name, ": bytes disagree with its shape"));
    }
    header[entry.name] = {{"dtype", entry.dtype},
                          {"shape", entry.shape},
                          {"data_offsets", {data.size(), data.size() + entry.bytes.size()}}};
    data += entry.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data 8-byte aligned, as safetensors writes
  const uint64_t len = text.size();
  std::string bytes(reinterpret_cast<const char*>(&len), 8);
  bytes += text;
  bytes += data;
  return WriteFile(path, bytes);
}

}  // namespace mha::client
