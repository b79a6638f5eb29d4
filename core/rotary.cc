#include "core/rotary.h"

#include <algorithm>
#include <cmath>

namespace mha::core::internal {

RotaryTable::RotaryTable(int64_t positions, int64_t rotary_dim, double theta)
    : positions_(positions), half_(rotary_dim / 2) {
  cos_.resize(static_cast<size_t>(positions * half_));
  sin_.resize(cos_.size());
  std::vector<double> inv_freq(static_cast<size_t>(half_));
  for (int64_t k = 0; k < half_; ++k) {
    inv_freq[k] = std::pow(theta, -2.0 * static_cast<double>(k) / static_cast<double>(rotary_dim));
  }
  for (int64_t t = 0; t < positions; ++t) {
    for (int64_t k = 0; k < half_; ++k) {
      const double angle = static_cast<double>(t) * inv_freq[k];
      cos_[t * half_ + k] = static_cast<float>(std::cos(angle));
      sin_[t * half_ + k] = static_cast<float>(std::sin(angle));
    }
  }
}

std::shared_ptr<const RotaryTable> Rotary::Table(int64_t n) const {
  absl::MutexLock lock(&mu_);
  if (table_ == nullptr || table_->positions() < n) {
    // Doubling: a session growing token by token rebuilds the table log(n) times.
    const int64_t have = table_ == nullptr ? 0 : table_->positions();
    table_ = std::make_shared<const RotaryTable>(std::max({n, 2 * have, int64_t{256}}), rotary_dim_,
                                                 theta_);
  }
  return table_;
}

}  // namespace mha::core::internal
