// Shared helpers for the libFuzzer targets.
#ifndef MHA_TESTS_FUZZ_FUZZ_UTIL_H_
#define MHA_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"

// A broken invariant is a crash libFuzzer records with its input.
#define MHA_FUZZ_CHECK(condition, ...)                                        \
  do {                                                                        \
    if (!(condition)) {                                                       \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__,   \
                   #condition);                                               \
      std::fprintf(stderr, "" __VA_ARGS__);                                   \
      std::abort();                                                           \
    }                                                                         \
  } while (false)

namespace mha::fuzzing {

// Every refusal of a hostile input must be one of the codes the API documents for
// bad input, and carry a message a person can act on.
inline bool IsInputError(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kResourceExhausted:
      return !status.message().empty();
    default:
      return false;
  }
}

}  // namespace mha::fuzzing

#endif  // MHA_TESTS_FUZZ_FUZZ_UTIL_H_
