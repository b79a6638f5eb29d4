// Wire compatibility of proto/inference/*.proto with the published Open Inference
// Protocol messages (KServe's v2 predict protocol and Triton's extensions). Every
// test decodes bytes built by hand from the published field numbers and wire types,
// so a renumbered or retyped field in our .proto fails here even though our own
// encoder and decoder would still agree with each other.
#include <bit>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "proto/inference/grpc_service.pb.h"
#include "proto/inference/model_config.pb.h"

namespace mha::server {
namespace {

using inference::InferParameter;
using inference::ModelConfig;
using inference::ModelConfigResponse;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStatisticsResponse;
using inference::ModelStreamInferResponse;

// Protobuf wire types.
constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLengthDelimited = 2;
constexpr int kFixed32 = 5;

// Published field numbers. Map fields are repeated entry messages with the key as
// field 1 and the value as field 2.
constexpr int kMapKey = 1;
constexpr int kMapValue = 2;

constexpr int kInferParameterBool = 1;    // InferParameter.bool_param
constexpr int kInferParameterInt64 = 2;   // InferParameter.int64_param
constexpr int kInferParameterString = 3;  // InferParameter.string_param
constexpr int kInferParameterDouble = 4;  // InferParameter.double_param (Triton)
constexpr int kInferParameterUint64 = 5;  // InferParameter.uint64_param (Triton)

constexpr int kInferTensorContentsInt = 2;    // InferTensorContents.int_contents
constexpr int kInferTensorContentsInt64 = 3;  // InferTensorContents.int64_contents
constexpr int kInferTensorContentsFp32 = 6;   // InferTensorContents.fp32_contents

constexpr int kModelInferRequestModelName = 1;         // ModelInferRequest.model_name
constexpr int kModelInferRequestModelVersion = 2;      // ModelInferRequest.model_version
constexpr int kModelInferRequestId = 3;                // ModelInferRequest.id
constexpr int kModelInferRequestParameters = 4;        // ModelInferRequest.parameters
constexpr int kModelInferRequestInputs = 5;            // ModelInferRequest.inputs
constexpr int kModelInferRequestOutputs = 6;           // ModelInferRequest.outputs
constexpr int kModelInferRequestRawInputContents = 7;  // ModelInferRequest.raw_input_contents

constexpr int kInferInputTensorName = 1;        // ModelInferRequest.InferInputTensor.name
constexpr int kInferInputTensorDatatype = 2;    // ModelInferRequest.InferInputTensor.datatype
constexpr int kInferInputTensorShape = 3;       // ModelInferRequest.InferInputTensor.shape
constexpr int kInferInputTensorParameters = 4;  // ModelInferRequest.InferInputTensor.parameters
constexpr int kInferInputTensorContents = 5;    // ModelInferRequest.InferInputTensor.contents

// ModelInferRequest.InferRequestedOutputTensor.name and .parameters
constexpr int kInferRequestedOutputTensorName = 1;
constexpr int kInferRequestedOutputTensorParameters = 2;

constexpr int kModelInferResponseModelName = 1;          // ModelInferResponse.model_name
constexpr int kModelInferResponseModelVersion = 2;       // ModelInferResponse.model_version
constexpr int kModelInferResponseId = 3;                 // ModelInferResponse.id
constexpr int kModelInferResponseParameters = 4;         // ModelInferResponse.parameters
constexpr int kModelInferResponseOutputs = 5;            // ModelInferResponse.outputs
constexpr int kModelInferResponseRawOutputContents = 6;  // ModelInferResponse.raw_output_contents

constexpr int kInferOutputTensorName = 1;        // ModelInferResponse.InferOutputTensor.name
constexpr int kInferOutputTensorDatatype = 2;    // ModelInferResponse.InferOutputTensor.datatype
constexpr int kInferOutputTensorShape = 3;       // ModelInferResponse.InferOutputTensor.shape
constexpr int kInferOutputTensorParameters = 4;  // ModelInferResponse.InferOutputTensor.parameters
constexpr int kInferOutputTensorContents = 5;    // ModelInferResponse.InferOutputTensor.contents

constexpr int kModelStreamInferResponseErrorMessage = 1;  // ModelStreamInferResponse.error_message
constexpr int kModelStreamInferResponseInferResponse =
    2;  // ModelStreamInferResponse.infer_response

constexpr int kStatisticDurationCount = 1;  // StatisticDuration.count
constexpr int kStatisticDurationNs = 2;     // StatisticDuration.ns

constexpr int kInferStatisticsSuccess = 1;        // InferStatistics.success
constexpr int kInferStatisticsFail = 2;           // InferStatistics.fail
constexpr int kInferStatisticsQueue = 3;          // InferStatistics.queue
constexpr int kInferStatisticsComputeInput = 4;   // InferStatistics.compute_input
constexpr int kInferStatisticsComputeInfer = 5;   // InferStatistics.compute_infer
constexpr int kInferStatisticsComputeOutput = 6;  // InferStatistics.compute_output

constexpr int kInferBatchStatisticsBatchSize = 1;      // InferBatchStatistics.batch_size
constexpr int kInferBatchStatisticsComputeInput = 2;   // InferBatchStatistics.compute_input
constexpr int kInferBatchStatisticsComputeInfer = 3;   // InferBatchStatistics.compute_infer
constexpr int kInferBatchStatisticsComputeOutput = 4;  // InferBatchStatistics.compute_output

constexpr int kModelStatisticsName = 1;            // ModelStatistics.name
constexpr int kModelStatisticsVersion = 2;         // ModelStatistics.version
constexpr int kModelStatisticsLastInference = 3;   // ModelStatistics.last_inference
constexpr int kModelStatisticsInferenceCount = 4;  // ModelStatistics.inference_count
constexpr int kModelStatisticsExecutionCount = 5;  // ModelStatistics.execution_count
constexpr int kModelStatisticsInferenceStats = 6;  // ModelStatistics.inference_stats
constexpr int kModelStatisticsBatchStats = 7;      // ModelStatistics.batch_stats

constexpr int kModelStatisticsResponseModelStats = 1;  // ModelStatisticsResponse.model_stats

constexpr int kModelConfigResponseConfig = 1;  // ModelConfigResponse.config

constexpr int kModelConfigName = 1;              // ModelConfig.name
constexpr int kModelConfigPlatform = 2;          // ModelConfig.platform
constexpr int kModelConfigVersionPolicy = 3;     // ModelConfig.version_policy
constexpr int kModelConfigMaxBatchSize = 4;      // ModelConfig.max_batch_size
constexpr int kModelConfigInput = 5;             // ModelConfig.input
constexpr int kModelConfigOutput = 6;            // ModelConfig.output
constexpr int kModelConfigInstanceGroup = 7;     // ModelConfig.instance_group
constexpr int kModelConfigDynamicBatching = 11;  // ModelConfig.dynamic_batching
constexpr int kModelConfigParameters = 14;       // ModelConfig.parameters
constexpr int kModelConfigBackend = 17;          // ModelConfig.backend

constexpr int kModelVersionPolicyLatest = 1;             // ModelVersionPolicy.latest
constexpr int kModelVersionPolicyLatestNumVersions = 1;  // ModelVersionPolicy.Latest.num_versions

constexpr int kModelInputName = 1;      // ModelInput.name
constexpr int kModelInputDataType = 2;  // ModelInput.data_type
constexpr int kModelInputDims = 4;      // ModelInput.dims
constexpr int kModelInputOptional = 8;  // ModelInput.optional

constexpr int kModelOutputName = 1;      // ModelOutput.name
constexpr int kModelOutputDataType = 2;  // ModelOutput.data_type
constexpr int kModelOutputDims = 3;      // ModelOutput.dims

constexpr int kModelInstanceGroupName = 1;   // ModelInstanceGroup.name
constexpr int kModelInstanceGroupCount = 2;  // ModelInstanceGroup.count
constexpr int kModelInstanceGroupKind = 4;   // ModelInstanceGroup.kind

// ModelDynamicBatching.preferred_batch_size, .max_queue_delay_microseconds and
// .preserve_ordering
constexpr int kModelDynamicBatchingPreferredBatchSize = 1;
constexpr int kModelDynamicBatchingMaxQueueDelayMicroseconds = 2;
constexpr int kModelDynamicBatchingPreserveOrdering = 3;

constexpr int kModelParameterStringValue = 1;  // ModelParameter.string_value

// Published enum values.
constexpr int kDataTypeInt32 = 8;  // DataType.TYPE_INT32
constexpr int kDataTypeFp32 = 11;  // DataType.TYPE_FP32
constexpr int kDataTypeBf16 = 14;  // DataType.TYPE_BF16
constexpr int kKindCpu = 2;        // ModelInstanceGroup.Kind.KIND_CPU

// A minimal protobuf encoder, independent of the generated code.
class Wire {
 public:
  const std::string& bytes() const { return bytes_; }

