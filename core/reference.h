// A naive reference of the layer: plain loops, double accumulation, no oneDNN and no
// shared code with attention.cc beyond the public structs. Used by tests only; it
// is the independent check of the fast path. Same semantics and shapes as
// MultiHeadAttention::Forward (see attention.h), both scorings; the inputs must
// already be valid.
// It decodes valid_lens itself, not through ValidLens, so that the one reader of
// that layout the fast path and the server share is checked as well.
#ifndef MHA_CORE_REFERENCE_H_
#define MHA_CORE_REFERENCE_H_

#include <vector>

#include "core/attention.h"
#include "core/config.h"
#include "core/weights.h"

namespace mha::core {

struct ReferenceResult {
  std::vector<double> output;     // (B, Q, p_o)
  std::vector<double> attention;  // (B, h, Q, K)
};

ReferenceResult ReferenceForward(const ModelConfig& config, const Weights& weights,
                                 const AttentionInputs& inputs);

}  // namespace mha::core

#endif  // MHA_CORE_REFERENCE_H_
