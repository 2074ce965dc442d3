// Sharding arithmetic: shard counts, coverage without gaps or overlaps, edge cases.
#include "worker/sharding.h"

#include <gtest/gtest.h>

#include "fabric/transfer_engine.h"

namespace fabric {
namespace {

TEST(Sharding, SmallOrZeroLengthStaysOnOneNic) {
  EXPECT_EQ(single_write_shards(0, 4, false), 1u);
  EXPECT_EQ(single_write_shards(3, 4, false), 1u);  // shorter than the NIC count
  EXPECT_EQ(single_write_shards(kMinShardBytes, 4, false), 1u);
  EXPECT_EQ(single_write_shards(kMinShardBytes + 1, 4, false), 2u);
}

TEST(Sharding, LargeWritesUseEveryNicUnlessPinned) {
  EXPECT_EQ(single_write_shards(1 << 20, 4, false), 4u);
  EXPECT_EQ(single_write_shards(1 << 20, 2, false), 2u);
  EXPECT_EQ(single_write_shards(1 << 20, 1, false), 1u);
  EXPECT_EQ(single_write_shards(1 << 20, 4, true), 1u);
  EXPECT_EQ(single_write_shards(3 * kMinShardBytes, 4, false), 3u);
  EXPECT_EQ(single_write_imm_count(1 << 20, 4, false), 4u);  // the public rule is the same
}

TEST(Sharding, ShardsCoverTheWriteExactly) {
  for (uint64_t len : {uint64_t{0}, uint64_t{1}, uint64_t{4095}, kMinShardBytes + 1,
                       uint64_t{100003}, uint64_t{1} << 20, (uint64_t{1} << 24) + 17}) {
    for (size_t nics = 1; nics <= 4; nics++) {
      size_t n = single_write_shards(len, nics, false);
      uint64_t next = 0;
      for (size_t i = 0; i < n; i++) {
        Shard s = single_write_shard(len, n, i);
        EXPECT_EQ(s.offset, next) << len << " " << nics << " " << i;
        if (len > 0) {
          EXPECT_GT(s.len, 0u) << len << " " << nics << " " << i;
        }
        EXPECT_EQ(s.offset % kShardAlign, 0u);
        next = s.offset + s.len;
      }
      EXPECT_EQ(next, len) << len << " " << nics;
    }
  }
}

TEST(Sharding, RoundRobinAndPinnedNics) {
  EXPECT_EQ(nic_for_op(0, 4, -1), 0u);
  EXPECT_EQ(nic_for_op(5, 4, -1), 1u);
  EXPECT_EQ(nic_for_op(5, 4, 3), 3u);
  EXPECT_EQ(nic_for_op(7, 1, -1), 0u);
}

}  // namespace
}  // namespace fabric
