// Command-line parsing for the binaries: Abseil flags, where every usage error is
// one line naming the flag or argument and exit status 2.
//
//   std::vector<std::string> args = mha::ParseCommandLineOrExit(argc, argv);
//   if (args.size() > 1) mha::ExitWithUsageError("unexpected argument '" + args[1] + "'");
//
// absl::ParseCommandLine reports a flag it cannot parse as "ERROR: Illegal value '5'
// specified for flag 'duration'" and exits 1. ParseCommandLineOrExit first tries
// every --name=value (and --name value, --name, --noname, as absl reads them) with
// the flag's own parser, and says what is wrong:
//
//   error: --duration: expected a duration with a unit (5s, 500ms, 2m), got '5'
//   error: --concurency: unknown flag (--help lists every flag)
//
// then parses with absl::ParseCommandLine (--flagfile and the rest as absl does
// them). --help (and --helpfull, --helpshort, --helpon, --helppackage) prints the
// program's usage message and every flag of the program, its help and its default,
// and exits 0; --helpmatch=TEXT only the flags whose name or help contains TEXT.
// Unlike absl's own listing it names no source file. --version prints VersionLine()
// and exits 0.
#ifndef MHA_BASE_COMMAND_LINE_H_
#define MHA_BASE_COMMAND_LINE_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace mha {

// The positional arguments after argv[0], in order.
std::vector<std::string> ParseCommandLineOrExit(int argc, char* argv[]);

// "attention_client 0.1.0 (Release)": `program`, the project's version (CMake's
// project VERSION) and the build type (CMAKE_BUILD_TYPE) it was compiled with.
std::string VersionLine(absl::string_view program);

// The flags given on the command line by name, as ParseCommandLineOrExit read them
// ("--nocausal" is "causal"); flags read from a --flagfile are not seen.
std::vector<std::string> FlagsOnCommandLine(int argc, char* argv[]);

// Prints "error: MESSAGE" on stderr and exits 2.
[[noreturn]] void ExitWithUsageError(absl::string_view message);

}  // namespace mha

#endif  // MHA_BASE_COMMAND_LINE_H_
