#include "client/sdk/http1_response.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace mha::client::http1 {
namespace {

// A chunk-size line or trailer line longer than this is refused.
constexpr size_t kMaxLine = 4096;

bool IsDigit(char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); }

bool IsTokenChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
         absl::string_view("!#$%&'*+-.^_`|~").find(c) != absl::string_view::npos;
}

absl::string_view Trim(absl::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool HasToken(absl::string_view list, absl::string_view token) {
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    if (absl::EqualsIgnoreCase(Trim(item), token)) return true;
  }
  return false;
}

}  // namespace

void ResponseParser::Reset(bool head_request) {
  state_ = State::kHead;
  head_request_ = head_request;
  head_.clear();
  line_.clear();
  trailer_bytes_ = 0;
  status_ = 0;
  keep_alive_ = false;
  fields_.clear();
  remaining_ = 0;
  body_.clear();
  error_ = absl::OkStatus();
}

ResponseParser::Event ResponseParser::Fail(std::string message) {
  state_ = State::kError;
  keep_alive_ = false;
  error_ = absl::InternalError(absl::StrCat("HTTP response: ", message));
  return Event::kError;
}

std::optional<absl::string_view> ResponseParser::Find(absl::string_view name) const {
  for (const auto& [field, value] : fields_) {
    if (absl::EqualsIgnoreCase(field, name)) return absl::string_view(value);
  }
  return std::nullopt;
}

bool ResponseParser::ParseHead() {
  absl::string_view head = head_;
  std::vector<absl::string_view> lines = absl::StrSplit(head, '\n');
  // The head ends with its empty line: the split leaves two empty pieces at the end.
  while (!lines.empty() && absl::StripSuffix(lines.back(), "\r").empty()) lines.pop_back();
  if (lines.empty()) {
    Fail("no status line");
    return false;
  }
  absl::string_view status_line = absl::StripSuffix(lines[0], "\r");
  // HTTP/1.x SP 3DIGIT [SP reason]
  const bool well_formed =
      status_line.size() >= 12 && absl::StartsWith(status_line, "HTTP/1.") &&
      (status_line[7] == '0' || status_line[7] == '1') && status_line[8] == ' ' &&
      std::all_of(status_line.begin() + 9, status_line.begin() + 12, IsDigit) &&
      status_line[9] != '0' && (status_line.size() == 12 || status_line[12] == ' ');
  if (!well_formed) {
    Fail(absl::StrCat("bad status line \"", absl::CHexEscape(status_line.substr(0, 64)), "\""));
    return false;
  }
  status_ = (status_line[9] - '0') * 100 + (status_line[10] - '0') * 10 + (status_line[11] - '0');
  const bool http10 = status_line[7] == '0';
  fields_.clear();
  for (size_t i = 1; i < lines.size(); ++i) {
    absl::string_view line = absl::StripSuffix(lines[i], "\r");
    const size_t colon = line.find(':');
    absl::string_view name = line.substr(0, colon);
    if (colon == absl::string_view::npos || name.empty() ||
        !std::all_of(name.begin(), name.end(), IsTokenChar)) {
      Fail(absl::StrCat("bad header field \"", absl::CHexEscape(line.substr(0, 64)), "\""));
      return false;
    }
    fields_.emplace_back(std::string(name), std::string(Trim(line.substr(colon + 1))));
  }
  const std::optional<absl::string_view> connection = Find("Connection");
  keep_alive_ = http10 ? connection && HasToken(*connection, "keep-alive")
                       : !(connection && HasToken(*connection, "close"));
  return true;
}

bool ResponseParser::TakeLine(absl::string_view data, size_t* pos) {
  const size_t nl = data.find('\n', *pos);
  if (nl == absl::string_view::npos) {
    line_.append(data.data() + *pos, data.size() - *pos);
    *pos = data.size();
    return false;
  }
  line_.append(data.data() + *pos, nl - *pos);
  *pos = nl + 1;
  if (!line_.empty() && line_.back() == '\r') line_.pop_back();
  return true;
}

