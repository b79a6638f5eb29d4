// Reporting for `bench`: a table for people, JSON and CSV for scripts. The same
// numbers in each; latencies in the table in milliseconds, in files in microseconds.
#ifndef MHA_CLIENT_REPORT_H_
#define MHA_CLIENT_REPORT_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "client/bench.h"

namespace mha::client {

// One row per step and RPC; with --rpc=health also the Attend/Health ratios.
void PrintTable(const BenchReport& report, std::ostream& out);

std::string ToJson(const BenchReport& report);
std::string ToCsv(const BenchReport& report);

// Writes `text` to `path`; INVALID_ARGUMENT naming the path on failure.
absl::Status WriteText(const std::string& path, const std::string& text);

}  // namespace mha::client

#endif  // MHA_CLIENT_REPORT_H_
