// MoE dispatch/combine (include/fabric/moe/all_to_all.h) on the host kernel side: ranks as threads
// of this process, each with its own engine, grouped into "nodes" that share node regions, the
// other nodes reached through the proxy over tcp or shm. Every received row and every combined
// value is checked against the CPU reference (include/fabric/moe/reference.h).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "fabric/moe/all_to_all.h"
#include "fabric/moe/reference.h"
#include "loopback/moe_steps.h"
#include "loopback/test_support.h"
#include "moe/layout.h"

namespace fabric::testing {
namespace {

class MoeSteps : public ::testing::TestWithParam<MoeCase> {};

// Each dispatch combined twice (DeepEP's test does), the second time with other expert outputs.
TEST_P(MoeSteps, TwentyStepsOfRandomSkewedRoutingMatchTheReferenceByteForByte) {
  const MoeCase& mc = GetParam();
  const std::vector<std::string> failures = run_steps(mc, 20, "moe-steps", {.recombine = true});
  for (uint32_t r = 0; r < mc.ranks; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

std::vector<MoeCase> moe_cases() {
  const ProviderCase tcp{"tcp;ofi_rxm", 1, false}, shm{"shm", 1, false},
      tcp2{"tcp;ofi_rxm", 2, true};
  return {
      // 4 ranks as 2 nodes, FP8, a private region smaller than most peers' rows.
      {tcp, 4, 2, 16, 8, 2048, 24, 3, moe::Dtype::kFp8},
      {shm, 4, 2, 16, 8, 2048, 24, 3, moe::Dtype::kFp8},
      // 8 ranks as 2 nodes, hidden 7168: every row fits the private region / none does.
      {tcp, 8, 4, 32, 8, 7168, 8, 64, moe::Dtype::kFp8},
      {shm, 8, 4, 32, 6, 7168, 8, 0, moe::Dtype::kBf16},
      // Two NICs that reorder deliveries; 4 nodes of 2; one node only (no proxy).
      {tcp2, 8, 2, 16, 4, 2048, 16, 2, moe::Dtype::kBf16},
      {shm, 4, 4, 8, 8, 2048, 16, 4, moe::Dtype::kFp8},
  };
}

std::string moe_case_name(const ::testing::TestParamInfo<MoeCase>& info) {
  const MoeCase& c = info.param;
  return case_name(::testing::TestParamInfo<ProviderCase>(c.provider, 0)) + "_" +
         std::to_string(c.ranks) + "ranks_" + std::to_string(c.ranks / c.node_size) + "nodes_h" +
         std::to_string(c.hidden) + "_p" + std::to_string(c.private_rows) +
         (c.dtype == moe::Dtype::kFp8 ? "_fp8" : "_bf16");
}

INSTANTIATE_TEST_SUITE_P(Loopback, MoeSteps, ::testing::ValuesIn(moe_cases()), moe_case_name);

// Two dispatches in flight (two-batch overlap): dispatch A, dispatch B, combine A, combine B,
// every output exact, through the proxy (two buffer sets, each with its own immediates) and
// inside one node.
class MoeOverlap : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeOverlap, TwoDispatchesInFlightMatchTheReferenceByteForByte) {
  const MoeCase& mc = GetParam();
  const std::vector<std::string> failures =
      run_steps(mc, 20, "moe-overlap", {.overlap = true, .recombine = true});
  for (uint32_t r = 0; r < mc.ranks; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Loopback, MoeOverlap,
    ::testing::Values(
        MoeCase{{"tcp;ofi_rxm", 1, false}, 4, 2, 16, 8, 2048, 24, 3, moe::Dtype::kFp8},
        MoeCase{{"shm", 1, false}, 4, 2, 16, 4, 1024, 16, 0, moe::Dtype::kBf16},
        MoeCase{{"shm", 1, false}, 4, 4, 8, 8, 2048, 16, 4, moe::Dtype::kFp8}),
    moe_case_name);

// FP8 dispatches of BF16 tokens quantized by the send half (DispatchArgs::quantize): every
// value and scale equals an independent quantization of the token, through the proxy and inside
// one node, with amax scales and with power-of-two scales (DeepEP's round_scale).
struct QuantizeCase {
  MoeCase moe;
  moe::Quantize quantize;
};
inline void PrintTo(const QuantizeCase& c, std::ostream* os) {
  PrintTo(c.moe, os);
  *os << (c.quantize == moe::Quantize::kAmax ? ", amax scales" : ", power-of-two scales");
}
class MoeQuantize : public ::testing::TestWithParam<QuantizeCase> {};

TEST_P(MoeQuantize, TheSendHalfQuantizesEveryTokenOnceAndExactly) {
  const QuantizeCase& qc = GetParam();
  const std::vector<std::string> failures =
      run_steps(qc.moe, 6, "moe-quantize", {.quantize = qc.quantize});
  for (uint32_t r = 0; r < qc.moe.ranks; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Loopback, MoeQuantize,
    ::testing::Values(
        QuantizeCase{{{"tcp;ofi_rxm", 1, false}, 4, 2, 16, 8, 2048, 24, 3, moe::Dtype::kFp8},
                     moe::Quantize::kAmax},
        QuantizeCase{{{"shm", 1, false}, 4, 4, 8, 4, 1152, 16, 4, moe::Dtype::kFp8},
                     moe::Quantize::kPow2},
        QuantizeCase{{{"shm", 1, false}, 4, 2, 16, 6, 1024, 16, 0, moe::Dtype::kFp8},
                     moe::Quantize::kPow2}),
    [](const ::testing::TestParamInfo<QuantizeCase>& info) {
      return moe_case_name(::testing::TestParamInfo<MoeCase>(info.param.moe, info.index)) +
             (info.param.quantize == moe::Quantize::kAmax ? "_amax" : "_pow2");
    });

// A rank that stops taking part (before step 2's dispatch, or between its dispatch and combine):
// every other rank's receive half fails in bounded time (the 2 s timeout; asserted loosely, under
// 30 s, so that a loaded sanitizer run passes) naming it, leaves its outputs marked
// invalid (counts = kInvalidCount, combine out = NaN), and the failed AllToAll refuses later calls.
class MoeFailure : public ::testing::TestWithParam<bool> {};

TEST_P(MoeFailure, ARankThatStopsMidJobFailsEveryOtherRankInBoundedTimeNamingIt) {
  const bool at_combine = GetParam();
  const MoeCase mc{{"tcp;ofi_rxm", 1, false}, 4, 2, 16, 4, 2048, 8, 2, moe::Dtype::kFp8};
  ThreadGather gather(mc.ranks);
  const std::vector<std::unique_ptr<TransferEngine>> engines = engines_for(mc);
  std::vector<std::string> errors(mc.ranks);
  std::vector<double> seconds(mc.ranks, 0);
  std::atomic<int> done{0};
  auto rank_main = [&](uint32_t r) {
    AllToAllConfig cfg = config_of(mc, r, "moe-dead");
    cfg.timeout = std::chrono::milliseconds(2000);
    cfg.buffers = 1;  // step 2 reuses step 1's buffers: its stale outputs must not survive
    AllToAll a2a(*engines[r], cfg, gather.for_rank(r));
    // Alive (its engine and regions too), sending nothing more, until the others have failed;
    // if they never do, the assertions below say so after 60 s instead of ctest's timeout.
    auto wait_for_the_others = [&] {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (done.load() < 3 && std::chrono::steady_clock::now() < give_up)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    };
    for (uint32_t step = 1; step <= 2; ++step) {
      std::vector<ReferenceInput> inputs;
      for (uint32_t s = 0; s < mc.ranks; ++s) inputs.push_back(make_input(cfg, s, step));
      const bool stops_here = r == 3 && step == 2;
      if (stops_here && !at_combine) return wait_for_the_others();
      const ReferenceInput& in = inputs[r];
      const moe::DispatchArgs args{.num_tokens = in.num_tokens,
                                   .x = in.x.data(),
                                   .x_scales = in.x_scales.data(),
                                   .topk_idx = in.topk_idx.data()};
      std::vector<uint16_t> out(uint64_t{in.num_tokens} * mc.hidden, 0);
      const auto t0 = std::chrono::steady_clock::now();
      const moe::Handle h = a2a.dispatch_send(args);
      const moe::DispatchOutput o = a2a.output(h);
      try {
        a2a.dispatch_recv(h);
        if (stops_here) return wait_for_the_others();
        std::vector<uint16_t> y(uint64_t{o.local_experts} * o.rows_per_expert * mc.hidden, 0);
        a2a.combine(
            h, {.expert_out = y.data(), .topk_weights = in.topk_weights.data(), .out = out.data()});
      } catch (const Error& e) {
        seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        errors[r] = std::string(to_string(e.code())) + " | " + e.what();
        // Nothing plausible is left in place: step 1's counts, zeros in out.
        if (at_combine) {
          for (size_t i = 0; i < out.size(); ++i)
            if (out[i] != moe::kInvalidBf16) {
              errors[r] += fmt::format(" | out[{}] = {:#x} after the failure", i, out[i]);
              break;
            }
        } else {
          for (uint32_t el = 0; el < o.local_experts; ++el)
            if (o.counts[el] != moe::kInvalidCount)
              errors[r] += fmt::format(" | counts[{}] = {} after the failure", el, o.counts[el]);
          for (uint32_t i = 0; i < o.local_experts * mc.ranks; ++i)
            if (o.runs[i] != moe::kInvalidRun)
              errors[r] += fmt::format(" | runs[{}] = {:#x} after the failure", i, o.runs[i]);
        }
        expect_error(ErrorCode::kInvalidArgument, "failed earlier",
                     [&] { a2a.dispatch_send(args); });
        expect_error(ErrorCode::kInvalidArgument, "failed earlier", [&] { a2a.check(); });
        done.fetch_add(1);
        return;
      }
    }
    done.fetch_add(1);
  };
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < mc.ranks; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  for (uint32_t r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("ranks [3]"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find(at_combine ? "MoE combine step 2" : "MoE dispatch step 2"),
              std::string::npos)
        << errors[r];
    EXPECT_EQ(errors[r].find("after the failure"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_TRUE(errors[r].starts_with("timeout") || errors[r].starts_with("provider")) << errors[r];
    EXPECT_LT(seconds[r], 30.0) << "rank " << r << " took too long to fail";
  }
}

INSTANTIATE_TEST_SUITE_P(Loopback, MoeFailure, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "AtCombine" : "AtDispatch";
                         });

// Shrink mode (DeepEP's enable_shrink): rank 3 stops taking part before step 2 (alive and
// silent). The others mask it after one timeout at step 2's dispatch receive, go on without it,
// and steps 2-4 are exact against the reference of the survivors' routing: rank 3 sends nothing,
// and the slots the survivors routed to its experts are left out of combine (weight zero) at step
// 2 and not sent at all from step 3 on. Over tcp, 2 nodes of 2: a node-mate (rank 2) and two
// ranks of the other node (through the proxy) lose it. Then set_masked unmasks and masks.
TEST(MoeShrink, ARankThatStopsIsMaskedAfterOneTimeoutAndTheOthersStayExact) {
  const MoeCase mc{{"tcp;ofi_rxm", 1, false}, 4, 2, 16, 4, 512, 8, 2, moe::Dtype::kBf16};
  constexpr uint32_t kGone = 3, kSteps = 4;
  ThreadGather gather(mc.ranks);
  const std::vector<std::unique_ptr<TransferEngine>> engines = engines_for(mc);
  std::vector<std::vector<uint16_t>> expert_outs(mc.ranks);
  // Rank 3's expert outputs are never read from step 2 on (no slot names its experts).
  expert_outs[kGone].assign(uint64_t{mc.experts} * mc.max_tokens * mc.hidden, 0);
  std::barrier sync(static_cast<std::ptrdiff_t>(mc.ranks));
  // A rank that failed has dropped out of `sync`, and its expert outputs may never have come: the
  // others stop instead of reading them (they read a failed rank's empty vector and crashed).
  std::atomic<bool> failed{false};
  auto rank_main = [&](uint32_t r) -> std::string {
    AllToAllConfig cfg = config_of(mc, r, "moe-shrink");
    // Long enough for a step of 4 ranks under TSan on a loaded 2-core machine (1.5 s was not):
    // only step 2 waits it out, for rank 3.
    cfg.timeout = std::chrono::milliseconds(5000);
    cfg.shrink = true;
    AllToAll a2a(*engines[r], cfg, gather.for_rank(r));
    for (uint32_t step = 1; step <= kSteps; ++step) {
      std::vector<ReferenceInput> inputs;
      for (uint32_t s = 0; s < mc.ranks; ++s) inputs.push_back(make_input(cfg, s, step));
      if (r == kGone && step == 2) {
        sync.arrive_and_drop();  // silent from here on; its engine and regions stay
        return "";
      }
      // What the survivors' outputs must equal: rank 3 sends nothing, and (for combine) no slot
      // names one of its experts.
      std::vector<ReferenceInput> survivors = inputs;
      if (step >= 2) {
        survivors[kGone] = ReferenceInput{};
        for (ReferenceInput& in : survivors)
          for (int64_t& e : in.topk_idx)
            if (e >= 0 && static_cast<uint32_t>(e) / (mc.experts / mc.ranks) == kGone) e = -1;
      }
      const ReferenceInput& in = inputs[r];
      const auto t0 = std::chrono::steady_clock::now();
      const moe::Handle h = a2a.dispatch({.num_tokens = in.num_tokens, .x = in.x.data(), .topk_idx = in.topk_idx.data()});
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (step == 2 && (a2a.masked_ranks() != std::vector<uint32_t>{kGone} || waited > 30))
        return fmt::format("step 2: masked {} after {:.1f} s", fmt::join(a2a.masked_ranks(), ","), waited);
      const moe::DispatchOutput o = a2a.output(h);
      const moe::ReferenceDispatch want = moe::reference_dispatch(cfg, survivors)[r];
      const uint64_t M = o.rows_per_expert, row = 2ull * mc.hidden;
      for (uint32_t el = 0; el < o.local_experts; ++el)
        if (o.counts[el] != want.counts[el] ||
            std::memcmp(static_cast<const std::byte*>(o.x) + el * M * row, want.x.data() + el * M * row,
                        uint64_t(want.counts[el]) * row) != 0 ||
            std::memcmp(o.src + el * M, want.src.data() + el * M, uint64_t(want.counts[el]) * 4) != 0)
          return fmt::format("step {}: expert {}'s rows differ from the survivors' reference", step, el);
      expert_outs[r] = expert_output(cfg, r, o);
      sync.arrive_and_wait();  // every survivor's expert outputs are in
      if (failed.load()) return fmt::format("step {}: another rank failed", step);
      const std::vector<uint16_t> want_out = moe::reference_combine(cfg, survivors, r, expert_outs);
      sync.arrive_and_wait();
      std::vector<uint16_t> out(uint64_t{in.num_tokens} * mc.hidden, 0xFFFF);
      a2a.combine(h, {.expert_out = expert_outs[r].data(), .topk_weights = in.topk_weights.data(), .out = out.data()});
      if (out != want_out) return fmt::format("step {}: combine differs from the survivors' reference", step);
    }
    a2a.set_masked(kGone, false);
    if (!a2a.masked_ranks().empty()) return "set_masked(3, false) left it masked";
    a2a.set_masked(kGone, true);
    if (a2a.masked_ranks() != std::vector<uint32_t>{kGone}) return "set_masked(3, true) did not mask it";
    a2a.check();  // not failed
    return "";
  };
  const std::vector<std::string> failures = on_rank_threads(mc.ranks, rank_main, [&] {
    failed.store(true);
    sync.arrive_and_drop();
  });
  for (uint32_t r = 0; r < mc.ranks; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// Input the kernel side cannot run is refused before anything is written: the same AllToAll then
// runs a correct step. Calls out of order and mismatched ranks are refused with a clear error.
TEST(MoeErrors, BadInputIsRefusedAndLosesNothing) {
  const MoeCase mc{{"shm", 1, false}, 2, 2, 8, 2, 256, 4, 2, moe::Dtype::kBf16};
  ThreadGather gather(mc.ranks);
  const std::vector<std::unique_ptr<TransferEngine>> engines = engines_for(mc);
  std::vector<std::string> failures(mc.ranks);
  auto rank_main = [&](uint32_t r) {
    const AllToAllConfig cfg = config_of(mc, r, "moe-errors");
    AllToAll a2a(*engines[r], cfg, gather.for_rank(r));
    std::vector<ReferenceInput> inputs;
    for (uint32_t s = 0; s < mc.ranks; ++s) inputs.push_back(make_input(cfg, s, 1));
    ReferenceInput in = inputs[r];
    const moe::DispatchArgs good{
        .num_tokens = in.num_tokens, .x = in.x.data(), .topk_idx = in.topk_idx.data()};
    std::vector<uint16_t> out(uint64_t{in.num_tokens} * mc.hidden);
    const moe::CombineArgs cargs{
        .expert_out = out.data(), .topk_weights = in.topk_weights.data(), .out = out.data()};
    expect_error(ErrorCode::kInvalidArgument, "not a handle of this AllToAll",
                 [&] { a2a.combine({}, cargs); });
    expect_error(ErrorCode::kInvalidArgument, "not a handle of this AllToAll",
                 [&] { a2a.combine(moe::Handle{.buffer = 0, .step = 1}, cargs); });
    moe::DispatchArgs a = good;
    if (r == 0) {  // rank 0 always has max_tokens tokens
      std::vector<int64_t> bad = in.topk_idx;
      bad[0] = 8;
      a.topk_idx = bad.data();
      expect_error(ErrorCode::kInvalidArgument, "not below experts 8", [&] { a2a.dispatch(a); });
      bad[0] = bad[1] = 3;
      expect_error(ErrorCode::kInvalidArgument, "names expert 3 in slots 0 and 1",
                   [&] { a2a.dispatch(a); });
      a = good;
    }
    a.num_tokens = 5;
    expect_error(ErrorCode::kInvalidArgument, "more than max_tokens 4", [&] { a2a.dispatch(a); });
    a = good;
    a.quantize = moe::Quantize::kAmax;
    expect_error(ErrorCode::kInvalidArgument, "quantize is for an FP8 dispatch",
                 [&] { a2a.dispatch(a); });
    a.quantize = static_cast<moe::Quantize>(7);
    expect_error(ErrorCode::kInvalidArgument, "not a Quantize value", [&] { a2a.dispatch(a); });
    a = good;
    const moe::Handle h = a2a.dispatch_send(good);
    // Calls out of order for a handle are refused and change nothing.
    expect_error(ErrorCode::kInvalidArgument,
                 "out of order for dispatch 1 (it is at 'dispatch sent'",
                 [&] { a2a.combine(h, cargs); });
    expect_error(ErrorCode::kInvalidArgument, "not a handle of this AllToAll",
                 [&] { a2a.dispatch_recv(moe::Handle{.buffer = 1, .step = 1}); });
    // A second dispatch takes the other buffer set; a third would take the first's, whose peers'
    // rows may still be landing: refused until the first is received.
    const moe::Handle h2 = a2a.dispatch_send(good);
    if (h2.buffer != 1 || h2.step != 2)
      failures[r] = fmt::format("second handle: set {} step {}", h2.buffer, h2.step);
    expect_error(ErrorCode::kInvalidArgument,
                 "at most 2 dispatches in flight (buffers = 2); dispatch 1 holds buffer set 0 at "
                 "'dispatch sent': receive it",
                 [&] { a2a.dispatch_send(good); });
    a2a.dispatch_recv(h);
    expect_error(ErrorCode::kInvalidArgument, "out of order for dispatch 1 (it is at 'dispatched'",
                 [&] { a2a.dispatch_recv(h); });
    expect_error(ErrorCode::kInvalidArgument, "out of order for dispatch 1",
                 [&] { a2a.combine_recv(h, cargs); });
    a2a.dispatch_recv(h2);
    if (in.num_tokens > 0)
      expect_error(ErrorCode::kInvalidArgument, "out and topk_weights",
                   [&] { a2a.combine(h2, {.expert_out = out.data()}); });
    const moe::DispatchOutput o = a2a.output(h);
    const moe::ReferenceDispatch want = moe::reference_dispatch(cfg, inputs)[r];
    for (uint32_t el = 0; el < o.local_experts; ++el)
      if (o.counts[el] != want.counts[el] ||
          std::memcmp(o.x, want.x.data(), uint64_t(want.counts[el]) * 2 * mc.hidden) != 0)
        failures[r] = "the step after refused input differs from the reference";
    std::vector<uint16_t> y(uint64_t{o.local_experts} * o.rows_per_expert * mc.hidden, 0);
    a2a.combine(
        h2, {.expert_out = y.data(), .topk_weights = in.topk_weights.data(), .out = out.data()});
    a2a.combine(
        h, {.expert_out = y.data(), .topk_weights = in.topk_weights.data(), .out = out.data()});
    expect_error(ErrorCode::kInvalidArgument, "out of order for dispatch 1 (it is at 'dispatched'",
                 [&] { a2a.combine_recv(h, cargs); });
    // The next dispatch reuses set 0: dispatch 1's handle is spent for good.
    const moe::Handle h3 = a2a.dispatch(good);
    expect_error(
        ErrorCode::kInvalidArgument,
        "the handle of dispatch 1 is spent (dispatch 3 took its buffer set 0: a handle is valid until its set is taken, 2 dispatches later)",
        [&] { a2a.combine(h, cargs); });
    a2a.combine(
        h3, {.expert_out = y.data(), .topk_weights = in.topk_weights.data(), .out = out.data()});
    // A dispatch that is never combined is dropped when its set is next needed (as DeepEP's
    // alternating buffers): dispatch 4 (set 1) is dropped by dispatch 6; 5 and 6 are exact.
    const moe::Handle h4 = a2a.dispatch(good);
    const moe::Handle h5 = a2a.dispatch(good);
    const moe::Handle h6 = a2a.dispatch(good);
    if (h6.buffer != h4.buffer) failures[r] = fmt::format("dispatch 6 took set {}", h6.buffer);
    expect_error(ErrorCode::kInvalidArgument,
                 "the handle of dispatch 4 is spent (dispatch 6 took its buffer set 1",
                 [&] { a2a.combine(h4, cargs); });
    for (const moe::Handle& hh : {h5, h6}) {
      const moe::DispatchOutput o6 = a2a.output(hh);
      for (uint32_t el = 0; el < o6.local_experts; ++el)
        if (o6.counts[el] != want.counts[el] ||
            std::memcmp(o6.x, want.x.data(), uint64_t(want.counts[el]) * 2 * mc.hidden) != 0)
          failures[r] = fmt::format("dispatch {} after a dropped one differs from the reference", hh.step);
      std::vector<uint16_t> got(uint64_t{in.num_tokens} * mc.hidden, 1);
      a2a.combine(hh, {.expert_out = y.data(), .topk_weights = in.topk_weights.data(), .out = got.data()});
      if (got != std::vector<uint16_t>(got.size(), 0))  // the zero expert outputs, summed
        failures[r] = fmt::format("combine {} after a dropped dispatch is not zero", hh.step);
    }
  };
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < mc.ranks; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  for (uint32_t r = 0; r < mc.ranks; ++r) EXPECT_EQ(failures[r], "");

  TransferEngine engine(config_for(mc.provider));
  AllToAllConfig cfg = config_of(mc, 0, "moe-bad");
  cfg.experts = 7;
  expect_error(ErrorCode::kInvalidArgument, "experts 7: a positive multiple of ranks 2",
               [&] { AllToAll(engine, cfg, {}); });
  cfg = config_of(mc, 0, "moe-bad");
  cfg.node_size = 3;
  expect_error(ErrorCode::kInvalidArgument, "node_size 3", [&] { AllToAll(engine, cfg, {}); });
  cfg = config_of(mc, 0, "bad/job");
  expect_error(ErrorCode::kInvalidArgument, "job 'bad/job'", [&] { AllToAll(engine, cfg, {}); });
  cfg = config_of(mc, 0, "moe-bad");
  cfg.buffers = 5;
  expect_error(ErrorCode::kInvalidArgument, "buffers 5 (1 to 4)",
               [&] { AllToAll(engine, cfg, {}); });
  cfg.buffers = 0;
  expect_error(ErrorCode::kInvalidArgument, "buffers 0 (1 to 4)",
               [&] { AllToAll(engine, cfg, {}); });
  cfg = config_of(mc, 0, "moe-bad");
  cfg.imm_base = 0xF0000000u;
  expect_error(ErrorCode::kInvalidArgument, "do not fit below 2^32",
               [&] { AllToAll(engine, cfg, {}); });
  cfg = config_of(mc, 0, "moe-bad");
  cfg.ranks = 4096, cfg.experts = 4096, cfg.max_tokens = 65536, cfg.topk = 8;
  expect_error(ErrorCode::kInvalidArgument, "must stay below 2^31", [&] { AllToAll(engine, cfg, {}); });
  cfg = config_of(mc, 0, "moe-bad");
  cfg.rdma_buffers = moe::RdmaBuffers::kDevice;
  expect_error(ErrorCode::kInvalidArgument, "rdma_buffers kDevice needs side kCuda",
               [&] { AllToAll(engine, cfg, {}); });
}

TEST(MoeErrors, RanksBuiltWithOtherDimensionsAreRefusedByName) {
  const MoeCase mc{{"shm", 1, false}, 2, 2, 8, 2, 256, 4, 2, moe::Dtype::kBf16};
  ThreadGather gather(mc.ranks);
  TransferEngine e0(config_for(mc.provider)), e1(config_for(mc.provider));
  std::vector<std::string> errors(2);
  auto rank_main = [&](uint32_t r, TransferEngine& e) {
    AllToAllConfig cfg = config_of(mc, r, "moe-dims");
    if (r == 1) cfg.hidden = 512;
    try {
      AllToAll a2a(e, cfg, gather.for_rank(r));
    } catch (const Error& err) {
      errors[r] = err.what();
    }
  };
  std::thread t0(rank_main, 0, std::ref(e0)), t1(rank_main, 1, std::ref(e1));
  t0.join();
  t1.join();
  EXPECT_NE(errors[0].find("rank 1 was built with other dimensions"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 0 was built with other dimensions"), std::string::npos)
      << errors[1];
}

}  // namespace
}  // namespace fabric::testing
