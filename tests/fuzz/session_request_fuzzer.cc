// libFuzzer target: raw bytes -> a stream of attention.v1.SessionRequest -> one
// attention session driven the way its reactor (server/attention_v1/session.cc) drives it,
// against the fuzzers' model repository (fuzz_models.h).
//
// Input layout: the stream's messages, each as a varint length and that many bytes
// (protobuf's delimited format, what SerializeDelimitedTo writes). A length past the
// end or bytes that do not parse end the stream there, as a client's half-close
// (gRPC reports a frame that does not deserialize like one); at most kMaxSteps
// messages are read.
//
// Per message, as the reactor does: the first one finds the model (Find on model
// and model_version) and fixes the session's settings (SettingsOf); every one is
// decoded (DecodeSessionStep) with the keys cached so far; a refusal ends the session
// and must be an input error. A decoded step reserves room in a KvSequence of a pool
// of a few blocks (a refusal ends the session, which must leave the sequence as it
// was; the pool's blocks are reused ones, and the check knows exactly when a step
// fits), is built into a core::PagedStep as the reactor builds it (G key/value
// heads; a bf16 cache for a bf16 model or kv_cache_precision bf16; a CROSS step
// without keys points them at a dummy float, a SELF step's keys are nullptr), gets
// its response from PrepareSessionResponse and runs through ForwardPaged.
//
// Checks: a decoded step's views lie within its request's tensors and agree with the
// session's kind, and its request_bytes is the message's size; the response is shaped
// (1, T, p_o) in the request's encoding; ForwardPaged succeeds; the cache grows by
// exactly the step's keys and never past the model's session_tokens(); the step writes
// exactly its own new tokens of the cache (tokens before it keep their bits; every slot
// past the cache's size is poisoned with a NaN after each Reserve and must still hold
// it, so a step that reads a slot nobody wrote shows up as NaN); the output is finite
// when the session's inputs are of moderate size (finite huge ones may overflow, as in
// PyTorch); and for an f32 model with an f32 cache and small inputs the session's
// outputs equal one stateless Forward over the whole sequence with each query's visible
// keys as its valid_len (a rotary model's token t at position t both ways).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "core/attention.h"
#include "core/kernels.h"
#include "core/kv_cache.h"
#include "proto/attention.pb.h"
#include "server/attention_v1/session_codec.h"
#include "tests/fuzz/fuzz_models.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using attention::v1::SessionRequest;
using attention::v1::SessionResponse;
using mha::core::KvCachePool;
using mha::core::KvSequence;
using mha::server::SessionSettings;
using mha::server::SessionStepInput;

constexpr int kMaxSteps = 64;
// The session cache's budget: a few blocks (a block is 32 tokens: 1 KiB for p_o = 4
// in f32, half that in bf16; 1.5 KiB for the cross model's p_o = 6). Released blocks
// are kept for reuse up to all of it, so an input's blocks are reused ones.
constexpr int64_t kBudgetBytes = 6 << 10;
// Output finite when every input value so far was within this; the reference
// comparison when within kReferenceBound.
constexpr float kFiniteBound = 1e4f;
constexpr float kReferenceBound = 16.0f;

// The floats a request tensor holds (its data or its raw bytes), for range checks.
struct Storage {
  const float* begin = nullptr;
  int64_t size = 0;
};
Storage StorageOf(const attention::v1::Tensor& t) {
  if (!t.raw().empty()) {
    return {reinterpret_cast<const float*>(t.raw().data()),
            static_cast<int64_t>(t.raw().size() / sizeof(float))};
  }
  return {t.data().data(), t.data_size()};
}

// [view, view + count) lies within `t`'s values.
void CheckWithin(const char* field, const float* view, int64_t count,
                 const attention::v1::Tensor& t) {
  if (count == 0) return;
  const Storage s = StorageOf(t);
  const auto at = reinterpret_cast<uintptr_t>(view), begin = reinterpret_cast<uintptr_t>(s.begin);
  const uintptr_t bytes = static_cast<uintptr_t>(count) * sizeof(float);
  const uintptr_t size = static_cast<uintptr_t>(s.size) * sizeof(float);
  MHA_FUZZ_CHECK(view != nullptr && s.begin != nullptr && at >= begin && bytes <= size &&
                     at - begin <= size - bytes,
                 "%s: view of %lld floats outside its tensor of %lld\n", field,
                 static_cast<long long>(count), static_cast<long long>(s.size));
}

