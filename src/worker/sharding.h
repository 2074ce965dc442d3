// How transfers become WRITEs over NICs: the sharding arithmetic, kept pure so it can be tested
// on its own and so the immediate-count rule is written down in exactly one place.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fabric {

// A single write smaller than this stays on one NIC: splitting it would add per-WRITE cost
// without adding bandwidth. (Paged writes saturate a link from 32 KiB pages.)
inline constexpr uint64_t kMinShardBytes = 32 * 1024;
inline constexpr uint64_t kShardAlign = 64;

struct Shard {
  uint64_t offset = 0;
  uint64_t len = 0;
};

// Number of WRITEs (hence of immediates delivered) of a single write of `len` bytes.
//   pinned or len <= kMinShardBytes: 1 (a zero-length write is one immediate-only WRITE)
//   otherwise: min(nics, ceil(len / kMinShardBytes))
size_t single_write_shards(uint64_t len, size_t nics, bool pinned);

// Shard i of a single write: equal shares rounded up to kShardAlign, the last one takes the rest.
// Every shard is non-empty when len > 0.
Shard single_write_shard(uint64_t len, size_t shards, size_t i);

// NIC of the i-th WRITE of a transfer spread round-robin (paged, scatter, barrier, shards).
inline size_t nic_for_op(size_t i, size_t nics, int pinned_nic) {
  return pinned_nic >= 0 ? static_cast<size_t>(pinned_nic) : i % nics;
}

}  // namespace fabric
