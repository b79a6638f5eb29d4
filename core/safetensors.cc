#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace mha::core {
namespace {

constexpr std::pair<absl::string_view, DType> kDTypes[] = {
    {"F64", DType::kF64}, {"F32", DType::kF32},  {"F16", DType::kF16}, {"BF16", DType::kBf16},
    {"I64", DType::kI64}, {"I32", DType::kI32},  {"I16", DType::kI16}, {"I8", DType::kI8},
    {"U8", DType::kU8},   {"BOOL", DType::kBool}};

// A header larger than this is not a weights file we should trust (the reference
// implementation caps it at 100 MB too).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while ((mant & 0x400) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  return std::bit_cast<float>(bits);
}

template <typename T>
T LoadLE(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the host is little-endian (x86-64, aarch64)
  return v;
}

absl::Status Invalid(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
}

// A file's JSON header and the data section after it.
struct Header {
  nlohmann::json json;
  const std::byte* data;  // tensor offsets count from here
  uint64_t data_size;
};

// The 8-byte little-endian header length, then that many bytes of JSON object.
absl::StatusOr<Header> ReadHeader(absl::string_view source, const std::byte* bytes, size_t size) {
  if (size < 8) {
    return Invalid(source, absl::StrCat("truncated: ", size,
                                        " bytes, a safetensors file starts with an 8-byte "
                                        "header length"));
  }
  const uint64_t header_len = LoadLE<uint64_t>(bytes);
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return Invalid(
        source, absl::StrCat("header length ", header_len, " exceeds the file (", size, " bytes)"));
  }
  const absl::string_view text(reinterpret_cast<const char*>(bytes + 8), header_len);
  Header header{.json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false),
                .data = bytes + 8 + header_len,
                .data_size = size - 8 - header_len};
  if (header.json.is_discarded() || !header.json.is_object()) {
    return Invalid(source, "header is not a JSON object");
  }
  return header;
}

// The "__metadata__" entry: an object of strings.
absl::Status ReadMetadata(absl::string_view source, const nlohmann::json& entry,
                          std::map<std::string, std::string>& metadata) {
  if (!entry.is_object()) return Invalid(source, "__metadata__ is not an object");
  for (const auto& [k, v] : entry.items()) {
    if (!v.is_string()) {
      return Invalid(source, absl::StrCat("__metadata__ \"", k, "\" is not a string"));
    }
    metadata[k] = v.get<std::string>();
  }
  return absl::OkStatus();
}

std::optional<DType> DTypeFromName(absl::string_view name) {
  for (const auto& [n, d] : kDTypes) {
    if (n == name) return d;
  }
  return std::nullopt;
}

// Appends the dims of `shape` to `dims` and returns the element count, or nullopt
// for a dim that is not an integer in 0..2^40. The count is checked against the
// data section before it can grow past it: a count above data_size is returned as
// data_size + 1, and the product never overflows.
std::optional<uint64_t> ReadShape(const nlohmann::json& shape, uint64_t data_size,
                                  std::vector<int64_t>& dims) {
  uint64_t elements = 1;
  for (const auto& d : shape) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (1ull << 40)) return std::nullopt;
    const uint64_t dim = d.get<uint64_t>();
    dims.push_back(static_cast<int64_t>(dim));
    if (dim != 0 && elements > data_size / dim) {
      elements = data_size + 1;
    } else {
      elements *= dim;
    }
  }
  return elements;
}

// One tensor's entry {"dtype", "shape", "data_offsets"}, checked against the data
// section: known dtype, offsets inside it, and a size that matches the shape.
absl::StatusOr<TensorView> ReadTensor(absl::string_view source, absl::string_view name,
                                      const nlohmann::json& entry, const Header& header) {
  auto bad = [&](absl::string_view what) {
    return Invalid(source, absl::StrCat("tensor \"", name, "\": ", what));
  };
  if (!entry.is_object()) return bad("entry is not an object");
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || !dtype_it->is_string()) return bad("missing \"dtype\"");
  if (shape_it == entry.end() || !shape_it->is_array()) return bad("missing \"shape\"");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return bad("\"data_offsets\" must be [begin, end]");
  }
  TensorView view{};
  const std::string dtype_name = dtype_it->get<std::string>();
  const std::optional<DType> dtype = DTypeFromName(dtype_name);
  if (!dtype) return bad(absl::StrCat("unknown dtype \"", dtype_name, "\""));
  view.dtype = *dtype;
  const uint64_t data_size = header.data_size;
  const std::optional<uint64_t> elements = ReadShape(*shape_it, data_size, view.shape);
  if (!elements) return bad("shape entries must be non-negative integers below 2^40");
  const auto& b = (*offsets_it)[0];
  const auto& e = (*offsets_it)[1];
  if (!b.is_number_unsigned() || !e.is_number_unsigned()) {
    return bad("data_offsets must be non-negative integers");
  }
  const uint64_t begin = b.get<uint64_t>(), end = e.get<uint64_t>();
  if (begin > end || end > data_size) {
    return bad(absl::StrCat("data_offsets [", begin, ", ", end,
                            "] out of range of the data section (", data_size, " bytes)"));
  }
  const size_t esize = DTypeSize(view.dtype);
  if (*elements > data_size || *elements * esize != end - begin) {
    return bad(absl::StrCat("shape [", absl::StrJoin(view.shape, ", "), "] of ", dtype_name,
                            " needs ", *elements * esize, " bytes, data_offsets give ",
                            end - begin));
  }
  view.data = header.data + begin;
  view.num_bytes = end - begin;
  return view;
}

