// ImmCounter: order independence, early arrivals, surplus and re-arming, FIFO expectations.
#include "imm/imm_counter.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

namespace fabric {
namespace {

using Counter = ImmCounter<int>;  // the waiter is an id we can check

TEST(ImmCounter, EarlyArrivalsCountTowardLaterExpectation) {
  Counter c;
  std::vector<int> met;
  for (int i = 0; i < 5; i++) c.arrive(7, met);
  EXPECT_TRUE(met.empty());
  EXPECT_EQ(c.count(7), 5u);
  c.expect(7, 5, static_cast<uint64_t>(42), 42, met);
  ASSERT_EQ(met, std::vector<int>{42});
  EXPECT_EQ(c.count(7), 0u);
}

TEST(ImmCounter, DiscardDropsWhatIsCountedAndKeepsTheWaiting) {
  Counter c(/*max_stray=*/1);
  std::vector<int> met;
  for (int i = 0; i < 3; i++) c.arrive(4, met);
  EXPECT_EQ(c.strays(), 1u);
  EXPECT_EQ(c.discard(4), 3u);
  EXPECT_EQ(c.count(4), 0u);
  EXPECT_EQ(c.strays(), 0u) << "a discarded stray frees its place";
  EXPECT_TRUE(c.arrive(5, met)) << "so another immediate may be counted";
  EXPECT_EQ(c.discard(99), 0u);
  c.expect(6, 2, static_cast<uint64_t>(1), 1, met);
  c.arrive(6, met);
  EXPECT_EQ(c.discard(6), 1u);
  c.arrive(6, met);
  EXPECT_TRUE(met.empty()) << "the expectation counts from zero again";
  c.arrive(6, met);
  EXPECT_EQ(met, std::vector<int>{1});
}

TEST(ImmCounter, ExpectationMetOnTheExactArrival) {
  Counter c;
  std::vector<int> met;
  c.expect(1, 3, static_cast<uint64_t>(10), 10, met);
  c.arrive(1, met);
  c.arrive(1, met);
  EXPECT_TRUE(met.empty());
  c.arrive(1, met);
  EXPECT_EQ(met, std::vector<int>{10});
}

TEST(ImmCounter, SurplusCarriesOverToTheNextExpectation) {
  Counter c;
  std::vector<int> met;
  c.expect(9, 2, static_cast<uint64_t>(1), 1, met);
  for (int i = 0; i < 5; i++) c.arrive(9, met);
  EXPECT_EQ(met, std::vector<int>{1});
  EXPECT_EQ(c.count(9), 3u);
  met.clear();
  c.expect(9, 4, static_cast<uint64_t>(2), 2, met);  // re-arm: 3 already counted
  EXPECT_TRUE(met.empty());
  c.arrive(9, met);
  EXPECT_EQ(met, std::vector<int>{2});
  EXPECT_EQ(c.count(9), 0u);
}

TEST(ImmCounter, SeveralExpectationsOfOneImmAreMetInOrder) {
  Counter c;
  std::vector<int> met;
  c.expect(3, 2, static_cast<uint64_t>(100), 100, met);
  c.expect(3, 1, static_cast<uint64_t>(200), 200, met);
  c.arrive(3, met);
  EXPECT_TRUE(met.empty());  // the first needs 2; the second waits behind it
  c.arrive(3, met);
  EXPECT_EQ(met, std::vector<int>{100});
  c.arrive(3, met);
  EXPECT_EQ(met, (std::vector<int>{100, 200}));
}

TEST(ImmCounter, ZeroCountIsMetImmediately) {
  Counter c;
  std::vector<int> met;
  c.expect(5, 0, static_cast<uint64_t>(1), 1, met);
  EXPECT_EQ(met, std::vector<int>{1});
}

TEST(ImmCounter, ImmediatesAreIndependent) {
  Counter c;
  std::vector<int> met;
  c.expect(0, 1, static_cast<uint64_t>(1), 1, met);
  c.expect(UINT32_MAX, 1, static_cast<uint64_t>(2), 2, met);
  c.arrive(UINT32_MAX, met);
  EXPECT_EQ(met, std::vector<int>{2});
  EXPECT_EQ(c.count(0), 0u);
}

TEST(ImmCounter, RandomArrivalOrdersMeetEveryExpectationExactlyOnce) {
  for (uint32_t seed = 1; seed <= 50; seed++) {
    std::mt19937 rng(seed);
    Counter c;
    std::vector<int> met;
    // 20 immediates, each expected in 1..3 chunks; arrivals shuffled with the registrations.
    struct Step { bool expect; uint32_t imm; uint64_t count; int id; };
    std::vector<Step> steps;
    std::map<int, uint32_t> owner;
    int next_id = 0;
    for (uint32_t imm = 0; imm < 20; imm++) {
      int chunks = 1 + static_cast<int>(rng() % 3);
      for (int k = 0; k < chunks; k++) {
        uint64_t n = 1 + rng() % 10;
        steps.push_back({true, imm * 7919, n, next_id});
        owner[next_id++] = imm;
        for (uint64_t a = 0; a < n; a++) steps.push_back({false, imm * 7919, 0, -1});
      }
    }
    std::shuffle(steps.begin(), steps.end(), rng);
    // Arrivals and registrations interleave in any order: once every arrival is in, every
    // expectation must have been met exactly once and nothing may be left counted.
    for (auto& s : steps) {
      if (s.expect) c.expect(s.imm, s.count, static_cast<uint64_t>(s.id), s.id, met);
      else c.arrive(s.imm, met);
    }
    std::sort(met.begin(), met.end());
    ASSERT_EQ(met.size(), static_cast<size_t>(next_id)) << "seed " << seed;
    for (int i = 0; i < next_id; i++) ASSERT_EQ(met[i], i) << "seed " << seed;
    for (uint32_t imm = 0; imm < 20; imm++) EXPECT_EQ(c.count(imm * 7919), 0u);
  }
}

TEST(ImmCounter, TakeAllWaitingEmptiesTheCounter) {
  Counter c;
  std::vector<int> met;
  c.expect(1, 5, static_cast<uint64_t>(1), 1, met);
  c.expect(2, 5, static_cast<uint64_t>(2), 2, met);
  auto left = c.take_all_waiting();
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<int>{1, 2}));
  c.arrive(1, met);
  EXPECT_TRUE(met.empty());
}

