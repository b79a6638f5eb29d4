#include "server/kserve_http/http1.h"

#include <algorithm>
#include <charconv>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/serving/abbreviate.h"

namespace mha::server::http1 {
namespace {

// RFC 9110 §5.6.2 tchar.
bool IsTokenChar(unsigned char c) {
  if (absl::ascii_isalnum(c)) return true;
  switch (c) {
    case '!':
    case '#':
    case '$':
    case '%':
    case '&':
    case '\'':
    case '*':
    case '+':
    case '-':
    case '.':
    case '^':
    case '_':
    case '`':
    case '|':
    case '~':
      return true;
    default:
      return false;
  }
}

bool IsToken(absl::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return IsTokenChar(static_cast<unsigned char>(c));
  });
}

// A field value's characters: VCHAR, obs-text, SP and HTAB (RFC 9110 §5.5).
bool IsFieldValue(absl::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c == '\t' || (c >= 0x20 && c != 0x7f);
  });
}

absl::string_view TrimOws(absl::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Every comma-separated element of the header's values, trimmed, empty ones skipped.
std::vector<absl::string_view> ListOf(const RequestHead& head, absl::string_view name) {
  std::vector<absl::string_view> out;
  for (const auto& [key, value] : head.headers) {
    if (!absl::EqualsIgnoreCase(key, name)) continue;
    for (absl::string_view item : absl::StrSplit(value, ',')) {
      item = TrimOws(item);
      if (!item.empty()) out.push_back(item);
    }
  }
  return out;
}

int64_t CountOf(const RequestHead& head, absl::string_view name) {
  return std::count_if(head.headers.begin(), head.headers.end(),
                       [name](const auto& h) { return absl::EqualsIgnoreCase(h.first, name); });
}

void Append(std::string* out, absl::string_view text) { out->append(text.data(), text.size()); }

}  // namespace

std::optional<absl::string_view> FindHeader(const Headers& headers, absl::string_view name) {
  for (const auto& [key, value] : headers) {
    if (absl::EqualsIgnoreCase(key, name)) return value;
  }
  return std::nullopt;
}

RequestParser::Event RequestParser::Refuse(int status, std::string message) {
  state_ = State::kRefused;
  refusal_ = {.status = status, .message = std::move(message)};
  return Event::kRefused;
}

void RequestParser::Next() {
  state_ = State::kSkipEmpty;
  started_ = false;
  head_text_.clear();
  scanned_ = 0;
  line_.clear();
  trailer_bytes_ = trailer_lines_ = 0;
  remaining_ = 0;
  head_ = RequestHead();
  body_.clear();
  body_.shrink_to_fit();
}

RequestParser::Event RequestParser::ParseHead() {
  std::vector<absl::string_view> lines = absl::StrSplit(head_text_, '\n');
  for (absl::string_view& line : lines) absl::ConsumeSuffix(&line, "\r");
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (lines.empty()) return Refuse(400, "malformed HTTP request: no request line");
  if (static_cast<int64_t>(lines.size()) - 1 > limits_.max_headers) {
    return Refuse(431,
                  absl::StrCat("request header fields: more than ", limits_.max_headers, " lines"));
  }
  if (std::optional<Event> refused = ParseRequestLine(lines[0])) return *refused;
  if (std::optional<Event> refused = ParseFields(absl::MakeConstSpan(lines).subspan(1))) {
    return *refused;
  }
  if (std::optional<Event> refused = ParseFraming()) return *refused;
  if (head_.chunked) {
    state_ = State::kChunkSize;
  } else {
    state_ = State::kBody;
    remaining_ = head_.content_length;
    body_.reserve(static_cast<size_t>(std::min<int64_t>(remaining_, int64_t{4} << 20)));
  }
  return Event::kHead;
}

