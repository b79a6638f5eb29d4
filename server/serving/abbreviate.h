// Client-supplied text quoted in error messages (model names, request ids) is
// abbreviated: a status message travels in HTTP/2 trailers, and gRPC clients refuse
// metadata over 8 KiB by default, so an echoed megabyte would replace the real error
// with "metadata size exceeds limit".
//
//   Abbreviate("abc", 8)                  == "abc"
//   Abbreviate(std::string(100, 'x'), 8)  == "xxxxxxxx... (100 bytes)"
//
// Every error message a front sends (gRPC status, ModelStreamInfer's error_message,
// an HTTP {"error": ...} body) goes through CapMessage: at most
// kMaxStatusMessageBytes bytes, the "... (N bytes)" tail included.
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

// `message` if it fits in kMaxStatusMessageBytes, else its start (cut at a UTF-8
// character boundary) and "... (N bytes)", kMaxStatusMessageBytes bytes at most.
inline std::string CapMessage(absl::string_view message) {
  if (message.size() <= kMaxStatusMessageBytes) return std::string(message);
  const std::string tail = absl::StrCat("... (", message.size(), " bytes)");
  size_t cut = kMaxStatusMessageBytes - tail.size();
  while (cut > 0 && (static_cast<unsigned char>(message[cut]) & 0xc0) == 0x80) --cut;
  return absl::StrCat(message.substr(0, cut), tail);
}

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_ABBREVIATE_H_
