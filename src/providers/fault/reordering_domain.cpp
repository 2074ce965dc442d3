// Reordering wrapper: forwards posts unchanged, shuffles and delays what poll() returns.
#include "providers/fault/reordering_domain.h"

#include <algorithm>
#include <random>
#include <vector>

#include "providers/fault/forwarding_domain.h"

namespace fabric {
namespace {

class ReorderingDomain final : public ForwardingDomain {
 public:
  ReorderingDomain(std::unique_ptr<Domain> inner, const ReorderConfig& config, size_t nic_index)
      : ForwardingDomain(std::move(inner)), config_(config), rng_(config.seed * 1000003 + nic_index) {}

  size_t poll(std::span<Completion> out) override {
    Completion fresh[64];
    size_t n = inner_->poll(std::span(fresh, std::min(out.size(), std::size(fresh))));
    std::uniform_int_distribution<uint32_t> hold(0, config_.max_hold_polls);
    for (size_t i = 0; i < n; i++) held_.push_back({std::move(fresh[i]), hold(rng_)});

    // Release in random order those whose hold ran out; age the rest.
    std::shuffle(held_.begin(), held_.end(), rng_);
    size_t written = 0;
    for (size_t i = 0; i < held_.size();) {
      if (held_[i].polls_left == 0 && written < out.size()) {
        out[written++] = std::move(held_[i].completion);
        held_[i] = std::move(held_.back());
        held_.pop_back();
      } else {
        if (held_[i].polls_left > 0) held_[i].polls_left--;
        i++;
      }
    }
    return written;
  }

 private:
  struct Held {
    Completion completion;
    uint32_t polls_left;
  };
  ReorderConfig config_;
  std::mt19937_64 rng_;
  std::vector<Held> held_;
};

}  // namespace

std::unique_ptr<Domain> wrap_reordering(std::unique_ptr<Domain> inner, const ReorderConfig& config,
                                        size_t nic_index) {
  return std::make_unique<ReorderingDomain>(std::move(inner), config, nic_index);
}

}  // namespace fabric