std::optional<RequestParser::Event> RequestParser::ParseRequestLine(absl::string_view line) {
  const std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || !IsToken(parts[0]) || parts[1].empty() || !IsFieldValue(parts[1]) ||
      absl::StrContains(parts[1], '\t')) {
    return Refuse(400, absl::StrCat("malformed HTTP request line \"", Abbreviate(line),
                                    "\": expected METHOD SP target SP HTTP/1.1"));
  }
  head_.method = std::string(parts[0]);
  absl::string_view target = parts[1];
  // absolute-form (RFC 9112 §3.2.2): the path of the URI.
  for (absl::string_view scheme : {"http://", "https://"}) {
    if (absl::StartsWithIgnoreCase(target, scheme)) {
      const size_t slash = target.find('/', scheme.size());
      target = slash == absl::string_view::npos ? "/" : target.substr(slash);
    }
  }
  if (target.front() != '/' && target != "*") {
    return Refuse(400, absl::StrCat("request target \"", Abbreviate(target),
                                    "\": expected an absolute path"));
  }
  head_.target = std::string(target);
  if (parts[2] == "HTTP/1.1") {
    head_.minor_version = 1;
  } else if (parts[2] == "HTTP/1.0") {
    head_.minor_version = 0;
  } else if (absl::StartsWith(parts[2], "HTTP/")) {
    return Refuse(505, absl::StrCat("HTTP version \"", Abbreviate(parts[2]),
                                    "\" is not supported; use HTTP/1.1"));
  } else {
    return Refuse(400, absl::StrCat("malformed HTTP request line \"", Abbreviate(line),
                                    "\": expected HTTP/1.1 at its end"));
  }
  return std::nullopt;
}

std::optional<RequestParser::Event> RequestParser::ParseFields(
    absl::Span<const absl::string_view> lines) {
  for (const absl::string_view line : lines) {
    if (line.front() == ' ' || line.front() == '\t') {
      return Refuse(400, "request header: a folded line (obs-fold) is not accepted");
    }
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos || !IsToken(line.substr(0, colon))) {
      return Refuse(400, absl::StrCat("request header \"", Abbreviate(line),
                                      "\": expected a name, a colon and a value"));
    }
    const absl::string_view value = TrimOws(line.substr(colon + 1));
    if (!IsFieldValue(value)) {
      return Refuse(400, absl::StrCat("request header ", Abbreviate(line.substr(0, colon)),
                                      ": a control character in its value"));
    }
    head_.headers.emplace_back(line.substr(0, colon), value);
  }
  return std::nullopt;
}

std::optional<RequestParser::Event> RequestParser::ParseFraming() {
  if (head_.minor_version == 1 && CountOf(head_, "Host") != 1) {
    return Refuse(400, absl::StrCat("Host: an HTTP/1.1 request needs exactly one, got ",
                                    CountOf(head_, "Host")));
  }
  for (absl::string_view option : ListOf(head_, "Connection")) {
    if (absl::EqualsIgnoreCase(option, "close")) head_.keep_alive = false;
  }
  if (head_.minor_version == 0) {
    head_.keep_alive = false;
    for (absl::string_view option : ListOf(head_, "Connection")) {
      if (absl::EqualsIgnoreCase(option, "keep-alive")) head_.keep_alive = true;
    }
  }
  const bool has_length = CountOf(head_, "Content-Length") > 0;
  if (CountOf(head_, "Transfer-Encoding") > 0) {
    if (head_.minor_version == 0) {
      return Refuse(400, "Transfer-Encoding: not allowed in an HTTP/1.0 request");
    }
    if (has_length) {
      return Refuse(400, "Transfer-Encoding and Content-Length: a request may carry only one");
    }
    const std::vector<absl::string_view> codings = ListOf(head_, "Transfer-Encoding");
    if (codings.size() != 1 || !absl::EqualsIgnoreCase(codings[0], "chunked")) {
      return Refuse(400, absl::StrCat("Transfer-Encoding: only \"chunked\" is accepted, got \"",
                                      Abbreviate(*head_.Find("Transfer-Encoding")), "\""));
    }
    head_.chunked = true;
  } else if (has_length) {
    if (std::optional<Event> refused = ParseContentLength()) return *refused;
  }
  if (std::optional<absl::string_view> expect = head_.Find("Expect")) {
    if (absl::EqualsIgnoreCase(TrimOws(*expect), "100-continue")) {
      head_.expect_continue = head_.minor_version == 1;
    } else {
      return Refuse(417, absl::StrCat("Expect: only 100-continue is understood, got \"",
                                      Abbreviate(*expect), "\""));
    }
  }
  return std::nullopt;
}

