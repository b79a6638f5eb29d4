#include "base/command_line.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"

namespace mha {
namespace {

// What a value of `flag`'s type looks like; `error` is ParseFrom's ("Illegal value
// ... specified for flag ...", maybe with the parser's own detail after "; ").
std::string Expected(const absl::CommandLineFlag& flag, absl::string_view error) {
  if (flag.IsOfType<absl::Duration>()) {
    return "expected a duration with a unit (5s, 500ms, 2m, 1h30m)";
  }
  if (flag.IsOfType<bool>()) return "expected true or false";
  if (flag.IsOfType<int32_t>() || flag.IsOfType<int64_t>()) return "expected an integer";
  if (flag.IsOfType<uint64_t>()) return "expected an integer >= 0";
  if (flag.IsOfType<double>()) return "expected a number";
  const size_t detail = error.find("; ");
  return detail == absl::string_view::npos ? "illegal value"
                                           : std::string(error.substr(detail + 2));
}

// --help and its kin, which absl parses by name: they are not registered flags.
bool IsUsageFlag(absl::string_view name) {
  for (absl::string_view usage : {"help", "helpfull", "helpshort", "helppackage", "helpon",
                                  "helpmatch", "version", "only_check_args"}) {
    if (name == usage) return true;
  }
  return false;
}

// What absl::ParseCommandLine would refuse in argv[*i] (and argv[*i + 1] for
// "--name value", advancing *i), as "--name: ..."; nullopt when it is fine.
std::optional<std::string> FlagError(int argc, char* argv[], int* i) {
  absl::string_view arg = argv[*i];
  arg.remove_prefix(absl::StartsWith(arg, "--") ? 2 : 1);
  const size_t equals = arg.find('=');
  absl::string_view name = arg.substr(0, equals);
  const std::string flag_name = absl::StrCat("--", name);
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if (flag == nullptr && absl::ConsumePrefix(&name, "no")) {  // --nobool
    flag = absl::FindCommandLineFlag(name);
    if (flag != nullptr && flag->IsOfType<bool>() && equals == absl::string_view::npos) {
      return std::nullopt;
    }
    if (flag != nullptr) return absl::StrCat(flag_name, ": only a boolean flag takes a 'no'");
  }
  if (flag == nullptr && IsUsageFlag(name)) return std::nullopt;  // absl's own, not in the registry
  if (flag == nullptr) return absl::StrCat(flag_name, ": unknown flag (--help lists every flag)");
  std::string value;
  if (equals != absl::string_view::npos) {
    value = std::string(arg.substr(equals + 1));
  } else if (flag->IsOfType<bool>()) {
    return std::nullopt;
  } else if (*i + 1 < argc) {
    value = argv[++*i];
  } else {
    return absl::StrCat(flag_name, ": missing value");
  }
  std::string error;
  if (flag->ParseFrom(value, &error)) return std::nullopt;
  return absl::StrCat(flag_name, ": ", Expected(*flag, error), ", got '", value, "'");
}

}  // namespace

std::vector<std::string> ParseCommandLineOrExit(int argc, char* argv[]) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;                         // the rest is positional
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional, "-" too
    if (std::optional<std::string> error = FlagError(argc, argv, &i)) ExitWithUsageError(*error);
  }
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  return std::vector<std::string>(args.begin() + 1, args.end());
}

void ExitWithUsageError(absl::string_view message) {
  std::fflush(stdout);
  std::fprintf(stderr, "error: %s\n", std::string(message).c_str());
  std::exit(2);
}

}  // namespace mha
