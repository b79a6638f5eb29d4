#include "server/serving/restricted_api.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace mha::server {
namespace {

constexpr const char* kGroupNames[kNumApiGroups] = {
    "inference", "metadata", "health", "statistics", "model-repository", "shared-memory"};

absl::Status Invalid(absl::string_view rule, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(
      "restricted_api: rule \"", rule, "\": ", problem,
      " (expected GROUP[,GROUP]:KEY=VALUE[;...]; groups ", absl::StrJoin(kGroupNames, ", "), ")"));
}

// A header name (RFC 9110 token) as gRPC also allows it in metadata keys.
bool ValidKey(absl::string_view key) {
  if (key.empty()) return false;
  for (const char c : key) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return false;
    }
  }
  return true;
}

// VALUE, @FILE or $ENV.
absl::StatusOr<std::string> Secret(absl::string_view rule, absl::string_view value) {
  std::string secret;
  if (absl::ConsumePrefix(&value, "@")) {
    std::ifstream file{std::string(value)};
    if (!file) return Invalid(rule, absl::StrCat("cannot read the secret file ", value));
    std::stringstream text;
    text << file.rdbuf();
    secret = text.str();
    if (absl::EndsWith(secret, "\n")) secret.pop_back();
    if (absl::EndsWith(secret, "\r")) secret.pop_back();
  } else if (absl::ConsumePrefix(&value, "$")) {
    const char* env = std::getenv(std::string(value).c_str());
    if (env == nullptr) {
      return Invalid(rule, absl::StrCat("environment variable ", value, " is not set"));
    }
    secret = env;
  } else {
    secret = std::string(value);
  }
  if (secret.empty()) return Invalid(rule, "the value is empty");
  return secret;
}

// Compares without stopping at the first difference.
bool SameSecret(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

}  // namespace

const char* ApiGroupName(ApiGroup group) { return kGroupNames[static_cast<int>(group)]; }

absl::StatusOr<std::unique_ptr<RestrictedApis>> RestrictedApis::Create(
    absl::string_view spec, prometheus::Registry* registry) {
  std::unique_ptr<RestrictedApis> apis(new RestrictedApis());
  for (absl::string_view rule : absl::StrSplit(spec, ';', absl::SkipWhitespace())) {
    rule = absl::StripAsciiWhitespace(rule);
    const size_t colon = rule.find(':');
    if (colon == absl::string_view::npos) return Invalid(rule, "no ':' after the groups");
    const absl::string_view assignment = rule.substr(colon + 1);
    const size_t equals = assignment.find('=');
    if (equals == absl::string_view::npos) return Invalid(rule, "no '=' between KEY and VALUE");
    const std::string key =
        absl::AsciiStrToLower(absl::StripAsciiWhitespace(assignment.substr(0, equals)));
    if (!ValidKey(key)) {
      return Invalid(
          rule,
          absl::StrCat("KEY \"", key, "\" is not a header name (letters, digits, '-', '_', '.')"));
    }
    absl::StatusOr<std::string> secret =
        Secret(rule, absl::StripAsciiWhitespace(assignment.substr(equals + 1)));
    if (!secret.ok()) return secret.status();
    for (absl::string_view name : absl::StrSplit(rule.substr(0, colon), ',')) {
      name = absl::StripAsciiWhitespace(name);
      int group = 0;
      while (group < kNumApiGroups && name != kGroupNames[group]) ++group;
      if (group == kNumApiGroups) {
        return Invalid(rule, absl::StrCat("unknown group \"", name, "\""));
      }
      if (apis->rules_[group].has_value()) {
        return Invalid(rule, absl::StrCat("group ", name, " is named by an earlier rule too"));
      }
      apis->rules_[group] = Rule{.key = key, .value = *secret};
    }
  }
  if (registry != nullptr) {
    auto& family = prometheus::BuildCounter()
                       .Name("mha_restricted_refusals_total")
                       .Help(
                           "Calls of a restricted API group (--restricted_api) refused for "
                           "lacking its key or value, by group.")
                       .Register(*registry);
    for (int group = 0; group < kNumApiGroups; ++group) {
      if (apis->rules_[group].has_value()) {
        apis->refusals_[group] = &family.Add({{"group", kGroupNames[group]}});
      }
    }
  }
  return apis;
}

absl::Status RestrictedApis::Allow(ApiGroup group, HeaderLookup header,
                                   absl::string_view key_prefix) const {
  const std::optional<Rule>& rule = rules_[static_cast<int>(group)];
  if (!rule.has_value()) return absl::OkStatus();
  std::optional<std::string> given = header(rule->key);
  if (!given.has_value() && !key_prefix.empty())
    given = header(absl::StrCat(key_prefix, rule->key));
  if (given.has_value() && SameSecret(*given, rule->value)) return absl::OkStatus();
  if (prometheus::Counter* refusals = refusals_[static_cast<int>(group)]) refusals->Increment();
  return absl::PermissionDeniedError(absl::StrCat(
      "the ", kGroupNames[static_cast<int>(group)], " API is restricted: ",
      given.has_value() ? "the value of '" : "the call needs the header or metadata '", rule->key,
      given.has_value() ? "' is not the one the server expects" : "' with the server's value"));
}

}  // namespace mha::server
