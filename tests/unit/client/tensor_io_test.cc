#include "client/sdk/tensor_io.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace mha::client {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("mha_client_tensor_io_" + std::to_string(getpid()) + "_" + name))
      .string();
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(TensorIoTest, NpyRoundTrip) {
  const std::string path = TempPath("a.npy");
  const std::vector<float> data = {1.5f, -2.0f, 0.25f, 3.0f, 4.0f, -0.0f};
  ASSERT_TRUE(WriteNpy(path, {2, 3}, data).ok());
  std::ifstream file(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(file)), {});
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  EXPECT_EQ((bytes.size() - data.size() * 4) % 64, 0u) << "data is 64-byte aligned";
  EXPECT_NE(bytes.find("'descr': '<f4'"), std::string::npos);
  EXPECT_NE(bytes.find("'shape': (2, 3)"), std::string::npos);
  auto array = ReadNpy(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(array->values.size(), data.size());
  for (size_t i = 0; i < data.size(); ++i) EXPECT_EQ(array->values[i], data[i]);
  std::remove(path.c_str());
}

// A file as np.save writes it (v1.0, float64, 1-d).
TEST(TensorIoTest, ReadsNumpyFloat64AndRejectsFortranOrder) {
  std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }";
  header.append(128 - 10 - header.size() - 1, ' ');
  header += '\n';
  std::string bytes = std::string("\x93NUMPY\x01\x00", 8);
  bytes += static_cast<char>(header.size());
  bytes += '\0';
  bytes += header;
  const double values[3] = {0.5, -7.0, 1e-3};
  bytes.append(reinterpret_cast<const char*>(values), sizeof(values));
  const std::string path = TempPath("f8.npy");
  WriteBytes(path, bytes);
  auto array = ReadNpy(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(array->values, (std::vector<double>{0.5, -7.0, 1e-3}));

  const size_t at = bytes.find("False");
  bytes.replace(at, 5, "True ");
  WriteBytes(path, bytes);
  array = ReadNpy(path);
  EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(array.status().message().find("Fortran"), absl::string_view::npos);

  WriteBytes(path, bytes.substr(0, bytes.size() - 8));  // truncated data
  EXPECT_FALSE(ReadNpy(path).ok());
  WriteBytes(path, "not numpy");
  EXPECT_FALSE(ReadNpy(path).ok());
  std::remove(path.c_str());
  EXPECT_FALSE(ReadNpy(path).ok()) << "missing file";
}

TEST(TensorIoTest, SafetensorsRoundTrip) {
  const std::string path = TempPath("a.safetensors");
  const std::vector<float> q = {1, 2, 3, 4, 5, 6};
  const std::vector<int32_t> lens = {3, 0};
  ASSERT_TRUE(
      WriteSafetensors(path, {F32Entry("queries", {1, 2, 3}, q), I32Entry("valid_lens", {2}, lens)})
          .ok());
  std::ifstream file(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(file)), {});
  uint64_t header_len;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_len + 6 * 4 + 2 * 4);
  auto tensors = ReadSafetensors(path);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 2u);
  EXPECT_EQ(tensors->at("queries").shape, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(tensors->at("queries").values, (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(tensors->at("valid_lens").values, (std::vector<double>{3, 0}));

  // Offsets beyond the data: rejected naming the tensor.
  bytes.resize(bytes.size() - 4);
  WriteBytes(path, bytes);
  tensors = ReadSafetensors(path);
  ASSERT_FALSE(tensors.ok());
  EXPECT_NE(tensors.status().message().find("valid_lens"), absl::string_view::npos)
      << tensors.status();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace mha::client