float MaxAbs(const float* x, int64_t n) {
  float m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(x[i]));
  return m;
}

// The decoded step agrees with its request, the session's kind and the limits.
void CheckDecoded(const SessionRequest& request, const SessionStepInput& step,
                  const SessionSettings& settings, const mha::server::Model& model,
                  int64_t cached) {
  const mha::core::ModelConfig& c = model.config;
  const bool self = settings.kind == attention::v1::SELF;
  MHA_FUZZ_CHECK(settings.kind == attention::v1::SELF || settings.kind == attention::v1::CROSS);
  MHA_FUZZ_CHECK(static_cast<int64_t>(request.ByteSizeLong()) <= model.limits.max_request_bytes);
  MHA_FUZZ_CHECK(step.request_bytes == static_cast<int64_t>(request.ByteSizeLong()));
  MHA_FUZZ_CHECK(step.num_queries >= (self ? 1 : 0) && step.num_keys >= 0);
  MHA_FUZZ_CHECK(step.raw == !request.queries().raw().empty());
  MHA_FUZZ_CHECK(step.num_queries == 0 || step.queries != nullptr);
  CheckWithin("queries", step.queries, step.num_queries * c.query_size, request.queries());
  if (self) {
    MHA_FUZZ_CHECK(c.SupportsSelfAttention());
    MHA_FUZZ_CHECK(step.keys == nullptr && step.values == nullptr);
    MHA_FUZZ_CHECK(step.num_keys == step.num_queries);
    MHA_FUZZ_CHECK(!request.has_keys() && !request.has_values());
  } else {
    MHA_FUZZ_CHECK((step.keys == nullptr) == (step.values == nullptr) || step.num_keys == 0);
    MHA_FUZZ_CHECK(step.num_keys == 0 || (request.has_keys() && request.has_values()));
    CheckWithin("keys", step.keys, step.num_keys * c.key_size, request.keys());
    CheckWithin("values", step.values, step.num_keys * c.value_size, request.values());
    if (settings.causal) MHA_FUZZ_CHECK(step.num_keys == step.num_queries);
  }
  MHA_FUZZ_CHECK(cached + step.num_keys <= model.limits.session_tokens(),
                 "%lld cached + %lld new over the session limit %lld\n",
                 static_cast<long long>(cached), static_cast<long long>(step.num_keys),
                 static_cast<long long>(model.limits.session_tokens()));
  // Decoding checked every value finite.
  const int64_t cross_keys = self ? 0 : step.num_keys;
  for (const auto& [x, n] : {std::pair{step.queries, step.num_queries * c.query_size},
                             std::pair{step.keys, cross_keys * c.key_size},
                             std::pair{step.values, cross_keys * c.value_size}}) {
    for (int64_t i = 0; i < n; ++i) MHA_FUZZ_CHECK(std::isfinite(x[i]));
  }
}

// A cache element (float, or uint16_t bf16 for a bf16 model's sequence): its bits,
// its value, and the NaN written to every element no step has written yet.
template <typename T>
struct Element;
template <>
struct Element<float> {
  static constexpr uint32_t kPoison = 0x7fc0dbadu;
  static uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }
  static float Value(float x) { return x; }
};
template <>
struct Element<uint16_t> {
  static constexpr uint16_t kPoison = 0x7fdb;
  static uint32_t Bits(uint16_t x) { return x; }
  static float Value(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
};

// Visits every element of every block of `cache` (core/kv_cache.h's layout: a
// block's keys of head h (p, kBlockTokens) transposed, its values (kBlockTokens, p)
// in column panels, kernels::ValueIndex):
// fn(token, head, key element, value element), token by token.
template <typename T, typename Fn>
void ForEachElement(const KvSequence& cache, Fn fn) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  const int64_t p = cache.head_size();
  for (int64_t b = 0; b < cache.capacity() / kBt; ++b) {
    for (int64_t h = 0; h < cache.num_heads(); ++h) {
      T* keys = cache.keys<T>(b, h);
      T* values = cache.values<T>(b, h);
      for (int64_t r = 0; r < kBt; ++r) {
        for (int64_t i = 0; i < p; ++i)
          fn(b * kBt + r, h, keys[i * kBt + r],
             values[mha::core::kernels::ValueIndex<T>(r, i, p, kBt)]);
      }
    }
  }
}

