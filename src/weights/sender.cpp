// WeightSender (include/fabric/weights_update.h): one training rank's side of a step, as a
// non-blocking loop over four kinds of work that become possible as immediates arrive: gather
// WRITEs whose slot was released, BF16 WRITEs to inference ranks that are ready, the next unit to
// quantize, and that unit's FP8 WRITEs.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "fabric/error.h"
#include "fabric/fp8.h"
#include "fabric/weights_update.h"
#include "schedule.h"

namespace fabric::weights {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

void host_hook(std::byte* arena, const UnitWork& w) {
  for (const Copy& c : w.local_copies)
    for (uint64_t i = 0; i < c.rows; i++)
      std::memcpy(arena + c.dst_offset + i * c.dst_stride, arena + c.src_offset + i * c.src_stride, c.row_bytes);
  const QuantizeTask& q = w.task;
  const uint64_t rows = q.r1 - q.r0;
  const uint64_t in_len = (rows - 1) * (q.in_stride / 2) + w.cols;
  fp8::quantize_blocks({.in = {reinterpret_cast<const uint16_t*>(arena + q.in_offset), in_len},
                        .rows = rows,
                        .cols = w.cols,
                        .in_stride = q.in_stride / 2,
                        .out = {reinterpret_cast<uint8_t*>(arena + q.out_offset), rows * w.cols},
                        .out_stride = 0,
                        .scales = {reinterpret_cast<float*>(arena + q.scale_offset),
                                   fp8::scale_rows(rows) * fp8::scale_cols(w.cols)}});
}

// What one update's completions report into; every OnDone keeps it alive, so late completions
// of a failed update land in it, not in freed memory.
struct Progress {
  std::vector<std::atomic<int>> ready;          // per inference rank
  std::vector<std::atomic<int>> gathered;       // per own unit
  std::vector<std::atomic<uint64_t>> credits;   // per training rank (credits it gave us)
  std::vector<std::atomic<uint64_t>> slot_done;  // per slot: completed sends of its units
  std::atomic<uint64_t> done{0}, failed{0};     // gathers, BF16 sends and barriers
  std::atomic<uint64_t> slot_failed{0};
  Progress(size_t dsts, size_t units, size_t srcs, size_t slots)
      : ready(dsts), gathered(units), credits(srcs), slot_done(slots) {}
};

}  // namespace

std::vector<uint64_t> staging_bytes_for(const UpdatePlan& plan, uint32_t window) {
  auto shared = std::shared_ptr<const UpdatePlan>(&plan, [](const UpdatePlan*) {});  // not owned
  const detail::Schedule s = detail::schedule_update(shared, window);
  std::vector<uint64_t> out;
  for (const detail::RankSchedule& r : s.ranks) out.push_back(std::min<uint64_t>(window, r.units.size()) * r.slot_bytes);
  return out;
}

struct WeightSender::State {
  TransferEngine& engine;
  WeightSenderConfig cfg;
  detail::Schedule sched;
  const detail::RankSchedule& me;
  std::vector<RemoteMr> train;                 // per training rank
  std::vector<std::vector<RemoteMr>> dest;     // [set][inference rank]
  std::vector<uint32_t> my_dsts;               // inference ranks this rank writes to
  std::vector<std::vector<uint32_t>> credit_units;  // per quantizer: the units of its we fill, in order
  std::vector<std::vector<RemoteMr>> unit_contributors;  // per own unit
  std::vector<std::vector<uint32_t>> unit_dsts;          // per own unit: inference ranks its sends reach
  std::vector<std::vector<uint32_t>> bf16_by_dst;        // per inference rank: indices into sched.send

  State(TransferEngine& e, WeightSenderConfig c)
      : engine(e), cfg(std::move(c)), sched(detail::schedule_update(cfg.plan, cfg.window)), me(sched.ranks.at(cfg.rank)) {}

  size_t imms(uint64_t len) const { return single_write_imm_count(len, engine.nic_count(), false); }

  void post(const detail::ScheduledWrite& w, RemoteMr dst, uint32_t imm, OnDone done) {
    engine.submit(SingleWrite{.len = w.len, .src = {cfg.arena, w.src_offset}, .dst = {dst, w.dst_offset}, .imm = imm},
                  std::move(done));
  }
};

