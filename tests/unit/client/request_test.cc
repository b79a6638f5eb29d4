#include "client/sdk/request.h"

#include "base/splitmix64.h"
#include "client/sdk/status.h"
#include "gtest/gtest.h"

namespace mha::client {
namespace {

attention::v1::ModelInfo Toy() {
  attention::v1::ModelInfo model;
  model.set_name("default");
  model.set_num_hiddens(100);
  model.set_num_heads(5);
  model.set_query_size(100);
  model.set_key_size(100);
  model.set_value_size(100);
  model.set_supports_self_attention(true);
  return model;
}

TEST(RequestTest, DefaultIsTheSeedsToyRequest) {
  auto request = MakeRequest(RequestOptions(), Toy());
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(ShapeString(request->queries()), "(2, 4, 100)");
  EXPECT_EQ(ShapeString(request->keys()), "(2, 6, 100)");
  EXPECT_EQ(ShapeString(request->values()), "(2, 6, 100)");
  ASSERT_EQ(request->valid_lens_size(), 2);
  EXPECT_EQ(request->valid_lens(0), 3);
  EXPECT_EQ(request->valid_lens(1), 2);
  EXPECT_EQ(TokenCount(*request), 8);
  for (float v : request->queries().data()) {
    EXPECT_GE(v, -1.0f);
    EXPECT_LT(v, 1.0f);
  }
  // Same seed, same inputs; another seed, others.
  auto again = MakeRequest(RequestOptions(), Toy());
  EXPECT_EQ(again->SerializeAsString(), request->SerializeAsString());
  RequestOptions other;
  other.seed = 1;
  EXPECT_NE(MakeRequest(other, Toy())->queries().data(0), request->queries().data(0));
}

// The generator's first outputs for seed 0, as any implementation must give them
// (these are SplitMix64's published values; the floats were computed in Python).
TEST(RequestTest, InputsAreSplitMix64FromTheSeedInDocumentedOrder) {
  SplitMix64 generator(0);
  EXPECT_EQ(generator.Next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(generator.Next(), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(generator.Next(), 0x06C45D188009454Full);

  auto request = MakeRequest(RequestOptions(), Toy());
  ASSERT_TRUE(request.ok()) << request.status();
  const auto& queries = request->queries().data();
  EXPECT_EQ(queries[0], 0.7666215896606445f);
  EXPECT_EQ(queries[1], -0.1369440108537674f);
  EXPECT_EQ(queries[2], -0.9471324682235718f);
  // One stream: queries (2, 4, 100), then keys (2, 6, 100), then values.
  SplitMix64 stream(0);
  for (int i = 0; i < queries.size(); ++i) ASSERT_EQ(queries[i], stream.Signed()) << i;
  for (float key : request->keys().data()) ASSERT_EQ(key, stream.Signed());
  for (float value : request->values().data()) ASSERT_EQ(value, stream.Signed());
}

TEST(RequestTest, OptionsThatContradictThemselvesAreUsageErrors) {
  RequestOptions options;
  options.batch = 0;
  absl::Status status = CheckRequestOptions(options);
  EXPECT_TRUE(IsUsageError(status));
  EXPECT_EQ(status.message(), "--batch: must be >= 1, got 0");
  EXPECT_EQ(MakeRequest(options, Toy()).status(), status);  // before any input is made

  options = RequestOptions();
  options.num_keys = -1;
  EXPECT_EQ(CheckRequestOptions(options).message(), "--num_keys: must be >= 0, got -1");

  options = RequestOptions();
  options.batch = 8;  // valid_lens {3, 2}: neither B nor B*Q entries
  status = CheckRequestOptions(options);
  EXPECT_TRUE(IsUsageError(status));
  EXPECT_EQ(status.message(),
            "--valid_lens: 2 entries (3,2) for batch 8: give B = 8 or B*Q = 32 entries, or "
            "--valid_lens=none");
  // With input files B comes from the files: checked by MakeRequest, not a usage error.
  options.input_files = {"queries.npy"};
  EXPECT_TRUE(CheckRequestOptions(options).ok());
}

TEST(RequestTest, SelfAttentionAndShapeChecks) {
  RequestOptions options;
  options.num_keys = 0;
  options.valid_lens = {};
  auto request = MakeRequest(options, Toy());
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_FALSE(request->has_keys());

  attention::v1::ModelInfo cross_only = Toy();
  cross_only.set_key_size(30);
  cross_only.set_supports_self_attention(false);
  EXPECT_EQ(MakeRequest(options, cross_only).status().code(), absl::StatusCode::kInvalidArgument);

  options.num_keys = 6;
  options.batch = 8;
  options.valid_lens = {3, 2};
  auto mismatched = MakeRequest(options, Toy());
  ASSERT_FALSE(mismatched.ok());
  EXPECT_NE(mismatched.status().message().find("--valid_lens=none"), absl::string_view::npos);
  options.valid_lens = std::vector<int32_t>(8 * 4, 1);  // B*Q entries
  EXPECT_TRUE(MakeRequest(options, Toy()).ok());
}

TEST(RequestTest, MaskFollowsValidLensAndCausal) {
  RequestOptions options;
  options.num_queries = 3;
  options.num_keys = 5;
  options.valid_lens = {2, 4};
  auto request = MakeRequest(options, Toy());
  ASSERT_TRUE(request.ok());
  EXPECT_FALSE(IsMasked(*request, 0, 0, 1));
  EXPECT_TRUE(IsMasked(*request, 0, 0, 2));
  EXPECT_FALSE(IsMasked(*request, 1, 2, 3));
  EXPECT_TRUE(IsMasked(*request, 1, 2, 4));
  request->set_causal(true);
  EXPECT_TRUE(IsMasked(*request, 1, 0, 1));  // causal: query 0 sees key 0 only
  EXPECT_FALSE(IsMasked(*request, 1, 1, 1));
  request->clear_valid_lens();
  for (int len : {1, 2, 3, 4, 5, 0}) request->add_valid_lens(len);  // per query
  request->set_causal(false);
  EXPECT_TRUE(IsMasked(*request, 0, 0, 1));
  EXPECT_FALSE(IsMasked(*request, 0, 2, 2));
  EXPECT_TRUE(IsMasked(*request, 1, 2, 0));
}

}  // namespace
}  // namespace mha::client
