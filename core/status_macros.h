// Status propagation helpers. Abseil 20220623 ships neither RETURN_IF_ERROR nor
// ASSIGN_OR_RETURN, so they are defined once here, as Triton's status.h does.
#ifndef MHA_CORE_STATUS_MACROS_H_
#define MHA_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MHA_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    const ::absl::Status mha_status_ = (expr);     \
    if (!mha_status_.ok()) return mha_status_;     \
  } while (false)

#define MHA_CONCAT_INNER_(a, b) a##b
#define MHA_CONCAT_(a, b) MHA_CONCAT_INNER_(a, b)

// MHA_ASSIGN_OR_RETURN(auto x, MakeX());
#define MHA_ASSIGN_OR_RETURN(lhs, expr) \
  MHA_ASSIGN_OR_RETURN_IMPL_(MHA_CONCAT_(mha_statusor_, __LINE__), lhs, expr)
#define MHA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)

#endif  // MHA_CORE_STATUS_MACROS_H_
