// ImmCounter: counts arrivals of each 32-bit immediate and meets expectations ("call me when imm X
// has been seen N times") whatever the arrival order. Owned by one worker thread: no locks.
//
// Rules (also in docs/api.md):
// - Every arrival adds one to the immediate's count, whether or not an expectation exists yet, so
//   immediates that arrive early are never lost, within a bound: at most `max_stray` distinct
//   immediates may be counted with no expectation waiting for them; an arrival of yet another
//   such value is dropped (arrive() returns false; the engine counts it in NicStats).
// - expect(imm, n) is met as soon as the count reaches n; meeting it consumes n from the count.
// - Arrivals beyond what pending expectations need stay counted and go to the next expectation of
//   the same immediate (re-arming is just calling expect again).
// - Several expectations of one immediate are met in the order they were registered (FIFO).
// - An expectation that is cancelled (or times out) consumes nothing: what it had seen stays
//   counted for the next expectation of that immediate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fabric {

template <class Waiter>
class ImmCounter {
 public:
  explicit ImmCounter(size_t max_stray = SIZE_MAX) : max_stray_(max_stray) {}

  // Registers expectation `id` (unique, chosen by the caller). If already met, returns its waiter
  // in `met`.
  void expect(uint32_t imm, uint64_t count, uint64_t id, Waiter waiter, std::vector<Waiter>& met) {
    Entry& e = entry(imm);
    bool was_stray = stray(e);
    e.waiting.push_back({count, id, std::move(waiter)});
    settle(imm, e, was_stray, met);
  }

  // One arrival of `imm`; expectations met by it are appended to `met`. False: dropped (too many
  // distinct immediates counted with nobody waiting for them).
  bool arrive(uint32_t imm, std::vector<Waiter>& met) {
    auto it = entries_.find(imm);
    if (it == entries_.end()) {
      if (strays_ >= max_stray_) return false;
    }
    Entry& e = it != entries_.end() ? it->second : entry(imm);
    bool was_stray = stray(e);
    e.count++;
    settle(imm, e, was_stray, met);
    return true;
  }

  // Removes expectation `id` of `imm` if it is still waiting, handing its waiter to `out`. Later
  // expectations that waited behind it and are met now are appended to `met`.
  bool cancel(uint32_t imm, uint64_t id, Waiter& out, std::vector<Waiter>& met) {
    auto it = entries_.find(imm);
    if (it == entries_.end()) return false;
    Entry& e = it->second;
    for (size_t i = 0; i < e.waiting.size(); i++) {
      if (e.waiting[i].id != id) continue;
      out = std::move(e.waiting[i].waiter);
      e.waiting.erase(e.waiting.begin() + static_cast<std::ptrdiff_t>(i));
      settle(imm, e, false, met);  // the next in line may be met by what is counted already
      return true;
    }
    return false;
  }

  uint64_t count(uint32_t imm) const {
    auto it = entries_.find(imm);
    return it == entries_.end() ? 0 : it->second.count;
  }
  // Drops the arrivals of `imm` counted and not consumed; returns how many. Pending expectations
  // stay, and count from zero again.
  uint64_t discard(uint32_t imm) {
    auto it = entries_.find(imm);
    if (it == entries_.end()) return 0;
    Entry& e = it->second;
    const uint64_t n = e.count;
    bool was_stray = stray(e);
    e.count = 0;
    std::vector<Waiter> none;
    settle(imm, e, was_stray, none);  // nothing can be met at zero: only the bookkeeping
    return n;
  }
  // Distinct immediates counted with no expectation waiting (bounded by max_stray).
  size_t strays() const { return strays_; }

  // Removes and returns every pending waiter (engine shutdown).
  std::vector<Waiter> take_all_waiting() {
    std::vector<Waiter> out;
    for (auto& [imm, e] : entries_)
      for (auto& w : e.waiting) out.push_back(std::move(w.waiter));
    entries_.clear();
    strays_ = 0;
    return out;
  }

 private:
  struct Waiting {
    uint64_t count;
    uint64_t id;
    Waiter waiter;
  };
  struct Entry {
    uint64_t count = 0;
    std::vector<Waiting> waiting;  // FIFO; short (a vector: no allocation per entry beyond it)
  };

  static bool stray(const Entry& e) { return e.waiting.empty() && e.count > 0; }

  // Meets what can be met, erases an entry with nothing left, and keeps strays_ in step.
  void settle(uint32_t imm, Entry& e, bool was_stray, std::vector<Waiter>& met) {
    size_t n = 0;
    while (n < e.waiting.size() && e.count >= e.waiting[n].count) {
      e.count -= e.waiting[n].count;
      met.push_back(std::move(e.waiting[n].waiter));
      n++;
    }
    if (n > 0) e.waiting.erase(e.waiting.begin(), e.waiting.begin() + static_cast<std::ptrdiff_t>(n));
    bool is_stray = stray(e);
    if (was_stray && !is_stray) strays_--;
    if (!was_stray && is_stray) strays_++;
    if (e.count == 0 && e.waiting.empty()) retire(imm);
  }

  // An entry with nothing left goes, but its node (and its waiting list's capacity) is kept for
  // the next new immediate: immediates come and go every round, and this keeps them from
  // allocating.
  void retire(uint32_t imm) {
    auto node = entries_.extract(imm);
    if (spare_.size() < kMaxSpare) spare_.push_back(std::move(node));
  }
  Entry& entry(uint32_t imm) {
    auto it = entries_.find(imm);
    if (it != entries_.end()) return it->second;
    if (spare_.empty()) return entries_[imm];
    auto node = std::move(spare_.back());
    spare_.pop_back();
    node.key() = imm;
    node.mapped().count = 0;
    node.mapped().waiting.clear();
    return entries_.insert(std::move(node)).position->second;
  }

  static constexpr size_t kMaxSpare = 1024;
  size_t max_stray_;
  size_t strays_ = 0;
  std::unordered_map<uint32_t, Entry> entries_;
  std::vector<typename std::unordered_map<uint32_t, Entry>::node_type> spare_;
};

}  // namespace fabric
