#include "client/sdk/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/sdk/status.h"
#include "proto/inference/grpc_service.grpc.pb.h"

namespace mha::client {
namespace {

constexpr uint64_t kAlign = 64;

uint64_t Aligned(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

void SetParameters(google::protobuf::Map<std::string, inference::InferParameter>* parameters,
                   const std::string& region, uint64_t bytes, uint64_t offset) {
  (*parameters)["shared_memory_region"].set_string_param(region);
  (*parameters)["shared_memory_byte_size"].set_int64_param(static_cast<int64_t>(bytes));
  (*parameters)["shared_memory_offset"].set_int64_param(static_cast<int64_t>(offset));
}

int64_t Dim(const inference::ModelInferRequest::InferInputTensor& tensor, int i) {
  return i < tensor.shape_size() ? tensor.shape(i) : 0;
}

}  // namespace

OutputSizes OutputSizesOf(const inference::ModelInferRequest& request, int64_t num_hiddens,
                          int64_t num_heads) {
  int64_t b = 0, q = 0, k = -1;
  for (const auto& input : request.inputs()) {
    if (input.name() == "queries") {
      b = Dim(input, 0);
      q = Dim(input, 1);
    } else if (input.name() == "keys") {
      k = Dim(input, 1);
    }
  }
  if (k < 0) k = q;
  OutputSizes sizes;
  for (const auto& output : request.outputs()) {
    const int64_t elements = output.name() == "attention" ? b * num_heads * q * k
                             : output.name() == "lse"     ? b * num_heads * q
                                                          : b * q * num_hiddens;
    sizes.emplace_back(output.name(), static_cast<uint64_t>(elements) * sizeof(float));
  }
  if (sizes.empty()) {
    sizes.emplace_back("output", static_cast<uint64_t>(b * q * num_hiddens) * sizeof(float));
  }
  return sizes;
}

uint64_t SharedMemoryBytes(const inference::ModelInferRequest& request,
                           const OutputSizes& outputs) {
  uint64_t bytes = 0;
  for (const std::string& raw : request.raw_input_contents()) bytes += Aligned(raw.size());
  for (const auto& [name, size] : outputs) bytes += Aligned(size);
  return bytes == 0 ? kAlign : bytes;
}

absl::StatusOr<std::unique_ptr<SharedMemorySlot>> SharedMemorySlot::Create(
    std::shared_ptr<grpc::Channel> channel, uint64_t bytes, absl::Duration timeout) {
  static std::atomic<int> counter{0};
  std::string name;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    name = absl::StrCat("mha_client_", getpid(), "_", counter++);
    fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("shm_open(\"/", name, "\"): ", std::strerror(errno)));
  }
  const std::string key = "/" + name;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    close(fd);
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate(\"", key, "\", ", bytes, "): ", std::strerror(error),
                     " (is /dev/shm large enough? docs/deploy.md, \"Shared memory\")"));
  }
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  inference::SystemSharedMemoryRegisterRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(0);
  request.set_byte_size(bytes);
  inference::SystemSharedMemoryRegisterResponse response;
  const grpc::Status status = stub->SystemSharedMemoryRegister(&context, request, &response);
  shm_unlink(key.c_str());  // registered or not: nothing is left behind
  if (!status.ok()) {
    close(fd);
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("SystemSharedMemoryRegister: ", status.error_message()));
  }
  return std::unique_ptr<SharedMemorySlot>(
      new SharedMemorySlot(std::move(channel), name, fd, bytes, timeout));
}

SharedMemorySlot::~SharedMemorySlot() {
  auto stub = inference::GRPCInferenceService::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  inference::SystemSharedMemoryUnregisterRequest request;
  request.set_name(name_);
  inference::SystemSharedMemoryUnregisterResponse response;
  (void)stub->SystemSharedMemoryUnregister(&context, request, &response);
  close(fd_);
}

absl::StatusOr<inference::ModelInferRequest> SharedMemorySlot::Place(
    const inference::ModelInferRequest& request, const OutputSizes& outputs) {
  if (request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError("shared memory: every input must be raw");
  }
  inference::ModelInferRequest placed = request;
  placed.clear_raw_input_contents();
  placed.clear_outputs();
  uint64_t at = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const std::string& raw = request.raw_input_contents(i);
    if (at + raw.size() > bytes_) {
      return absl::InvalidArgumentError("shared memory: the region is too small");
    }
    if (!raw.empty() && pwrite(fd_, raw.data(), raw.size(), static_cast<off_t>(at)) !=
                            static_cast<ssize_t>(raw.size())) {
      return absl::InternalError(absl::StrCat("pwrite: ", std::strerror(errno)));
    }
    SetParameters(placed.mutable_inputs(i)->mutable_parameters(), name_, raw.size(), at);
    at += Aligned(raw.size());
  }
  output_offsets_.clear();
  for (const auto& [name, size] : outputs) {
    if (at + size > bytes_) {
      return absl::InvalidArgumentError("shared memory: the region is too small");
    }
    auto* output = placed.add_outputs();
    output->set_name(name);
    SetParameters(output->mutable_parameters(), name_, size, at);
    output_offsets_.emplace_back(name, at);
    at += Aligned(size);
  }
  return placed;
}

absl::Status SharedMemorySlot::FillOutputs(inference::ModelInferResponse* response) const {
  for (int i = 0; i < response->outputs_size() && i < response->raw_output_contents_size(); ++i) {
    auto* output = response->mutable_outputs(i);
    auto& parameters = *output->mutable_parameters();
    if (!parameters.contains("shared_memory_region")) continue;
    uint64_t offset = 0;
    bool found = false;
    for (const auto& [name, at] : output_offsets_) {
      if (name == output->name()) {
        offset = at;
        found = true;
      }
    }
    if (!found) {
      return absl::InternalError(absl::StrCat("output ", output->name(), " was not placed"));
    }
    int64_t elements = 1;
    for (int64_t d : output->shape()) elements *= d;
    std::string* raw = response->mutable_raw_output_contents(i);
    raw->resize(static_cast<size_t>(elements) * sizeof(float));
    if (pread(fd_, raw->data(), raw->size(), static_cast<off_t>(offset)) !=
        static_cast<ssize_t>(raw->size())) {
      return absl::InternalError(absl::StrCat("pread: ", std::strerror(errno)));
    }
    parameters.erase("shared_memory_region");
    parameters.erase("shared_memory_byte_size");
    parameters.erase("shared_memory_offset");
  }
  return absl::OkStatus();
}

}  // namespace mha::client