// Tensors' [begin, end) byte ranges in the data section must not overlap.
absl::Status CheckNoOverlap(absl::string_view source,
                            std::vector<std::pair<uint64_t, uint64_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return Invalid(source, "tensor data ranges overlap");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view DTypeName(DType dtype) {
  for (const auto& [name, d] : kDTypes) {
    if (d == dtype) return name;
  }
  return "?";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBf16:
    case DType::kI16:
      return 2;
    case DType::kI8:
    case DType::kU8:
    case DType::kBool:
      return 1;
  }
  return 0;
}

int64_t TensorView::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::vector<float>> TensorView::ToFloat(absl::string_view name) const {
  const int64_t n = num_elements();
  std::vector<float> out(static_cast<size_t>(n));
  const size_t esize = DTypeSize(dtype);
  for (int64_t i = 0; i < n; ++i) {
    const std::byte* p = data + i * esize;
    switch (dtype) {
      case DType::kF32:
        out[i] = LoadLE<float>(p);
        break;
      case DType::kF64:
        out[i] = static_cast<float>(LoadLE<double>(p));
        break;
      case DType::kF16:
        out[i] = HalfToFloat(LoadLE<uint16_t>(p));
        break;
      case DType::kBf16:
        out[i] = std::bit_cast<float>(static_cast<uint32_t>(LoadLE<uint16_t>(p)) << 16);
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", name, "\": expected a float dtype (F32, F16, BF16, F64), got ",
            DTypeName(dtype)));
    }
  }
  return out;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->source_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    std::string msg = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::FailedPreconditionError(msg);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* map = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": mmap failed: ", std::strerror(err)));
    }
    file->map_ = map;
    file->map_size_ = file->size_;
    file->bytes_ = static_cast<const std::byte*>(map);
  }
  ::close(fd);
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBuffer(
    absl::string_view bytes) {
  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->source_ = "<buffer>";
  file->owned_.assign(bytes.data(), bytes.size());
  file->bytes_ = reinterpret_cast<const std::byte*>(file->owned_.data());
  file->size_ = file->owned_.size();
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

absl::StatusOr<TensorView> SafetensorsFile::Get(absl::string_view name) const {
  auto it = tensors_.find(std::string(name));
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(source_, ": no tensor \"", name, "\""));
  }
  return it->second;
}

absl::Status SafetensorsFile::Parse() {
  MHA_ASSIGN_OR_RETURN(const Header header, ReadHeader(source_, bytes_, size_));
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : header.json.items()) {
    if (name == "__metadata__") {
      MHA_RETURN_IF_ERROR(ReadMetadata(source_, entry, metadata_));
      continue;
    }
    MHA_ASSIGN_OR_RETURN(TensorView view, ReadTensor(source_, name, entry, header));
    const auto begin = static_cast<uint64_t>(view.data - header.data);
    ranges.emplace_back(begin, begin + view.num_bytes);
    tensors_.emplace(name, std::move(view));
  }
  return CheckNoOverlap(source_, std::move(ranges));
}

std::string SerializeSafetensors(const std::vector<NamedTensor>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const NamedTensor& t : tensors) {
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  std::memcpy(out.data(), &n, 8);
  out += text;
  for (const NamedTensor& t : tensors) out += t.bytes;
  return out;
}

NamedTensor F32Tensor(std::string name, std::vector<int64_t> shape,
                      const std::vector<float>& values) {
  std::string bytes(values.size() * sizeof(float), '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return {std::move(name), DType::kF32, std::move(shape), std::move(bytes)};
}

}  // namespace mha::core