std::optional<RequestParser::Event> RequestParser::ParseContentLength() {
  const std::vector<absl::string_view> values = ListOf(head_, "Content-Length");
  std::optional<absl::string_view> first;
  for (absl::string_view v : values) {
    if (!std::all_of(v.begin(), v.end(), absl::ascii_isdigit) || (first && *first != v)) {
      return Refuse(400, "Content-Length: expected one decimal byte count");
    }
    first = v;
  }
  if (!first) return Refuse(400, "Content-Length: expected one decimal byte count");
  int64_t length = 0;
  const auto [end, error] = std::from_chars(first->data(), first->data() + first->size(), length);
  if (error != std::errc() || length > limits_.max_body_bytes) {
    return Refuse(413, absl::StrCat("request body: Content-Length ", Abbreviate(*first),
                                    " is over the limit of ", limits_.max_body_bytes, " bytes"));
  }
  head_.content_length = length;
  return std::nullopt;
}

// Appends data[*pos, ...) up to and including the next LF to line_; true when the
// line is complete (its LF and a CR before it removed). `budget` bounds line_.
bool RequestParser::TakeLine(absl::string_view data, size_t* pos, int64_t budget, bool* over) {
  const size_t lf = data.find('\n', *pos);
  const size_t end = lf == absl::string_view::npos ? data.size() : lf;
  const size_t room =
      static_cast<size_t>(std::max<int64_t>(0, budget + 1 - static_cast<int64_t>(line_.size())));
  Append(&line_, data.substr(*pos, std::min(end - *pos, room)));
  *pos = lf == absl::string_view::npos ? data.size() : lf + 1;
  if (over != nullptr) *over = static_cast<int64_t>(line_.size()) > budget;
  if (lf == absl::string_view::npos) return false;
  if (!line_.empty() && line_.back() == '\r') line_.pop_back();
  return true;
}

char* RequestParser::ReserveBody(size_t n) {
  n = std::min(n, static_cast<size_t>(body_remaining()));
  const size_t size = body_.size();
  body_.resize(size + n);
  return body_.data() + size;
}

void RequestParser::CommitBody(size_t reserved, size_t used) {
  used = std::min(used, reserved);
  body_.resize(body_.size() - (reserved - used));
  remaining_ -= static_cast<int64_t>(used);
}

RequestParser::Event RequestParser::Feed(absl::string_view data, size_t* consumed) {
  size_t pos = 0;
  std::optional<Event> event;
  while (!event) {
    switch (state_) {
      case State::kSkipEmpty:
        while (pos < data.size() && (data[pos] == '\r' || data[pos] == '\n')) ++pos;
        if (!data.empty()) started_ = true;
        if (pos == data.size()) {
          event = Event::kNeedMore;
        } else {
          state_ = State::kHead;
        }
        break;
      case State::kHead:
        event = FeedHead(data, &pos);
        break;
      case State::kBody:
        if (!TakeBody(data, &pos)) {
          event = Event::kNeedMore;
        } else {
          state_ = State::kDone;
          event = Event::kRequest;
        }
        break;
      case State::kChunkSize:
        event = FeedChunkSize(data, &pos);
        break;
      case State::kChunkData:
        if (!TakeBody(data, &pos)) {
          event = Event::kNeedMore;
        } else {
          state_ = State::kChunkDataEnd;
        }
        break;
      case State::kChunkDataEnd:
        event = FeedChunkDataEnd(data, &pos);
        break;
      case State::kTrailer:
        event = FeedTrailer(data, &pos);
        break;
      case State::kDone:
        event = Event::kRequest;
        break;
      case State::kRefused:
        event = Event::kRefused;
        break;
    }
  }
  *consumed = pos;
  return *event;
}

bool RequestParser::TakeBody(absl::string_view data, size_t* pos) {
  const size_t take =
      static_cast<size_t>(std::min<int64_t>(remaining_, static_cast<int64_t>(data.size() - *pos)));
  Append(&body_, data.substr(*pos, take));
  *pos += take;
  remaining_ -= static_cast<int64_t>(take);
  return remaining_ == 0;
}

