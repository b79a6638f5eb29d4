#include "client/sdk/status.h"

#include "gtest/gtest.h"

namespace mha::client {
namespace {

TEST(StatusTest, UsageErrorsExitTwoAndPrintTheirMessage) {
  const absl::Status usage = UsageError("--batch: must be >= 1, got 0");
  EXPECT_TRUE(IsUsageError(usage));
  EXPECT_EQ(usage.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrorLine(usage), "error: --batch: must be >= 1, got 0");
  EXPECT_EQ(ExitCode(usage), 2);

  // The server's INVALID_ARGUMENT is a call's error: code name, exit 1.
  const absl::Status call = absl::InvalidArgumentError("Attend: valid_lens[1]: bad\nlength");
  EXPECT_FALSE(IsUsageError(call));
  EXPECT_EQ(ErrorLine(call), "error: INVALID_ARGUMENT: Attend: valid_lens[1]: bad length");
  EXPECT_EQ(ExitCode(call), 1);
  EXPECT_EQ(ExitCode(absl::OkStatus()), 0);
}

TEST(StatusTest, RangeChecksNameTheFlag) {
  EXPECT_TRUE(CheckAtLeast("channels", 1, 1).ok());
  EXPECT_EQ(CheckAtLeast("channels", 0, 1).message(), "--channels: must be >= 1, got 0");
  EXPECT_TRUE(IsUsageError(CheckAtLeast("channels", 0, 1)));
  EXPECT_TRUE(CheckPositive("window", absl::Milliseconds(1)).ok());
  EXPECT_EQ(CheckPositive("window", absl::ZeroDuration()).message(),
            "--window: must be > 0, got 0");
}

TEST(StatusTest, CodeNamesAreTheCanonicalOnes) {
  EXPECT_EQ(CodeFromName("RESOURCE_EXHAUSTED"), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CodeFromName("UNAUTHENTICATED"), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CodeFromName("resource_exhausted"), std::nullopt);
  EXPECT_EQ(CodeFromName("QUEUE_FULL"), std::nullopt);
  EXPECT_EQ(CodeName(grpc::StatusCode::DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
}

}  // namespace
}  // namespace mha::client