size_t ResponseParser::TakeBody(absl::string_view data, size_t pos, int64_t limit) {
  const size_t take =
      static_cast<size_t>(std::min<int64_t>(limit, static_cast<int64_t>(data.size() - pos)));
  body_.append(data.data() + pos, take);
  return take;
}

ResponseParser::Event ResponseParser::Feed(absl::string_view data, size_t* consumed) {
  size_t pos = 0;
  std::optional<Event> event;
  while (!event) {
    switch (state_) {
      case State::kHead:
        event = FeedHead(data, &pos);
        break;
      case State::kLength:
        if (!TakeRemaining(data, &pos)) {
          event = Event::kNeedMore;
        } else {
          state_ = State::kDone;
        }
        break;
      case State::kChunkLine:
        event = FeedChunkLine(data, &pos);
        break;
      case State::kChunkData:
        if (!TakeRemaining(data, &pos)) {
          event = Event::kNeedMore;
        } else {
          state_ = State::kChunkEnd;
        }
        break;
      case State::kChunkEnd:
        if (!TakeLine(data, &pos)) {
          event = line_.size() > 1 ? Fail("chunk data longer than its size") : Event::kNeedMore;
        } else if (!line_.empty()) {
          event = Fail("chunk data longer than its size");
        } else {
          state_ = State::kChunkLine;
        }
        break;
      case State::kTrailers:
        event = FeedTrailers(data, &pos);
        break;
      case State::kToClose: {
        const int64_t room = limits_.max_body_bytes - static_cast<int64_t>(body_.size());
        if (static_cast<int64_t>(data.size() - pos) > room) {
          event = Fail(absl::StrCat("body over the limit of ", limits_.max_body_bytes, " bytes"));
        } else {
          pos += TakeBody(data, pos, room);
          event = Event::kNeedMore;
        }
        break;
      }
      case State::kDone:
        event = Event::kDone;
        break;
      case State::kError:
        event = Event::kError;
        break;
    }
  }
  *consumed = pos;
  return *event;
}

bool ResponseParser::TakeRemaining(absl::string_view data, size_t* pos) {
  const size_t took = TakeBody(data, *pos, remaining_);
  *pos += took;
  remaining_ -= static_cast<int64_t>(took);
  return remaining_ == 0;
}

std::optional<ResponseParser::Event> ResponseParser::FeedHead(absl::string_view data, size_t* pos) {
  // Look for the empty line from the last 3 bytes already held on.
  const size_t from = head_.size() >= 3 ? head_.size() - 3 : 0;
  const size_t take = std::min(limits_.max_head_bytes - head_.size(), data.size() - *pos);
  head_.append(data.data() + *pos, take);
  size_t end = std::string::npos;
  for (size_t i = head_.find('\n', from); i != std::string::npos; i = head_.find('\n', i + 1)) {
    if (i + 1 < head_.size() && head_[i + 1] == '\n') {
      end = i + 2;
    } else if (i + 2 < head_.size() && head_[i + 1] == '\r' && head_[i + 2] == '\n') {
      end = i + 3;
    }
    if (end != std::string::npos) break;
  }
  if (end == std::string::npos) {
    *pos += take;
    if (head_.size() >= limits_.max_head_bytes) {
      return Fail(absl::StrCat("head over ", limits_.max_head_bytes, " bytes"));
    }
    return Event::kNeedMore;
  }
  *pos += take - (head_.size() - end);
  head_.resize(end);
  if (!ParseHead()) return Event::kError;
  head_.clear();
  if (status_ == 101) return Fail("101 Switching Protocols was not asked for");
  if (status_ < 200) return std::nullopt;  // an interim response: the final one follows
  return StartBody();
}

