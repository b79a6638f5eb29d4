// Restricted API groups (server/serving/restricted_api.h): the flag's syntax, @FILE and
// $ENV secrets, the check and its counter; and the HTTP front's path -> group map.
#include "server/serving/restricted_api.h"

#include <stdlib.h>

#include <map>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/kserve_http/http_front.h"
#include "tests/temp_dir.h"

namespace mha::server {
namespace {

using Headers = std::map<std::string, std::string>;

absl::Status AllowWith(const RestrictedApis& apis, ApiGroup group, const Headers& headers,
                       absl::string_view prefix = "") {
  return apis.Allow(
      group,
      [&headers](absl::string_view key) -> std::optional<std::string> {
        auto it = headers.find(std::string(key));
        if (it == headers.end()) return std::nullopt;
        return it->second;
      },
      prefix);
}

TEST(RestrictedApisTest, RulesSecretsAndTheCheck) {
  mha::testing::TempDir dir;
  const std::string file = dir.Write("secret", "from-file\n");
  setenv("MHA_UNIT_SECRET", "from-env", 1);
  prometheus::Registry registry;
  auto apis = RestrictedApis::Create(" health , statistics : Key-A = @" + file +
                                         " ;inference:key-b=$MHA_UNIT_SECRET;"
                                         "model-repository:key-c=plain",
                                     &registry);
  ASSERT_TRUE(apis.ok()) << apis.status();
  EXPECT_TRUE((*apis)->restricted(ApiGroup::kHealth));
  EXPECT_TRUE((*apis)->restricted(ApiGroup::kStatistics));
  EXPECT_FALSE((*apis)->restricted(ApiGroup::kMetadata));
  EXPECT_FALSE((*apis)->restricted(ApiGroup::kSharedMemory));

  EXPECT_TRUE(AllowWith(**apis, ApiGroup::kMetadata, {}).ok());
  EXPECT_TRUE(AllowWith(**apis, ApiGroup::kHealth, {{"key-a", "from-file"}}).ok());
  EXPECT_TRUE(AllowWith(**apis, ApiGroup::kInference, {{"key-b", "from-env"}}).ok());
  EXPECT_TRUE(AllowWith(**apis, ApiGroup::kModelRepository, {{"key-c", "plain"}}).ok());
  EXPECT_TRUE(AllowWith(**apis, ApiGroup::kHealth, {{"pre-key-a", "from-file"}}, "pre-").ok());
  const absl::Status missing = AllowWith(**apis, ApiGroup::kHealth, {});
  EXPECT_EQ(missing.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(missing.message(), "the health API is restricted")) << missing;
  const absl::Status wrong = AllowWith(**apis, ApiGroup::kHealth, {{"key-a", "from-fil"}});
  EXPECT_EQ(wrong.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(absl::StrContains(wrong.message(), "from-file")) << wrong;
  // A group's key does not open another group.
  EXPECT_FALSE(AllowWith(**apis, ApiGroup::kInference, {{"key-a", "from-file"}}).ok());

  double health = -1, inference = -1;
  for (const auto& family : registry.Collect()) {
    if (family.name != "mha_restricted_refusals_total") continue;
    for (const auto& metric : family.metric) {
      if (metric.label[0].value == "health") health = metric.counter.value;
      if (metric.label[0].value == "inference") inference = metric.counter.value;
    }
  }
  EXPECT_EQ(health, 2);
  EXPECT_EQ(inference, 1);
}

TEST(RestrictedApisTest, BadRulesNameTheFlagAndTheRule) {
  for (const auto& [spec, says] : std::map<std::string, std::string>{
           {"health", "no ':' after the groups"},
           {"health:k", "no '=' between KEY and VALUE"},
           {"healthy:k=v", "unknown group \"healthy\""},
           {"health:k y=v", "is not a header name"},
           {"health:k=", "the value is empty"},
           {"health:k=a;health,inference:j=b", "group health is named by an earlier rule too"}}) {
    auto apis = RestrictedApis::Create(spec, nullptr);
    ASSERT_FALSE(apis.ok()) << spec;
    EXPECT_EQ(apis.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(apis.status().message(), "restricted_api: rule \""))
        << apis.status();
    EXPECT_TRUE(absl::StrContains(apis.status().message(), says)) << apis.status();
  }
  auto none = RestrictedApis::Create("", nullptr);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE((*none)->restricted(ApiGroup::kInference));
}

TEST(RestrictedApisTest, HttpPathsMapToTheirGroups) {
  EXPECT_EQ(ApiGroupOfPath("/v2/health/live"), ApiGroup::kHealth);
  EXPECT_EQ(ApiGroupOfPath("/v2/health/ready"), ApiGroup::kHealth);
  EXPECT_EQ(ApiGroupOfPath("/v2/models/m/ready"), ApiGroup::kHealth);
  EXPECT_EQ(ApiGroupOfPath("/v2/models/m/versions/2/ready"), ApiGroup::kHealth);
  EXPECT_EQ(ApiGroupOfPath("/v2/models/m/infer"), ApiGroup::kInference);
  EXPECT_EQ(ApiGroupOfPath("/v2/models/m/versions/1/infer"), ApiGroup::kInference);
  EXPECT_EQ(ApiGroupOfPath("/v2/models/m/stats"), ApiGroup::kStatistics);
  EXPECT_EQ(ApiGroupOfPath("/v2/repository/index"), ApiGroup::kModelRepository);
  EXPECT_EQ(ApiGroupOfPath("/v2/repository/models/m/load"), ApiGroup::kModelRepository);
  EXPECT_EQ(ApiGroupOfPath("/v2/systemsharedmemory/status"), ApiGroup::kSharedMemory);
  EXPECT_EQ(ApiGroupOfPath("/v2/cudasharedmemory/region/r/register"), ApiGroup::kSharedMemory);
  EXPECT_EQ(ApiGroupOfPath("/v2"), ApiGroup::kMetadata);
  EXPECT_EQ(ApiGroupOfPath("/v2/models/m"), ApiGroup::kMetadata);
  EXPECT_EQ(ApiGroupOfPath("/v2/models/m/config"), ApiGroup::kMetadata);
}

}  // namespace
}  // namespace mha::server
