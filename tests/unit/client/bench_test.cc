#include "client/bench.h"

#include "gtest/gtest.h"

namespace mha::client {
namespace {

std::vector<double> Sweep(absl::string_view text) {
  auto values = ParseSweep(text, "concurrency");
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *values : std::vector<double>{};
}

TEST(BenchTest, ParsesSweeps) {
  EXPECT_EQ(Sweep("8"), (std::vector<double>{8}));
  EXPECT_EQ(Sweep("1:4"), (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ(Sweep("1:64:x2"), (std::vector<double>{1, 2, 4, 8, 16, 32, 64}));
  EXPECT_EQ(Sweep("1:50:x2"), (std::vector<double>{1, 2, 4, 8, 16, 32}));
  EXPECT_EQ(Sweep("10:40:10"), (std::vector<double>{10, 20, 30, 40}));
  EXPECT_EQ(Sweep("0.5:2:x2"), (std::vector<double>{0.5, 1, 2}));
}

TEST(BenchTest, RejectsBadSweepsNamingTheFlag) {
  for (const char* bad :
       {"", "0", "-1", "4:1", "1:4:x1", "1:4:0", "1:4:x", "a", "1:2:3:4", "1:100000:0.01"}) {
    auto values = ParseSweep(bad, "request_rate");
    ASSERT_FALSE(values.ok()) << bad;
    EXPECT_EQ(values.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(values.status().message().find("--request_rate"), absl::string_view::npos);
  }
}

}  // namespace
}  // namespace mha::client