WeightSender::WeightSender(TransferEngine& engine, WeightSenderConfig config) {
  if (!config.plan) throw Error(ErrorCode::kInvalidArgument, "WeightSender: no plan");
  const uint32_t ranks = config.plan->gather_manifest.src_ranks, dsts = config.plan->send_manifest.dst_ranks;
  if (config.rank >= ranks)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightSender: rank {} of {} training ranks", config.rank, ranks));
  if (ranks > kMaxUpdateRanks || dsts > kMaxUpdateRanks)
    throw Error(ErrorCode::kInvalidArgument, "WeightSender: more ranks than the immediates can name");
  if (config.train_arenas.size() != ranks)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightSender: {} training arenas for {} ranks",
                                                         config.train_arenas.size(), ranks));
  if (config.dest_arenas.empty() || config.dest_arenas.size() > 2)
    throw Error(ErrorCode::kInvalidArgument, "WeightSender: one or two buffer sets of inference arenas");
  for (const auto& set : config.dest_arenas)
    if (set.size() != dsts)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("WeightSender: a buffer set of {} arenas for {} inference ranks", set.size(), dsts));
  if (!config.hook && !config.arena_ptr)
    throw Error(ErrorCode::kInvalidArgument, "WeightSender: no hook and no host pointer to the arena");
  s_ = std::make_unique<State>(engine, std::move(config));
  State& s = *s_;
  for (const MrDesc& d : s.cfg.train_arenas) s.train.push_back(engine.add_remote(d));
  for (const auto& set : s.cfg.dest_arenas) {
    s.dest.emplace_back();
    for (const MrDesc& d : set) s.dest.back().push_back(engine.add_remote(d));
  }
  const uint32_t me = s.cfg.rank;
  s.credit_units.resize(ranks);
  for (uint32_t i : s.me.gather_out) {
    const detail::ScheduledWrite& w = s.sched.gather[i];
    auto& units = s.credit_units[w.dst_rank];
    if (units.empty() || units.back() != w.unit) units.push_back(w.unit);
  }
  s.bf16_by_dst.resize(dsts);
  std::vector<bool> writes_to(dsts, false);
  for (uint32_t i : s.me.bf16_out) {
    s.bf16_by_dst[s.sched.send[i].dst_rank].push_back(i);
    writes_to[s.sched.send[i].dst_rank] = true;
  }
  for (const detail::ScheduledUnit& u : s.me.units) {
    s.unit_contributors.emplace_back();
    for (uint32_t g : u.contributors) s.unit_contributors.back().push_back(s.train[g]);
    s.unit_dsts.emplace_back();
    for (uint32_t i : u.send_writes) {
      const uint32_t d = s.sched.send[i].dst_rank;
      writes_to[d] = true;
      if (std::find(s.unit_dsts.back().begin(), s.unit_dsts.back().end(), d) == s.unit_dsts.back().end())
        s.unit_dsts.back().push_back(d);
    }
  }
  for (uint32_t d = 0; d < dsts; d++)
    if (writes_to[d]) s.my_dsts.push_back(d);
  (void)me;
}

WeightSender::~WeightSender() = default;

