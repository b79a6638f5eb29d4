#include "base/command_line.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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

// A command-line flag as written: its name without dashes, "no" or value.
struct GivenFlag {
  std::string written;                    // "--concurrency", "--nocausal"
  std::string name;                       // "concurrency", "causal"
  absl::CommandLineFlag* flag = nullptr;  // nullptr: not registered
  bool negated = false;                   // --noNAME
  std::optional<std::string> value;       // after '=', or the next argument
  bool missing_value = false;             // --name at the end, not a boolean
};

// Reads argv[*i] (and argv[*i + 1] for "--name value", advancing *i).
GivenFlag ReadFlag(int argc, char* argv[], int* i) {
  absl::string_view arg = argv[*i];
  arg.remove_prefix(absl::StartsWith(arg, "--") ? 2 : 1);
  const size_t equals = arg.find('=');
  GivenFlag given;
  absl::string_view name = arg.substr(0, equals);
  given.written = absl::StrCat("--", name);
  given.flag = absl::FindCommandLineFlag(name);
  if (given.flag == nullptr && absl::ConsumePrefix(&name, "no")) {
    given.flag = absl::FindCommandLineFlag(name);
    given.negated = given.flag != nullptr;
    if (!given.negated) name = arg.substr(0, equals);
  }
  given.name = std::string(name);
  if (equals != absl::string_view::npos) {
    given.value = std::string(arg.substr(equals + 1));
  } else if (given.flag != nullptr && !given.flag->IsOfType<bool>()) {
    if (*i + 1 < argc) {
      given.value = argv[++*i];
    } else {
      given.missing_value = true;
    }
  }
  return given;
}

// What absl::ParseCommandLine would refuse in `given`, as "--name: ..."; nullopt
// when it is fine.
std::optional<std::string> FlagError(const GivenFlag& given) {
  const std::string& flag_name = given.written;
  if (given.negated) {
    if (given.flag->IsOfType<bool>() && !given.value) return std::nullopt;
    return absl::StrCat(flag_name, ": only a boolean flag takes a 'no'");
  }
  if (given.flag == nullptr && IsUsageFlag(given.name)) return std::nullopt;  // absl's own
  if (given.flag == nullptr) {
    return absl::StrCat(flag_name, ": unknown flag (--help lists every flag)");
  }
  if (given.missing_value) return absl::StrCat(flag_name, ": missing value");
  if (!given.value) return std::nullopt;  // a boolean flag alone
  std::string error;
  if (given.flag->ParseFrom(*given.value, &error)) return std::nullopt;
  return absl::StrCat(flag_name, ": ", Expected(*given.flag, error), ", got '", *given.value, "'");
}

// Flags of the program itself, not Abseil's own (--flagfile, --fromenv, ...).
bool IsProgramFlag(const absl::CommandLineFlag& flag) {
  return !absl::StrContains(flag.Filename(), "absl/");
}

// "    --name (help); default: value;" wrapped at 80 columns, as Abseil lays it out.
std::string FlagEntry(const absl::CommandLineFlag& flag) {
  std::string default_value = flag.DefaultValue();
  if (flag.IsOfType<std::string>()) default_value = absl::StrCat("\"", default_value, "\"");
  const std::string text =
      absl::StrCat("--", flag.Name(), " (", flag.Help(), "); default: ", default_value, ";");
  std::string entry, line = "    ";
  bool first = true;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!first && line.size() + 1 + word.size() > 80) {
      absl::StrAppend(&entry, line, "\n");
      line = absl::StrCat("      ", word);
    } else {
      absl::StrAppend(&line, first ? "" : " ", word);
    }
    first = false;
  }
  absl::StrAppend(&entry, line, "\n");
  return entry;
}

// The usage message and the program's flags (those whose name or help contain
// `match`, when set) on stdout; exits 0.
[[noreturn]] void PrintHelpAndExit(absl::string_view match) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!IsProgramFlag(*flag)) continue;
    if (!match.empty() && !absl::StrContains(name, match) &&
        !absl::StrContains(flag->Help(), match)) {
      continue;
    }
    flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::string text = absl::StrCat(absl::ProgramUsageMessage(), "\n\nFlags:\n");
  for (const absl::CommandLineFlag* flag : flags) absl::StrAppend(&text, FlagEntry(*flag));
  std::fputs(text.c_str(), stdout);
  std::exit(0);
}

std::string ProgramName(const char* argv0) {
  const absl::string_view path = argv0 != nullptr ? argv0 : "";
  const size_t slash = path.rfind('/');
  return std::string(slash == absl::string_view::npos ? path : path.substr(slash + 1));
}

// --help and its kin, --version: handled here, exit 0.
void HandleHelpAndVersion(int argc, char* argv[]) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") return;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) continue;
    if (arg == "version") {
      std::printf("%s\n", VersionLine(ProgramName(argv[0])).c_str());
      std::exit(0);
    }
    if (absl::ConsumePrefix(&arg, "helpmatch=")) PrintHelpAndExit(arg);
    if (arg == "help" || arg == "helpfull" || arg == "helpshort" || arg == "helppackage" ||
        absl::StartsWith(arg, "helpon=")) {
      PrintHelpAndExit("");
    }
  }
}

}  // namespace

std::string VersionLine(absl::string_view program) {
  const absl::string_view build_type = MHA_BUILD_TYPE;
  return absl::StrCat(program, " ", MHA_VERSION, " (",
                      build_type.empty() ? "no CMAKE_BUILD_TYPE" : build_type, ")");
}

std::vector<std::string> FlagsOnCommandLine(int argc, char* argv[]) {
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;                         // the rest is positional
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional, "-" too
    names.push_back(ReadFlag(argc, argv, &i).name);
  }
  return names;
}

std::vector<std::string> ParseCommandLineOrExit(int argc, char* argv[]) {
  HandleHelpAndVersion(argc, argv);
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;                         // the rest is positional
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional, "-" too
    if (std::optional<std::string> error = FlagError(ReadFlag(argc, argv, &i))) {
      ExitWithUsageError(*error);
    }
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
