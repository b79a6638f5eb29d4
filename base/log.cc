#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mha::log {
namespace {

std::atomic<Format> g_format{Format::kText};
std::atomic<int> g_verbosity{0};

void WriteLine(std::string line) {
  line.push_back('\n');
  const char* data = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, data, left);
    if (n <= 0) return;
    data += n;
    left -= static_cast<size_t>(n);
  }
}

std::string Now() {
  return absl::FormatTime("%Y-%m-%d%ET%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
}

void Emit(absl::string_view level, absl::string_view text_prefix, absl::string_view source,
          absl::string_view message) {
  if (g_format.load(std::memory_order_relaxed) == Format::kText) {
    WriteLine(absl::StrCat(text_prefix, source, source.empty() ? "" : ": ", message));
    return;
  }
  WriteLine(absl::StrCat("{\"time\":\"", Now(), "\",\"level\":\"", level, "\"",
                         source.empty() ? "" : absl::StrCat(",\"source\":", JsonString(source)),
                         ",\"msg\":", JsonString(message), "}"));
}

bool NeedsQuotes(absl::string_view text) {
  if (text.empty()) return true;
  for (const char c : text) {
    if (c == ' ' || c == '"' || c == '=' || static_cast<unsigned char>(c) < 0x20) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<Format> ParseFormat(absl::string_view name) {
  if (name == "text") return Format::kText;
  if (name == "json") return Format::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("log_format: expected text or json, got \"", name, "\""));
}

void Configure(Format format, int verbosity) {
  g_format.store(format);
  g_verbosity.store(verbosity);
}
Format format() { return g_format.load(std::memory_order_relaxed); }
int verbosity() { return g_verbosity.load(std::memory_order_relaxed); }

void Info(absl::string_view message) { Emit("info", "", "", message); }
void Warning(absl::string_view message) { Emit("warning", "warning: ", "", message); }
void Error(absl::string_view message) { Emit("error", "error: ", "", message); }

void Verbose(int level, absl::string_view source, absl::string_view message) {
  if (verbosity() < level) return;
  Emit(level <= 1 ? "info" : "debug", "", source, message);
}

void Access(std::initializer_list<Field> fields) {
  const bool json = format() == Format::kJson;
  std::string line =
      json ? absl::StrCat("{\"time\":\"", Now(), "\",\"level\":\"info\",\"log\":\"access\"")
           : absl::StrCat("access time=", Now());
  for (const auto& [key, value] : fields) {
    absl::StrAppend(&line, json ? absl::StrCat(",\"", key, "\":") : absl::StrCat(" ", key, "="));
    if (const int64_t* number = std::get_if<int64_t>(&value)) {
      absl::StrAppend(&line, *number);
    } else {
      const std::string& text = std::get<std::string>(value);
      absl::StrAppend(&line, json || NeedsQuotes(text) ? JsonString(text) : text);
    }
  }
  if (json) line.push_back('}');
  WriteLine(std::move(line));
}

std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<int>(c));
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace mha::log
