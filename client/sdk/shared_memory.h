// Triton's system shared memory from the client side (attention_client
// --shared_memory=system over --protocol=kserve): a POSIX shared-memory region per
// in-flight request, holding its inputs and then its outputs, so that tensors do
// not cross the socket. The server must run with --shared_memory=system on the
// same host (docs/service.md, "System shared memory").
//
//   auto slot = SharedMemorySlot::Create(channel, SharedMemoryBytes(infer, outputs),
//                                        absl::Seconds(10)).value();
//   ModelInferRequest by_region = slot->Place(infer, outputs).value();
//   ... ModelInfer(by_region) ... slot->FillOutputs(&response);   // as if inline
//
// A slot's file is created (mode 0600, an unused "/mha_client_<pid>_<n>"), registered
// under the same name, then unlinked at once: the server's descriptor keeps it alive,
// so a client killed mid-run leaves nothing in /dev/shm (the server drops it at its
// own unregister or exit). The destructor unregisters it (best effort).
// Layout: inputs first, then outputs, each at a 64-byte-aligned offset.
//
// Thread safety: a slot serves one request at a time.
#ifndef MHA_CLIENT_SDK_SHARED_MEMORY_H_
#define MHA_CLIENT_SDK_SHARED_MEMORY_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/inference/grpc_service.pb.h"

namespace mha::client {

// The outputs a request asks for and the bytes of each.
using OutputSizes = std::vector<std::pair<std::string, uint64_t>>;

// What `request`'s outputs are, in bytes, for a model of `num_hiddens` features and
// `num_heads` heads (FP32: output [B, Q, p_o], attention [B, h, Q, K]).
OutputSizes OutputSizesOf(const inference::ModelInferRequest& request, int64_t num_hiddens,
                          int64_t num_heads);
// The region bytes `request` (raw inputs) and `outputs` take, aligned as placed.
uint64_t SharedMemoryBytes(const inference::ModelInferRequest& request, const OutputSizes& outputs);

class SharedMemorySlot {
 public:
  // Creates, registers (SystemSharedMemoryRegister, deadline `timeout`) and unlinks
  // a region of `bytes`. The server's errors keep their code, prefixed with
  // "SystemSharedMemoryRegister: ".
  static absl::StatusOr<std::unique_ptr<SharedMemorySlot>> Create(
      std::shared_ptr<grpc::Channel> channel, uint64_t bytes, absl::Duration timeout);
  ~SharedMemorySlot();
  SharedMemorySlot(const SharedMemorySlot&) = delete;
  SharedMemorySlot& operator=(const SharedMemorySlot&) = delete;

  const std::string& name() const { return name_; }
  uint64_t bytes() const { return bytes_; }

  // `request` with its raw inputs written into the region and named by it (no
  // raw_input_contents), and `outputs` (in that order) placed after them.
  absl::StatusOr<inference::ModelInferRequest> Place(const inference::ModelInferRequest& request,
                                                     const OutputSizes& outputs);
  // Reads each shared-memory output of `response` back into its
  // raw_output_contents entry (and drops its shared_memory_* parameters), so that
  // it reads as an inline response.
  absl::Status FillOutputs(inference::ModelInferResponse* response) const;

 private:
  SharedMemorySlot(std::shared_ptr<grpc::Channel> channel, std::string name, int fd, uint64_t bytes,
                   absl::Duration timeout)
      : channel_(std::move(channel)),
        name_(std::move(name)),
        fd_(fd),
        bytes_(bytes),
        timeout_(timeout) {}

  std::shared_ptr<grpc::Channel> channel_;
  std::string name_;
  int fd_;
  uint64_t bytes_;
  absl::Duration timeout_;
  std::vector<std::pair<std::string, uint64_t>> output_offsets_;  // by Place
};

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_SHARED_MEMORY_H_