std::optional<RequestParser::Event> RequestParser::FeedHead(absl::string_view data, size_t* pos) {
  if (*pos == data.size()) return Event::kNeedMore;
  // The head, its final empty line included, is at most max_head_bytes.
  const size_t limit = static_cast<size_t>(limits_.max_head_bytes);
  const size_t take = std::min(data.size() - *pos, limit - std::min(limit, head_text_.size()));
  const size_t before = head_text_.size();
  Append(&head_text_, data.substr(*pos, take));
  // The head ends at the first empty line: "\n\n" or "\n\r\n".
  size_t end = absl::string_view::npos;
  for (size_t i = scanned_ > 2 ? scanned_ - 2 : 0; i < head_text_.size(); ++i) {
    if (head_text_[i] != '\n') continue;
    if (i + 1 < head_text_.size() && head_text_[i + 1] == '\n') {
      end = i + 2;
      break;
    }
    if (i + 2 < head_text_.size() && head_text_[i + 1] == '\r' && head_text_[i + 2] == '\n') {
      end = i + 3;
      break;
    }
  }
  scanned_ = head_text_.size();
  if (end == absl::string_view::npos) {
    *pos += take;
    if (static_cast<int64_t>(head_text_.size()) >= limits_.max_head_bytes) {
      return Refuse(431, absl::StrCat("request header fields: over the limit of ",
                                      limits_.max_head_bytes, " bytes"));
    }
    return Event::kNeedMore;
  }
  *pos += end - before;
  head_text_.resize(end);
  return ParseHead();
}

std::optional<RequestParser::Event> RequestParser::FeedChunkSize(absl::string_view data,
                                                                 size_t* pos) {
  // Over-long is judged whether or not the line is complete, so that the answer does
  // not depend on where the reads split it.
  bool over = false;
  const bool line = TakeLine(data, pos, limits_.max_head_bytes, &over);
  if (over) return Refuse(431, "chunked body: a chunk-size line over the header limit");
  if (!line) return Event::kNeedMore;
  absl::string_view size_text = line_;
  size_text = size_text.substr(0, size_text.find(';'));
  size_text = TrimOws(size_text);
  uint64_t size = 0;
  const auto [end, error] =
      std::from_chars(size_text.data(), size_text.data() + size_text.size(), size, 16);
  if (size_text.empty() || size_text.size() > 16 || error != std::errc() ||
      end != size_text.data() + size_text.size()) {
    return Refuse(400,
                  absl::StrCat("chunked body: malformed chunk size \"", Abbreviate(line_), "\""));
  }
  line_.clear();
  if (size > static_cast<uint64_t>(limits_.max_body_bytes) ||
      static_cast<int64_t>(body_.size() + size) > limits_.max_body_bytes) {
    return Refuse(413, absl::StrCat("request body: chunks over the limit of ",
                                    limits_.max_body_bytes, " bytes"));
  }
  // Reserved once (address space, touched only as written), so that the body never
  // holds two copies while it grows.
  if (size > 0 && body_.capacity() < static_cast<size_t>(limits_.max_body_bytes)) {
    body_.reserve(static_cast<size_t>(limits_.max_body_bytes));
  }
  if (size == 0) {
    state_ = State::kTrailer;
  } else {
    remaining_ = static_cast<int64_t>(size);
    state_ = State::kChunkData;
  }
  return std::nullopt;
}

std::optional<RequestParser::Event> RequestParser::FeedChunkDataEnd(absl::string_view data,
                                                                    size_t* pos) {
  // Only the CRLF that ends the chunk's data may come here (or its CR so far).
  const bool line = TakeLine(data, pos, 2);
  const bool more_data = line ? !line_.empty() : !line_.empty() && line_ != "\r";
  if (more_data) {
    return Refuse(400, "chunked body: a chunk's data longer than its size");
  }
  if (!line) return Event::kNeedMore;
  state_ = State::kChunkSize;
  return std::nullopt;
}

std::optional<RequestParser::Event> RequestParser::FeedTrailer(absl::string_view data,
                                                               size_t* pos) {
  const size_t before = *pos;
  const bool line = TakeLine(data, pos, limits_.max_head_bytes);
  trailer_bytes_ += static_cast<int64_t>(*pos - before);
  if (trailer_bytes_ > limits_.max_head_bytes) {
    return Refuse(431, absl::StrCat("chunked body: trailer fields over the limit of ",
                                    limits_.max_head_bytes, " bytes"));
  }
  if (!line) return Event::kNeedMore;
  if (line_.empty()) {
    state_ = State::kDone;
    return Event::kRequest;
  }
  line_.clear();
  if (++trailer_lines_ > limits_.max_headers) {
    return Refuse(431,
                  absl::StrCat("chunked body: more than ", limits_.max_headers, " trailer lines"));
  }
  return std::nullopt;
}

}  // namespace mha::server::http1
