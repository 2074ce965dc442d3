// The time as one phase of a worker's round sees it: the clock is read on first need and the value
// reused until the next phase, so the metrics' timestamps cost one clock read per phase that needs
// one (per transfer when they come one at a time, far fewer when they come in batches). A stamp
// is at most one phase early: a phase takes microseconds (tens under a burst of 64 requests).
#pragma once

#include <chrono>

namespace fabric::util {

class RoundClock {
 public:
  using Clock = std::chrono::steady_clock;
  void next_phase() { valid_ = false; }
  Clock::time_point now() {
    if (!valid_) {
      now_ = Clock::now();
      valid_ = true;
    }
    return now_;
  }

 private:
  Clock::time_point now_{};
  bool valid_ = false;
};

}  // namespace fabric::util
