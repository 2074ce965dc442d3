// MpscQueue under concurrent producers, and the object pool's stable addresses.
#include "util/mpsc_queue.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "util/object_pool.h"

namespace fabric::util {
namespace {

TEST(MpscQueue, FullQueueRefusesAndKeepsTheValue) {
  MpscQueue<std::vector<int>> q(4);
  EXPECT_EQ(q.capacity(), 4u);
  for (int i = 0; i < 4; i++) {
    std::vector<int> v{i};
    ASSERT_TRUE(q.try_push(v));
  }
  std::vector<int> extra{99};
  EXPECT_FALSE(q.try_push(extra));
  EXPECT_EQ(extra, std::vector<int>{99});
  for (int i = 0; i < 4; i++) EXPECT_EQ(q.try_pop()->at(0), i);
  EXPECT_FALSE(q.try_pop().has_value());
}

TEST(MpscQueue, ManyProducersOneConsumerLoseNothingAndKeepPerProducerOrder) {
  constexpr int kProducers = 4, kItems = 200000;
  MpscQueue<uint64_t> q(1024);
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; p++)
    producers.emplace_back([&q, p] {
      for (uint64_t i = 0; i < kItems; i++) {
        uint64_t v = (uint64_t(p) << 32) | i;
        while (!q.try_push(v)) std::this_thread::yield();
      }
    });
  std::vector<uint64_t> next(kProducers, 0);
  for (uint64_t got = 0; got < uint64_t{kProducers} * kItems;) {
    auto v = q.try_pop();
    if (!v) continue;
    uint32_t p = static_cast<uint32_t>(*v >> 32);
    ASSERT_LT(p, static_cast<uint32_t>(kProducers));
    ASSERT_EQ(*v & 0xffffffff, next[p]) << "producer " << p;
    next[p]++;
    got++;
  }
  for (auto& t : producers) t.join();
  EXPECT_FALSE(q.try_pop().has_value());
}

TEST(ObjectPool, AddressesAreStableAndRecycled) {
  struct Item { int value = 0; };
  ObjectPool<Item> pool(2);
  Item* a = pool.acquire();
  a->value = 5;
  std::vector<Item*> more;
  for (int i = 0; i < 10; i++) more.push_back(pool.acquire());  // grows; `a` must not move
  EXPECT_EQ(a->value, 5);
  EXPECT_EQ(pool.in_use(), 11u);
  pool.release(a);
  Item* b = pool.acquire();
  EXPECT_EQ(b, a);          // recycled
  EXPECT_EQ(b->value, 0);   // and reset
}

}  // namespace
}  // namespace fabric::util