  Wire& Varint(int field, uint64_t value) {
    Tag(field, kVarint);
    PutVarint(value);
    return *this;
  }
  // int32 and int64 fields encode negatives as their 64-bit two's complement.
  Wire& SignedVarint(int field, int64_t value) {
    return Varint(field, static_cast<uint64_t>(value));
  }
  Wire& Bytes(int field, const std::string& value) {
    Tag(field, kLengthDelimited);
    PutVarint(value.size());
    bytes_ += value;
    return *this;
  }
  Wire& Message(int field, const Wire& message) { return Bytes(field, message.bytes()); }
  Wire& Float(int field, float value) {
    Tag(field, kFixed32);
    PutLittleEndian(std::bit_cast<uint32_t>(value), 4);
    return *this;
  }
  Wire& Double(int field, double value) {
    Tag(field, kFixed64);
    PutLittleEndian(std::bit_cast<uint64_t>(value), 8);
    return *this;
  }
  // Packed repeated varints (int32, int64, enums): one length-delimited record.
  Wire& PackedSigned(int field, std::initializer_list<int64_t> values) {
    Wire payload;
    for (int64_t v : values) payload.PutVarint(static_cast<uint64_t>(v));
    return Bytes(field, payload.bytes());
  }
  Wire& PackedFloats(int field, std::initializer_list<float> values) {
    Wire payload;
    for (float v : values) payload.PutLittleEndian(std::bit_cast<uint32_t>(v), 4);
    return Bytes(field, payload.bytes());
  }
  // One map<string, V> entry whose value is a message.
  Wire& MapEntry(int field, const std::string& key, const Wire& value) {
    return Message(field, Wire().Bytes(kMapKey, key).Message(kMapValue, value));
  }