std::optional<ResponseParser::Event> ResponseParser::StartBody() {
  if (head_request_ || status_ == 204 || status_ == 304) {
    state_ = State::kDone;
    return std::nullopt;
  }
  if (std::optional<absl::string_view> coding = Find("Transfer-Encoding")) {
    std::vector<absl::string_view> codings = absl::StrSplit(*coding, ',');
    if (absl::EqualsIgnoreCase(Trim(codings.back()), "chunked")) {
      state_ = State::kChunkLine;
    } else {
      state_ = State::kToClose;
      keep_alive_ = false;
    }
    return std::nullopt;
  }
  std::optional<int64_t> length;
  for (const auto& [field, value] : fields_) {
    if (!absl::EqualsIgnoreCase(field, "Content-Length")) continue;
    for (absl::string_view item : absl::StrSplit(value, ',')) {
      item = Trim(item);
      int64_t n = 0;
      if (item.empty() || item.size() > 18 || !std::all_of(item.begin(), item.end(), IsDigit) ||
          !absl::SimpleAtoi(item, &n) || (length && *length != n)) {
        return Fail(
            absl::StrCat("bad Content-Length \"", absl::CHexEscape(value.substr(0, 64)), "\""));
      }
      length = n;
    }
  }
  if (!length) {
    state_ = State::kToClose;
    keep_alive_ = false;
    return std::nullopt;
  }
  if (*length > limits_.max_body_bytes) {
    return Fail(absl::StrCat("Content-Length ", *length, " over the limit of ",
                             limits_.max_body_bytes, " bytes"));
  }
  body_.reserve(static_cast<size_t>(*length));
  remaining_ = *length;
  state_ = State::kLength;
  return std::nullopt;
}

std::optional<ResponseParser::Event> ResponseParser::FeedChunkLine(absl::string_view data,
                                                                   size_t* pos) {
  if (!TakeLine(data, pos)) {
    if (line_.size() > kMaxLine) return Fail("chunk-size line too long");
    return Event::kNeedMore;
  }
  absl::string_view size_text = line_;
  size_text = size_text.substr(0, size_text.find(';'));
  size_text = Trim(size_text);
  int64_t size = 0;
  for (char c : size_text) {
    const int digit = IsDigit(c)             ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
    if (digit < 0 || size > limits_.max_body_bytes) {
      size = -1;
      break;
    }
    size = size * 16 + digit;
  }
  if (size_text.empty() || size < 0) {
    return Fail(absl::StrCat("bad chunk-size line \"",
                             absl::CHexEscape(absl::string_view(line_).substr(0, 64)), "\""));
  }
  line_.clear();
  if (size > limits_.max_body_bytes - static_cast<int64_t>(body_.size())) {
    return Fail(absl::StrCat("chunked body over the limit of ", limits_.max_body_bytes, " bytes"));
  }
  remaining_ = size;
  state_ = size == 0 ? State::kTrailers : State::kChunkData;
  return std::nullopt;
}

std::optional<ResponseParser::Event> ResponseParser::FeedTrailers(absl::string_view data,
                                                                  size_t* pos) {
  const size_t before = *pos;
  const bool complete = TakeLine(data, pos);
  trailer_bytes_ += *pos - before;
  if (trailer_bytes_ > limits_.max_head_bytes) {
    return Fail(absl::StrCat("trailers over ", limits_.max_head_bytes, " bytes"));
  }
  if (!complete) return Event::kNeedMore;
  if (line_.empty()) state_ = State::kDone;
  line_.clear();
  return std::nullopt;
}

ResponseParser::Event ResponseParser::Finish() {
  switch (state_) {
    case State::kToClose:
      state_ = State::kDone;
      keep_alive_ = false;
      return Event::kDone;
    case State::kDone:
      return Event::kDone;
    case State::kError:
      return Event::kError;
    case State::kHead:
      if (head_.empty()) return Fail("the server closed the connection without answering");
      return Fail("the server closed the connection in the response's head");
    default:
      return Fail("the server closed the connection before the body's end");
  }
}

}  // namespace mha::client::http1
