// What a polling thread does when it found no work: spin (kBusy), or spin, yield, then sleep
// briefly (kAdaptive, for machines with fewer cores than busy threads).
#pragma once

#include <sys/prctl.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "fabric/config.h"

namespace fabric::util {

// Makes the calling thread's short sleeps last what they ask for. Linux lets a sleep overrun by
// the thread's timer slack, 50 us by default: a 20 us nap took 73 us (p50) on the dev VM and 24
// us with 1 us of slack, and a polling thread that naps notices work that much later.
inline void tighten_timer_slack() { (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL); }

class Idle {
 public:
  // Construct it on the polling thread (it tightens that thread's timer slack when it may nap).
  explicit Idle(PollMode mode, std::chrono::microseconds sleep = std::chrono::microseconds(50))
      : mode_(mode), sleep_(sleep) {
    if (mode_ == PollMode::kAdaptive) tighten_timer_slack();
  }
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
