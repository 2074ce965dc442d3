// WeightReceiver (include/fabric/weights/update.h): an inference rank counts each source rank's
// immediates for a step, as many as the schedule says that rank writes to it.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <mutex>
#include <thread>

#include "fabric/error.h"
#include "fabric/weights/update.h"
#include "schedule.h"
#include "weights_stats.h"

namespace fabric::weights {

namespace {

using Clock = std::chrono::steady_clock;

struct Armed {
  std::shared_ptr<std::vector<std::atomic<int>>> flags;  // per source rank
  std::vector<ImmExpectation> expectations;
};

}  // namespace

struct WeightReceiver::State {
  TransferEngine& engine;
  WeightReceiverConfig cfg;
  ImmReservation& imms;  // this rank's: the training ranks' data WRITEs are counted there
  std::vector<uint64_t> expected;  // per training rank: immediates it sends here each step
  uint64_t step_bytes = 0;         // what the plan writes into this rank each step
  detail::ReceiverStats stats;
  std::vector<RemoteMr> sources;   // per training rank
  std::mutex mu;
  std::map<uint64_t, Armed> armed;      // by step
  std::map<uint32_t, uint64_t> failed;  // step tag -> the failed step
  MetricsRegistration metrics;          // last: removed before what its source reads

  State(TransferEngine& e, WeightReceiverConfig c) : engine(e), cfg(std::move(c)), imms(*cfg.imms) {}
};

WeightReceiver::WeightReceiver(TransferEngine& engine, WeightReceiverConfig config) {
  if (!config.plan) throw Error(ErrorCode::kInvalidArgument, "WeightReceiver: no plan");
  const uint32_t ranks = config.plan->gather_manifest.src_ranks, dsts = config.plan->send_manifest.dst_ranks;
  if (config.rank >= dsts)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightReceiver: rank {} of {} inference ranks", config.rank, dsts));
  if (config.sets != 1 && config.sets != 2)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightReceiver: {} buffer sets (1 or 2)", config.sets));
  if (ranks > kMaxUpdateRanks || dsts > kMaxUpdateRanks)
    throw Error(ErrorCode::kInvalidArgument, "WeightReceiver: more ranks than the immediates can name");
  detail::checked_imms(config.imms, "WeightReceiver");
  s_ = std::make_unique<State>(engine, std::move(config));
  State& s = *s_;
  s.expected.assign(ranks, 0);
  // The window does not change what lands here, only when: any window gives the same counts.
  const detail::Schedule sched = detail::schedule_update(s.cfg.plan, 1);
  for (const detail::ScheduledWrite& w : sched.send)
    if (w.dst_rank == s.cfg.rank) {
      s.expected[w.src_rank] += single_write_imm_count(w.len, engine.nic_count(), false);
      s.step_bytes += w.len;
    }
  set_sources(s.cfg.train_arenas);
  s.metrics = engine.add_metrics_source([st = &s](MetricsWriter& w) { write_metrics(w, st->stats, st->cfg.rank); });
}

WeightReceiver::~WeightReceiver() {
  if (!s_) return;
  for (auto& [step, a] : s_->armed)
    for (const ImmExpectation& e : a.expectations) s_->engine.cancel_imm_expectation(e);
}

void WeightReceiver::set_sources(std::vector<MrDesc> train_arenas) {
  State& s = *s_;
  if (train_arenas.size() != s.expected.size())
    throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightReceiver: {} training arenas for {} ranks",
                                                         train_arenas.size(), s.expected.size()));
  std::vector<RemoteMr> interned;
  for (const MrDesc& d : train_arenas) interned.push_back(s.engine.add_remote(d));
  std::lock_guard lock(s.mu);
  s.sources = std::move(interned);
  s.cfg.train_arenas = std::move(train_arenas);
}

uint64_t WeightReceiver::expected_writes() const {
  uint64_t n = 0;
  for (uint64_t e : s_->expected) n += e;
  return n;
}

void WeightReceiver::ready(uint64_t step) {
  State& s = *s_;
  std::vector<RemoteMr> notify;
  {
    std::lock_guard lock(s.mu);
    const uint32_t tag = update_imm(ImmKind::kData, step, 0);
    if (s.armed.count(step)) throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightReceiver: step {} is already ready", step));
    if (auto f = s.failed.find(tag); f != s.failed.end()) {
      if (f->second == step)
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("WeightReceiver: step {} failed; retry it under a new step number", step));
      // The same tag 2^kUpdateStepBits steps later: the failed step's late immediates are long in, drop them.
      for (uint32_t r = 0; r < s.expected.size(); r++) s.imms.discard(update_imm(ImmKind::kData, step, r));
      s.failed.erase(f);
    }
    for (const auto& [other, a] : s.armed)
      if (update_imm(ImmKind::kData, other, 0) == tag)
        throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightReceiver: steps {} and {} share a tag", other, step));
    Armed a;
    a.flags = std::make_shared<std::vector<std::atomic<int>>>(s.expected.size());
    for (uint32_t r = 0; r < s.expected.size(); r++) {
      if (s.expected[r] == 0) {
        (*a.flags)[r].store(kDoneSucceeded);
        continue;
      }
      a.expectations.push_back(s.imms.expect(update_imm(ImmKind::kData, step, r), s.expected[r],
                                             OnDone::flag(&(*a.flags)[r]).keep_alive(a.flags)));
      notify.push_back(s.sources[r]);
    }
    s.armed.emplace(step, std::move(a));
  }
  if (!notify.empty())
    s.engine.submit(Barrier{.dsts = notify, .imm = update_imm(ImmKind::kReady, step, s.cfg.rank)}, OnDone::none());
}

void WeightReceiver::wait_update(uint64_t step, std::chrono::milliseconds timeout) {
  State& s = *s_;
  std::shared_ptr<std::vector<std::atomic<int>>> flags;
  {
    std::lock_guard lock(s.mu);
    auto it = s.armed.find(step);
    if (it == s.armed.end())
      throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightReceiver: step {} was not made ready", step));
    flags = it->second.flags;
  }
  const auto deadline = Clock::now() + timeout;
  auto missing = [&] {
    std::vector<uint32_t> m;
    for (uint32_t r = 0; r < flags->size(); r++)
      if ((*flags)[r].load(std::memory_order_acquire) != kDoneSucceeded) m.push_back(r);
    return m;
  };
  for (;;) {
    std::vector<uint32_t> m = missing();
    if (m.empty()) break;
    if (Clock::now() > deadline) {
      std::lock_guard lock(s.mu);
      Armed& a = s.armed.at(step);
      for (const ImmExpectation& e : a.expectations) s.engine.cancel_imm_expectation(e);
      for (uint32_t r : m) s.imms.discard(update_imm(ImmKind::kData, step, r));
      s.failed[update_imm(ImmKind::kData, step, 0)] = step;
      s.armed.erase(step);
      s.stats.failed.add();
      throw Error(ErrorCode::kTimeout,
                  fmt::format("weight update step {} on inference rank {}: after {} ms, writes are missing from "
                              "training ranks {}",
                              step, s.cfg.rank, timeout.count(), fmt::join(m, ", ")));
    }
    // The flags are notified by the worker; a short sleep keeps this thread off a busy core.
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  std::lock_guard lock(s.mu);
  s.armed.erase(step);
  s.stats.updates.add();
  s.stats.bytes.add(s.step_bytes);
}

}  // namespace fabric::weights