TEST(ImmCounter, CancelledExpectationConsumesNothingAndUnblocksTheNext) {
  Counter c;
  std::vector<int> met;
  c.expect(4, 5, 1, 1, met);
  c.expect(4, 2, 2, 2, met);
  c.arrive(4, met);
  c.arrive(4, met);
  EXPECT_TRUE(met.empty());  // 2 counted: the first needs 5, the second waits behind it
  int out = 0;
  ASSERT_TRUE(c.cancel(4, 1, out, met));
  EXPECT_EQ(out, 1);
  EXPECT_EQ(met, std::vector<int>{2});  // met at once by what was counted
  EXPECT_EQ(c.count(4), 0u);
  EXPECT_FALSE(c.cancel(4, 1, out, met));  // gone
  EXPECT_FALSE(c.cancel(99, 1, out, met));
  met.clear();
  c.expect(4, 3, 3, 3, met);
  c.arrive(4, met);
  ASSERT_TRUE(c.cancel(4, 3, out, met));
  EXPECT_EQ(c.count(4), 1u) << "a cancelled expectation's arrivals stay counted";
}

TEST(ImmCounter, StrayImmediatesAreBoundedAndDropsAreReported) {
  Counter c(3);
  std::vector<int> met;
  for (uint32_t imm = 0; imm < 3; imm++) EXPECT_TRUE(c.arrive(imm, met));
  EXPECT_TRUE(c.arrive(0, met)) << "a value already counted is not a new stray";
  EXPECT_FALSE(c.arrive(3, met)) << "a fourth distinct stray is dropped";
  EXPECT_EQ(c.strays(), 3u);
  c.expect(10, 1, 1, 1, met);  // waited for: never dropped
  EXPECT_TRUE(c.arrive(10, met));
  EXPECT_EQ(met, std::vector<int>{1});
  c.expect(1, 1, 2, 2, met);  // consumes stray 1: room for another
  EXPECT_EQ(c.strays(), 2u);
  EXPECT_TRUE(c.arrive(3, met));
  EXPECT_EQ(c.count(0), 2u);
  EXPECT_EQ(c.count(3), 1u);
}

TEST(ImmCounter, ManyDistinctStraysKeepMemoryBounded) {
  Counter c(1000);
  std::vector<int> met;
  size_t dropped = 0;
  for (uint32_t imm = 0; imm < 1000000; imm++) dropped += c.arrive(imm, met) ? 0 : 1;
  EXPECT_EQ(c.strays(), 1000u);
  EXPECT_EQ(dropped, 1000000u - 1000u);
}

}  // namespace
}  // namespace fabric