 private:
  void Tag(int field, int wire_type) {
    PutVarint(static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
  }
  void PutVarint(uint64_t value) {
    while (value >= 0x80) {
      bytes_.push_back(static_cast<char>((value & 0x7f) | 0x80));
      value >>= 7;
    }
    bytes_.push_back(static_cast<char>(value));
  }
  void PutLittleEndian(uint64_t value, int size) {
    for (int i = 0; i < size; ++i) bytes_.push_back(static_cast<char>(value >> (8 * i)));
  }

  std::string bytes_;
};

// Raw little-endian float32 bytes, as raw_input_contents carries them.
std::string RawFloats(std::initializer_list<float> values) {
  std::string out;
  for (float v : values) {
    uint32_t bits = std::bit_cast<uint32_t>(v);
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(bits >> (8 * i)));
  }
  return out;
}

// A field number our .proto lacks would land in the unknown-field set: the
// message then serializes larger than a copy with unknown fields discarded.
template <typename M>
bool HasUnknownFields(const M& message) {
  std::unique_ptr<M> copy(message.New());
  copy->CopyFrom(message);
  copy->DiscardUnknownFields();
  return copy->ByteSizeLong() != message.ByteSizeLong();
}

template <typename M>
M ParseOrFail(const Wire& wire) {
  M message;
  EXPECT_TRUE(message.ParseFromString(wire.bytes())) << M::descriptor()->full_name();
  EXPECT_FALSE(HasUnknownFields(message)) << message.DebugString();
  return message;
}

TEST(InferenceWireTest, ModelInferRequestDecodesPublishedFields) {
  Wire queries;
  queries.Bytes(kInferInputTensorName, "queries")
      .Bytes(kInferInputTensorDatatype, "FP32")
      .PackedSigned(kInferInputTensorShape, {1, 2, 3})
      .MapEntry(kInferInputTensorParameters, "layout",
                Wire().Bytes(kInferParameterString, "row_major"))
      .Message(
          kInferInputTensorContents,
          Wire().PackedFloats(kInferTensorContentsFp32, {1.5f, -2.25f, 0.0f, 3e-8f, -1e30f, 7.0f}));
  // Shape written unpacked (one record per element): decoders must accept both.
  Wire valid_lens;
  valid_lens.Bytes(kInferInputTensorName, "valid_lens")
      .Bytes(kInferInputTensorDatatype, "INT32")
      .SignedVarint(kInferInputTensorShape, 2)
      .Message(kInferInputTensorContents, Wire().PackedSigned(kInferTensorContentsInt, {2, -1}));
  Wire positions;
  positions.Bytes(kInferInputTensorName, "positions")
      .Bytes(kInferInputTensorDatatype, "INT64")
      .PackedSigned(kInferInputTensorShape, {2})
      .Message(kInferInputTensorContents,
               Wire().PackedSigned(kInferTensorContentsInt64, {int64_t{1} << 40, -5}));
  Wire request;
  request.Bytes(kModelInferRequestModelName, "default")
      .Bytes(kModelInferRequestModelVersion, "1")
      .Bytes(kModelInferRequestId, "req-42")
      .MapEntry(kModelInferRequestParameters, "causal", Wire().Varint(kInferParameterBool, 1))
      .MapEntry(kModelInferRequestParameters, "priority",
                Wire().SignedVarint(kInferParameterInt64, -3))
      .MapEntry(kModelInferRequestParameters, "note", Wire().Bytes(kInferParameterString, "hi"))
      .MapEntry(kModelInferRequestParameters, "temperature",
                Wire().Double(kInferParameterDouble, 0.125))
      .MapEntry(kModelInferRequestParameters, "big",
                Wire().Varint(kInferParameterUint64, uint64_t{1} << 63))
      .Message(kModelInferRequestInputs, queries)
      .Message(kModelInferRequestInputs, valid_lens)
      .Message(kModelInferRequestInputs, positions)
      .Message(kModelInferRequestOutputs,
               Wire()
                   .Bytes(kInferRequestedOutputTensorName, "attention")
                   .MapEntry(kInferRequestedOutputTensorParameters, "binary_data",
                             Wire().Varint(kInferParameterBool, 1)))
      .Message(kModelInferRequestOutputs, Wire().Bytes(kInferRequestedOutputTensorName, "output"))
      .Bytes(kModelInferRequestRawInputContents, RawFloats({0.5f, -4.0f}))
      .Bytes(kModelInferRequestRawInputContents, std::string("\x00\x01\xfe\xff", 4));

  const auto parsed = ParseOrFail<ModelInferRequest>(request);
  EXPECT_EQ(parsed.model_name(), "default");
  EXPECT_EQ(parsed.model_version(), "1");
  EXPECT_EQ(parsed.id(), "req-42");

  ASSERT_EQ(parsed.parameters().size(), 5);
  const InferParameter& causal = parsed.parameters().at("causal");
  EXPECT_EQ(causal.parameter_choice_case(), InferParameter::kBoolParam);
  EXPECT_TRUE(causal.bool_param());
  const InferParameter& priority = parsed.parameters().at("priority");
  EXPECT_EQ(priority.parameter_choice_case(), InferParameter::kInt64Param);
  EXPECT_EQ(priority.int64_param(), -3);
  const InferParameter& note = parsed.parameters().at("note");
  EXPECT_EQ(note.parameter_choice_case(), InferParameter::kStringParam);
  EXPECT_EQ(note.string_param(), "hi");
  const InferParameter& temperature = parsed.parameters().at("temperature");
  EXPECT_EQ(temperature.parameter_choice_case(), InferParameter::kDoubleParam);
  EXPECT_EQ(temperature.double_param(), 0.125);
  const InferParameter& big = parsed.parameters().at("big");
  EXPECT_EQ(big.parameter_choice_case(), InferParameter::kUint64Param);
  EXPECT_EQ(big.uint64_param(), uint64_t{1} << 63);

  ASSERT_EQ(parsed.inputs_size(), 3);
  const auto& q = parsed.inputs(0);
  EXPECT_EQ(q.name(), "queries");
  EXPECT_EQ(q.datatype(), "FP32");
  EXPECT_EQ(std::vector<int64_t>(q.shape().begin(), q.shape().end()),
            (std::vector<int64_t>{1, 2, 3}));
  ASSERT_EQ(q.parameters().size(), 1);
  EXPECT_EQ(q.parameters().at("layout").string_param(), "row_major");
  ASSERT_TRUE(q.has_contents());
  // Bit-exact: the values travel as fixed32 and must come back unchanged.
  EXPECT_EQ(
      std::vector<float>(q.contents().fp32_contents().begin(), q.contents().fp32_contents().end()),
      (std::vector<float>{1.5f, -2.25f, 0.0f, 3e-8f, -1e30f, 7.0f}));
  EXPECT_EQ(q.contents().int_contents_size(), 0);

  const auto& v = parsed.inputs(1);
  EXPECT_EQ(v.name(), "valid_lens");
  EXPECT_EQ(v.datatype(), "INT32");
  EXPECT_EQ(std::vector<int64_t>(v.shape().begin(), v.shape().end()), (std::vector<int64_t>{2}));
  EXPECT_EQ(
      std::vector<int32_t>(v.contents().int_contents().begin(), v.contents().int_contents().end()),
      (std::vector<int32_t>{2, -1}));
  EXPECT_EQ(v.contents().fp32_contents_size(), 0);

  const auto& p = parsed.inputs(2);
  EXPECT_EQ(p.name(), "positions");
  EXPECT_EQ(std::vector<int64_t>(p.contents().int64_contents().begin(),
                                 p.contents().int64_contents().end()),
            (std::vector<int64_t>{int64_t{1} << 40, -5}));

  ASSERT_EQ(parsed.outputs_size(), 2);
  EXPECT_EQ(parsed.outputs(0).name(), "attention");
  ASSERT_EQ(parsed.outputs(0).parameters().size(), 1);
  EXPECT_TRUE(parsed.outputs(0).parameters().at("binary_data").bool_param());
  EXPECT_EQ(parsed.outputs(1).name(), "output");
  EXPECT_TRUE(parsed.outputs(1).parameters().empty());

  ASSERT_EQ(parsed.raw_input_contents_size(), 2);
  EXPECT_EQ(parsed.raw_input_contents(0), RawFloats({0.5f, -4.0f}));
  EXPECT_EQ(parsed.raw_input_contents(1), std::string("\x00\x01\xfe\xff", 4));
}

TEST(InferenceWireTest, ModelInferResponseDecodesPublishedFields) {
  const std::string output_bytes = RawFloats({0.25f, -0.75f, 8.0f, 1e-3f});
  Wire response;
  response.Bytes(kModelInferResponseModelName, "default")
      .Bytes(kModelInferResponseModelVersion, "1")
      .Bytes(kModelInferResponseId, "abc")
      .MapEntry(kModelInferResponseParameters, "batch_rows",
                Wire().SignedVarint(kInferParameterInt64, 4))
      .Message(kModelInferResponseOutputs,
               Wire()
                   .Bytes(kInferOutputTensorName, "output")
                   .Bytes(kInferOutputTensorDatatype, "FP32")
                   .PackedSigned(kInferOutputTensorShape, {1, 2, 2})
                   .MapEntry(kInferOutputTensorParameters, "binary_data_size",
                             Wire().SignedVarint(kInferParameterInt64, 16)))
      .Message(kModelInferResponseOutputs,
               Wire()
                   .Bytes(kInferOutputTensorName, "scores")
                   .Bytes(kInferOutputTensorDatatype, "FP32")
                   .PackedSigned(kInferOutputTensorShape, {2})
                   // Unpacked (one fixed32 record per value): decoders accept both.
                   .Message(kInferOutputTensorContents, Wire()
                                                            .Float(kInferTensorContentsFp32, -1.0f)
                                                            .Float(kInferTensorContentsFp32, 2.5f)))
      .Bytes(kModelInferResponseRawOutputContents, output_bytes);

  const auto parsed = ParseOrFail<ModelInferResponse>(response);
  EXPECT_EQ(parsed.model_name(), "default");
  EXPECT_EQ(parsed.model_version(), "1");
  EXPECT_EQ(parsed.id(), "abc");
  ASSERT_EQ(parsed.parameters().size(), 1);
  EXPECT_EQ(parsed.parameters().at("batch_rows").int64_param(), 4);
  ASSERT_EQ(parsed.outputs_size(), 2);
  const auto& out = parsed.outputs(0);
  EXPECT_EQ(out.name(), "output");
  EXPECT_EQ(out.datatype(), "FP32");
  EXPECT_EQ(std::vector<int64_t>(out.shape().begin(), out.shape().end()),
            (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ(out.parameters().at("binary_data_size").int64_param(), 16);
  EXPECT_FALSE(out.has_contents());
  const auto& scores = parsed.outputs(1);
  EXPECT_EQ(scores.name(), "scores");
  EXPECT_EQ(std::vector<float>(scores.contents().fp32_contents().begin(),
                               scores.contents().fp32_contents().end()),
            (std::vector<float>{-1.0f, 2.5f}));
  ASSERT_EQ(parsed.raw_output_contents_size(), 1);
  EXPECT_EQ(parsed.raw_output_contents(0), output_bytes);
}

TEST(InferenceWireTest, ModelStreamInferResponseDecodesPublishedFields) {
  Wire failed;
  failed.Bytes(kModelStreamInferResponseErrorMessage, "queries: expected rank 3")
      .Message(kModelStreamInferResponseInferResponse, Wire().Bytes(kModelInferResponseId, "7"));
  const auto bad = ParseOrFail<ModelStreamInferResponse>(failed);
  EXPECT_EQ(bad.error_message(), "queries: expected rank 3");
  ASSERT_TRUE(bad.has_infer_response());
  EXPECT_EQ(bad.infer_response().id(), "7");

  Wire succeeded;
  succeeded.Message(
      kModelStreamInferResponseInferResponse,
      Wire()
          .Bytes(kModelInferResponseId, "8")
          .Message(kModelInferResponseOutputs, Wire().Bytes(kInferOutputTensorName, "output"))
          .Bytes(kModelInferResponseRawOutputContents, RawFloats({3.0f})));
  const auto good = ParseOrFail<ModelStreamInferResponse>(succeeded);
  EXPECT_EQ(good.error_message(), "");
  EXPECT_EQ(good.infer_response().id(), "8");
  ASSERT_EQ(good.infer_response().outputs_size(), 1);
  EXPECT_EQ(good.infer_response().outputs(0).name(), "output");
  ASSERT_EQ(good.infer_response().raw_output_contents_size(), 1);
  EXPECT_EQ(good.infer_response().raw_output_contents(0), RawFloats({3.0f}));
}

Wire Duration(uint64_t count, uint64_t ns) {
  return Wire().Varint(kStatisticDurationCount, count).Varint(kStatisticDurationNs, ns);
}

TEST(InferenceWireTest, ModelStatisticsResponseDecodesPublishedFields) {
  Wire inference_stats;
  inference_stats.Message(kInferStatisticsSuccess, Duration(9, 123456789))
      .Message(kInferStatisticsFail, Duration(2, 5000))
      .Message(kInferStatisticsQueue, Duration(9, 777))
      .Message(kInferStatisticsComputeInput, Duration(4, 11))
      .Message(kInferStatisticsComputeInfer, Duration(4, 987654321012))
      .Message(kInferStatisticsComputeOutput, Duration(4, 13));
  Wire stats;
  stats.Bytes(kModelStatisticsName, "default")
      .Bytes(kModelStatisticsVersion, "1")
      .Varint(kModelStatisticsLastInference, 1700000000123)
      .Varint(kModelStatisticsInferenceCount, 10)
      .Varint(kModelStatisticsExecutionCount, 4)
      .Message(kModelStatisticsInferenceStats, inference_stats)
      .Message(kModelStatisticsBatchStats,
               Wire()
                   .Varint(kInferBatchStatisticsBatchSize, 1)
                   .Message(kInferBatchStatisticsComputeInput, Duration(3, 30))
                   .Message(kInferBatchStatisticsComputeInfer, Duration(3, 3000))
                   .Message(kInferBatchStatisticsComputeOutput, Duration(3, 300)))
      .Message(kModelStatisticsBatchStats,
               Wire()
                   .Varint(kInferBatchStatisticsBatchSize, 7)
                   .Message(kInferBatchStatisticsComputeInfer, Duration(1, 70000)));
  Wire response;
  response.Message(kModelStatisticsResponseModelStats, stats)
      .Message(kModelStatisticsResponseModelStats, Wire().Bytes(kModelStatisticsName, "other"));

  const auto parsed = ParseOrFail<ModelStatisticsResponse>(response);
  ASSERT_EQ(parsed.model_stats_size(), 2);
  const auto& s = parsed.model_stats(0);
  EXPECT_EQ(s.name(), "default");
  EXPECT_EQ(s.version(), "1");
  EXPECT_EQ(s.last_inference(), 1700000000123u);
  EXPECT_EQ(s.inference_count(), 10u);
  EXPECT_EQ(s.execution_count(), 4u);
  const auto& is = s.inference_stats();
  EXPECT_EQ(is.success().count(), 9u);
  EXPECT_EQ(is.success().ns(), 123456789u);
  EXPECT_EQ(is.fail().count(), 2u);
  EXPECT_EQ(is.fail().ns(), 5000u);
  EXPECT_EQ(is.queue().count(), 9u);
  EXPECT_EQ(is.queue().ns(), 777u);
  EXPECT_EQ(is.compute_input().count(), 4u);
  EXPECT_EQ(is.compute_input().ns(), 11u);
  EXPECT_EQ(is.compute_infer().count(), 4u);
  EXPECT_EQ(is.compute_infer().ns(), 987654321012u);
  EXPECT_EQ(is.compute_output().count(), 4u);
  EXPECT_EQ(is.compute_output().ns(), 13u);
  ASSERT_EQ(s.batch_stats_size(), 2);
  EXPECT_EQ(s.batch_stats(0).batch_size(), 1u);
  EXPECT_EQ(s.batch_stats(0).compute_input().ns(), 30u);
  EXPECT_EQ(s.batch_stats(0).compute_infer().count(), 3u);
  EXPECT_EQ(s.batch_stats(0).compute_infer().ns(), 3000u);
  EXPECT_EQ(s.batch_stats(0).compute_output().ns(), 300u);
  EXPECT_EQ(s.batch_stats(1).batch_size(), 7u);
  EXPECT_EQ(s.batch_stats(1).compute_infer().count(), 1u);
  EXPECT_EQ(s.batch_stats(1).compute_infer().ns(), 70000u);
  EXPECT_FALSE(s.batch_stats(1).has_compute_input());
  EXPECT_EQ(parsed.model_stats(1).name(), "other");
  EXPECT_FALSE(parsed.model_stats(1).has_inference_stats());
}

TEST(InferenceWireTest, ModelConfigResponseDecodesPublishedFields) {
  Wire config;
  config.Bytes(kModelConfigName, "default")
      .Bytes(kModelConfigPlatform, "mha")
      .Message(kModelConfigVersionPolicy,
               Wire().Message(kModelVersionPolicyLatest,
                              Wire().Varint(kModelVersionPolicyLatestNumVersions, 1)))
      .SignedVarint(kModelConfigMaxBatchSize, 64)
      .Message(kModelConfigInput, Wire()
                                      .Bytes(kModelInputName, "queries")
                                      .Varint(kModelInputDataType, kDataTypeFp32)
                                      .PackedSigned(kModelInputDims, {-1, 100}))
      .Message(kModelConfigInput, Wire()
                                      .Bytes(kModelInputName, "valid_lens")
                                      .Varint(kModelInputDataType, kDataTypeInt32)
                                      .PackedSigned(kModelInputDims, {-1})
                                      .Varint(kModelInputOptional, 1))
      .Message(kModelConfigOutput, Wire()
                                       .Bytes(kModelOutputName, "output")
                                       .Varint(kModelOutputDataType, kDataTypeBf16)
                                       .PackedSigned(kModelOutputDims, {-1, 100}))
      .Message(kModelConfigInstanceGroup, Wire()
                                              .Bytes(kModelInstanceGroupName, "default_0")
                                              .SignedVarint(kModelInstanceGroupCount, 2)
                                              .Varint(kModelInstanceGroupKind, kKindCpu))
      .Message(kModelConfigDynamicBatching,
               Wire()
                   .PackedSigned(kModelDynamicBatchingPreferredBatchSize, {4, 8})
                   .Varint(kModelDynamicBatchingMaxQueueDelayMicroseconds, 2500)
                   .Varint(kModelDynamicBatchingPreserveOrdering, 1))
      .MapEntry(kModelConfigParameters, "scoring",
                Wire().Bytes(kModelParameterStringValue, "scaled_dot"))
      .Bytes(kModelConfigBackend, "mha-serve");
  const auto parsed =
      ParseOrFail<ModelConfigResponse>(Wire().Message(kModelConfigResponseConfig, config));
  const ModelConfig& c = parsed.config();
  EXPECT_EQ(c.name(), "default");
  EXPECT_EQ(c.platform(), "mha");
  ASSERT_TRUE(c.version_policy().has_latest());
  EXPECT_EQ(c.version_policy().latest().num_versions(), 1u);
  EXPECT_EQ(c.max_batch_size(), 64);
  ASSERT_EQ(c.input_size(), 2);
  EXPECT_EQ(c.input(0).name(), "queries");
  EXPECT_EQ(c.input(0).data_type(), inference::TYPE_FP32);
  EXPECT_EQ(std::vector<int64_t>(c.input(0).dims().begin(), c.input(0).dims().end()),
            (std::vector<int64_t>{-1, 100}));
  EXPECT_FALSE(c.input(0).optional());
  EXPECT_EQ(c.input(1).data_type(), inference::TYPE_INT32);
  EXPECT_TRUE(c.input(1).optional());
  ASSERT_EQ(c.output_size(), 1);
  EXPECT_EQ(c.output(0).name(), "output");
  EXPECT_EQ(c.output(0).data_type(), inference::TYPE_BF16);
  EXPECT_EQ(std::vector<int64_t>(c.output(0).dims().begin(), c.output(0).dims().end()),
            (std::vector<int64_t>{-1, 100}));
  ASSERT_EQ(c.instance_group_size(), 1);
  EXPECT_EQ(c.instance_group(0).name(), "default_0");
  EXPECT_EQ(c.instance_group(0).count(), 2);
  EXPECT_EQ(c.instance_group(0).kind(), inference::ModelInstanceGroup::KIND_CPU);
  ASSERT_EQ(c.scheduling_choice_case(), ModelConfig::kDynamicBatching);
  EXPECT_EQ(std::vector<int32_t>(c.dynamic_batching().preferred_batch_size().begin(),
                                 c.dynamic_batching().preferred_batch_size().end()),
            (std::vector<int32_t>{4, 8}));
  EXPECT_EQ(c.dynamic_batching().max_queue_delay_microseconds(), 2500u);
  EXPECT_TRUE(c.dynamic_batching().preserve_ordering());
  ASSERT_EQ(c.parameters().size(), 1);
  EXPECT_EQ(c.parameters().at("scoring").string_value(), "scaled_dot");
  EXPECT_EQ(c.backend(), "mha-serve");
}

// The reverse direction: what we send must be what a client built from the
// published .proto expects, byte for byte. Deterministic serialization writes
// fields in number order, map entries sorted by key and repeated scalars packed,
// which is the order the hand-built bytes use.
template <typename M>
std::string SerializeDeterministic(const M& message) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    EXPECT_TRUE(message.SerializeToCodedStream(&coded));
  }
  return out;
}

TEST(InferenceWireTest, ModelInferRequestSerializesToPublishedBytes) {
  ModelInferRequest request;
  request.set_model_name("default");
  request.set_id("r1");
  (*request.mutable_parameters())["seq"].set_int64_param(5);
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  auto* input = request.add_inputs();
  input->set_name("queries");
  input->set_datatype("FP32");
  input->add_shape(1);
  input->add_shape(1);
  input->add_shape(2);
  input->mutable_contents()->add_fp32_contents(0.5f);
  input->mutable_contents()->add_fp32_contents(-3.0f);
  request.add_outputs()->set_name("output");
  request.add_raw_input_contents(RawFloats({1.0f}));

  Wire expected;
  expected.Bytes(kModelInferRequestModelName, "default")
      .Bytes(kModelInferRequestId, "r1")
      .MapEntry(kModelInferRequestParameters, "causal", Wire().Varint(kInferParameterBool, 1))
      .MapEntry(kModelInferRequestParameters, "seq", Wire().SignedVarint(kInferParameterInt64, 5))
      .Message(kModelInferRequestInputs,
               Wire()
                   .Bytes(kInferInputTensorName, "queries")
                   .Bytes(kInferInputTensorDatatype, "FP32")
                   .PackedSigned(kInferInputTensorShape, {1, 1, 2})
                   .Message(kInferInputTensorContents,
                            Wire().PackedFloats(kInferTensorContentsFp32, {0.5f, -3.0f})))
      .Message(kModelInferRequestOutputs, Wire().Bytes(kInferRequestedOutputTensorName, "output"))
      .Bytes(kModelInferRequestRawInputContents, RawFloats({1.0f}));
  EXPECT_EQ(SerializeDeterministic(request), expected.bytes());
}

TEST(InferenceWireTest, ModelStatisticsResponseSerializesToPublishedBytes) {
  ModelStatisticsResponse response;
  auto* stats = response.add_model_stats();
  stats->set_name("default");
  stats->set_version("1");
  stats->set_inference_count(3);
  stats->set_execution_count(2);
  stats->mutable_inference_stats()->mutable_success()->set_count(3);
  stats->mutable_inference_stats()->mutable_success()->set_ns(300);
  stats->mutable_inference_stats()->mutable_compute_infer()->set_count(2);
  stats->mutable_inference_stats()->mutable_compute_infer()->set_ns(200);
  auto* batch = stats->add_batch_stats();
  batch->set_batch_size(2);
  batch->mutable_compute_infer()->set_count(1);
  batch->mutable_compute_infer()->set_ns(150);

  Wire expected;
  expected.Message(kModelStatisticsResponseModelStats,
                   Wire()
                       .Bytes(kModelStatisticsName, "default")
                       .Bytes(kModelStatisticsVersion, "1")
                       .Varint(kModelStatisticsInferenceCount, 3)
                       .Varint(kModelStatisticsExecutionCount, 2)
                       .Message(kModelStatisticsInferenceStats,
                                Wire()
                                    .Message(kInferStatisticsSuccess, Duration(3, 300))
                                    .Message(kInferStatisticsComputeInfer, Duration(2, 200)))
                       .Message(kModelStatisticsBatchStats,
                                Wire()
                                    .Varint(kInferBatchStatisticsBatchSize, 2)
                                    .Message(kInferBatchStatisticsComputeInfer, Duration(1, 150))));
  EXPECT_EQ(SerializeDeterministic(response), expected.bytes());
}

// The encoder itself, against bytes worked out by hand from the protobuf
// encoding rules, so a bug in it cannot hide a bug in the .proto.
TEST(InferenceWireTest, EncoderMatchesHandWorkedBytes) {
  // Field 1 varint 150: tag 0x08, then 150 = 0x96 0x01.
  EXPECT_EQ(Wire().Varint(1, 150).bytes(), std::string("\x08\x96\x01", 3));
  // Field 7 length-delimited "ab": tag 7 << 3 | 2 = 0x3a.
  EXPECT_EQ(Wire().Bytes(7, "ab").bytes(), std::string("\x3a\x02"
                                                       "ab",
                                                       4));
  // Field 2 int64 -1: ten bytes, nine 0xff then 0x01.
  EXPECT_EQ(Wire().SignedVarint(2, -1).bytes(),
            std::string("\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11));
  // Field 6 packed floats {1.0}: tag 0x32, length 4, 0x3f800000 little-endian.
  EXPECT_EQ(Wire().PackedFloats(6, {1.0f}).bytes(), std::string("\x32\x04\x00\x00\x80\x3f", 6));
  // Field 4 double 0.125 = 0x3fc0000000000000: tag 4 << 3 | 1 = 0x21.
  EXPECT_EQ(Wire().Double(4, 0.125).bytes(),
            std::string("\x21\x00\x00\x00\x00\x00\x00\xc0\x3f", 9));
  // Field 17 varint 1: the tag 17 << 3 = 136 needs two bytes, 0x88 0x01.
  EXPECT_EQ(Wire().Varint(17, 1).bytes(), std::string("\x88\x01\x01", 3));
}

}  // namespace
}  // namespace mha::server
