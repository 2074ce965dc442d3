// The weight-update executor end to end on loopback engines: training ranks (WeightSender)
// gather, quantize and write into inference ranks' arenas (WeightReceiver), step after step with
// changing weights; every inference byte must equal the block quantization of that step's full
// tensors. A training rank that never takes part fails the step on every side within its
// timeout, naming it, and the other buffer set keeps the last step's weights.
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <random>
#include <thread>

#include "fabric/fabric.h"
#include "fabric/weights/update.h"
#include "test_support.h"
#include "weights_cluster.h"
#include "weights_model.h"

namespace fabric::weights {
namespace {

using fabric::testing::config_for;
using fabric::testing::expect_error;
using fabric::testing::ProviderCase;
using testing::expect_exact;
using testing::Model;
using testing::random_bf16;
using testing::random_model;

class WeightsExecutor : public ::testing::TestWithParam<ProviderCase> {};

TEST_P(WeightsExecutor, TwentyStepsOfChangingWeightsLandBitForBitInAlternatingBufferSets) {
  Model m = random_model(10);
  Cluster c(std::move(m), GetParam(), /*window=*/2, /*sets=*/2, /*owner_rows=*/128);
  // The case exercises what the executor does: remote gathers, and more units than slots.
  size_t remote_gathers = 0, most_units = 0;
  for (const Copy& k : c.plan->gather.copies) remote_gathers += !k.local;
  for (uint32_t r = 0; r < c.model.m.src_ranks; r++) {
    size_t n = 0;
    for (const QuantizeTask& q : c.plan->quantize) n += q.rank == r;
    most_units = std::max(most_units, n);
  }
  ASSERT_GT(remote_gathers, 0u);
  ASSERT_GT(most_units, 2u);
  for (uint64_t step = 0; step < 20; step++) {
    c.new_weights(1000 + static_cast<uint32_t>(step));
    for (const std::string& e : c.step(step)) ASSERT_EQ(e, "") << "step " << step;
    expect_exact(c.model, c.set_bytes(step % 2));
    if (HasFatalFailure()) FAIL() << "step " << step;
  }
}

TEST_P(WeightsExecutor, RandomManifestsWindowsAndUnitsAllLandExactly) {
  for (uint32_t seed = 0; seed < 6; seed++) {
    Model m = random_model(100 + seed);
    const uint32_t window = 1 + seed % 3;
    Cluster c(std::move(m), GetParam(), window, 1, 128 * (seed % 2));
    for (uint64_t step = 0; step < 2; step++) {
      c.new_weights(seed * 10 + static_cast<uint32_t>(step));
      for (const std::string& e : c.step(step)) ASSERT_EQ(e, "") << "seed " << seed << " step " << step;
      expect_exact(c.model, c.set_bytes(0));
      if (HasFatalFailure()) FAIL() << "seed " << seed;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Loopback, WeightsExecutor,
                         ::testing::Values(ProviderCase{"tcp;ofi_rxm", 1, false}, ProviderCase{"shm", 2, false},
                                           ProviderCase{"tcp;ofi_rxm", 2, true}),
                         fabric::testing::case_name);

// Two FP8 tensors over FSDP 2 (whole-tensor owners gather the other half) into two inference ranks.
Model small_gathered_model() {
  Model model;
  Manifest& m = model.m;
  m.src_ranks = 2;
  m.dst_ranks = 2;
  std::mt19937 rng(5);
  uint64_t cursor = 0;
  for (uint32_t t = 0; t < 2; t++) {
    m.tensors.push_back({"w" + std::to_string(t), 256, 256, 2, true});
    model.full.emplace_back(256 * 256);
    for (auto& v : model.full[t]) v = random_bf16(rng);
    for (uint32_t r = 0; r < 2; r++)
      m.sources.push_back({.tensor = t, .rank = r, .box = {100 * r, r ? 256u : 100u, 0, 256}, .offset = cursor});
    cursor += 256 * 256 * 2;
    m.dests.push_back({.tensor = t, .rank = t, .box = {0, 256, 0, 256}, .offset = 0});
    m.dest_scales.push_back({.tensor = t, .rank = t, .box = {0, 2, 0, 2}, .offset = 256 * 256});
  }
  model.dst_size = {256 * 256 + 16, 256 * 256 + 16};
  return model;
}

TEST(WeightsExecutorFailure, AMissingTrainingRankFailsTheStepEverywhereNamingItAndTheOtherSetKeepsItsWeights) {
  const ProviderCase pc{"tcp;ofi_rxm", 1, false};
  // Step 0 must land: the default timeout (60 s), since a loaded 2-core machine under TSan can take
  // more than a second or two over it. Only the step meant to fail gets a tight one (1.5 s).
  Cluster c(small_gathered_model(), pc, 1, 2, 0);
  c.new_weights(1);
  for (const std::string& e : c.step(0)) ASSERT_EQ(e, "");
  const auto step0 = c.set_bytes(0);
  expect_exact(c.model, step0);
  // Step 1 without training rank 1 (a trainer that died before it began): the inference ranks
  // time out naming it, rank 0 times out waiting for rank 1's slot credits (rank 1 holds
  // most of both tensors, so it quantizes them), and set 0 is untouched.
  c.new_senders(1, std::chrono::milliseconds(1500));
  c.new_weights(2);
  std::vector<std::string> errors = c.step(1, {1}, std::chrono::milliseconds(1500));
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_NE(errors[0].find("from training ranks 1"), std::string::npos) << errors[0];  // its slot credits
  for (size_t k = 1; k < 3; k++) EXPECT_NE(errors[k].find("missing from training ranks 1"), std::string::npos) << errors[k];
  EXPECT_EQ(c.set_bytes(0), step0);
  // The failed step's number is not taken again; a later one (here by fresh senders, as a
  // restarted job would have) lands whole.
  expect_error(ErrorCode::kInvalidArgument, "retry it under a new step number", [&] { c.receivers[0]->ready(1); });
  c.new_senders(1, std::chrono::seconds(60));
  for (const std::string& e : c.step(3)) ASSERT_EQ(e, "");
  expect_exact(c.model, c.set_bytes(1));
}

TEST(WeightsExecutorFailure, BadConfigurationsAreRejectedWithAClearError) {
  const ProviderCase pc{"tcp;ofi_rxm", 1, false};
  Cluster c(small_gathered_model(), pc, 1, 1, 0);
  TransferEngine& e = *c.train_engines[0];
  auto base = [&] {
    return WeightSenderConfig{.plan = c.plan, .rank = 0, .arena = c.train_mr[0], .arena_ptr = c.train_arena[0].data(),
                              .train_arenas = c.train_desc, .dest_arenas = c.infer_desc, .window = 1,
                              .imms = &c.train_imms[0]};
  };
  auto cfg = base();
  cfg.rank = 2;
  expect_error(ErrorCode::kInvalidArgument, "rank 2 of 2", [&] { WeightSender(e, cfg); });
  cfg = base();
  cfg.train_arenas.pop_back();
  expect_error(ErrorCode::kInvalidArgument, "1 training arenas for 2", [&] { WeightSender(e, cfg); });
  cfg = base();
  cfg.dest_arenas[0].pop_back();
  expect_error(ErrorCode::kInvalidArgument, "1 arenas for 2 inference", [&] { WeightSender(e, cfg); });
  cfg = base();
  cfg.window = 0;
  expect_error(ErrorCode::kInvalidArgument, "at least one unit", [&] { WeightSender(e, cfg); });
  cfg = base();
  cfg.arena_ptr = nullptr;
  expect_error(ErrorCode::kInvalidArgument, "no hook", [&] { WeightSender(e, cfg); });
  cfg = base();
  cfg.imms = nullptr;
  expect_error(ErrorCode::kInvalidArgument, "no immediate reservation", [&] { WeightSender(e, cfg); });
  ImmReservation other = e.reserve_imms({.holder = "another user", .bits = kUpdateImmBits});
  cfg.imms = &other;  // held, but not the one the arena was registered under
  expect_error(ErrorCode::kInvalidArgument, "not registered under its immediate reservation", [&] { WeightSender(e, cfg); });
  ImmReservation narrow = e.reserve_imms({.holder = "a narrow user", .bits = 8});
  cfg.imms = &narrow;
  expect_error(ErrorCode::kInvalidArgument, "an immediate reservation of 8 bits", [&] { WeightSender(e, cfg); });
  expect_error(ErrorCode::kInvalidArgument, "no immediate reservation",
               [&] { WeightReceiver(*c.infer_engines[0], {.plan = c.plan, .rank = 0, .train_arenas = c.train_desc}); });
  WeightReceiver& rx = *c.receivers[0];
  expect_error(ErrorCode::kInvalidArgument, "not made ready", [&] { rx.wait_update(9, std::chrono::milliseconds(10)); });
  rx.ready(4);
  expect_error(ErrorCode::kInvalidArgument, "already ready", [&] { rx.ready(4); });
  expect_error(ErrorCode::kInvalidArgument, "share a tag", [&] { rx.ready(4 + (1u << kUpdateStepBits)); });
  expect_error(ErrorCode::kInvalidArgument, "3 buffer sets",
               [&] { WeightReceiver(*c.infer_engines[0], {.plan = c.plan, .rank = 0, .train_arenas = c.train_desc, .sets = 3}); });
}

}  // namespace
}  // namespace fabric::weights
