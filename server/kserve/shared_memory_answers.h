// The HTTP routes of Triton's system shared memory extension, transport-neutral:
// what each route answers, for the HTTP front to call (it routes, maps the status
// to an HTTP code, server/kserve_http/http_front.h, and checks the shared-memory
// restricted group first). The gRPC front answers the same calls from
// server/serving/shared_memory.h directly (server/kserve_grpc/inference_service.h).
//
//   GET  /v2/systemsharedmemory[/region/{name}]/status
//        SharedMemoryStatusBody(registry, name or "") -> 200 with the body, a JSON
//        array of {"name", "key", "offset", "byte_size"} by name; NOT_FOUND (404)
//        naming an unknown name
//   POST /v2/systemsharedmemory/region/{name}/register
//        SharedMemoryRegisterBody(registry, name, body, peer_is_loopback) -> 200 {}
//        or the error: INVALID_ARGUMENT naming the body's field, ALREADY_EXISTS
//        (Triton answers it with 400), PERMISSION_DENIED, RESOURCE_EXHAUSTED
//        (server/serving/shared_memory.h has the checks)
//   POST /v2/systemsharedmemory[/region/{name}]/unregister
//        SharedMemoryUnregister(registry, name or "") -> OK always (an unknown
//        name succeeds, as in Triton)
// With registry == nullptr (--shared_memory=none) each is UNIMPLEMENTED naming the
// flag.
//
// The register body: a JSON object with "key" (a string, required), "offset" (an
// integer >= 0, default 0) and "byte_size" (an integer >= 1, required); other keys
// are ignored; nested at most 32 deep; INVALID_ARGUMENT naming the field, e.g.
//   byte_size: expected an integer >= 0, got "16"
//
// Thread safety: thread-safe (the registry is).
#ifndef MHA_SERVER_KSERVE_SHARED_MEMORY_ANSWERS_H_
#define MHA_SERVER_KSERVE_SHARED_MEMORY_ANSWERS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/serving/shared_memory.h"

namespace mha::server {

absl::StatusOr<std::string> SharedMemoryStatusBody(const SharedMemoryRegistry* registry,
                                                   absl::string_view name);
absl::Status SharedMemoryRegisterBody(SharedMemoryRegistry* registry, absl::string_view name,
                                      absl::string_view body, bool peer_is_loopback);
absl::Status SharedMemoryUnregister(SharedMemoryRegistry* registry, absl::string_view name);

// The register body's fields (above) into a RegionSpec named `name`; no registry.
absl::StatusOr<RegionSpec> ParseRegisterBody(absl::string_view name, absl::string_view body);

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_SHARED_MEMORY_ANSWERS_H_
