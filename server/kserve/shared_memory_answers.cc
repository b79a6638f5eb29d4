#include "server/kserve/shared_memory_answers.h"

#include <nlohmann/json.hpp>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/kserve/json_depth.h"
#include "server/serving/abbreviate.h"

namespace mha::server {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

absl::Status Unimplemented() {
  return absl::UnimplementedError(
      "system shared memory is off (attention_server --shared_memory=system serves it); send "
      "tensors in the request");
}

// What a JSON value is, for messages: its type, or a short rendering of a scalar.
std::string Describe(const Json& value) {
  if (value.is_object()) return "an object";
  if (value.is_array()) return "an array";
  return Abbreviate(value.dump(-1, ' ', false, Json::error_handler_t::replace));
}

absl::StatusOr<uint64_t> Unsigned(const Json& root, const char* field, bool required) {
  const auto it = root.find(field);
  if (it == root.end()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
    return 0;
  }
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  if (it->is_number_integer() && it->get<int64_t>() >= 0) {
    return static_cast<uint64_t>(it->get<int64_t>());
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected an integer >= 0, got ", Describe(*it)));
}

}  // namespace

absl::StatusOr<RegionSpec> ParseRegisterBody(absl::string_view name, absl::string_view body) {
  if (const size_t nul = body.find('\0'); nul != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("request body: invalid JSON: a NUL byte at offset ", nul));
  }
  MHA_RETURN_IF_ERROR(CheckJsonDepth(body));
  Json root = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError("request body: invalid JSON");
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request body: expected a JSON object, got ", Describe(root)));
  }
  RegionSpec spec{.name = std::string(name)};
  const auto key = root.find("key");
  if (key == root.end()) return absl::InvalidArgumentError("key: required");
  if (!key->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("key: expected a string, got ", Describe(*key)));
  }
  spec.key = key->get<std::string>();
  MHA_ASSIGN_OR_RETURN(spec.offset, Unsigned(root, "offset", false));
  MHA_ASSIGN_OR_RETURN(spec.byte_size, Unsigned(root, "byte_size", true));
  return spec;
}

absl::StatusOr<std::string> SharedMemoryStatusBody(const SharedMemoryRegistry* registry,
                                                   absl::string_view name) {
  if (registry == nullptr) return Unimplemented();
  MHA_ASSIGN_OR_RETURN(const std::vector<RegionSpec> regions, registry->Status(name));
  OrderedJson body = OrderedJson::array();
  for (const RegionSpec& region : regions) {
    OrderedJson entry = OrderedJson::object();
    entry["name"] = region.name;
    entry["key"] = region.key;
    entry["offset"] = region.offset;
    entry["byte_size"] = region.byte_size;
    body.push_back(std::move(entry));
  }
  return body.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

absl::Status SharedMemoryRegisterBody(SharedMemoryRegistry* registry, absl::string_view name,
                                      absl::string_view body, bool peer_is_loopback) {
  if (registry == nullptr) return Unimplemented();
  MHA_ASSIGN_OR_RETURN(const RegionSpec spec, ParseRegisterBody(name, body));
  return registry->Register(spec, peer_is_loopback);
}

absl::Status SharedMemoryUnregister(SharedMemoryRegistry* registry, absl::string_view name) {
  if (registry == nullptr) return Unimplemented();
  registry->Unregister(name);
  return absl::OkStatus();
}

}  // namespace mha::server
