// Sharding arithmetic (see sharding.h for the rules).
#include "worker/sharding.h"

#include <algorithm>

namespace fabric {

size_t single_write_shards(uint64_t len, size_t nics, bool pinned) {
  if (pinned || nics <= 1 || len <= kMinShardBytes) return 1;
  uint64_t by_size = (len + kMinShardBytes - 1) / kMinShardBytes;
  return static_cast<size_t>(std::min<uint64_t>(nics, by_size));
}

Shard single_write_shard(uint64_t len, size_t shards, size_t i) {
  if (shards <= 1) return {0, len};
  uint64_t share = (len + shards - 1) / shards;
  share = (share + kShardAlign - 1) / kShardAlign * kShardAlign;
  uint64_t offset = std::min<uint64_t>(len, share * i);
  uint64_t end = (i + 1 == shards) ? len : std::min<uint64_t>(len, offset + share);
  return {offset, end - offset};
}

}  // namespace fabric
