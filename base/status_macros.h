// Status propagation for every target (core, server, client, tests). Abseil
// 20220623 ships neither RETURN_IF_ERROR nor ASSIGN_OR_RETURN, so the two are
// defined once here.
//
//   absl::StatusOr<int> Parse(std::string_view s);
//   absl::Status Use(std::string_view s) {
//     MHA_ASSIGN_OR_RETURN(const int n, Parse(s));
//     MHA_RETURN_IF_ERROR(Check(n));
//     return absl::OkStatus();
//   }
#ifndef MHA_BASE_STATUS_MACROS_H_
#define MHA_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MHA_RETURN_IF_ERROR(expr)              \
  do {                                         \
    const ::absl::Status mha_status_ = (expr); \
    if (!mha_status_.ok()) return mha_status_; \
  } while (false)

#define MHA_CONCAT_INNER_(a, b) a##b
#define MHA_CONCAT_(a, b) MHA_CONCAT_INNER_(a, b)

// MHA_ASSIGN_OR_RETURN(auto x, MakeX());
#define MHA_ASSIGN_OR_RETURN(lhs, expr) \
  MHA_ASSIGN_OR_RETURN_IMPL_(MHA_CONCAT_(mha_statusor_, __LINE__), lhs, expr)
#define MHA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)    \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)

#endif  // MHA_BASE_STATUS_MACROS_H_
