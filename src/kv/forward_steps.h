// A trigger's step count turned into (requests, layer) events: each forward is num_layers steps, one
// per layer, then one for the extras (kExtrasLayer). Pure bookkeeping, owned by KvSender under its
// lock; unit-tested on the CPU (tests/unit/kv_forward_steps_test.cpp).
#pragma once

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "fabric/kv/transfer.h"

namespace fabric::kv {

class ForwardSteps {
 public:
  explicit ForwardSteps(uint32_t layers) : layers_(layers) {}

  // The next forward computes these requests.
  void push(std::vector<uint64_t> requests) {
    if (forwards_.empty()) front_start_ = steps_;
    forwards_.push_back(std::move(requests));
  }

  struct Event {
    std::vector<uint64_t> requests;
    uint32_t layer;  // kExtrasLayer: the forward's last step
  };
  // The trigger has counted `value` steps in all (values at or below what was seen are ignored).
  // Appends one event per new step to `out`; returns how many new steps had no forward begun.
  uint64_t reach(uint64_t value, std::vector<Event>& out) {
    uint64_t unmatched = 0;
    while (steps_ < value) {
      if (forwards_.empty()) {
        unmatched += value - steps_;
        steps_ = value;
        break;
      }
      const uint64_t k = steps_ - front_start_;
      out.push_back({forwards_.front(), k < layers_ ? static_cast<uint32_t>(k) : kExtrasLayer});
      steps_++;
      if (k == layers_) {  // the extras' step ends the forward
        forwards_.pop_front();
        front_start_ = steps_;
      }
    }
    return unmatched;
  }

  size_t forwards_pending() const { return forwards_.size(); }

 private:
  uint64_t layers_;
  uint64_t steps_ = 0;        // steps seen in all
  uint64_t front_start_ = 0;  // the step at which the front forward began
  std::deque<std::vector<uint64_t>> forwards_;
};

}  // namespace fabric::kv
