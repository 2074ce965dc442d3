// ForwardSteps: a trigger's step count becomes each forward's layers, then its extras step, in
// order, whatever values the watcher happens to see.
#include "kv/forward_steps.h"

#include <gtest/gtest.h>

namespace fabric::kv {
namespace {

using Events = std::vector<ForwardSteps::Event>;

std::vector<std::pair<uint64_t, uint32_t>> flat(const Events& e) {
  std::vector<std::pair<uint64_t, uint32_t>> out;
  for (auto& ev : e)
    for (uint64_t r : ev.requests) out.push_back({r, ev.layer});
  return out;
}

TEST(KvForwardSteps, EachForwardIsItsLayersThenTheExtras) {
  ForwardSteps s(2);
  s.push({7, 8});
  s.push({9});
  Events e;
  EXPECT_EQ(s.reach(1, e), 0u);
  EXPECT_EQ(s.reach(1, e), 0u) << "a value seen twice adds nothing";
  EXPECT_EQ(s.reach(0, e), 0u) << "nor does an older one";
  EXPECT_EQ(s.reach(5, e), 0u) << "coalesced values: every step in between";
  using P = std::pair<uint64_t, uint32_t>;
  EXPECT_EQ(flat(e), (std::vector<P>{{7, 0}, {8, 0}, {7, 1}, {8, 1}, {7, kExtrasLayer}, {8, kExtrasLayer},
                                     {9, 0}, {9, 1}}));
  EXPECT_EQ(s.forwards_pending(), 1u);
  e.clear();
  EXPECT_EQ(s.reach(6, e), 0u);
  EXPECT_EQ(flat(e), (std::vector<P>{{9, kExtrasLayer}}));
  EXPECT_EQ(s.forwards_pending(), 0u);
}

TEST(KvForwardSteps, StepsWithoutAForwardAreCountedAndTheNextForwardStartsAfresh) {
  ForwardSteps s(1);
  Events e;
  EXPECT_EQ(s.reach(3, e), 3u);
  EXPECT_TRUE(e.empty());
  s.push({4});
  EXPECT_EQ(s.reach(5, e), 0u);
  using P = std::pair<uint64_t, uint32_t>;
  EXPECT_EQ(flat(e), (std::vector<P>{{4, 0}, {4, kExtrasLayer}}));
}

}  // namespace
}  // namespace fabric::kv
