// The free slots of a fixed-size table, taken and given back by the one thread that writes the
// table (the worker): lowest index first at the start, then most recently freed first.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace fabric::util {

class FreeSlots {
 public:
  explicit FreeSlots(size_t capacity) {
    free_.reserve(capacity);
    for (size_t i = capacity; i-- > 0;) free_.push_back(static_cast<uint32_t>(i));
  }
  std::optional<uint32_t> take() {
    if (free_.empty()) return std::nullopt;
    uint32_t s = free_.back();
    free_.pop_back();
    return s;
  }
  void give(uint32_t s) { free_.push_back(s); }

 private:
  std::vector<uint32_t> free_;
};

}  // namespace fabric::util
