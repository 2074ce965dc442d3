// Helpers the weight-update planners share (plan.cpp, update_plan.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fabric/error.h"
#include "fabric/weights/plan.h"

namespace fabric::weights::detail {

inline Error invalid(const std::string& what) { return Error(ErrorCode::kInvalidArgument, "weights plan: " + what); }

// Bytes from one row of a placement to the next.
inline uint64_t stride_of(const Placement& p, const TensorSpec& t) {
  return p.row_stride ? p.row_stride : p.box.cols() * t.elem_bytes;
}

using Interval = std::pair<uint64_t, uint64_t>;  // bytes [first, second)

// Sorts `v` and finds the first interval that overlaps the one before it (into `at`).
inline bool overlapping(std::vector<Interval>& v, Interval& at) {
  std::sort(v.begin(), v.end());
  for (size_t i = 1; i < v.size(); i++)
    if (v[i].first < v[i - 1].second) {
      at = v[i];
      return true;
    }
  return false;
}

}  // namespace fabric::weights::detail