// Poisons the elements of `cache` past its size.
template <typename T>
void PoisonUnwritten(const KvSequence& cache) {
  ForEachElement<T>(cache, [&](int64_t t, int64_t, T& k, T& v) {
    if (t < cache.size()) return;
    k = std::bit_cast<T>(Element<T>::kPoison);
    v = std::bit_cast<T>(Element<T>::kPoison);
  });
}

// The whole cache's bits, in ForEachElement's order.
template <typename T>
std::vector<uint32_t> Snapshot(const KvSequence& cache) {
  std::vector<uint32_t> bits;
  ForEachElement<T>(cache, [&](int64_t, int64_t, const T& k, const T& v) {
    bits.push_back(Element<T>::Bits(k));
    bits.push_back(Element<T>::Bits(v));
  });
  return bits;
}

// After a step from `before` tokens: tokens before it unchanged (`snapshot`, taken
// after Reserve), its own tokens written (and finite when `finite`), later ones
// still poison.
template <typename T>
void CheckCacheAfterStep(const KvSequence& cache, int64_t before,
                         const std::vector<uint32_t>& snapshot, bool finite) {
  MHA_FUZZ_CHECK(snapshot.size() == static_cast<size_t>(cache.capacity() * cache.num_heads() *
                                                        cache.head_size() * 2),
                 "the cache's capacity changed during the step\n");
  size_t at = 0;
  ForEachElement<T>(cache, [&](int64_t t, int64_t h, const T& k, const T& v) {
    for (const T* x : {&k, &v}) {
      const uint32_t bits = Element<T>::Bits(*x);
      const char* which = x == &k ? "key" : "value";
      if (t < before) {
        MHA_FUZZ_CHECK(bits == snapshot[at], "cached token %lld head %lld: %s changed\n",
                       static_cast<long long>(t), static_cast<long long>(h), which);
      } else if (t < cache.size()) {
        MHA_FUZZ_CHECK(bits != Element<T>::kPoison, "new token %lld head %lld: %s not written\n",
                       static_cast<long long>(t), static_cast<long long>(h), which);
        if (finite) MHA_FUZZ_CHECK(std::isfinite(Element<T>::Value(*x)));
      } else {
        MHA_FUZZ_CHECK(bits == Element<T>::kPoison,
                       "token %lld head %lld past the cache's size: %s written\n",
                       static_cast<long long>(t), static_cast<long long>(h), which);
      }
      ++at;
    }
  });
}

// The cache helpers for the sequence's element type.
void PoisonUnwritten(const KvSequence& cache) {
  cache.bf16() ? PoisonUnwritten<uint16_t>(cache) : PoisonUnwritten<float>(cache);
}
std::vector<uint32_t> Snapshot(const KvSequence& cache) {
  return cache.bf16() ? Snapshot<uint16_t>(cache) : Snapshot<float>(cache);
}
void CheckCacheAfterStep(const KvSequence& cache, int64_t before,
                         const std::vector<uint32_t>& snapshot, bool finite) {
  cache.bf16() ? CheckCacheAfterStep<uint16_t>(cache, before, snapshot, finite)
               : CheckCacheAfterStep<float>(cache, before, snapshot, finite);
}

// Takes every block the pool can hand out for this model's sequences and releases
// them: the session's blocks are then reused ones (the pool's retained blocks, as
// in a server that has served sessions), each poisoned again as it is reserved.
void CycleThroughPool(KvCachePool* pool, int64_t num_heads, int64_t head_size, bool bf16) {
  KvSequence all(pool, num_heads, head_size, bf16);
  while (all.Reserve(all.capacity() + KvCachePool::kBlockTokens).ok()) {
  }
  MHA_FUZZ_CHECK(all.bytes() <= pool->budget_bytes() && all.capacity() > 0);
}

// The session so far as one stateless call: every query, every key and value, and
// per query the keys it saw.
struct Reference {
  std::vector<float> queries, keys, values, outputs;
  std::vector<int32_t> lens;

  void Add(const SessionStepInput& step, const mha::core::ModelConfig& c, bool self, bool causal,
           int64_t cached, const float* output) {
    const float* k = self ? step.queries : step.keys;
    const float* v = self ? step.queries : step.values;
    queries.insert(queries.end(), step.queries, step.queries + step.num_queries * c.query_size);
    if (step.num_keys > 0) {
      keys.insert(keys.end(), k, k + step.num_keys * c.key_size);
      values.insert(values.end(), v, v + step.num_keys * c.value_size);
    }
    for (int64_t i = 0; i < step.num_queries; ++i) {
      lens.push_back(static_cast<int32_t>(causal ? cached + i + 1 : cached + step.num_keys));
    }
    outputs.insert(outputs.end(), output, output + step.num_queries * c.num_hiddens);
  }

