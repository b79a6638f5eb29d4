// The model lookup the serving layer needs, declared here and implemented by the
// models layer (server/models/model_repository.h), so that this layer never sees
// how models are read, versioned or reloaded.
#ifndef MHA_SERVER_SERVING_MODEL_SOURCE_H_
#define MHA_SERVER_SERVING_MODEL_SOURCE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/serving/model.h"

namespace mha::server {

class ModelSource {
 public:
  virtual ~ModelSource() = default;

  // The model served as `name` and `version`: name "" resolves to "default" if
  // served, else to the only model; version "" to its newest version served.
  // NOT_FOUND naming the model or the version; INVALID_ARGUMENT when "" is
  // ambiguous. The reference keeps the model alive for as long as it is held.
  virtual absl::StatusOr<std::shared_ptr<const Model>> Find(absl::string_view name,
                                                            absl::string_view version) const = 0;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_MODEL_SOURCE_H_
