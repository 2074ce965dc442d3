// Expectations: a worker's immediate counting (its ImmCounter) with the expectations' deadlines.
// It meets, times out, cancels and ends expectations and hands each one's OnDone and status to
// the worker's report function (which queues the event for the callback thread). Worker thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "fabric/error.h"
#include "fabric/on_done.h"
#include "imm/imm_counter.h"
#include "worker/request.h"

namespace fabric {

class Expectations {
 public:
  using Report = std::function<void(OnDone&, Status)>;
  Expectations(size_t max_stray, Report report) : imms_(max_stray), report_(std::move(report)) {}

  void expect(ExpectRequest&& r);
  // One arrival; false: dropped (max_stray distinct values already counted with nobody waiting).
  bool arrive(uint32_t imm);
  // Ends a pending expectation with kCancelled; false when it had already ended.
  bool cancel(uint32_t imm, uint64_t id);
  // Ends with kTimeout every expectation whose deadline is before `now`.
  void expire(Clock::time_point now);
  bool has_deadlines() const { return !deadlines_.empty(); }
  uint64_t count(uint32_t imm) const { return imms_.count(imm); }
  uint64_t discard(uint32_t imm) { return imms_.discard(imm); }
  // Ends every pending expectation with `status` (the engine is closing).
  void end_all(const Status& status);

 private:
  struct Waiter {
    OnDone on_done;
    uint64_t id = 0;
    uint64_t count = 0;
    uint32_t imm = 0;
    std::optional<Clock::time_point> deadline;
  };
  void report_met();

  ImmCounter<Waiter> imms_;
  std::vector<Waiter> met_;  // capacity kept: nothing allocates per arrival
  std::set<std::tuple<Clock::time_point, uint64_t, uint32_t>> deadlines_;  // (when, id, imm)
  Report report_;
};

}  // namespace fabric
