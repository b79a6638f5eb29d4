// Client-supplied text quoted in error messages (model names, request ids) is
// abbreviated: a status message travels in HTTP/2 trailers, and gRPC clients refuse
// metadata over 8 KiB by default, so an echoed megabyte would replace the real error
// with "metadata size exceeds limit".
//
//   Abbreviate("abc", 8)                  == "abc"
//   Abbreviate(std::string(100, 'x'), 8)  == "xxxxxxxx... (100 bytes)"
#ifndef MHA_SERVER_SERVING_ABBREVIATE_H_
#define MHA_SERVER_SERVING_ABBREVIATE_H_

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace mha::server {

// Longest client string quoted in a message, and longest message sent.
inline constexpr size_t kMaxQuotedBytes = 64;
inline constexpr size_t kMaxStatusMessageBytes = 1024;

// `text` if it fits in `max_bytes`, else its first <= max_bytes bytes (cut at a UTF-8
// character boundary) followed by "... (N bytes)".
inline std::string Abbreviate(absl::string_view text, size_t max_bytes = kMaxQuotedBytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xc0) == 0x80) --cut;
  return absl::StrCat(text.substr(0, cut), "... (", text.size(), " bytes)");
}

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_ABBREVIATE_H_