UpdateTimes WeightSender::update(uint64_t step) {
  State& s = *s_;
  const auto t0 = Clock::now();
  const auto deadline = t0 + s.cfg.timeout;
  const uint32_t me = s.cfg.rank, window = s.sched.window;
  const size_t units = s.me.units.size(), ranks = s.train.size();
  const std::vector<RemoteMr>& dest = s.dest[step % s.dest.size()];
  auto progress = std::make_shared<Progress>(s.dest.front().size(), units, ranks, std::min<size_t>(window, units));
  Progress& pr = *progress;
  auto keep = [&](OnDone d) { return std::move(d).keep_alive(progress); };
  std::vector<ImmExpectation> armed;
  UpdateTimes times;
  uint64_t posted = 0;                                  // gathers, BF16 sends and barriers
  std::vector<uint64_t> slot_posted(pr.slot_done.size(), 0);

  auto expect = [&](uint32_t imm, uint64_t count, OnDone done) {
    armed.push_back(s.engine.expect_imm_count(imm, count, keep(std::move(done))));
  };
  auto credit = [&](uint32_t unit) {  // tells the unit's contributors its slot is free
    if (unit >= units || s.unit_contributors[unit].empty()) return;
    s.engine.submit(Barrier{.dsts = s.unit_contributors[unit], .imm = update_imm(ImmKind::kCredit, step, me)},
                    keep(OnDone::counter(&pr.done, &pr.failed)));
    posted++;
  };
  try {
    for (uint32_t d : s.my_dsts) expect(update_imm(ImmKind::kReady, step, d), 1, OnDone::flag(&pr.ready[d]));
    for (uint32_t u = 0; u < units; u++) {
      uint64_t count = 0;
      for (uint32_t i : s.me.units[u].gather_writes) count += s.imms(s.sched.gather[i].len);
      if (count == 0) pr.gathered[u].store(kDoneSucceeded);
      else expect(update_imm(ImmKind::kGather, step, u), count, OnDone::flag(&pr.gathered[u]));
    }
    for (uint32_t r = 0; r < ranks; r++)
      for (size_t k = 0; k < s.credit_units[r].size(); k++)
        expect(update_imm(ImmKind::kCredit, step, r), 1, OnDone::counter(&pr.credits[r]));
    for (uint32_t u = 0; u < std::min<size_t>(window, units); u++) credit(u);

    std::vector<size_t> next_credit_unit(ranks, 0);  // per quantizer: its units we have filled
    std::vector<size_t> gather_cursor(ranks, 0);     // scan position in gather_out per quantizer
    std::vector<bool> bf16_posted(s.bf16_by_dst.size(), false);
    // Our gather WRITEs, grouped by destination (gather_out is ordered by (dst, unit, offset)).
    std::vector<std::vector<uint32_t>> gather_to(ranks);
    for (uint32_t i : s.me.gather_out) gather_to[s.sched.gather[i].dst_rank].push_back(i);
    size_t next_unit = 0;
    auto ready = [&](uint32_t d) { return pr.ready[d].load(std::memory_order_acquire) == kDoneSucceeded; };
    Clock::time_point waiting_since = Clock::now();
    enum { kIdle, kGather, kReady, kSlot } waiting = kIdle;
    auto account_wait = [&] {
      const double w = ms_since(waiting_since);
      if (waiting == kGather) times.gather_wait_ms += w;
      if (waiting == kReady) times.ready_wait_ms += w;
      waiting = kIdle;
    };
    for (;;) {
      bool moved = false;
      if (pr.failed.load() || pr.slot_failed.load())
        throw Error(ErrorCode::kProvider, fmt::format("weight update step {}: a WRITE of training rank {} failed "
                                                       "(the log has its error)", step, me));
      // Gather WRITEs into slots the quantizers released.
      for (uint32_t r = 0; r < ranks; r++) {
        const uint64_t released = pr.credits[r].load(std::memory_order_acquire);
        while (next_credit_unit[r] < released && next_credit_unit[r] < s.credit_units[r].size()) {
          const uint32_t unit = s.credit_units[r][next_credit_unit[r]++];
          auto& list = gather_to[r];
          while (gather_cursor[r] < list.size() && s.sched.gather[list[gather_cursor[r]]].unit == unit) {
            const detail::ScheduledWrite& w = s.sched.gather[list[gather_cursor[r]++]];
            s.post(w, s.train[r], update_imm(ImmKind::kGather, step, unit), keep(OnDone::counter(&pr.done, &pr.failed)));
            posted++;
            times.writes++;
            times.bytes += w.len;
          }
          moved = true;
        }
      }
      // BF16 pieces straight from the shards, to every inference rank that is ready.
      for (uint32_t d = 0; d < s.bf16_by_dst.size(); d++) {
        if (bf16_posted[d] || s.bf16_by_dst[d].empty() || !ready(d)) continue;
        for (uint32_t i : s.bf16_by_dst[d]) {
          const detail::ScheduledWrite& w = s.sched.send[i];
          s.post(w, dest[d], update_imm(ImmKind::kData, step, me), keep(OnDone::counter(&pr.done, &pr.failed)));
          posted++;
          times.writes++;
          times.bytes += w.len;
        }
        bf16_posted[d] = true;
        moved = true;
      }
      // The next unit: its input complete, its slot's earlier sends done, its inference ranks ready.
      if (next_unit < units) {
        const uint32_t u = static_cast<uint32_t>(next_unit);
        const size_t slot = u % window;
        const bool in = pr.gathered[u].load(std::memory_order_acquire) == kDoneSucceeded;
        const bool free = pr.slot_done[slot].load(std::memory_order_acquire) == slot_posted[slot];
        const bool dsts_ready = std::all_of(s.unit_dsts[u].begin(), s.unit_dsts[u].end(), ready);
        if (pr.gathered[u].load() == kDoneFailed)
          throw Error(ErrorCode::kProvider, fmt::format("weight update step {}: gathering unit {} failed", step, u));
        if (in && free && dsts_ready) {
          account_wait();
          const detail::ScheduledUnit& su = s.me.units[u];
          const UnitWork work{su.task, s.cfg.plan->gather_manifest.tensors[su.task.tensor].cols, su.local_copies};
          const auto tq = Clock::now();
          if (s.cfg.hook) s.cfg.hook(work);
          else host_hook(s.cfg.arena_ptr, work);
          times.quantize_ms += ms_since(tq);
          credit(u + window);  // its input area may be refilled
          for (uint32_t i : su.send_writes) {
            const detail::ScheduledWrite& w = s.sched.send[i];
            s.post(w, dest[w.dst_rank], update_imm(ImmKind::kData, step, me),
                   keep(OnDone::counter(&pr.slot_done[slot], &pr.slot_failed)));
            slot_posted[slot]++;
            times.writes++;
            times.bytes += w.len;
          }
          next_unit++;
          moved = true;
        } else if (waiting == kIdle) {
          waiting = !in ? kGather : !dsts_ready ? kReady : kSlot;
          waiting_since = Clock::now();
        }
      }
      bool all_posted = next_unit == units;
      for (uint32_t r = 0; r < ranks; r++) all_posted &= gather_cursor[r] == gather_to[r].size();
      for (uint32_t d = 0; d < s.bf16_by_dst.size(); d++) all_posted &= bf16_posted[d] || s.bf16_by_dst[d].empty();
      if (all_posted) break;
      if (Clock::now() > deadline) {
        std::string what;
        if (next_unit < units) {
          const detail::ScheduledUnit& su = s.me.units[next_unit];
          const TensorSpec& t = s.cfg.plan->gather_manifest.tensors[su.task.tensor];
          what = fmt::format("unit {} ({} rows [{}, {})) waits for ", next_unit, t.name, su.task.r0, su.task.r1);
          if (pr.gathered[next_unit].load() != kDoneSucceeded)
            what += fmt::format("gather WRITEs from training ranks {}", fmt::join(su.contributors, ", "));
          else {
            std::vector<uint32_t> missing;
            for (uint32_t d : s.unit_dsts[next_unit])
              if (!ready(d)) missing.push_back(d);
            what += missing.empty() ? std::string("its slot's earlier WRITEs")
                                    : fmt::format("inference ranks {} to be ready", fmt::join(missing, ", "));
          }
        } else {
          std::vector<uint32_t> r_missing, d_missing;
          for (uint32_t r = 0; r < ranks; r++)
            if (gather_cursor[r] < gather_to[r].size()) r_missing.push_back(r);
          for (uint32_t d = 0; d < s.bf16_by_dst.size(); d++)
            if (!bf16_posted[d] && !s.bf16_by_dst[d].empty()) d_missing.push_back(d);
          if (!r_missing.empty()) what = fmt::format("slot credits from training ranks {}", fmt::join(r_missing, ", "));
          if (!d_missing.empty())
            what += fmt::format("{}inference ranks {} to be ready", what.empty() ? "" : "; ", fmt::join(d_missing, ", "));
        }
        throw Error(ErrorCode::kTimeout, fmt::format("weight update step {} on training rank {}: not done after {} ms: {}",
                                                     step, me, s.cfg.timeout.count(), what));
      }
      if (!moved) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    // Drain: every WRITE and barrier completed.
    const auto td = Clock::now();
    auto outstanding = [&] {
      uint64_t sends_left = 0;
      for (size_t k = 0; k < slot_posted.size(); k++) sends_left += slot_posted[k] - pr.slot_done[k].load();
      return pr.done.load() < posted || sends_left > 0;
    };
    while (outstanding()) {
      if (pr.failed.load() || pr.slot_failed.load())
        throw Error(ErrorCode::kProvider, fmt::format("weight update step {}: a WRITE of training rank {} failed "
                                                       "(the log has its error)", step, me));
      if (Clock::now() > deadline)
        throw Error(ErrorCode::kTimeout, fmt::format("weight update step {} on training rank {}: WRITEs not completed "
                                                     "after {} ms", step, me, s.cfg.timeout.count()));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    times.drain_ms = ms_since(td);
  } catch (...) {
    for (const ImmExpectation& e : armed) s.engine.cancel_imm_expectation(e);
    throw;
  }
  times.total_ms = ms_since(t0);
  return times;
}

}  // namespace fabric::weights
