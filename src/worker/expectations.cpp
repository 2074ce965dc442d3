// Expectations (expectations.h): the ImmCounter's waiters, their deadlines and their reports.
#include "worker/expectations.h"

#include <fmt/format.h>

namespace fabric {

void Expectations::expect(ExpectRequest&& r) {
  imms_.expect(r.imm, r.count, r.id, Waiter{std::move(r.on_done), r.id, r.count, r.imm, r.deadline}, met_);
  const bool met_now = !met_.empty();  // only this one can be met: the count did not change
  report_met();
  if (!met_now && r.deadline) deadlines_.emplace(*r.deadline, r.id, r.imm);
}

bool Expectations::arrive(uint32_t imm) {
  const bool counted = imms_.arrive(imm, met_);
  report_met();
  return counted;
}

bool Expectations::cancel(uint32_t imm, uint64_t id) {
  Waiter w;
  if (!imms_.cancel(imm, id, w, met_)) return false;
  if (w.deadline) deadlines_.erase({*w.deadline, id, imm});
  report_(w.on_done, Status(ErrorCode::kCancelled, "the expectation was cancelled (cancel_imm_expectation)"));
  report_met();
  return true;
}

void Expectations::expire(Clock::time_point now) {
  while (!deadlines_.empty() && std::get<0>(*deadlines_.begin()) <= now) {
    auto [when, id, imm] = *deadlines_.begin();
    deadlines_.erase(deadlines_.begin());
    Waiter w;
    if (!imms_.cancel(imm, id, w, met_)) continue;
    report_(w.on_done,
            Status(ErrorCode::kTimeout,
                   fmt::format("expect_imm_count: immediate {:#x} arrived {} of the {} times expected "
                               "before the timeout (ExpectOptions::timeout): did a sender fail, or "
                               "is the expected count wrong?",
                               imm, imms_.count(imm), w.count)));
    report_met();
  }
}

void Expectations::end_all(const Status& status) {
  for (auto& w : imms_.take_all_waiting()) report_(w.on_done, status);
  deadlines_.clear();
}

void Expectations::report_met() {
  for (auto& w : met_) {
    if (w.deadline) deadlines_.erase({*w.deadline, w.id, w.imm});
    report_(w.on_done, Status::ok_status());
  }
  met_.clear();
}

}  // namespace fabric