  void Check(const mha::server::Model& model) const {
    const mha::core::ModelConfig& c = model.config;
    const int64_t q = static_cast<int64_t>(lens.size());
    const int64_t k = static_cast<int64_t>(keys.size()) / c.key_size;
    if (q == 0 || k == 0) return;
    const mha::core::AttentionInputs in{.batch = 1,
                                        .num_queries = q,
                                        .num_keys = k,
                                        .queries = queries.data(),
                                        .keys = keys.data(),
                                        .values = values.data(),
                                        .valid_lens = lens};
    std::vector<float> want(static_cast<size_t>(q * c.num_hiddens));
    const absl::Status status = model.attention->Forward(in, want.data());
    MHA_FUZZ_CHECK(status.ok(), "reference Forward: %s\n", status.ToString().c_str());
    for (size_t i = 0; i < want.size(); ++i) {
      MHA_FUZZ_CHECK(std::abs(outputs[i] - want[i]) <= 1e-3f * (1.0f + std::abs(want[i])),
                     "output %zu (query %zu of %lld, %lld keys): session %g, stateless %g\n", i,
                     i / static_cast<size_t>(c.num_hiddens), static_cast<long long>(q),
                     static_cast<long long>(k), outputs[i], want[i]);
    }
  }
};

// The stream's messages: delimited, up to kMaxSteps, up to the first that does not
// parse.
std::vector<SessionRequest> SplitStream(const uint8_t* data, size_t size) {
  std::vector<SessionRequest> messages;
  size_t at = 0;
  while (at < size && static_cast<int>(messages.size()) < kMaxSteps) {
    uint64_t length = 0;
    int shift = 0;
    bool complete = false;
    while (at < size && shift < 64) {
      const uint8_t b = data[at++];
      length |= static_cast<uint64_t>(b & 0x7f) << shift;
      shift += 7;
      if ((b & 0x80) == 0) {
        complete = true;
        break;
      }
    }
    if (!complete || length > size - at) break;
    SessionRequest& message = messages.emplace_back();
    if (!message.ParseFromArray(data + at, static_cast<int>(length))) {
      messages.pop_back();
      break;
    }
    at += length;
  }
  return messages;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  mha::fuzzing::InitializeRequestFuzzer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<SessionRequest> stream = SplitStream(data, size);
  if (stream.empty()) return 0;

  // The reactor's state (server/attention_v1/session.cc, Session).
  std::shared_ptr<const mha::server::Model> model;
  SessionSettings settings;
  KvCachePool pool(kBudgetBytes, /*retain_bytes=*/kBudgetBytes);
  std::unique_ptr<KvSequence> cache;

  Reference reference;
  float max_input = 0;  // over every value the session was sent
  for (const SessionRequest& request : stream) {
    const bool first = model == nullptr;
    if (first) {
      absl::StatusOr<std::shared_ptr<const mha::server::Model>> found =
          mha::fuzzing::Repository().Find(request.model(), request.model_version());
      if (!found.ok()) {
        MHA_FUZZ_CHECK(mha::fuzzing::IsInputError(found.status()), "%s\n",
                       found.status().ToString().c_str());
        return 0;
      }
      model = *std::move(found);
      settings = mha::server::SettingsOf(request);
    }
    const mha::core::ModelConfig& c = model->config;
    const bool self = settings.kind == attention::v1::SELF;
    const int64_t cached = cache != nullptr ? cache->size() : 0;
    absl::StatusOr<SessionStepInput> decoded =
        mha::server::DecodeSessionStep(request, first, settings, *model, cached);
    if (!decoded.ok()) {  // the stream ends with it
      MHA_FUZZ_CHECK(mha::fuzzing::IsInputError(decoded.status()), "%s\n",
                     decoded.status().ToString().c_str());
      break;
    }
    const SessionStepInput& step = *decoded;
    CheckDecoded(request, step, settings, *model, cached);
    const int64_t cross_keys = self ? 0 : step.num_keys;
    max_input = std::max({max_input, MaxAbs(step.queries, step.num_queries * c.query_size),
                          MaxAbs(step.keys, cross_keys * c.key_size),
                          MaxAbs(step.values, cross_keys * c.value_size)});

    // The cache as the reactor makes it: G key/value heads, bf16 for a bf16 model or
    // kv_cache_precision bf16.
    const bool bf16 = c.cache_bf16();
    if (first) {
      CycleThroughPool(&pool, c.kv_heads(), c.head_size(), bf16);
      cache = std::make_unique<KvSequence>(&pool, c.kv_heads(), c.head_size(), bf16);
    }
    // The pool serves this session alone: a step fits iff its blocks do.
    constexpr int64_t kBt = KvCachePool::kBlockTokens;
    const int64_t block_bytes = 2 * c.kv_hiddens() * kBt * (bf16 ? 2 : 4);
    const bool fits = (cached + step.num_keys + kBt - 1) / kBt * block_bytes <= kBudgetBytes;
    const int64_t capacity = cache->capacity(), used = pool.used_bytes();
    const absl::Status reserved = cache->Reserve(step.num_keys);
    MHA_FUZZ_CHECK(reserved.ok() == fits, "%lld + %lld tokens of %lld-byte blocks: %s\n",
                   static_cast<long long>(cached), static_cast<long long>(step.num_keys),
                   static_cast<long long>(block_bytes), reserved.ToString().c_str());
    if (!reserved.ok()) {  // the stream ends
      MHA_FUZZ_CHECK(reserved.code() == absl::StatusCode::kResourceExhausted &&
                     !reserved.message().empty());
      MHA_FUZZ_CHECK(cache->size() == cached && cache->capacity() == capacity &&
                     pool.used_bytes() == used);
      break;
    }
    MHA_FUZZ_CHECK(cache->capacity() >= cached + step.num_keys &&
                   pool.used_bytes() <= pool.budget_bytes());
    PoisonUnwritten(*cache);
    const std::vector<uint32_t> snapshot = Snapshot(*cache);

    SessionResponse response;
    float* output_view = mha::server::PrepareSessionResponse(step, *model, &response);
    float* lse_view =
        settings.return_lse ? mha::server::PrepareSessionLse(step, *model, &response) : nullptr;
    MHA_FUZZ_CHECK(!settings.return_lse || c.attention_only());
    mha::core::PagedStep paged =
        mha::server::ToPagedStep(step, settings, cache.get(), output_view, lse_view);
    if (lse_view != nullptr) {
      const attention::v1::Tensor& lse = response.lse();
      MHA_FUZZ_CHECK(lse.shape_size() == 3 && lse.shape(1) == c.num_heads &&
                     lse.shape(2) == step.num_queries);
    }
    const attention::v1::Tensor& out = response.output();
    MHA_FUZZ_CHECK(out.shape_size() == 3 && out.shape(0) == 1 && out.shape(1) == step.num_queries &&
                   out.shape(2) == c.num_hiddens);
    MHA_FUZZ_CHECK(out.raw().empty() || out.data_size() == 0);
    MHA_FUZZ_CHECK(static_cast<int64_t>(step.raw ? out.raw().size() / sizeof(float)
                                                 : static_cast<size_t>(out.data_size())) ==
                   step.num_queries * c.num_hiddens);
    const absl::Status status = model->attention->ForwardPaged({&paged, 1});
    MHA_FUZZ_CHECK(status.ok(), "%s\n", status.ToString().c_str());

    MHA_FUZZ_CHECK(cache->size() == cached + step.num_keys, "cache %lld after %lld + %lld\n",
                   static_cast<long long>(cache->size()), static_cast<long long>(cached),
                   static_cast<long long>(step.num_keys));
    MHA_FUZZ_CHECK(cache->size() <= model->limits.session_tokens());
    const bool moderate = max_input <= kFiniteBound;
    CheckCacheAfterStep(*cache, cached, snapshot, moderate);
    const float* output =
        step.raw ? reinterpret_cast<const float*>(out.raw().data()) : out.data().data();
    if (moderate) {
      for (int64_t i = 0; i < step.num_queries * c.num_hiddens; ++i) {
        MHA_FUZZ_CHECK(std::isfinite(output[i]), "output %lld is %g, inputs within %g\n",
                       static_cast<long long>(i), output[i], max_input);
      }
    }
    reference.Add(step, c, self, settings.causal, cached, output);
  }
  if (model != nullptr && !model->config.cache_bf16() && max_input <= kReferenceBound) {
    reference.Check(*model);
  }
  cache.reset();
  MHA_FUZZ_CHECK(pool.used_bytes() == 0, "%lld bytes held after the session\n",
                 static_cast<long long>(pool.used_bytes()));
  return 0;
}
