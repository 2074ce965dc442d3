// What the soak sends in each round, derived from (seed, round, peer) on both sides, so that a
// peer can check every byte without being told more than which transfers succeeded.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fabric/fabric.h"

namespace fabric::soak {

inline constexpr uint64_t kSrcLen = 2 << 20;      // the driver's source region
inline constexpr uint64_t kPeerLen = 4 << 20;     // each peer's destination region
inline constexpr uint64_t kSingleArea = 1 << 20;  // [0, 1 MiB): single writes
inline constexpr uint64_t kPagedArea = 2 << 20;   // [1 MiB, 3 MiB): 512 pages of 4 KiB
inline constexpr uint64_t kPageLen = 4096;
inline constexpr uint32_t kPagesPerRound = 64;
inline constexpr uint64_t kScatterArea = 3 << 20;  // [3 MiB, +16 KiB): one scatter slice
inline constexpr uint64_t kSliceLen = 16 << 10;
inline constexpr uint32_t kMessagesPerRound = 16;
inline constexpr size_t kMaxMessage = 1024;
// One immediate per kind; each round sends one transfer of each kind to each peer.
inline constexpr uint32_t kImmSingle = 0x100, kImmPaged = 0x200, kImmScatter = 0x300, kImmBarrier = 0x400;

// The byte at `offset` of the source region in round `round`.
inline uint8_t source_byte(uint32_t round, uint64_t offset) {
  uint64_t x = (static_cast<uint64_t>(round) << 40) ^ (offset >> 3) ^ 0x9E3779B97F4A7C15ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x >> (8 * (offset & 7)));
}

inline std::string message(uint32_t round, uint32_t peer, uint32_t i) {
  size_t len = 8 + (round * 131 + peer * 17 + i * 61) % (kMaxMessage - 8);
  std::string m(len, '\0');
  uint32_t header[2] = {round, (peer << 16) | i};
  std::memcpy(m.data(), header, sizeof header);
  for (size_t k = sizeof header; k < len; k++) m[k] = static_cast<char>(source_byte(round + peer, k * 7 + i));
  return m;
}

struct RoundPlan {
  uint64_t single_len, single_src, single_dst;
  std::vector<uint32_t> src_idx, dst_idx;
  uint64_t slice_src;
  // Views of the indices (valid while the plan lives).
  Pages src_pages() const { return {src_idx, 2 * kPageLen, 0}; }             // 256 slots
  Pages dst_pages() const { return {dst_idx, kPageLen, kSingleArea}; }       // 512 slots

  RoundPlan(uint64_t seed, uint32_t round, uint32_t peer) {
    std::mt19937_64 rng(seed * 7919 + round * 131 + peer);
    // Sizes from one byte to 1 MiB, a third each below 4 KiB, 64 KiB and 1 MiB.
    uint64_t cap = std::array<uint64_t, 3>{4096, 65536, kSingleArea}[rng() % 3];
    single_len = 1 + rng() % (cap - 1);
    single_src = rng() % (kSrcLen - single_len);
    single_dst = rng() % (kSingleArea - single_len);
    src_idx = pick(rng, kSrcLen / (2 * kPageLen));
    dst_idx = pick(rng, kPagedArea / kPageLen);
    slice_src = rng() % (kSrcLen - kSliceLen);
  }

 private:
  static std::vector<uint32_t> pick(std::mt19937_64& rng, uint64_t range) {
    std::vector<uint32_t> all(range);
    std::iota(all.begin(), all.end(), 0u);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(kPagesPerRound);
    return all;
  }
};

// What the driver tells a peer after a round: which of its transfers succeeded.
struct RoundReport {
  uint32_t round = 0;
  uint8_t single_ok = 0, paged_ok = 0, scatter_ok = 0, barrier_ok = 0;
  uint32_t messages_ok = 0;  // bit i: message i was sent successfully
};

// What a peer answers.
struct PeerReply {
  uint64_t verified_bytes = 0;
  uint64_t lost = 0;  // transfers reported successful whose bytes or immediates never came right
  uint64_t duplicated_messages = 0;
  uint64_t rss_kib = 0;
  uint64_t faults_injected = 0;
};

inline uint64_t resident_kib() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  unsigned long size = 0, resident = 0;
  if (f) {
    if (std::fscanf(f, "%lu %lu", &size, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) / 1024;
}

}  // namespace fabric::soak
