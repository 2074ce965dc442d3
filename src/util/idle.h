// What a polling thread does when it found no work: spin (kBusy), or spin, yield, then sleep
// briefly (kAdaptive, for machines with fewer cores than busy threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#include "fabric/config.h"

namespace fabric::util {

class Idle {
 public:
  explicit Idle(PollMode mode, std::chrono::microseconds sleep = std::chrono::microseconds(50))
      : mode_(mode), sleep_(sleep) {}
  void reset() { idle_rounds_ = 0; }
  void wait() {
    if (mode_ == PollMode::kBusy) return;
    ++idle_rounds_;
    if (idle_rounds_ < kSpinRounds) return;
    if (idle_rounds_ < kYieldRounds) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
  }

 private:
  static constexpr uint32_t kSpinRounds = 200;
  static constexpr uint32_t kYieldRounds = 2000;
  PollMode mode_;
  std::chrono::microseconds sleep_;
  uint32_t idle_rounds_ = 0;
};

}  // namespace fabric::util
