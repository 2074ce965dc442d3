// ImmCounter: counts arrivals of each 32-bit immediate and meets expectations ("call me when imm X
// has been seen N times") whatever the arrival order. Owned by one worker thread: no locks.
//
// Rules (also in docs/api.md):
// - Every arrival adds one to the immediate's count, whether or not an expectation exists yet, so
//   immediates that arrive early are never lost.
// - expect(imm, n) is met as soon as the count reaches n; meeting it consumes n from the count.
// - Arrivals beyond what pending expectations need stay counted and go to the next expectation of
//   the same immediate (re-arming is just calling expect again).
// - Several expectations of one immediate are met in the order they were registered (FIFO).
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fabric {

template <class Waiter>
class ImmCounter {
 public:
  // Registers an expectation. If already met, returns its waiter in `met`.
  void expect(uint32_t imm, uint64_t count, Waiter waiter, std::vector<Waiter>& met) {
    Entry& e = entries_[imm];
    e.waiting.push_back({count, std::move(waiter)});
    settle(imm, e, met);
  }

  // One arrival of `imm`; expectations met by it are appended to `met`.
  void arrive(uint32_t imm, std::vector<Waiter>& met) {
    Entry& e = entries_[imm];
    e.count++;
    if (!e.waiting.empty()) settle(imm, e, met);
  }

  uint64_t count(uint32_t imm) const {
    auto it = entries_.find(imm);
    return it == entries_.end() ? 0 : it->second.count;
  }

  // Removes and returns every pending waiter (engine shutdown).
  std::vector<Waiter> take_all_waiting() {
    std::vector<Waiter> out;
    for (auto& [imm, e] : entries_)
      for (auto& w : e.waiting) out.push_back(std::move(w.waiter));
    entries_.clear();
    return out;
  }

 private:
  struct Waiting {
    uint64_t count;
    Waiter waiter;
  };
  struct Entry {
    uint64_t count = 0;
    std::deque<Waiting> waiting;
  };

  void settle(uint32_t imm, Entry& e, std::vector<Waiter>& met) {
    while (!e.waiting.empty() && e.count >= e.waiting.front().count) {
      e.count -= e.waiting.front().count;
      met.push_back(std::move(e.waiting.front().waiter));
      e.waiting.pop_front();
    }
    if (e.count == 0 && e.waiting.empty()) entries_.erase(imm);
  }

  std::unordered_map<uint32_t, Entry> entries_;
};

}  // namespace fabric
