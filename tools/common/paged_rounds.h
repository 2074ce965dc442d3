// The workload shared by fabric-demo and the raw libfabric loop, so both move identical data: a
// byte pattern, and the page permutation of each round (rounds alternate between the two halves of
// the destination, so one round can be in flight while the next is posted).
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace fabric::tools {

inline uint8_t pattern(uint64_t byte_index) {
  return static_cast<uint8_t>(byte_index * 131 + (byte_index >> 13) + 7);
}

// Round r writes source page i to destination page result[i], in half (r % 2).
inline std::vector<uint32_t> round_permutation(uint32_t round, uint32_t pages) {
  std::vector<uint32_t> p(pages);
  for (uint32_t i = 0; i < pages; i++) p[i] = i;
  std::shuffle(p.begin(), p.end(), std::mt19937(1234 + round));
  for (auto& x : p) x += (round % 2) * pages;
  return p;
}

}  // namespace fabric::tools
