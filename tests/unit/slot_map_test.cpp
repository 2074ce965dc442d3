// util::SlotMap: which slot a take() returns, the capacity, stable addresses (bounded) and values
// that survive growth (unbounded) and a slot's reuse, and a reader on another thread while the
// owner grows a bounded table.
#include "util/slot_map.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace fabric::util {
namespace {

TEST(SlotMap, GrowsInOrderThenTakesTheMostRecentlyFreedSlotFirst) {
  SlotMap<int> m;
  for (uint32_t i = 0; i < 6; i++) EXPECT_EQ(m.take(), i);
  EXPECT_EQ(m.size(), 6u);
  m.give(1);
  m.give(4);
  EXPECT_EQ(m.take(), 4u);
  EXPECT_EQ(m.take(), 1u);
  EXPECT_EQ(m.take(), 6u);  // none free: it grows again
  EXPECT_EQ(m.size(), 7u);
}

TEST(SlotMap, RefusesPastItsCapacityUntilASlotIsFreed) {
  SlotMap<int> m(5);
  for (uint32_t i = 0; i < 5; i++) ASSERT_EQ(m.take(), i);
  EXPECT_EQ(m.take(), std::nullopt);
  EXPECT_EQ(m.size(), 5u);
  EXPECT_EQ(m.capacity(), 5u);
  m.give(2);
  EXPECT_EQ(m.take(), 2u);
  EXPECT_EQ(m.take(), std::nullopt);
}

TEST(SlotMap, BoundedSlotsKeepTheirAddressAndAFreedSlotKeepsItsValue) {
  // Immovable values (atomics), as the engine's tables hold.
  SlotMap<std::atomic<uint32_t>> m(1000);
  std::vector<std::atomic<uint32_t>*> first;
  for (uint32_t i = 0; i < 5; i++) {
    uint32_t s = *m.take();
    m[s].store(100 + s);
    first.push_back(&m[s]);
  }
  for (uint32_t i = 0; i < 900; i++) m.take();
  for (uint32_t s = 0; s < 5; s++) {
    EXPECT_EQ(&m[s], first[s]);
    EXPECT_EQ(m[s].load(), 100 + s);
  }
  EXPECT_EQ(m[904].load(), 0u);  // a new slot starts default-constructed
  m.give(3);
  ASSERT_EQ(m.take(), 3u);
  EXPECT_EQ(m[3].load(), 103u);  // a generation kept in the slot survives its reuse
}

TEST(SlotMap, UnboundedKeepsEveryValueAcrossItsGrowth) {
  SlotMap<std::string> m;
  for (uint32_t i = 0; i < 1000; i++) {
    uint32_t s = *m.take();
    m[s] = std::string(40, static_cast<char>('a' + s % 26)) + std::to_string(s);  // on the heap
  }
  EXPECT_EQ(m.size(), 1000u);
  for (uint32_t s = 0; s < 1000; s++)
    ASSERT_EQ(m[s], std::string(40, static_cast<char>('a' + s % 26)) + std::to_string(s));
  m.give(10);
  ASSERT_EQ(m.take(), 10u);
  EXPECT_EQ(m[10], std::string(40, 'k') + "10");
}

TEST(SlotMap, FindSaysWhichSlotsExist) {
  SlotMap<int> m(8);
  EXPECT_EQ(m.find(0), nullptr);
  ASSERT_EQ(m.take(), 0u);
  m[0] = 7;
  ASSERT_NE(m.find(0), nullptr);
  EXPECT_EQ(*m.find(0), 7);
  EXPECT_EQ(m.find(1), nullptr);
  const SlotMap<int>& c = m;
  EXPECT_EQ(c.find(0), &m[0]);
  EXPECT_EQ(c.find(8), nullptr);
}

// With a capacity, another thread looks up every slot that size() covers while the owner grows
// the table: each is there (its chunk published before the size), holding 0 until the owner
// fills it. A reader that ran ahead of the chunk would crash, or fail under TSan
// (tests/sanitize/run.sh).
TEST(SlotMap, AReaderOnAnotherThreadFindsEverySlotThatSizeCovers) {
  constexpr uint32_t kSlots = 20000;
  SlotMap<std::atomic<uint32_t>> m(kSlots);
  std::thread owner([&] {
    for (uint32_t i = 0; i < kSlots; i++) {
      uint32_t s = *m.take();
      m[s].store(s + 1, std::memory_order_relaxed);
    }
  });
  uint64_t checked = 0;
  for (size_t n = 0; n < kSlots;) {
    n = m.size();
    for (size_t s = n > 64 ? n - 64 : 0; s < n; s++) {
      const std::atomic<uint32_t>* slot = m.find(static_cast<uint32_t>(s));
      ASSERT_NE(slot, nullptr);
      const uint32_t v = slot->load(std::memory_order_relaxed);
      ASSERT_TRUE(v == 0 || v == s + 1) << "slot " << s << " holds " << v;
      checked++;
    }
  }
  owner.join();
  EXPECT_GT(checked, 0u);
  EXPECT_EQ(m.size(), kSlots);
  EXPECT_EQ(m.take(), std::nullopt);
}

}  // namespace
}  // namespace fabric::util
