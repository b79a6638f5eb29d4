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
// then parses with absl::ParseCommandLine (--help, --flagfile and the rest as absl
// does them).
#ifndef MHA_BASE_COMMAND_LINE_H_
#define MHA_BASE_COMMAND_LINE_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace mha {

// The positional arguments after argv[0], in order.
std::vector<std::string> ParseCommandLineOrExit(int argc, char* argv[]);

// Prints "error: MESSAGE" on stderr and exits 2.
[[noreturn]] void ExitWithUsageError(absl::string_view message);

}  // namespace mha

#endif  // MHA_BASE_COMMAND_LINE_H_
